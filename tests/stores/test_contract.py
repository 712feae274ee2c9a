"""One store contract, every backend: what ``CachedDataset`` may rely on from any store
(:class:`nbkit.stores.base.Store` and :class:`~nbkit.stores.base.Location`), in the style of
fsspec's abstract test suites.

Each backend is a small adapter (:class:`Backend`) that knows how to make a cache of a source at a
fresh location and how to open it again without the source, on this host or on another one. The
tests in :class:`StoreContract` are written once against that adapter and run for a local
directory, ``memory://`` and the GCS emulator through the mirror (working copy), Redis, a bucket
read through a bounded local area, and :class:`DictStore`: a whole backend written here in a few
lines (one ``Store`` subclass, one ``Location`` subclass, one entry in ``BACKENDS``), which is all a
new backend takes.
"""

from __future__ import annotations

import uuid

import fsspec.callbacks
import numpy as np
import pytest
from fixtures_gcs import gcs, gcs_server
from fixtures_redis import redis_server, redis_url
from sources import TupleSource, VarShapeSource, assert_equal

import nbkit
from nbkit import format as fmt
from nbkit.cachedir import CacheFiles
from nbkit.stores import registry
from nbkit.stores.base import Location, Store
from nbkit.stores.readthrough import ReadThroughStore
from nbkit.stores.redis import RedisStore


class Backend:
    """How to reach one kind of store. Subclasses set :meth:`location`; the rest is shared."""

    name = "?"
    writable = True  # the engine stores computed samples here (read-through: no)

    def __init__(self, tmp_path, monkeypatch, request):
        self.tmp_path, self.monkeypatch, self.request = tmp_path, monkeypatch, request
        self.host = 0
        self.on_host(0)

    def on_host(self, k: int) -> None:
        """Act as host ``k``: its own working copies and local areas."""
        self.host = k
        self.monkeypatch.setenv("NBKIT_CACHE_DIR", str(self.tmp_path / f"host-{k}"))

    def location(self) -> tuple:
        """A fresh ``(path or URL, options for CachedDataset)``."""
        raise NotImplementedError

    def create(self, source, *, only=None):
        """A cache of ``source`` (every sample, or the indices ``only``) here; returns ``(dataset, url, options)``."""
        url, options = self.location()
        ds = nbkit.CachedDataset(source, url, **options)
        if only is None:
            ds.warmup()
        else:
            ds[list(only)]
            ds.sync()
        return ds, url, options

    def open(self, url, options):
        """The cache at ``url`` without its source, from this host."""
        return nbkit.CachedDataset.open(url, **options)


class Local(Backend):
    name = "local"

    def location(self):
        return str(self.tmp_path / f"cache-{uuid.uuid4().hex[:6]}"), {}


class Memory(Backend):
    name = "memory"

    def location(self):
        return f"memory://contract-{uuid.uuid4().hex[:10]}/cache", {}


class GCS(Backend):
    name = "gcs"

    def location(self):
        bucket = self.request.getfixturevalue("gcs")
        return f"{bucket.url}/cache", {"storage_options": bucket.storage_options}


class Redis(Backend):
    name = "redis"

    def location(self):
        return self.request.getfixturevalue("redis_url"), {}


class ReadThrough(Backend):
    """A cache warmed locally, pushed to ``memory://``, read through a small local area."""

    name = "readthrough"
    writable = False

    def location(self):
        return f"memory://contract-rt-{uuid.uuid4().hex[:10]}/cache", {"local_max_bytes": 256 << 10}

    def create(self, source, *, only=None):
        url, options = self.location()
        local = nbkit.CachedDataset(source, self.tmp_path / f"local-{uuid.uuid4().hex[:6]}")
        if only is None:
            local.warmup()
        else:
            local[list(only)]
        nbkit.push(local.root, url)
        return nbkit.CachedDataset(source, url, **options), url, options


#: The "servers" of :class:`DictLocation`: URL -> that cache's metadata and samples, in this process.
DICT_SERVERS: dict = {}


class DictStore(Store):
    """A minimal backend's store: each sample one ``(flags, crc, column rows as bytes, blob)`` entry in a dict."""

    def __init__(self, server: dict, meta: dict, *, writable: bool):
        super().__init__(meta, writable=writable)
        self.samples = server.setdefault("samples", {})

    def is_stored(self, idx):
        return np.array([int(i) in self.samples for i in idx], dtype=bool)

    def flags_of(self, idx):
        return np.array([self.samples[int(i)][0] for i in idx], dtype=np.uint8)

    def crc_of(self, idx):
        return np.array([self.samples[int(i)][1] for i in idx], dtype=np.uint32)

    def gather(self, idx):
        out = []
        for k, leaf in enumerate(self.schema.columns):
            dtype = self.schema.column_dtype(leaf)
            zero = bytes(self.schema.row_bytes(leaf))  # a free-form sample has no rows (as in a local cache's zeros)
            raw = b"".join(self.samples[int(i)][2][k] if self.samples[int(i)][2] else zero for i in idx)
            out.append(np.frombuffer(raw, dtype=dtype).reshape(len(idx), *leaf.shape).copy())
        return out

    def read_blob(self, i):
        return self.samples[int(i)][3]

    def put(self, idx, flags, crc, cpos, stacked, bpos, blobs):
        rows = {int(p): [np.ascontiguousarray(c[m]).tobytes() for c in stacked] for m, p in enumerate(cpos)}
        blob_of = dict(zip(bpos.tolist(), blobs))
        for j, i in enumerate(idx.tolist()):
            self.samples[i] = (int(flags[j]), int(crc[j]), rows.get(j), blob_of.get(j, b""))

    def stored_count(self):
        return len(self.samples)

    def data_bytes(self):
        return sum(sum(map(len, rows or [])) + len(blob) for _, _, rows, blob in self.samples.values())

    stored_bytes = data_bytes


class DictLocation(Location):
    """A minimal backend's location: ``dict-store://<name>`` in :data:`DICT_SERVERS`."""

    def __init__(self, url, storage_options=None):
        super().__init__(url=url, root=url, is_remote=True, storage_options=dict(storage_options or {}))

    def read_meta(self):
        return DICT_SERVERS.get(self.root, {}).get("meta")

    def publish_meta(self, meta):
        return DICT_SERVERS.setdefault(self.root, {}).setdefault("meta", meta)  # the first creator wins

    def open_store(self, meta, *, writable):
        return DictStore(DICT_SERVERS[self.root], meta, writable=writable)

    def remove(self):
        DICT_SERVERS.pop(self.root, None)


def resolve_dict(url, storage_options=None, **location_options):
    return DictLocation(url, storage_options)


class Dict(Backend):
    """The backend above, registered for ``dict-store://`` for the length of one test."""

    name = "dict"

    def __init__(self, tmp_path, monkeypatch, request):
        super().__init__(tmp_path, monkeypatch, request)
        monkeypatch.setitem(registry.SCHEMES, "dict-store", registry.Backend(f"{__name__}:resolve_dict"))

    def location(self):
        return f"dict-store://contract-{uuid.uuid4().hex[:10]}/cache", {}


BACKENDS = [Local, Memory, GCS, Redis, ReadThrough, Dict]


@pytest.fixture(params=BACKENDS, ids=[b.name for b in BACKENDS])
def backend(request, tmp_path, monkeypatch):
    return request.param(tmp_path, monkeypatch, request)


class StoreContract:
    """The tests every backend passes."""

    n = 300

    def test_round_trip_without_the_source(self, backend):
        src = TupleSource(self.n)
        _, url, options = backend.create(src)
        ds = backend.open(url, options)
        assert len(ds) == self.n and ds.source is None
        for i in (0, 7, self.n - 1):
            assert_equal(ds[i], src[i], f"sample {i}")
        batch = nbkit.collate(ds.__getitems__([5, 3, 5, 250]))
        assert_equal(list(batch), list(nbkit.collate([src[5], src[3], src[5], src[250]])))

    def test_store_protocol(self, backend):
        src = TupleSource(self.n)
        _, url, options = backend.create(src)
        store = backend.open(url, options).store
        idx = np.arange(self.n, dtype=np.int64)
        assert (store.length, store.capacity, store.n_columns) == (self.n, self.n, 2)
        assert store.admitted(idx).all() and store.is_stored(idx).all()
        assert len(store.missing()) == 0 and store.stored_count() == self.n
        assert store.flags_of(idx[:10]).dtype == np.uint8 and store.crc_of(idx[:10]).dtype == np.uint32
        rows = store.gather(idx[:10])
        assert [len(r) for r in rows] == [10, 10]
        assert fmt.verify(store, idx).all()
        assert store.data_bytes() > 0 and store.stored_bytes() > 0

    def test_close_then_open_again(self, backend):
        src = TupleSource(self.n)
        _, url, options = backend.create(src)
        ds = backend.open(url, options)
        assert_equal(ds[3], src[3])
        ds.close()
        ds.close()  # twice: nothing more
        with pytest.raises(ValueError, match=r"was closed .*CachedDataset\.open\("):
            ds[3]
        with backend.open(url, options) as again:  # what it held is released: a new handle works alike
            assert_equal(again[4], src[4])
        assert again.closed

    def test_missing_samples(self, backend):
        src = TupleSource(self.n)
        ds, url, options = backend.create(src, only=range(0, self.n, 3))
        expected = np.setdiff1d(np.arange(self.n), np.arange(0, self.n, 3))
        assert np.array_equal(ds.missing(), expected if backend.writable else np.zeros(0, np.int64))
        assert np.array_equal(ds.store.missing(expected[:5]), expected[:5] if backend.writable else [])
        assert ds.stats.cached == len(range(0, self.n, 3))
        assert_equal(ds[1], src[1])  # computed from the source (and stored, where the store can)
        if backend.writable:
            assert ds.store.is_stored(np.array([1]))[0]

    def test_variable_shapes_and_blobs(self, backend):
        src = VarShapeSource(40)
        _, url, options = backend.create(src)
        ds = backend.open(url, options)
        for i in range(len(src)):
            assert_equal(ds[i], src[i], f"sample {i}")
        assert ds.verify() == len(src)

    def test_verify_with_a_plain_fsspec_callback(self, backend):
        src = TupleSource(self.n)
        ds, _, _ = backend.create(src)
        cb = fsspec.callbacks.Callback()
        assert ds.verify(callback=cb) == self.n
        assert (cb.size, cb.value) == (self.n, self.n)

    def test_stats_after_an_epoch(self, backend):
        src = TupleSource(self.n)
        _, url, options = backend.create(src)
        ds = backend.open(url, options)
        loader = nbkit.collate(ds.__getitems__(list(range(self.n))))
        assert len(loader[0]) == self.n
        s = ds.stats
        assert (s.hits, s.misses, s.cached, s.total, s.complete) == (self.n, 0, self.n, self.n, True)

    def test_another_host_sees_the_cache(self, backend):
        src = TupleSource(self.n)
        _, url, options = backend.create(src)
        backend.on_host(1)
        ds = backend.open(url, options)
        assert ds.stats.cached == self.n
        assert_equal(ds[42], src[42])


class TestStores(StoreContract):
    """The contract, once for each backend."""


# -- the contract itself: every member declared in one base class ------------------------------------

REQUIRED = ("is_stored", "flags_of", "crc_of", "gather", "read_blob", "put", "stored_count", "data_bytes", "stored_bytes")
OPTIONAL = ("admitted", "stored_mask", "missing", "gather_checked", "will_need", "prefetch", "sync", "close", "memory_mapped",
            "row_crc", "n_columns", "slot_of")


@pytest.mark.parametrize("cls", [CacheFiles, RedisStore, ReadThroughStore, DictStore], ids=lambda c: c.__name__)
def test_every_store_defines_the_required_members(cls):
    assert all(hasattr(Store, m) for m in REQUIRED + OPTIONAL)
    assert [m for m in REQUIRED if getattr(cls, m) is getattr(Store, m)] == []


def test_a_store_missing_a_required_member_says_which_and_where():
    class Half(DictStore):
        gather = Store.gather

    store = Half({}, {"length": 3, "schema": None}, writable=True)
    with pytest.raises(NotImplementedError, match=r"^Half does not implement Store\.gather\(\), which every store must define"):
        store.gather(np.arange(2))
    # The optional members have the defaults the engine relies on.
    assert (store.memory_mapped, store.prefetch(np.arange(3)), store.will_need(np.arange(3)), store.sync()) == (False, 0, None, None)


def test_an_engine_on_a_store_without_put_names_the_member(tmp_path, monkeypatch):
    class NoPut(DictStore):
        put = Store.put

    monkeypatch.setattr(DictLocation, "open_store", lambda self, meta, *, writable: NoPut(DICT_SERVERS[self.root], meta,
                                                                                           writable=writable))
    Dict(tmp_path, monkeypatch, None)
    ds = nbkit.CachedDataset(TupleSource(4), f"dict-store://noput-{uuid.uuid4().hex[:6]}/cache")
    with pytest.raises(NotImplementedError, match=r"NoPut does not implement Store\.put\(\)"):
        ds[0]


def test_a_location_missing_a_required_member_says_which():
    class Bare(Location):
        pass

    with pytest.raises(NotImplementedError, match=r"^Bare does not implement Location\.open_store\(\), which every location"):
        Bare(url="x://y", root="x://y").open_store({}, writable=False)
