"""A cache in a local directory (a plain path or a ``file://`` URL): :class:`LocalLocation`, whose
store is :class:`nbkit.cachedir.CacheFiles`. The mirror and read-through backends keep their local
working copy or area through it too.

Example:
    >>> resolve("/tmp/my-cache").root, resolve("file:///tmp/my-cache").is_remote
    ('/tmp/my-cache', False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import format as fmt
from ..cachedir import CacheFiles, create_cache, remove_cache
from ..commit import recover
from .base import Location

__all__ = ["LocalLocation", "resolve"]


@dataclass
class LocalLocation(Location):
    """A cache in the local directory ``root``: ``nbkit.json`` and the data files of
    :class:`nbkit.cachedir.CacheFiles`, created, removed and swapped by :mod:`nbkit.cachedir`.

    Example:
        >>> import tempfile
        >>> loc = LocalLocation(url="x", root=tempfile.mkdtemp())
        >>> loc.read_meta() is None, loc.prepare(), loc.publish(), loc.is_remote
        (True, False, False, False)
    """

    meta_is_local_file = True

    def read_meta(self) -> dict | None:
        """The cache metadata, or ``None`` when no cache exists here yet."""
        if not os.path.exists(os.path.join(self.root, fmt.META)):
            if not recover(self.root):  # a swap interrupted by a crash: the moved-aside cache goes back
                return None
        return fmt.read_meta(self.root)

    def publish_meta(self, meta: dict) -> dict:
        """Create the store's files for ``meta``, then publish ``meta`` once; return whichever metadata won."""
        return create_cache(self.root, meta)  # files made durable and sized before anyone sees the metadata

    def open_store(self, meta: dict, *, writable: bool) -> CacheFiles:
        """The memory-mapped files of the cache, for this process."""
        return CacheFiles(self.root, meta, writable=writable)

    def remove(self) -> None:
        """Delete the cache here (metadata first), for ``overwrite=True``."""
        remove_cache(self.root)


def resolve(url: str, storage_options: dict | None = None, **location_options) -> LocalLocation:
    """The :class:`LocalLocation` of a local directory; ``local_max_bytes`` does not apply to one."""
    from fsspec.core import split_protocol, strip_protocol

    if location_options.get("local_max_bytes") is not None:
        raise ValueError(f"local_max_bytes only applies to a remote cache (gs://…), not to the local path {url}")
    unknown = set(location_options) - {"local_max_bytes"}
    if unknown:
        raise TypeError(f"unexpected options for a local cache: {sorted(unknown)}")
    protocol, _ = split_protocol(url)
    local = strip_protocol(url) if protocol else url
    return LocalLocation(url=url, root=os.path.abspath(os.path.expanduser(local)), is_remote=False,
                         storage_options=dict(storage_options or {}))
