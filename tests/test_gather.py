"""The column gather's two paths: the copy from the memory map (rows in the page cache) and the
explicit ``preadv`` reads (rows on disk), which must return the same bytes and catch the same damage.

The path is forced with ``NBKIT_READ`` (or ``mode=``); the residency decision is checked on a file
whose pages were evicted with ``posix_fadvise(DONTNEED)``."""

import multiprocessing as mp
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import nbkit
import nbkit.gather as gather
from nbkit import format as fmt
from sources import TupleSource, flip_byte

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st


class MixedRows(Dataset):
    """Three fixed-shape columns of different row sizes (2940, 12 and 8 bytes)."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 28, 35), dtype=torch.uint8, generator=g), torch.randn(3, generator=g), i


N = 40


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixed")
    nbkit.CachedDataset(MixedRows(N), path).warmup()
    return path


def _evict(path):
    os.sync()
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@pytest.mark.fuzz
@given(st.lists(st.integers(0, N - 1), min_size=1, max_size=3 * N), st.integers(1, 5))
def test_pread_returns_the_bytes_of_the_map(mixed, indices, max_run):
    # Any index list: duplicates, unsorted, adjacent runs (cut short by a small MAX_RUN), the last row.
    store = nbkit.CachedDataset.open(mixed).store
    idx = np.array(indices, dtype=np.int64)
    old = gather.MAX_RUN
    gather.MAX_RUN = max_run
    try:
        by_read, crcs = store.gather_checked(idx, crc=True, mode="pread")
    finally:
        gather.MAX_RUN = old
    by_map, none = store.gather_checked(idx, crc=True, mode="mmap")
    assert none is None  # the map's path leaves the checksum to the caller
    for a, b in zip(by_read, by_map):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert crcs.tolist() == fmt.batch_crc(by_map, len(idx)).tolist() == store.crc_of(idx).tolist()
    store.close()


@pytest.mark.parametrize("mode", ["pread", "mmap", "auto"])
def test_every_read_path_serves_the_same_batches(mixed, mode, monkeypatch):
    monkeypatch.setenv("NBKIT_READ", mode)
    src = MixedRows(N)
    ds = nbkit.CachedDataset.open(mixed)
    idx = [N - 1, 3, 3, 4, 5, 0, 17]
    want = default_collate([src[i] for i in idx])
    for got in (nbkit.collate(ds.__getitems__(idx)), ds.read_columns(np.array(idx))):
        for g, w in zip(got, want):
            assert torch.equal(torch.as_tensor(g), w)
    batches = [b for b in ds.loader(8, device=None, shuffle=False)]
    assert torch.equal(torch.cat([b[2] for b in batches]), torch.arange(N))


def test_a_flipped_byte_is_caught_on_the_pread_path(tmp_path, monkeypatch):
    monkeypatch.setenv("NBKIT_READ", "pread")
    src = TupleSource(20)
    nbkit.CachedDataset(src, tmp_path).warmup()
    flip_byte(tmp_path / "col-0.bin", 7 * 8 * 8 * 4 + 5)  # a byte inside sample 7's image
    without = nbkit.CachedDataset.open(tmp_path)
    assert without.read_columns(np.array([6, 7])) is None  # refused: the caller takes the checking path
    with pytest.raises(nbkit.CorruptCacheError, match=r"sample 7 .*checksum"):
        without.__getitems__([6, 7])
    with_source = nbkit.CachedDataset(src, tmp_path)
    got = nbkit.collate(with_source.__getitems__([7, 8]))
    want = default_collate([src[7], src[8]])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert with_source.stats.recomputed == 1


def test_a_file_truncated_under_the_reader_is_a_clean_error(tmp_path):
    nbkit.CachedDataset(TupleSource(20), tmp_path).warmup()
    store = nbkit.CachedDataset.open(tmp_path).store
    os.truncate(tmp_path / "col-0.bin", 10 * 8 * 8 * 4 + 100)  # rows 10 and later are gone (partly, then wholly)
    ok, _ = store.gather_checked(np.array([0, 9]), mode="pread")
    assert ok[0].shape == (2, 1, 8, 8)
    for rows in ([3, 10], [19], [11, 12, 13]):
        with pytest.raises(nbkit.CorruptCacheError, match=r"col-0.bin ends at byte \d+.*truncated"):
            store.gather_checked(np.array(rows), mode="pread")
    store.close()


def test_residency_decides_the_path(tmp_path, monkeypatch):
    nbkit.CachedDataset(TupleSource(64, shape=(3, 96, 96)), tmp_path).warmup()  # 108 KiB rows
    store = nbkit.CachedDataset.open(tmp_path).store
    idx = np.arange(0, 64, 3)
    calls = []
    real = gather.read_rows
    monkeypatch.setattr(gather, "read_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    _evict(tmp_path)
    assert not gather.resident(store.columns, idx)
    store.gather_checked(idx)  # on disk: explicit reads (which also bring the pages in)
    assert calls == [1]
    store.gather_checked(idx, mode="mmap")
    assert gather.resident(store.columns, idx)
    store.gather_checked(idx)  # resident: the copy from the map, as before
    assert calls == [1]
    monkeypatch.setenv("NBKIT_READ", "pread")
    store.gather_checked(idx)
    assert calls == [1, 1]
    monkeypatch.setenv("NBKIT_READ", "mmap")
    _evict(tmp_path)
    store.gather_checked(idx)
    assert calls == [1, 1]
    monkeypatch.setenv("NBKIT_READ", "fast")
    with pytest.raises(ValueError, match="NBKIT_READ.*'fast'.*auto, mmap, pread"):
        store.gather_checked(idx)
    store.close()


def test_read_ahead_brings_rows_into_the_page_cache(tmp_path):
    nbkit.CachedDataset(TupleSource(64, shape=(3, 32, 32)), tmp_path).warmup()
    ds = nbkit.CachedDataset.open(tmp_path)
    idx = np.array([5, 40, 41, 63])
    _evict(tmp_path)
    assert not gather.resident(ds.store.columns, idx)
    ds.read_ahead(idx)
    for _ in range(200):  # WILLNEED starts the reads; they finish in the background
        if gather.resident(ds.store.columns, idx):
            break
        os.sched_yield()
        __import__("time").sleep(0.01)
    assert gather.resident(ds.store.columns, idx)


METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]


@pytest.mark.parametrize("method", METHODS)
def test_dataloader_workers_read_with_pread(tmp_path, monkeypatch, method):
    monkeypatch.setenv("NBKIT_READ", "pread")  # inherited by the workers, whatever the start method
    src = TupleSource(48)
    nbkit.CachedDataset(src, tmp_path).warmup()
    ds = nbkit.CachedDataset.open(tmp_path)
    loader = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context=method)
    seen = 0
    for x, y in loader:
        want_x, want_y = default_collate([src[i] for i in range(seen, seen + len(y))])
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
        seen += len(y)
    assert seen == 48


@pytest.mark.fuzz
@given(st.integers(1, 5), st.integers(1, 300), st.booleans())
def test_crc_rows_is_zlibs_crc32(n, width, chained):
    rows = np.random.default_rng(n * width).integers(0, 256, (n, width), dtype=np.uint8)
    start = np.arange(n, dtype=np.uint32) * 7919 if chained else None
    want = [zlib.crc32(r.tobytes(), 0 if start is None else int(start[i])) for i, r in enumerate(rows)]
    old = gather.FAST_CRC_MIN
    try:
        for limit in (0, 1 << 30):  # libdeflate (when the system has it), then zlib
            gather.FAST_CRC_MIN = limit
            assert gather.crc_rows(rows, start).tolist() == want
    finally:
        gather.FAST_CRC_MIN = old


def test_a_cache_larger_than_memory_is_always_read_with_preads(tmp_path, monkeypatch):
    nbkit.CachedDataset(TupleSource(16), tmp_path).warmup()
    monkeypatch.setattr("nbkit.cachedir.physical_memory", lambda: 1024)  # a host smaller than this cache
    store = nbkit.CachedDataset.open(tmp_path).store
    calls = []
    real = gather.read_rows
    monkeypatch.setattr(gather, "read_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, crcs = store.gather_checked(np.array([3, 1]), crc=True)  # resident, yet read with preads
    assert calls == [1] and crcs.tolist() == store.crc_of(np.array([3, 1])).tolist()
    store.gather_checked(np.array([3, 1]), mode="mmap")
    assert calls == [1]
    store.close()


def test_output_buffers_are_reused_only_once_nothing_holds_them():
    a = gather.recycled_rows(64, (3, 64, 64), np.uint8)
    address = a.ctypes.data
    a[:] = 7
    t = torch.from_numpy(a)[1:]
    view = a[2:]
    del a
    b = gather.recycled_rows(64, (3, 64, 64), np.uint8)
    assert b.ctypes.data != address and int(t[0, 0, 0, 0]) == 7
    del t, b
    c = gather.recycled_rows(64, (3, 64, 64), np.uint8)
    assert c.ctypes.data != address and int(view[0, 0, 0, 0]) == 7
    del c
    del view  # the last one freed is the next one given
    assert gather.recycled_rows(64, (3, 64, 64), np.uint8).ctypes.data == address


def test_small_rows_of_a_cache_that_fits_are_copied_from_the_map(tmp_path, monkeypatch):
    nbkit.CachedDataset(TupleSource(64), tmp_path).warmup()  # 256-byte rows
    store = nbkit.CachedDataset.open(tmp_path).store
    calls = []
    real = gather.read_rows
    monkeypatch.setattr(gather, "read_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    _evict(tmp_path)
    store.gather_checked(np.arange(0, 64, 5))
    assert calls == []
    store.gather_checked(np.arange(0, 64, 5), mode="pread")
    assert calls == [1]
    store.close()


_FORK_AFTER_GATHERS = """
import multiprocessing as mp, os, sys, tempfile, warnings
import numpy as np, torch
import nbkit
from nbkit.gather import read_rows, take_rows

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    col = np.arange(64 * 4096, dtype=np.uint8).reshape(64, 4096)
    path = os.path.join(tempfile.mkdtemp(), "col.bin"); col.tofile(path); fd = os.open(path, os.O_RDONLY)
    rows = np.arange(0, 64, 2)
    assert take_rows([col], rows, threads=2)[0].tolist() == col[rows].tolist()         # the gather pool
    assert read_rows([(fd, path)], [col], rows, threads=4)[0][0].tolist() == col[rows].tolist()  # the I/O pool
    child = mp.get_context("fork").Process(target=int); child.start(); child.join()      # a DataLoader's fork
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(64)), tempfile.mkdtemp())
    report = ds.warmup(num_workers=2, chunk_size=8, multiprocessing_context="fork")   # nbkit's own forks
    assert report.computed == 64 and take_rows([col], rows, threads=2)[0].tolist() == col[rows].tolist()
print("warnings:", [str(w.message) for w in caught if "fork" in str(w.message)])
"""


@pytest.mark.skipif("fork" not in mp.get_all_start_methods(), reason="needs the fork start method (Linux, macOS)")
def test_a_fork_after_parallel_gathers_finds_no_thread_of_ours():
    # A fresh interpreter: threads other tests left behind would make any fork warn.
    out = subprocess.run([sys.executable, "-c", _FORK_AFTER_GATHERS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "warnings: []", out.stdout


def test_one_sample_reads_take_the_row_path_and_still_check_it(tmp_path):
    src = TupleSource(20)
    nbkit.CachedDataset(src, tmp_path).warmup()
    flip_byte(tmp_path / "col-0.bin", 7 * 8 * 8 * 4 + 5)  # a byte inside sample 7's image
    without = nbkit.CachedDataset.open(tmp_path)
    for i in (6, 6, 19, -1):  # the same rows as the batch path, before and after this process checked them
        one, batch = without.read_columns(np.array([i])), without.read_columns(np.array([i, 0]))
        assert [c.shape[0] for c in one] == [1, 1] and all(np.array_equal(a[0], b[0]) for a, b in zip(one, batch))
        one[0][0] += 1  # a copy: the cache's map is untouched
    assert torch.equal(torch.as_tensor(without.read_columns(np.array([6]))[0][0]), src[6][0])
    assert without.read_columns(np.array([7])) is None  # refused: the caller takes the checking path
    with pytest.raises(nbkit.CorruptCacheError, match=r"sample 7 .*checksum"):
        without[7]
    hits = without.stats.hits
    without.read_columns(np.array([3]))
    assert without.stats.hits == hits + 1
