"""The one commit protocol: how every state change reaches the local disk, and what a crash leaves.

A change is *committed*, never hoped for (SQLite, LMDB and git's object store do the same):

1. write a temporary sibling of the target (same directory, so the same filesystem: never
   ``$TMPDIR``), ``fsync`` it;
2. ``rename`` it into place (or, to create once, ``link`` it: first writer wins);
3. ``fsync`` the directory, so the new name survives a power loss too.

Directories are handled through descriptors (:class:`Dir`: ``O_DIRECTORY | O_NOFOLLOW``, then
``*at`` calls with ``dir_fd``), so no path is resolved twice: a directory swapped for a symbolic link
between a check and an action is refused, never followed. A whole directory (an imported or pulled
cache) is staged beside its target under a leftover name (:func:`staging_name`), every file and the
directory synced, then exchanged with the target in one step (``renameat2(RENAME_EXCHANGE)``) where
the kernel has it; elsewhere the old copy is moved aside first and :func:`recover` puts it back if a
crash came between the two renames. Leftovers (staged copies, moved-aside copies, temporary files)
carry names that :func:`leftover_of` recognises, so ``nbkit ls`` lists them and ``nbkit rm`` /
``nbkit prune`` remove them. A full disk is an :class:`OSError` ``ENOSPC`` naming the file, the room
it needed and the fix (:func:`disk_full`).

:func:`file_lock` is a ``flock`` on a freshly opened descriptor, so it excludes other processes and
other threads of this process; forked children (DataLoader workers) close inherited lock descriptors
at once, so a lock held at fork time is never kept alive by a child.

The crash-point tests (``tests/crash``, ``docs/CRASH.md``) kill each operation at every file-system
call it makes and check what is left; every new operation gets an entry there.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with file_lock(os.path.join(d, "x.lock")):
    ...     _ = atomic_write(os.path.join(d, "x"), b"one")
    >>> atomic_write(os.path.join(d, "x"), b"two", exclusive=True), open(os.path.join(d, "x"), "rb").read()
    (False, b'one')
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import stat
import threading
import uuid

from .errors import DiskFullError, LockHeldError, UnsafeArchiveError
from .text import fix, format_bytes
from .trust import open_regular

try:
    import fcntl
except ImportError:  # Windows: no flock; a per-path thread lock still orders this process's threads
    fcntl = None

__all__ = ["CHUNK", "Dir", "file_lock", "atomic_write", "temp_name", "temp_pid", "staging_name", "leftover_of",
           "LEFTOVER_OPS", "claim", "release", "is_claimed", "swap_in", "recover", "remove_tree", "sync_tree", "disk_full", "unnamed_full_disk", "write_all", "makedirs"]

#: Bytes read or written at a time when streaming a file (hashing, copying, archiving).
CHUNK = 4 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Whether this system has the ``*at`` calls (``dir_fd``) that :class:`Dir` needs; else paths are used.
HAS_DIR_FD = {os.open, os.unlink, os.rename, os.mkdir, os.rmdir, os.stat} <= os.supports_dir_fd

# ---------------------------------------------------------------------------------------------
# Names: temporary files and leftovers

#: The operations whose interrupted runs leave a named sibling: ``.<target>.nbkit-<op>-<hex>``.
LEFTOVER_OPS = {
    "import": "an interrupted import of a tar (a copy being unpacked or the cache it replaced)",
    "pull": "an interrupted pull (a copy being downloaded or the cache it replaced)",
    "old": "an interrupted swap (the cache an import or pull replaced)",
    "trash": "an interrupted removal (of a cache removed, pruned or replaced)",
    "create": "an interrupted creation of a cache",
    "export": "an interrupted export (a tar being written)",
    "build": "an interrupted build of a part (a worker of nbkit.cluster killed or stopped while writing it)",
}
_LEFTOVER = re.compile(r"\.(?P<target>.+)\.nbkit-(?P<op>[a-z]+)-(?P<tag>[0-9a-f]{8,32})\Z", re.S)
_TEMP = re.compile(r"\.(?P<target>.+)\.(?P<pid>[0-9]{1,10})\.(?P<tid>[0-9]+)\.(?P<tag>[0-9a-f]{8})\.tmp\Z", re.S)


def staging_name(target: str, op: str) -> str:
    """A fresh sibling name for ``op``'s staged copy of ``target`` (a base name): ``.<target>.nbkit-<op>-<hex>``.

    Example:
        >>> staging_name("mnist", "import").startswith(".mnist.nbkit-import-")
        True
    """
    if op not in LEFTOVER_OPS:
        raise ValueError(f"unknown operation {op!r}; one of {sorted(LEFTOVER_OPS)}")
    return f".{target}.nbkit-{op}-{uuid.uuid4().hex[:12]}"


def leftover_of(name: str) -> tuple[str, str] | None:
    """``(target, what left it)`` for a name made by :func:`staging_name` or :func:`temp_name`, else ``None``.

    Example:
        >>> leftover_of(".mnist.nbkit-pull-0123456789ab")[0], leftover_of("mnist")
        ('mnist', None)
    """
    m = _LEFTOVER.match(name)
    if m and m["op"] in LEFTOVER_OPS:
        return m["target"], LEFTOVER_OPS[m["op"]]
    m = _TEMP.match(name)
    if m:
        return m["target"], f"an interrupted write (a temporary file of process {m['pid']})"
    return None


_claims: dict = {}  # path -> descriptor holding its flock


def claim(path: str) -> None:
    """Mark the staged file or directory ``path`` as being worked on by this process (an exclusive
    ``flock`` held until :func:`release`): :func:`is_claimed` tells cleanup to leave it alone.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); claim(d); is_claimed(d)
        True
        >>> release(d); is_claimed(d)
        False
    """
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX)
    _claims[os.path.abspath(path)] = fd


def release(path: str) -> None:
    """End :func:`claim` of ``path`` (whatever is there now)."""
    fd = _claims.pop(os.path.abspath(path), None)
    if fd is not None:
        os.close(fd)


def is_claimed(path: str) -> bool:
    """Whether a live process (this one included) still works on the leftover ``path``."""
    if os.path.abspath(path) in _claims:
        return True
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def temp_name(path: str) -> str:
    """A temporary name next to ``path``, private to this process and thread: ``.<name>.<pid>.<tid>.<rand>.tmp``.

    Example:
        >>> temp_name("/d/index.bin").startswith("/d/.index.bin.")
        True
    """
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp")


def temp_pid(name: str) -> int | None:
    """The process id in a name made by :func:`temp_name`, or ``None``.

    Example:
        >>> temp_pid(".x.bin.123.456.abcd1234.tmp"), temp_pid("x.bin")
        (123, None)
    """
    m = _TEMP.match(os.path.basename(name))
    return int(m["pid"]) if m else None


# ---------------------------------------------------------------------------------------------
# Full disk


def _free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_full(path: str, needed: int | None = None, cause: BaseException | None = None, *, doing: str = "write",
              note: str = "") -> OSError:
    """The :class:`nbkit.errors.DiskFullError` (``ENOSPC``) for ``path``: which file, how much it
    needed, what is free, and what to do.

    Example:
        >>> str(disk_full("/tmp/c/col-0.bin", 3 << 20)).startswith("not enough disk space to write /tmp/c/col-0.bin: it needs 3.1 MB")
        True
    """
    free = _free_bytes(os.path.dirname(path) or ".")
    need = f": it needs {format_bytes(needed)}" if needed is not None else ""
    have = f", {format_bytes(free)} {'is' if free == 1 else 'are'} free there" if free is not None else ""
    e = DiskFullError(errno.ENOSPC,
                f"not enough disk space to {doing} {path}{need}{have}. Nothing stored before was lost. Free some space "
                f"({fix('free cache space')}) or choose a path on a larger disk, then run it again{note}.")
    e.filename = path
    if cause is not None:
        e.__cause__ = cause
    return e


def unnamed_full_disk(e: BaseException) -> bool:
    """Whether ``e`` is a full disk that no :func:`disk_full` has named yet (a bare ``[Errno 28]``).

    Example:
        >>> unnamed_full_disk(OSError(errno.ENOSPC, "No space left on device")), unnamed_full_disk(disk_full("/d/x"))
        (True, False)
    """
    return isinstance(e, OSError) and e.errno == errno.ENOSPC and not isinstance(e, DiskFullError)


def write_all(fd: int, data, offset: int | None = None, *, path: str = "?") -> None:
    """Write every byte of ``data`` to ``fd`` (at ``offset`` with ``pwrite``); a full disk names ``path``.

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp() + "/x"; fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        >>> write_all(fd, b"abc", path=path); os.close(fd); open(path, "rb").read()
        b'abc'
    """
    view, done = memoryview(data).cast("B"), 0
    try:
        while done < len(view):
            if offset is None:
                done += os.write(fd, view[done:])
            else:
                done += os.pwrite(fd, view[done:], offset + done)
    except OSError as e:
        if unnamed_full_disk(e):
            raise disk_full(path, len(view), e) from e
        raise


# ---------------------------------------------------------------------------------------------
# Directories through descriptors


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """Atomically exchange the entries ``a`` and ``b`` of the directory ``dir_fd``
    (``renameat2(RENAME_EXCHANGE)``); ``False`` where the kernel or filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), 2) == 0:  # RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


_RENAMEAT2: list = []


def _renameat2():
    if not _RENAMEAT2:
        fn = None
        if os.name == "posix" and HAS_DIR_FD:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
                fn = libc.renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (OSError, AttributeError):  # no renameat2 in this libc (musl, macOS)
                fn = None
        _RENAMEAT2.append(fn)
    return _RENAMEAT2[0]


class Dir:
    """A directory held open by descriptor: every name inside it is resolved against the descriptor,
    never by path again, and no symbolic link is followed.

    Args:
        path: the directory (its last component must not be a link).
        parent: open ``path`` (a single name) inside this :class:`Dir` instead.

    Example:
        >>> import tempfile
        >>> with Dir(tempfile.mkdtemp()) as d:
        ...     d.write("a.bin", b"hello"), d.names()
        (True, ['a.bin'])
    """

    def __init__(self, path: str, *, parent: "Dir | None" = None):
        self.path = os.path.join(parent.path, path) if parent is not None else os.path.abspath(path)
        flags = os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC
        try:
            if parent is not None and HAS_DIR_FD:
                self.fd = os.open(path, flags, dir_fd=parent.fd)
            else:
                self.fd = os.open(self.path, flags)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(self.path):
                raise UnsafeArchiveError(f"{self.path} is a symbolic link, not a directory: nbkit never follows one "
                                         "out of a cache. Remove the link, or give the real directory.") from e
            raise
        if not stat.S_ISDIR(os.fstat(self.fd).st_mode):  # systems without O_DIRECTORY
            os.close(self.fd)
            raise NotADirectoryError(errno.ENOTDIR, f"{self.path} is not a directory", self.path)

    # -- plumbing -----------------------------------------------------------------------------

    def _at(self, name: str) -> dict:
        return {"dir_fd": self.fd} if HAS_DIR_FD else {}

    def _p(self, name: str) -> str:
        return name if HAS_DIR_FD else os.path.join(self.path, name)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def anchor(self) -> str:
        """A path that names this very directory (``/proc/self/fd/N`` where the system has it), for
        helpers that take paths: the names below it resolve against the directory held open, never
        against whatever is at :attr:`path` by then."""
        proc = f"/proc/self/fd/{self.fd}"
        return proc if os.path.isdir("/proc/self/fd") else self.path

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "Dir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    # -- reading ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The entries, sorted."""
        return sorted(os.listdir(self.fd if HAS_DIR_FD else self.path))

    def lstat(self, name: str) -> os.stat_result | None:
        """``lstat`` of an entry (a link is described, not followed), or ``None`` if absent."""
        try:
            return os.stat(self._p(name), follow_symlinks=False, **self._at(name))
        except FileNotFoundError:
            return None

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def open(self, name: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """Open a regular file inside (:func:`nbkit.trust.open_regular`: never a link, fifo or device,
        and never a file with other names when writing)."""
        return open_regular(name, flags, mode, dir_fd=self.fd) if HAS_DIR_FD else open_regular(self.join(name), flags, mode)

    # -- changing -----------------------------------------------------------------------------

    def sync(self) -> None:
        """``fsync`` the directory: renames, creations and removals inside it survive a power loss."""
        try:
            os.fsync(self.fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP):  # filesystems that cannot sync a directory
                raise

    def mkdir(self, name: str, mode: int = 0o777) -> None:
        os.mkdir(self._p(name), mode, **self._at(name))

    def unlink(self, name: str, *, missing_ok: bool = True) -> bool:
        """Remove the entry ``name`` (a link is removed itself); return whether it was there."""
        try:
            os.unlink(self._p(name), **self._at(name))
            return True
        except FileNotFoundError:
            if not missing_ok:
                raise
            return False

    def rename(self, src: str, dst: str, *, into: "Dir | None" = None) -> None:
        """Rename ``src`` to ``dst`` (in ``into``, default this directory), replacing a file there."""
        into = into or self
        if HAS_DIR_FD:
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=into.fd)
        else:
            os.replace(self.join(src), into.join(dst))

    def exchange(self, a: str, b: str) -> bool:
        """Swap the entries ``a`` and ``b`` in one step; ``False`` where the system cannot (nothing changed)."""
        return HAS_DIR_FD and _exchange(self.fd, a, b)

    def write(self, name: str, data: bytes, *, exclusive: bool = False, sync: bool = True) -> bool:
        """Commit ``data`` as the file ``name``: a temporary sibling, ``fsync``, rename (``exclusive``:
        link, only if ``name`` is absent), ``fsync`` of the directory. Readers see the old file or the
        whole new one. Returns whether ``name`` now holds ``data``."""
        tmp = os.path.basename(temp_name(name))
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write_all(fd, data, path=self.join(name))
                if sync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if not exclusive:
                self.rename(tmp, name)
            else:
                try:
                    if HAS_DIR_FD:
                        os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
                    else:
                        os.link(self.join(tmp), self.join(name))
                except FileExistsError:
                    return False
                except OSError as e:
                    if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                        raise
                    # A filesystem without hard links (some FUSE mounts): rename-if-absent.
                    if self.exists(name):
                        return False
                    self.rename(tmp, name)
            if sync:
                self.sync()
            return True
        finally:
            self.unlink(tmp)

    #: Directories :meth:`remove_tree` holds open at once: a deeper one is first moved up into the
    #: top of the tree being removed (one rename, same filesystem), so an untrusted tree of any depth
    #: (a 3,000-level chain in a leftover) needs neither recursion nor a descriptor per level.
    REMOVE_DEPTH = 64

    def remove_tree(self, name: str) -> None:
        """Remove the entry ``name`` and, if it is a directory, everything below it, through
        descriptors: a link is removed itself, never followed; a name swapped for a link meanwhile is
        removed as the link. Iterative: an explicit stack of at most :data:`REMOVE_DEPTH` directories."""
        st = self.lstat(name)
        if st is None:
            return
        if not stat.S_ISDIR(st.st_mode):
            self.unlink(name)
            return
        top = self._enter(name)
        if top is None:
            return
        stack = [(self, name, top, iter(top.names()))]  # (parent, name in it, the directory held, names left)
        try:
            while stack:
                parent, here, d, names = stack[-1]
                child = next(names, None)
                if child is None:
                    again = d.names()  # what was moved up into the top meanwhile
                    if again:
                        stack[-1] = (parent, here, d, iter(again))
                        continue
                    stack.pop()
                    d.close()
                    try:
                        os.rmdir(parent._p(here), **parent._at(here))
                    except FileNotFoundError:
                        pass
                    continue
                cst = d.lstat(child)
                if cst is None:
                    continue
                if not stat.S_ISDIR(cst.st_mode):
                    d.unlink(child)
                elif len(stack) >= self.REMOVE_DEPTH:
                    d.rename(child, f".nbkit-deep-{uuid.uuid4().hex}", into=top)
                elif (sub := d._enter(child)) is not None:
                    stack.append((d, child, sub, iter(sub.names())))
        finally:
            for _, _, d, _ in stack:
                d.close()

    def _enter(self, name: str) -> "Dir | None":
        """The directory ``name`` held open, or ``None``: gone, or swapped for a link or a file
        since it was seen (that entry is then removed itself)."""
        try:
            return Dir(name, parent=self)
        except (OSError, ValueError) as e:
            if isinstance(e, FileNotFoundError):
                return None
            self.unlink(name)
            return None


# ---------------------------------------------------------------------------------------------
# Whole directories


def sync_tree(path: str) -> None:
    """``fsync`` every regular file under ``path``, then every directory (deepest first), so what was
    written there survives a power loss before it is renamed into place.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = atomic_write(d + "/x", b"1", sync=False); sync_tree(d)
    """
    with Dir(path) as d:
        _sync_dir(d)


def _sync_dir(d: Dir) -> None:
    for name in d.names():
        st = d.lstat(name)
        if st is None:
            continue
        if stat.S_ISDIR(st.st_mode):
            with Dir(name, parent=d) as sub:
                _sync_dir(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = d.open(name)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    d.sync()


def swap_in(staged: str, dest: str) -> None:
    """Put the directory ``staged`` (a sibling of ``dest`` named by :func:`staging_name`, already
    synced with :func:`sync_tree`) at ``dest``, replacing whatever directory is there.

    At every instant a whole directory is at ``dest``: the two are exchanged in one step where the
    kernel can (``renameat2``); elsewhere the old one is renamed aside to ``.<dest>.nbkit-old-<hex>``
    first and :func:`recover` (run by every open) renames it back if a crash came before the new one
    was in place. The replaced copy is removed last; a crash before that leaves it as a leftover.

    Example:
        >>> import tempfile
        >>> parent = tempfile.mkdtemp(); dest = os.path.join(parent, "c"); os.mkdir(dest)
        >>> staged = os.path.join(parent, staging_name("c", "import")); os.mkdir(staged)
        >>> _ = atomic_write(os.path.join(staged, "new"), b"x"); swap_in(staged, dest)
        >>> os.listdir(dest), os.listdir(parent)
        (['new'], ['c'])
    """
    parent, name = os.path.split(os.path.abspath(dest))
    staged_name = os.path.basename(staged)
    if os.path.dirname(os.path.abspath(staged)) != parent:
        raise ValueError(f"{staged} must be beside {dest}")
    umask = os.umask(0)
    os.umask(umask)
    with Dir(parent) as p:
        os.chmod(p._p(staged_name), 0o777 & ~umask, **({"dir_fd": p.fd} if HAS_DIR_FD else {}))  # mkdtemp made it 0700
        st = p.lstat(name)
        if st is None:
            p.rename(staged_name, name)
            p.sync()
            return
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, f"{dest} exists and is not a directory; choose another cache path", dest)
        if p.exchange(staged_name, name):
            p.sync()
            old = staged_name  # now holds the replaced copy, under a leftover name
        else:
            old = staging_name(name, "old")
            p.rename(name, old)
            p.sync()
            p.rename(staged_name, name)
            p.sync()
        p.remove_tree(old)
        p.sync()


def recover(dest: str) -> bool:
    """After a crash inside :func:`swap_in`'s fallback: if nothing is at ``dest`` but a copy moved
    aside for it is, rename that copy back. Returns whether it did. Cheap when ``dest`` exists.

    Example:
        >>> import tempfile
        >>> parent = tempfile.mkdtemp(); os.mkdir(os.path.join(parent, staging_name("c", "old")))
        >>> recover(os.path.join(parent, "c")), os.listdir(parent)
        (True, ['c'])
    """
    dest = os.path.abspath(dest)
    if os.path.lexists(dest):
        return False
    parent, name = os.path.split(dest)
    try:
        with Dir(parent) as p:
            moved = [n for n in p.names() if (m := _LEFTOVER.match(n)) and m["op"] == "old" and m["target"] == name]
            if len(moved) != 1:
                return False
            try:
                if HAS_DIR_FD:  # rename-if-absent: never over a directory another process just created
                    os.rename(moved[0], name, src_dir_fd=p.fd, dst_dir_fd=p.fd)
                else:
                    os.rename(p.join(moved[0]), dest)
            except OSError as e:
                if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOENT):
                    return False
                raise
            p.sync()
            return True
    except FileNotFoundError:
        return False


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything below it through descriptors (:meth:`Dir.remove_tree`).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); os.makedirs(d + "/a/b"); remove_tree(d + "/a"); os.listdir(d)
        []
    """
    parent, name = os.path.split(os.path.abspath(path))
    try:
        with Dir(parent) as p:
            p.remove_tree(name)
            p.sync()
    except FileNotFoundError:
        pass


# ---------------------------------------------------------------------------------------------
# Files by path (one directory descriptor each)


def atomic_write(path: str, data: bytes, *, exclusive: bool = False, sync: bool = True) -> bool:
    """Commit ``data`` to ``path`` so that readers see the old file or the whole new one, never a part
    (:meth:`Dir.write`: a temporary sibling, ``fsync``, rename or link, ``fsync`` of the directory).

    Args:
        path: the file to write.
        data: its new content.
        exclusive: create ``path`` only if it does not exist (hard link; rename-if-absent on
            filesystems without links); an existing file is left as it is.
        sync: make it durable (``fsync`` of the file and the directory); ``False`` only for files
            that can be made again at no cost.

    Returns:
        Whether ``path`` now holds ``data`` (``False`` only when ``exclusive`` found a file there).

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp() + "/x"
        >>> atomic_write(path, b"1"), open(path, "rb").read()
        (True, b'1')
    """
    head, tail = os.path.split(os.path.abspath(path))
    with Dir(head) as d:
        return d.write(tail, data, exclusive=exclusive, sync=sync)


# Lock descriptors open in this process. A forked child inherits them, and a flock lasts while any
# copy is open: the child closes its copies at once, or a lock held by another thread at fork time
# would never be released.
_open_locks: set = set()
_open_locks_guard = threading.Lock()
_thread_locks: dict = {}  # path -> threading.Lock, only where fcntl is missing


def _close_inherited_locks() -> None:
    for fd in _open_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_locks.clear()
    _open_locks_guard.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_open_locks_guard.acquire, after_in_parent=_open_locks_guard.release,
                        after_in_child=_close_inherited_locks)


#: Seconds nbkit waits for a ``flock`` another process holds on a cache's file before it says so:
#: a stuck process, or anyone able to read the file holding it, never makes nbkit wait without end.
LOCK_SECONDS = 30.0

#: ``errno``s of a filesystem without ``flock`` (some network and FUSE mounts): nothing is locked there.
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)


def flock_within(fd: int, *, shared: bool = False, seconds: float | None = None) -> bool:
    """``flock`` ``fd``, waiting at most ``seconds`` (default :data:`LOCK_SECONDS`); whether it got
    it. ``True`` where there are no locks (no ``fcntl``, a filesystem without them).

    A lock that is free is taken at once. Otherwise a helper thread waits in a blocking ``flock`` on
    a duplicate of ``fd`` (the same open file description, so the lock it gets is ``fd``'s): the
    kernel wakes it at the release, as a plain ``flock`` would be, and ``/proc/locks`` shows this
    process waiting. Past ``seconds`` the caller gives up; the helper, once it gets the lock, only
    closes its duplicate (the lock then goes with ``fd``'s last descriptor, or at its next unlock).

    Example:
        >>> import tempfile
        >>> fd = os.open(tempfile.mkdtemp(), os.O_RDONLY)
        >>> flock_within(fd, seconds=0.1)
        True
        >>> os.close(fd)
    """
    if fcntl is None:
        return True
    op = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError as e:
        if e.errno in NO_LOCKS:
            return True
        raise
    with _open_locks_guard:  # a child forked meanwhile closes its copy at once (it would keep the lock)
        waiter = os.dup(fd)
        _open_locks.add(waiter)
    got, guard, state = threading.Event(), threading.Lock(), {"abandoned": False, "error": None}

    def wait() -> None:
        try:
            fcntl.flock(waiter, op)
        except OSError as e:  # handed to the caller
            state["error"] = e
        with guard:
            if state["abandoned"]:
                _close_lock(waiter)
                return
            got.set()

    threading.Thread(target=wait, name="nbkit-flock-wait", daemon=True).start()
    got.wait(LOCK_SECONDS if seconds is None else seconds)
    with guard:
        if not got.is_set():
            state["abandoned"] = True
            return False
    _close_lock(waiter)  # the lock stays: fd's open file description holds it
    error = state["error"]
    if error is not None:
        if error.errno in NO_LOCKS:
            return True
        raise error
    return True


def lock_or_raise(fd: int, path: str, *, shared: bool = False, why: str = "") -> None:
    """:func:`flock_within`, or :class:`nbkit.errors.LockHeldError` naming ``path``, ``why`` it is
    locked (what nbkit itself holds it for) and how to find the process holding it.

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp(); fd = os.open(path, os.O_RDONLY)
        >>> lock_or_raise(fd, path, shared=True); os.close(fd)
    """
    if not flock_within(fd, shared=shared):
        raise LockHeldError(
            f"{path} has been locked by another process for {LOCK_SECONDS:g} s{f' ({why})' if why else ''}, and nbkit "
            f"does not wait without end. Find that process with `fuser -v {path}` (or `lsof {path}`) and let it finish "
            "or end it, then run this again.")


@contextlib.contextmanager
def file_lock(path: str):
    """Hold an exclusive lock on ``path`` (created if absent) for the block; blocks while anyone else holds it.

    Example:
        >>> import tempfile
        >>> with file_lock(tempfile.mkdtemp() + "/a.lock"):
        ...     pass
    """
    if fcntl is None:
        with _open_locks_guard:
            lock = _thread_locks.setdefault(os.path.abspath(path), threading.Lock())
        with lock:
            yield
        return
    while True:
        makedirs(os.path.dirname(path) or ".")
        with _open_locks_guard:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | _CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # its directory was removed since makedirs (nbkit rm): made again
            _open_locks.add(fd)
        try:
            lock_or_raise(fd, path, why="nbkit holds it while it appends to a cache's heap or commits one file")
            # The holder before us may have unlinked the lock file (nbkit.remove removes a cache's
            # heap.lock last, holding it): a lock on a file no longer at ``path`` excludes nobody.
            if _same_file(fd, path):
                break
        except BaseException:
            _close_lock(fd)
            raise
        _close_lock(fd)
    try:
        yield
    finally:
        _close_lock(fd)  # releases the lock


def makedirs(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)``, also when another process removes ``path`` meanwhile
    (``nbkit rm`` of an empty cache directory): made again, never a ``FileExistsError`` for a directory.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp() + "/a/b"; makedirs(d); makedirs(d); os.path.isdir(d)
        True
    """
    while True:
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileExistsError:
            if os.path.lexists(path) and not os.path.isdir(path):
                raise


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _close_lock(fd: int) -> None:
    with _open_locks_guard:
        _open_locks.discard(fd)
        os.close(fd)
