"""Progress callbacks: fsspec-compatible, stoppable, and a plain text line for terminals."""

import io
import os
import re
import socket
import tempfile
import threading
import time

import numpy as np
import pytest
from fsspec.callbacks import Callback as FsspecCallback

from nbkit.progress import Callback, Job, JobState, TextProgress, Workers, as_callback
from nbkit.text import format_seconds
from sources import TupleSource


def test_callback_is_an_fsspec_callback_with_a_stop_flag():
    cb = Callback()
    assert isinstance(cb, FsspecCallback)
    cb.set_size(10)
    cb.relative_update(4)
    cb.request_stop()
    assert (cb.value, cb.size, cb.stop_requested) == (4, 10, True)
    assert isinstance(as_callback(None), Callback)


def test_text_progress_prints_a_readable_line():
    out = io.StringIO()
    p = TextProgress("warmup", file=out, min_interval=0)
    p.set_size(200)
    p.relative_update(50)
    assert "50/200" in out.getvalue() and "25.0%" in out.getvalue() and "ETA" in out.getvalue()
    p.relative_update(150)
    p.close()
    assert out.getvalue().rstrip().splitlines()[-1].startswith("warmup  200/200  100.0%")


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _warmup(p, clock, n, seconds_each):
    """``n`` samples, one update each, ``seconds_each`` apart (as warmup's chunks arrive), then done and closed."""
    p.set_size(n)
    for _ in range(n):
        clock.now += seconds_each
        p.relative_update(1)
    p.set_description("done")
    p.close()


def test_text_progress_in_a_log_prints_each_tenth_and_the_end_once():
    # A 40 s warmup written to a log file: 81 lines when it printed every 0.5 s; now 0%, 10% ... 90%, 100%.
    out, clock = io.StringIO(), _Clock()
    _warmup(TextProgress("warmup", file=out, clock=clock), clock, 800, 0.05)
    lines = out.getvalue().splitlines()
    assert [line.split()[2] for line in lines] == [f"{p}.0%" for p in range(0, 101, 10)], lines
    assert "\r" not in out.getvalue()


def test_text_progress_in_a_log_prints_every_30_seconds_between_tenths():
    out, clock = io.StringIO(), _Clock()
    _warmup(TextProgress("warmup", file=out, clock=clock), clock, 100, 10.0)  # 100 s per tenth
    lines = out.getvalue().splitlines()
    # Per tenth (100 s): its first line, then one every 30 s (at 30, 60 and 90 s); then the end.
    assert len(lines) == 10 * 4 + 1, lines
    assert lines[1].startswith("warmup  3/100    3.0%") and lines[1].endswith("ETA 16m10s"), lines[1]  # the clock's rate
    assert lines[-1].startswith("warmup  100/100  100.0%") and sum("100.0%" in line for line in lines) == 1


def test_text_progress_in_a_log_ends_with_the_state_it_stopped_at():
    out, clock = io.StringIO(), _Clock()
    p = TextProgress("push", file=out, clock=clock)
    p.set_size(1000)
    p.relative_update(55)
    p.set_description("stopped")
    p.close()
    p.close()
    assert out.getvalue().splitlines()[-1].startswith("push  55/1,000    5.5%") and "stopped" in out.getvalue()
    assert len(out.getvalue().splitlines()) == 2  # 0% at the start, and where it stopped


def test_text_progress_on_a_terminal_rewrites_one_line():
    out, clock = _Terminal(), _Clock()
    _warmup(TextProgress("warmup", file=out, clock=clock, min_interval=0.5), clock, 800, 0.05)
    text = out.getvalue()
    redraws = text.count("\r")
    assert 70 <= redraws <= 81, redraws  # every 0.5 s of a 40 s warmup, as before
    assert text.endswith("\n") and text.rstrip("\n").splitlines()[-1].startswith("warmup  800/800  100.0%")


def test_format_seconds():
    assert format_seconds(3.21) == "3.2s" and format_seconds(75.2) == "1m15s" and format_seconds(7300) == "2h01m"


# -- any fsspec-style callback works with every long operation ---------------------------------------------


class _Recorder(FsspecCallback):
    """A plain fsspec callback, as a user of fsspec would write it: no set_description, no stop flag."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def call(self, *args, **kwargs):
        self.calls += 1


def test_as_callback_adapts_a_plain_fsspec_callback():
    plain = _Recorder()
    cb = as_callback(plain)
    assert isinstance(cb, Callback) and as_callback(cb) is cb
    cb.set_description("hashing")  # a no-op for the plain callback
    cb.set_size(10)
    cb.absolute_update(2)
    cb.relative_update(3)
    assert (plain.size, plain.value, cb.value, cb.moved) == (10, 5, 5, 3)
    assert plain.calls == 3 and cb.description == "hashing"
    assert cb.stop_requested is False  # fsspec answers unknown attributes with a (truthy) no-op method
    cb.request_stop()
    assert cb.stop_requested is True


def test_every_long_operation_accepts_a_plain_fsspec_callback(tmp_path):
    import torch

    import nbkit

    source = torch.utils.data.TensorDataset(torch.arange(600.0).reshape(300, 2))
    ds = nbkit.CachedDataset(source, str(tmp_path / "cache"))
    warm = _Recorder()
    report = ds.warmup(callback=warm, chunk_size=64)
    assert report.computed == 300 and not report.stopped and warm.value == 300
    assert ds.verify(callback=_Recorder()) == 300
    exported = _Recorder()
    nbkit.export_tar(ds.root, str(tmp_path / "cache.tar"), callback=exported)
    assert exported.value == exported.size > 0
    nbkit.import_tar(str(tmp_path / "cache.tar"), str(tmp_path / "restored"), callback=_Recorder())
    pushed = _Recorder()
    nbkit.push(ds.root, "memory://nbkit-progress-test/cache", callback=pushed)
    assert pushed.value == pushed.size > 0
    nbkit.pull("memory://nbkit-progress-test/cache", str(tmp_path / "pulled"), callback=_Recorder())
    for path in ("restored", "pulled"):
        assert nbkit.CachedDataset.open(str(tmp_path / path)).stats.complete


# -- Callback: phases, rate, ETA ----------------------------------------------------------------------------


def test_rate_counts_only_this_phase_and_start_phase_resets():
    cb = Callback(phase="warmup")
    cb.set_size(100)
    cb.absolute_update(40)  # already done before this operation: not speed
    assert cb.moved == 0 and cb.rate() == 0.0 and cb.eta() is None
    cb.relative_update(30)
    assert cb.moved == 30 and cb.rate() > 0 and cb.eta() > 0 and not cb.finished
    cb.relative_update(30)
    assert cb.finished
    cb.start_phase("publish", unit="bytes", size=5000)
    assert (cb.phase, cb.unit, cb.size, cb.value, cb.moved, cb.finished) == ("publish", "bytes", 5000, 0, 0, False)
    cb.absolute_update(0)
    cb.absolute_update(2500)  # later absolute updates are progress (import_tar reports this way)
    assert cb.moved == 2500


# -- Job -----------------------------------------------------------------------------------------------


def test_job_runs_in_the_background_and_keeps_its_report():
    ended = []
    release = threading.Event()

    def work(cb):
        cb.set_size(2)
        release.wait(10)
        cb.relative_update(2)
        return "report"

    job = Job("work", work, on_end=ended.append)
    assert job.state is JobState.READY and not job.running and job.wait()
    job.start()
    assert job.running and job.state is JobState.RUNNING
    assert not job.wait(timeout=0.05)
    release.set()
    assert job.wait(timeout=10)
    assert (job.state, job.report, job.error, job.callback.value) == (JobState.DONE, "report", None, 2)
    assert ended == [job] and not job.stop()
    with pytest.raises(RuntimeError, match="already started"):
        job.start()


def test_job_stop_and_error():
    def chunks(cb):
        cb.set_size(1000)
        while not cb.stop_requested:
            cb.relative_update(1)
            time.sleep(0.001)
        return None

    job = Job("chunks", chunks, callback=Callback()).start()
    while job.callback.value == 0:
        time.sleep(0.001)
    assert job.stop() and job.state in (JobState.STOPPING, JobState.STOPPED)
    assert job.wait(timeout=10) and job.state is JobState.STOPPED and job.stopped

    def fail(cb):
        raise OSError("disk on fire")

    failed = Job("fail", fail).start()
    assert failed.wait(timeout=10)
    assert failed.state is JobState.ERROR and isinstance(failed.error, OSError) and failed.report is None


def test_close_stops_the_clock_so_a_finished_operation_has_no_eta():
    from nbkit.progress import Callback

    cb = Callback()
    cb.set_size(100)
    cb.absolute_update(0)
    cb.relative_update(40)
    assert cb.eta() is not None and cb.ended is None
    cb.close()
    elapsed, rate = cb.elapsed(), cb.rate()
    assert cb.eta() is None and rate > 0
    import time

    time.sleep(0.01)
    assert (cb.elapsed(), cb.rate()) == (elapsed, rate)  # frozen at close
    cb.start_phase("publish", unit="bytes", size=10)  # a new phase runs a new clock
    assert cb.ended is None


# -- progress only moves forward: the callbacks of real operations, replayed -----------------------------


class _Replay(TextProgress):
    """A terminal meter that keeps every state it was asked to draw: (phase, unit, size, value, fraction, line)."""

    def __init__(self, label):
        super().__init__(label, file=_Terminal(), min_interval=0, unit="bytes")
        self.states = []

    def call(self, *args, **kwargs):
        self.states.append((self.phase, self.unit, self.size, self.value, self.fraction(), self.line()))
        super().call(*args, **kwargs)


def _phases(states):
    """The states grouped by phase, in order (a phase met again later counts as a new one)."""
    groups = []
    for s in states:
        if not groups or groups[-1][0] != s[0]:
            groups.append((s[0], []))
        groups[-1][1].append(s)
    return groups


def _check_forward(cb, expected):
    """Each phase in ``expected`` (``(phase, unit)``, in order) ran; within one, the value never passes the total,
    the drawn fraction never falls, and the rate is in the phase's unit; the screen ends each phase once."""
    phases = _phases(cb.states)
    assert [(name, states[0][1]) for name, states in phases if any(s[3] for s in states)] == expected, \
        [(name, states[0][1]) for name, states in phases]
    for name, states in phases:
        fractions = [s[4] for s in states if s[4] is not None]
        assert fractions == sorted(fractions) and all(0 <= f <= 1 for f in fractions), (name, fractions)
        for phase, unit, size, value, _, line in states:
            assert unit == states[0][1], (name, unit)
            assert size is None or value <= size, f"{name}: {value:,} counted against a total of {size:,} ({line})"
            rate = re.search(r"  ([0-9.,]+ ?[A-Za-z]*/s)  ", line).group(1)
            assert rate.endswith(" B/s") or rate[-4:] in ("KB/s", "MB/s", "GB/s") if unit == "bytes" \
                else rate.endswith(f" {unit}/s"), line
        last = states[-1][5]
        if states[-1][3]:  # work was done in this phase: its rate says how fast, never 0
            assert not re.search(r"  0 (B|samples)/s  ", last), last
    screen = cb.file.getvalue()
    ended = [line.rsplit("\r", 1)[-1] for line in screen.split("\n")[:-1]]  # what each finished line shows
    assert screen.endswith("\n") and len(ended) == len(expected), ended
    for (name, unit), line in zip(expected, ended):
        assert "100.0%" in line and (name == cb.label or f" {name} " in line), ended


def test_long_operations_report_each_phase_forward_in_its_own_unit(tmp_path):
    import torch

    import nbkit

    source = torch.utils.data.TensorDataset(torch.arange(6000.0).reshape(1500, 4), torch.arange(1500))
    ds = nbkit.CachedDataset(source, str(tmp_path / "cache"))
    ds.warmup()
    tar = str(tmp_path / "cache.tar")
    runs = [
        ("export", lambda cb: nbkit.export_tar(ds.root, tar, callback=cb), [("hash", "bytes"), ("export", "bytes")]),
        ("import", lambda cb: nbkit.import_tar(tar, str(tmp_path / "imported"), callback=cb),
         [("import", "bytes"), ("verify", "samples")]),
        ("push", lambda cb: nbkit.push(ds.root, str(tmp_path / "bucket"), callback=cb), [("hash", "bytes"), ("push", "bytes")]),
        ("pull", lambda cb: nbkit.pull(str(tmp_path / "bucket"), str(tmp_path / "pulled"), callback=cb),
         [("pull", "bytes"), ("verify", "samples")]),
    ]
    for label, run, expected in runs:
        cb = _Replay(label)
        report = run(cb)
        cb.close()
        assert not report.stopped
        _check_forward(cb, expected)


def test_text_progress_never_draws_a_fraction_that_falls_or_passes_the_total():
    out = _Terminal()
    p = TextProgress("bench", file=out, min_interval=0, unit="batches")
    p.relative_update(1)  # no total yet: a count, no percent
    assert "%" not in p.line() and "1 batches" in p.line()
    p.set_size(10)
    p.relative_update(4)
    assert "50.0%" in p.line()
    p.set_size(20)  # a total revised upward: the percent holds until the work catches up
    assert "50.0%" in p.line() and "5/20" in p.line()
    p.relative_update(30)  # past the total: shown as the total
    assert " 20/20  100.0%" in p.line()
    p.close()
    assert out.getvalue().count("\n") == 1


def test_text_progress_ends_each_phase_once_and_its_last_line_is_not_printed_twice():
    out = io.StringIO()  # a log
    p = TextProgress("import", file=out, unit="bytes")
    p.set_description("connecting")  # a phase with nothing done yet: no final line of its own
    p.start_phase("import", unit="bytes", size=100)
    p.relative_update(100)
    p.set_description("imported")
    p.start_phase("verify", size=3)
    p.relative_update(3)
    p.set_description("verified")
    p.close()
    p.close()
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[0:2] for line in lines if "100.0%" in line] == [["import", "100 B/100 B"], ["import verify", "3/3"]]
    assert len(lines) == len(set(lines)), lines
    term = _Terminal()
    t = TextProgress("push", file=term, min_interval=0)
    t.set_size(2)
    t.relative_update(2)
    t.set_description("pushed")
    t.close()
    # (a line shorter than the one it overwrites is padded with spaces: the rate's width varies)
    assert term.getvalue().count("\n") == 1 and term.getvalue().endswith("\n") and term.getvalue().rstrip().endswith("pushed")


# -- a build run by several workers: Workers, set_workers, and how TextProgress shows them ------------


class _SlowSource(TupleSource):
    """Each sample takes a moment, so both workers of a pool get parts."""

    def __getitem__(self, i):
        time.sleep(0.002)
        return super().__getitem__(i)


class _WorkersRecorder(Callback):
    def __init__(self):
        super().__init__()
        self.snapshots = []

    def set_workers(self, workers):
        self.snapshots.append((workers, self.value))
        super().set_workers(workers)


def test_workers_aggregate_parts_samples_and_rates_and_name_the_slowest():
    w = Workers(parts_total=5)
    assert (w.slowest, w.text()) == (None, "parts 0/5")
    w = w.record("h1:10", 100, 0.5).record("h1:11", 100, 2.0).record("h2:10", 50, 0.1)
    assert w.parts_done == 3 and [r.worker for r in w.rows] == ["h1:10", "h1:11", "h2:10"]  # host+pid: two hosts, same pid
    assert [r.rate for r in w.rows] == [200.0, 50.0, 500.0]
    assert w.slowest.worker == "h1:11" and w.text() == "parts 3/5 · 3 workers · slowest: h1:11 50/s"
    one = Workers(parts_total=2).record("h:1", 10, 1.0)
    assert one.slowest is None and one.text() == "parts 1/2 · 1 worker"  # no "slowest" of one
    assert Workers(parts_total=1).record("h:1", 0, 0.0).rows[0].rate == 0.0  # a part found already built


def test_set_workers_is_part_of_every_callback_and_of_plain_fsspec_ones():
    for cb in (Callback(), as_callback(None), as_callback(FsspecCallback())):
        assert cb.workers is None
        cb.set_workers(Workers(parts_total=3).record("h:1", 5, 1.0))
        assert cb.workers.parts_done == 1


def test_text_progress_shows_parts_workers_and_the_slowest():
    out, clock = io.StringIO(), _Clock()
    p = TextProgress("build", file=out, clock=clock)
    p.set_size(1000)
    p.set_description("building: 0 of 4 parts merged")
    p.set_workers(Workers(parts_total=4))
    clock.now = 1.0
    p.set_workers(Workers(parts_total=4).record("hostA:7", 250, 0.5).record("hostB:9", 250, 1.0))
    p.relative_update(500)
    p.close()
    last = out.getvalue().splitlines()[-1]
    assert last.startswith("build  500/1,000   50.0%  500 samples/s")
    assert last.endswith("parts 2/4 · 2 workers · slowest: hostB:9 250/s")  # the parts say what the description said
    assert "building:" not in last


def test_text_progress_fits_one_terminal_row_and_a_notebook_column(monkeypatch):
    import nbkit.progress as progress

    workers = Workers(parts_total=40).record("a-rather-long-host-name.internal:12345", 10, 1.0).record("b:1", 10, 2.0)
    monkeypatch.setenv("COLUMNS", "50")
    out, clock = _Terminal(), _Clock()
    p = TextProgress("build", file=out, clock=clock)
    p.set_size(100)
    p.set_workers(workers)
    clock.now = 1.0
    p.relative_update(20)
    p.close()
    rows = [r for line in out.getvalue().split("\n") for r in line.split("\r") if r.strip()]
    assert rows and all(len(r.rstrip()) <= 49 for r in rows), rows  # redrawn in place: never wraps
    assert rows[-1].rstrip().endswith("…")

    monkeypatch.setattr(progress, "in_kernel", lambda: True)
    out = io.StringIO()
    p = TextProgress("build", file=out, clock=clock)
    p.set_size(100)
    p.set_workers(workers)
    p.relative_update(20)
    p.close()
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 28 for line in lines if "/" not in line or " " in line), lines
    assert "slowest: b:1 5/s" in " ".join(out.getvalue().split())  # every word there, wrapped between words


def test_a_build_on_two_worker_processes_reports_each_worker_and_parts_done():
    import multiprocessing as mp

    import nbkit
    from nbkit.cluster import LocalEngine, run

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("needs fork (the source is defined in this test module)")
    n, part = 240, 30
    with tempfile.TemporaryDirectory() as d:
        ds = nbkit.CachedDataset(_SlowSource(n), d)
        ds.compute_and_store(np.arange(0, 30))  # the first part is cached already: planned parts are 7
        cb = _WorkersRecorder()
        with LocalEngine(2, multiprocessing_context="fork") as engine:
            report = run(ds, engine, part_size=part, callback=cb)
        ds.close()
    assert report.computed == n - 30 and report.parts == 7
    first, last = cb.snapshots[0][0], cb.snapshots[-1][0]
    assert (first.parts_done, first.parts_total, first.rows) == (0, 7, ())
    assert (last.parts_done, last.parts_total) == (7, 7)
    done = [s.parts_done for s, _ in cb.snapshots]
    assert [d for k, d in enumerate(done) if k == 0 or d != done[k - 1]] == list(range(8))  # each merged part, in order
    assert all(b - a in (0, 1) for a, b in zip(done, done[1:]))  # between them: the parts out, shown every second
    assert sum(r.samples for r in last.rows) == n - 30 and sum(r.parts for r in last.rows) == 7
    host = socket.gethostname()
    pids = {int(r.worker.rpartition(":")[2]) for r in last.rows}
    assert all(r.worker.startswith(host + ":") for r in last.rows) and os.getpid() not in pids  # the workers, not the driver
    assert 1 <= len(last.rows) <= 2 and all(r.rate > 0 for r in last.rows)
    if len(last.rows) == 2:
        assert last.slowest is min(last.rows, key=lambda r: r.rate)
    assert cb.workers is last
