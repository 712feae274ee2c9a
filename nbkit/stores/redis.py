"""A cache whose samples live in Redis: one in-memory cache shared by many hosts.

``redis://[[user]:password@]host[:port][,host[:port]…]/<db>/<name>`` (``rediss://`` for TLS): samples
sharded over the servers (``i % n``), one value per sample checked against its CRC like a local
cache; a full server is never allowed to evict silently, and lost samples are recomputed from the
source (``docs/DESIGN.md``, "Stores").

Example:
    >>> from nbkit.stores.redis import parse_url
    >>> parse_url("redis://10.0.0.1:6379,10.0.0.2:6380/0/mnist").servers
    [('10.0.0.1', 6379), ('10.0.0.2', 6380)]
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import struct
import time
import warnings
from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from .. import trust
from ..codec import Schema
from ..errors import CorruptCacheError, MissingSampleError
from ..extras import require
from ..gather import physical_memory
from ..text import format_bytes, format_list
from .base import Location, Store

__all__ = ["RedisLocation", "RedisStore", "is_oom", "RedisURL", "parse_url", "resolve", "resolve_redis", "FULL_RETRY_SECONDS",
           "PUT_BYTES", "CONNECT_SECONDS", "ANSWER_SECONDS", "MAX_LENGTH", "MAX_VALUE_BYTES"]

FULL_RETRY_SECONDS = 30.0  # after a write hit maxmemory, skip writes to that server this long
_HEADER = struct.Struct("<BI")  # flags, crc: the record fields stored in front of each sample
PUT_BYTES = 16 << 20  # at most this much sample data per write call (large samples, bounded buffers)
_BITMAP_ABOVE = 8192  # is_stored() of more indices than this reads the bitmap, not the samples
#: A TCP connection to a server, then each of its answers: a silent server fails within seconds (a
#: timeout is not retried; a refused or dropped connection is, over a restart). Override them with
#: ``storage_options={"socket_connect_timeout": s, "socket_timeout": s}``.
CONNECT_SECONDS = 5.0
ANSWER_SECONDS = 10.0
#: The most samples a Redis cache holds: its bitmap of stored samples is one Redis string (SETBIT
#: takes offsets below 2**32).
MAX_LENGTH = 1 << 32
#: The largest value a Redis server stores (``proto-max-bulk-len``'s default): one sample's rows must fit.
MAX_VALUE_BYTES = 512 << 20
#: Bytes of this process's memory a reader needs per sample of the cache (checked-sample flags,
#: index arrays of missing samples, admission slots).
_READER_BYTES = 16
_NAME = re.compile(r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$")  # no glob character: key patterns need no escaping

# Store samples on one server, atomically: nothing if the server lost this cache (returns -1, the
# caller re-creates its metadata and retries) or is at maxmemory (the first write, SET, fails with
# OOM before anything changed). KEYS: live marker, bitmap, byte counter, sample keys; ARGV: pairs
# of (index, value).
_PUT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local grown = 0
for j = 4, #KEYS do
  local old = redis.call('STRLEN', KEYS[j])
  local v = ARGV[2 * (j - 3)]
  redis.call('SET', KEYS[j], v)
  redis.call('SETBIT', KEYS[2], ARGV[2 * (j - 3) - 1], 1)
  grown = grown + string.len(v) - old
end
redis.call('INCRBY', KEYS[3], grown)
return grown
"""

# Delete samples (that could not be replaced on a full server). DEL comes first: it is allowed at
# maxmemory, and once a script has written, Redis lets it finish. KEYS: bitmap, byte counter,
# sample keys; ARGV: their indices.
_DROP = """
local shrunk = 0
for j = 3, #KEYS do
  local old = redis.call('STRLEN', KEYS[j])
  if redis.call('DEL', KEYS[j]) == 1 then
    redis.call('SETBIT', KEYS[1], ARGV[j - 2], 0)
    shrunk = shrunk + old
  end
end
redis.call('DECRBY', KEYS[2], shrunk)
return shrunk
"""


def _redis():
    return require("redis", extra="redis", feature="redis:// caches")


@dataclass(frozen=True)
class RedisURL:
    """A parsed ``redis://`` cache URL.

    Attributes:
        servers: ``(host, port)`` of each server, in shard order.
        db: the Redis database number.
        name: the cache's namespace.
        username, password: from the URL's user info, if any.
        ssl: ``True`` for ``rediss://``.

    Example:
        >>> parse_url("rediss://h1,h2:7000/0/mnist").ssl
        True
    """

    servers: list
    db: int
    name: str
    username: str | None = None
    password: str | None = None
    ssl: bool = False


def parse_url(url: str) -> RedisURL:
    """Split ``redis://[user:pass@]h1[:p1][,h2[:p2]…]/<db>/<name>`` into its parts.

    Example:
        >>> u = parse_url("redis://:secret@cache-host/3/team/mnist")
        >>> u.servers, u.db, u.name, u.password
        ([('cache-host', 6379)], 3, 'team/mnist', 'secret')
    """
    from urllib.parse import unquote

    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("redis", "rediss"):
        raise ValueError(f"{url!r} is not a redis:// or rediss:// URL")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
    servers = []
    for part in netloc.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [IPv6]:port
            host, _, tail = part[1:].partition("]")
            port = tail.lstrip(":") or "6379"
        else:
            host, _, port = part.partition(":")
            port = port or "6379"
        if not host or not port.isdigit():
            raise ValueError(f"bad server {part!r} in {url!r}: expected host:port, e.g. redis://10.0.0.1:6379/0/mnist")
        servers.append((host, int(port)))
    if not servers:
        raise ValueError(f"{url!r} names no server: expected redis://host:port/<db>/<name>, e.g. redis://127.0.0.1:6379/0/mnist")
    segments = [s for s in path.split("/") if s]
    db = 0
    if segments and segments[0].isdigit():
        db = int(segments.pop(0))
    name = "/".join(segments)
    if not _NAME.match(name):
        raise ValueError(
            f"{url!r} needs a cache name after the database number, made of letters, digits, '.', '_', '-' and '/' "
            f"(got {name!r}): e.g. redis://127.0.0.1:6379/0/mnist. The name keeps caches sharing a server apart."
        )
    return RedisURL(servers=servers, db=db, name=name, username=username, password=password, ssl=scheme == "rediss")


def resolve(url: str, storage_options: dict | None = None, **location_options) -> "RedisLocation":
    """The :class:`RedisLocation` of a ``redis://`` URL; no network access (the registry calls this).

    Example:
        >>> resolve("redis://127.0.0.1:6379/0/team/mnist").meta_key
        'nbkit:team/mnist:meta'
    """
    if location_options.get("local_max_bytes") is not None:
        raise ValueError(f"local_max_bytes applies to a gs:// cache read through a local area, not to the Redis cache {url}")
    unknown = set(location_options) - {"local_max_bytes"}
    if unknown:
        raise TypeError(f"unexpected options for a Redis cache: {sorted(unknown)}")
    return RedisLocation(url, storage_options)


resolve_redis = resolve  # the name before nbkit.stores


def meta_tag(meta: dict) -> str:
    """A short hash of the metadata: sample keys of different caches (or generations) never collide."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def _meta_body(meta: dict) -> bytes:
    """The metadata as stored under ``nbkit:<name>:meta``."""
    return json.dumps(meta, indent=1, sort_keys=True).encode()


class RedisLocation(Location):
    """Where a Redis cache lives: its servers, database and name. Holds one client per server per process.

    Example:
        >>> loc = resolve("redis://127.0.0.1:6379,127.0.0.1:6380/0/mnist")
        >>> loc.is_remote, loc.root
        (True, 'redis://127.0.0.1:6379,127.0.0.1:6380/0/mnist')
    """

    # The metadata lives on the servers: a handle checks its generation when its store opens (one
    # GET), and a rebuilt cache's sample keys carry another meta_tag, so an old handle's writes
    # never land among them.
    meta_is_local_file = False

    def __init__(self, url: str, storage_options: dict | None = None):
        self.parsed = parse_url(url)
        p = self.parsed
        hosts = ",".join(f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h, port in p.servers)
        super().__init__(url=url, root=f"{'rediss' if p.ssl else 'redis'}://{hosts}/{p.db}/{p.name}", is_remote=True,
                         storage_options=dict(storage_options or {}))
        self.prefix = f"nbkit:{p.name}:"
        self.meta_key = self.prefix + "meta"
        self._clients = None
        self._clients_pid = None

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_clients"] = None  # connections never cross a fork or a pickle: each process opens its own
        state["_clients_pid"] = None
        return state

    @property
    def addresses(self) -> list[str]:
        return [f"{h}:{port}" for h, port in self.parsed.servers]

    def clients(self) -> list:
        """One ``redis.Redis`` per server for this process, opened on first use: each server's RESP3
        handshake and eviction policy are checked then."""
        if self._clients is None or self._clients_pid != os.getpid():
            redis = _redis()
            from redis.backoff import ExponentialBackoff
            from redis.retry import Retry

            p = self.parsed
            options = {"socket_connect_timeout": CONNECT_SECONDS, "socket_timeout": ANSWER_SECONDS, "protocol": 3,
                       "username": p.username, "password": p.password}
            if p.ssl:
                options["ssl"] = True
            options.update(self.storage_options)
            self._answer_seconds = options.get("socket_timeout")
            clients = []
            for k, (host, port) in enumerate(p.servers):
                # Rides over a restart or a dropped connection. A timeout is not retried: a server that
                # accepts connections and never answers must fail in seconds, not minutes.
                retry = Retry(ExponentialBackoff(cap=0.5, base=0.05), 4, supported_errors=(redis.exceptions.ConnectionError,))
                clients.append(redis.Redis(host=host, port=port, db=p.db, retry=retry, **options))
                self._handshake(k, clients[-1])
                self._check_policy(k, clients[-1])
            self._clients, self._clients_pid = clients, os.getpid()
        return self._clients

    def call(self, k: int, fn, *args, **kwargs):
        """``fn(*args)`` against server ``k``, turning a lost or silent connection into an error that names the server."""
        redis = _redis()
        try:
            return fn(*args, **kwargs)
        except redis.exceptions.TimeoutError as e:
            raise self.silent(k, e) from e
        except redis.exceptions.ConnectionError as e:
            raise self.unreachable(k, e) from e

    def get_small(self, k: int, key: str, fix: str) -> bytes | None:
        """The value of ``key`` (metadata) on server ``k``, or ``None``; its size is checked before it is read."""
        c = self.clients()[k]
        where = f"{key} on the Redis server {self.addresses[k]}"
        try:
            size = self.call(k, c.strlen, key)
            trust.check_bound(size, trust.MAX_JSON_BYTES, where, "bytes", "far more than any nbkit metadata", fix)
            raw = self.call(k, c.get, key) if size else None
        except _redis().exceptions.ResponseError as e:  # WRONGTYPE: a list, hash or set under nbkit's key
            raise CorruptCacheError(f"{where} is not nbkit metadata (the server says: {trust.shown(str(e))}). {fix}") from e
        if raw is not None and not isinstance(raw, bytes):  # an array or an integer where a string was asked for
            raise CorruptCacheError(f"{where} is not nbkit metadata: the server answered {type(raw).__name__} "
                                    f"{trust.shown(raw)}, not a string. {fix}")
        return raw

    def unreachable(self, k: int, e: Exception) -> ConnectionError:
        """The error for server ``k`` refusing or dropping the connection."""
        return ConnectionError(
            f"the Redis server {self.addresses[k]} of the cache {self.root} does not answer ({e}). Start it again "
            "(a server that comes back empty is refilled from the source), or check the URL and storage_options.")

    def silent(self, k: int, e: Exception) -> TimeoutError:
        """The error for server ``k`` leaving a connection or a command unanswered past the timeout."""
        host, port = self.parsed.servers[k]
        seconds = getattr(self, "_answer_seconds", ANSWER_SECONDS)
        within = f"within {seconds:g} s" if isinstance(seconds, (int, float)) else "in time"
        return TimeoutError(
            f"the Redis server {self.addresses[k]} of the cache {self.root} did not answer {within} ({e}): it accepts "
            f"connections but sends nothing back (stopped, overloaded, or not a Redis server). Check it with "
            f"`redis-cli -h {host} -p {port} PING` and restart it, or give it longer with "
            "storage_options={'socket_timeout': seconds}."
        )

    def _handshake(self, k: int, client) -> None:
        """Open one connection to server ``k`` and check its RESP3 handshake (``HELLO 3``), so that an old
        server, a wrong password or another service at that address fails here, once, saying so."""
        redis = _redis()
        address = self.addresses[k]
        conn = client.connection_pool.make_connection()
        need = ("nbkit needs Redis >= 6 (or a server that speaks RESP3, such as Valkey): upgrade the server, or check "
                f"that the URL {self.root} names the Redis server you mean")
        try:
            conn.connect()  # TCP (retried), then HELLO 3 [AUTH user password] and its reply
            trust.check_hello(conn.handshake_metadata, address, need + ".")
        except redis.exceptions.TimeoutError as e:
            raise self.silent(k, e) from e
        except redis.exceptions.AuthenticationError as e:
            raise PermissionError(
                f"the Redis server {address} refused the credentials of the URL {self.root} ({e}). Put the right ones "
                "in the URL: redis://[user]:password@host:port/<db>/<name>."
            ) from e
        except redis.exceptions.ResponseError as e:  # an error reply to HELLO
            if "NOAUTH" in str(e) or "AUTH" in str(e).split(" ", 1)[0]:
                raise PermissionError(
                    f"the Redis server {address} needs a password ({e}): put it in the URL, "
                    "redis://[user]:password@host:port/<db>/<name>."
                ) from e
            raise ConnectionError(f"the server at {address} does not speak RESP3 (HELLO failed: {e}): {need}.") from e
        except (redis.exceptions.InvalidResponse, AttributeError, TypeError) as e:
            # Not the Redis protocol (redis-py's handshake calls .get() on the reply: a reply that is no
            # map raises AttributeError or TypeError there).
            raise ConnectionError(
                f"the server at {address} does not speak RESP3: it answered HELLO with something that is not the Redis "
                f"protocol ({type(e).__name__}: {e}). {need}."
            ) from e
        except CorruptCacheError as e:
            raise ConnectionError(str(e)) from e
        except redis.exceptions.ConnectionError as e:
            if "RESP" in str(e):  # "Invalid RESP version": a map without proto 3
                raise ConnectionError(f"the server at {address} does not speak RESP3 (HELLO failed: {e}): {need}.") from e
            raise self.unreachable(k, e) from e
        finally:
            conn.disconnect()

    def tag_prefix(self, meta: dict) -> str:
        """The prefix of the keys of the cache with metadata ``meta``: its samples, bitmap, byte counter, live marker."""
        return f"{self.prefix}{meta_tag(meta)}:"

    # -- the engine's hooks ------------------------------------------------------------------------

    def read_meta(self) -> dict | None:
        clients = self.clients()
        found = {}
        for k, c in enumerate(clients):
            raw = self.get_small(k, self.meta_key, "Pass overwrite=True to rebuild the cache, or use another name.")
            if raw is not None:
                found[k] = raw
        if not found:
            return None
        if len(set(found.values())) > 1:
            raise CorruptCacheError(
                f"the servers of the Redis cache {self.root} hold different metadata for {self.parsed.name!r} "
                f"(servers {sorted(self.addresses[k] for k in found)}): a server list changed, or caches were created "
                "against different server lists. Pass overwrite=True to discard them and rebuild, or use another name."
            )
        return self._parse(next(iter(found.values())))

    def publish_meta(self, meta: dict) -> dict:
        clients = self.clients()
        if meta["length"] > MAX_LENGTH or _HEADER.size + _row_bytes(meta) > MAX_VALUE_BYTES:
            raise ValueError(
                f"a Redis cache holds at most {MAX_LENGTH:,} samples of at most {format_bytes(MAX_VALUE_BYTES)} each (its bitmap "
                f"of stored samples is one Redis string, each sample one value); this source has {meta['length']:,} samples "
                f"of {_row_bytes(meta):,} bytes of fixed-shape fields. Cache it in a local directory or a gs:// bucket instead."
            )
        body = _meta_body(dict(meta, shards=len(clients)))
        self._write(0, clients[0].set, self.meta_key, body, nx=True)
        won = self.get_small(0, self.meta_key, "Pass overwrite=True to rebuild the cache, or use another name.") or body
        # (the first creator wins; take its metadata)
        winner = self._parse(won)
        live = self.tag_prefix(winner) + "live"
        for k, c in enumerate(clients):
            if k:
                self._write(k, c.set, self.meta_key, won, nx=True)
            self._write(k, c.set, live, b"1")
        return winner

    def open_store(self, meta: dict, *, writable: bool) -> "RedisStore":
        return RedisStore(self, meta, writable=writable)

    def remove(self) -> None:
        """Delete every key of this cache name on every server (metadata first)."""
        clients = self.clients()
        for k, c in enumerate(clients):
            self.call(k, c.delete, self.meta_key)
        for k, c in enumerate(clients):
            self.call(k, _unlink_matching, c, self.prefix + "*")  # scan_iter is lazy: iterate inside call()

    def prepare(self, callback=None) -> bool:
        return False  # nothing to pull: every host reads the servers directly

    def publish(self, callback=None) -> bool:
        return False  # samples are visible to every host as soon as they are stored

    def close(self) -> None:
        """Close this process's connections (the next use opens new ones)."""
        clients, pid = self._clients, self._clients_pid
        self._clients = self._clients_pid = None
        if clients is not None and pid == os.getpid():  # a forked child never shuts its parent's sockets
            for c in clients:
                c.close()

    # -- helpers -------------------------------------------------------------------------------------

    def _write(self, k: int, fn, *args, **kwargs):
        try:
            return self.call(k, fn, *args, **kwargs)
        except _redis().exceptions.ResponseError as e:
            if not is_oom(e):
                raise
            raise OSError(
                errno.ENOSPC,
                f"the Redis server {self.addresses[k]} is at its memory limit (maxmemory) and cannot even hold the "
                f"metadata of the cache {self.root}. Raise its maxmemory (CONFIG SET maxmemory …), free memory, or use "
                "another server.",
            ) from e

    def _parse(self, raw: bytes) -> dict:
        where = f"{self.meta_key} on {self.root}"
        fix = "Use another cache name, or pass overwrite=True to rebuild the cache."
        meta = fmt.parse_meta(raw, where, fix)
        self._check_sizes(meta, where, fix)
        shards = meta.get("shards", 1)
        if shards != len(self.parsed.servers):
            raise ValueError(
                f"the Redis cache {self.parsed.name!r} was created sharded over {shards} server(s); the URL {self.url} names "
                f"{len(self.parsed.servers)}. Give the same server list, in the same order, on every host (or pass "
                "overwrite=True to rebuild it over these servers)."
            )
        return meta

    def _check_sizes(self, meta: dict, where: str, fix: str) -> None:
        """Refuse metadata whose length or sample size no Redis cache can have, or this host cannot track,
        before anything is allocated from it (``CorruptCacheError`` naming ``where``)."""
        ram = physical_memory()
        limit, why = MAX_LENGTH, "the bitmap of stored samples of a Redis cache holds 2**32"
        if 0 < ram < MAX_LENGTH * _READER_BYTES:
            limit = ram // _READER_BYTES
            why = f"a reader needs {_READER_BYTES} bytes of memory per sample and this host has {format_bytes(ram)}"
        trust.check_bound(meta["length"], limit, where, "samples", why, fix)
        trust.check_bound(_HEADER.size + _row_bytes(meta), MAX_VALUE_BYTES, where, "bytes per sample (record and rows)",
                          "the largest value a Redis server stores", fix)

    def _check_policy(self, k: int, client) -> None:
        """Refuse a server that would evict samples silently when full (``maxmemory-policy allkeys-*``)."""
        redis = _redis()
        address = self.addresses[k]
        try:
            policy = self.call(k, client.info, "memory").get("maxmemory_policy")
        except redis.exceptions.ResponseError:  # INFO not allowed for this user: try CONFIG GET
            try:
                policy = self.call(k, client.config_get, "maxmemory-policy").get("maxmemory-policy")
            except redis.exceptions.ResponseError:
                policy = None
        if policy is None:
            warnings.warn(
                f"cannot read the maxmemory-policy of the Redis server {address} (INFO and CONFIG are not allowed): make "
                "sure it is noeviction or volatile-*. Under allkeys-* Redis evicts cached samples when full; nbkit then "
                "recomputes them or reports them missing, at the cost of misses.",
                UserWarning,
                stacklevel=4,
            )
            return
        if str(policy).startswith("allkeys-"):
            host, port = self.parsed.servers[k]
            raise ValueError(
                f"the Redis server {address} has maxmemory-policy {policy}: when full it would silently evict cached samples "
                f"(and nbkit's metadata). Use a policy that never evicts keys without a TTL: run "
                f"`redis-cli -h {host} -p {port} CONFIG SET maxmemory-policy noeviction` (or volatile-lru), or start "
                "redis-server with --maxmemory-policy noeviction. nbkit then stops storing when the server is full."
            )


def _row_bytes(meta: dict) -> int:
    """Bytes of one sample's fixed-shape fields (its rows) under the metadata's schema."""
    schema = Schema.from_json(meta["schema"])
    return sum(schema.row_bytes(leaf) for leaf in schema.columns)


def _unlink_matching(client, pattern: str, batch: int = 1000) -> None:
    """Delete the keys matching ``pattern`` on one server, ``batch`` at a time (SCAN, never KEYS)."""
    keys = []
    for key in client.scan_iter(match=pattern, count=batch):
        keys.append(key)
        if len(keys) >= batch:
            client.unlink(*keys)
            keys = []
    if keys:
        client.unlink(*keys)


def _pieces(pos: np.ndarray, values: list):
    """Split positions into runs of at most :data:`PUT_BYTES` of values (one script call each)."""
    start, size = 0, 0
    for j, p in enumerate(pos.tolist()):
        size += len(values[p])
        if size > PUT_BYTES and j > start:
            yield pos[start:j]
            start, size = j, len(values[p])
    if start < len(pos):
        yield pos[start:]


#: What a value of the wrong size reads as: a record whose flags fail ``format.verify`` (a damaged
#: sample, recomputed from the source or reported), with no rows and no blob.
_DAMAGED = _HEADER.pack(fmt.FLAG_DAMAGED, 0)
_FIX = ("Check that the URL names the Redis server you mean; pass overwrite=True (with the source) to rebuild the "
        "cache there.")


def _connection(pool):
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 wants the command name
        return pool.get_connection("MGET")


def is_oom(e: Exception) -> bool:
    """Whether a Redis ``ResponseError`` says the server is at ``maxmemory``."""
    # redis-py >= 4.4 raises OutOfMemoryError (and strips the "OOM" prefix); older ones a plain ResponseError.
    oom = getattr(_redis().exceptions, "OutOfMemoryError", ())
    return isinstance(e, oom) or "OOM" in str(e) or "maxmemory" in str(e)


class RedisStore(Store):
    """The samples of one cache in Redis, for one process (see ``docs/DESIGN.md``, "Store protocol").

    Reads of a batch fetch every sample of it with one ``MGET`` per server and keep the values until
    the next batch, so ``is_stored`` / ``flags_of`` / ``gather`` / ``read_blob`` / ``crc_of`` of that
    batch cost one round trip in all. ``put`` writes one atomic script call per server.

    Attributes:
        not_stored: samples this process could not store because their server was full.

    Example:
        >>> RedisStore.row_crc([b"abc"]) == __import__("zlib").crc32(b"abc")  # the same checksums as a local cache
        True
    """

    def __init__(self, location: RedisLocation, meta: dict, *, writable: bool):
        super().__init__(meta, writable=writable)
        self.location = location
        self._clients = location.clients()
        self._n = len(self._clients)
        base = location.tag_prefix(meta)
        self._sample_prefix = (base + "s:").encode()
        self._live = base + "live"
        self._bits = base + "bits"
        self._bytes = base + "bytes"
        self._meta_body = _meta_body(meta)
        self._cols = []  # (offset in the rows, row bytes, dtype, shape) per column
        offset = 0
        for leaf in self.schema.columns:
            nbytes = self.schema.row_bytes(leaf)
            self._cols.append((offset, nbytes, self.schema.column_dtype(leaf), leaf.shape))
            offset += nbytes
        self._row_bytes = offset
        self._buf: dict[int, bytes | None] = {}  # the values of the last batch read or written
        self._put = [c.register_script(_PUT) for c in self._clients]
        self._drop = [c.register_script(_DROP) for c in self._clients]
        self._full_until = [0.0] * self._n
        self.not_stored = 0
        self._warned = False

    # -- reads -------------------------------------------------------------------------------------------

    def _key(self, i) -> bytes:
        return self._sample_prefix + b"%d" % i

    def _groups(self, idx: np.ndarray):
        """``(server, positions in idx)`` for each server that holds some of ``idx``."""
        if self._n == 1:
            return [(0, np.arange(len(idx)))] if len(idx) else []
        shard = idx % self._n
        return [(k, pos) for k in range(self._n) if len(pos := np.flatnonzero(shard == k))]

    def _fetch(self, idx: np.ndarray) -> None:
        """Read the values of ``idx`` (one MGET per server) into the buffer, replacing it."""
        groups = [(k, idx[pos]) for k, pos in self._groups(idx)]
        requests = [(k, [self._live] + [self._key(i) for i in sub]) for k, sub in groups]
        replies = self._mget_all(requests)
        buf = {}
        for (k, sub), values in zip(groups, replies):
            where = f"the Redis server {self.location.addresses[k]} of the cache {self.location.root}"
            live, values = (values[0], values[1:]) if isinstance(values, list) and values else (None, values)
            sized = trust.check_sample_values(values, len(sub), header=_HEADER.size, row_bytes=self._row_bytes,
                                              freeform=fmt.FLAG_FREEFORM, var=fmt.FLAG_VAR, where=where, fix=_FIX)
            values = [v if ok else _DAMAGED for v, ok in zip(values, sized)]  # sizes checked before any CRC
            if live is None:
                self._lost(k, sub, values)
            buf.update(zip(sub.tolist(), values))
        self._buf = buf

    def _mget_all(self, requests: list) -> list:
        """``MGET`` on several servers at once: send every request, then read every reply."""
        if len(requests) > 1:
            errors = _redis().exceptions
            conns = []
            k = requests[0][0]
            try:
                for k, keys in requests:
                    conn = _connection(self._clients[k].connection_pool)
                    conns.append((k, conn))
                    conn.send_command("MGET", *keys)
                replies = []
                for k, conn in conns:
                    replies.append(conn.read_response())
                return replies
            except BaseException as e:
                for _, conn in conns:
                    conn.disconnect()  # an unread reply must never be taken for the next command's
                if isinstance(e, errors.TimeoutError):
                    raise self.location.silent(k, e) from e  # silent: asking it again would only wait again
                if not isinstance(e, (errors.ConnectionError, OSError)):
                    raise
            finally:
                for k, conn in conns:
                    self._clients[k].connection_pool.release(conn)
        # One server, or a connection failed above: one call per server, with the clients' retries.
        return [self.location.call(k, self._clients[k].mget, keys) for k, keys in requests]

    def _lost(self, k: int, sub: np.ndarray, values: list) -> None:
        """Server ``k`` no longer knows this cache: it restarted empty, was flushed, or the cache was removed."""
        if self.writable:
            self._heal(k)  # the engine recomputes whatever is missing from the source
            return
        gone = [int(i) for i, v in zip(sub, values) if v is None]
        if gone:
            raise MissingSampleError(
                f"the Redis server {self.location.addresses[k]} no longer holds the cache {self.location.root} (it restarted "
                f"without persistence, was flushed, or the cache was removed): samples {format_list(gone)} are gone. Open the cache "
                "with its source (nbkit.CachedDataset(source, url)) to recompute them, or warm it up again."
            )

    def _heal(self, k: int) -> None:
        """Publish the metadata and this cache's marker on server ``k`` again, after it lost them."""
        c = self._clients[k]
        try:
            self.location.call(k, c.set, self.location.meta_key, self._meta_body, nx=True)
            self.location.call(k, c.set, self._live, b"1")
        except _redis().exceptions.ResponseError as e:
            if not is_oom(e):
                raise
            self._full(k, 0)

    def _values(self, idx: np.ndarray) -> list:
        buf = self._buf
        try:
            return [buf[i] for i in idx.tolist()]
        except KeyError:
            self._fetch(idx)
            return [self._buf[i] for i in idx.tolist()]

    def is_stored(self, idx: np.ndarray) -> np.ndarray:
        if len(idx) > _BITMAP_ABOVE:
            self._buf = {}
            return self._stored_bits(idx)
        self._fetch(idx)
        buf = self._buf
        return np.fromiter((buf[i] is not None for i in idx.tolist()), dtype=bool, count=len(idx))

    def flags_of(self, idx: np.ndarray) -> np.ndarray:
        return np.fromiter((v[0] if v else 0 for v in self._values(idx)), dtype=np.uint8, count=len(idx))

    def crc_of(self, idx: np.ndarray) -> np.ndarray:
        return np.fromiter((_HEADER.unpack_from(v)[1] if v else 0 for v in self._values(idx)), dtype=np.uint32, count=len(idx))

    def gather(self, idx: np.ndarray) -> list:
        """The column rows of samples ``idx`` (zeros for a free-form or absent sample, whose CRC then decides)."""
        if not self._cols:
            return []
        values = self._values(idx)
        n, width = len(values), _HEADER.size + self._row_bytes
        if all(v is not None and len(v) == width for v in values):
            table = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, width)  # one copy, then per column
            start = _HEADER.size
        else:
            blank = bytes(self._row_bytes)
            # A damaged value (marked by _fetch) has no rows: zeros, whose CRC then fails.
            rows = [v[_HEADER.size:width] if v and len(v) >= width and not v[0] & (fmt.FLAG_FREEFORM | fmt.FLAG_DAMAGED)
                    else blank for v in values]
            table = np.frombuffer(b"".join(rows), dtype=np.uint8).reshape(n, self._row_bytes)
            start = 0
        out = []
        for offset, nbytes, dtype, shape in self._cols:
            part = table[:, start + offset:start + offset + nbytes].copy()  # aligned, writable, C order
            out.append(part.view(dtype).reshape(n, *shape))
        return out

    def read_blob(self, i: int) -> bytes:
        v = self._values(np.array([i]))[0]
        if v is None:
            raise CorruptCacheError(f"sample {i} of the Redis cache {self.location.root} vanished while it was read; read it again.")
        if v[0] & fmt.FLAG_DAMAGED:
            raise CorruptCacheError(f"sample {i} of the Redis cache {self.location.root} is damaged: its value is not of "
                                    "a size its record fields allow.")
        if v[0] & fmt.FLAG_FREEFORM:
            return v[_HEADER.size:]
        return v[_HEADER.size + self._row_bytes:]

    # -- the bitmap of stored samples -------------------------------------------------------------------

    def _stored_bits(self, idx: np.ndarray) -> np.ndarray:
        out = np.zeros(len(idx), dtype=bool)
        for k, pos in self._groups(idx):
            sub = idx[pos]
            lo, hi = int(sub.min()) >> 3, int(sub.max()) >> 3
            c = self._clients[k]
            raw = self.location.call(k, c.getrange, self._bits, lo, hi)[: hi - lo + 1]
            bits = np.zeros(hi - lo + 1, np.uint8)
            bits[: len(raw)] = np.frombuffer(raw, np.uint8)
            out[pos] = (bits[(sub >> 3) - lo] >> (7 - (sub & 7)).astype(np.uint8)) & 1 == 1  # bit 0 is the high bit
        return out

    def stored_mask(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` are stored, from the bitmap (one read per server, no sample values)."""
        self._buf = {}
        return self._stored_bits(idx)

    def stored_count(self) -> int:
        return sum(int(self.location.call(k, c.bitcount, self._bits)) for k, c in enumerate(self._clients))

    def data_bytes(self) -> int:
        return sum(int(self.location.call(k, c.get, self._bytes) or 0) for k, c in enumerate(self._clients))

    def stored_bytes(self) -> int:
        """Bytes of sample values held by the servers (Redis adds a small per-key overhead on top)."""
        return self.data_bytes()

    # -- writes -------------------------------------------------------------------------------------------

    def put(self, idx: np.ndarray, flags: np.ndarray, crc: np.ndarray, cpos: np.ndarray, stacked: list,
            bpos: np.ndarray, blobs: list) -> np.ndarray:
        """Store samples ``idx`` (each one value: record fields, rows, blob); a sample is visible only once whole.

        Returns which samples were kept (a full server refuses some)."""
        kept = np.ones(len(idx), dtype=bool)
        ids = idx.tolist()
        pieces = [[_HEADER.pack(f, c)] for f, c in zip(flags.tolist(), crc.tolist())]
        if len(cpos) and stacked:
            m = len(cpos)
            parts = [np.ascontiguousarray(s).reshape(m, -1).view(np.uint8) for s in stacked]
            rows = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=1)
            for r, j in zip(rows, cpos.tolist()):
                pieces[j].append(r)
        for j, blob in zip(bpos.tolist(), blobs):
            pieces[j].append(blob)
        values = [b"".join(p) for p in pieces]  # one copy per sample
        replaced = {i for i in ids if self._buf.get(i) is not None}
        self._buf.update(zip(ids, values))  # served from here even if a full server refuses them
        for k, pos in self._groups(idx):
            for part in _pieces(pos, values):
                sub = idx[part].tolist()
                if time.monotonic() < self._full_until[k]:
                    self._refused(k, sub, replaced)
                    kept[part] = False
                    continue
                keys = [self._live, self._bits, self._bytes] + [self._key(i) for i in sub]
                args = [x for i, j in zip(sub, part.tolist()) for x in (i, values[j])]
                try:
                    if self.location.call(k, self._put[k], keys=keys, args=args) == -1:
                        self._heal(k)  # the server lost this cache since we last looked: mark it again, then store
                        self.location.call(k, self._put[k], keys=keys, args=args)
                except _redis().exceptions.ResponseError as e:
                    if not is_oom(e):
                        raise
                    self._full(k, len(sub))
                    self._refused(k, sub, replaced)
                    kept[part] = False
        return kept

    def _refused(self, k: int, sub: list, replaced: set) -> None:
        """Samples server ``k`` could not store: count them, and drop older values they were meant to replace."""
        self.not_stored += len(sub)
        old = [i for i in sub if i in replaced]
        if old:
            # A sample rewritten after failing its checksum must not stay readable in its damaged form.
            self.location.call(k, self._drop[k], keys=[self._bits, self._bytes] + [self._key(i) for i in old], args=old)

    def _full(self, k: int, refused: int) -> None:
        """Server ``k`` hit maxmemory refusing ``refused`` samples: skip it for a while, and warn once."""
        self._full_until[k] = time.monotonic() + FULL_RETRY_SECONDS
        if self._warned:
            return
        self._warned = True
        c = self._clients[k]
        try:
            info = self.location.call(k, c.info, "memory")
        except _redis().exceptions.ResponseError:  # INFO not allowed for this user
            info = {}
        stored_here = int(self.location.call(k, c.bitcount, self._bits))
        warnings.warn(
            f"the Redis server {self.location.addresses[k]} is full (maxmemory {format_bytes(int(info.get('maxmemory', 0)))}, "
            f"used {format_bytes(int(info.get('used_memory', 0)))}) after storing {stored_here} samples of the cache "
            f"{self.location.root} there; {refused} samples were not stored. nbkit stops storing on that server: its other "
            "samples are computed from the source on every read (correct, but misses). Raise its maxmemory "
            "(CONFIG SET maxmemory …), add servers to the URL, or free memory.",
            UserWarning,
            stacklevel=3,
        )

    def close(self) -> None:
        self._buf = {}
