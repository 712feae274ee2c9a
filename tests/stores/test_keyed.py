"""The local keyed store (nbkit.stores.keyed) under nbkit.CacheLoader: append-only values and key index."""

import os

import numpy as np
import pytest
import torch

import nbkit
from nbkit.stores import keyed


def test_keys_keep_their_type():
    for key in (0, -5, 2**70, "", "ünï", b"\x00raw"):
        assert keyed.key_of(keyed.key_bytes(key)) == key
    assert keyed.key_bytes(torch.tensor(7)) == keyed.key_bytes(7) == keyed.key_bytes(np.uint8(7))


@pytest.mark.parametrize("key", [True, np.bool_(False), 1.0, float("nan"), torch.tensor(1.5), torch.tensor(1 + 2j),
                                 torch.tensor(True), torch.arange(2), None, (1, 2), np.array(3)], ids=repr)
def test_keys_of_other_types_are_refused_naming_the_argument(key):
    with pytest.raises(TypeError, match=r"^key must be a str, an int .* or bytes, got"):
        keyed.key_bytes(key)


def test_huge_int_keys_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"key is too large .*str\(key\)"):
        keyed.key_bytes(10**5000)


def test_a_torn_record_is_never_served_and_writing_goes_on_after_it(tmp_path):
    path = tmp_path / "kv"
    loader = nbkit.CacheLoader(path)
    loader.get("whole", lambda k: "whole value")
    size = os.path.getsize(path / keyed.KEYS)
    # What a writer killed mid-append leaves: value bytes nobody points at, half of an index record.
    with open(path / keyed.VALUES, "ab") as f:
        f.write(b"NBKF half a value")
    record = keyed.RECORD.pack(keyed.MAGIC, 5, 0, 100, 0, 0) + b"storn"
    with open(path / keyed.KEYS, "ab") as f:
        f.write(record[:20])
    reader = nbkit.CacheLoader(path)
    assert len(reader) == 1 and "torn" not in reader and reader.get("whole") == "whole value"
    reader.get("next", lambda k: [1, 2])  # appended after the torn bytes, which readers skip
    assert os.path.getsize(path / keyed.KEYS) == size + 20 + keyed.RECORD.size + len(b"snext")
    fresh = nbkit.CacheLoader(path)
    assert fresh.get("next") == [1, 2] and fresh.get("whole") == "whole value" and len(fresh) == 2


def test_damage_in_the_index_costs_only_the_records_it_hits(tmp_path):
    path = tmp_path / "kv"
    loader = nbkit.CacheLoader(path)
    for k in range(5):
        loader.get(k, lambda k: k * 10)
    with open(path / keyed.KEYS, "r+b") as f:  # one byte of the second record's key
        f.seek(2 * keyed.RECORD.size + len(b"i0") + 1)
        f.write(b"\xff")
    reader = nbkit.CacheLoader(path)
    assert sorted(reader.keys()) == [0, 2, 3, 4] and reader.verify() == 4
    assert reader.get(1, lambda k: "again") == "again" and nbkit.CacheLoader(path).get(1) == "again"


def test_a_huge_sparse_index_is_read_in_bounded_pieces(tmp_path, monkeypatch):
    """keys.bin's size is data: a copied directory may hold a sparse file of many GiB. Reading it
    never allocates more than a bounded piece (it used to read it whole: MemoryError)."""
    path = tmp_path / "kv"
    loader = nbkit.CacheLoader(path)
    loader.get("a", lambda k: "value a")
    loader.close()
    with open(path / keyed.KEYS, "r+b") as f:
        f.truncate(64 << 30)  # 64 GiB of holes after the whole records
    asked = []
    real_pread = os.pread
    monkeypatch.setattr(keyed.os, "pread", lambda fd, n, off: asked.append(n) or real_pread(fd, n, off))
    reader = nbkit.CacheLoader(path)
    assert reader.get("a") == "value a" and reader.get("b", lambda k: "value b") == "value b"
    assert reader.get("c", lambda k: 3) == 3 and "zzz" not in reader
    assert max(asked) <= 16 << 20


def test_both_keyed_stores_define_the_keyed_contract():
    from nbkit.stores.base import KeyedStore
    from nbkit.stores.keyed_redis import RedisKeyed

    required = ("get", "put", "contains", "count", "keys")
    for cls in (keyed.LocalKeyed, RedisKeyed):
        assert issubclass(cls, KeyedStore)
        assert [m for m in required if getattr(cls, m) is getattr(KeyedStore, m)] == [], cls.__name__

    class NoKeys(KeyedStore):
        pass

    with pytest.raises(NotImplementedError, match=r"^NoKeys does not implement KeyedStore\.keys\(\), which every keyed store"):
        NoKeys().keys()
