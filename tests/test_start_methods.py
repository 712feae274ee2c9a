"""DataLoader workers and warmup workers over a CachedDataset under every start method (``fork``;
``spawn``, macOS's default; ``forkserver``, Python 3.14's default on Linux), and copies of a dataset
(pickle, deepcopy) that die without breaking the original's workers.

Each spawn or forkserver worker imports torch (2-5 s on a busy machine), so every test starts as
few worker sets as it can."""

import copy
import gc
import multiprocessing as mp
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import nbkit
import workers
from sources import TupleSource

METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]
N = 48


def _expected(src, indices):
    return default_collate([src[i] for i in indices])


def _check_epoch(loader, src):
    seen = 0
    for x, y in loader:
        start = seen
        want_x, want_y = _expected(src, range(start, start + len(y)))
        assert torch.equal(x, want_x) and torch.equal(y, want_y), f"batch from sample {start}"
        seen += len(y)
    assert seen == len(src)


def _copies_die(ds):
    """Copy the dataset both ways in this process and let the copies be collected."""
    copies = [pickle.loads(pickle.dumps(ds)), copy.deepcopy(ds)]
    assert all(c[1][1] == ds[1][1] for c in copies)
    del copies
    gc.collect()


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_copy_that_dies_never_breaks_the_originals_workers(tmp_path, how):
    src = TupleSource(N)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    dup = pickle.loads(pickle.dumps(ds)) if how == "pickle" else copy.deepcopy(ds)
    _check_epoch(DataLoader(dup, batch_size=8, num_workers=2, collate_fn=nbkit.collate), src)  # the copy works too
    del dup
    gc.collect()
    _check_epoch(DataLoader(ds, batch_size=8, num_workers=2), src)


@pytest.mark.parametrize("method", METHODS)
def test_dataloader_workers_under_each_start_method(tmp_path, method):
    src = TupleSource(N)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    report = ds.warmup(num_workers=2, chunk_size=12, multiprocessing_context=method)
    assert (report.computed, report.stopped) == (N, False) and ds.verify() == N
    _copies_die(ds)
    with pytest.warns(UserWarning, match="pin_memory") if not torch.cuda.is_available() else _nothing():
        default = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=method, pin_memory=True,
                             persistent_workers=True)
        for _ in range(2):  # the same workers serve the second epoch
            _check_epoch(default, src)
    ours = DataLoader(ds, batch_size=8, num_workers=1, multiprocessing_context=method, collate_fn=nbkit.collate)
    _check_epoch(ours, src)


@pytest.mark.parametrize("method", METHODS)
def test_cacheloader_inside_getitem_under_each_start_method(tmp_path, method):
    keyed = workers.KeyedDataset(str(tmp_path / "kv"), n=16)
    loader = DataLoader(keyed, batch_size=4, num_workers=2, multiprocessing_context=method, persistent_workers=True)
    for _ in range(2):  # misses stored by the workers, then hits
        got = list(loader)
        x = torch.cat([b[0] for b in got])
        assert torch.equal(x, torch.stack([workers.image(i) for i in range(16)]))
    assert len(nbkit.CacheLoader(str(tmp_path / "kv"))) == 16


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("method", METHODS)
def test_large_rows_stored_by_workers_under_each_start_method(tmp_path, method):
    """Rows of 64 KiB or more go to the files as the samples' own arrays (format.Rows): stored by a
    warmup's workers and by DataLoader workers reading a cold cache, every sample equal to the source."""
    from sources import LargeRowSource, assert_equal

    src = LargeRowSource(16)
    warm = nbkit.CachedDataset(src, tmp_path / "warm")
    assert warm.warmup(num_workers=2, chunk_size=4, multiprocessing_context=method).computed == 16
    cold = nbkit.CachedDataset(src, tmp_path / "cold")
    loader = DataLoader(cold, batch_size=4, num_workers=2, multiprocessing_context=method, collate_fn=nbkit.collate)
    assert sum(len(batch[1]) for batch in loader) == 16
    for ds in (warm, cold):
        assert len(ds.missing()) == 0 and ds.verify() == 16
        for i in range(16):
            assert_equal(ds[i], src[i])
