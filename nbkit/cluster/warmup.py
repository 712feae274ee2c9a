"""Filling a cache: every missing sample, once, in this process or by the local engine's workers.

``warmup(num_workers=N)`` with ``N > 0`` is the build protocol (:func:`nbkit.cluster.run`) run by
:class:`~nbkit.cluster.local.LocalEngine`: the missing indices are cut into parts of ``chunk_size``
samples, ``N`` worker processes each compute a part into a small part cache beside the cache, and
this process verifies and merges each part in place as it arrives. A stop request
(``callback.request_stop()``, the panel's Stop) or ``KeyboardInterrupt`` ends the workers within a
fraction of a second even when every worker is stuck in the source; the parts finished by then are
merged, and a rerun computes only what is still missing. A killed worker loses only its part.

``num_workers=0`` computes in this process, straight into the cache: with no worker there is
nothing to hand over, so a part (a second write, a verification and a merge) would buy nothing.
A sample is published record-state-last, so an interrupted warmup leaves only whole samples.

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
import os
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..progress import as_callback
from .report import WarmupReport
from ..trust import MAX_SAMPLES, MAX_WORKERS, MAX_WORLD_SIZE, check_int

__all__ = ["run_warmup"]

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
    if num_workers:
        return _with_workers(cached, num_workers, callback, None if shard is None else (rank, world), chunk_size,
                             multiprocessing_context)
    cb = as_callback(callback)
    start = time.perf_counter()
    all_idx = np.arange(len(cached))
    if shard is not None:
        all_idx = all_idx[rank::world]
    cached.check_generation()  # a handle made before a rebuild elsewhere fills nothing
    files = cached.store
    _merge_left_parts(cached, files)
    missing = files.missing(all_idx)
    all_idx = all_idx[files.admitted(all_idx)]  # beyond a byte budget: nothing to fill
    skipped = len(all_idx) - len(missing)
    cb.set_size(len(all_idx))
    cb.absolute_update(skipped)
    cb.set_description("warming up" if len(missing) else "already complete")
    chunks = [missing[s : s + chunk_size] for s in range(0, len(missing), chunk_size)]
    done = 0
    try:
        for chunk in chunks:
            if cb.should_stop():
                break
            n = _fill(cached, chunk)
            done += n
            cb.relative_update(n)
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


def _merge_left_parts(cached, files) -> None:
    """Merge the parts a stopped or failed warmup with workers left beside a local cache (verified by
    size and every CRC): computed once, never again, and no directory left behind."""
    if "://" in cached.root:
        return
    from .merge import merge
    from .part import list_parts, parts_dir

    parts = parts_dir(cached.root)
    left = list_parts(parts)
    for path in left:
        merge(files, path, hashes=False)
    if left:
        with contextlib.suppress(OSError):  # something else still in it (a live build's staging): it stays
            os.rmdir(parts)


#: warmup(num_workers=N) cuts parts of up to this many samples (never fewer than chunk_size)…
MAX_PART = 1024
#: …and at least this many parts a worker.
PARTS_PER_WORKER = 8


def _with_workers(cached, num_workers: int, callback, shard, chunk_size: int, multiprocessing_context) -> WarmupReport:
    """The build protocol on local worker processes: parts of ``chunk_size`` samples or more (up to
    :data:`MAX_PART`, while each worker still gets :data:`PARTS_PER_WORKER`; as many parts for every
    worker, of one size), merged in place.
    A ``shard=(rank, world)`` takes the parts ``k`` with ``k % world == rank`` (whole parts, so that
    no two hosts build one part)."""
    from .driver import run
    from .local import LocalEngine

    cached.check_generation()  # a handle made before a rebuild elsewhere fills nothing
    missing = len(cached.store.missing())
    part_size = chunk_size
    if shard is None:  # (hosts sharing a warmup cut the same parts: chunk_size alone, on every host)
        # Fewer, larger parts: each costs a few fsyncs, a rename and a merge, what the protocol adds
        # to the compute; at least PARTS_PER_WORKER a worker (balance, and what a Stop discards), at
        # most MAX_PART samples, and as many for every worker, of one size: no short part at the end
        # for one worker to finish alone (60,000 samples on 2 workers: 60 parts of 1,000).
        count = num_workers * max(PARTS_PER_WORKER, -(-missing // (num_workers * MAX_PART)))
        part_size = max(chunk_size, -(-missing // count))
    parts = -(-missing // part_size)
    engine = LocalEngine(max(1, min(num_workers, parts)), multiprocessing_context=multiprocessing_context)
    try:
        report = run(cached, engine, part_size=part_size, callback=callback, shard=shard, strategy="local")
    except BrokenProcessPool as e:  # the same part lost its worker every time
        pid, code = engine.lost[-1] if engine.lost else (None, "unknown")
        raise RuntimeError(
            f"nbkit warmup worker (pid {pid}) exited with code {code} while filling the cache at {cached.path}: killed "
            "(out of memory?) or crashed in the source. Samples stored so far are kept; run warmup() again to resume, "
            "with fewer workers or num_workers=0 to see the error.") from e
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"(raised in an nbkit warmup worker of {cached.path}; samples stored so far are kept: run warmup() "
                       "again to resume, or with num_workers=0 to debug the source in this process)")
        raise
    finally:
        engine.close()
    return WarmupReport(computed=report.computed + report.reused, skipped=report.skipped, total=report.total,
                        seconds=report.seconds, stopped=report.stopped)
