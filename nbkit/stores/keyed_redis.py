"""A keyed cache (:class:`nbkit.CacheLoader`) in Redis: one hash of values per server, shared by many hosts.

The URL is a Redis cache URL (``redis://[[user]:password@]host[:port][,host…]/<db>/<name>``, parsed
and connected by :class:`nbkit.stores.redis.RedisLocation`). Per server, ``nbkit:<name>:keyed:meta``
(created once) and the hash ``nbkit:<name>:keyed:values`` mapping each key (its stored form) to
``crc u4`` and the encoded value; a key lives on server ``crc32(key) % n``. ``HSETNX`` stores a value
whole or not at all, and only if no process stored the key first.

Example:
    >>> from nbkit.stores.registry import resolve
    >>> RedisKeyed.hash_key(resolve("redis://127.0.0.1:6379/0/team/aug"))
    'nbkit:team/aug:keyed:values'
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib

from .. import trust
from ..errors import CorruptCacheError
from ..extras import require
from .base import KeyedStore
from .keyed import MAX_KEY, check_keyed_meta, key_of, keyed_meta
from .redis import RedisLocation, is_oom

__all__ = ["RedisKeyed"]

_CRC = struct.Struct("<I")


class RedisKeyed(KeyedStore):
    """The values of one keyed cache on its Redis servers, for one process.

    Methods take keys in their stored form (:func:`nbkit.stores.keyed.key_bytes`).
    """

    is_remote = True

    def __init__(self, location: RedisLocation):
        self.location = location
        self.root = location.root
        self._clients = location.clients()
        self._n = len(self._clients)
        self._hash = self.hash_key(location)
        self._meta_key = location.prefix + "keyed:meta"
        self._warned = False
        body = json.dumps(dict(keyed_meta(), shards=self._n), sort_keys=True).encode()
        for k, c in enumerate(self._clients):
            self._write(k, c.set, self._meta_key, body, nx=True)
            raw = location.get_small(k, self._meta_key, "Delete the CacheLoader's Redis keys and let it fill again.")
            meta = check_keyed_meta(raw or body, f"{self._meta_key} on {self.root}")
            if meta.get("shards") != self._n:
                raise ValueError(
                    f"the keyed cache {location.parsed.name!r} was created over {meta.get('shards')} Redis server(s); the URL "
                    f"{location.url} names {self._n}. Give the same server list, in the same order, on every host."
                )

    @staticmethod
    def hash_key(location: RedisLocation) -> str:
        return location.prefix + "keyed:values"

    def _server(self, kb: bytes) -> int:
        return zlib.crc32(kb) % self._n if self._n > 1 else 0

    def _write(self, k: int, fn, *args, **kwargs):
        """A write to server ``k``; ``None`` (and one warning) when the server is at its memory limit."""
        try:
            return self.location.call(k, fn, *args, **kwargs)
        except require("redis", extra="redis", feature="redis:// caches").exceptions.ResponseError as e:
            if not is_oom(e):
                raise self._not_ours(k, e) from e
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"the Redis server {self.location.addresses[k]} of the CacheLoader {self.root} is full (maxmemory): "
                    "values that do not fit are returned but not stored, so load_fn runs again for them. Raise its "
                    "maxmemory (CONFIG SET maxmemory …), add servers to the URL, or free memory.",
                    UserWarning,
                    stacklevel=4,
                )
            return None

    def _read(self, k: int, fn, *args):
        """A read of the values hash on server ``k``; a key of another type there (a string, a list planted
        under nbkit's name) is a ``CorruptCacheError`` naming it, not the server's raw WRONGTYPE error."""
        try:
            return self.location.call(k, fn, *args)
        except require("redis", extra="redis", feature="redis:// caches").exceptions.ResponseError as e:
            raise self._not_ours(k, e) from e

    def _not_ours(self, k: int, e: Exception) -> CorruptCacheError:
        return CorruptCacheError(f"{self._hash} on the Redis server {self.location.addresses[k]} is not a CacheLoader's "
                                 f"values (the server says: {trust.shown(str(e))}). Delete that key (DEL {self._hash}) "
                                 "and let the CacheLoader fill again.")

    def get(self, kb: bytes, *, fresh: bool = False):
        """``(crc, value)`` of a stored key, or ``None`` (always read from the server: ``fresh`` changes nothing)."""
        k = self._server(kb)
        raw = self._read(k, self._clients[k].hget, self._hash, kb)
        if raw is None:
            return None
        if not isinstance(raw, bytes) or len(raw) < _CRC.size:  # its size first, then (by the caller) its checksum
            got = f"{len(raw)} bytes" if isinstance(raw, bytes) else trust.shown(raw)
            raise CorruptCacheError(f"the value of key {key_of(kb)!r} in {self._hash} on the Redis server "
                                    f"{self.location.addresses[k]} is {got}, shorter than its {_CRC.size}-byte checksum.")
        return _CRC.unpack_from(raw)[0], memoryview(raw)[_CRC.size:]

    def contains(self, kb: bytes) -> bool:
        k = self._server(kb)
        return bool(self._read(k, self._clients[k].hexists, self._hash, kb))

    def put(self, kb: bytes, crc: int, value: bytes, *, replace: bool = False) -> bool:
        """Store ``value`` under ``kb`` unless another process stored the key first (or ``replace``);
        return whether this call stored it."""
        k = self._server(kb)
        c = self._clients[k]
        data = _CRC.pack(crc) + bytes(value)
        done = self._write(k, c.hset if replace else c.hsetnx, self._hash, kb, data)
        return bool(done)

    def count(self) -> int:
        return sum(int(self._read(k, c.hlen, self._hash)) for k, c in enumerate(self._clients))

    def keys(self) -> list:
        """Every stored key, in stored form."""
        fix = "Delete the CacheLoader's Redis keys and let it fill again."
        return [trust.check_stored_key(kb, MAX_KEY, f"{self._hash} on the Redis server {self.location.addresses[k]}", fix)
                for k, c in enumerate(self._clients) for kb in self._read(k, c.hkeys, self._hash)]

    def __repr__(self) -> str:
        return f"RedisKeyed({self.root!r})"

    def close(self) -> None:
        pass
