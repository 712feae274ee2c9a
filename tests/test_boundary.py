"""The trust boundary's promises, proven again (issue 37): no allocation sized by a claim, no raw
``TypeError``/``OverflowError``/``RecursionError`` from an index, a Redis reply or a resume state,
and truncated columns recomputed when the source is there."""

import os

import numpy as np
import pytest
import torch

import nbkit
from nbkit import format as fmt
from nbkit.errors import CorruptCacheError
from fixtures_redis import redis_server, redis_url
from sources import DictSource, IrregularSource, assert_equal


def build(root, src):
    nbkit.CachedDataset(src, root).warmup()
    return root


# -- a record's length is a claim: a sparse heap is as long as it says, and holds nothing ----------

@pytest.mark.parametrize("source", [DictSource, IrregularSource])
@pytest.mark.parametrize("claim", [8 << 30, 512 << 30])
def test_a_huge_blob_claimed_in_a_sparse_heap_is_a_damaged_sample(tmp_path, source, claim):
    src = source(8)
    root = build(tmp_path / "c", src)
    with open(root / "heap.bin", "r+b") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: the index's claims all fall inside it
    rec = np.memmap(root / "index.bin", dtype=fmt.RECORD, mode="r+")
    rec["off"][3], rec["len"][3] = 1 << 39, claim
    rec.flush()
    del rec
    with pytest.raises(CorruptCacheError, match=r"sample 3"):
        nbkit.CachedDataset.open(root)[3]
    with pytest.raises(CorruptCacheError, match=r"indices 3"):
        nbkit.CachedDataset.open(root).verify()
    rec = np.memmap(root / "index.bin", dtype=fmt.RECORD, mode="r+")
    rec["state"][5] = 0  # one sample missing, so that warmup has work to do
    rec.flush()
    del rec
    ds = nbkit.CachedDataset(src, root)
    ds.warmup(num_workers=0)
    assert_equal(ds[3], src[3])  # recomputed: the claim is never read whole
    assert ds.stats.recomputed >= 1


def test_a_large_blob_that_is_really_there_is_read(tmp_path):
    big = [{"b": bytes([i]) * ((fmt.BLOB_PIECE + 5) if i == 1 else 3)} for i in range(3)]
    root = build(tmp_path / "c", big)
    ds = nbkit.CachedDataset.open(root)
    assert ds[1]["b"] == big[1]["b"] and ds.verify() == 3


# -- indices are integers or integer-likes ------------------------------------------------------------

@pytest.fixture(scope="module")
def small_cache(tmp_path_factory):
    src = torch.utils.data.TensorDataset(torch.arange(8))
    ds = nbkit.CachedDataset(src, tmp_path_factory.mktemp("idx") / "c")
    ds.warmup()
    return ds


@pytest.mark.parametrize("index", [1.5, "3", np.float64(2.9), None, b"1", {1}, np.bool_(True), torch.tensor(1.0),
                                   torch.tensor([1, 2])])
def test_an_index_that_is_not_an_integer_is_a_type_error_naming_its_type(small_cache, index):
    with pytest.raises(TypeError, match=type(index).__name__):
        small_cache[index]


@pytest.mark.parametrize("indices", [[1.5], ["3"], [np.float64(2.9)], [0, None], np.array([0.0, 1.0]), "12"])
def test_batched_indices_that_are_not_integers_are_a_type_error(small_cache, indices):
    with pytest.raises(TypeError, match=r"indices must be"):
        small_cache.__getitems__(indices)


@pytest.mark.parametrize("index", [2**70, -2**70, 2**63, 8, -9, np.uint64(2**64 - 1)])
def test_an_index_out_of_range_of_any_size_is_an_index_error(small_cache, index):
    with pytest.raises(IndexError, match="out of range"):
        small_cache[index]
    with pytest.raises(IndexError, match="out of range"):
        small_cache.__getitems__([0, index])


def test_integer_likes_are_indices(small_cache):
    for index in (3, np.int32(3), np.uint8(3), torch.tensor(3), torch.tensor([3]), True, -5):
        assert int(small_cache[index][0]) == int(index) % 8 if not isinstance(index, torch.Tensor) else 3
    assert [int(s[0]) for s in small_cache.__getitems__([np.int64(1), torch.tensor(2), 2**2, -1])] == [1, 2, 4, 7]
    assert [int(s[0]) for s in small_cache.__getitems__(torch.tensor([5, 6]))] == [5, 6]
    assert len(small_cache.__getitems__([])) == 0
    assert [int(s[0]) for s in small_cache[[1, -1]]] == [1, 7] and small_cache[np.array([], np.int64)] == []
    with pytest.raises(TypeError, match="indices must be"):
        small_cache[[1, 1.5]]


def test_grain_source_indices(small_cache):
    pytest.importorskip("jax")
    from nbkit.jax import GrainSource

    source = GrainSource(small_cache)
    assert int(np.asarray(source[np.int64(2)][0])) == 2
    for bad, error in ((1.5, TypeError), ("3", TypeError), (2**70, IndexError)):
        with pytest.raises(error):
            source[bad]


# -- a Redis metadata reply that is no string ------------------------------------------------------


@pytest.mark.parametrize("plant", ["list", "hash", "set", "zset"])
def test_a_redis_metadata_key_of_another_type_is_a_clear_error(redis_url, redis_server, plant):
    c = redis_server.client()
    key = f"nbkit:{redis_url.rsplit('/', 1)[1]}:meta"
    {"list": lambda: c.rpush(key, b"a", b"b"), "hash": lambda: c.hset(key, "a", "b"), "set": lambda: c.sadd(key, "x"),
     "zset": lambda: c.zadd(key, {"x": 1.0})}[plant]()
    with pytest.raises(CorruptCacheError, match=rf"{key} on the Redis server .* is not nbkit metadata.*WRONGTYPE.*overwrite=True"):
        nbkit.CachedDataset.open(redis_url)
    with pytest.raises(CorruptCacheError, match=rf"{key} .*is not nbkit metadata"):
        nbkit.CachedDataset(DictSource(4), redis_url)
    ds = nbkit.CachedDataset(DictSource(4), redis_url, overwrite=True)  # the fix the message gives works
    assert_equal(ds[2], DictSource(4)[2])


@pytest.mark.parametrize("reply", [[b"{", b"}"], 7, {b"a": b"b"}])
def test_a_redis_metadata_reply_that_is_an_array_or_an_integer_is_a_clear_error(redis_url, redis_server, monkeypatch, reply):
    import redis

    nbkit.CachedDataset(DictSource(4), redis_url).warmup()
    monkeypatch.setattr(redis.Redis, "get", lambda self, key: reply)  # a proxy or another service answering
    with pytest.raises(CorruptCacheError, match=rf"is not nbkit metadata: the server answered {type(reply).__name__}"):
        nbkit.CachedDataset.open(redis_url)


@pytest.mark.parametrize("plant", ["string", "list"])
def test_a_cacheloader_values_key_of_another_type_is_a_clear_error(redis_url, redis_server, plant):
    loader = nbkit.CacheLoader(redis_url)
    assert loader.get("a", lambda k: "value a") == "value a"
    c = redis_server.client()
    name = redis_url.rsplit("/", 1)[1]
    (key,) = [k.decode() for k in c.keys(f"nbkit:{name}:*keyed:values")]
    c.delete(key)
    {"string": lambda: c.set(key, b"x"), "list": lambda: c.rpush(key, b"a")}[plant]()
    again = nbkit.CacheLoader(redis_url)
    with pytest.raises(CorruptCacheError, match=rf"{key} on the Redis server .* is not a CacheLoader's values.*WRONGTYPE.*DEL "):
        again.get("a", lambda k: "value a")
    with pytest.raises(CorruptCacheError, match="is not a CacheLoader's values"):
        "a" in again


# -- prune's age -------------------------------------------------------------------------------------

@pytest.mark.parametrize("age", [float("nan"), float("inf"), -float("inf"), -1, -0.5, 2**20000],
                         ids=["nan", "inf", "-inf", "-1", "-0.5", "2**20000"])
def test_prune_refuses_an_age_that_is_no_number_of_seconds(tmp_path, monkeypatch, age):
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"older_than must be a number of seconds in \[0, "):
        nbkit.prune(older_than=age, dry_run=True)
    with pytest.raises(TypeError, match="older_than"):
        nbkit.prune(older_than="7d")
    assert nbkit.prune(older_than=0.0, dry_run=True) == []


# -- resume states: checked whole, bounded in depth, refused without a trace -----------------------

def _deep(n, leaf, box):
    for _ in range(n):
        leaf = box(leaf)
    return leaf


def _loaders(ds):
    yield ds.loader(4, seed=0, drop_last=True)
    try:
        from nbkit.jax import JaxLoader
    except ImportError:
        return
    yield JaxLoader(ds, 4, seed=0, drop_last=True)


@pytest.mark.parametrize("damage", ["deep epoch", "deep kind", "deep dict", "last epoch done", "epoch past the last"])
def test_a_refused_resume_state_leaves_the_loader_as_it_was(tmp_path, damage):
    ds = nbkit.CachedDataset([np.arange(3) * i for i in range(16)], tmp_path / "c")
    for loader in _loaders(ds):
        it = iter(loader)
        next(it)  # a run one batch in
        good, epoch = loader.state_dict(), loader.sampler.epoch
        state = {
            "deep epoch": lambda: {**good, "epoch": _deep(200_000, {}, lambda x: {"epoch": x})},
            "deep kind": lambda: {**good, "kind": _deep(200_000, [], lambda x: [x])},
            "deep dict": lambda: _deep(200_000, good, lambda x: {"state": x}),
            "last epoch done": lambda: {**good, "epoch": 2**62, "position": len(loader)},
            "epoch past the last": lambda: {**good, "epoch": 2**62 + 1},
        }[damage]()
        with pytest.raises(ValueError, match=r"load_state_dict|epoch"):
            loader.load_state_dict(state)
        assert loader.state_dict() == good and loader.sampler.epoch == epoch
        assert len(list(it)) == len(loader) - 1  # the run goes on where it was
        loader.load_state_dict(good)  # and a good state still loads
        assert loader.state_dict() == good


# -- a truncated cache with its source: the lost samples are recomputed, the rest kept (SECURITY.md) --

@pytest.mark.parametrize("file", ["col-0.bin", "col-1.bin", "index.bin", "heap.bin"])
def test_a_truncated_cache_file_is_recomputed_with_the_source(tmp_path, file):
    src = DictSource(20)
    root = build(tmp_path / "c", src)
    size = os.path.getsize(root / file)
    with open(root / file, "r+b") as f:
        f.truncate(size // 2 + 3)  # the second half gone, one row or record cut in the middle
    if file != "heap.bin":  # a heap cut short is damaged records, as before; the other files are sized
        with pytest.raises(CorruptCacheError, match=rf"{file} is \d+ bytes, expected {size}: the cache is truncated\. "
                                                    r"Open it with its source .* to recompute"):
            nbkit.CachedDataset.open(root)[0]
    ds = nbkit.CachedDataset(src, root)
    for i in range(20):
        assert_equal(ds[i], src[i])
    assert 0 < ds.stats.recomputed < 20  # the lost samples, not every sample
    ds.close()
    assert nbkit.CachedDataset.open(root).verify() == 20 and os.path.getsize(root / file) >= size


@pytest.mark.parametrize("claim", [8 << 30, 512 << 30])
def test_a_cacheloader_record_claiming_a_huge_value_in_a_sparse_file_is_damage(tmp_path, claim):
    from nbkit.stores import keyed

    path = tmp_path / "kv"
    loader = nbkit.CacheLoader(path)
    loader.get("a", lambda k: "value a")
    loader.close()
    with open(path / keyed.VALUES, "r+b") as f:
        f.truncate(1 << 40)  # 1 TiB of holes
    kb = keyed.key_bytes("a")
    head = keyed.RECORD.pack(keyed.MAGIC, len(kb), 1 << 39, claim, 0, 0)[:-4]
    with open(path / keyed.KEYS, "ab") as f:  # a later record for the key wins
        f.write(head + fmt.row_crc([head, kb]).to_bytes(4, "little") + kb)
    with pytest.raises(CorruptCacheError, match=r"key 'a'.*the record is damaged"):
        nbkit.CacheLoader(path).get("a")
    assert nbkit.CacheLoader(path).get("a", lambda k: "again") == "again"
    assert nbkit.CacheLoader(path).get("a") == "again"
