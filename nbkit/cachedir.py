"""One local cache directory: its memory-mapped files (:class:`CacheFiles`, the local sample store)
and the operations on the directory: find it, count and verify what it stores without building a
dataset, replace it by swapping a checked copy into place.

Example:
    >>> import tempfile, torch, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tempfile.mkdtemp())
    >>> _ = ds[:3]
    >>> stored_count(ds.root), data_files(ds.root), verify(ds.root)
    ((3, 8), ['index.bin', 'col-0.bin'], 3)
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import stat
import time
import weakref
from dataclasses import dataclass

import numpy as np

from . import format as fmt
from . import trust
from .errors import CorruptCacheError, LockHeldError, UnsafeArchiveError
from .commit import (NO_LOCKS, Dir, claim, disk_full, file_lock, is_claimed, leftover_of, lock_or_raise, makedirs, recover, release, remove_tree, staging_name, swap_in,
                     sync_tree, write_all)
from .gather import gather_rows, physical_memory, read_mode, resident, will_need
from .stores.base import Store

try:
    import fcntl
except ImportError:  # Windows: no flock, so whether a cache is in use cannot be known
    fcntl = None

__all__ = ["CacheFiles", "cache_root", "data_files", "stored_count", "verify", "remove_cache", "check_replaceable",
           "swap_into_place", "stage_dir", "discard_stage", "sweep_leftovers", "create_cache", "interrupted", "frozen", "open_files", "hold_in_use", "unused", "in_use", "allocated",
           "PARTS_SUFFIX", "is_part_name", "PartsListing", "parts_listing"]


# -- a build's parts directory (nbkit.cluster): listed and removed by nbkit.disk ------------------------

#: A cache's parts live beside it, in ``<cache>.parts`` (``nbkit.cluster.part.parts_dir``).
PARTS_SUFFIX = ".parts"
#: Digits of each bound in a part's name: enough for the largest cache (``format.MAX_LENGTH``, 2**40).
PART_DIGITS = 13
#: A part's directory name, ``part-<start>-<stop>`` (``nbkit.cluster.part.part_name``).
PART_NAME = re.compile(r"part-(?P<start>[0-9]{%d})-(?P<stop>[0-9]{%d})\Z" % (PART_DIGITS, PART_DIGITS))


def is_part_name(name: str) -> bool:
    """Whether ``name`` is a part's (``part-<start>-<stop>``, 13 digits each).

    Example:
        >>> is_part_name("part-0000000000000-0000000004096"), is_part_name("col-0.bin")
        (True, False)
    """
    return PART_NAME.match(name) is not None


@dataclass(frozen=True)
class PartsListing:
    """What a parts directory holds: ``parts`` (whole ones), ``builds`` (interrupted or running
    builds and removals of parts: staging leftovers), and ``claimed`` (those a live process works on)."""

    parts: int
    builds: int
    claimed: int


def parts_listing(d: Dir) -> PartsListing | None:
    """The :class:`PartsListing` of the directory ``d`` (held open) when it is a parts directory: its
    name ends in :data:`PARTS_SUFFIX` and every entry is a part or a leftover of one; else ``None``
    (a directory holding anything else is not nbkit's to remove whole).

    Example:
        >>> import tempfile
        >>> top = tempfile.mkdtemp(); os.makedirs(top + "/c.parts/part-0000000000000-0000000000016")
        >>> with Dir(top + "/c.parts") as d:
        ...     parts_listing(d)
        PartsListing(parts=1, builds=0, claimed=0)
    """
    if not d.path.endswith(PARTS_SUFFIX):
        return None
    parts = builds = claimed = 0
    for name in d.names():
        if is_part_name(name):
            parts += 1
            continue
        left = leftover_of(name)
        if left is None or not is_part_name(left[0]):
            return None
        builds += 1
        claimed += is_claimed(os.path.join(d.anchor, name))  # through the descriptor: any path length
    return PartsListing(parts, builds, claimed)


def cache_root(cache_path) -> str:
    """The absolute local directory of a cache, or ``FileNotFoundError`` naming the fix."""
    root = os.path.abspath(os.path.expanduser(os.fspath(cache_path)))
    recover(root)  # a swap interrupted by a crash: put the moved-aside cache back
    fmt.read_meta(root)  # raises FileNotFoundError / CorruptCacheError with the fix
    return root


def data_files(root: str) -> list[str]:
    """The cache's data files (without ``nbkit.json``), in copy order."""
    return [n for n in fmt.list_cache_files(root) if n != fmt.META]


def open_files(root: str, *, writable: bool = False) -> "CacheFiles":
    """The :class:`CacheFiles` of the cache at ``root`` (close them when done)."""
    return CacheFiles(root, fmt.read_meta(root), writable=writable)


def stored_count(root: str) -> tuple[int, int]:
    """``(stored, length)`` of the cache at ``root``; samples outside a byte budget count as stored
    (there is nothing to fill), so ``stored == length`` means complete."""
    files = open_files(root)
    try:
        return files.length - len(files.missing()), files.length
    finally:
        files.close()


def verify(root: str, callback=None) -> int:
    """Check every stored sample of the cache at ``root`` against its checksum; return how many.

    Raises:
        CorruptCacheError: listing the first damaged samples.
    """
    files = open_files(root)
    try:
        return fmt.verify_store(files, where=root, callback=callback)
    finally:
        files.close()  # release the maps before the directory is renamed


def check_replaceable(dest: str) -> None:
    """``dest`` may be absent, an empty directory, or an nbkit cache; never anything else."""
    if not os.path.exists(dest):
        return
    if not os.path.isdir(dest):
        raise NotADirectoryError(f"{dest} exists and is not a directory; choose another cache path")
    if os.listdir(dest) and not os.path.exists(os.path.join(dest, fmt.META)):
        raise FileExistsError(f"{dest} exists, is not empty and is not an nbkit cache; choose another path or empty it first")


def swap_into_place(tmp: str, dest: str) -> None:
    """Make the directory ``tmp`` (staged beside ``dest`` under :func:`nbkit.commit.staging_name`)
    durable, then put it at ``dest`` in place of what is there (:func:`nbkit.commit.swap_in`: a whole
    cache is at ``dest`` at every instant, even across a crash or a power loss)."""
    sync_tree(tmp)
    try:
        swap_in(tmp, dest)
    finally:
        release(tmp)


def stage_dir(dest: str, op: str) -> str:
    """A new empty directory beside ``dest`` for ``op`` (``"import"``, ``"pull"``) to build a copy in,
    named so that ``nbkit ls`` lists it and ``nbkit rm`` removes it if the process dies.

    Example:
        >>> import tempfile
        >>> tmp = stage_dir(tempfile.mkdtemp() + "/cache", "import"); name = os.path.basename(tmp); discard_stage(tmp)
        >>> name.startswith(".cache.nbkit-import-"), os.path.exists(tmp)
        (True, False)
    """
    parent, name = os.path.split(os.path.abspath(dest))
    sweep_leftovers(dest)
    path = os.path.join(parent, staging_name(name, op))
    os.mkdir(path, 0o700)
    claim(path)  # released by swap_into_place or discard_stage: cleanup leaves a live one alone
    return path


def sweep_leftovers(dest: str) -> list[str]:
    """Remove what interrupted operations left beside ``dest`` (``.<name>.nbkit-<op>-<hex>`` siblings
    no live process claims); return their paths. The next import, pull or export cleans up this way.

    Example:
        >>> import tempfile
        >>> parent = tempfile.mkdtemp(); os.mkdir(os.path.join(parent, staging_name("c", "pull")))
        >>> len(sweep_leftovers(os.path.join(parent, "c"))), os.listdir(parent)
        (1, [])
    """
    parent, name = os.path.split(os.path.abspath(dest))
    swept = []
    try:
        with Dir(parent) as p:
            for entry in p.names():
                left = leftover_of(entry)
                if left is None or left[0] != name or entry.endswith(".tmp") or is_claimed(p.join(entry)):
                    continue
                p.remove_tree(entry)
                swept.append(p.join(entry))
            if swept:
                p.sync()
    except FileNotFoundError:
        pass
    return swept


def discard_stage(path: str) -> None:
    """Remove a directory made by :func:`stage_dir` (an import or pull that failed or stopped)."""
    release(path)
    remove_tree(path)


def remove_cache(root: "str | Dir") -> None:
    """Delete the cache files in ``root``: metadata first and durably, so that from then on the
    directory is not a cache, then the data files (a crash in between leaves data files without
    metadata, which :func:`create_cache` wipes before it builds anything there: never adopted).

    Works through the directory's descriptor (a ``root`` swapped for a link is refused, never
    followed). Only names of the fixed pattern (:data:`nbkit.trust.CACHE_FILE`), the lock and
    nbkit's own temporary files directly in ``root`` are removed, never a name that metadata carries;
    a symbolic link is removed itself, never what it points to.
    """
    if isinstance(root, Dir):  # already held open by the caller: no second lookup of the path
        _remove_cache_in(root)
        return
    try:
        d = Dir(root)
    except (FileNotFoundError, NotADirectoryError):
        return
    with d:
        _remove_cache_in(d)


def _remove_cache_in(d: Dir) -> None:
    # Under the cache's lock, which create_cache holds while it builds: a removal never takes files
    # from under a creation in progress (leaving nbkit.json published over missing data files), and a
    # creation waits for a removal to end. The lock file goes with the rest; file_lock's waiters see
    # that and lock the new one.
    lock = _lock_in(d)
    try:
        _remove_locked(d)
    finally:
        if lock is not None:
            os.close(lock)


def _lock_in(d: Dir) -> int | None:
    """``heap.lock`` in ``d`` opened and ``flock``-ed exclusively, or ``None`` where it cannot be
    (no ``flock``, a link or no regular file under its name: removed like the rest, never followed)."""
    if fcntl is None:
        return None
    while True:
        try:
            fd = d.open(fmt.LOCK, os.O_RDWR | os.O_CREAT)
        except (OSError, ValueError):
            return None
        try:
            lock_or_raise(fd, d.join(fmt.LOCK), why="nbkit holds it while it appends to the cache's heap")
        except OSError:
            os.close(fd)
            raise
        st, mine = d.lstat(fmt.LOCK), os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # the removal before this one unlinked it: lock the one there now


def _remove_locked(d: Dir) -> None:
    # A marker first, durably (nbkit.json itself becomes it): from then on the directory is not a
    # cache, and until the marker goes last, nbkit ls lists it as an interrupted removal.
    marker = staging_name(fmt.META, "trash")
    if d.exists(fmt.META):
        d.rename(fmt.META, marker)
    elif any(trust.is_cache_file(n) for n in d.names()):
        os.close(d.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    else:
        marker = None
    d.sync()
    _remove_data(d)
    for n in d.names():  # this removal's marker, and those of interrupted ones before it
        if _is_marker(n):
            d.unlink(n)
    d.sync()


def _remove_data(d: Dir, *, keep_lock: bool = False) -> None:
    """Unlink the data files, the lock (unless ``keep_lock``: the caller holds it) and leftover
    temporary files in ``d`` (never a directory, never a marker)."""
    names = d.names()
    doomed = sorted(n for n in names if n != fmt.META and trust.is_cache_file(n))
    doomed += [n for n in names if (left := leftover_of(n)) is not None and (trust.is_cache_file(left[0]) or left[0] == fmt.LOCK)
               and not _is_marker(n)]
    for name in doomed + ([] if keep_lock else [fmt.LOCK]):
        st = d.lstat(name)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            d.unlink(name)  # never follows a link


def _is_marker(name: str) -> bool:
    return name.startswith(f".{fmt.META}.nbkit-")


def interrupted(root: str) -> str | None:
    """What an interrupted removal or creation left at ``root`` (a marker ``.nbkit.json.nbkit-<op>-…``
    and no ``nbkit.json``): that operation's description, or ``None``.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); os.close(os.open(os.path.join(d, staging_name(fmt.META, "trash")), os.O_CREAT | os.O_WRONLY))
        >>> interrupted(d)
        'an interrupted removal (of a cache removed, pruned or replaced)'
    """
    try:
        names = os.listdir(root)
    except OSError:
        return None
    if fmt.META in names:
        return None
    for n in names:
        if _is_marker(n) and (left := leftover_of(n)) is not None:
            return left[1]
    return None


def create_cache(root: str, meta: dict) -> dict:
    """Create the cache ``meta`` at ``root`` unless one is there already; return the metadata that is there.

    Under the cache's lock: if ``nbkit.json`` exists, it wins (another process created the cache
    first). Else any data files in ``root`` belong to no cache (an interrupted removal or creation, or
    a ``nbkit.json`` deleted by hand): they are removed, never adopted. Then the files are created and
    sized, made durable, and ``nbkit.json`` is published last, durably.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())  # creates it
        >>> create_cache(ds.root, dict(ds.store.meta, generation="another"))["generation"] == ds.store.meta["generation"]
        True
    """
    recover(root)  # before anything is made at root: a swap interrupted there puts the old cache back
    makedirs(root)
    with file_lock(os.path.join(root, fmt.LOCK)):
        with Dir(root) as d:
            if d.exists(fmt.META):
                return fmt.read_meta(root)
            # A marker until nbkit.json is published: a crash before leaves a directory nbkit ls
            # lists as an interrupted creation (and this function wipes it on the next try).
            marker = staging_name(fmt.META, "create")
            os.close(d.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            d.sync()
            _remove_data(d, keep_lock=True)  # the lock we hold: unlinked, it would let a removal in now
            files = CacheFiles(root, meta, writable=True, create=True)
            try:
                files.sync()
            finally:
                files.close()
            d.sync()
            published = fmt.publish_meta(root, meta)
            for n in d.names():
                if _is_marker(n):
                    d.unlink(n)
            d.sync()
        return published


def _lock_meta(root: str, exclusive: bool) -> tuple[int | None, bool | None]:
    """``(fd, locked)``: ``root/nbkit.json`` opened and ``flock``-ed, shared (waiting while an
    exclusive holder has it) or exclusive without waiting. ``locked`` is ``False`` when the exclusive
    lock was refused (a process has the cache open), ``None`` when use cannot be known (no ``flock``,
    no metadata, a filesystem without locks); the caller closes ``fd`` when it is not ``None``."""
    if fcntl is None:
        return None, None
    try:
        fd = trust.open_regular(os.path.join(root, fmt.META))
    except FileNotFoundError:
        return None, None
    try:
        if exclusive:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            lock_or_raise(fd, os.path.join(root, fmt.META), shared=True,
                          why="held exclusively, as nbkit rm does while it removes the cache")
    except BlockingIOError:
        return fd, False
    except LockHeldError:
        os.close(fd)
        raise
    except OSError as e:
        if e.errno in NO_LOCKS:
            return fd, None
        os.close(fd)
        raise
    return fd, True


def allocated(st: os.stat_result) -> int:
    """Bytes a file takes on disk: its allocated blocks (a preallocated, sparse column counts what
    is written), or its size where the system does not say.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.truncate(1 << 30)      # 1 GiB long, nothing written
        ...     allocated(os.fstat(f.fileno())) < 1 << 20
        True
    """
    return st.st_blocks * 512 if hasattr(st, "st_blocks") else st.st_size


def hold_in_use(root: str) -> int | None:
    """A descriptor of ``root/nbkit.json`` holding a shared ``flock``: the cache is in use while it is open.

    Every process that opens a cache's files holds one (:class:`CacheFiles`); DataLoader workers
    hold their own (forked ones also share their parent's until they exit). ``None`` where there is
    no metadata yet (a cache being created) or the filesystem has no ``flock``.
    """
    fd, locked = _lock_meta(root, exclusive=False)  # waits only while nbkit.remove holds the cache
    if fd is not None and not locked:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def unused(root: str):
    """Hold ``root/nbkit.json`` exclusively for the block; yields whether no process has the cache open.

    ``True`` also where use cannot be known (no ``flock``, no metadata). While the block runs and
    holds the lock, processes opening the cache wait.
    """
    fd, locked = _lock_meta(root, exclusive=True)
    try:
        yield locked is not False
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def frozen(root: str):
    """Hold off every writer of the cache at ``root`` for the block (``flock`` on ``index.bin``, which
    :meth:`CacheFiles.put` holds shared while it writes): what is read inside is one consistent state.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> with frozen(ds.root):
        ...     stored_count(ds.root)
        (0, 4)
    """
    with Dir(root) as d:
        fd = d.open(fmt.INDEX)
    try:
        lock_or_raise(fd, os.path.join(root, fmt.INDEX), why="nbkit holds it shared while it stores samples")
        yield
    finally:
        os.close(fd)  # releases the lock


def in_use(root: str) -> bool:
    """Whether a process (this one included) has the cache at ``root`` open now.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tempfile.mkdtemp())
        >>> _ = ds[0]  # reading opens the files
        >>> in_use(ds.root)
        True
        >>> root = ds.root; del ds  # a dataset dropped (or its store closed) no longer uses the cache
        >>> in_use(root)
        False
    """
    with unused(root) as free:
        return not free


def _close_fds(fds: list) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _map(path: str, size: int, writable: bool, create: bool = False):
    """``(mmap, fd)`` of ``path`` holding exactly ``size`` bytes; ``create`` makes and sizes it.

    A cache's files are made only when it is created (:func:`create_cache`): a writer opening an
    existing cache never creates one (a cache removed under it is an error, not a new orphan file).
    :func:`nbkit.trust.open_regular` refuses to open a file with other names for writing."""
    flags = os.O_RDWR | (os.O_CREAT if create else 0) if writable else os.O_RDONLY
    try:
        fd = trust.open_regular(path, flags)
    except FileNotFoundError:
        raise CorruptCacheError(f"{path} is missing: the cache was removed or is incomplete. Open it again "
                                "(nbkit.CachedDataset(source, path) re-creates it), or re-import it.") from None
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            if not writable:
                raise CorruptCacheError(
                    f"{path} is {actual} bytes, expected {size}: the cache is truncated. Open it with its source "
                    "(nbkit.CachedDataset(source, path)) to recompute the lost samples, or re-import it.")
            # A writer (the source is there) sizes the file again: the lost rows read as zeros, fail their
            # checksums and are recomputed; every sample that survived is kept.
            _preallocate(fd, path, actual, size)
        elif actual > size:
            raise CorruptCacheError(f"{path} is {actual} bytes, expected {size}: it does not belong to this cache's metadata.")
        if size == 0:
            return None, fd
        return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ), fd
    except BaseException:
        os.close(fd)
        raise


def _preallocate(fd: int, path: str, actual: int, size: int) -> None:
    free = os.statvfs(os.path.dirname(path) or ".")
    if size - actual > free.f_bavail * free.f_frsize:
        raise disk_full(path, size - actual, doing="create the cache file")
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, actual, size - actual)
        else:
            os.ftruncate(fd, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise disk_full(path, size - actual, e, doing="create the cache file") from e
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            os.ftruncate(fd, size)
        else:
            raise


#: Samples smaller than this (all columns) of a cache that fits in RAM are copied from the map even
#: when not resident: the kernel's read-ahead of a page fault brings in their neighbours too (a
#: cold MNIST epoch: 0.46 s through the map, 1.3 s with one pread a row).
PREAD_MIN_ROW_BYTES = 64 << 10
#: How long a batch found resident makes the next ones be taken as resident too.
RESIDENT_SECONDS = 1.0


class CacheFiles(Store):
    """The memory-mapped files of one cache directory, opened in one process.

    Not shared between processes: each process (DataLoader worker, TPU process) opens its own.
    """

    def __init__(self, root: str, meta: dict, *, writable: bool, create: bool = False):
        super().__init__(meta, writable=writable)
        self.root = root
        self._fds = []
        # Closed by close(), or when the object is collected (a dataset dropped without closing).
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        use = hold_in_use(root)  # first: a cache nbkit.remove holds is waited for before any file is mapped
        if use is not None:
            self._fds.append(use)
        self._where = os.path.join(root, fmt.META)
        mm, fd = _map(trust.cache_file_path(root, fmt.INDEX, self._where), self.length * fmt.RECORD.itemsize, writable, create)
        self._fds.append(fd)
        self._index_fd = fd
        self._index_mmap = mm
        if mm is None:
            self.records = np.zeros(0, fmt.RECORD)
        else:
            self.records = np.frombuffer(mm, dtype=fmt.RECORD, count=self.length)
        self.state = self.records["state"]
        self.flags = self.records["flags"]
        self.crc = self.records["crc"]
        self.off = self.records["off"]
        self.len = self.records["len"]
        self.columns = []
        self.column_fds = []
        self._column_files = []  # (fd, path) of each column file, for explicit reads
        for k, leaf in enumerate(self.schema.columns):
            dtype = self.schema.column_dtype(leaf)
            shape = (self.capacity, *leaf.shape)
            nbytes = self.capacity * self.schema.row_bytes(leaf)  # bounded by parse_meta
            cpath = trust.cache_file_path(root, fmt.column_file(k), self._where)
            cm, cfd = _map(cpath, nbytes, writable, create)
            self._fds.append(cfd)
            self.column_fds.append(cfd)
            self._column_files.append((cfd, cpath))
            if cm is None:
                self.columns.append(np.zeros(shape, dtype))
            else:
                self.columns.append(np.frombuffer(cm, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape))
        # Columns larger than this host's memory are always read with explicit reads: their pages can
        # never all be resident, and copies through the map would count every page read in this
        # process's resident set.
        self._resident_until = 0.0  # until then (time.monotonic), batches are taken to be resident
        ram = physical_memory()
        self._past_ram = 0 < ram < sum(c.nbytes for c in self.columns)
        self._small_rows = sum(c.strides[0] if c.ndim else 0 for c in self.columns) < PREAD_MIN_ROW_BYTES
        self._heap_fd = None
        self._heap_size = 0  # bytes of heap.bin known to exist (refreshed when a record points further)
        if os.path.lexists(os.path.join(root, fmt.HEAP)):
            # Opened now, so that a heap.bin that is no regular file fails the open, not each sample
            # (which would look like damaged records).
            try:
                self._heap()
            except BaseException:
                self.close()
                raise

    # -- the store interface the engine uses --------------------------------------------------

    def is_stored(self, idx: np.ndarray) -> np.ndarray:
        # A record in an unknown state counts as stored: its check then fails (see flags_of), so it
        # is recomputed from the source or reported, never silently taken for a miss.
        return self.state[idx] != fmt.EMPTY

    def flags_of(self, idx: np.ndarray) -> np.ndarray:
        flags = self.flags[idx]
        damaged = self.state[idx] > fmt.STORED  # neither EMPTY nor STORED
        return flags | np.where(damaged, np.uint8(fmt.FLAG_DAMAGED), np.uint8(0)) if damaged.any() else flags

    def crc_of(self, idx: np.ndarray) -> np.ndarray:
        return self.crc[idx]

    def stored_count(self) -> int:
        return int(np.count_nonzero(self.state != fmt.EMPTY))

    memory_mapped = True  # gather reads this host's page cache: batches can be gathered anywhere on it
    takes_rows = True  # write_rows writes a Rows column row by row, from the samples' own memory

    def row(self, i: int) -> list | None:
        """Stored sample ``i``'s row of each column, as views of the maps (the caller copies them),
        or ``None`` when they are not the whole sample (not stored, free-form, variable-length,
        damaged) or the columns are past this host's memory (read with explicit reads instead)."""
        if self._past_ram or self.state[i] != fmt.STORED or self.flags[i]:
            return None
        r = i if self.slot_of is None else int(self.slot_of[i])
        return [c[r] for c in self.columns]

    def gather(self, idx: np.ndarray, out: list | None = None, threads: int | None = None) -> list:
        """The column rows of stored samples ``idx``: one vectorised read per column, split over
        several threads for large batches (into ``out`` when given)."""
        return self.gather_checked(idx, out, threads)[0]

    def gather_checked(self, idx: np.ndarray, out: list | None = None, threads: int | None = None, *,
                       crc: bool = False, mode: str | None = None):
        """``(column rows, crcs or None)`` of stored samples ``idx``: copied from the memory maps
        when their pages are resident, else read with many concurrent ``preadv`` calls, which with
        ``crc`` also checksum each sample on the bytes read (:func:`nbkit.gather.gather_rows`;
        ``mode`` forces a path). The rows lie inside the files: their sizes were checked at open."""
        rows = idx if self.slot_of is None else self.slot_of[idx]
        if mode is None and read_mode() == "auto":
            if self._past_ram:
                mode = "pread"  # never all resident: reads from the page cache cost no more than copies from the map
            elif self._small_rows:
                mode = "mmap"  # a fault reads ahead many small rows at once; a pread reads one
            elif time.monotonic() < self._resident_until or resident(self.columns, rows):
                # Once resident, a cache that fits stays so: look again in a second, not every batch
                # (eight mincore calls are a tenth of a small batch's gather).
                if time.monotonic() >= self._resident_until:
                    self._resident_until = time.monotonic() + RESIDENT_SECONDS
                mode = "mmap"
            else:
                mode = "pread"
        return gather_rows(self.columns, rows, out, threads, files=self._column_files, crc=crc, mode=mode)

    def will_need(self, idx: np.ndarray) -> None:
        """Start reading the rows of the stored samples of ``idx`` into the page cache in the
        background when they are not resident (read-ahead of a batch gathered later)."""
        idx = idx[self.is_stored(idx)]
        rows = idx if self.slot_of is None else self.slot_of[idx]
        if len(rows) and not resident(self.columns, rows):
            will_need(self._column_files, self.columns, rows)

    def put(self, idx: np.ndarray, flags: np.ndarray, crc: np.ndarray, cpos: np.ndarray, stacked: list,
            bpos: np.ndarray, blobs: list):
        """Store samples ``idx``: rows of the conforming ones (positions ``cpos``), blobs (positions
        ``bpos``), then their records, ``state`` last so no reader trusts a half-written sample.

        Returns ``None`` (everything kept); a store that can refuse (a full server) returns a bool
        mask of the samples it kept. Holds the cache's write lock shared (:func:`frozen`: a push
        waits for the writes in flight, and holds new ones until it has read the files)."""
        lock_or_raise(self._index_fd, os.path.join(self.root, fmt.INDEX), shared=True,
                      why="nbkit holds it exclusively while it pushes or exports the cache")
        try:
            self._put(idx, flags, crc, cpos, stacked, bpos, blobs)
        finally:
            if fcntl is not None:
                fcntl.flock(self._index_fd, fcntl.LOCK_UN)

    def _put(self, idx, flags, crc, cpos, stacked, bpos, blobs) -> None:
        was = self.state[idx] != fmt.EMPTY
        if was.any():
            self.state[idx[was]] = fmt.EMPTY  # a sample being replaced must not look stored meanwhile
        if len(cpos):
            rows_idx = idx[cpos] if self.slot_of is None else self.slot_of[idx[cpos]]
            if len(rows_idx) > 1 and not (np.diff(rows_idx) > 0).all():
                order = np.argsort(rows_idx, kind="stable")  # runs of consecutive rows → one write each
                rows_idx, stacked = rows_idx[order], [rows[order] for rows in stacked]
            for k, rows in enumerate(stacked):
                self.write_rows(k, rows_idx, rows)
        if len(bpos):
            offsets = self.append_blobs(blobs)
            self.off[idx[bpos]] = offsets
            self.len[idx[bpos]] = [len(b) for b in blobs]
        self.flags[idx] = flags
        self.crc[idx] = crc
        self.state[idx] = fmt.STORED

    # -- heap ---------------------------------------------------------------------------------

    def _heap(self) -> int:
        if self._heap_fd is None:
            path = trust.cache_file_path(self.root, fmt.HEAP, self._where)
            if self.writable:
                self._heap_fd = self._open_heap_writable(path)
            else:
                try:
                    self._heap_fd = trust.open_regular(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptCacheError(f"{path} is missing but the index points into it: the cache is incomplete. Re-import or re-create it.") from None
            self._fds.append(self._heap_fd)
        return self._heap_fd

    def _open_heap_writable(self, path: str) -> int:
        """``heap.bin`` for appends: made on the first blob, under the cache's lock and only while the
        cache is still there (a writer racing ``nbkit rm`` leaves no orphan file behind)."""
        try:
            return trust.open_regular(path, os.O_RDWR)
        except FileNotFoundError:
            with file_lock(os.path.join(self.root, fmt.LOCK)):
                if not os.path.exists(self._where):
                    raise CorruptCacheError(f"the cache at {self.root} was removed while this process was writing "
                                            "to it. Open it again (nbkit.CachedDataset(source, path) re-creates it).") from None
                return trust.open_regular(path, os.O_RDWR | os.O_CREAT)

    def append_blobs(self, blobs: list[bytes]) -> list[int]:
        """Append ``blobs`` to the heap under an exclusive lock; return their offsets."""
        fd = self._heap()
        data = b"".join(blobs)
        lock = os.path.join(self.root, fmt.LOCK)
        if os.path.islink(lock):
            raise UnsafeArchiveError(f"{lock} is a symbolic link; an nbkit cache holds regular files only. Remove it.")
        with file_lock(lock):  # excludes other processes and threads
            start = os.fstat(fd).st_size
            try:
                write_all(fd, data, start, path=os.path.join(self.root, fmt.HEAP))
            except OSError:
                os.ftruncate(fd, start)  # no torn tail: the next append starts where the whole blobs end
                raise
        offsets, pos = [], start
        for b in blobs:
            offsets.append(pos)
            pos += len(b)
        return offsets

    def read_blob(self, i: int) -> bytes:
        """The heap blob of stored sample ``i``; :class:`CorruptCacheError` naming the index when its
        record points outside ``heap.bin`` (checked against the file's size before reading)."""
        off, n = int(self.off[i]), int(self.len[i])
        if n == 0:
            return b""
        if off + n > self._heap_size:
            self._heap_size = os.fstat(self._heap()).st_size  # another process may have appended since
            if off + n > self._heap_size:
                raise CorruptCacheError(
                    f"sample {i}: its record in {os.path.join(self.root, fmt.INDEX)} points at bytes {off}..{off + n} of "
                    f"{os.path.join(self.root, fmt.HEAP)}, which holds {self._heap_size}: the record is damaged."
                )
        if n > fmt.BLOB_PIECE:
            self._check_large_blob(i, off, n)
        data = os.pread(self._heap(), n, off)
        if len(data) != n:
            raise CorruptCacheError(f"sample {i}: {os.path.join(self.root, fmt.HEAP)} is shorter than the index says; the cache is damaged.")
        return data

    def _check_large_blob(self, i: int, off: int, n: int) -> None:
        """Check a large blob's checksum piece by piece before any memory is taken for it: a
        record's length is a claim (a copied or planted sparse heap holds terabytes of nothing), so
        it must match the bytes really there, and fit this machine, before it sizes a read."""
        heap = os.path.join(self.root, fmt.HEAP)
        if n > physical_memory() // 2:
            raise CorruptCacheError(f"sample {i}: its record in {os.path.join(self.root, fmt.INDEX)} claims a blob of {n:,} "
                                    f"bytes in {heap}, more than half of this machine's memory: the record is damaged.")
        idx = np.array([i], dtype=np.int64)
        prefix = 0 if int(self.flags[i]) & fmt.FLAG_FREEFORM else int(fmt.batch_crc(self.gather(idx), 1)[0])
        if fmt.range_crc(self._heap(), off, n, prefix) != int(self.crc[i]):
            raise CorruptCacheError(f"sample {i}: the {n:,} bytes its record in {os.path.join(self.root, fmt.INDEX)} points "
                                    f"at in {heap} fail its checksum: the record is damaged.")

    def write_rows(self, k: int, indices: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows`` of column ``k`` at ``indices``.

        Uses ``pwrite`` on runs of consecutive indices rather than stores through the mapping:
        the kernel copies into the page cache without a page fault per 4 KiB, about 5× faster,
        and readers' mappings see the same pages. :class:`nbkit.format.Rows` (large rows, not
        stacked) are written one ``pwrite`` a row, from each sample's own memory.
        """
        fd = self.column_fds[k]
        if isinstance(rows, fmt.Rows):
            col = self.columns[k]
            row_bytes = int(np.prod(col.shape[1:], dtype=np.int64)) * col.itemsize
            if len(rows) != len(indices):
                raise ValueError(f"{len(rows)} rows for {len(indices)} indices of column {k} of {self.root}")
            for slot, row in zip(np.asarray(indices).tolist(), rows.flat()):
                if row.nbytes != row_bytes:
                    raise ValueError(f"a row of {row.nbytes} bytes for column {k} of {self.root}, whose rows are {row_bytes}")
                write_all(fd, memoryview(row), slot * row_bytes, path=self._column_files[k][1])
            return
        rows = np.ascontiguousarray(rows)
        if rows.nbytes == 0:
            return
        flat = rows.reshape(len(indices), -1).view(np.uint8)
        row_bytes = flat.shape[1]
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        for run in np.split(np.arange(len(indices)), breaks):
            start, stop = int(run[0]), int(run[-1]) + 1
            write_all(fd, memoryview(flat[start:stop]).cast("B"), int(indices[start]) * row_bytes,
                      path=self._column_files[k][1])

    def data_fds(self) -> dict[str, int]:
        """``{name: descriptor}`` of the data files this process has open (``index.bin``, each
        ``col-<k>.bin``, ``heap.bin`` when it exists): what a check of their bytes reads, so that it
        reads the very files this object maps (never a name resolved again).

        Example:
            >>> import tempfile, torch, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
            >>> sorted(ds.store.data_fds())
            ['col-0.bin', 'index.bin']
        """
        fds = {fmt.INDEX: self._index_fd}
        fds.update((fmt.column_file(k), fd) for k, fd in enumerate(self.column_fds))
        if os.path.lexists(os.path.join(self.root, fmt.HEAP)):
            fds[fmt.HEAP] = self._heap()
        return fds

    def data_bytes(self) -> int:
        """Bytes of sample data stored so far (column rows of stored samples, plus the heap)."""
        rows = sum(int(np.prod(c.shape[1:], dtype=np.int64)) * c.itemsize for c in self.columns)
        heap = os.path.join(self.root, fmt.HEAP)
        return self.stored_count() * rows + (os.path.getsize(heap) if os.path.exists(heap) else 0)

    def stored_bytes(self) -> int:
        """Bytes the cache occupies on disk (allocated blocks, preallocated columns included; as
        ``nbkit ls`` counts them)."""
        total = 0
        for name in os.listdir(self.root):
            try:
                total += allocated(os.lstat(os.path.join(self.root, name)))
            except FileNotFoundError:
                continue
        return total

    def sync(self) -> None:
        """Make what was stored durable: the data files first, then the index, so that after a power
        loss no record is stored without its data (a record whose data did not reach the disk fails
        its CRC and is recomputed)."""
        self.sync_data()
        if self._index_mmap is not None:
            self._index_mmap.flush()
        os.fsync(self._index_fd)

    def sync_data(self) -> None:
        """Make the data files durable (the column files and ``heap.bin``, whoever wrote into them:
        an ``fsync`` flushes a file, not a descriptor), not the index: what must precede any record
        of rows that other processes placed (:func:`nbkit.cluster.merge.link_records`).

        Example:
            >>> import tempfile, torch, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
            >>> _ = ds[0]; ds.store.sync_data()    # rows durable; the index is synced by sync()
        """
        for fd in self.column_fds + ([self._heap_fd] if self._heap_fd is not None else []):
            os.fsync(fd)
        if self._heap_fd is not None:
            with Dir(self.root) as d:  # heap.bin is made on the first blob: its name must be durable too
                d.sync()

    def close(self) -> None:
        """Close the files (and end this process's use of the cache: :func:`in_use`), and let go of
        the maps: each is unmapped once no array made from it is left (closing a map that an array
        still views would fail, ``BufferError``). Closing twice does nothing more."""
        _close_fds(self._fds)
        self.records = self.state = self.flags = self.crc = self.off = self.len = None
        self.columns, self.column_fds, self._column_files = [], [], []
        self._index_mmap = self._index_fd = self._heap_fd = None
