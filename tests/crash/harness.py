"""Crash-point testing of nbkit's operations, as SQLite's crash tests and the ALICE study do it:
enumerate every file-system call an operation makes, kill it just before each one, and check what
a reopening process finds (``docs/CRASH.md``).

For each operation of :data:`crash.operations.OPERATIONS` and each mode (``"kill"``: ``kill -9``;
``"power"``: a simulated power cut, :mod:`crash.interpose`):

1. ``setup`` builds the state before it in a template directory (once per operation);
2. a counting run on a copy lists its calls (N of them) and leaves the state after it;
3. for each chosen crash point k (:func:`choose_points`), a fresh copy of the template, a fresh
   process that runs the operation and kills itself before call k, then the checks below, in this
   (the pytest) process, through nbkit's public API and plain file listings only.

The invariants (numbers as in ``docs/CRASH.md``):

1. the target is the old whole state or the new one (an interrupted build: fewer samples, never a
   wrong one), or none where the operation may leave none; it opens, ``verify()`` passes, and every
   stored sample equals its source's for the version its metadata's generation names. A directory
   left without ``nbkit.json`` is given to a new cache of the same shape (another source): it must
   not serve a sample the crash left.
2. nothing else changed: the bystander and the operation's inputs are byte-identical.
3. leftovers are visible and removable: every other entry of the target's parent is listed by
   ``nbkit.caches(parent)`` and ``nbkit.remove`` removes it (and a cache left behind, whole); nothing
   is left in ``$TMPDIR``; running the operation again succeeds and gives the new whole state.
4. (push) the remote pulls as the old or the new cache, or a pull refuses it cleanly.
5. (CacheLoader) every key reads back its value or is absent.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from crash.interpose import EXIT_CODE, NAMES, SYNCS
from crash.operations import KEYS_AFTER, KEYS_BEFORE, N, OPERATIONS, Operation, Source, same_sample, same_value, value

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

#: Crash points per operation and mode in CI (``NBKIT_CRASH`` unset); ``NBKIT_CRASH=all`` runs every
#: point, ``NBKIT_CRASH=<n>`` at most n (structural calls always included).
CI_POINTS = {"kill": 40, "power": 12, "power-meta": 12}
#: The crash modes: ``kill`` (``kill -9``: the page cache keeps every write), ``power`` (a power cut:
#: only what was synced stays, names and data) and ``power-meta`` (a power cut after the filesystem
#: committed every name made so far, but no data that was not synced: the zero-length files ext4,
#: XFS or btrfs leave when a rename comes before the fsync of what it renames).
MODES = {"kill": {}, "power": {"power": True}, "power-meta": {"power": True, "keep_entries": True}}


def budget() -> int | None:
    """Crash points per operation and mode: ``None`` means all of them."""
    value_ = os.environ.get("NBKIT_CRASH", "").strip().lower()
    if value_ == "all":
        return None
    if value_.isdigit():
        return int(value_)
    return 0  # CI_POINTS by mode


def choose_points(calls: list, cap: int | None, mode: str = "kill") -> list[int]:
    """The crash points (1-based call numbers) to run: all of them without a cap; else every call
    whose state a crash there can tell apart, and other calls evenly spaced (first and last
    included) up to ``cap``.

    After a kill the page cache survives, so a crash before a sync leaves what a crash before the
    next call leaves: every call that changes names counts (:data:`crash.interpose.NAMES`), writes
    fill the budget. After a power cut only synced data survives, so what matters is every sync,
    the end of the operation and (``power-meta``, where names survive) every name change.

    Example:
        >>> calls = [("write", ""), ("rename", ""), ("write", ""), ("write", ""), ("fsync", ""), ("write", "")]
        >>> choose_points(calls, 3), choose_points(calls, 0, "power")
        ([1, 2, 6], [2, 5])
    """
    n = len(calls)
    if cap is None or n <= cap:
        return list(range(1, n + 1))
    kinds = NAMES if mode == "kill" else NAMES | SYNCS
    must = [k for k, (kind, _) in enumerate(calls, 1) if kind in kinds]
    rest = [k for k, (kind, _) in enumerate(calls, 1) if kind not in kinds]
    room = min(max(cap - len(must), 0), len(rest))
    if room == 1:
        picked = rest[:1]
    else:
        picked = [rest[round(j * (len(rest) - 1) / (room - 1))] for j in range(room)] if room else []
    return sorted(set(must) | set(picked))


# -- the process server --------------------------------------------------------------------------


class Server:
    """``tests/crash/driver.py``: forks a fresh process per job from one that imported torch and nbkit."""

    def __init__(self, log_path: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "driver.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=REPO, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the crash driver did not start; see {log_path}")
        self._next = 0

    def job(self, **job) -> tuple[int, dict]:
        """``(exit status, last report)`` of one job (``driver.py`` describes the fields)."""
        self._next += 1
        job["id"] = self._next
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the crash driver died; see {self.log_path}")
        answer = json.loads(line)
        reports = answer["reports"] or [{"status": "silent"}]
        return answer["exit"], reports[-1]

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.wait(30)
        self._log.close()


# -- reading states back ---------------------------------------------------------------------------


def digest(path: str) -> dict | None:
    """Every entry under ``path`` (relative name → type, size, sha256 or link target); ``None`` if absent."""
    if not os.path.lexists(path):
        return None
    out = {}

    def one(p, rel):
        st = os.lstat(p)
        if os.path.islink(p):
            out[rel] = ("link", os.readlink(p))
        elif os.path.isdir(p):
            out[rel] = ("dir",)
            for name in sorted(os.listdir(p)):
                one(os.path.join(p, name), f"{rel}/{name}")
        else:
            with open(p, "rb") as f:
                out[rel] = ("file", st.st_size, hashlib.sha256(f.read()).hexdigest())

    one(path, ".")
    return out


def generation(cache: str) -> str | None:
    try:
        with open(os.path.join(cache, "nbkit.json"), "rb") as f:
            return json.loads(f.read()).get("generation")
    except (OSError, ValueError):
        return None


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:300]


@contextlib.contextmanager
def _opened(path: str):
    import nbkit

    ds = nbkit.CachedDataset.open(path)
    try:
        yield ds
    finally:
        with contextlib.suppress(Exception):
            ds.store.close()
        del ds


@dataclass
class Known:
    """What the template and the counting run say about an operation's states."""

    old_gen: str | None = None
    new_gen: str | None = None
    old_tar: str | None = None  # sha256
    new_tar: str | None = None
    inputs: dict = field(default_factory=dict)  # path -> digest


def check_cache_at(path: str, op: Operation, known: Known, *, final: bool) -> list[str]:
    """Invariant 1 for a cache directory; the violations found."""
    if not os.path.lexists(os.path.join(path, "nbkit.json")):
        if final:
            return [] if op.new is None else ["no cache at the target after the operation completed"]
        return [] if (op.absent_ok or op.old is None) else ["no cache at the target: the old one is gone and the new one is not there"]
    if final and op.new is None:
        return ["the cache is still there after the operation completed"]
    gen = generation(path)
    if op.old is not None and gen == known.old_gen:
        which, expect = "old", op.old
    elif op.new is not None and (known.new_gen is None or gen == known.new_gen):
        which, expect = "new", op.new
    elif gen is None:
        size = os.path.getsize(os.path.join(path, "nbkit.json"))
        return [f"its nbkit.json ({size} bytes) does not read: the cache does not open"]
    else:
        return [f"its generation {gen} is neither the old cache's ({known.old_gen}) nor the new one's ({known.new_gen})"]
    try:
        with _opened(path) as ds:
            if len(ds) != N:
                return [f"it has {len(ds)} samples, expected {N}"]
            ds.verify()
            missing = set(int(i) for i in ds.missing())
            out = []
            if missing and (expect.whole or final):
                out.append(f"the {which} cache holds {N - len(missing)}/{N} samples: a whole one was expected")
            src, other = Source(expect.seed), None
            wrong = [i for i in range(N) if i not in missing and not same_sample(ds[i], src[i])]
            if wrong:
                olds = op.old if which == "new" else op.new
                if olds is not None:
                    other = Source(olds.seed)
                from_other = [i for i in wrong if other is not None and same_sample(ds[i], other[i])]
                out.append(f"samples {wrong[:6]} of the {which} cache (generation {gen}) are wrong"
                           + (f"; {from_other[:6]} are the other version's samples" if from_other else ""))
            return out
    except Exception as e:  # noqa: BLE001 - every failure to read it back is the finding
        return [f"the {which} cache does not read back: {_first_line(e)}"]


def adoption_probe(path: str, scratch: str) -> list[str]:
    """A directory left without ``nbkit.json``: a new cache of the same shape made there (from another
    source) must serve no sample the crash left."""
    import nbkit

    if not os.path.isdir(path) or os.path.lexists(os.path.join(path, "nbkit.json")) or not os.listdir(path):
        return []
    copy = os.path.join(scratch, "probe")
    shutil.copytree(path, copy, symlinks=True)
    probe = Source(9)
    try:
        ds = nbkit.CachedDataset(probe, copy)
        try:
            stored = [i for i in range(N) if i not in set(int(j) for j in ds.missing())]
            wrong = [i for i in stored if not same_sample(ds[i], probe[i])]
        finally:
            ds.store.close()
            del ds
    except Exception as e:  # noqa: BLE001 - a clean refusal to build there is no wrong sample
        return [] if isinstance(e, (OSError, ValueError)) else [f"a new cache there fails: {_first_line(e)}"]
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    if wrong:
        return [f"the data files the crash left without nbkit.json were adopted by a new cache of the same shape: "
                f"it serves {len(wrong)} samples of the old source ({wrong[:6]})"]
    return []


def check_tar(path: str, known: Known, *, final: bool) -> list[str]:
    if not os.path.lexists(path):
        return ["no tar at the target: the old one is gone and the new one is not there"]
    with open(path, "rb") as f:
        sha = hashlib.sha256(f.read()).hexdigest()
    if sha == known.new_tar or (sha == known.old_tar and not final):
        return []
    size = os.path.getsize(path)
    return [f"the tar ({size} bytes) is neither the old tar nor the new one"
            + (" (the old one is still there)" if sha == known.old_tar else "")]


def check_remote(path: str, op: Operation, known: Known, scratch: str, *, final: bool) -> list[str]:
    """Invariant 4: pulling the remote gives the old or new whole cache, or a clean refusal."""
    import nbkit

    dest = os.path.join(scratch, "pulled")
    try:
        nbkit.pull("file://" + path, dest)
    except (FileNotFoundError, nbkit.CorruptCacheError, nbkit.UnsafeArchiveError) as e:
        return [f"the remote does not pull after the push completed: {_first_line(e)}"] if final else []
    except Exception as e:  # noqa: BLE001 - the failure is a finding, reported below
        return [f"pulling the remote fails uncleanly: {_first_line(e)}"]
    try:
        whole = Known(old_gen=known.old_gen, new_gen=known.new_gen)
        return [f"pulled: {v}" for v in check_cache_at(dest, op, whole, final=final)]
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def check_keyed(path: str, scratch: str, *, final: bool) -> list[str]:
    """Invariant 5: every key reads back its value or is absent (keys stored before stay)."""
    import nbkit

    if not os.path.isdir(path):
        return ["the CacheLoader's directory is gone"]
    copy = os.path.join(scratch, "keys")
    shutil.copytree(path, copy, symlinks=True)  # reading may create files: read a copy
    out = []
    try:
        loader = nbkit.CacheLoader(copy)
        for k in range(KEYS_AFTER):
            if k in loader:
                v = loader.get(k)
                if not same_value(v, value(1, k)):
                    out.append(f"key {k} reads back a wrong value")
            elif k < KEYS_BEFORE or final:
                out.append(f"key {k} is missing" + (" (it was stored before the operation)" if k < KEYS_BEFORE else ""))
        loader.store.close()
    except Exception as e:  # noqa: BLE001 - the failure is a finding, reported below
        out.append(f"the CacheLoader does not read back: {_first_line(e)}")
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return out


def check_target(op: Operation, work: str, known: Known, scratch: str, *, final: bool) -> list[tuple[str, str]]:
    """Invariants 1, 4 and 5 on the target: ``(invariant, message)`` pairs."""
    target = os.path.join(work, op.target)
    if op.kind == "cache":
        found = [("1", m) for m in check_cache_at(target, op, known, final=final)]
        found += [("1", m) for m in adoption_probe(target, scratch)]
        return found
    if op.kind == "tar":
        return [("1", m) for m in check_tar(target, known, final=final)]
    if op.kind == "remote":
        return [("4", m) for m in check_remote(target, op, known, scratch, final=final)]
    if op.kind == "keyed":
        return [("5", m) for m in check_keyed(target, scratch, final=final)]
    if op.kind == "file":  # the harness's own tests (crash.toys)
        return [("1", m) for m in check_file(target, op, final=final)]
    if op.kind == "aside":
        return [("1", m) for m in check_aside(target, op, final=final)]
    raise ValueError(op.kind)


def check_aside(path: str, op: Operation, *, final: bool) -> list[str]:
    """A file moved aside (``nbkit.checkpoint.set_aside``): its old content readable under its name
    or the new one (the first entry of ``op.entries``) at every point, and only the new one at the end."""
    from crash.toys import content

    found = {}
    for where in (path, os.path.join(os.path.dirname(path), op.entries[0])):
        try:
            with open(where, "rb") as f:
                found[where] = f.read()
        except FileNotFoundError:
            continue
    bad = [f"{os.path.basename(w)} holds {len(d)} bytes that are not the old content" for w, d in found.items()
           if d != content(op.old.seed)]
    if not found:
        bad.append("the file is gone under both names")
    elif final and path in found:
        bad.append("the file is still under its old name after the move")
    return bad


def check_file(path: str, op: Operation, *, final: bool) -> list[str]:
    from crash.toys import content

    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return ["the file is gone"]
    if data == content(op.new.seed) or (data == content(op.old.seed) and not final):
        return []
    return [f"the file holds {len(data)} bytes that are neither the old content nor the new"]


def check_inputs(op: Operation, work: str, known: Known) -> list[tuple[str, str]]:
    """Invariant 2: the bystander and the inputs are byte-identical."""
    out = []
    for rel, before in known.inputs.items():
        now = digest(os.path.join(work, rel))
        if now != before:
            changed = sorted(k for k in set(before or {}) | set(now or {}) if (before or {}).get(k) != (now or {}).get(k))
            out.append(("2", f"{rel} changed: {changed[:5]}"))
    return out


def _expected_names(op: Operation) -> set:
    return {os.path.basename(op.target), "bystander", *op.entries}


def leftovers(op: Operation, work: str) -> list[str]:
    """The names in the target's parent that are neither expected nor the target; the target too when
    it is a directory left holding files (other than empty lock files) but no metadata."""
    parent = os.path.dirname(os.path.join(work, op.target))
    names = sorted(set(os.listdir(parent)) - _expected_names(op))
    target = os.path.join(work, op.target)
    if op.kind == "cache" and os.path.isdir(target) and not os.path.lexists(os.path.join(target, "nbkit.json")):
        held = [n for n in os.listdir(target)
                if not (n.endswith(".lock") and os.path.isfile(os.path.join(target, n))
                        and not os.path.getsize(os.path.join(target, n)))]
        if held:
            names.append(os.path.basename(target))
    return names


@contextlib.contextmanager
def _cache_dir(op: Operation, work: str, scratch: str):
    """``$NBKIT_CACHE_DIR`` as the operation sees it (else an empty one) while nbkit's tools look."""
    wanted = op.env.get("NBKIT_CACHE_DIR", "").replace("{work}", work) or os.path.join(scratch, "no-working-copies")
    os.makedirs(wanted, exist_ok=True)
    before = os.environ.get("NBKIT_CACHE_DIR")
    os.environ["NBKIT_CACHE_DIR"] = wanted
    try:
        yield
    finally:
        if before is None:
            del os.environ["NBKIT_CACHE_DIR"]
        else:
            os.environ["NBKIT_CACHE_DIR"] = before


def check_leftovers(op: Operation, work: str, scratch: str, tmpdir: str | None) -> list[tuple[str, str]]:
    """Invariant 3 (visible, removable): on the crashed state and on a copy of it."""
    import nbkit.disk

    out = []
    if tmpdir and os.path.isdir(tmpdir) and os.listdir(tmpdir):
        out.append(("3", f"left {sorted(os.listdir(tmpdir))[:3]} in $TMPDIR, where nbkit.caches() never looks"))
    names = leftovers(op, work)
    target = os.path.join(work, op.target)
    has_cache = op.removable and os.path.lexists(os.path.join(target, "nbkit.json"))
    if not names and not has_cache:
        return out
    parent = os.path.dirname(target)
    with _cache_dir(op, work, scratch):
        try:
            listed = {c.path for c in nbkit.disk.caches(parent)}
        except Exception as e:  # noqa: BLE001 - the failure is a finding, reported below
            return out + [("3", f"nbkit.caches(parent) fails: {_first_line(e)}")]
    for name in names:
        if os.path.join(parent, name) not in listed:
            out.append(("3", f"leftover {name!r} is not listed by nbkit.caches()"))
    copy = os.path.join(scratch, "removal")
    shutil.copytree(work, copy, symlinks=True)
    cparent = os.path.dirname(os.path.join(copy, op.target))
    try:
        with _cache_dir(op, copy, scratch):
            for name in names:
                try:
                    nbkit.disk.remove(os.path.join(cparent, name))
                except Exception as e:  # noqa: BLE001 - the failure is a finding, reported below
                    out.append(("3", f"nbkit.remove(leftover {name!r}) fails: {_first_line(e)}"))
            if has_cache:
                try:
                    left = nbkit.disk.remove(os.path.join(copy, op.target)).left
                    if left:
                        out.append(("3", f"nbkit.remove(target cache) leaves {list(left)[:3]} (and the directory)"))
                except Exception as e:  # noqa: BLE001 - the failure is a finding, reported below
                    out.append(("3", f"nbkit.remove(target cache) fails: {_first_line(e)}"))
        still = sorted(set(os.listdir(cparent)) - _expected_names(op)) if os.path.isdir(cparent) else []
        if still:
            out.append(("3", f"after nbkit.remove the parent still holds {still[:3]}"))
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    return out


# -- running an operation's crash points -----------------------------------------------------------


@dataclass
class Violation:
    invariant: str
    point: int
    call: str
    message: str


@dataclass
class Result:
    """One operation in one mode: its calls, the points run and what they found."""

    op: str
    mode: str
    calls: int = 0
    points: int = 0
    seconds: float = 0.0
    kinds: dict = field(default_factory=dict)
    violations: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # the harness's own trouble (an operation failing uncrashed)

    def by_invariant(self) -> dict:
        out: dict = {}
        for v in self.violations:
            out.setdefault(v.invariant, set()).add(v.point)
        return {k: len(s) for k, s in sorted(out.items())}

    def summary(self, examples: int = 8) -> str:
        lines = [f"{self.op} [{self.mode}]: {self.points} of {self.calls} crash points, "
                 f"{len({v.point for v in self.violations})} with violations {self.by_invariant()}"]
        seen = set()
        for v in self.violations:
            key = (v.invariant, re.sub(r"'[^']*'|\[[^\]]*\]|/\S+|\d+", "_", v.message))
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"  inv {v.invariant} @ {v.point} before {v.call}: {v.message}")
            if len(seen) >= examples:
                break
        lines += [f"  harness: {e}" for e in self.errors[:5]]
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {"op": self.op, "mode": self.mode, "calls": self.calls, "points": self.points,
                "seconds": round(self.seconds, 1), "kinds": self.kinds, "violations_by_invariant": self.by_invariant(),
                "points_with_violations": len({v.point for v in self.violations}),
                "examples": [vars(v) for v in self.violations[:40]], "errors": self.errors}


def _tmp_base(base: str) -> str:
    """Where each run's ``$TMPDIR`` goes: on another filesystem than the work directory when the
    machine has one (``/dev/shm``), as ``/tmp`` and a Drive mount are on Colab."""
    shm = "/dev/shm"
    try:
        if os.path.isdir(shm) and os.access(shm, os.W_OK) and os.stat(shm).st_dev != os.stat(base).st_dev:
            d = os.path.join(shm, f"nbkit-crash-{os.getpid()}")
            os.makedirs(d, exist_ok=True)
            return d
    except OSError:
        pass
    d = os.path.join(base, "tmpdirs")
    os.makedirs(d, exist_ok=True)
    return d


class Harness:
    """Runs operations' crash points under one :class:`Server`, in directories under ``base``."""

    def __init__(self, server: Server, base: str):
        import nbkit

        if not os.path.abspath(nbkit.__file__).startswith(os.path.join(REPO, "nbkit") + os.sep):
            raise RuntimeError(f"this process imports nbkit from {nbkit.__file__}, the crashed processes from {REPO}: "
                               f"run pytest from {REPO} (or set PYTHONPATH={REPO})")
        self.server, self.base = server, base
        self.tmp_base = _tmp_base(base)
        self._templates: dict = {}

    def close(self) -> None:
        if self.tmp_base.startswith("/dev/shm/"):
            shutil.rmtree(self.tmp_base, ignore_errors=True)

    def _env(self, op: Operation, work: str) -> dict:
        return {k: v.replace("{work}", work) for k, v in op.env.items()}

    def template(self, op: Operation) -> str:
        if op.name not in self._templates:
            t = os.path.join(self.base, op.name, "template")
            os.makedirs(t)
            code, rep = self.server.job(kind="setup", op=op.name, work=t, env=self._env(op, t))
            if rep.get("status") != "done":
                raise RuntimeError(f"setup of {op.name} failed: {rep}")
            self._templates[op.name] = t
        return self._templates[op.name]

    def _fresh(self, template: str, name: str) -> str:
        work = os.path.join(os.path.dirname(template), name)
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(template, work, symlinks=True)
        return work

    def _tmpdir(self, name: str) -> str:
        d = os.path.join(self.tmp_base, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        return d

    def run(self, op: Operation, mode: str, cap: int | None = 0) -> Result:
        """Every chosen crash point of ``op`` in ``mode`` (``cap`` 0: the CI budget; ``None``: all)."""
        start = time.perf_counter()
        power = mode != "kill"
        result = Result(op.name, mode)
        template = self.template(op)
        target = op.target
        known = Known(old_gen=generation(os.path.join(template, target)) if op.kind in ("cache", "remote") else None)
        known.inputs = {rel: digest(os.path.join(template, rel)) for rel in op.inputs}
        if op.kind == "tar":
            known.old_tar = digest(os.path.join(template, target))["."][2]

        # The counting run: how many calls, which ones, and the state after.
        work = self._fresh(template, f"{mode}-count")
        stash = self._stash(work, power)
        tmpdir = self._tmpdir(f"{op.name}-{mode}-count")
        code, rep = self.server.job(kind="run", op=op.name, work=work, interpose=True, stash=stash,
                                    tmpdir=tmpdir, env=self._env(op, work), **MODES[mode])
        if rep.get("status") != "done":
            raise RuntimeError(f"{op.name} fails without a crash under the harness: {rep}")
        calls = rep["calls"]
        result.calls = len(calls)
        for kind, _ in calls:
            result.kinds[kind] = result.kinds.get(kind, 0) + 1
        if op.kind in ("cache", "remote") and op.name not in FRESH_GENERATION:
            known.new_gen = generation(os.path.join(work, target))
        if op.kind == "tar":
            known.new_tar = digest(os.path.join(work, target))["."][2]
        scratch = os.path.join(os.path.dirname(template), "scratch")
        os.makedirs(scratch, exist_ok=True)
        for inv, msg in check_target(op, work, known, scratch, final=True) + check_inputs(op, work, known):
            result.errors.append(f"the uncrashed run does not give the new state: inv {inv}: {msg}")
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(stash or "", ignore_errors=True)

        cap = CI_POINTS[mode] if cap == 0 else cap
        points = choose_points([tuple(c) for c in calls], cap, mode)
        result.points = len(points)
        for k in points:
            call = f"{calls[k - 1][0]} {calls[k - 1][1]}"
            for inv, msg in self.point(op, mode, template, known, scratch, k):
                result.violations.append(Violation(inv, k, call, msg))
        result.seconds = time.perf_counter() - start
        return result

    def _stash(self, work: str, power: bool) -> str | None:
        if not power:
            return None
        stash = work + ".stash"
        shutil.rmtree(stash, ignore_errors=True)
        os.makedirs(stash)
        return stash

    def point(self, op: Operation, mode: str, template: str, known: Known, scratch: str, k: int) -> list[tuple[str, str]]:
        """Crash ``op`` before call ``k`` on a fresh copy, then check every invariant."""
        power = mode != "kill"
        work = self._fresh(template, f"{mode}-{k}")
        stash = self._stash(work, power)
        tmpdir = self._tmpdir(f"{op.name}-{mode}-{k}")
        try:
            code, rep = self.server.job(kind="run", op=op.name, work=work, interpose=True, crash_at=k, stash=stash,
                                        tmpdir=tmpdir, env=self._env(op, work), **MODES[mode])
            found = []
            status = rep.get("status")
            if status == "crashed" and code == EXIT_CODE:
                if rep.get("notes"):
                    found.append(("model", f"power cut could not undo everything: {rep['notes'][:2]}"))
            elif status == "done":
                pass  # fewer calls this time (threads): it completed
            elif status == "error":
                found.append(("run", f"the operation failed under the harness: {rep.get('type')}: {rep.get('error', '')[:300]}"))
                return found
            else:
                found.append(("run", f"the crashed process ended with {status} (exit {code})"))
                return found
            found += check_target(op, work, known, scratch, final=status == "done")
            found += check_inputs(op, work, known)
            found += check_leftovers(op, work, scratch, tmpdir)
            # A rerun completes what the crash interrupted.
            code, rep = self.server.job(kind="run", op=op.name, work=work, interpose=True, tmpdir=tmpdir,
                                        env=self._env(op, work))  # counted only: its syncs are not run
            target = os.path.join(work, op.target)
            gone = op.new is None and (not os.path.lexists(target) or (os.path.isdir(target) and not os.listdir(target)))
            if rep.get("status") != "done" and gone and rep.get("type") in ("FileNotFoundError", "ValueError"):
                pass  # a removal the crash had already done: "nothing to remove there" is the answer
            elif rep.get("status") != "done":
                found.append(("3", f"rerunning the operation fails: {rep.get('type')}: {(rep.get('error') or str(rep))[:300]}"))
            else:
                found += [(inv if inv != "1" else "3", f"after a rerun: {msg}")
                          for inv, msg in check_target(op, work, known, scratch, final=True)]
                found += check_inputs(op, work, known)
            return found
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(stash or "", ignore_errors=True)
            shutil.rmtree(tmpdir, ignore_errors=True)


#: Results of this session's crash tests, for the summary at the end.
RESULTS: list = []

#: Operations that create a new cache (a new generation id each run) rather than copy one.
FRESH_GENERATION = {"warmup_new", "overwrite"}


def modes(op: Operation) -> list[str]:
    return list(MODES) if op.power_loss else ["kill"]


def all_cases() -> list[tuple[str, str]]:
    return [(name, mode) for name, op in OPERATIONS.items() for mode in modes(op)]
