"""Several processes on one cache, and processes killed mid-write: nothing torn, nothing lost."""

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import torch
import pytest
from torch.utils.data import DataLoader

import nbkit
import workers
from fixtures_redis import redis_server, redis_url
from sources import CountingSource, TupleSource, VarShapeSource, assert_equal, check_complete_and_equal, computed_counts

CTX = mp.get_context("spawn")


def test_four_processes_create_and_warm_one_cache_at_once(tmp_path):
    n = 600
    path, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    barrier = CTX.Barrier(4)
    procs = [CTX.Process(target=workers.warm, args=(str(path), n, str(logs), 0.0, barrier)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    check_complete_and_equal(path, n)
    assert set(computed_counts(logs)) == set(range(n))


def test_sharded_warmup_computes_each_sample_once(tmp_path):
    n = 400
    path, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    barrier = CTX.Barrier(4)
    procs = [CTX.Process(target=workers.warm_shard, args=(str(path), n, str(logs), r, 4, barrier)) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    counts = computed_counts(logs)
    # Construction reads a few probe samples; warmup itself computes every sample exactly once.
    probes = {0, n // 2, n - 1}
    assert all(counts[i] == 1 for i in range(n) if i not in probes)
    assert set(counts) == set(range(n))
    check_complete_and_equal(path, n)


def test_readers_never_see_a_torn_sample_while_others_fill(tmp_path):
    n = 2000
    path, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    nbkit.CachedDataset(CountingSource(n, str(logs)), path)
    writers = [CTX.Process(target=workers.warm, args=(str(path), n, str(logs), 0.0)) for _ in range(2)]
    results = CTX.Queue()
    readers = [CTX.Process(target=workers.read_while_filling, args=(str(path), n, str(logs), 40, results)) for _ in range(2)]
    for p in writers + readers:
        p.start()
    for p in writers + readers:
        p.join(180)
        assert p.exitcode == 0, "a reader saw a wrong sample or a writer failed"
    assert results.get(timeout=5) == results.get(timeout=5) == 40 * 32
    check_complete_and_equal(path, n)


def test_sigkill_mid_warmup_then_resume(tmp_path):
    n = 3000
    path, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    proc = CTX.Process(target=workers.warm, args=(str(path), n, str(logs), 0.002))
    proc.start()
    deadline = time.time() + 60
    index = path / "index.bin"
    while time.time() < deadline:
        if (path / "nbkit.json").exists() and index.exists():
            state = np.fromfile(index, dtype=np.uint8)[::24]
            if 200 < np.count_nonzero(state) < n - 500:
                break
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    assert proc.exitcode == -signal.SIGKILL
    ds = nbkit.CachedDataset.open(path)
    cached_before = ds.stats.cached
    assert 0 < cached_before < n
    assert ds.verify() == cached_before  # whatever is marked stored is whole
    resumed = nbkit.CachedDataset(CountingSource(n, str(logs)), path)
    report = resumed.warmup()
    assert report.skipped == cached_before and report.computed == n - cached_before
    check_complete_and_equal(path, n)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_stats_from_dataloader_workers_reach_the_main_process(tmp_path, context):
    n = 512
    ds = nbkit.CachedDataset(TupleSource(n), tmp_path)
    loader = DataLoader(ds, batch_size=64, shuffle=True, num_workers=2, collate_fn=nbkit.collate,
                        multiprocessing_context=context)
    seen = sum(len(y) for _, y in loader)  # first epoch: every read misses and fills
    assert seen == n
    s = ds.stats
    assert (s.hits, s.misses, s.cached) == (0, n, n)
    ds.reset_stats()
    for _ in loader:
        pass
    s = ds.stats
    assert (s.hits, s.misses) == (n, 0) and s.hit_rate == 1.0


def test_processes_appending_variable_length_samples_at_once(tmp_path):
    from sources import VarShapeSource

    n = 300
    path = tmp_path / "cache"
    barrier = CTX.Barrier(3)
    procs = [CTX.Process(target=workers.warm_var, args=(str(path), n, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ds = nbkit.CachedDataset.open(path)
    assert ds.is_complete and ds.verify() == n
    src = VarShapeSource(n)
    for i in range(n):
        assert_equal(ds[i], src[i], f"sample {i}")


# -- one generation: a handle made before a rebuild elsewhere never writes into it ----------------


def _served_from(path, n, shift):
    """How many samples of the cache at ``path`` equal ``ShiftedSource(n, shift)``'s."""
    ds = nbkit.CachedDataset.open(path)
    src = workers.ShiftedSource(n, shift)
    batch = ds.__getitems__(list(range(n)))
    return sum(bool(torch.equal(batch[i][0], src[i][0])) for i in range(n))


def test_a_handle_made_before_an_overwrite_in_another_process_refuses_to_fill_the_rebuilt_cache(tmp_path):
    n, path = 200, str(tmp_path / "cache")
    old = nbkit.CachedDataset(workers.ShiftedSource(n, 0), path)
    p = CTX.Process(target=workers.overwrite, args=(path, n, 1000))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    with pytest.raises(nbkit.StaleCacheError, match="rebuilt .*overwrite=True.*Open it again"):
        old.warmup()
    with pytest.raises(nbkit.StaleCacheError, match=path):
        old.warmup(num_workers=2, chunk_size=50)
    with pytest.raises(nbkit.StaleCacheError):
        old[3]
    assert _served_from(path, n, 1000) == n  # nothing of the old source got in


def test_a_handle_whose_store_is_open_refuses_to_write_after_an_overwrite_by_another_handle(tmp_path):
    n, path = 60, tmp_path / "cache"
    old = nbkit.CachedDataset(workers.ShiftedSource(n, 0), path)
    old[0]  # its store is open and mapped
    new = nbkit.CachedDataset(workers.ShiftedSource(n, 7), path, overwrite=True)
    with pytest.raises(nbkit.StaleCacheError, match="rebuilt"):
        old.warmup()
    new.warmup()
    assert _served_from(path, n, 7) == n
    reader = nbkit.CachedDataset.open(path)
    nbkit.CachedDataset(workers.ShiftedSource(n, 9), path, overwrite=True)
    with pytest.raises(nbkit.StaleCacheError):  # read-only handles notice at open (and reads at most 1 s later)
        reader[1]


def test_a_handle_stays_valid_while_the_cache_is_only_reopened_or_replaced_by_a_copy_of_itself(tmp_path):
    n, path = 40, tmp_path / "cache"
    ds = nbkit.CachedDataset(workers.ShiftedSource(n, 0), path)
    ds[:10]
    again = nbkit.CachedDataset(workers.ShiftedSource(n, 0), path)  # same source, no overwrite: same cache
    again.warmup()
    nbkit.export_tar(path, tmp_path / "c.tar")
    nbkit.import_tar(tmp_path / "c.tar", path)  # the same build, swapped into place
    ds.warmup()
    assert ds.verify() == n and _served_from(path, n, 0) == n


def test_a_cache_made_before_generation_ids_still_opens_and_still_notices_a_rebuild(tmp_path):
    import json

    n, path = 40, tmp_path / "cache"
    nbkit.CachedDataset(workers.ShiftedSource(n, 0), path)[:5]
    meta_path = path / "nbkit.json"
    meta = json.loads(meta_path.read_text())
    assert len(meta.pop("generation")) == 32
    meta_path.write_text(json.dumps(meta))
    old = nbkit.CachedDataset(workers.ShiftedSource(n, 0), path)
    old.warmup()
    assert old.verify() == n
    nbkit.CachedDataset(workers.ShiftedSource(n, 3), path, overwrite=True)
    with pytest.raises(nbkit.StaleCacheError):
        old.warmup()


def test_a_redis_handle_made_before_an_overwrite_refuses_the_rebuilt_cache(redis_url):
    n = 40
    old = nbkit.CachedDataset(workers.ShiftedSource(n, 0), redis_url)
    new = nbkit.CachedDataset(workers.ShiftedSource(n, 5), redis_url, overwrite=True)
    with pytest.raises(nbkit.StaleCacheError, match="rebuilt"):
        old.warmup(num_workers=2, chunk_size=10)  # its store opens: one GET of the metadata
    new.warmup()
    got = nbkit.CachedDataset.open(redis_url).__getitems__(list(range(n)))
    src = workers.ShiftedSource(n, 5)
    assert all(torch.equal(got[i][0], src[i][0]) for i in range(n))


def test_a_generation_check_costs_one_stat_per_write(tmp_path):
    ds = nbkit.CachedDataset(workers.ShiftedSource(64, 0), tmp_path / "cache")
    ds[0]
    t0 = time.perf_counter()
    for _ in range(2000):
        ds.check_generation()
    per_check = (time.perf_counter() - t0) / 2000
    assert per_check < 200e-6, f"{per_check * 1e6:.1f} µs per check"


# -- a lock on a cache's file held by another process for good: never a wait without end ----------------


def _held_by_another(path, shared=False):
    """``path`` flocked through a descriptor of its own (another open file, as another process's)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
    return fd


@pytest.mark.parametrize("name,what", [("index.bin", "store"), ("heap.lock", "store blobs"), ("nbkit.json", "open")])
def test_a_cache_file_locked_for_good_by_another_process_is_an_error_that_says_how_to_find_it(tmp_path, monkeypatch, name, what):
    from nbkit.errors import LockHeldError

    monkeypatch.setattr(nbkit.commit, "LOCK_SECONDS", 0.3)
    path = str(tmp_path / "cache")
    src = VarShapeSource(8)  # varying shapes: every sample appends a blob to the heap (heap.lock)
    nbkit.CachedDataset(src, path).close()
    lock = os.path.join(path, name)
    if not os.path.exists(lock):
        open(lock, "w").close()
    fd = _held_by_another(lock)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockHeldError, match=rf"{name} has been locked by another process for 0.3 s.*fuser -v"):
            ds = nbkit.CachedDataset(src, path)
            ds.warmup()
        assert time.monotonic() - t0 < 5
    finally:
        os.close(fd)
    ds = nbkit.CachedDataset(src, path)  # released: it goes on where it stopped
    ds.warmup()
    assert len(ds.missing()) == 0 and ds.verify() == 8
    assert all(torch.equal(ds[i][0], src[i][0]) for i in range(8))
    ds.close()


def test_a_push_waits_for_a_put_in_flight_but_not_for_a_lock_held_for_good(tmp_path, monkeypatch):
    from nbkit.cachedir import frozen
    from nbkit.errors import LockHeldError

    monkeypatch.setattr(nbkit.commit, "LOCK_SECONDS", 0.3)
    path = str(tmp_path / "cache")
    ds = nbkit.CachedDataset(TupleSource(8), path)
    ds.warmup()
    fd = _held_by_another(os.path.join(path, "index.bin"), shared=True)  # a writer that never finishes its put
    try:
        with pytest.raises(LockHeldError, match="index.bin has been locked"):
            with frozen(ds.root):
                pass
    finally:
        os.close(fd)
    with frozen(ds.root):  # released: the push goes ahead
        pass
    ds.close()
