"""nbkit.cachedir: one local cache directory, counted, checked and replaced without building a dataset."""

import os

import numpy as np
import pytest
import torch

import nbkit
from nbkit import format as fmt
from nbkit.cachedir import (CacheFiles, cache_root, check_replaceable, open_files, remove_cache, stored_count,
                            swap_into_place, verify)
from nbkit.errors import CorruptCacheError


@pytest.fixture
def cache(tmp_path):
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(20.0)), tmp_path / "c", max_bytes=20 * 24 + 40)
    ds.warmup()
    return ds.root


def test_count_and_verify_open_no_dataset(cache, monkeypatch):
    monkeypatch.setattr(nbkit.CachedDataset, "__init__", None)  # would fail if anything built one
    stored, length = stored_count(cache)
    assert length == 20 and stored == 20  # samples outside the byte budget count as stored: nothing to fill
    files = open_files(cache)
    assert isinstance(files, CacheFiles) and files.stored_count() < 20
    files.close()
    assert verify(cache) == stored_count(cache)[0] - (20 - len(np.flatnonzero(files.admitted(np.arange(20)))))


def test_verify_names_damaged_samples(cache):
    files = open_files(cache, writable=True)
    i = int(np.flatnonzero(files.is_stored(np.arange(20)))[0])
    files.crc[i] ^= 1
    files.close()
    with pytest.raises(CorruptCacheError, match=f"1 sample.*indices {i}"):
        verify(cache)


def test_replace_and_remove(cache, tmp_path):
    assert cache_root(cache) == cache
    with pytest.raises(FileNotFoundError, match="no nbkit cache"):
        cache_root(tmp_path)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("x")
    with pytest.raises(FileExistsError):
        check_replaceable(str(tmp_path / "notes"))
    check_replaceable(cache)
    new = tmp_path / "new"
    new.mkdir()
    (new / "f").write_text("y")
    swap_into_place(str(new), cache)
    assert os.listdir(cache) == ["f"]
    remove_cache(cache)
    assert os.listdir(cache) == ["f"] and not os.path.exists(os.path.join(cache, fmt.META))


# -- large rows: written from the samples' own arrays (format.Rows), never stacked first -------------


@pytest.fixture
def puts(monkeypatch):
    """What each ``CacheFiles.put`` got for its columns: ``"rows"`` or ``"stacked"``."""
    seen, real = [], CacheFiles.put

    def spy(self, idx, flags, crc, cpos, stacked, bpos, blobs):
        seen.append(["rows" if isinstance(c, fmt.Rows) else "stacked" for c in stacked])
        return real(self, idx, flags, crc, cpos, stacked, bpos, blobs)

    monkeypatch.setattr(CacheFiles, "put", spy)
    return seen


@pytest.mark.parametrize("how", ["warmup", "reads", "budget"])
def test_large_rows_are_written_from_the_samples_own_arrays_and_read_back_equal(tmp_path, puts, how):
    from sources import LargeRowSource, assert_equal

    src = LargeRowSource(24)
    budget = {"max_bytes": 12 * (3 * 80 * 80 * 4 + 8) + 4096} if how == "budget" else {}
    ds = nbkit.CachedDataset(src, tmp_path / "c", **budget)
    if how == "reads":
        order = np.random.default_rng(0).permutation(24)
        ds.__getitems__([int(i) for i in order[:10]])  # a batch out of order: rows sorted into runs
        for i in order[10:]:
            ds[int(i)]
    else:
        ds.warmup()
    assert puts and all(kinds[0] == "rows" and kinds[1:] == ["stacked"] for kinds in puts if kinds)
    ds.close()
    with nbkit.CachedDataset.open(tmp_path / "c") as reader:
        stored = np.flatnonzero(reader.store.is_stored(np.arange(24)))
        assert reader.verify() == len(stored) and (len(stored) == 24) == (how != "budget") and len(stored) >= 6
        for i in stored:
            assert_equal(reader[int(i)], src[int(i)])


def test_a_store_that_does_not_take_rows_gets_every_column_stacked(tmp_path, puts, monkeypatch):
    from sources import LargeRowSource, assert_equal

    monkeypatch.setattr(CacheFiles, "takes_rows", False)
    ds = nbkit.CachedDataset(LargeRowSource(8), tmp_path / "c")
    ds.warmup()
    assert puts and all(kinds == ["stacked", "stacked"] for kinds in puts)
    assert ds.verify() == 8
    assert_equal(ds[3], LargeRowSource(8)[3])


def test_rows_of_the_wrong_size_are_refused_before_a_byte_is_written(tmp_path):
    from sources import LargeRowSource

    ds = nbkit.CachedDataset(LargeRowSource(4), tmp_path / "c")
    before = ds.store.columns[0][1].copy()
    with pytest.raises(ValueError, match="rows for 1 indices"):
        ds.store.write_rows(0, np.array([1]), fmt.Rows([]))
    with pytest.raises(ValueError, match="a row of 12 bytes for column 0"):
        ds.store.write_rows(0, np.array([1]), fmt.Rows([np.zeros(3, np.float32)]))
    assert np.array_equal(ds.store.columns[0][1], before)
