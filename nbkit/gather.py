"""Gathering batch rows from memory-mapped columns at memory bandwidth.

One ``column[rows]`` is a single-threaded copy: fine for MNIST's 3 KiB rows, but a batch of 256
preprocessed 224-px images is 150 MiB, and one core copies (and page-faults) far below what the
memory system gives. :func:`take_rows` splits the rows of a batch over a per-process thread pool;
``numpy.take`` releases the GIL while it copies, so the threads run in parallel, and they write
straight into the caller's buffers (pinned host memory for the device loader).

Example:
    >>> import numpy as np
    >>> from nbkit.gather import take_rows
    >>> col = np.arange(20, dtype=np.float32).reshape(10, 2)
    >>> out = np.empty((3, 2), np.float32)
    >>> take_rows([col], np.array([7, 0, 3]), [out], threads=2)[0].tolist()
    [[14.0, 15.0], [0.0, 1.0], [6.0, 7.0]]
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import get_worker_info

__all__ = ["take_rows", "spans", "auto_threads", "pool", "empty_rows", "pinned_rows"]

# Batches at least this large are gathered straight into pinned memory when this process uses CUDA.
PIN_MIN_BYTES = 64 << 10
# Below this many bytes a batch is copied by the calling thread: handing work to a pool costs
# tens of microseconds, a copy of 1 MiB about as much.
PARALLEL_MIN_BYTES = 2 << 20
MAX_THREADS = 8

_pool = None
_pool_pid = None
_pool_lock = threading.Lock()


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def pool() -> ThreadPoolExecutor:
    """This process's gather pool (a forked child builds its own: threads do not survive fork)."""
    global _pool, _pool_pid
    pid = os.getpid()
    if _pool is None or _pool_pid != pid:
        with _pool_lock:
            if _pool is None or _pool_pid != pid:
                _pool = ThreadPoolExecutor(max_workers=max(1, min(MAX_THREADS, cpu_count())),
                                           thread_name_prefix="nbkit-gather")
                _pool_pid = pid
    return _pool


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
    allocator: ``pin_memory=True`` then has nothing left to copy, and ``.to("cuda")`` is a DMA."""
    sizes = [n * int(np.prod(c.shape[1:], dtype=np.int64)) * c.itemsize for c in columns]
    if sum(sizes) < PIN_MIN_BYTES or not torch.cuda.is_initialized() or get_worker_info() is not None:
        return [np.empty((n, *c.shape[1:]), dtype=c.dtype) for c in columns]
    return [pinned_rows(n, c.shape[1:], c.dtype)[1] for c in columns]


def pinned_rows(n: int, shape, dtype: np.dtype):
    """``(buffer, array)``: ``n`` rows of ``shape`` and ``dtype`` in one page-locked uint8 tensor,
    and the numpy view of it (which keeps the buffer alive)."""
    size = n * int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    buf = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=True)[:size]
    return buf, buf.numpy().view(dtype).reshape(n, *shape)


def take_rows(columns: list, rows: np.ndarray, out: list | None = None, threads: int | None = None) -> list:
    """``[col[rows] for col in columns]``, copied by ``threads`` threads (``None``: by the batch's size).

    Args:
        columns: arrays indexed by their first axis (memory-mapped column files).
        rows: int64 row numbers.
        out: optional arrays of shape ``(len(rows), *col.shape[1:])`` to write into (pinned buffers).
        threads: how many threads copy; ``1`` copies in the calling thread.
    """
    n = len(rows)
    if out is None:
        out = empty_rows(n, columns)
    if threads is None:
        threads = auto_threads(sum(int(np.prod(c.shape[1:], dtype=np.int64)) * c.itemsize for c in columns) * n)
    parts = spans(n, min(threads, n)) if n else []
    if len(parts) <= 1:
        for c, o in zip(columns, out):
            np.take(c, rows, axis=0, out=o)
        return out

    def copy(span):
        a, b = span
        for c, o in zip(columns, out):
            np.take(c, rows[a:b], axis=0, out=o[a:b])

    for f in [pool().submit(copy, s) for s in parts]:
        f.result()
    return out
