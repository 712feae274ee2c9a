"""Read-through: train from a cache in a bucket that is larger than the local disk.

``CachedDataset.open("gs://bucket/cache", local_max_bytes=N)`` fetches the cache's metadata,
manifest and index once, then sample data in *pieces* (:mod:`.geometry`), on demand, into a local
area of at most ``N`` bytes shared by the host's processes (:mod:`.area`); the store
(:mod:`.store`) checks each fetched piece against the index's CRCs and prefetches ahead for
:class:`nbkit.samplers.PrefetchSampler`. Read-only: nothing is ever written to the bucket.

Example:
    >>> import os, tempfile, torch, nbkit
    >>> from unittest import mock
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(512.0)), tempfile.mkdtemp())
    >>> _ = ds.warmup(); _ = nbkit.push(ds.root, "memory://doctest/readthrough")
    >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):
    ...     rt = nbkit.CachedDataset.open("memory://doctest/readthrough", local_max_bytes=64 << 10)
    >>> float(rt[300][0]), store_of(rt).counters["fetched"]
    (300.0, 1)
"""

from .area import area_usage
from .geometry import Geometry
from .location import ReadThroughLocation, resolve
from .store import ReadThroughStore, store_of

__all__ = ["ReadThroughLocation", "ReadThroughStore", "Geometry", "resolve", "resolve_read_through", "store_of",
           "area_usage"]

resolve_read_through = resolve  # the name before nbkit.stores
