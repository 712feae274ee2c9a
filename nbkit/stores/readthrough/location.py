"""Where a read-through cache lives: the remote URL and its local area (``<working copy>.readthrough``).

``prepare()`` fetches ``manifest.json``, then ``nbkit.json`` and ``index.bin`` (each read bounded by
and checked against its manifest entry) into the local area, never the data; the cache is
read-only through it.

Example:
    >>> loc = resolve("gs://bucket/cache", {"token": "anon"}, local_max_bytes=1 << 30)
    >>> loc.root.endswith(".readthrough"), loc.is_remote, loc.publish()
    (True, True, False)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ... import format as fmt
from ... import trust
from ...errors import CorruptCacheError
from ...transfer.manifest import MANIFEST, REPUSH, check_listing, read_local_manifest, read_remote_manifest
from ...transfer.remote import connect, remote_errors
from ..local import LocalLocation
from ..mirror import working_copy_dir
from .area import area_lock, read_listed, replace_area
from .geometry import Geometry
from .store import ReadThroughStore

__all__ = ["ReadThroughLocation", "resolve", "AREA_SUFFIX"]

AREA_SUFFIX = ".readthrough"




def resolve(url: str, storage_options: dict | None = None, *, local_max_bytes: int,
                         piece_bytes: int | None = None, **unused) -> "ReadThroughLocation":
    """The :class:`ReadThroughLocation` of ``url`` (what the registry returns for ``local_max_bytes=``);
    no network access until ``prepare()``.

    Args:
        url: a pushed cache, e.g. ``"gs://bucket/caches/mnist"``.
        storage_options: passed to fsspec.
        local_max_bytes: the most bytes the local area may hold (index and metadata included).
        piece_bytes: the size of a piece (default: ``local_max_bytes / 12``, at most 8 MiB).

    Example:
        >>> loc = resolve("gs://bucket/cache", {"token": "anon"}, local_max_bytes=1 << 30)
        >>> loc.root.endswith(".readthrough"), loc.is_remote
        (True, True)
    """
    if unused:
        raise TypeError(f"read-through does not take the option(s) {sorted(unused)}")
    limit = int(local_max_bytes)
    if limit <= 0:
        raise ValueError(f"local_max_bytes must be a positive number of bytes, got {local_max_bytes!r}")
    return ReadThroughLocation(url=os.fspath(url), root=working_copy_dir(url, storage_options) + AREA_SUFFIX,
                               is_remote=True, storage_options=dict(storage_options or {}),
                               local_max_bytes=limit, piece_bytes=piece_bytes)


@dataclass
class ReadThroughLocation(LocalLocation):
    """A remote cache read through a bounded local area (see the module docstring).

    Attributes:
        local_max_bytes: the most bytes the local area holds.
        piece_bytes: the piece size asked for (``None``: chosen from ``local_max_bytes``).

    Example:
        >>> loc = resolve("memory://doctest/location", local_max_bytes=1 << 20)
        >>> isinstance(loc, ReadThroughLocation), loc.local_max_bytes, loc.publish()
        (True, 1048576, False)
    """

    local_max_bytes: int = 0
    piece_bytes: int | None = None
    _meta: dict | None = field(default=None, repr=False)
    _manifest: dict | None = field(default=None, repr=False)

    def prepare(self, callback=None) -> bool:
        """Fetch the metadata, manifest and index into the local area (never the data); return ``False``.

        Raises:
            FileNotFoundError: the bucket or the cache at the URL does not exist.
            CorruptCacheError: the remote metadata, manifest or index is damaged.
            ValueError: ``local_max_bytes`` cannot hold the index and two pieces.
        """
        fix = "then open it again"
        fs, rroot = connect(self.url, self.storage_options, doing="opening (read-through)", fix=fix)
        with remote_errors(fs, self.url, "opening (read-through)", fix):
            fs.invalidate_cache()
            # The manifest first (at most MAX_JSON_BYTES): every other read is bounded by its sizes.
            manifest = read_remote_manifest(fs, rroot, self.url)
            if manifest is None:
                if not fs.exists(f"{rroot}/{fmt.META}"):
                    raise FileNotFoundError(_absent(fs, self.url, rroot))
                raise CorruptCacheError(f"{self.url} has {fmt.META} but no {MANIFEST}: it was not written by nbkit.push, "
                                        "and read-through needs the manifest. Push the cache with nbkit.push.")
            entry = manifest["files"].get(fmt.META)
            if entry is None:  # a partial manifest: a push in progress
                raise FileNotFoundError(_absent(fs, self.url, rroot))
            trust.check_bound(entry["size"], trust.MAX_JSON_BYTES, f"{self.url}/{MANIFEST}", f"bytes of {fmt.META}",
                              "far more than any nbkit metadata", REPUSH)
            try:
                meta_raw = read_listed(fs, rroot, self.url, manifest, fmt.META)
            except FileNotFoundError:
                raise FileNotFoundError(_absent(fs, self.url, rroot)) from None
            check_listing(fs, rroot, self.url, manifest)  # the manifest's sizes are the objects' real sizes
            meta = fmt.parse_meta(meta_raw, f"{self.url}/{fmt.META}", "Push the cache again with nbkit.push.")
            Geometry.of(  # checks now that the limit can hold the index and two pieces
                meta, manifest, self.local_max_bytes, self.piece_bytes, self.url)
            os.makedirs(self.root, exist_ok=True)
            with area_lock(self.root):
                if read_local_manifest(self.root) != manifest or not os.path.exists(os.path.join(self.root, fmt.INDEX)):
                    replace_area(self.root, fs, rroot, self.url, manifest, meta_raw)
        self._meta, self._manifest = meta, manifest
        return False

    def read_meta(self) -> dict:
        if self._meta is None:
            self.prepare()
        return self._meta

    def publish_meta(self, meta: dict) -> dict:
        raise PermissionError(f"a read-through cache is read-only: no cache can be created at {self.url} through it. "
                              "Warm the cache locally, nbkit.push it there, then open it with local_max_bytes=.")

    def open_store(self, meta: dict, *, writable: bool) -> ReadThroughStore:
        if self._manifest is None:
            self.prepare()
        return ReadThroughStore(self, meta, self._manifest, writable=writable)

    def remove(self) -> None:
        raise PermissionError(f"a read-through cache is read-only: overwrite=True cannot replace {self.url}. "
                              "Open it without local_max_bytes to rebuild it, or push a new cache there with nbkit.push.")

    def publish(self, callback=None) -> bool:
        return False  # read-only: nothing is ever written to the bucket


def _absent(fs, url: str, rroot: str) -> str:
    bucket = rroot.split("/", 1)[0]
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if any(p in ("gs", "gcs", "s3", "s3a") for p in protocols):
        try:
            exists = fs.exists(bucket)
        except OSError:
            exists = True
        if not exists:
            return (f"the bucket {bucket!r} of {url} does not exist (or these credentials cannot see it). Check the URL "
                    "and storage_options, or create the bucket and nbkit.push a cache there.")
    return (f"{url} holds no complete nbkit cache ({fmt.META} is missing): push one with nbkit.push(cache_dir, {url!r}) "
            "first, check the prefix, or wait until a push in progress has finished.")
