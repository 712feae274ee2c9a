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

from .cacheloader import CacheLoader
from .codec import register_namedtuple
from .collate import collate
from .dataset import CachedDataset
from .loader import DeviceLoader
from .errors import (CorruptCacheError, MissingSampleError, NondeterministicSourceError, StaleCacheError,
                     UnsafeArchiveError)
from .progress import Callback, TextProgress
from .transforms import fields

__version__ = "0.1.0"

__all__ = [
    "CachedDataset",
    "CacheLoader",
    "DeviceLoader",
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


def __getattr__(name):
    # Transfer functions live in their own modules; import them on first use.
    if name in ("export_tar", "import_tar"):
        from . import archive

        return getattr(archive, name)
    if name in ("caches", "remove", "prune"):
        from . import disk

        return getattr(disk, name)
    if name in ("push", "pull"):
        from . import transfer

        return getattr(transfer, name)
    if name in _SUBMODULES:
        # nbkit.tpu, nbkit.widgets … load (with their optional dependencies) on first use.
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'nbkit' has no attribute {name!r}")


_SUBMODULES = ("tpu", "widgets", "bench", "offline", "readthrough", "redis_store", "storage", "progress", "stats",
               "stores", "samplers")
