"""``GrainSource``: a cache as a Grain ``RandomAccessDataSource``.

Grain reads any object with ``__len__`` and ``__getitem__`` (grain 0.2.18 reads one record at a
time; ``_getitems`` is its batched read, for the versions and callers that use it); this one
answers from the cache (a record: one row of each column; a batch: one gather per column), with samples as
numpy pytrees: rows of the verified columns, no tensor made (:func:`nbkit.jax.trees.numpy_rows`),
or through the engine's batch path and :func:`nbkit.jax.numpy_tree` for what the columns cannot
serve (samples not stored yet, variable-shape fields, a ``transform=``). It pickles into Grain's worker processes as the
cache's location, not its files nor its source (:meth:`nbkit.CachedDataset.without_source`): each
worker reopens the cache on its first read and counts into the same ``stats`` (the hit-rate meter
sees the workers' reads). A cache not yet complete travels with its source instead, so workers
compute and store what is missing, as a ``DataLoader``'s workers do. Grain is not imported here:
the protocol is structural.

Example:
    >>> import tempfile, numpy as np, nbkit, grain
    >>> ds = nbkit.CachedDataset([{"x": np.arange(3) + i, "y": i} for i in range(8)], tempfile.mkdtemp())
    >>> _ = ds.warmup()
    >>> batches = grain.MapDataset.source(GrainSource(ds)).shuffle(seed=0).batch(4)
    >>> sorted(batches[0]["y"].tolist() + batches[1]["y"].tolist())
    [0, 1, 2, 3, 4, 5, 6, 7]
"""

from __future__ import annotations

import os
import threading

from ..collate import SampleBatch
from ..dataset import CachedDataset
from ..samplers import cache_identity, content_identity
from ..trust import check_indices
from .trees import numpy_rows, numpy_tree

__all__ = ["GrainSource"]


class GrainSource:
    """A cache as a Grain data source: ``len(source)``, ``source[i]`` and ``source._getitems(indices)``
    give numpy samples, for ``grain.MapDataset.source``, ``grain.DataLoader`` (with
    ``worker_count`` ≥ 1 too) and Grain's checkpoints (its ``repr`` names the cache and its build).

    Args:
        cache: a :class:`nbkit.CachedDataset`, or the path or URL of a cache (opened without its source).
        storage_options: for a URL given as ``cache``: passed to fsspec (credentials, endpoint).

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(6.0).view(3, 2)), tempfile.mkdtemp())
        >>> _ = ds.warmup()
        >>> source = GrainSource(ds.root)                  # by path: no source needed
        >>> source[2], source._getitems([1, 0])            # tensors come out as numpy arrays
        ((array([4., 5.], dtype=float32),), [(array([2., 3.], dtype=float32),), (array([0., 1.], dtype=float32),)])
    """

    def __init__(self, cache, *, storage_options: dict | None = None):
        if isinstance(cache, (str, os.PathLike)):
            cache = CachedDataset.open(os.fspath(cache), storage_options=storage_options)
        elif not isinstance(cache, CachedDataset):
            raise TypeError(f"GrainSource needs an nbkit.CachedDataset or the path of a cache, got {type(cache).__name__}; "
                            "cache the dataset first: nbkit.CachedDataset(source, path)")
        elif storage_options is not None:
            raise TypeError("GrainSource: storage_options= goes with a path or URL; a CachedDataset has its own")
        self.dataset = cache
        self._opened = threading.Lock()  # Grain reads from many threads: the first read opens the files once

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self._getitems([index])[0]

    def _open(self) -> CachedDataset:
        """The cache, its files opened (and checked) in this process by the first thread that asks."""
        ds = self.dataset
        lock = self._opened
        if lock is not None:
            with lock:
                ds.store
            self._opened = None
        return ds

    def _getitems(self, indices) -> list:
        """The samples ``indices`` (one batched read of the cache), as Grain's batched read asks."""
        ds = self._open()
        idx = check_indices(indices, len(ds))  # integers only; [1.5] or ["3"] is a TypeError, 2**70 an IndexError
        if ds.transform is None:
            # Stored samples of fixed-shape fields: rows of the verified columns, no tensor made.
            columns = ds.read_columns(idx)
            if columns is not None:
                return numpy_rows(ds.schema, columns, len(idx))
        batch = ds.__getitems__(idx.tolist())  # computes, repairs, transforms: the engine's own path
        samples = batch.samples() if isinstance(batch, SampleBatch) else batch
        return [numpy_tree(s) for s in samples]

    def __getstate__(self):
        ds = self.dataset
        if ds.source is None or ds.is_complete:
            ds = ds.without_source()  # workers reopen the files by location, never with the source
        return {"dataset": ds}

    def __setstate__(self, state):
        self.dataset = state["dataset"]
        self._opened = threading.Lock()

    def __repr__(self) -> str:
        # Grain's DataLoader checkpoints compare the source's repr: the path, the length and what the
        # cache holds (as DeviceLoader's resume state: a cache rebuilt from the same source is the same).
        ds = self.dataset
        return f"nbkit.jax.GrainSource({ds.path!r}, length={len(ds)}, content={content_identity(ds) or cache_identity(ds)!r})"
