"""Filling a cache: every missing sample, once, in this process or in parallel workers.

Work is cut into chunks of missing indices. With ``num_workers > 0``, worker processes take chunk
numbers from a queue, compute their samples and write them into the cache files themselves; only a
count travels back, so there is no per-sample IPC. The main process polls for those counts, so a
stop request (``callback.request_stop()``, the panel's Stop) or ``KeyboardInterrupt`` ends the
warmup within a fraction of a second even when every worker is stuck in the source: the workers
are terminated. A sample is published record-state-last, so a killed worker leaves only whole
samples behind; a rerun skips stored samples by looking at the index alone and simply resumes.

Example:
    >>> import torch, tempfile, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(1000)), tempfile.mkdtemp())
    >>> first = ds.warmup(chunk_size=100)
    >>> second = ds.warmup()
    >>> (first.computed, second.computed, second.skipped)
    (1000, 0, 1000)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import queue
import random
import signal
import time
import traceback
from dataclasses import dataclass

import numpy as np
import torch

from .progress import as_callback
from .trust import MAX_SAMPLES, MAX_WORKERS, MAX_WORLD_SIZE, check_int

__all__ = ["WarmupReport", "run_warmup"]

#: How often (seconds) the main process looks at the stop flag and the workers while it waits.
POLL_SECONDS = 0.1
#: How long terminated workers get to exit before they are killed.
TERMINATE_SECONDS = 2.0


@dataclass(frozen=True)
class WarmupReport:
    """What one ``warmup()`` call did.

    Attributes:
        computed: samples computed and stored by this call.
        skipped: samples already stored when it started (in its shard).
        total: samples in its shard.
        seconds: wall time.
        stopped: ``True`` if it stopped early because the callback asked it to.
    """

    computed: int
    skipped: int
    total: int
    seconds: float
    stopped: bool

    @property
    def rate(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        state = "stopped" if self.stopped else "done"
        return (f"warmup {state}: {self.computed} computed, {self.skipped} already cached, "
                f"{self.total} in all, {self.seconds:.1f}s ({self.rate:,.0f} samples/s)")


def _fill(cached, chunk: np.ndarray) -> int:
    """Compute and store the samples of ``chunk`` still missing; return the chunk's size."""
    # Another process (a TPU peer, a reader) may have filled some meanwhile.
    todo = cached.store.missing(chunk)
    if len(todo):
        cached.compute_and_store(todo)
    return len(chunk)


def run_warmup(cached, *, num_workers=0, callback=None, shard=None, chunk_size=256, multiprocessing_context=None) -> WarmupReport:
    num_workers = check_int(num_workers, "num_workers", min=0, max=MAX_WORKERS,
                            fix="each is a process: use about as many as the machine has cores (os.cpu_count())")
    chunk_size = check_int(chunk_size, "chunk_size", min=1, max=MAX_SAMPLES,
                           fix="a chunk holds at most as many samples as a cache can (2**40)")
    if shard is not None:
        if not isinstance(shard, (tuple, list)) or len(shard) != 2:
            raise TypeError(f"shard must be a (rank, world) pair of ints, got {shard!r}")
        rank = check_int(shard[0], "shard rank")
        world = check_int(shard[1], "shard world", min=1, max=MAX_WORLD_SIZE, fix="pass the number of hosts sharing the warmup")
        if not 0 <= rank < world:
            raise ValueError(f"shard=(rank, world) needs 0 <= rank < world, got {tuple(shard)}")
    if cached.source is None:
        raise ValueError(
            f"cannot warm up the cache at {cached.path}: it was opened without its source dataset. "
            "Open it with nbkit.CachedDataset(source, path) to compute missing samples."
        )
    context = _context(multiprocessing_context) if num_workers else None
    cb = as_callback(callback)
    start = time.perf_counter()
    all_idx = np.arange(len(cached))
    if shard is not None:
        all_idx = all_idx[rank::world]
    cached.check_generation()  # a handle made before a rebuild elsewhere fills nothing
    files = cached.store
    missing = files.missing(all_idx)
    all_idx = all_idx[files.admitted(all_idx)]  # beyond a byte budget: nothing to fill
    skipped = len(all_idx) - len(missing)
    cb.set_size(len(all_idx))
    cb.absolute_update(skipped)
    cb.set_description("warming up" if len(missing) else "already complete")
    chunks = [missing[s : s + chunk_size] for s in range(0, len(missing), chunk_size)]
    try:
        if num_workers == 0 or not chunks:
            done = 0
            for chunk in chunks:
                if cb.should_stop():
                    break
                n = _fill(cached, chunk)
                done += n
                cb.relative_update(n)
        else:
            done = _Workers(cached, chunks, min(num_workers, len(chunks)), context).run(cb)
    except BaseException:
        if chunks:
            with contextlib.suppress(Exception):  # what was stored before the failure is kept; the failure is the news
                files.sync()
        raise
    if chunks:
        # Once per warmup (stopped too): data files, then the index, so records never outlive their
        # data across a power loss. Per batch it would cost a sync per write.
        files.sync()
    stopped = done < len(missing)
    seconds = time.perf_counter() - start
    cb.set_description("stopped" if stopped else "done")
    return WarmupReport(computed=done, skipped=skipped, total=len(all_idx), seconds=seconds, stopped=stopped)


def _context(multiprocessing_context):
    """The multiprocessing context for the workers: ``None`` (the default start method), a name
    (``"fork"``, ``"spawn"``, ``"forkserver"``) or a context object."""
    if multiprocessing_context is None:
        return multiprocessing.get_context()
    if isinstance(multiprocessing_context, str):
        methods = multiprocessing.get_all_start_methods()
        if multiprocessing_context not in methods:
            raise ValueError(f"multiprocessing_context must be one of {methods} (or a multiprocessing context), "
                             f"got {multiprocessing_context!r}")
        return multiprocessing.get_context(multiprocessing_context)
    if not hasattr(multiprocessing_context, "Process") or not hasattr(multiprocessing_context, "Queue"):
        raise TypeError("multiprocessing_context must be a start method name ('fork', 'spawn', 'forkserver') or a "
                        f"multiprocessing context, got {type(multiprocessing_context).__name__}")
    return multiprocessing_context


class _Workers:
    """Warmup worker processes: chunk numbers go out on one queue, counts (or an error) come back on another."""

    def __init__(self, cached, chunks: list, n: int, context):
        self.cached, self.chunks, self.n, self.context = cached, chunks, n, context
        self.procs = []

    def run(self, cb) -> int:
        """Fill every chunk; return how many samples were filled (fewer when a stop was requested)."""
        ctx = self.context
        tasks, results = ctx.Queue(), ctx.Queue()
        seed = random.getrandbits(48)
        self.procs = [ctx.Process(target=_worker, args=(self.cached, self.chunks, tasks, results, seed + w),
                                  daemon=True, name=f"nbkit-warmup-{w}") for w in range(self.n)]
        done = finished = 0
        try:
            for p in self.procs:
                p.start()
            # Only now: the first put starts the queue's feeder thread, and a process that forks
            # with a thread running is one Python warns about (the child could inherit a held lock).
            for k in range(len(self.chunks)):
                tasks.put(k)
            for _ in range(self.n):
                tasks.put(None)
            while finished < len(self.chunks):
                if cb.should_stop():
                    break
                try:
                    kind, value = results.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    self._check_alive()
                    continue
                if kind == "error":
                    raise _rebuild_error(value)
                finished += 1
                done += value
                cb.relative_update(value)
        finally:
            # Workers that are still busy (a stop, an error, Ctrl-C) are stuck or no longer wanted.
            self._end(graceful=finished == len(self.chunks))
            for q in (tasks, results):
                q.close()
                q.cancel_join_thread()  # never wait on a queue a terminated worker may have left locked
        return done

    def _check_alive(self) -> None:
        for w, p in enumerate(self.procs):
            if p.exitcode not in (None, 0):
                raise RuntimeError(
                    f"nbkit warmup worker {w} (pid {p.pid}) exited with code {p.exitcode} while filling the cache at "
                    f"{self.cached.path}: killed (out of memory?) or crashed in the source. Samples stored so far are "
                    "kept; run warmup() again to resume, with fewer workers or num_workers=0 to see the error."
                )

    def _end(self, graceful: bool) -> None:
        deadline = time.monotonic() + TERMINATE_SECONDS
        if graceful:
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + TERMINATE_SECONDS
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(TERMINATE_SECONDS)


def _worker(cached, chunks: list, tasks, results, seed: int) -> None:
    """A warmup worker: fill the chunks whose numbers arrive on ``tasks`` until ``None``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it ends the workers
    torch.set_num_threads(1)  # as DataLoader workers: several processes, one thread each
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    while True:
        k = tasks.get()
        if k is None:
            return
        try:
            n = _fill(cached, chunks[k])
        except Exception as e:  # noqa: BLE001 - handed to the main process, which raises it
            results.put(("error", _error_payload(e, k, cached)))
            return
        results.put(("done", n))


_UNPICKLABLE = (pickle.PickleError, TypeError, AttributeError, ValueError, ImportError, EOFError)


def _error_payload(e: Exception, k: int, cached) -> tuple:
    text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        raw = pickle.dumps(e)
        pickle.loads(raw)
    except _UNPICKLABLE:  # an exception that does not survive pickling travels as its text
        raw = None
    return raw, f"{type(e).__name__}: {e}", text, k


def _rebuild_error(payload) -> BaseException:
    raw, summary, text, k = payload
    error = None
    if raw is not None:
        try:
            error = pickle.loads(raw)
        except _UNPICKLABLE:
            error = None
    if not isinstance(error, BaseException):
        error = RuntimeError(f"a warmup worker failed: {summary}")
    if hasattr(error, "add_note"):
        error.add_note(f"(raised in an nbkit warmup worker while filling chunk {k}; its traceback:\n{text})")
    return error
