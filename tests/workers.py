"""Process entry points for the concurrency tests (importable by spawned processes)."""

import random

import nbkit
from sources import CountingSource, TupleSource, assert_equal


def warm(path, n, log_dir, delay, barrier=None):
    if barrier is not None:
        barrier.wait()  # every process creates the cache at the same moment
    ds = nbkit.CachedDataset(CountingSource(n, log_dir, delay=delay), path)
    ds.warmup(chunk_size=16)


def warm_shard(path, n, log_dir, rank, world, barrier):
    ds = nbkit.CachedDataset(CountingSource(n, log_dir), path)
    barrier.wait()
    ds.warmup(shard=(rank, world), chunk_size=8)


def read_while_filling(path, n, log_dir, rounds, result):
    src = TupleSource(n)
    ds = nbkit.CachedDataset(CountingSource(n, log_dir), path)
    rng = random.Random(0)
    checked = 0
    for _ in range(rounds):
        idx = rng.sample(range(n), 32)
        batch = ds.__getitems__(idx)
        for j, i in enumerate(idx):
            assert_equal(batch[j], src[i], f"sample {i}")
            checked += 1
    result.put(checked)


def warm_var(path, n, barrier):
    from sources import VarShapeSource

    barrier.wait()
    nbkit.CachedDataset(VarShapeSource(n), path).warmup(chunk_size=7)
