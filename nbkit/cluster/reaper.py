"""Waiting for a driver's death, and ending what it started: what keeps a ``kill -9`` of the driver
(a notebook's kernel restart) from leaving idle worker processes that hold their memory for good.

:func:`wait_for_exit` returns once a process has ended. The local pool's workers run it in a thread
(:func:`nbkit.cluster.engine.watch_driver`); for the processes of a cluster nbkit started but whose
code is not nbkit's (a local Ray instance's raylet, GCS and agents), the engine starts this file as
a small script of its own, ``python -I reaper.py DRIVER PID...``, which ends those PIDs once the
driver has ended. It imports nothing but the standard library (not nbkit, not torch: it stays a few
MB for the engine's lifetime).

Example:
    >>> import subprocess, sys
    >>> child = subprocess.Popen([sys.executable, "-c", "pass"])
    >>> wait_for_exit(child.pid, pidfd=False); child.wait()   # (the poll sees it ended, or its zombie)
    0
"""

from __future__ import annotations

import os
import sys
import time

__all__ = ["wait_for_exit", "main"]

#: How often (seconds) a process is looked for where it cannot be waited on (no ``pidfd_open``).
POLL_SECONDS = 0.5
#: Seconds between SIGTERM and SIGKILL of what the dead driver started.
GRACE_SECONDS = 2.0


def wait_for_exit(pid: int, *, pidfd: bool = True) -> None:
    """Return once the process ``pid`` has ended (at once if it has already).

    On Linux 5.3+ this waits on a pidfd (no polling, and a recycled pid cannot fool it); elsewhere it
    polls every :data:`POLL_SECONDS`, and, for this process's own parent, also sees it end by the
    parent changing (a recycled pid then fools it neither)."""
    fd = None
    if pidfd and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except OSError:  # an old kernel, or a seccomp profile without it: poll
            fd = None
    if fd is not None:
        import select
        try:
            # poll, not select: select() refuses a descriptor past 1023 (a worker of a process that
            # already holds many files open, e.g. a cache of many columns, gets such a pidfd).
            waiter = select.poll()
            waiter.register(fd, select.POLLIN)
            while not waiter.poll():  # readable once the process has ended
                pass
        finally:
            os.close(fd)
        return
    parent = os.getppid()
    while _running(pid) and not (parent == pid and os.getppid() != parent):
        time.sleep(POLL_SECONDS)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and another user's
        return True
    fields = proc_stat(pid)  # an unreaped child ended already: its zombie answers kill(0)
    return fields is None or fields[0] != "Z"


def _started(pid: int) -> str | None:
    """When ``pid`` started (``/proc``'s start time, in clock ticks), or None: gone, or no ``/proc``."""
    fields = proc_stat(pid)
    return fields[19] if fields is not None and len(fields) > 19 else None  # field 22 of /proc/PID/stat


def proc_stat(pid: int) -> list | None:
    """The fields of ``/proc/<pid>/stat`` after the process's name (``[0]`` its state, ``[1]`` its
    parent's pid, ``[19]`` its start time), or None: gone, or no ``/proc`` (macOS).

    Example:
        >>> fields = proc_stat(os.getpid())
        >>> fields is None or fields[1] == str(os.getppid())
        True
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except (OSError, IndexError):
        return None


def main(argv: list) -> int:
    """``reaper.py DRIVER PID...``: once DRIVER has ended, end each PID (SIGTERM, then SIGKILL after
    :data:`GRACE_SECONDS`). Each PID is pinned by its start time when this starts, so a pid recycled
    meanwhile is never signalled (where there is no ``/proc``, by its pid alone). Only the standard
    library: it runs isolated (``python -I``), where a vendored psutil (Ray's) is not importable."""
    import signal

    driver, pinned = int(argv[0]), {int(a): _started(int(a)) for a in argv[1:]}
    wait_for_exit(driver)

    def ours() -> list:
        return [pid for pid, started in pinned.items() if _running(pid) and _started(pid) == started]

    for sig, wait in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 0.0)):
        for pid in ours():
            try:
                os.kill(pid, sig)
            except OSError:  # gone meanwhile
                pass
        end = time.monotonic() + wait
        while ours() and time.monotonic() < end:
            time.sleep(0.1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
