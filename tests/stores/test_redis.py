"""The Redis store (nbkit.stores.redis): samples in real redis-server processes on 127.0.0.1."""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from torch.utils.data import DataLoader

import nbkit
from fixtures_redis import (fake_server, namespace, redis_factory, redis_server, redis_trio, redis_url,
                            sharded_url)
from sources import (CountingSource, DictSource, IrregularSource, TupleSource, VarShapeSource, assert_equal,
                     computed_counts)


def check_all(ds, src):
    """Every sample equal to the source, one at a time and in batches."""
    n = len(src)
    for i in range(n):
        assert_equal(ds[i], src[i], f"sample {i}")
    for start in range(0, n, 37):
        idx = list(range(start, min(n, start + 37)))
        batch = ds.__getitems__(idx)
        for j, i in enumerate(idx):
            assert_equal(batch[j], src[i], f"batch sample {i}")


@pytest.mark.parametrize("make", [TupleSource, DictSource, VarShapeSource, IrregularSource])
def test_round_trip_equals_source(redis_url, make):
    src = make()
    ds = nbkit.CachedDataset(src, redis_url)
    assert ds.warmup().computed == len(src)
    check_all(ds, src)
    assert ds.verify() == len(src)
    s = ds.stats
    assert s.cached == s.total == len(src) and s.complete and s.bytes > 0
    # Another process's view: a fresh dataset, the same server, no recomputation.
    again = nbkit.CachedDataset(make(), redis_url)
    assert again.warmup().computed == 0
    check_all(again, src)


def test_batches_are_one_mget_per_server(redis_url):
    src = TupleSource(300)
    ds = nbkit.CachedDataset(src, redis_url)
    ds.warmup()
    store = ds.store
    calls = []
    client = store.location.clients()[0]
    original = client.mget
    client.mget = lambda *a, **k: calls.append(len(a[0])) or original(*a, **k)
    try:
        x, y = nbkit.collate(ds.__getitems__(list(range(0, 300, 3))))
    finally:
        client.mget = original
    assert calls == [101]  # the live marker and 100 samples, in one round trip
    assert torch.equal(x, torch.stack([src[i][0] for i in range(0, 300, 3)]))
    assert y.tolist() == [i % 10 for i in range(0, 300, 3)]


def test_large_writes_are_split(redis_url, monkeypatch):
    from nbkit.stores import redis as redis_store

    monkeypatch.setattr(redis_store, "PUT_BYTES", 1)  # every sample is over it: one sample a call
    src = DictSource(40)
    ds = nbkit.CachedDataset(src, redis_url)
    calls = []
    store = ds.store
    script = store._put[0]
    store._put[0] = lambda **kw: calls.append(len(kw["keys"]) - 3) or script(**kw)
    ds.warmup()
    assert calls == [1] * 40
    check_all(nbkit.CachedDataset.open(redis_url), src)


def test_open_without_source(redis_url):
    src = TupleSource(50)
    ds = nbkit.CachedDataset(src, redis_url)
    ds.__getitems__(list(range(20)))  # only the first 20 are stored
    opened = nbkit.CachedDataset.open(redis_url)
    assert opened.source is None and len(opened) == 50
    check_all(opened, TupleSource(20))
    with pytest.raises(nbkit.MissingSampleError, match="holds 20 of 50"):
        opened[30]
    with pytest.raises(FileNotFoundError):
        nbkit.CachedDataset.open(redis_url.rsplit("/", 1)[0] + "/" + namespace())


def test_dataloader_workers_and_stats(redis_url):
    src = TupleSource(600)
    ds = nbkit.CachedDataset(src, redis_url)
    report = ds.warmup(num_workers=2, chunk_size=50)
    assert report.computed == 600 and ds.stats.cached == 600
    ds.reset_stats()
    seen = []
    order = torch.randperm(600, generator=torch.Generator().manual_seed(0)).tolist()  # a shuffled epoch
    for x, y in DataLoader(ds, batch_size=64, sampler=order, num_workers=2, collate_fn=nbkit.collate):
        seen.append((x, y))
    xs, ys = torch.cat([x for x, _ in seen]), torch.cat([y for _, y in seen])
    assert torch.equal(xs, torch.stack([src[i][0] for i in order]))
    assert ys.tolist() == [i % 10 for i in order]
    s = ds.stats
    assert (s.hits, s.misses, s.cached) == (600, 0, 600)  # counted in the workers, seen here
    assert s.bytes == 600 * (5 + 8 * 8 * 4 + 8)


def test_misses_in_dataloader_workers_are_stored_once(redis_url, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    ds = nbkit.CachedDataset(CountingSource(256, str(logs)), redis_url)
    probes = computed_counts(logs)  # the fingerprint's
    for _ in DataLoader(ds, batch_size=32, num_workers=2, collate_fn=nbkit.collate):
        pass
    for _ in DataLoader(ds, batch_size=32, num_workers=2, collate_fn=nbkit.collate):
        pass
    counts = computed_counts(logs)
    assert all(counts[i] - probes.get(i, 0) == 1 for i in range(256))  # each computed once, in two epochs
    assert ds.stats.hits == 256 and ds.stats.misses == 256


def test_sharded_across_three_servers(redis_trio, tmp_path):
    name = namespace()
    url = sharded_url(redis_trio, name)
    src = TupleSource(300)
    ds = nbkit.CachedDataset(src, url)
    ds.warmup()
    per_server = [len(s.keys(f"nbkit:{name}:*:s:*")) for s in redis_trio]
    assert per_server == [100, 100, 100]  # sample i on server i % 3
    for s in redis_trio:
        assert s.client().exists(f"nbkit:{name}:meta")  # metadata everywhere
    check_all(nbkit.CachedDataset.open(url), src)
    assert ds.stats.cached == 300
    # The same servers in a list of another length are refused, not silently read from the wrong shards.
    two = sharded_url(redis_trio[:2], name)
    with pytest.raises(ValueError, match="sharded over 3 server"):
        nbkit.CachedDataset.open(two)


def test_two_caches_side_by_side_in_one_server(redis_server):
    a_url, b_url = redis_server.url("team/a"), redis_server.url("team/a-b")
    a_src, b_src = TupleSource(80), DictSource(40)
    a = nbkit.CachedDataset(a_src, a_url, overwrite=True)
    b = nbkit.CachedDataset(b_src, b_url, overwrite=True)
    a.warmup()
    b.warmup()
    check_all(nbkit.CachedDataset.open(a_url), a_src)
    check_all(nbkit.CachedDataset.open(b_url), b_src)
    # Rebuilding one leaves the other whole.
    nbkit.CachedDataset(TupleSource(10), a_url, overwrite=True)
    assert nbkit.CachedDataset.open(a_url).stats.cached == 0
    check_all(nbkit.CachedDataset.open(b_url), b_src)
    assert nbkit.CachedDataset.open(b_url).stats.cached == 40


def test_stale_fingerprint_and_overwrite(redis_url, redis_server):
    nbkit.CachedDataset(TupleSource(100), redis_url).warmup()
    with pytest.raises(nbkit.StaleCacheError, match="overwrite=True"):
        nbkit.CachedDataset(TupleSource(100, shape=(1, 4, 4)), redis_url)
    with pytest.raises(nbkit.StaleCacheError, match="length"):
        nbkit.CachedDataset(TupleSource(120), redis_url)
    name = redis_url.rsplit("/", 1)[1]
    assert len(redis_server.keys(f"nbkit:{name}:*")) > 100
    fresh = nbkit.CachedDataset(TupleSource(100, shape=(1, 4, 4)), redis_url, overwrite=True)
    assert fresh.stats.cached == 0
    assert len(redis_server.keys(f"nbkit:{name}:*:s:*")) == 0  # the old samples are gone, not orphaned
    fresh.warmup()
    check_all(nbkit.CachedDataset.open(redis_url), TupleSource(100, shape=(1, 4, 4)))


def test_damaged_value_recomputed_with_source_refused_without(redis_url, redis_server):
    src = TupleSource(20)
    nbkit.CachedDataset(src, redis_url).warmup()
    c = redis_server.client()
    (key,) = redis_server.keys(f"nbkit:{redis_url.rsplit('/', 1)[1]}:*:s:7")
    value = bytearray(c.get(key))
    value[40] ^= 0xFF
    c.set(key, bytes(value))
    with pytest.raises(nbkit.CorruptCacheError, match="1 sample"):
        nbkit.CachedDataset.open(redis_url).verify()
    with pytest.raises(nbkit.CorruptCacheError, match="sample 7"):
        nbkit.CachedDataset.open(redis_url)[7]
    ds = nbkit.CachedDataset(src, redis_url)
    assert_equal(ds[7], src[7])
    assert ds.stats.recomputed == 1
    assert nbkit.CachedDataset.open(redis_url).verify() == 20


def test_full_server_stops_storing_and_serves_from_source(redis_factory):
    server = redis_factory("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    src = TupleSource(1500, shape=(1, 32, 32))  # 4 KiB a sample: about 6 MB in all
    ds = nbkit.CachedDataset(src, server.url())
    with pytest.warns(UserWarning, match=r"is full \(maxmemory 3.1 MB.*not stored") as caught:
        report = ds.warmup(chunk_size=100)
    assert len([w for w in caught if "is full" in str(w.message)]) == 1  # said once
    stored = ds.stats.cached
    assert 100 <= stored < 1500 and report.computed == 1500
    assert ds.store.not_stored == 1500 - stored
    assert int(server.client().info("memory")["used_memory"]) <= 4 * 2**20
    ds.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for start in range(0, 1500, 128):
            idx = list(range(start, min(1500, start + 128)))
            x, y = nbkit.collate(ds.__getitems__(idx))
            assert torch.equal(x, torch.stack([src[i][0] for i in idx]))
    s = ds.stats
    assert s.hits == stored and s.misses == 1500 - stored  # the rest came from the source
    # A reader without the source gets what is stored, and a clear error for the rest.
    opened = nbkit.CachedDataset.open(server.url(ds.path.rsplit("/", 1)[1]))
    missing = opened.missing()
    assert len(missing) == 1500 - stored
    with pytest.raises(nbkit.MissingSampleError):
        opened[int(missing[0])]


def test_damaged_value_on_a_full_server_is_dropped_not_served(redis_factory):
    server = redis_factory("--maxmemory-policy", "noeviction")
    src = TupleSource(100, shape=(1, 32, 32))
    url = server.url()
    nbkit.CachedDataset(src, url).warmup()
    c = server.client()
    (key,) = server.keys(f"nbkit:{url.rsplit('/', 1)[1]}:*:s:7")
    value = bytearray(c.get(key))
    value[100] ^= 0xFF
    c.set(key, bytes(value))
    c.config_set("maxmemory", "1mb")  # below what it holds: every write is refused from now on
    ds = nbkit.CachedDataset(src, url)
    with pytest.warns(UserWarning, match="is full"):
        assert_equal(ds[7], src[7])  # recomputed; the replacement is refused, so the damaged value is deleted
    assert ds.stats.recomputed == 1 and not c.exists(key) and ds.stats.cached == 99
    assert_equal(ds[7], src[7])
    with pytest.raises(nbkit.MissingSampleError):
        nbkit.CachedDataset.open(url)[7]


def test_evicting_policy_is_refused(redis_factory):
    server = redis_factory("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru")
    with pytest.raises(ValueError, match=r"allkeys-lru.*CONFIG SET maxmemory-policy noeviction"):
        nbkit.CachedDataset(TupleSource(10), server.url())
    server.client().config_set("maxmemory-policy", "volatile-lru")  # never evicts keys without a TTL
    ds = nbkit.CachedDataset(TupleSource(10), server.url())
    assert ds.warmup().computed == 10


def test_policy_unreadable_is_a_warning_not_a_refusal(redis_factory):
    server = redis_factory()
    server.client().acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["*"],
                                commands=["+@all", "-info", "-config"])
    url = f"redis://reader:pw@{server.address}/0/{namespace()}"
    with pytest.warns(UserWarning, match="cannot read the maxmemory-policy"):
        ds = nbkit.CachedDataset(TupleSource(10), url)
    assert ds.warmup().computed == 10


def test_dataset_pickles_without_connections(redis_url):
    import pickle

    src = TupleSource(30)
    ds = nbkit.CachedDataset(src, redis_url)
    ds.warmup()
    assert ds._location._clients is not None
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._location._clients is None  # each process opens its own
    check_all(copy, src)
    assert copy._location._clients[0] is not ds._location._clients[0]


def test_server_restarted_mid_epoch_recomputes_with_source(redis_factory, tmp_path):
    server = redis_factory()
    logs = tmp_path / "logs"
    logs.mkdir()
    n = 512
    src = TupleSource(n)
    ds = nbkit.CachedDataset(CountingSource(n, str(logs)), server.url())
    ds.warmup()
    ds.reset_stats()
    before = sum(computed_counts(logs).values())
    order = torch.randperm(n, generator=torch.Generator().manual_seed(1)).tolist()
    for b, start in enumerate(range(0, n, 64)):
        if b == 4:
            server.restart()  # mid-epoch: every stored sample is gone
        idx = order[start:start + 64]
        x, y = nbkit.collate(ds.__getitems__(idx))
        assert torch.equal(x, torch.stack([src[i][0] for i in idx])) and y.tolist() == [i % 10 for i in idx]
    s = ds.stats
    assert s.hits == 256 and s.misses == 256 and s.cached == 256  # the second half recomputed and stored again
    assert sum(computed_counts(logs).values()) - before == 256  # exactly the lost samples that were asked for
    # The metadata came back too: another host can open the cache, without its source, and read what is stored.
    opened = nbkit.CachedDataset.open(ds.path)
    for i in order[256:]:
        assert_equal(opened[i], src[i])


def test_one_shard_restarted_mid_epoch(redis_factory):
    servers = [redis_factory() for _ in range(3)]
    url = sharded_url(servers)
    n = 600
    src = TupleSource(n)
    ds = nbkit.CachedDataset(src, url)
    ds.warmup()
    ds.reset_stats()
    order = torch.randperm(n, generator=torch.Generator().manual_seed(2)).tolist()
    for b, start in enumerate(range(0, n, 100)):
        if b == 3:
            servers[1].restart()  # its connections break under the batched reads of the others
        idx = order[start:start + 100]
        x, _ = nbkit.collate(ds.__getitems__(idx))
        assert torch.equal(x, torch.stack([src[i][0] for i in idx]))
    lost = sum(1 for i in order[300:] if i % 3 == 1)
    assert ds.stats.misses == lost and ds.stats.hits == n - lost
    assert len(nbkit.CachedDataset.open(url).missing()) == 200 - lost
    servers[2].kill()  # down for good: an error naming it, never a partial batch
    with pytest.raises(ConnectionError, match=f"{servers[2].address} .*does not answer"):
        ds.__getitems__(list(range(30)))
    x, _ = nbkit.collate(ds.__getitems__([0, 1, 3, 4]))  # the other shards still serve
    assert torch.equal(x, torch.stack([src[i][0] for i in (0, 1, 3, 4)]))


def test_server_restarted_without_source_is_a_clear_error(redis_factory):
    server = redis_factory()
    src = TupleSource(64)
    url = server.url()
    nbkit.CachedDataset(src, url).warmup()
    reader = nbkit.CachedDataset.open(url)
    assert_equal(reader[3], src[3])
    server.restart()
    with pytest.raises(nbkit.MissingSampleError, match=r"no longer holds the cache .*restarted"):
        reader.__getitems__([1, 2, 3])
    server.kill()
    with pytest.raises(ConnectionError, match=rf"{server.address}.*does not answer"):
        reader[5]


def test_server_restarted_during_parallel_warmup(redis_factory):
    server = redis_factory()
    src = TupleSource(400)
    ds = nbkit.CachedDataset(src, server.url())
    ds.warmup(chunk_size=50, num_workers=0)
    server.restart()
    report = ds.warmup(num_workers=2, chunk_size=50)
    assert report.computed == 400
    check_all(nbkit.CachedDataset.open(ds.path), src)


def test_byte_budget_in_redis(redis_url):
    n = 400
    src = TupleSource(n)
    ds = nbkit.CachedDataset(src, redis_url, max_bytes=n * 24 + n * (8 * 8 * 4 + 8) // 4)
    ds.warmup()
    assert ds.stats.cached == ds.stats.capacity == 100
    ds.reset_stats()
    for x, y in DataLoader(ds, batch_size=50, shuffle=True, collate_fn=nbkit.collate):
        pass
    assert ds.stats.hit_rate == 0.25
    check_all(ds, src)


def test_urls_and_options():
    from nbkit.stores.redis import parse_url, resolve as resolve_redis

    u = parse_url("rediss://user:p%40ss@h1,h2:7000,[::1]:7001/5/a/b.c")
    assert u.servers == [("h1", 6379), ("h2", 7000), ("::1", 7001)] and u.db == 5 and u.name == "a/b.c"
    assert (u.username, u.password, u.ssl) == ("user", "p@ss", True)
    assert parse_url("redis://h/mnist").db == 0
    for bad in ("redis://h:6379/0/", "redis://h/0/a:b", "redis://h/0/a*", "redis:///0/x", "redis://h:port/0/x"):
        with pytest.raises(ValueError):
            parse_url(bad)
    with pytest.raises(ValueError, match="local_max_bytes"):
        resolve_redis("redis://h/0/x", local_max_bytes=10)
    from nbkit.stores.registry import resolve

    loc = resolve("redis://h1:1,h2:2/0/x", {"socket_timeout": 3})
    assert loc.is_remote and loc.root == "redis://h1:1,h2:2/0/x" and loc.prepare() is False and loc.publish() is False


def test_import_nbkit_does_not_import_redis_and_missing_package_names_the_extra():
    code = (
        "import sys, nbkit\n"
        "assert 'redis' not in sys.modules\n"
        "sys.modules['redis'] = None\n"
        "try:\n"
        "    nbkit.CachedDataset(None, 'redis://127.0.0.1:1/0/x')\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "(nbkit-cache's 'redis' extra): pip install redis" in out.stdout


# -- issue 25: what a server sends is bounded and checked before it is used -------------------------


def _edit_meta(server, url, edit):
    """Rewrite the metadata of the cache at ``url`` on ``server`` with ``edit(meta)``."""
    c = server.client()
    key = f"nbkit:{url.rsplit('/', 1)[1]}:meta"
    meta = json.loads(c.get(key))
    edit(meta)
    c.set(key, json.dumps(meta).encode())
    return key


@pytest.mark.parametrize("field", ["length", "row size"])
def test_metadata_sizes_beyond_what_redis_holds_are_refused_at_open(redis_url, redis_server, field):
    nbkit.CachedDataset(TupleSource(20), redis_url).warmup()

    def edit(meta):
        if field == "length":
            meta["length"] = 2**40  # every reader would allocate 1 TiB for it
        else:
            meta["schema"]["leaves"][0]["shape"] = [1 << 30]  # 4 GiB of rows per sample
            meta["columns"][0]["shape"] = [1 << 30]

    key = _edit_meta(redis_server, redis_url, edit)
    what = "1,099,511,627,776 samples" if field == "length" else "4,294,967,309 bytes per sample"
    with pytest.raises(nbkit.CorruptCacheError, match=rf"{key} .*claims {what}.*more than.*overwrite=True"):
        nbkit.CachedDataset.open(redis_url)


def test_a_source_longer_than_a_redis_cache_holds_is_refused(redis_url, monkeypatch):
    from nbkit.stores import redis as redis_store

    monkeypatch.setattr(redis_store, "MAX_LENGTH", 10)
    with pytest.raises(ValueError, match=r"at most 10 samples.*this source has 20 samples.*local directory"):
        nbkit.CachedDataset(TupleSource(20), redis_url)


@pytest.mark.parametrize("damage", ["truncated", "shorter than its header", "empty", "longer"])
def test_a_value_of_the_wrong_size_is_a_damaged_sample(redis_url, redis_server, damage):
    src = TupleSource(20)
    nbkit.CachedDataset(src, redis_url).warmup()
    c = redis_server.client()
    (key,) = redis_server.keys(f"nbkit:{redis_url.rsplit('/', 1)[1]}:*:s:7")
    value = c.get(key)
    c.set(key, {"truncated": value[:20], "shorter than its header": value[:3], "empty": b"",
                "longer": value + b"\0" * 8}[damage])
    opened = nbkit.CachedDataset.open(redis_url)
    with pytest.raises(nbkit.CorruptCacheError, match="sample 7"):
        opened[7]
    with pytest.raises(nbkit.CorruptCacheError, match="sample 7"):
        opened.__getitems__([6, 7, 8])
    with pytest.raises(nbkit.CorruptCacheError, match=r"1 sample\(s\).*indices 7"):
        nbkit.CachedDataset.open(redis_url).verify()
    ds = nbkit.CachedDataset(src, redis_url)
    check_all(ds, src)  # recomputed from the source and stored again
    assert ds.stats.recomputed == 1
    assert nbkit.CachedDataset.open(redis_url).verify() == 20


def test_a_silent_server_fails_within_seconds(fake_server):
    silent = fake_server(None)  # accepts the connection, never answers
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"{silent.address} .*did not answer within \d+ s.*redis-cli"):
        nbkit.CachedDataset.open(silent.url())
    assert time.monotonic() - start < 30  # not retried: seconds, not minutes


def test_a_server_that_stops_answering_mid_epoch_fails_within_its_timeout(redis_factory):
    servers = [redis_factory(), redis_factory()]
    src = TupleSource(40)
    url = sharded_url(servers)
    nbkit.CachedDataset(src, url).warmup()
    reader = nbkit.CachedDataset.open(url, storage_options={"socket_timeout": 2})
    check_all(reader, src)
    os.kill(servers[1]._proc.pid, signal.SIGSTOP)  # alive, connected, silent
    try:
        for read in (lambda: reader.__getitems__(list(range(10))),  # one MGET per server, pipelined
                     lambda: nbkit.CachedDataset.open(servers[1].url(), storage_options={"socket_timeout": 2})):
            start = time.monotonic()
            with pytest.raises(TimeoutError, match=rf"{servers[1].address} .*did not answer within 2 s"):
                read()
            assert time.monotonic() - start < 2 * 2 + 3
    finally:
        os.kill(servers[1]._proc.pid, signal.SIGCONT)
    check_all(nbkit.CachedDataset.open(url), src)


@pytest.mark.parametrize("reply, said", [
    (b"-ERR unknown command 'HELLO', with args beginning with: '3' \r\n", r"\(HELLO failed: unknown command 'HELLO'"),
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "not the Redis protocol"),
    (b"+OK\r\n", "not the Redis protocol"),
    (b"%1\r\n+proto\r\n:2\r\n", "HELLO failed"),
])
def test_a_server_without_resp3_is_named_clearly(fake_server, reply, said):
    server = fake_server(reply)
    with pytest.raises(ConnectionError, match=rf"the server at {server.address} does not speak RESP3.*{said}.*Redis >= 6"):
        nbkit.CachedDataset.open(server.url())
    with pytest.raises(ConnectionError, match=rf"{server.address} does not speak RESP3"):
        nbkit.CacheLoader(server.url()).get("a", lambda key: 1)


def test_wrong_password_is_named(redis_factory):
    server = redis_factory("--requirepass", "secret")
    with pytest.raises(PermissionError, match=f"{server.address} .*password"):
        nbkit.CachedDataset.open(f"redis://{server.address}/0/x")
    with pytest.raises(PermissionError, match=f"{server.address} refused the credentials"):
        nbkit.CachedDataset.open(f"redis://:wrong@{server.address}/0/x")
    ds = nbkit.CachedDataset(TupleSource(5), f"redis://:secret@{server.address}/0/x")
    assert ds.warmup().computed == 5


def test_cacheloader_values_and_keys_from_the_server_are_checked(redis_url, redis_server):
    loader = nbkit.CacheLoader(redis_url)
    assert loader.get("a", lambda key: torch.arange(3)).tolist() == [0, 1, 2]
    c = redis_server.client()
    values = f"nbkit:{redis_url.rsplit('/', 1)[1]}:keyed:values"
    c.hset(values, b"sa", b"\x01\x02")  # shorter than its checksum
    with pytest.raises(nbkit.CorruptCacheError, match=r"key 'a'.*is 2 bytes, shorter than its 4-byte checksum"):
        nbkit.CacheLoader(redis_url).get("a")
    assert nbkit.CacheLoader(redis_url).get("a", lambda key: torch.arange(4)).tolist() == [0, 1, 2, 3]  # recomputed
    assert nbkit.CacheLoader(redis_url).get("a").tolist() == [0, 1, 2, 3]
    c.hset(values, b"iabc", b"\0" * 8)  # no key nbkit stores
    with pytest.raises(nbkit.CorruptCacheError, match=r"holds the key b'iabc'"):
        nbkit.CacheLoader(redis_url).keys()


def test_oversized_metadata_is_refused_before_it_is_read(redis_url, redis_server, monkeypatch):
    from nbkit import trust

    monkeypatch.setattr(trust, "MAX_JSON_BYTES", 1000)
    redis_server.client().set(f"nbkit:{redis_url.rsplit('/', 1)[1]}:meta", b" " * 2000)
    with pytest.raises(nbkit.CorruptCacheError, match=r"claims 2,000 bytes, more than 1,000"):
        nbkit.CachedDataset.open(redis_url)


def test_a_silent_server_fails_a_cacheloader_within_seconds(fake_server):
    silent = fake_server(None)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"{silent.address} .*did not answer within \d+ s"):
        nbkit.CacheLoader(silent.url()).get("a", lambda key: 1)
    assert time.monotonic() - start < 30
