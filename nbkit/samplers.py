"""Which indices each process reads in each epoch.

:class:`EpochSampler` is ``DistributedSampler``'s contract as a reusable piece: a shuffle that
depends only on ``seed + epoch`` (the same order on every host), split so that every rank gets the
same number of samples (padded by repeating, or truncated with ``drop_last``). The device loader
uses it, and it plugs into a ``DataLoader`` as ``sampler=``.

Example:
    >>> from nbkit.samplers import EpochSampler
    >>> s = EpochSampler(10, shuffle=False, rank=1, world_size=3)
    >>> list(s), len(s)
    ([1, 4, 7, 0], 4)
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["EpochSampler", "default_rank_world"]


def default_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` when it is initialised,
    else from the torch_xla runtime when torch_xla is already imported, else ``(0, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "torch_xla.runtime" in sys.modules:  # never import torch_xla ourselves: it grabs the device
        xr = sys.modules["torch_xla.runtime"]
        try:
            return int(xr.global_ordinal()), int(xr.world_size())
        except RuntimeError:  # imported but no runtime started in this process
            pass
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
        n = data if isinstance(data, (int, np.integer)) else len(data)
        if rank is None and world_size is None:
            rank, world_size = default_rank_world()
        elif rank is None or world_size is None:
            raise ValueError(f"give both rank and world_size, or neither (got rank={rank}, world_size={world_size})")
        if not isinstance(world_size, (int, np.integer)) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self.n, self.shuffle, self.seed = int(n), bool(shuffle), int(seed)
        self.rank, self.world_size, self.drop_last = int(rank), int(world_size), bool(drop_last)
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
