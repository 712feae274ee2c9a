"""nbkit.cluster.warmup (``ds.warmup()``): every missing sample once, in this process or in workers; a stop
or a crash keeps what was stored, and the next warmup resumes from there."""

import multiprocessing as mp
import os
import signal

import pytest

import nbkit
import workers
from sources import CountingSource, TupleSource, VarShapeSource, assert_equal, check_complete_and_equal, computed_counts

CTX = mp.get_context("spawn")


def test_parallel_warmup_in_worker_processes(tmp_path):
    n = 1000
    logs = tmp_path / "logs"
    logs.mkdir()
    ds = nbkit.CachedDataset(CountingSource(n, str(logs)), tmp_path / "c")
    report = ds.warmup(num_workers=2, chunk_size=50)
    assert report.computed == n and not report.stopped
    assert len([f for f in os.listdir(logs)]) >= 2  # work really ran in other processes
    check_complete_and_equal(tmp_path / "c", n)
    assert ds.stats.stored == n


def test_warmup_stops_on_request_and_resumes(tmp_path):
    n = 1000

    class StopAfter(nbkit.Callback):
        def call(self, *args, **kwargs):
            if self.value >= 300:
                self.request_stop()

    ds = nbkit.CachedDataset(TupleSource(n), tmp_path)
    cb = StopAfter()
    first = ds.warmup(callback=cb, chunk_size=100)
    assert first.stopped and first.computed == 300 and cb.description == "stopped"
    second = ds.warmup(callback=nbkit.Callback())
    assert not second.stopped and second.skipped == 300 and second.computed == 700
    assert ds.is_complete


def test_warmup_reports_progress(tmp_path):
    cb = nbkit.Callback()
    ds = nbkit.CachedDataset(TupleSource(250), tmp_path)
    ds[0], ds[1]
    ds.warmup(callback=cb, chunk_size=100)
    assert (cb.size, cb.value, cb.description) == (250, 250, "done")


def test_source_errors_name_the_sample(tmp_path):
    class Broken(TupleSource):
        def __getitem__(self, i):
            if i == 77:
                raise RuntimeError("bad file")
            return super().__getitem__(i)

    ds = nbkit.CachedDataset(Broken(100), tmp_path)
    with pytest.raises(RuntimeError, match="bad file") as e:
        ds.warmup()
    assert any("sample 77" in note for note in getattr(e.value, "__notes__", ["sample 77"]))
    assert ds.stats.cached < 100


@pytest.mark.parametrize("stop_by", ["callback", "signal"])
def test_stop_ends_a_warmup_whose_workers_are_stuck_in_the_source(tmp_path, stop_by):
    path = str(tmp_path / "cache")
    result = CTX.Queue()
    p = CTX.Process(target=workers.warm_stuck, args=(path, result, stop_by))
    p.start()
    try:
        kind, asked = result.get(timeout=120)
        assert kind == "asked"
        if stop_by == "signal":
            os.kill(p.pid, signal.SIGINT)
        outcome = result.get(timeout=15)  # the old warmup blocked in DataLoader's next() for the source's 600 s
    finally:
        if p.is_alive():
            p.join(10)
        if p.is_alive():
            p.kill()
    took = outcome[-1] - asked
    assert took < 5, f"the warmup took {took:.1f} s to stop"
    if stop_by == "callback":
        assert outcome[:3] == ("report", 32, True)
    else:
        assert outcome[0] == "interrupted"
    p.join(10)
    assert p.exitcode == 0
    ds = nbkit.CachedDataset.open(path)
    assert ds.verify() == ds.stats.cached >= 32  # whatever the killed workers left is whole
    assert len(ds.missing()) == 64 - ds.stats.cached


def test_a_worker_error_or_crash_reaches_the_caller_and_keeps_what_was_stored(tmp_path):
    ds = nbkit.CachedDataset(workers.FailingSource(40, bad=30), tmp_path / "a", fingerprint_samples=0)
    with pytest.raises(ValueError, match="bad sample 30") as got:
        ds.warmup(num_workers=2, chunk_size=5)
    if hasattr(got.value, "add_note"):  # Python 3.11+
        assert any("warmup worker" in note for note in got.value.__notes__)
    assert ds.verify() == ds.stats.cached >= 5
    crash = nbkit.CachedDataset(workers.FailingSource(40, bad=30, crash=True), tmp_path / "b", fingerprint_samples=0)
    with pytest.raises(RuntimeError, match="warmup worker .* exited with code 9"):
        crash.warmup(num_workers=2, chunk_size=5)
    assert crash.verify() == crash.stats.cached


# -- parallel and serial fill the same cache -------------------------------------------------------


def test_workers_write_the_same_bytes_as_one_process(tmp_path):
    n = 300
    serial = nbkit.CachedDataset(TupleSource(n), tmp_path / "serial")
    parallel = nbkit.CachedDataset(TupleSource(n), tmp_path / "parallel")
    assert serial.warmup(num_workers=0, chunk_size=32).computed == n
    assert parallel.warmup(num_workers=2, chunk_size=32).computed == n
    data = sorted(f for f in os.listdir(tmp_path / "serial") if f.endswith(".bin"))
    assert data and data == sorted(f for f in os.listdir(tmp_path / "parallel") if f.endswith(".bin"))
    for name in data:  # the column files and the index: byte for byte
        assert (tmp_path / "serial" / name).read_bytes() == (tmp_path / "parallel" / name).read_bytes(), name


def test_workers_and_one_process_read_back_the_same_free_form_samples(tmp_path):
    src = VarShapeSource()
    serial = nbkit.CachedDataset(src, tmp_path / "serial")
    parallel = nbkit.CachedDataset(src, tmp_path / "parallel")
    serial.warmup(num_workers=0, chunk_size=3)
    parallel.warmup(num_workers=2, chunk_size=3)
    every = list(range(len(src)))
    for i, (a, b) in enumerate(zip(nbkit.CachedDataset.open(tmp_path / "serial").__getitems__(every),
                                   nbkit.CachedDataset.open(tmp_path / "parallel").__getitems__(every))):
        assert_equal(a, b, f"sample {i}")
        assert_equal(a, src[i], f"sample {i}")


# -- resume ----------------------------------------------------------------------------------------


def test_a_parallel_warmup_stopped_then_resumed_computes_only_what_is_missing(tmp_path):
    n = 600
    logs = tmp_path / "logs"
    logs.mkdir()

    class StopAfter(nbkit.Callback):
        def call(self, *args, **kwargs):
            if self.value >= 200:
                self.request_stop()

    ds = nbkit.CachedDataset(CountingSource(n, str(logs)), tmp_path / "c")
    first = ds.warmup(num_workers=2, chunk_size=50, callback=StopAfter())
    assert first.stopped and 200 <= first.computed < n
    stored = ds.stats.cached
    reopened = nbkit.CachedDataset.open(tmp_path / "c")
    assert reopened.verify() == stored  # whatever a stop left is whole
    missing = {int(i) for i in reopened.missing()}
    assert len(missing) == n - stored
    before = computed_counts(logs)
    second = nbkit.CachedDataset(CountingSource(n, str(logs)), tmp_path / "c").warmup(num_workers=2, chunk_size=50)
    assert not second.stopped and second.skipped == stored and second.computed == n - stored
    after = computed_counts(logs)
    # The resumed warmup computed the missing samples only: a stored one is never computed again
    # (beyond the fingerprint's probes, read when the dataset is made).
    probes = {0, n // 2, n - 1}
    again = {i for i in after if after[i] > before.get(i, 0) and i not in probes}
    assert again == missing - probes
    check_complete_and_equal(tmp_path / "c", n)


# -- a crashed worker ------------------------------------------------------------------------------


def test_a_crashed_worker_says_what_happened_and_what_to_do_and_a_rerun_resumes(tmp_path):
    path = tmp_path / "c"
    crash = nbkit.CachedDataset(workers.FailingSource(40, bad=30, crash=True), path, fingerprint_samples=0)
    with pytest.raises(RuntimeError) as got:
        crash.warmup(num_workers=2, chunk_size=5)
    message = str(got.value)
    assert "nbkit warmup worker" in message and "exited with code 9" in message
    assert str(path) in message  # which cache
    assert "killed (out of memory?) or crashed in the source" in message  # what may have happened
    assert "run warmup() again to resume" in message and "num_workers=0 to see the error" in message  # the fix
    stored = crash.stats.cached
    assert crash.verify() == stored
    fixed = nbkit.CachedDataset(workers.FailingSource(40, bad=-1), path, fingerprint_samples=0)  # the source mended
    report = fixed.warmup(num_workers=2, chunk_size=5)
    assert report.skipped == stored and report.computed == 40 - stored
    check_complete_and_equal(path, 40)


def test_parts_a_parallel_warmup_left_are_merged_by_the_next_warmup_in_process(tmp_path):
    from nbkit.cluster.part import parts_dir

    n = 200
    ds = nbkit.CachedDataset(workers.FailingSource(n, bad=150), tmp_path / "c", fingerprint_samples=0)
    with pytest.raises(ValueError, match="bad sample 150"):
        ds.warmup(num_workers=2, chunk_size=10)
    stored = ds.stats.cached
    fixed = nbkit.CachedDataset(workers.FailingSource(n, bad=-1), tmp_path / "c", fingerprint_samples=0)
    report = fixed.warmup(num_workers=0)
    assert report.skipped >= stored and report.computed + report.skipped == n
    assert not os.path.exists(parts_dir(str(tmp_path / "c")))  # whatever was left is merged, nothing stays
    check_complete_and_equal(tmp_path / "c", n)


@pytest.mark.parametrize("n,workers,size,count", [(6000, 2, 375, 16), (60000, 2, 1000, 60), (5000, 3, 256, 20)])
def test_a_parallel_warmup_cuts_as_many_parts_of_one_size_for_every_worker(tmp_path, monkeypatch, n, workers, size, count):
    import nbkit.cluster.driver as driver

    seen = {}
    real = driver.run

    def run(cached, engine, *, part_size, **kw):
        seen["size"] = part_size
        return real(cached, engine, part_size=part_size, **kw)

    monkeypatch.setattr(driver, "run", run)
    ds = nbkit.CachedDataset(TupleSource(n, shape=(1, 2, 2)), str(tmp_path / "cache"))
    ds.warmup(num_workers=workers)
    assert seen["size"] == size and -(-n // size) == count  # (5,000 on 3: chunk_size 256 is the floor)
    assert len(ds.missing()) == 0
    ds.close()
