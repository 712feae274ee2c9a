"""Crash points in one process: count its file-system calls, kill it just before the k-th one, and
(power-loss mode) first roll the file system back to what had been made durable.

:func:`install` replaces, in this process only, every Python entry point through which nbkit changes
files: ``os.open`` (counted when its flags write or create), ``os.write``, ``pwrite``, ``writev``,
``pwritev``, ``sendfile``, ``copy_file_range``, ``ftruncate``, ``truncate``, ``posix_fallocate``,
``fsync``, ``fdatasync``, ``rename``, ``replace``, ``unlink``, ``remove``, ``rmdir``, ``mkdir``,
``link``, ``symlink``, ``chmod``, ``fchmod``; ``builtins.open``/``io.open`` in a writing mode (the
file object is wrapped, so its ``write``, ``writelines``, ``truncate``, ``flush`` and ``close``
count too); ``mmap.mmap`` (its ``flush``, an ``msync``, counts); and ``nbkit.commit._exchange`` (one
``renameat2(RENAME_EXCHANGE)``) where nbkit has it. Calls on descriptors that are no regular file or
directory (pipes, sockets, the terminal) and on descriptors 0-2 are not counted. Calls are
serialised (one lock), so a crash point is a moment when no other thread of the process is inside a
file-system call. ``fsync`` and ``fdatasync`` are counted but not run: a kill keeps the page cache
anyway, and what a power cut keeps is the model's business (real syncs would only slow every run). A crash is ``os._exit(137)``, what ``kill -9`` leaves: the page cache keeps every
write the process made, Python's buffers lose theirs.

Power loss (``power_loss=True``) adds a model of what the disk holds after a power cut at that
moment; at the crash point the process rewrites the file system to it, then exits:

* A file's content is what it held at its last ``fsync``/``fdatasync`` (or ``mmap.flush`` of the
  range), else what it held before this process first opened it for writing; a file this process
  created and never synced is empty. Files are tracked by inode, so renames carry their state.
* A directory entry made or removed by this process (create, ``mkdir``, ``rename``, exchange,
  ``link``, ``symlink``, ``unlink``, ``rmdir``) persists only once every directory it touched (both
  sides of a rename) has been ``fsync``-ed after it, through any descriptor on that directory (a
  path, or ``dir_fd``-relative). The others are undone, newest first: a name created disappears
  (a directory with all below it), a name removed comes back with its inode, a rename goes back.
  To be able to bring back a removed name, an ``unlink``/``rmdir``, and the file or empty
  directory a ``rename`` replaces, are done by moving the victim into a stash directory on the same
  filesystem (the process sees the same result: the name is gone).
* Only files and directories on the filesystem of the ``roots`` given are modelled (the test's
  work directory). Elsewhere (a ``$TMPDIR`` on tmpfs) calls are counted but nothing is rolled back.

Simplifications, each keeping less than a real disk might, never more: an un-synced write is lost
whole (a real disk may keep some of its pages, or reorder them: ALICE's torn and reordered writes
are not explored; an in-place overwrite is caught by the kill mode instead), and a file's size goes
back with its content (a file created, preallocated and never synced is empty, not zeros); ``fsync`` of a file does not make its directory entry durable (it does on ext4);
a rename is durable only when both of its directories were synced (ext4 journals it as one step);
other metadata (``chmod``, times) is not rolled back; extended attributes and hard-link counts are not modelled. Where an undo cannot
be applied (a later, durable operation moved the name), the power cut goes on and notes it.
"""

from __future__ import annotations

import builtins
import io
import json
import mmap
import os
import shutil
import stat
import sys
import threading
import uuid

#: The real functions, taken before anything is replaced; the model itself uses only these.
O = type("O", (), {})()  # noqa: E741 - one letter, read as "the originals" on every line that uses it
for _name in ("open", "write", "pwrite", "writev", "pwritev", "sendfile", "copy_file_range", "ftruncate", "truncate",
              "posix_fallocate", "fsync", "fdatasync", "rename", "replace", "unlink", "remove", "rmdir", "mkdir",
              "link", "symlink", "chmod", "fchmod", "close", "fstat", "lstat", "stat", "readlink", "pread", "listdir"):
    if hasattr(os, _name):
        setattr(O, _name, getattr(os, _name))
_io_open = io.open
_mmap_class = mmap.mmap

#: Calls that change names: in CI every one of them is a crash point.
NAMES = frozenset({"rename", "replace", "exchange", "unlink", "remove", "rmdir", "mkdir", "link", "symlink"})
#: Calls that make something durable, and the end of the operation: what a power cut depends on.
SYNCS = frozenset({"fsync", "fdatasync", "msync", "end"})
STRUCTURAL = NAMES | SYNCS
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
EXIT_CODE = 137


def _path(p) -> str:
    p = os.fspath(p)
    return os.fsdecode(p) if isinstance(p, bytes) else p


def _absolute(path, dir_fd=None) -> str:
    """The absolute path ``path`` names (relative to ``dir_fd`` when given), without resolving its last part."""
    path = _path(path)
    if os.path.isabs(path):
        return os.path.normpath(path)
    if dir_fd is None:
        return os.path.abspath(path)
    return os.path.normpath(os.path.join(O.readlink(f"/proc/self/fd/{dir_fd}"), path))


def _key(st) -> tuple:
    return st.st_dev, st.st_ino


def _read_all(fd: int) -> bytes:
    chunks, off = [], 0
    while True:
        b = O.pread(fd, 1 << 20, off)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        off += len(b)


def _write_all(fd: int, data: bytes) -> None:
    O.ftruncate(fd, 0)
    view, off = memoryview(data), 0
    while off < len(view):
        off += O.pwrite(fd, view[off:], off)


class _Entry:
    """One directory operation of the journal: undone at a power cut unless every directory in
    ``dirs`` was synced after it."""

    __slots__ = ("op", "dirs", "unsynced", "args")

    def __init__(self, op: str, dirs: list, args: tuple):
        self.op, self.dirs, self.args = op, dirs, args
        self.unsynced = set(dirs)


class PowerModel:
    """What the disk holds: durable content per inode, and a journal of directory operations."""

    def __init__(self, roots, stash: str, exchange=None, keep_entries: bool = False):
        self.keep_entries = keep_entries
        self.dev = {O.stat(r).st_dev for r in roots}
        self.stash = stash
        self.stash_fd = O.open(stash, _DIR_FLAGS)
        self.stash_key = _key(O.fstat(self.stash_fd))
        self.inodes: dict = {}  # key -> [our O_RDWR fd, durable bytes]
        self.dirs: dict = {}  # key -> our fd on the directory
        self.journal: list = []
        self.notes: list = []
        self.exchange = exchange

    # -- what is modelled ----------------------------------------------------------------------

    def _tracked_dir(self, path: str):
        """``(key, fd)`` of the directory at ``path`` if it is modelled, else ``None``."""
        try:
            fd = O.open(path, _DIR_FLAGS)
        except OSError:
            return None
        k = _key(O.fstat(fd))
        if k[0] not in self.dev or k == self.stash_key:
            O.close(fd)
            return None
        if k in self.dirs:
            O.close(fd)
        else:
            self.dirs[k] = fd
        return k

    def parent(self, abspath: str):
        """``(dir key, name)`` of a modelled path, or ``None``."""
        k = self._tracked_dir(os.path.dirname(abspath) or "/")
        return None if k is None else (k, os.path.basename(abspath))

    def register_path(self, abspath: str) -> None:
        """Snapshot an existing regular file before this process first writes it."""
        try:
            st = O.stat(abspath)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode) and st.st_dev in self.dev and _key(st) not in self.inodes:
            fd = O.open(abspath, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
            self.inodes[_key(st)] = [fd, _read_all(fd)]

    def register_fd(self, fd: int, created: bool) -> None:
        st = O.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_dev not in self.dev or _key(st) in self.inodes:
            return
        ours = O.open(f"/proc/self/fd/{fd}", os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        self.inodes[_key(st)] = [ours, b"" if created else _read_all(ours)]

    def synced(self, fd: int) -> None:
        st = O.fstat(fd)
        k = _key(st)
        if stat.S_ISDIR(st.st_mode):
            for e in self.journal:
                e.unsynced.discard(k)
        elif k in self.inodes:
            self.inodes[k][1] = _read_all(self.inodes[k][0])

    def synced_range(self, k, offset: int, size: int) -> None:
        if k in self.inodes:
            fd, durable = self.inodes[k]
            now = _read_all(fd)
            end = min(offset + size, len(now))
            merged = bytearray(durable.ljust(max(len(durable), end), b"\0"))
            merged[offset:end] = now[offset:end]
            self.inodes[k][1] = bytes(merged)

    def log(self, op: str, dirs: list, *args) -> None:
        self.journal.append(_Entry(op, dirs, args))

    def stash_name(self) -> str:
        return uuid.uuid4().hex

    def move_to_stash(self, abspath: str) -> str:
        name = self.stash_name()
        O.rename(abspath, os.path.join(self.stash, name))
        return name

    # -- the power cut -------------------------------------------------------------------------

    def cut(self) -> None:
        for k, (fd, durable) in self.inodes.items():
            try:
                if _read_all(fd) != durable:
                    _write_all(fd, durable)
            except OSError as e:
                self.notes.append(f"content of inode {k}: {e}")
        if self.keep_entries:
            return
        for e in reversed(self.journal):
            if e.unsynced:
                try:
                    self._undo(e)
                except OSError as err:
                    self.notes.append(f"undo {e.op}{e.args}: {err}")

    def _undo(self, e: _Entry) -> None:
        d = [self.dirs[k] for k in e.dirs]
        if e.op == "create":
            (name,) = e.args
            O.unlink(name, dir_fd=d[0])
        elif e.op == "mkdir":
            (name,) = e.args
            shutil.rmtree(name, dir_fd=d[0])
        elif e.op in ("unlink", "rmdir"):
            name, stashed = e.args
            O.rename(stashed, name, src_dir_fd=self.stash_fd, dst_dir_fd=d[0])
        elif e.op == "rename":
            src, dst, victim = e.args
            O.rename(dst, src, src_dir_fd=d[-1], dst_dir_fd=d[0])
            if victim is not None:
                O.rename(victim, dst, src_dir_fd=self.stash_fd, dst_dir_fd=d[-1])
        elif e.op == "exchange":
            a, b = e.args
            if not self.exchange(d[0], a, b):
                raise OSError("renameat2(RENAME_EXCHANGE) refused the undo")


class Recorder:
    """Counts this process's file-system calls and crashes at call ``crash_at`` (1-based)."""

    def __init__(self, crash_at: int | None, report_fd: int, model: PowerModel | None):
        self.crash_at, self.report_fd, self.model = crash_at, report_fd, model
        self.count = 0
        self.calls: list = []  # (kind, detail) of each call, for the counting run
        self.lock = threading.RLock()

    def point(self, kind: str, detail: str) -> None:
        """Called, under the lock, just before a counted call."""
        self.count += 1
        self.calls.append((kind, detail))
        if self.count == self.crash_at:
            notes = []
            if self.model is not None:
                uninstall()
                self.model.cut()
                notes = self.model.notes
            send(self.report_fd, {"status": "crashed", "at": self.count, "call": f"{kind} {detail}", "notes": notes})
            os._exit(EXIT_CODE)


    def end(self) -> None:
        """One more crash point once the operation has returned (a power cut right after it)."""
        with self.lock:
            self.point("end", "(the operation returned)")


_recorder: Recorder | None = None
_saved: list = []


def send(fd: int, obj) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[O.write(fd, data):]


def _counted_fd(fd) -> bool:
    if not isinstance(fd, int) or fd <= 2:
        return False
    try:
        mode = O.fstat(fd).st_mode
    except OSError:
        return True  # a bad descriptor: the call fails, but it was made
    return stat.S_ISREG(mode) or stat.S_ISDIR(mode)


def _special(path, dir_fd=None) -> bool:
    """Whether ``path`` is an existing device, fifo or socket (``/dev/null``): not a file-system change."""
    try:
        mode = O.stat(path, dir_fd=dir_fd).st_mode
    except (OSError, TypeError, ValueError):
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _name(p) -> str:
    try:
        return os.path.basename(_path(p)) or _path(p)
    except TypeError:
        return repr(p)


# -- wrappers -------------------------------------------------------------------------------------


def _w_open(path, flags, mode=0o777, *, dir_fd=None):
    r = _recorder
    if not flags & _WRITE_FLAGS or r is None or _special(path, dir_fd):
        return O.open(path, flags, mode, dir_fd=dir_fd)
    with r.lock:
        r.point("open", _name(path))
        m = r.model
        if m is None:
            return O.open(path, flags, mode, dir_fd=dir_fd)
        p = _absolute(path, dir_fd)
        existed = os.path.lexists(p)
        if existed:
            m.register_path(p)
        fd = O.open(path, flags, mode, dir_fd=dir_fd)
        if not existed:
            where = m.parent(p)
            if where is not None:
                m.register_fd(fd, created=True)
                m.log("create", [where[0]], where[1])
        else:
            m.register_fd(fd, created=False)
        return fd


def _fd_call(kind: str, real):
    def wrapper(fd, *args, **kwargs):
        r = _recorder
        if not isinstance(fd, int) and hasattr(fd, "fileno"):
            fd = fd.fileno()  # os.fsync(file object)
        if r is None or not _counted_fd(fd):
            return real(fd, *args, **kwargs)
        with r.lock:
            r.point(kind, f"fd {fd}")
            if kind in ("fsync", "fdatasync"):
                # Not done: a kill keeps the page cache, and a power cut is the model's business.
                # (Running real syncs would only make every crash point slower.)
                O.fstat(fd)  # a bad descriptor fails as it would
                if r.model is not None:
                    r.model.synced(fd)
                return None
            if r.model is not None:
                r.model.register_fd(fd, created=False)
            return real(fd, *args, **kwargs)
    wrapper.__name__ = real.__name__
    return wrapper


def _w_sendfile(out_fd, in_fd, offset, count, *args, **kwargs):
    return _fd_call("sendfile", O.sendfile)(out_fd, in_fd, offset, count, *args, **kwargs)


def _w_copy_file_range(src, dst, count, *args, **kwargs):
    r = _recorder
    if r is None or not _counted_fd(dst):
        return O.copy_file_range(src, dst, count, *args, **kwargs)
    with r.lock:
        r.point("copy_file_range", f"fd {dst}")
        if r.model is not None:
            r.model.register_fd(dst, created=False)
        return O.copy_file_range(src, dst, count, *args, **kwargs)


def _w_truncate(path, length):
    r = _recorder
    if r is None:
        return O.truncate(path, length)
    if isinstance(path, int):
        return _fd_call("ftruncate", O.ftruncate)(path, length)
    with r.lock:
        r.point("truncate", _name(path))
        if r.model is not None:
            r.model.register_path(_absolute(path))
        return O.truncate(path, length)


def _w_chmod(path, mode, *, dir_fd=None, follow_symlinks=True):
    r = _recorder
    if r is None:
        return O.chmod(path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
    with r.lock:
        r.point("chmod", _name(path))
        return O.chmod(path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)


def _w_mkdir(path, mode=0o777, *, dir_fd=None):
    r = _recorder
    if r is None:
        return O.mkdir(path, mode, dir_fd=dir_fd)
    with r.lock:
        r.point("mkdir", _name(path))
        out = O.mkdir(path, mode, dir_fd=dir_fd)
        if r.model is not None:
            where = r.model.parent(_absolute(path, dir_fd))
            if where is not None:
                r.model.log("mkdir", [where[0]], where[1])
        return out


def _removing(kind: str, real, want_dir: bool):
    def wrapper(path, *, dir_fd=None):
        r = _recorder
        if r is None:
            return real(path, dir_fd=dir_fd)
        with r.lock:
            r.point(kind, _name(path))
            m = r.model
            if m is None:
                return real(path, dir_fd=dir_fd)
            p = _absolute(path, dir_fd)
            where = m.parent(p)
            try:
                st = O.lstat(p)
            except OSError:
                st = None
            if where is None or st is None or stat.S_ISDIR(st.st_mode) != want_dir or (want_dir and O.listdir(p)):
                return real(path, dir_fd=dir_fd)  # fails (or is not modelled) as it would
            if not want_dir:
                m.register_path(p)  # its content comes back with the name
            m.log(kind if want_dir else "unlink", [where[0]], where[1], m.move_to_stash(p))
    wrapper.__name__ = real.__name__
    return wrapper


def _renaming(kind: str, real):
    def wrapper(src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        r = _recorder
        if r is None:
            return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
        with r.lock:
            r.point(kind, f"{_name(src)} -> {_name(dst)}")
            m = r.model
            if m is None:
                return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            s, d = _absolute(src, src_dir_fd), _absolute(dst, dst_dir_fd)
            ws, wd = m.parent(s), m.parent(d)
            if wd is None:
                return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            victim = None
            try:
                vst = O.lstat(d)
            except OSError:
                vst = None
            try:
                sst = O.lstat(s)
            except OSError:
                sst = None
            if vst is not None and (sst is None or stat.S_ISDIR(sst.st_mode) != stat.S_ISDIR(vst.st_mode)):
                return real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)  # fails as it would
            same = vst is not None and _key(sst) == _key(vst)
            if vst is not None and not same and not (stat.S_ISDIR(vst.st_mode) and O.listdir(d)):
                if not stat.S_ISDIR(vst.st_mode):
                    m.register_path(d)
                victim = m.move_to_stash(d)
            try:
                out = real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            except BaseException:
                if victim is not None:
                    O.rename(os.path.join(m.stash, victim), d)
                raise
            if ws is None:  # arrived from a directory that is not modelled: like a file created here
                if victim is not None:
                    m.log("unlink", [wd[0]], wd[1], victim)  # undone after the create (newest first)
                m.log("create", [wd[0]], wd[1])
                try:  # its content was never synced where the model could see it: none is durable
                    fd = O.open(d, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    m.register_fd(fd, created=True)
                    O.close(fd)
                except OSError:
                    pass
            else:
                m.log("rename", [ws[0], wd[0]], ws[1], wd[1], victim)
            return out
    wrapper.__name__ = real.__name__
    return wrapper


def _w_link(src, dst, *, src_dir_fd=None, dst_dir_fd=None, follow_symlinks=True):
    r = _recorder
    if r is None:
        return O.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)
    with r.lock:
        r.point("link", f"{_name(src)} -> {_name(dst)}")
        out = O.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=follow_symlinks)
        if r.model is not None:
            where = r.model.parent(_absolute(dst, dst_dir_fd))
            if where is not None:
                r.model.log("create", [where[0]], where[1])
        return out


def _w_symlink(src, dst, target_is_directory=False, *, dir_fd=None):
    r = _recorder
    if r is None:
        return O.symlink(src, dst, target_is_directory, dir_fd=dir_fd)
    with r.lock:
        r.point("symlink", _name(dst))
        out = O.symlink(src, dst, target_is_directory, dir_fd=dir_fd)
        if r.model is not None:
            where = r.model.parent(_absolute(dst, dir_fd))
            if where is not None:
                r.model.log("create", [where[0]], where[1])
        return out


def _exchanging(real):
    def wrapper(dir_fd, a, b, *args, **kwargs):
        r = _recorder
        if r is None:
            return real(dir_fd, a, b, *args, **kwargs)
        with r.lock:
            r.point("exchange", f"{_name(a)} <-> {_name(b)}")
            out = real(dir_fd, a, b, *args, **kwargs)
            if out and r.model is not None:
                k = r.model._tracked_dir(f"/proc/self/fd/{dir_fd}")
                if k is not None:
                    r.model.log("exchange", [k], _path(a), _path(b))
            return out
    wrapper.__name__ = getattr(real, "__name__", "_exchange")
    return wrapper


class _File:
    """A file opened for writing with ``open``: ``write``, ``writelines``, ``truncate``, ``flush``
    and ``close`` are counted; everything else goes to the file."""

    def __init__(self, f, name: str):
        object.__setattr__(self, "_f", f)
        object.__setattr__(self, "_label", name)

    def _counted(self, kind, fn, *args):
        r = _recorder
        if r is None:
            return fn(*args)
        with r.lock:
            r.point(kind, self._label)
            return fn(*args)

    def write(self, data):
        return self._counted("write", self._f.write, data)

    def writelines(self, lines):
        return self._counted("write", self._f.writelines, lines)

    def truncate(self, *args):
        return self._counted("ftruncate", self._f.truncate, *args)

    def flush(self):
        if self._f.closed:
            return self._f.flush()
        return self._counted("flush", self._f.flush)

    def close(self):
        if self._f.closed:
            return None
        return self._counted("close", self._f.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __setattr__(self, name, value):
        setattr(self._f, name, value)


def _w_io_open(file, mode="r", *args, **kwargs):
    r = _recorder
    if r is None or not any(c in mode for c in "wax+") or (not isinstance(file, int) and _special(file)):
        return _io_open(file, mode, *args, **kwargs)
    if isinstance(file, int):
        return _File(_io_open(file, mode, *args, **kwargs), f"fd {file}")
    with r.lock:
        r.point("open", _name(file))
        m = r.model
        if m is None:
            return _File(_io_open(file, mode, *args, **kwargs), _name(file))
        p = _absolute(file)
        existed = os.path.lexists(p)
        if existed:
            m.register_path(p)
        f = _io_open(file, mode, *args, **kwargs)
        m.register_fd(f.fileno(), created=not existed)
        if not existed:
            where = m.parent(p)
            if where is not None:
                m.log("create", [where[0]], where[1])
        return _File(f, _name(file))


class _Map(_mmap_class):
    """``mmap.mmap`` whose ``flush`` (``msync``) is a counted call that makes the range durable."""

    def __new__(cls, fileno, length, *args, **kwargs):
        self = super().__new__(cls, fileno, length, *args, **kwargs)
        self._key = None
        if fileno >= 0:
            self._key = _key(O.fstat(fileno))
            r = _recorder
            if r is not None and r.model is not None and kwargs.get("access", mmap.ACCESS_WRITE) != mmap.ACCESS_READ:
                with r.lock:
                    r.model.register_fd(fileno, created=False)
        return self

    def flush(self, *args):
        r = _recorder
        if r is None or self._key is None:
            return super().flush(*args)
        with r.lock:
            r.point("msync", f"inode {self._key[1]}")
            out = super().flush(*args)
            if r.model is not None:
                offset = args[0] if args else 0
                size = args[1] if len(args) > 1 else len(self) - offset
                r.model.synced_range(self._key, offset, size)
            return out


def _replacements() -> list:
    """``(module, name, replacement)`` of every patched entry point."""
    out = [(os, "open", _w_open), (os, "truncate", _w_truncate), (os, "chmod", _w_chmod), (os, "mkdir", _w_mkdir),
           (os, "unlink", _removing("unlink", O.unlink, False)), (os, "remove", _removing("remove", O.remove, False)),
           (os, "rmdir", _removing("rmdir", O.rmdir, True)),
           (os, "rename", _renaming("rename", O.rename)), (os, "replace", _renaming("replace", O.replace)),
           (os, "link", _w_link), (os, "symlink", _w_symlink),
           (builtins, "open", _w_io_open), (io, "open", _w_io_open), (mmap, "mmap", _Map)]
    for kind in ("write", "pwrite", "writev", "pwritev", "ftruncate", "posix_fallocate", "fsync", "fdatasync", "fchmod"):
        if hasattr(O, kind):
            out.append((os, kind, _fd_call(kind, getattr(O, kind))))
    if hasattr(O, "sendfile"):
        out.append((os, "sendfile", _w_sendfile))
    if hasattr(O, "copy_file_range"):
        out.append((os, "copy_file_range", _w_copy_file_range))
    commit = sys.modules.get("nbkit.commit")
    if commit is None:
        try:
            import nbkit.commit as commit
        except ImportError:
            commit = None
    if commit is not None and hasattr(commit, "_exchange"):
        out.append((commit, "_exchange", _exchanging(commit._exchange)))
    return out


def install(crash_at: int | None, report_fd: int, *, power_loss: bool = False, keep_entries: bool = False, roots=(),
            stash: str | None = None) -> Recorder:
    """Start counting (and crash at call ``crash_at``); returns the :class:`Recorder`.

    With ``power_loss``, the crash is a power cut: un-synced file content is lost, and so are
    un-synced directory entries unless ``keep_entries`` (the journal committed the names, the data
    never reached the disk: the zero-length files of a rename before ``fsync``).
    """
    global _recorder
    try:
        import nbkit.commit as commit
    except ImportError:  # an nbkit without the commit module: no exchange to patch
        commit = None
    exchange = getattr(commit, "_exchange", None)
    model = PowerModel(roots, stash, exchange, keep_entries) if power_loss else None
    for module, name, new in _replacements():
        _saved.append((module, name, getattr(module, name)))
        setattr(module, name, new)
    _recorder = Recorder(crash_at, report_fd, model)
    return _recorder


def uninstall() -> None:
    """Put every replaced function back (and stop counting)."""
    global _recorder
    _recorder = None
    while _saved:
        module, name, old = _saved.pop()
        setattr(module, name, old)
