"""nbkit.CacheLoader: Bagua-style caching by key inside ``__getitem__``, on a local directory and on Redis."""

import multiprocessing as mp
import os
import pickle
import random
import signal
import time
import uuid
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import nbkit
from fixtures_redis import redis_server, redis_url
from nbkit.stores import keyed
from sources import image

FORK = mp.get_context("fork")


@pytest.fixture(params=["local", "redis"])
def where(request, tmp_path):
    """A fresh CacheLoader location: a local directory, or a namespace on a real redis-server."""
    if request.param == "local":
        return str(tmp_path / "kv")
    return request.getfixturevalue("redis_url")


def loads(log_dir) -> dict:
    """``key -> how many times load_fn ran for it`` (in any process), from the marker files."""
    counts: dict = {}
    for name in os.listdir(log_dir):
        key = name.split("@", 1)[0]
        counts[key] = counts.get(key, 0) + 1
    return counts


def value_of(key):
    """What load_fn returns for ``key``: a sample like CachedDataset stores (tensor, label, name)."""
    i = key if isinstance(key, int) else int(str(key).lstrip("k"))
    return image(i, (1, 6, 6)), i % 10, f"name-{key}"


class Bagua(Dataset):
    """Bagua's pattern: cache the decoded sample by key in ``__getitem__``, augment after it."""

    def __init__(self, path, n, log_dir):
        self.loader = nbkit.CacheLoader(path)
        self.n, self.log_dir = n, log_dir

    def __len__(self):
        return self.n

    def _load(self, key):
        open(os.path.join(self.log_dir, f"{key}@{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
        x, y, _ = value_of(key)
        return x, y

    def __getitem__(self, index):
        x, y = self.loader.get(index, self._load)
        return x + 0.01 * torch.rand_like(x), y, index  # random augmentation, after the cache


def test_bagua_style_dataset_two_epochs_two_workers(where, tmp_path):
    n = 48
    logs = tmp_path / "logs"
    logs.mkdir()
    ds = Bagua(where, n, str(logs))
    seen = []
    for epoch in range(2):
        loader = DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
        xs = {}
        for x, y, idx in loader:
            for xi, yi, i in zip(x, y.tolist(), idx.tolist()):
                ref, label, _ = value_of(i)
                assert yi == label and torch.allclose(xi, ref, atol=0.011) and not torch.equal(xi, ref)
                xs[i] = xi
        assert sorted(xs) == list(range(n))
        seen.append(xs)
        if epoch == 0:
            assert loads(logs) == {str(i): 1 for i in range(n)}  # every key loaded once, by some worker
    assert loads(logs) == {str(i): 1 for i in range(n)}  # epoch 2: every read a hit
    assert ds.loader.num_keys() == len(ds.loader) == n and all(i in ds.loader for i in range(n))
    assert any(not torch.equal(seen[0][i], seen[1][i]) for i in range(n))  # augmentation differs per epoch


def test_string_and_int_keys_are_distinct(where):
    loader = nbkit.CacheLoader(where)
    assert loader.get(1, lambda k: "int one") == "int one"
    assert loader.get("1", lambda k: "str one") == "str one"
    assert loader.get(b"1", lambda k: b"bytes one") == b"bytes one"
    assert loader.get("ünï/κey with spaces", lambda k: [k, 2.5, None]) == ["ünï/κey with spaces", 2.5, None]
    # numpy and 0-d tensor integers are the int key
    assert loader.get(np.int64(1)) == loader.get(torch.tensor(1)) == "int one"
    assert len(loader) == 4 and sorted(map(repr, loader.keys())) == sorted(map(repr, [1, "1", b"1", "ünï/κey with spaces"]))
    assert 2 not in loader and "2" not in loader
    with pytest.raises(nbkit.MissingSampleError, match="not in the CacheLoader"):
        loader.get(2)
    for bad in (1.5, float("nan"), True, torch.tensor(1 + 2j), torch.tensor(0.5)):
        with pytest.raises(TypeError, match=r"^key must be a str, an int .*or bytes, got"):
            loader.get(bad, str)


def test_values_persist_across_sessions(where):
    first = nbkit.CacheLoader(where)
    for k in range(30):
        first.get(f"k{k}", value_of)
    first.close()

    def never(key):
        raise AssertionError(f"load_fn called for {key}")

    again = nbkit.CacheLoader(where)
    assert len(again) == 30
    for k in range(30):
        x, y, name = again.get(f"k{k}", never)
        ref = value_of(k)
        assert torch.equal(x, ref[0]) and y == ref[1] and name == f"name-k{k}"
    assert again.verify() == 30


def test_loader_pickles_into_another_process(where):
    loader = nbkit.CacheLoader(where)
    loader.get("a", lambda k: 1)
    clone = pickle.loads(pickle.dumps(loader))
    assert clone._store is None  # no descriptor or connection crosses a pickle
    assert clone.get("a") == 1


def _writer(path, keys, log_dir, barrier):
    loader = nbkit.CacheLoader(path)

    def load(key):
        open(os.path.join(log_dir, f"{key}@{os.getpid()}-{uuid.uuid4().hex}"), "w").close()
        return value_of(key)

    barrier.wait()
    for key in keys:
        got = loader.get(key, load)
        assert got[2] == f"name-{key}"


def test_several_processes_write_at_once(where, tmp_path):
    keys = [f"k{i}" for i in range(150)]
    logs = tmp_path / "logs"
    logs.mkdir()
    barrier = FORK.Barrier(4)
    procs = []
    for p in range(4):
        order = keys[:]
        random.Random(p).shuffle(order)
        procs.append(FORK.Process(target=_writer, args=(where, order, str(logs), barrier)))
    for p in procs:
        p.start()
    assert [p.join(120) or p.exitcode for p in procs] == [0] * 4
    counts = loads(logs)
    assert set(counts) == set(keys)  # every key loaded at least once; a race may load one twice, never store it twice
    loader = nbkit.CacheLoader(where)
    assert len(loader) == len(keys) and loader.verify() == len(keys)
    for k in keys:
        x, y, name = loader.get(k)
        assert torch.equal(x, value_of(k)[0]) and name == f"name-{k}"
    if not where.startswith("redis://"):
        # Each key has exactly one record: the first writer stored it, the others found it stored.
        records = keyed.LocalKeyed(where)
        assert records.refresh() == sum(keyed.RECORD.size + len(keyed.key_bytes(k)) for k in keys)


def big_value(i):
    return np.full(50_000 + i, i % 251, dtype=np.uint8), i


def _endless_writer(path):
    loader = nbkit.CacheLoader(path)
    i = 0
    while True:
        loader.get(i, big_value)
        i += 1


def test_a_process_killed_mid_write_leaves_only_whole_values(tmp_path):
    path = str(tmp_path / "kv")
    for attempt in range(3):
        p = FORK.Process(target=_endless_writer, args=(path,))
        p.start()
        time.sleep(0.4 + 0.13 * attempt)  # somewhere in the middle of a value or a record
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        loader = nbkit.CacheLoader(path)
        n = len(loader)
        assert n > 0 and loader.verify() == n
        for i in loader.keys():
            arr, j = loader.get(i)
            assert j == i and arr.shape == (50_000 + i,) and (arr == i % 251).all()
    # Writing resumes after a torn tail: the new value is readable by a fresh process.
    loader.get("after", lambda k: "ok")
    assert nbkit.CacheLoader(path).get("after") == "ok"


def _damage(where, key):
    """Flip one byte of the stored value of ``key``."""
    if where.startswith("redis://"):
        import redis

        from nbkit.stores.registry import resolve

        loc = resolve(where)
        client = redis.Redis(*loc.parsed.servers[0])
        h = loc.prefix + "keyed:values"
        raw = bytearray(client.hget(h, keyed.key_bytes(key)))
        raw[-3] ^= 0xFF
        client.hset(h, keyed.key_bytes(key), bytes(raw))
        return
    store = keyed.LocalKeyed(where)
    off, length, _ = store.lookup(keyed.key_bytes(key))
    with open(os.path.join(where, keyed.VALUES), "r+b") as f:
        f.seek(off + length - 3)
        b = f.read(1)
        f.seek(off + length - 3)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_damaged_byte_is_caught_by_the_checksum(where):
    loader = nbkit.CacheLoader(where)
    loader.get("good", lambda k: "fine")
    loader.get("img-3", lambda k: torch.arange(100))
    _damage(where, "img-3")
    reader = nbkit.CacheLoader(where)
    with pytest.raises(nbkit.CorruptCacheError, match="key 'img-3'.*checksum"):
        reader.get("img-3")
    with pytest.raises(nbkit.CorruptCacheError, match="'img-3'"):
        reader.verify()
    assert reader.get("good") == "fine"
    # With load_fn the value is computed again and replaces the damaged one.
    assert torch.equal(reader.get("img-3", lambda k: torch.arange(100)), torch.arange(100))
    again = nbkit.CacheLoader(where)
    assert torch.equal(again.get("img-3"), torch.arange(100)) and again.verify() == 2 and len(again) == 2


def test_pickle_is_refused_by_default(where):
    loader = nbkit.CacheLoader(where)
    with pytest.raises(TypeError, match="allow_pickle=True"):
        loader.get("frac", lambda k: Fraction(1, 3))
    assert "frac" not in loader
    writer = nbkit.CacheLoader(where, allow_pickle=True)
    assert writer.get("frac", lambda k: Fraction(1, 3)) == Fraction(1, 3)
    with pytest.raises(PermissionError, match="allow_pickle=True"):
        nbkit.CacheLoader(where).get("frac")
    assert nbkit.CacheLoader(where, allow_pickle=True).get("frac") == Fraction(1, 3)


def test_bucket_urls_are_refused_with_the_alternatives(tmp_path):
    with pytest.raises(ValueError, match="redis://.*gsutil"):
        nbkit.CacheLoader("gs://bucket/kv")
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tmp_path / "ds")
    with pytest.raises(ValueError, match="CachedDataset cache"):
        nbkit.CacheLoader(ds.root)


# -- untrusted files and arguments ----------------------------------------------------------------------

def _forge_record(path, key, off, length, crc):
    """Append a keys.bin record for ``key`` with a valid record checksum (what a forged cache could hold)."""
    import struct

    from nbkit import format as fmt

    kb = keyed.key_bytes(key)
    head = keyed.RECORD.pack(keyed.MAGIC, len(kb), off, length, crc, 0)[:-4]
    with open(os.path.join(path, keyed.KEYS), "ab") as f:
        f.write(head + struct.pack("<I", fmt.row_crc([head, kb])) + kb)


@pytest.mark.parametrize("off,length", [(2**64 - 1, 1), (0, 2**63), (10**12, 10), (5, 2**64 - 6)])
def test_a_record_past_values_bin_is_recomputed_or_reported(tmp_path, off, length):
    path = str(tmp_path / "kv")
    nbkit.CacheLoader(path).get("k", lambda k: "value")
    _forge_record(path, "k", off, length, 0)
    reader = nbkit.CacheLoader(path)
    with pytest.raises(nbkit.CorruptCacheError, match=r"key 'k'.*keys\.bin.*values\.bin.*load_fn"):
        reader.get("k")
    with pytest.raises(nbkit.CorruptCacheError, match="'k'"):
        reader.verify()
    assert reader.get("k", lambda k: "again") == "again"
    assert nbkit.CacheLoader(path).get("k") == "again" and nbkit.CacheLoader(path).verify() == 1


def test_records_with_keys_no_writer_makes_are_skipped(tmp_path):
    path = str(tmp_path / "kv")
    loader = nbkit.CacheLoader(path)
    loader.get(1, lambda k: "one")
    import struct

    from nbkit import format as fmt

    for kb in (b"i\xff", b"i1_0", b"x1", b"s\xff\xfe", b"i" + b"9" * 5000):
        head = keyed.RECORD.pack(keyed.MAGIC, len(kb), 0, 1, 0, 0)[:-4]
        with open(os.path.join(path, keyed.KEYS), "ab") as f:
            f.write(head + struct.pack("<I", fmt.row_crc([head, kb])) + kb)
    again = nbkit.CacheLoader(path)
    assert again.keys() == [1] and again.get(1) == "one" and again.verify() == 1


@pytest.mark.parametrize("kwargs,error,match", [
    ({"path_or_url": b"/tmp/kv"}, TypeError, "path_or_url must be a str path"),
    ({"path_or_url": 3}, TypeError, "path_or_url must be a path"),
    ({"path_or_url": "gs:/bucket/kv"}, ValueError, "one slash.*gs://bucket/kv"),
    ({"path_or_url": "redis:/host/0/x"}, ValueError, "one slash"),
    ({"allow_pickle": "yes"}, TypeError, "allow_pickle must be True or False"),
    ({"storage_options": "x"}, TypeError, "storage_options must be a dict"),
])
def test_arguments_are_checked_at_the_door(tmp_path, kwargs, error, match):
    args = {"path_or_url": str(tmp_path / "kv"), **kwargs}
    with pytest.raises(error, match=match):
        nbkit.CacheLoader(args.pop("path_or_url"), **args)
    with pytest.raises(TypeError, match="load_fn must be a callable"):
        nbkit.CacheLoader(str(tmp_path / "ok")).get("k", "not callable")


def test_files_that_are_links_are_refused(tmp_path):
    path = tmp_path / "kv"
    nbkit.CacheLoader(str(path)).get("k", lambda k: 1)
    victim = tmp_path / "victim"
    victim.write_bytes(b"mine")
    os.unlink(path / keyed.VALUES)
    os.symlink(victim, path / keyed.VALUES)
    with pytest.raises(nbkit.UnsafeArchiveError, match="symbolic link"):
        nbkit.CacheLoader(str(path))
    assert victim.read_bytes() == b"mine"


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st

FUZZ_VALUES = {"a": torch.arange(5), 7: ("seven", 7.5, None), b"raw": {"x": [1, 2], "y": b"\x00"}, "long": "z" * 300}


@pytest.fixture(scope="module")
def keyed_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("kvt") / "kv"
    loader = nbkit.CacheLoader(str(path))
    for k, v in FUZZ_VALUES.items():
        loader.get(k, lambda key, v=v: v)
    loader.close()
    return path


def _same(a, b):
    from sources import assert_equal

    try:
        assert_equal(a, b)
        return True
    except AssertionError:
        return False


def _read_all(path, repair: bool):
    """Every key through a fresh CacheLoader: the value, or an nbkit error naming the key and the cache."""
    loader = nbkit.CacheLoader(str(path))
    for k, v in FUZZ_VALUES.items():
        try:
            got = loader.get(k, (lambda key, v=v: v) if repair else None)
        except (nbkit.CorruptCacheError, nbkit.MissingSampleError) as e:
            assert not repair, e
            assert repr(k) in str(e) and str(path) in str(e), e
            continue
        assert _same(got, v), (k, got)
    try:
        loader.verify()
    except nbkit.CorruptCacheError as e:
        assert not repair and str(path) in str(e), e
    loader.close()


def _fuzz_open(path):
    try:
        return nbkit.CacheLoader(str(path))
    except nbkit.CorruptCacheError as e:
        assert keyed.KEYS_META in str(e), e
        return None


@pytest.mark.fuzz
@given(file=st.sampled_from([keyed.KEYS, keyed.VALUES, keyed.KEYS_META]),
       edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.none() | st.integers(min_value=0))
def test_fuzz_cacheloader_files(keyed_template, tmp_path_factory, file, edits, cut):
    import shutil

    base = tmp_path_factory.mktemp("kvcase")
    path = base / "kv"
    shutil.copytree(keyed_template, path)
    raw = bytearray((path / file).read_bytes())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    if cut is not None:
        del raw[cut % len(raw):]
    (path / file).write_bytes(bytes(raw))
    opened = _fuzz_open(path)
    if opened is not None:
        opened.close()
        _read_all(path, repair=False)
        _read_all(path, repair=True)
    assert sorted(os.listdir(base)) == ["kv"]


@pytest.mark.fuzz
@given(key=st.sampled_from(list(FUZZ_VALUES)), off=st.integers(0, 2**64 - 1) | st.integers(0, 2000),
       length=st.integers(0, 2**64 - 1) | st.integers(0, 2000), crc=st.integers(0, 2**32 - 1))
def test_fuzz_forged_key_records(keyed_template, tmp_path_factory, key, off, length, crc):
    import shutil

    path = tmp_path_factory.mktemp("kvforged") / "kv"
    shutil.copytree(keyed_template, path)
    _forge_record(str(path), key, off, length, crc)
    _read_all(path, repair=False)
    _read_all(path, repair=True)


@pytest.mark.fuzz
@given(key=st.sampled_from(list(FUZZ_VALUES)), sparse=st.sampled_from([keyed.KEYS, keyed.VALUES]),
       off=st.integers(0, 2**41) | st.sampled_from([0, 1 << 39]),
       length=st.integers(0, 2**41) | st.sampled_from([(16 << 20) + 1, 8 << 30, 1 << 39]), crc=st.integers(0, 2**32 - 1))
def test_fuzz_forged_key_records_in_sparse_files(keyed_template, tmp_path_factory, key, sparse, off, length, crc):
    # A copied or planted directory: a file as long as it claims (1 TiB of holes), so every claim
    # passes a size check; none may size a read or a buffer.
    import shutil

    path = tmp_path_factory.mktemp("kvsparse") / "kv"
    shutil.copytree(keyed_template, path)
    _forge_record(str(path), key, off, length, crc)
    with open(path / sparse, "r+b") as f:
        f.truncate(max(1 << 40, os.path.getsize(path / sparse)))
    _read_all(path, repair=False)
    _read_all(path, repair=True)


@pytest.mark.fuzz
@given(meta=st.dictionaries(st.sampled_from(["format", "version", "shards", "x"]),
                            st.none() | st.booleans() | st.integers() | st.text(max_size=12) | st.just("nbkit-keyed")
                            | st.lists(st.integers(), max_size=2), max_size=4))
def test_fuzz_cacheloader_metadata_values(tmp_path_factory, meta):
    import json

    path = tmp_path_factory.mktemp("kvmeta") / "kv"
    path.mkdir()
    (path / keyed.KEYS_META).write_text(json.dumps(meta))
    loader = _fuzz_open(path)
    if loader is not None:
        assert loader.get("k", lambda k: 1) == 1
        loader.close()
