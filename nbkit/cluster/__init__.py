"""Building one cache on many workers: plan parts, build each part anywhere, merge them in place.

The protocol (docs/DESIGN.md, "Building on many machines"): the missing indices of a cache are cut
into parts (contiguous index ranges); a worker computes one part and writes it as a small,
self-checking cache of that slice; the driver verifies each part (through :mod:`nbkit.trust`) and
merges it into the cache without moving sample bytes through itself where the storage allows it.
An :class:`~nbkit.cluster.engine.Engine` runs the part builds: local processes, a Ray or Dask cluster,
or the ranks of a torch.distributed / JAX job.

Example:
    >>> from nbkit import cluster
    >>> cluster.Engine.__name__
    'Engine'
"""

from __future__ import annotations

from ..extras import lazy_names

__all__ = ["Engine", "ExecutorEngine", "LocalEngine", "BuildReport", "run", "read_part", "VerifiedPart", "PartRefused",
           "run_ranks", "RanksIncomplete"]

__getattr__, __dir__ = lazy_names(__name__, {"Engine": "engine", "ExecutorEngine": "engine", "LocalEngine": "local",
                                             "BuildReport": "report", "run": "driver",
                                             "read_part": "part", "VerifiedPart": "part", "PartRefused": "part",
                                             "run_ranks": "ranks", "RanksIncomplete": "ranks"})
