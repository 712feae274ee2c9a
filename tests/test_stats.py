"""Shared counters: rows per process, totals across processes, reset, and the Stats snapshot."""

import multiprocessing as mp
import pickle

import torch

import nbkit
from nbkit.stats import EpochCounter, EpochStats, SharedCounters, Stats


def _count(counters, n):
    for _ in range(n):
        counters.add(hits=1)
    counters.add(misses=2)


def test_counts_from_other_processes_add_up():
    c = SharedCounters.create()
    c.add(hits=5)
    procs = [mp.get_context("spawn").Process(target=_count, args=(c, 100)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert c.totals()["hits"] == 305 and c.totals()["misses"] == 6


def test_reset_and_pickle():
    c = SharedCounters.create()
    c.add(hits=3, stored=4)
    c.reset()
    c.add(hits=1)
    assert c.totals() == {"hits": 1, "misses": 0, "recomputed": 0, "stored": 0, "refused": 0}
    clone = pickle.loads(pickle.dumps(c))
    clone.add(misses=1)
    assert c.totals()["misses"] == 1


def test_stats_snapshot_text():
    s = Stats(hits=3, misses=1, recomputed=0, stored=4, cached=4, total=8, bytes=2**20)
    assert s.hit_rate == 0.75 and not s.complete and s.reads == 4
    assert "cached 4/8 (50.0%)" in str(s) and "hit rate 75.0%" in str(s) and str(s).endswith(", 1.0 MB of sample data")
    assert Stats(0, 0, 0, 0, 0, 1, 0).hit_rate == 0.0


def test_stats_right_after_a_warmup_say_nothing_was_read_yet(tmp_path):
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tmp_path / "c")
    ds.warmup()
    text = str(ds.stats)
    assert text.startswith("cached 8/8 (100.0%), no samples read yet, ") and "hit rate" not in text, text
    ds[0]
    assert "hits 1, misses 0, hit rate 100.0%" in str(ds.stats)


def test_epoch_stats_before_any_read():
    # The hit rate before the first read is 0.0 in both models (EpochStats follows Stats); reads says "none yet".
    e = EpochStats(epoch=1)
    assert e.reads == 0 and e.hit_rate == 0.0 and e.rate == 0.0 and not e.filling


class _FakeDataset:
    """Anything with .stats: counters a test sets by hand."""

    def __init__(self):
        self.hits = self.misses = 0

    @property
    def stats(self):
        return Stats(hits=self.hits, misses=self.misses, recomputed=0, stored=0, cached=0, total=10, bytes=0)


def test_epoch_counter_counts_per_epoch_and_survives_a_reset():
    ds = _FakeDataset()
    ds.hits, ds.misses = 5, 5  # reads before the counter existed are not counted
    ticks = iter(range(100))
    counter = EpochCounter(ds, clock=lambda: float(next(ticks)))
    assert counter.new_epoch() is None and len(counter.epochs) == 1  # nothing read yet: harmless
    ds.misses += 10
    closed = counter.new_epoch()
    assert (closed.epoch, closed.hits, closed.misses, closed.filling) == (1, 0, 10, True) and closed.seconds > 0
    ds.hits += 10
    assert counter.count() is counter.current and (counter.current.hits, counter.current.hit_rate) == (10, 1.0)
    ds.hits, ds.misses = 4, 0  # ds.reset_stats(), then 4 more reads
    counter.count()
    assert [(e.epoch, e.hits, e.misses) for e in counter.epochs] == [(1, 0, 10), (2, 4, 0)]
    overall = counter.overall()
    assert (overall.epoch, overall.hits, overall.misses, overall.hit_rate) == (0, 4, 10, 4 / 14)


def test_tracked_passes_count_consumed_batches_and_the_reads_beyond_them():
    import torch

    ds = _FakeDataset()

    class Loader:
        """Two batches a pass; reading each one ahead of handing it out, as workers do."""

        def __len__(self):
            return 2

        def __iter__(self):
            for n in (3, 2):
                ds.hits += n + 1  # the batch, and one sample read ahead
                yield torch.zeros(n, 4), torch.arange(n)

    counter = EpochCounter(ds)
    got = [len(y) for _, y in counter.track(Loader(), steps=3)]
    assert got == [3, 2, 3]
    e1, e2 = counter.epochs
    assert (e1.samples, e1.reads, e1.read_ahead, e1.batches, e1.planned, e1.cut_short) == (5, 7, 2, 2, 2, False)
    assert (e2.samples, e2.reads, e2.read_ahead, e2.batches, e2.cut_short) == (3, 4, 1, 1, True)
    assert counter.overall().samples == 8 and not counter.running
    ds.hits += 100  # reads after a tracked pass ended belong to no epoch of it
    assert counter.count().reads == 4
