"""nbkit: persistent, fast sample caches for PyTorch datasets in notebooks.

Example:
    >>> import torch, tempfile, nbkit
    >>> src = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.arange(64))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp())
    >>> _ = ds.warmup()
    >>> loader = torch.utils.data.DataLoader(ds, batch_size=16, collate_fn=nbkit.collate)
    >>> [x.shape for x, y in loader][0]
    torch.Size([16, 4])
"""

from __future__ import annotations

import sys
import types

from .extras import lazy_names
from .errors import (CorruptCacheError, MissingSampleError, NondeterministicSourceError, StaleCacheError,
                     UnsafeArchiveError)

__version__ = "0.1.0"

__all__ = [
    "CachedDataset",
    "CacheLoader",
    "DeviceLoader",
    "EpochSampler",
    "PrefetchSampler",
    "collate",
    "fields",
    "register_namedtuple",
    "Callback",
    "TextProgress",
    "StaleCacheError",
    "CorruptCacheError",
    "MissingSampleError",
    "NondeterministicSourceError",
    "UnsafeArchiveError",
    "export_tar",
    "import_tar",
    "push",
    "pull",
    "caches",
    "remove",
    "prune",
]

# Each public name is imported from its module on first use, so that ``import nbkit`` (and the
# ``nbkit`` command, which never needs torch) loads no more than it uses: torch loads with the
# engine, the optional world with its front end.
_PUBLIC = {
    "CachedDataset": "dataset", "CacheLoader": "cacheloader", "DeviceLoader": "loader",
    "EpochSampler": "samplers", "PrefetchSampler": "samplers", "collate": "collate",
    "fields": "transforms", "register_namedtuple": "codec", "Callback": "progress", "TextProgress": "progress",
    "export_tar": "transfer.archive", "import_tar": "transfer.archive", "push": "transfer.sync", "pull": "transfer.sync",
    "caches": "disk", "remove": "disk", "prune": "disk",
}


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)


class _Package(types.ModuleType):
    """``nbkit``: a public name that is also a submodule's (``nbkit.collate``, the function, lives in
    ``nbkit/collate.py``) stays the public object when the submodule is imported later; the import
    system would otherwise set the package's attribute to the module."""

    def __setattr__(self, name, value):
        if name in _PUBLIC and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
