"""Filling a cache: every missing sample, once, in this process or in parallel workers.

Work is cut into chunks of missing indices. With ``num_workers > 0`` a ``DataLoader`` over the
chunks runs them in worker processes, each of which computes its samples and writes them into
the cache files itself; only a count travels back, so there is no per-sample IPC. A rerun skips
stored samples by looking at the index alone (nothing is read back), and a killed run leaves
only whole samples behind, so warmup simply resumes.

Example:
    >>> import torch, tempfile, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(1000)), tempfile.mkdtemp())
    >>> first = ds.warmup(chunk_size=100)
    >>> second = ds.warmup()
    >>> (first.computed, second.computed, second.skipped)
    (1000, 0, 1000)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from torch.utils.data import DataLoader, Dataset

from .progress import as_callback

__all__ = ["WarmupReport", "run_warmup"]


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


class _Chunks(Dataset):
    """Each item is one chunk of indices; getting it fills those samples and returns the count."""

    def __init__(self, cached, chunks):
        self.cached = cached
        self.chunks = chunks

    def __len__(self):
        return len(self.chunks)

    def __getitem__(self, k):
        chunk = self.chunks[k]
        # Another process (a TPU peer, a reader) may have filled some meanwhile.
        todo = self.cached.store.missing(chunk)
        if len(todo):
            self.cached._compute_and_store(todo)
        return len(chunk)


def _first(batch):
    return batch


def run_warmup(cached, *, num_workers=0, callback=None, shard=None, chunk_size=256, multiprocessing_context=None) -> WarmupReport:
    if cached.source is None:
        raise ValueError(
            f"cannot warm up the cache at {cached.path}: it was opened without its source dataset. "
            "Open it with nbkit.CachedDataset(source, path) to compute missing samples."
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    cb = as_callback(callback)
    start = time.perf_counter()
    all_idx = np.arange(len(cached))
    if shard is not None:
        rank, world = shard
        if not (0 <= rank < world):
            raise ValueError(f"shard=(rank, world) needs 0 <= rank < world, got {shard}")
        all_idx = all_idx[rank::world]
    files = cached.store
    missing = files.missing(all_idx)
    all_idx = all_idx[files.admitted(all_idx)]  # beyond a byte budget: nothing to fill
    skipped = len(all_idx) - len(missing)
    cb.set_size(len(all_idx))
    cb.absolute_update(skipped)
    cb.set_description("warming up" if len(missing) else "already complete")
    chunks = [missing[s : s + chunk_size] for s in range(0, len(missing), chunk_size)]
    done = 0
    stopped = False
    if num_workers == 0:
        filler = _Chunks(cached, chunks)
        for k in range(len(chunks)):
            if cb.stop_requested is True:
                stopped = True
                break
            n = filler[k]
            done += n
            cb.relative_update(n)
    else:
        loader = DataLoader(_Chunks(cached, chunks), batch_size=None, shuffle=False, num_workers=num_workers,
                            collate_fn=_first, multiprocessing_context=multiprocessing_context, prefetch_factor=2)
        it = iter(loader)
        try:
            for n in it:
                done += int(n)
                cb.relative_update(int(n))
                if cb.stop_requested is True:
                    stopped = done < len(missing)
                    break
        finally:
            del it
    seconds = time.perf_counter() - start
    cb.set_description("stopped" if stopped else "done")
    return WarmupReport(computed=done, skipped=skipped, total=len(all_idx), seconds=seconds, stopped=stopped)
