"""Gathering batch rows from memory-mapped columns at memory bandwidth.

One ``column[rows]`` is a single-threaded copy: fine for MNIST's 3 KiB rows, but a batch of 256
preprocessed 224-px images is 150 MiB, and one core copies (and page-faults) far below what the
memory system gives. :func:`take_rows` splits the rows of a batch over a per-process thread pool;
``numpy.take`` releases the GIL while it copies, so the threads run in parallel, and they write
straight into the caller's buffers (pinned host memory for the device loader).

That copy is fast only while the rows are in the page cache. Once a cache outgrows RAM, each
page fault of the copy is a small synchronous disk read, one per thread: a tenth of what the disk
gives to many concurrent reads. :func:`gather_rows` therefore looks first (``mincore`` on a few of
the batch's rows) and, when they are not resident, reads the rows with ``os.preadv`` from an I/O
pool of :data:`IO_THREADS` threads (I/O concurrency is what the disk needs, not the CPU count),
rows sorted by offset and adjacent rows coalesced into one call, straight into the output buffers,
taking each sample's CRC-32 on the bytes just read. ``NBKIT_READ=mmap|pread|auto`` (or ``mode=``)
forces a path.

Example:
    >>> import numpy as np
    >>> from nbkit.gather import take_rows
    >>> col = np.arange(20, dtype=np.float32).reshape(10, 2)
    >>> out = np.empty((3, 2), np.float32)
    >>> take_rows([col], np.array([7, 0, 3]), [out], threads=2)[0].tolist()
    [[14.0, 15.0], [0.0, 1.0], [6.0, 7.0]]
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys
import threading
import weakref
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .errors import CorruptCacheError

__all__ = ["take_rows", "gather_rows", "read_rows", "resident", "will_need", "crc_rows", "spans", "auto_threads",
           "pool", "io_pool", "stop_pools", "empty_rows", "aligned_rows", "pinned_rows", "recycled_rows", "physical_memory", "read_mode",
           "READ_MODES"]

# Batches at least this large are gathered straight into pinned memory when this process uses CUDA.
PIN_MIN_BYTES = 64 << 10
# Below this many bytes a batch is copied by the calling thread: handing work to a pool costs
# tens of microseconds, a copy of 1 MiB about as much.
PARALLEL_MIN_BYTES = 2 << 20
MAX_THREADS = 8

# The process's pools, lent for the length of a gather (:func:`pool`, :func:`io_pool`) and stopped
# before every fork (:func:`stop_pools`): the parent forks with no thread of ours alive (Python warns
# about a multi-threaded process that forks: the child may inherit a lock another thread held), and
# the child starts without them. The next gather starts them again.
_pools = {}  # name: (pool, the pid that made it)
_pools_state = threading.Condition()
_lent = 0  # pools lent out now (a gather in flight)
_forking = False  # a fork waits for the pools to be idle: nothing is lent meanwhile
#: The longest a fork waits for the gathers in flight before it goes ahead with the pools running.
FORK_WAIT_SECONDS = 10.0

#: Concurrent reads of rows that are not in the page cache: an SSD (or a cloud disk) reaches its
#: throughput only with many requests in flight (here: 170 MB/s with 1, 470 MB/s with 32).
IO_THREADS = 32
#: The most rows one ``preadv`` call reads (below every system's IOV_MAX of 1024 buffers).
MAX_RUN = 512
#: Rows at least this large are announced to the kernel (``posix_fadvise(WILLNEED)``) before they are read.
ADVISE_MIN_BYTES = 64 << 10
#: Rows of a batch whose pages ``mincore`` inspects to decide the path.
RESIDENCY_SAMPLES = 8
#: How :func:`gather_rows` reads: ``auto`` (per batch, by residency), ``mmap`` (copy from the
#: memory map) or ``pread`` (explicit reads). The environment variable ``NBKIT_READ`` overrides ``auto``.
READ_MODES = ("auto", "mmap", "pread")
READ_ENV = "NBKIT_READ"


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@contextlib.contextmanager
def _lend(name: str, threads: int):
    """This process's pool called ``name``, for the duration of the block (work submitted to it is
    done by the block's end). Waits while a fork stops the pools."""
    global _lent
    pid = os.getpid()
    with _pools_state:
        _pools_state.wait_for(lambda: not _forking)
        pool_ = _pools.get(name)
        if pool_ is None or pool_[1] != pid:  # pid: a child forked without the hooks (a C-level fork) makes its own
            pool_ = _pools[name] = (ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name), pid)
        _lent += 1
    try:
        yield pool_[0]
    finally:
        with _pools_state:
            _lent -= 1
            _pools_state.notify_all()


def pool():
    """This process's gather pool, lent for a ``with`` block: ``with pool() as p: p.map(...)``.

    Example:
        >>> with pool() as p:
        ...     list(p.map(abs, [-1, 2]))
        [1, 2]
    """
    return _lend("nbkit-gather", max(1, min(MAX_THREADS, cpu_count())))


def stop_pools(timeout: float = FORK_WAIT_SECONDS) -> bool:
    """Stop this process's pools once the gathers in flight are done (at most ``timeout`` seconds);
    the next gather starts them again. Runs before every ``os.fork``; return whether they stopped.

    Example:
        >>> with pool() as p:
        ...     _ = p.submit(int).result()
        >>> stop_pools(), any(t.name.startswith("nbkit-gather") for t in threading.enumerate())
        (True, False)
    """
    with _pools_state:
        idle = _pools_state.wait_for(lambda: not _lent, timeout=timeout)
        stopping = [p for p, pid in _pools.values() if pid == os.getpid()] if idle else []
        if idle:
            _pools.clear()
    for p in stopping:
        p.shutdown(wait=True)  # idle threads: they exit at once
    return idle


def _before_fork() -> None:
    global _forking
    with _pools_state:
        _forking = True  # no new loan while the fork waits for those in flight
    stop_pools()


def _after_fork_in_parent() -> None:
    global _forking
    with _pools_state:
        _forking = False
        _pools_state.notify_all()


def _after_fork_in_child() -> None:
    global _pools, _pools_state, _lent, _forking
    # Only the forking thread lives on: nothing is lent, and the condition may have been held by another.
    _pools, _pools_state, _lent, _forking = {}, threading.Condition(), 0, False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


def physical_memory() -> int:
    """Bytes of RAM on this host (``0`` when it cannot tell)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows)
        return 0


def io_pool():
    """This process's pool of :data:`IO_THREADS` threads for explicit reads, lent for a ``with``
    block like :func:`pool`."""
    return _lend("nbkit-read", IO_THREADS)


def auto_threads(batch_bytes: int) -> int:
    """How many threads to gather a batch of ``batch_bytes`` with: one per ~2 MiB, at most one per
    CPU (and 8), so small rows stay on the calling thread."""
    return int(max(1, min(MAX_THREADS, cpu_count(), batch_bytes // PARALLEL_MIN_BYTES)))


def spans(n: int, parts: int) -> list:
    """``parts`` contiguous ``(start, stop)`` ranges covering ``range(n)`` (fewer if ``n`` is small)."""
    bounds = np.linspace(0, n, parts + 1).astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def empty_rows(n: int, columns: list) -> list:
    """Output arrays for ``n`` rows of each column. In a process that drives a CUDA GPU (outside
    DataLoader workers), large batches get page-locked (pinned) memory from torch's caching host
    allocator: ``pin_memory=True`` then has nothing left to copy, and ``.to("cuda")`` is a DMA.
    Other large columns come from :func:`recycled_rows`."""
    sizes = [n * math.prod(c.shape[1:]) * c.itemsize for c in columns]  # math.prod: a small batch's reads are µs
    if sum(sizes) < PIN_MIN_BYTES or not _drives_cuda():
        return [recycled_rows(n, c.shape[1:], c.dtype) if size >= RECYCLE_MIN_BYTES else aligned_rows(n, c.shape[1:], c.dtype)
                for c, size in zip(columns, sizes)]
    return [pinned_rows(n, c.shape[1:], c.dtype)[1] for c in columns]


#: The alignment of the arrays :func:`empty_rows` makes: XLA's CPU client takes a host array this
#: aligned as it is (``jax.device_put`` on the CPU is then no copy), and copies any other.
ALIGN = 64


def aligned_rows(n: int, shape, dtype) -> np.ndarray:
    """An uninitialised array of ``n`` rows of ``shape`` starting at a multiple of :data:`ALIGN` bytes
    (``np.empty`` gives 16): a batch JAX then places on the CPU without copying it.

    Example:
        >>> aligned_rows(3, (5,), np.float32).ctypes.data % ALIGN, aligned_rows(3, (5,), np.float32).shape
        (0, (3, 5))
    """
    dtype = np.dtype(dtype)
    size = n * math.prod(shape) * dtype.itemsize
    raw = np.empty(size + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + size].view(dtype).reshape(n, *shape)


def _drives_cuda() -> bool:
    """Whether this process (not a DataLoader worker) has initialised CUDA; a process that never
    imported torch has not, and is not made to import it here."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    from torch.utils.data import get_worker_info

    return get_worker_info() is None


#: Output columns at least this large come from :func:`recycled_rows`.
RECYCLE_MIN_BYTES = 4 << 20
#: The most bytes of freed output buffers a process keeps for reuse.
RECYCLE_KEEP_BYTES = 512 << 20
_free = {}  # size -> deque of anonymous maps whose arrays have died (deque: append/pop are atomic)
_free_pid = None


def recycled_rows(n: int, shape, dtype) -> np.ndarray:
    """An uninitialised array of ``n`` rows of ``shape`` whose memory is reused once every array
    and tensor made from it is gone. A fresh 38 MiB batch costs the kernel a page fault and a
    zeroed page for every page (a fifth of the read time of a batch read from disk); a recycled
    one has its pages already.

    Example:
        >>> a = recycled_rows(256, (16384,), np.uint8); address = a.ctypes.data; del a
        >>> recycled_rows(256, (16384,), np.uint8).ctypes.data == address
        True
    """
    global _free, _free_pid
    if _free_pid != os.getpid():  # a forked child starts with its own (empty) free list
        _free, _free_pid = {}, os.getpid()
    dtype = np.dtype(dtype)
    size = max(1, n * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    spare = _free.setdefault(size, deque())
    try:
        mm = spare.pop()
    except IndexError:
        mm = mmap.mmap(-1, size)
        if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
            mm.madvise(mmap.MADV_HUGEPAGE)  # as numpy does for large arrays: 512x fewer page faults
    raw = np.frombuffer(mm, dtype=np.uint8)  # every view of it (numpy collapses bases) keeps ``raw`` alive
    weakref.finalize(raw, _recycle, _free, size, mm)
    return raw[:n * int(np.prod(shape, dtype=np.int64)) * dtype.itemsize].view(dtype).reshape(n, *shape)


def _recycle(free: dict, size: int, mm) -> None:
    spare = free.setdefault(size, deque())
    if (len(spare) + 1) * size <= RECYCLE_KEEP_BYTES:
        spare.append(mm)


def pinned_rows(n: int, shape, dtype: np.dtype):
    """``(buffer, array)``: ``n`` rows of ``shape`` and ``dtype`` in one page-locked uint8 tensor,
    and the numpy view of it (which keeps the buffer alive)."""
    import torch

    size = n * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    buf = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)[:size]
    return buf, buf.numpy().view(dtype).reshape(n, *shape)


def take_rows(columns: list, rows: np.ndarray, out: list | None = None, threads: int | None = None) -> list:
    """``[col[rows] for col in columns]``, copied by ``threads`` threads (``None``: by the batch's size).

    Args:
        columns: arrays indexed by their first axis (memory-mapped column files).
        rows: int64 row numbers, already checked to lie in the columns (the trust boundary's
            ``check_indices``): a row past the end is clipped here, not refused.
        out: optional arrays of shape ``(len(rows), *col.shape[1:])`` to write into (pinned buffers).
        threads: how many threads copy; ``1`` copies in the calling thread.
    """
    n = len(rows)
    if out is None:
        out = empty_rows(n, columns)
    if threads is None:
        threads = auto_threads(sum(math.prod(c.shape[1:]) * c.itemsize for c in columns) * n)
    parts = spans(n, min(threads, n)) if n and threads > 1 else []
    if len(parts) <= 1:
        for c, o in zip(columns, out):
            np.take(c, rows, axis=0, out=o, mode="clip")  # rows were checked: "clip" skips numpy's buffered copy
        return out

    def copy(span):
        a, b = span
        for c, o in zip(columns, out):
            np.take(c, rows[a:b], axis=0, out=o[a:b], mode="clip")

    with pool() as p:
        for f in [p.submit(copy, s) for s in parts]:
            f.result()
    return out


def _row_bytes(c: np.ndarray) -> int:
    return int(np.prod(c.shape[1:], dtype=np.int64)) * c.itemsize


def _mincore():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.mincore
    except (OSError, AttributeError, TypeError):  # no mincore (Windows): residency unknown, the map is used
        return None
    f.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    f.restype = ctypes.c_int
    return f


_MINCORE = _mincore()

#: Rows at least this large are checksummed with libdeflate's CRC-32 when the system has it (the
#: same CRC-32 as zlib's, 3x faster on large buffers here); smaller rows stay with ``zlib.crc32``,
#: whose call costs less. ``NBKIT_CRC=zlib`` turns libdeflate off.
FAST_CRC_MIN = 16 << 10


@functools.lru_cache(maxsize=None)
def fast_crc():
    """libdeflate's ``libdeflate_crc32`` when the system has it and it agrees with ``zlib.crc32``
    (looked up on first use, not at import), else ``None``.

    Example:
        >>> buf = ctypes.create_string_buffer(b"ab", 2)  # kept alive: the call reads its memory
        >>> fast_crc() is None or fast_crc()(0, ctypes.addressof(buf), 2) == zlib.crc32(b"ab")
        True
    """
    if os.environ.get("NBKIT_CRC") == "zlib":
        return None
    name = ctypes.util.find_library("deflate")
    try:
        f = ctypes.CDLL(name).libdeflate_crc32 if name else None
    except (OSError, AttributeError):
        return None
    if f is None:
        return None
    f.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    f.restype = ctypes.c_uint32  # a CDLL call releases the GIL: threads checksum in parallel
    # A library of that name that computes anything else would make every sample look damaged.
    probe = bytes(range(256)) * 67
    buf = ctypes.create_string_buffer(probe, len(probe))
    if f(0, ctypes.addressof(buf), len(probe)) != zlib.crc32(probe) or f(7, ctypes.addressof(buf), 3) != zlib.crc32(probe[:3], 7):
        return None
    return f


def _crc_at(value: int, address: int, size: int) -> int:
    """CRC-32 of ``size`` bytes at ``address`` continued from ``value`` (needs libdeflate)."""
    return fast_crc()(value, address, size)


def crc_rows(rows: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """CRC-32 (``zlib.crc32``'s) of each row of a 2-D uint8 array, continued from ``start``.

    Example:
        >>> rows = np.arange(6, dtype=np.uint8).reshape(2, 3)
        >>> crc_rows(rows).tolist() == [zlib.crc32(bytes([0, 1, 2])), zlib.crc32(bytes([3, 4, 5]))]
        True
    """
    n, width = rows.shape
    fast = fast_crc()
    if fast is None or width < FAST_CRC_MIN or not rows.flags.c_contiguous:
        if start is None:
            return np.fromiter(map(zlib.crc32, rows), dtype=np.uint32, count=n)
        return np.fromiter(map(zlib.crc32, rows, start.tolist()), dtype=np.uint32, count=n)
    base = rows.ctypes.data
    init = [0] * n if start is None else start.tolist()
    return np.fromiter((fast(c, base + i * width, width) for i, c in enumerate(init)), dtype=np.uint32, count=n)


def resident(columns: list, rows: np.ndarray, samples: int = RESIDENCY_SAMPLES) -> bool:
    """Whether the pages of ``samples`` of ``rows`` (spread over the batch) are all in the page
    cache, in every memory-mapped column (``True`` when it cannot tell: the map is then used as before).

    Example:
        >>> resident([np.zeros((4, 2))], np.array([0, 3]))   # not a file map: nothing to read
        True
    """
    n = len(rows)
    if _MINCORE is None or not n:
        return True
    page = mmap.PAGESIZE
    picks = rows[np.unique(np.linspace(0, n - 1, min(n, samples)).astype(np.int64))]
    for c in columns:
        rb = _row_bytes(c)
        base = c.ctypes.data
        if rb == 0:
            continue
        for r in picks.tolist():
            start = base + r * rb
            first = start - start % page
            length = start + rb - first
            vec = ctypes.create_string_buffer((length + page - 1) // page)
            if _MINCORE(first, length, vec) != 0:
                return True
            if not all(b & 1 for b in vec.raw):
                return False
    return True


def will_need(files: list, columns: list, rows: np.ndarray) -> None:
    """Ask the kernel to start reading ``rows`` of the column files into the page cache, without
    waiting (``posix_fadvise(WILLNEED)``): read-ahead of a batch that is gathered later.

    Args:
        files: ``(fd, path)`` of each column file.
        columns: the columns (for their row sizes).
        rows: row numbers (already checked to lie in the files).
    """
    advise = getattr(os, "posix_fadvise", None)
    if advise is None or not len(rows):
        return
    uniq = np.unique(rows)
    for (fd, _), c in zip(files, columns):
        rb = _row_bytes(c)
        if rb == 0:
            continue
        breaks = np.flatnonzero(np.diff(uniq) != 1) + 1
        for run in np.split(uniq, breaks):
            advise(fd, int(run[0]) * rb, len(run) * rb, os.POSIX_FADV_WILLNEED)


def _fill(fd: int, path: str, bufs: list, offset: int) -> None:
    """Read ``sum(len(b) for b in bufs)`` bytes at ``offset`` into ``bufs``; a file that ends
    first (truncated under the reader) raises :class:`CorruptCacheError` rather than leaving garbage."""
    done = os.preadv(fd, bufs, offset)
    total = sum(len(b) for b in bufs)
    while done < total:
        rest, skip = [], done
        for b in bufs:
            if skip >= len(b):
                skip -= len(b)
                continue
            rest.append(b[skip:])
            skip = 0
        got = os.preadv(fd, rest, offset + done)
        if got == 0:
            raise CorruptCacheError(
                f"{path} ends at byte {offset + done}, but the cache's rows reach byte {offset + total}: the file was "
                "truncated while the cache was open. Re-import or re-create the cache."
            )
        bufs, offset, total, done = rest, offset + done, total - done, got


def read_rows(files: list, columns: list, rows: np.ndarray, out: list | None = None, *, crc: bool = False,
              threads: int | None = None):
    """``([col[rows] for col in columns], crcs)`` read with ``os.preadv`` from the column files.

    Rows are sorted by offset, each run of adjacent rows is one call per column, and the runs are
    spread over :func:`io_pool` (at most ``threads``, default :data:`IO_THREADS`, reads in flight).
    A row asked twice is read once. With ``crc``, each sample's CRC-32 over its rows in column order
    (:func:`nbkit.format.row_crc`) is taken by the reading thread on the bytes it just read;
    otherwise ``crcs`` is ``None``.

    Args:
        files: ``(fd, path)`` of each column file (rows already checked to lie inside them).
        columns: the memory-mapped columns (their shapes and dtypes).
        rows: int64 row numbers.
        out: optional C-contiguous output arrays (``len(rows)`` rows each).
        crc: also return the samples' CRC-32s.
        threads: reads in flight at most.

    Example:
        >>> import tempfile
        >>> col = np.arange(12, dtype=np.int32).reshape(6, 2)
        >>> path = tempfile.mkstemp()[1]; col.tofile(path); fd = os.open(path, os.O_RDONLY)
        >>> got, crcs = read_rows([(fd, path)], [col], np.array([4, 1, 4]), crc=True)
        >>> got[0].tolist(), int(crcs[0]) == zlib.crc32(col[4].tobytes())
        ([[8, 9], [2, 3], [8, 9]], True)
        >>> os.close(fd)
    """
    n = len(rows)
    if out is None:
        out = empty_rows(n, columns)
    sizes = [_row_bytes(c) for c in columns]
    flats = [memoryview(o.reshape(-1).view(np.uint8)) if rb else None for o, rb in zip(out, sizes)]
    bases = [o.ctypes.data for o in out]
    fast = [fast_crc() is not None and rb >= FAST_CRC_MIN for rb in sizes]
    uniq, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    crc_u = np.zeros(len(uniq), np.uint32) if crc else None
    # Runs of adjacent rows, cut at MAX_RUN, then dealt out to the threads in offset order.
    cuts = np.flatnonzero(np.diff(uniq) != 1) + 1
    bounds = [0] + cuts.tolist() + [len(uniq)]
    runs = [(a, min(a + MAX_RUN, b)) for a, b in zip(bounds[:-1], bounds[1:]) for a in range(a, b, MAX_RUN)]
    width = max(1, min(threads or IO_THREADS, IO_THREADS, len(runs)))
    first_l = first.tolist()
    uniq_l = uniq.tolist()

    advise = getattr(os, "posix_fadvise", None)
    if advise is not None:
        # Every large row of the batch is asked of the kernel at once, so the disk sees the whole
        # batch queued (deeper than the threads alone keep it); the reads below then wait on those pages.
        for (fd, _), rb in zip(files, sizes):
            if rb >= ADVISE_MIN_BYTES:
                for a, b in runs:
                    advise(fd, uniq_l[a] * rb, (b - a) * rb, os.POSIX_FADV_WILLNEED)
    todo = iter(runs)  # taken run by run (``next`` on a list iterator is atomic): no thread idles
    # while another still has a queue of reads, as a fixed split would leave it at a batch's end

    def work():
        for a, b in todo:
            for (fd, path), flat, rb in zip(files, flats, sizes):
                if not rb:
                    continue
                bufs = [flat[p * rb:(p + 1) * rb] for p in first_l[a:b]]
                _fill(fd, path, bufs, uniq_l[a] * rb)
            if crc:
                for j in range(a, b):
                    p, c = first_l[j], 0
                    for flat, rb, base, by_address in zip(flats, sizes, bases, fast):
                        if by_address:
                            c = _crc_at(c, base + p * rb, rb)
                        elif rb:
                            c = zlib.crc32(flat[p * rb:(p + 1) * rb], c)
                    crc_u[j] = c

    if width <= 1:
        work()
    else:
        with io_pool() as p:
            for f in [p.submit(work) for _ in range(width)]:
                f.result()
    if len(uniq) < n:  # rows asked more than once: copy the one read
        src = first[inverse]
        dup = np.flatnonzero(src != np.arange(n))
        for o in out:
            o[dup] = o[src[dup]]
    return out, (crc_u[inverse] if crc else None)


def read_mode(mode: str | None = None) -> str:
    """``mode``, or ``$NBKIT_READ``, or ``"auto"``; a ValueError for anything else."""
    if mode is None:
        mode = os.environ.get(READ_ENV) or "auto"
    if mode not in READ_MODES:
        raise ValueError(f"{READ_ENV}/mode={mode!r} is not a read mode: use one of {', '.join(READ_MODES)}")
    return mode


def gather_rows(columns: list, rows: np.ndarray, out: list | None = None, threads: int | None = None, *,
                files: list | None = None, crc: bool = False, mode: str | None = None):
    """``(rows of each column, crcs or None)``: copied from the memory map (:func:`take_rows`) when
    the batch's pages are resident, else read with :func:`read_rows` (``crc``: with each sample's
    CRC-32 taken on the bytes read; the map's path returns ``None`` and the caller checksums the copy).

    Args:
        columns: memory-mapped columns.
        rows: int64 row numbers.
        out: optional output arrays.
        threads: copy threads for the map's path.
        files: ``(fd, path)`` of each column file; without them, always the map.
        crc: take CRCs on the explicit-read path.
        mode: ``auto``, ``mmap`` or ``pread`` (default: ``$NBKIT_READ``, else ``auto``).

    Example:
        >>> col = np.arange(6).reshape(3, 2)
        >>> gather_rows([col], np.array([2, 0]))[0][0].tolist()
        [[4, 5], [0, 1]]
    """
    mode = read_mode(mode)
    usable = files is not None and hasattr(os, "preadv") and len(rows) and all(
        o is None or o.flags.c_contiguous for o in (out or [None]))
    if usable and (mode == "pread" or (mode == "auto" and not resident(columns, rows))):
        return read_rows(files, columns, rows, out, crc=crc)
    return take_rows(columns, rows, out, threads), None
