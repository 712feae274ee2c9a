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
from fixtures_redis import redis_server, redis_url  # noqa: F401
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
