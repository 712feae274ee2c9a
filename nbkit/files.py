"""Local file helpers every layer shares: one exclusive file lock and one atomic write.

:func:`file_lock` is a ``flock`` on a freshly opened descriptor, so it excludes other processes
*and* other threads of this process, and forked children (DataLoader workers) close inherited lock
descriptors at once, so a lock held at fork time is never kept alive by a child. :func:`atomic_write`
writes a private temporary file and renames it into place (or, with ``exclusive=True``, links it
into place only if nothing is there yet: create once, first writer wins).

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
import errno
import os
import threading
import uuid

try:
    import fcntl
except ImportError:  # Windows: no flock; a per-path thread lock still orders this process's threads
    fcntl = None

__all__ = ["CHUNK", "file_lock", "atomic_write", "temp_name"]

#: Bytes read or written at a time when streaming a file (hashing, copying, archiving).
CHUNK = 4 << 20

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
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with _open_locks_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        _open_locks.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with _open_locks_guard:
            _open_locks.discard(fd)
            os.close(fd)  # releases the lock


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
    parts = name.split(".")
    try:
        return int(parts[-4]) if parts[-1] == "tmp" else None
    except (IndexError, ValueError):
        return None


def atomic_write(path: str, data: bytes, *, exclusive: bool = False, sync: bool = False) -> bool:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part.

    Args:
        path: the file to write.
        data: its new content.
        exclusive: create ``path`` only if it does not exist (hard link; rename-if-absent on
            filesystems without links); an existing file is left as it is.
        sync: ``fsync`` the data before it becomes visible.

    Returns:
        Whether ``path`` now holds ``data`` (``False`` only when ``exclusive`` found a file there).
    """
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            # A filesystem without hard links (some FUSE mounts): fall back to rename-if-absent.
            if os.path.exists(path):
                return False
            os.replace(tmp, path)
            return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
