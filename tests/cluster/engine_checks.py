"""The checks every cluster engine passes (tests/cluster/test_ray.py and test_dask.py run them on a real
local cluster of 2 workers)."""

import os
import signal
import threading
import time

import pytest

import engine_calls


def results_come_back(engine):
    futures = [engine.submit(engine_calls.square, i) for i in range(6)]
    assert [f.result(timeout=120) for f in futures] == [i * i for i in range(6)]
    assert engine.workers == 2


def calls_run_in_other_processes(engine):
    pids = {f.result(timeout=120) for f in [engine.submit(engine_calls.pid) for _ in range(4)]}
    assert os.getpid() not in pids


def killed_worker_call_completes(engine, tmp_path):
    """The worker running a call is SIGKILLed mid-call: the engine runs the call again elsewhere and
    the future completes (a naive engine leaves it failed or hanging)."""
    folder = tmp_path / "pids"
    folder.mkdir()
    fut = engine.submit(engine_calls.hold_once, str(folder), 120)
    deadline = time.monotonic() + 120
    while not os.listdir(folder):
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.05)
    victim = int(os.listdir(folder)[0])
    assert victim != os.getpid()
    os.kill(victim, signal.SIGKILL)
    status, ran_on = fut.result(timeout=120)
    assert status == "done" and ran_on != victim
    assert len(os.listdir(folder)) == 2  # run twice: the killed copy and the retry


def cancel_stops_outstanding_calls(engine):
    futures = [engine.submit(engine_calls.sleep, 60) for _ in range(4)]  # 2 run, 2 queue
    time.sleep(1.0)
    start = time.monotonic()
    engine.cancel(futures)
    assert all(f.cancelled() for f in futures)
    assert time.monotonic() - start < 10
    # the workers are free again (a running call was stopped, not left to sleep its 60 s)
    after = [engine.submit(engine_calls.square, 7) for _ in range(2)]
    assert [f.result(timeout=30) for f in after] == [49, 49]


def unpicklable_call_names_the_factory_form(engine):
    with pytest.raises(TypeError) as info:
        engine.submit(engine_calls.square, threading.Lock()).result(timeout=60)
    text = str(info.value)
    assert "does not pickle" in text and "lock" in text
    assert "factory" in text and "module-level function" in text


def the_source_goes_to_each_worker_once(engine, tmp_path):
    """Engine.share: the parts of a build carry only the source's token, and the cache is exact; a
    second build on the same engine gets its own source."""
    import nbkit
    from buildsources import Named, check_cache

    ds = nbkit.CachedDataset(Named(64), str(tmp_path / "cache"))
    sent = []
    submit = engine.submit

    def recording(fn, spec):
        sent.append(spec["source"])
        return submit(fn, spec)

    engine.submit = recording
    try:
        report = nbkit.cluster.run(ds, engine, part_size=8)
    finally:
        del engine.submit
    assert report.computed == 64 and len(sent) == 8
    assert all(kind == "shared" and payload is None for kind, _, payload in sent)  # no part carries the pickled source
    ds.close()
    check_cache(ds.root, Named(64))
    other = nbkit.CachedDataset(Named(32), str(tmp_path / "other"))
    assert nbkit.cluster.run(other, engine, part_size=8).computed == 32
    other.close()
    check_cache(other.root, Named(32))
