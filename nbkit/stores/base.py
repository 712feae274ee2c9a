"""The ``Location`` base class: where one cache lives, and the hooks the engine calls on it.

``CachedDataset`` resolves its path once (:func:`nbkit.stores.registry.resolve`) and then calls
only these hooks: ``prepare()``, ``read_meta()``, ``not_found()``, ``publish_meta(meta)``,
``open_store(meta, writable=...)``, ``remove()``, ``publish()``, ``close()``, and
:meth:`Location.check_generation` (has the cache been rebuilt since a handle opened it?). The base
class implements them for a local directory (the store is :class:`nbkit.cachedir.CacheFiles`); a
backend that keeps samples elsewhere (a bucket's working copy, Redis, a bucket read through)
subclasses it and overrides them.

Example:
    >>> import tempfile
    >>> loc = Location(url="x", root=tempfile.mkdtemp())
    >>> loc.read_meta() is None, loc.prepare(), loc.publish(), loc.is_remote
    (True, False, False, False)
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field

from .. import format as fmt
from ..cachedir import CacheFiles, create_cache, remove_cache
from ..commit import recover
from ..errors import StaleCacheError

__all__ = ["Location", "Generation", "new_generation"]


def new_generation() -> str:
    """A fresh generation id for the metadata of a cache being created: 32 lowercase hex characters."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Generation:
    """Which build of a cache a handle opened.

    Attributes:
        id: the ``generation`` field of its ``nbkit.json`` (``None`` for caches made before nbkit
            wrote one: their file's identity stands in for it).
        stamp: ``(device, inode, mtime_ns, size)`` of ``nbkit.json`` when it was read (``None`` where
            the metadata is not a local file): unchanged means unchanged, at the cost of one ``stat``.
    """

    id: str | None
    stamp: tuple | None


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
    #: Whether the metadata is the local file ``root/nbkit.json`` (so a ``stat`` tells whether it changed).
    meta_is_local_file = True

    def meta_stamp(self) -> tuple | None:
        """``(device, inode, mtime_ns, size)`` of ``nbkit.json``, or ``None`` when it is absent."""
        try:
            st = os.stat(os.path.join(self.root, fmt.META))
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def generation_of(self, meta: dict) -> Generation:
        """The :class:`Generation` of ``meta``, just read from here."""
        return Generation(meta.get("generation"), self.meta_stamp() if self.meta_is_local_file else None)

    def check_generation(self, opened: Generation, *, reread: bool = False) -> tuple[Generation, bool]:
        """Raise :class:`StaleCacheError` if the cache here is no longer the build ``opened``.

        Cheap when nothing changed: one ``stat`` of ``nbkit.json`` (``reread`` reads it anyway, as a
        store does when it opens). Returns ``(current, replaced)``: ``replaced`` when the files were
        replaced by a copy of the same build (an import or pull of this cache), so the caller
        reopens its store. Metadata that is not a local file (Redis) is read only when ``reread``.
        """
        if not self.meta_is_local_file and not reread:
            return opened, False
        stamp = self.meta_stamp() if self.meta_is_local_file else None
        if self.meta_is_local_file and stamp is not None and stamp == opened.stamp and not reread:
            return opened, False
        if self.meta_is_local_file and stamp is None:
            raise self._stale("its nbkit.json is gone (overwrite=True removes a cache before rebuilding it)")
        try:
            meta = self.read_meta()
        except FileNotFoundError:
            meta = None
        if meta is None:
            if self.meta_is_local_file:
                raise self._stale("its nbkit.json is gone (overwrite=True removes a cache before rebuilding it)")
            # A server that lost its memory (restarted, flushed): its store publishes the metadata
            # again and the samples are recomputed; that is not a rebuild.
            return opened, False
        current = Generation(meta.get("generation"), stamp)
        if opened.id is not None or current.id is not None:
            same = current.id == opened.id
        else:  # caches made before generation ids: the metadata file's identity is the generation
            same = not self.meta_is_local_file or stamp == opened.stamp
        if not same:
            raise self._stale("it was rebuilt (overwrite=True) by another handle or process after this one opened it")
        return current, current.stamp != opened.stamp

    def _stale(self, what: str) -> StaleCacheError:
        return StaleCacheError(
            f"the cache at {self.url} is not the one this dataset opened: {what}. This handle no longer reads or "
            f"writes there, so the rebuilt cache never receives samples of the old source. Open it again: "
            f"nbkit.CachedDataset(source, {self.url!r}) (or CachedDataset.open for a cache without its source)."
        )

    def read_meta(self) -> dict | None:
        """The cache metadata, or ``None`` when no cache exists here yet."""
        if not os.path.exists(os.path.join(self.root, fmt.META)):
            if not recover(self.root):  # a swap interrupted by a crash: the moved-aside cache goes back
                return None
        return fmt.read_meta(self.root)

    def existing_meta(self) -> dict:
        """The metadata of the cache that must exist here (opening without a source); else :meth:`not_found`.

        Example:
            >>> import tempfile
            >>> from nbkit.stores import registry
            >>> registry.resolve(tempfile.mkdtemp(), None).existing_meta()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            FileNotFoundError: ...
        """
        meta = self.read_meta()
        if meta is None:
            raise self.not_found()
        return meta

    def not_found(self) -> Exception:
        """The error for opening a cache that does not exist here (naming how to make one)."""
        try:
            fmt.read_meta(self.root)
        except FileNotFoundError as e:
            return e
        return FileNotFoundError(f"no nbkit cache at {self.url}")

    def publish_meta(self, meta: dict) -> dict:
        """Create the store's files for ``meta``, then publish ``meta`` once; return whichever metadata won."""
        return create_cache(self.root, meta)  # files made durable and sized before anyone sees the metadata

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

    def close(self) -> None:
        """Release what this location holds in this process (connections); called by
        ``CachedDataset.close()`` after its store is closed. Default: nothing to release."""
