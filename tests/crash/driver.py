"""The crash harness's process server: imports torch and nbkit once, then forks one fresh process per job.

Started by :class:`crash.harness.Server` as ``python tests/crash/driver.py``. It reads one job a line
(JSON) on stdin and answers one line on stdout: ``{"id", "exit", "reports"}``, where ``exit`` is the
child's exit status (137: it crashed itself) and ``reports`` the lines it sent on its report pipe.
A job names an operation of :data:`crash.operations.OPERATIONS` and what to do with it:

* ``"setup"``: build the state before the operation in ``work`` (no interposition);
* ``"run"``: run the operation in ``work``, with ``interpose`` true counting its file-system calls
  and, with ``crash_at`` k, killing itself just before the k-th (``power`` true: after rolling the
  file system back to what was durable, see :mod:`crash.interpose`; with ``keep_entries`` every
  directory entry made so far stays, only un-synced data is lost).

Each job runs in a child forked from this process, which has only imported modules: no nbkit
object, open file or thread exists before the fork, so each run starts as a new process would,
without paying two seconds of imports.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/: the harness is the package "crash"

#: A job that runs longer than this is killed (and reported as a hang).
JOB_SECONDS = 120


def _child(job: dict, report_fd: int) -> None:
    from crash import interpose
    from crash.operations import OPERATIONS
    from crash.toys import TOYS

    os.dup2(2, 1)  # the protocol is the server's stdout: a child's prints go to the log
    os.environ.update(job.get("env") or {})
    if job.get("tmpdir"):
        os.environ["TMPDIR"] = job["tmpdir"]
    tempfile.tempdir = None  # recomputed from TMPDIR
    op = OPERATIONS.get(job["op"]) or TOYS[job["op"]]
    work = job["work"]
    os.chdir(work)
    try:
        if job["kind"] == "setup":
            op.setup(work)
            interpose.send(report_fd, {"status": "done"})
        elif not job.get("interpose"):
            op.run(work)
            interpose.send(report_fd, {"status": "done"})
        else:
            rec = interpose.install(job.get("crash_at"), report_fd, power_loss=bool(job.get("power")),
                                    keep_entries=bool(job.get("keep_entries")),
                                    roots=[work], stash=job.get("stash"))
            try:
                op.run(work)
                if job.get("power"):
                    rec.end()
            finally:
                interpose.uninstall()
            interpose.send(report_fd, {"status": "done", "count": rec.count, "calls": rec.calls,
                                       "notes": rec.model.notes if rec.model else []})
    except BaseException as e:  # noqa: BLE001 - reported to the harness, which judges it
        interpose.send(report_fd, {"status": "error", "type": type(e).__name__, "error": str(e)[:2000],
                                   "traceback": traceback.format_exc()[-6000:]})
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _collect(pid: int, fd: int) -> tuple[int, list]:
    """Read the child's reports until it closes the pipe, then its exit status (killed after JOB_SECONDS)."""
    data, deadline = b"", time.monotonic() + JOB_SECONDS
    while True:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, left))
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1, [json.loads(x) for x in data.decode().splitlines() if x] + [{"status": "hang"}]
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code, [json.loads(x) for x in data.decode().splitlines() if x]


def main() -> None:
    import torch

    torch.set_num_threads(1)
    import fsspec.implementations.local
    import nbkit
    import nbkit.transfer.archive
    import nbkit.cacheloader
    import nbkit.disk
    import nbkit.transfer.sync
    from crash import operations, toys

    try:
        import nbkit.commit
    except ImportError:
        pass
    try:  # looked up once here (a subprocess running ldconfig), not in every child
        from nbkit.gather import fast_crc

        fast_crc()
    except (ImportError, OSError):
        pass
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    proto.write(json.dumps({"ready": os.getpid()}) + "\n")
    proto.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            _child(job, w)
        os.close(w)
        try:
            code, reports = _collect(pid, r)
        finally:
            os.close(r)
        proto.write(json.dumps({"id": job.get("id"), "exit": code, "reports": reports}) + "\n")
        proto.flush()


if __name__ == "__main__":
    main()
