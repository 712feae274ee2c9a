"""Which indices each process reads in each epoch.

:class:`EpochSampler` is ``DistributedSampler``'s contract as a reusable piece: a shuffle that
depends only on ``seed + epoch`` (the same order on every host), split so that every rank gets the
same number of samples (padded by repeating, or truncated with ``drop_last``); the device loader
uses it, and it plugs into a ``DataLoader`` as ``sampler=``. :class:`PrefetchSampler` knows how a
read-through cache is stored: it reads it in windows of pieces, fetching the next window while
one is read, so an epoch fetches each piece once.

Example:
    >>> s = EpochSampler(10, shuffle=False, rank=1, world_size=3)
    >>> list(s), len(s)
    ([1, 4, 7, 0], 4)
    >>> import os, tempfile, torch, nbkit
    >>> from unittest import mock
    >>> src = torch.utils.data.TensorDataset(torch.arange(4096.0).reshape(1024, 4))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
    >>> _ = nbkit.push(ds.root, "memory://doctest/samplers")
    >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):  # where local areas live
    ...     rt = nbkit.CachedDataset.open("memory://doctest/samplers", local_max_bytes=64 << 10)
    >>> loader = torch.utils.data.DataLoader(rt, batch_size=100, sampler=PrefetchSampler(rt, seed=0),
    ...                                      collate_fn=nbkit.collate)
    >>> sum(float(b[0].sum()) for b in loader) == float(torch.arange(4096.0).sum())
    True
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.data import Sampler

from .trust import check_bool, check_int, check_size
from .stores.readthrough import store_of

__all__ = ["EpochSampler", "default_rank_world", "PrefetchSampler", "plan_windows"]


def default_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` when it is initialised,
    else from the torch_xla runtime when this process has started it, else ``(0, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    # Ask torch_xla only when its runtime is already running here: asking would start it (and a
    # process that started it can no longer spawn one process per TPU chip).
    if "torch_xla" in sys.modules:
        from .tpu import xla  # every torch_xla call goes through nbkit.tpu's adapter

        if xla.runtime_started():
            return xla.rank_world()
    return 0, 1


class EpochSampler(Sampler):
    """This rank's indices of a dataset for one epoch, reshuffled per epoch from ``seed``.

    Args:
        data: the dataset or its length.
        shuffle: shuffle with ``torch.randperm`` seeded by ``seed + epoch`` (as ``DistributedSampler``).
        seed: the shuffle seed; the same on every host.
        rank, world_size: this process's share (default: :func:`default_rank_world`).
        drop_last: drop the tail that does not divide evenly over the ranks, instead of padding it
            with repeated indices.
    """

    def __init__(self, data, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False):
        if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
            n = check_int(data, "data (a length)", min=0)
        elif hasattr(data, "__len__"):
            n = len(data)
        else:
            raise TypeError(f"EpochSampler needs a dataset (with __len__) or its length, got {type(data).__name__}")
        shuffle, drop_last = check_bool(shuffle, "shuffle"), check_bool(drop_last, "drop_last")
        seed = check_int(seed, "seed", min=0)
        if rank is None and world_size is None:
            rank, world_size = default_rank_world()
        elif rank is None or world_size is None:
            raise ValueError(f"give both rank and world_size, or neither (got rank={rank}, world_size={world_size})")
        world_size = check_int(world_size, "world_size", min=1)
        rank = check_int(rank, "rank", min=0, max=world_size - 1)
        self.n, self.shuffle, self.seed = int(n), shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch = 0
        if self.drop_last:
            self.per_rank = self.n // self.world_size
        else:
            self.per_rank = -(-self.n // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (the same ``seed`` and epoch give the same order anywhere)."""
        self.epoch = int(epoch)

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices for ``epoch`` (default: the current one), as int64."""
        epoch = self.epoch if epoch is None else int(epoch)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=g).numpy()
        else:
            order = np.arange(self.n, dtype=np.int64)
        total = self.per_rank * self.world_size
        if total > self.n:  # pad by repeating from the start (as DistributedSampler)
            order = np.resize(order, total) if self.n else order
        order = order[:total]
        return order[self.rank:total:self.world_size].astype(np.int64, copy=False)

    def __iter__(self):
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.per_rank


class PrefetchSampler(torch.utils.data.Sampler):
    """Sample a read-through cache in windows of pieces, fetching the next window while one is read.

    Each epoch puts the cache's pieces in random order and cuts that order into windows of about
    ``window_bytes`` (default: a third of the local area); samples are shuffled within a window.
    So every piece is fetched about once an epoch, and the mixing is over a window's samples
    rather than the whole dataset (as with webdataset's shard shuffle). Halfway through a window,
    the next window's pieces are queued for the store's prefetch thread (in the main process; with
    DataLoader workers the pieces land in the shared local area, where the workers find them).

    Args:
        dataset: a ``CachedDataset`` opened with ``local_max_bytes=``.
        shuffle: ``False`` reads in index order (still prefetching ahead).
        seed: the order is a function of ``(seed, epoch)``; ``None`` picks a random seed once. Each
            iteration moves to the next epoch; :meth:`set_epoch` sets it explicitly.
        window_bytes: bytes of pieces per window.

    Example:
        >>> import os, tempfile, torch, nbkit
        >>> from unittest import mock
        >>> src = torch.utils.data.TensorDataset(torch.randn(2000, 64))     # 512 KB of rows
        >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
        >>> _ = nbkit.push(ds.root, "memory://doctest/sampler")
        >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):
        ...     rt = nbkit.CachedDataset.open("memory://doctest/sampler", local_max_bytes=256 << 10)
        >>> sampler = PrefetchSampler(rt, seed=0)
        >>> sorted(sampler) == list(range(2000)), len(sampler.windows()) > 1
        (True, True)
    """

    def __init__(self, dataset, *, shuffle: bool = True, seed: int | None = None, window_bytes: int | None = None):
        self.dataset = dataset
        store = store_of(dataset)
        self.shuffle = check_bool(shuffle, "shuffle")
        self.seed = int(np.random.SeedSequence().entropy % (2**32)) if seed is None else check_int(seed, "seed", min=0)
        if window_bytes is not None:
            window_bytes = check_size(window_bytes, "window_bytes", min=1)
        self.window_bytes = window_bytes or max(1, store.geometry.usable // 3)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of epoch ``epoch`` next (call it each epoch, as with ``DistributedSampler``)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def windows(self) -> list:
        """This epoch's windows: a list of index arrays, in the order they are read."""
        store = store_of(self.dataset)
        return plan_windows(store, np.random.default_rng([self.seed, self.epoch]), self.window_bytes, self.shuffle)

    def __iter__(self):
        store = store_of(self.dataset)
        windows = self.windows()
        self.epoch += 1
        for w, win in enumerate(windows):
            order = win.tolist()
            half = len(order) // 2
            if w == 0:
                store.prefetch(win)
            yield from order[:half]
            if w + 1 < len(windows):
                store.prefetch(windows[w + 1])  # halfway through this window
            yield from order[half:]


def plan_windows(store, rng, window_bytes: int, shuffle: bool = True) -> list:
    """Group every index by the piece it lives in, order the pieces, cut them into windows of about
    ``window_bytes``, shuffle within each window (see :class:`PrefetchSampler`)."""
    if store.length == 0:
        return []
    groups, cost, loose = store.piece_groups()
    perm = rng.permutation(len(groups)) if shuffle else np.arange(len(groups))
    windows, current, size = [], [], 0
    for j in perm:
        if current and size + cost[j] > window_bytes:
            windows.append(np.concatenate(current))
            current, size = [], 0
        current.append(groups[j])
        size += cost[j]
    if current:
        windows.append(np.concatenate(current))
    if len(loose):
        if not windows:
            windows = [np.zeros(0, np.int64)]
        loose = rng.permutation(loose) if shuffle else loose
        parts = np.array_split(loose, len(windows))
        windows = [np.concatenate([w, p]) for w, p in zip(windows, parts)]
    if shuffle:
        windows = [rng.permutation(w) for w in windows]
    else:
        windows = [np.sort(w) for w in windows]
    return windows
