"""The ``Location`` base class: where one cache lives, and the hooks the engine calls on it.

``CachedDataset`` resolves its path once (:func:`nbkit.stores.registry.resolve`) and then calls
only these hooks: ``prepare()``, ``read_meta()``, ``not_found()``, ``publish_meta(meta)``,
``open_store(meta, writable=...)``, ``remove()``, ``publish()``. The base class implements them for
a local directory (the store is :class:`nbkit.cachedir.CacheFiles`); a backend that keeps samples
elsewhere (a bucket's working copy, Redis, a bucket read through) subclasses it and overrides them.

Example:
    >>> import tempfile
    >>> loc = Location(url="x", root=tempfile.mkdtemp())
    >>> loc.read_meta() is None, loc.prepare(), loc.publish(), loc.is_remote
    (True, False, False, False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from .. import format as fmt
from ..cachedir import CacheFiles, remove_cache

__all__ = ["Location"]


@dataclass
class Location:
    """A resolved cache location.

    Attributes:
        url: the path or URL as given.
        root: the local directory the engine reads and writes (or, for a store without one, a
            normalized form of the URL).
        is_remote: ``True`` when the cache lives elsewhere than ``root`` alone.
        storage_options: passed to fsspec (or the backend's client) for ``url``.
    """

    url: str
    root: str
    is_remote: bool = False
    storage_options: dict = field(default_factory=dict)

    #: Whether :meth:`publish` sends anything: the engine then calls it once the store becomes complete.
    publishes = False

    def read_meta(self) -> dict | None:
        """The cache metadata, or ``None`` when no cache exists here yet."""
        if not os.path.exists(os.path.join(self.root, fmt.META)):
            return None
        return fmt.read_meta(self.root)

    def not_found(self) -> Exception:
        """The error for opening a cache that does not exist here (naming how to make one)."""
        try:
            fmt.read_meta(self.root)
        except FileNotFoundError as e:
            return e
        return FileNotFoundError(f"no nbkit cache at {self.url}")

    def publish_meta(self, meta: dict) -> dict:
        """Create the store's files for ``meta``, then publish ``meta`` once; return whichever metadata won."""
        os.makedirs(self.root, exist_ok=True)
        CacheFiles(self.root, meta, writable=True).close()  # sized before anyone sees the metadata
        return fmt.publish_meta(self.root, meta)

    def open_store(self, meta: dict, *, writable: bool):
        """The sample store (see ``docs/DESIGN.md``, "Store protocol") for this process."""
        return CacheFiles(self.root, meta, writable=writable)

    def remove(self) -> None:
        """Delete the cache here (metadata first), for ``overwrite=True``."""
        remove_cache(self.root)

    def prepare(self, callback=None) -> bool:
        """Bring the cache within reach before the engine opens it; return whether anything was fetched."""
        return False

    def publish(self, callback=None) -> bool:
        """Make what was stored here visible at the URL; return whether anything was sent."""
        return False
