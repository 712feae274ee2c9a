"""Planning a build: the missing samples of a cache cut into parts (contiguous index ranges).

A part is ``[k * part_size, min((k + 1) * part_size, length))`` for each ``k`` whose range holds at
least one missing, admitted sample: ranges aligned to ``part_size``, so a rerun after any failure
plans the same parts again (a part already built is found under the same name) and a part's worker
computes only the samples that were missing when it was planned. Parts already there (an earlier
plan's, maybe of another part size, or another driver's) are planned around: :func:`plan`'s
``around``, :func:`held` for a local parts directory, :func:`plan_around` and :func:`gaps` for the
whole parts of a composed (``gs://``) build.

Example:
    >>> import torch, tempfile, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
    >>> _ = ds.compute_and_store(np.arange(4))
    >>> [(p.start, p.stop, len(p.todo)) for p in plan(ds.store, 4)]
    [(4, 8, 4), (8, 10, 2)]
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .. import trust
from ..commit import LEFTOVER_OPS, is_claimed, leftover_of
from .part import parse_part_name, part_name

__all__ = ["PlannedPart", "plan", "plan_around", "cover", "gaps", "held", "DEFAULT_PART_SIZE"]

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


def _check_size(part_size) -> int:
    return trust.check_int(part_size, "part_size", min=1, max=trust.MAX_SAMPLES,
                           fix="a part holds a few thousand samples (the default is 4096)")


def plan(store, part_size: int = DEFAULT_PART_SIZE, indices: np.ndarray | None = None, *,
         around=()) -> list[PlannedPart]:
    """The parts of the cache ``store`` (any :class:`nbkit.stores.base.Store`) that hold missing,
    admitted samples (of ``indices``, or of all), in index order.

    ``around``: ``(start, stop)`` ranges that parts already hold or are being built into (an earlier
    plan's, maybe of another part size, or another driver's): their indices are left out, and an
    aligned range is cut where one of them begins or ends, so no index is built twice.

    Raises:
        ValueError: ``part_size`` is not a positive integer (at most ``2**40``).
    """
    part_size = _check_size(part_size)
    missing = store.missing(indices)
    if len(missing) and around:
        held = np.zeros(len(missing), dtype=bool)
        for a, b in around:
            held |= (missing >= a) & (missing < b)
        missing = missing[~held]
    if not len(missing):
        return []
    # Each index's piece: its aligned range, cut at the bounds of the ranges around it.
    start = (missing // part_size) * part_size
    stop = np.minimum(start + part_size, store.length)
    bounds = np.unique(np.array([x for r in around for x in r], dtype=np.int64))
    if len(bounds):
        below = np.searchsorted(bounds, missing, side="right")  # bounds[below - 1] <= index < bounds[below]
        start = np.where(below > 0, np.maximum(start, bounds[np.maximum(below - 1, 0)]), start)
        stop = np.where(below < len(bounds), np.minimum(stop, bounds[np.minimum(below, len(bounds) - 1)]), stop)
    cuts = np.flatnonzero(np.diff(start)) + 1
    firsts = np.concatenate([[0], cuts]).astype(np.int64)
    return [PlannedPart(int(start[k]), int(stop[k]), group) for k, group in zip(firsts, np.split(missing, cuts))]


def plan_around(found, length: int | None = None) -> tuple[list, list]:
    """Split the parts ``found`` (``(start, stop)`` each, maybe of several plans and part sizes) into
    those to keep, which never overlap, and those to drop (an index kept twice would be merged or
    composed twice): the parts of an exact cover of ``[0, length)`` when there is one (every index
    held once: nothing to build), else in index order, a part overlapping one kept before it is dropped.

    Example:
        >>> plan_around([(0, 16), (8, 24), (16, 32)])
        ([(0, 16), (16, 32)], [(8, 24)])
        >>> plan_around([(0, 24), (0, 16), (16, 32), (24, 32)], 32)
        ([(0, 16), (16, 32)], [(0, 24), (24, 32)])
    """
    found = sorted({(int(a), int(b)) for a, b in found})
    keep = cover(found, length) if length is not None else None
    if keep is None:
        keep, at = [], 0
        for start, stop in found:
            if start >= at:
                keep.append((start, stop))
                at = stop
    kept = set(keep)
    return keep, [b for b in found if b not in kept]


def cover(found, length: int) -> list | None:
    """Parts of ``found`` that hold every index of ``[0, length)`` exactly once, in index order (the
    fewest such parts ending each index), or ``None`` when no choice of them does.

    Example:
        >>> cover([(0, 16), (0, 24), (16, 40), (24, 40)], 40), cover([(0, 16)], 40)
        ([(0, 16), (16, 40)], None)
    """
    came = {0: None}  # an index reached by a chain of parts from 0: the part that reached it
    for start, stop in sorted({(int(a), int(b)) for a, b in found}):
        if start in came and stop not in came and stop <= length:
            came[stop] = (start, stop)
    if length not in came:
        return None
    chain, at = [], length
    while at:
        chain.append(came[at])
        at = came[at][0]
    return chain[::-1]


def gaps(length: int, part_size: int, kept, keys=None) -> list[tuple[int, int]]:
    """The ranges of ``[0, length)`` no part of ``kept`` (disjoint ``(start, stop)``) holds, each
    inside one range aligned to ``part_size`` (of ``keys``, those ranges' first indices, or of all):
    what a build of whole parts (``gs://``, composed) still has to build.

    Example:
        >>> gaps(64, 24, [(0, 16), (32, 48)])
        [(16, 24), (24, 32), (48, 64)]
    """
    part_size = _check_size(part_size)
    kept = sorted((int(a), int(b)) for a, b in kept)
    firsts = range(0, length, part_size) if keys is None else sorted({int(k) // part_size * part_size for k in keys})
    out, j = [], 0
    for a in firsts:
        b = min(a + part_size, length)
        while j < len(kept) and kept[j][1] <= a:  # kept parts wholly before this range: never again
            j += 1
        at, k = a, j
        while k < len(kept) and kept[k][0] < b:
            if kept[k][0] > at:
                out.append((at, kept[k][0]))
            at = max(at, kept[k][1])
            k += 1
        if at < b:
            out.append((at, b))
    return out


def held(parts: str) -> list[tuple[int, int]]:
    """``(start, stop)`` of every part in the local parts directory ``parts`` that is whole, or being
    built by a live process (a claimed staging directory): what another driver of the same cache,
    maybe with another part size, is about to merge. A plan around them builds no index twice, unless
    both drivers plan at the same instant (then the merge stores each index once, and the second copy
    of those samples is computed for nothing).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); os.mkdir(os.path.join(d, part_name(0, 8))); held(d)
        [(0, 8)]
    """
    try:
        names = os.listdir(parts)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for name in names:
        bounds = parse_part_name(name)
        if bounds is None:
            left = leftover_of(name)
            if left is None or left[1] != LEFTOVER_OPS["build"]:
                continue
            bounds = parse_part_name(left[0])
            if bounds is None or not is_claimed(os.path.join(parts, name)):
                continue  # a dead build's: swept, not waited for
        out.append(bounds)
    return sorted(out)
