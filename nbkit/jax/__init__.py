"""JAX reads a cache: as a Grain data source (:class:`GrainSource`: numpy samples, batched reads,
Grain's worker processes and checkpoints; :class:`GrainBatches`: records that are whole shuffled
batches, so Grain's per-record work is paid once a batch) or through a device feed
(:class:`JaxLoader`: batches as ``jax.Array`` s placed with a sharding, read ahead in the
background, resumed at the exact batch). The cache may have been written by a torch source or a
numpy one: what comes out is numpy (:func:`numpy_tree`), and torch tensors become numpy arrays
without a copy. The guide is ``docs/jax.md``.

``import nbkit`` never imports jax or grain, and neither does this package: its names load on first
use, and only :class:`JaxLoader` needs jax (``pip install jax grain``: nbkit-cache's ``jax`` extra).

Example:
    >>> import tempfile, numpy as np, nbkit
    >>> from nbkit.jax import GrainSource
    >>> src = [(np.full(2, i, np.float32), i) for i in range(6)]           # any list or dataset of numpy samples
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
    >>> source = GrainSource(ds)
    >>> len(source), source[4]
    (6, (array([4., 4.], dtype=float32), 4))
"""

from __future__ import annotations

from ..extras import lazy_names

__all__ = ["GrainSource", "GrainBatches", "JaxLoader", "place", "batch_sharding", "numpy_tree"]

_PUBLIC = {"GrainSource": "source", "GrainBatches": "grain_batches", "JaxLoader": "feed", "place": "feed", "batch_sharding": "feed", "numpy_tree": "trees"}

__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)  # nothing loads until a name is used
