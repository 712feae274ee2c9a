"""A byte budget (max_bytes): only what fits is cached; the choice is stable and evenly spread."""

import os

import numpy as np
import pytest
from torch.utils.data import DataLoader

import nbkit
from sources import CountingSource, DictSource, TupleSource, assert_equal

ROW = 8 * 8 * 4 + 8  # image row + label row, bytes


def budget_for(n, fraction):
    return int(n * 24 + fraction * n * ROW)


def test_budget_caches_the_fraction_that_fits(tmp_path):
    n = 1000
    ds = nbkit.CachedDataset(TupleSource(n), tmp_path, max_bytes=budget_for(n, 0.25))
    report = ds.warmup()
    s = ds.stats
    assert s.capacity == 250 and s.cached == 250 and s.complete and s.budgeted
    assert report.computed == 250 and report.total == 250
    assert os.path.getsize(tmp_path / "col-0.bin") == 250 * 8 * 8 * 4
    assert "budget: 250 samples" in str(s)


def test_every_read_is_correct_and_hit_rate_equals_the_fraction(tmp_path):
    n = 2000
    src = TupleSource(n)
    ds = nbkit.CachedDataset(src, tmp_path, max_bytes=budget_for(n, 0.5))
    ds.warmup()
    ds.reset_stats()
    for collate_fn in (nbkit.collate, None):
        for x, y in DataLoader(ds, batch_size=128, shuffle=True, collate_fn=collate_fn):
            pass
    assert abs(ds.stats.hit_rate - 0.5) < 1e-9
    for i in (0, 1, 2, 3, n - 1):
        assert_equal(ds[i], src[i])
    batch = ds.__getitems__(list(range(50)))
    for i in range(50):
        assert_equal(batch[i], src[i])


def test_admitted_set_is_stable_across_sessions_and_spread_out(tmp_path):
    n = 1000
    logs = tmp_path / "logs"
    logs.mkdir()
    a = nbkit.CachedDataset(TupleSource(n), tmp_path / "c", max_bytes=budget_for(n, 0.3))
    a.warmup()
    stored_a = set(np.flatnonzero(a.store.is_stored(np.arange(n))))
    b = nbkit.CachedDataset(CountingSource(n, str(logs)), tmp_path / "c2", max_bytes=budget_for(n, 0.3))
    b.warmup()
    stored_b = set(np.flatnonzero(b.store.is_stored(np.arange(n))))
    assert stored_a == stored_b  # the same subset in another session / cache
    # spread over the whole index range, not a prefix
    first_half = sum(1 for i in stored_a if i < n // 2)
    assert 100 < first_half < 200
    reopened = nbkit.CachedDataset(TupleSource(n), tmp_path / "c", max_bytes=budget_for(n, 0.3))
    assert reopened.warmup().computed == 0


def test_open_without_source_names_the_budget(tmp_path):
    n = 100
    ds = nbkit.CachedDataset(TupleSource(n), tmp_path, max_bytes=budget_for(n, 0.2))
    ds.warmup()
    opened = nbkit.CachedDataset.open(tmp_path)
    outside = int(np.flatnonzero(~opened.store.admitted(np.arange(n)))[0])
    with pytest.raises(nbkit.MissingSampleError, match="byte budget"):
        opened[outside]


def test_a_different_budget_is_a_stale_cache(tmp_path):
    nbkit.CachedDataset(TupleSource(100), tmp_path, max_bytes=budget_for(100, 0.2))
    with pytest.raises(nbkit.StaleCacheError, match="byte budget"):
        nbkit.CachedDataset(TupleSource(100), tmp_path, max_bytes=budget_for(100, 0.5))
    nbkit.CachedDataset(TupleSource(100), tmp_path)  # no budget given: take the cache as it is


def test_budget_with_variable_length_samples(tmp_path):
    src = DictSource(200)
    ds = nbkit.CachedDataset(src, tmp_path, max_bytes=200 * 24 + 60 * 400)
    ds.warmup()
    assert 0 < ds.stats.capacity < 200
    for i in range(0, 200, 17):
        assert_equal(ds[i], src[i])


def test_zero_budget_caches_nothing(tmp_path):
    src = TupleSource(50)
    ds = nbkit.CachedDataset(src, tmp_path, max_bytes=0)
    assert ds.warmup().computed == 0 and ds.stats.capacity == 0
    assert_equal(ds[3], src[3])
    with pytest.raises(ValueError, match="max_bytes"):
        nbkit.CachedDataset(src, tmp_path / "x", max_bytes=-1)


def test_mixed_batches_collate_like_the_source(tmp_path):
    from torch.utils.data import default_collate

    from sources import BareTensorSource, CollatableDictSource

    for make, row in ((BareTensorSource, 2 * 3 * 4), (TupleSource, ROW)):
        src = make(200)
        ds = nbkit.CachedDataset(src, tmp_path / make.__name__, max_bytes=200 * 24 + 80 * row)
        ds.warmup()
        idx = list(range(0, 200, 3))
        assert_equal(nbkit.collate(ds.__getitems__(idx)), default_collate([src[i] for i in idx]))
        assert_equal(default_collate(list(ds.__getitems__(idx))), default_collate([src[i] for i in idx]))
    src = CollatableDictSource(60)  # has var leaves: served sample by sample, still right
    ds = nbkit.CachedDataset(src, tmp_path / "dict", max_bytes=60 * 24 + 20 * 600)
    ds.warmup()
    assert_equal(nbkit.collate(ds.__getitems__(list(range(60)))), default_collate([src[i] for i in range(60)]))
