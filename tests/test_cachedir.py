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
