"""Planning a build: the missing samples of a cache cut into parts (contiguous index ranges).

A part is ``[k * part_size, min((k + 1) * part_size, length))`` for each ``k`` whose range holds at
least one missing, admitted sample: ranges aligned to ``part_size``, so a rerun after any failure
plans the same parts again (a part already built is found under the same name) and a part's worker
computes only the samples that were missing when it was planned.

Example:
    >>> import torch, tempfile, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
    >>> _ = ds.compute_and_store(np.arange(4))
    >>> [(p.start, p.stop, len(p.todo)) for p in plan(ds.store, 4)]
    [(4, 8, 4), (8, 10, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import trust
from .part import part_name

__all__ = ["PlannedPart", "plan", "DEFAULT_PART_SIZE"]

#: Samples per part by default: large enough that a part's fixed costs (a directory, a manifest, a
#: merge) are small against its compute, small enough that a lost worker loses little.
DEFAULT_PART_SIZE = 4096


@dataclass(frozen=True)
class PlannedPart:
    """One part to build: its range and the indices in it still missing when it was planned."""

    start: int
    stop: int
    todo: np.ndarray

    @property
    def name(self) -> str:
        return part_name(self.start, self.stop)


def plan(store, part_size: int = DEFAULT_PART_SIZE, indices: np.ndarray | None = None) -> list[PlannedPart]:
    """The parts of the cache ``store`` (any :class:`nbkit.stores.base.Store`) that hold missing,
    admitted samples (of ``indices``, or of all), in index order.

    Raises:
        ValueError: ``part_size`` is not a positive integer (at most ``2**40``).
    """
    part_size = trust.check_int(part_size, "part_size", min=1, max=trust.MAX_SAMPLES,
                                fix="a part holds a few thousand samples (the default is 4096)")
    missing = store.missing(indices)
    if not len(missing):
        return []
    keys = missing // part_size
    cuts = np.flatnonzero(np.diff(keys)) + 1
    out = []
    for group in np.split(missing, cuts):
        k = int(group[0]) // part_size
        out.append(PlannedPart(k * part_size, min((k + 1) * part_size, store.length), group))
    return out
