"""The build driver with real engines and real faults: killed workers, damaged parts, a killed driver, two drivers."""

import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import multiprocessing as mp
import numpy as np
import pytest
import torch

import nbkit
from nbkit import cli
from nbkit.cluster import LocalEngine, run
from nbkit.cluster.engine import ExecutorEngine
from nbkit.cluster.part import build_part, list_parts, parts_dir
from nbkit.progress import Callback

from buildsources import Flagged, Named, Unpicklable, check_cache, make_named, same
from fixtures_gcs import gcs, gcs_server

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]


def threads(n=2):
    return ExecutorEngine(ThreadPoolExecutor(n), workers=n, name="threads")


def _heap_of_a_plain_warmup(tmp_path, n):
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "plain"))
    ds.warmup()
    ds.close()
    return os.path.getsize(str(tmp_path / "plain" / "heap.bin"))


@pytest.mark.parametrize("method", METHODS)
def test_local_engine_builds_the_cache(tmp_path, method):
    n = 150
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "cache"))
    ds.compute_and_store(np.arange(10, 20))  # partly filled already
    cb = Callback()
    with LocalEngine(2, multiprocessing_context=method) as engine:
        report = run(ds, engine, part_size=32, callback=cb)
    assert (report.computed, report.skipped, report.total, report.parts, report.stopped) == (140, 10, n, 5, False)
    assert (cb.value, cb.size, cb.description) == (n, n, "done")
    assert not os.path.exists(parts_dir(ds.root))
    ds.close()
    check_cache(ds.root, Named(n))
    assert cli.main(["info", ds.root]) == 0 and cli.main(["verify", ds.root]) == 0
    assert os.path.getsize(os.path.join(ds.root, "heap.bin")) == _heap_of_a_plain_warmup(tmp_path, n)  # each blob once


def test_a_killed_worker_loses_only_its_part(tmp_path):
    n, flag = 96, str(tmp_path / "flag")
    ds = nbkit.CachedDataset(Flagged(n, flag, at=40), str(tmp_path / "cache"))
    killed = []

    def killer():
        while not os.path.exists(flag):
            time.sleep(0.02)
        with open(flag) as f:
            pid = int(f.read())
        assert pid > 0 and pid != os.getpid()
        os.kill(pid, signal.SIGKILL)  # a real worker process, mid-part
        killed.append(pid)
        open(flag + ".go", "w").close()

    t = threading.Thread(target=killer)
    t.start()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        report = run(ds, engine, part_size=16)
    t.join()
    assert killed and report.retried >= 1 and not report.stopped
    ds.close()
    check_cache(ds.root, Named(n))
    assert not os.path.exists(parts_dir(ds.root))  # the killed build's staging directory was swept


@pytest.mark.parametrize("damage", ["crc", "schema"])
def test_a_bad_part_is_refused_and_recomputed(tmp_path, damage):
    n = 64
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "cache"))
    if damage == "crc":
        out = build_part(dict(cache=ds.root, parts=parts_dir(ds.root), start=16, stop=32, todo=np.arange(16, 32),
                              meta=ds.store.meta, source=("pickled", "t", pickle.dumps(ds))))
        with open(os.path.join(parts_dir(ds.root), out["name"], "col-0.bin"), "r+b") as f:
            f.seek(7)
            f.write(b"\x7f")
    else:
        other = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.zeros(n, 2)), str(tmp_path / "other"))
        build_part(dict(cache=other.root, parts=parts_dir(ds.root), start=16, stop=32, todo=np.arange(16, 32),
                        meta=dict(other.store.meta, generation=ds.store.meta["generation"]),
                        source=("pickled", "t", pickle.dumps(other))))
        other.close()
    with threads() as engine:
        report = run(ds, engine, part_size=16)
    assert report.refused == 1 and report.computed == n and report.reused == 0
    ds.close()
    check_cache(ds.root, Named(n))


def test_parts_left_by_a_stopped_build_are_merged_not_recomputed(tmp_path):
    n = 64
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "cache"))
    cb = Callback()
    engine = threads(1)
    real = engine.submit

    def submit(fn, spec):
        f = real(fn, spec)
        f.add_done_callback(lambda _: cb.request_stop())  # Stop as soon as one part is built
        return f
    engine.submit = submit
    first = run(ds, engine, part_size=16, callback=cb)
    engine.close()
    assert first.stopped and first.computed + len(list_parts(parts_dir(ds.root))) * 16 <= n
    with threads() as engine2:
        second = run(ds, engine2, part_size=16)
    assert first.computed + second.computed + second.reused == n and not second.stopped
    ds.close()
    check_cache(ds.root, Named(n))


def test_a_part_left_by_another_run_is_reused(tmp_path):
    n = 48
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "cache"))
    build_part(dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=16, todo=np.arange(16), meta=ds.store.meta,
                    source=("pickled", "t", pickle.dumps(ds))))
    with threads() as engine:
        report = run(ds, engine, part_size=16)
    assert (report.reused, report.computed, report.parts) == (16, 32, 3)
    ds.close()
    check_cache(ds.root, Named(n))


def test_the_driver_killed_mid_merge_then_rerun(tmp_path):
    n, path = 64, str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "driver_script.py"), path, str(n), "0", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 137, proc.stderr
    left = list_parts(parts_dir(path))
    assert left  # the part being merged is still there
    with nbkit.CachedDataset.open(path) as half:  # the cache is whole: stored samples are correct, others missing
        assert half.verify() == n - len(half.missing()) and len(half.missing()) > 0
    ds = nbkit.CachedDataset(Named(n), path)
    with threads() as engine:
        report = run(ds, engine, part_size=16)
    assert report.reused > 0 and not report.stopped
    ds.close()
    check_cache(path, Named(n))


def test_two_drivers_at_once_never_merge_twice(tmp_path):
    n, path = 96, str(tmp_path / "cache")
    nbkit.CachedDataset(Named(n), path).close()  # created once, so both drivers open the same generation
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "driver_script.py"), path, str(n), "0.01"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, BUILD_BARRIER=str(barrier))) for _ in range(2)]
    deadline = time.monotonic() + 120
    while len(os.listdir(barrier)) < 2 and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.02)
    (barrier / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    merged = [tuple(map(int, o[0].split())) for o in outs]
    assert sum(c + r for c, r in merged) == n, merged  # each sample merged by exactly one of them
    check_cache(path, Named(n))
    # Two drivers that plan at the same instant may both build a range: each places its blobs in the
    # heap, one copy is linked (the cache exact), the other's bytes stay unreferenced (at most once more).
    plain = _heap_of_a_plain_warmup(tmp_path, n)
    assert plain <= os.path.getsize(os.path.join(path, "heap.bin")) <= 2 * plain


def test_an_unpicklable_source_says_which_and_shows_the_factory(tmp_path):
    ds = nbkit.CachedDataset(Unpicklable(20), str(tmp_path / "cache"))
    with threads() as engine, pytest.raises(TypeError, match="Unpicklable does not pickle.*factory=make_source"):
        run(ds, engine)
    ds.close()
    ds = nbkit.CachedDataset(make_named(), str(tmp_path / "f"))
    with LocalEngine(1, multiprocessing_context="fork") as engine:
        report = run(ds, engine, part_size=32, factory=make_named)
    assert report.computed == 64
    ds.close()
    check_cache(ds.root, make_named())


class Failing(Named):
    def __getitem__(self, i):
        if i == 30:
            raise ValueError("bad sample 30")
        return super().__getitem__(i)


def test_a_source_error_ends_the_build_and_keeps_what_was_merged(tmp_path):
    ds = nbkit.CachedDataset(Failing(64), str(tmp_path / "cache"))
    with threads(1) as engine, pytest.raises(ValueError, match="bad sample 30") as e:
        run(ds, engine, part_size=16)
    assert "built the part [16, 32)" in "".join(getattr(e.value, "__notes__", []))
    assert 0 not in ds.missing() and ds.verify() >= 16
    ds.close()


def test_a_remote_or_sourceless_cache_is_refused(tmp_path):
    ds = nbkit.CachedDataset(Named(8), str(tmp_path / "c"))
    ds.close()
    with nbkit.CachedDataset.open(str(tmp_path / "c")) as opened, threads() as engine:
        with pytest.raises(ValueError, match="without its source"):
            run(opened, engine)


# -- warmup's needs: shards, unhashed local parts, writing_into ----------------------------------------


def test_shards_build_disjoint_whole_parts_and_together_the_cache(tmp_path):
    n = 100
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "cache"))
    with threads() as engine:
        first = run(ds, engine, part_size=16, shard=(0, 2))
        assert (first.computed, first.total, first.parts) == (52, 52, 4)  # parts 0, 2, 4, 6: [0,16) … [96,100)
        assert set(ds.missing().tolist()) == {i for i in range(n) if (i // 16) % 2 == 1}
        second = run(ds, engine, part_size=16, shard=(1, 2))
    assert (second.computed, second.skipped) == (48, 0)
    ds.close()
    check_cache(ds.root, Named(n))


def test_parts_of_local_workers_carry_no_sha256_and_are_still_checked(tmp_path):
    from nbkit.cluster.part import PartRefused, read_part

    ds = nbkit.CachedDataset(Named(32), str(tmp_path / "cache"))
    spec = dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=16, todo=np.arange(16), meta=ds.store.meta,
                source=("pickled", "t", pickle.dumps(ds)), hashes=False)
    path = os.path.join(parts_dir(ds.root), build_part(spec)["name"])
    read_part(path, ds.store.meta, hashes=False).close()
    with pytest.raises(PartRefused, match="no SHA-256 for"):  # a driver that hashes never takes it unhashed
        read_part(path, ds.store.meta)
    with open(os.path.join(path, "col-0.bin"), "r+b") as f:
        f.seek(7)
        f.write(b"\x7f")
    with pytest.raises(PartRefused, match="fail their checksum"):  # unhashed, a damaged byte is still found
        read_part(path, ds.store.meta, hashes=False)
    ds.close()


def test_writing_into_leaves_the_cache_untouched(tmp_path):
    from nbkit.cluster.part import PartStore, part_meta

    ds = nbkit.CachedDataset(Named(20), str(tmp_path / "cache"))
    ds.compute_and_store(np.array([0]))
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "heap.bin").touch()  # as a part build makes it: CacheFiles makes it only for a published cache
    part = PartStore(str(tmp_path / "p"), part_meta(ds.store.meta, 8, 16), 8, writable=True, create=True)
    with ds.writing_into(part):
        ds.compute_and_store(np.arange(8, 12))
        with pytest.raises(RuntimeError, match="already writing"):
            with ds.writing_into(part):
                pass
    assert part.state.tolist()[:5] == [1, 1, 1, 1, 0]
    assert ds.missing().tolist() == list(range(1, 20)) and same(ds[0], Named(20)[0])  # its own store again
    part.close()
    ds.close()


def test_a_stuck_worker_shows_before_its_part_ends(tmp_path, monkeypatch):
    from nbkit import progress

    monkeypatch.setattr(progress, "OVERDUE_SECONDS", 1.0)
    n, flag = 64, str(tmp_path / "flag")
    ds = nbkit.CachedDataset(Flagged(n, flag, at=40), str(tmp_path / "cache"))  # the part [32, 48) hangs at 40
    seen = []

    class Watch(Callback):
        def call(self, *args, **kwargs):
            if self.workers is not None:
                seen.append(self.workers.text())

    def release_once_shown():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("the oldest for" in t for t in seen):
            time.sleep(0.05)
        open(flag + ".go", "w").close()

    t = threading.Thread(target=release_once_shown)
    t.start()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        report = run(ds, engine, part_size=16, callback=Watch())
    t.join()
    stuck = [s for s in seen if "the oldest for" in s]
    assert stuck and re.search(r"\d+ parts? out, the oldest for \d", stuck[0]), seen[-5:]
    assert report.computed == n and not report.stopped
    ds.close()


@pytest.fixture
def ctrl_c_live():
    """SIGINT with Python's own handler, as in an interactive Python, a terminal or a notebook: a suite
    run as a background job of a script (CI's .ci/run) starts with SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_cancels_the_parts_out_keeps_the_finished_ones_and_raises(tmp_path, ctrl_c_live):
    n, flag = 64, str(tmp_path / "flag")
    ds = nbkit.CachedDataset(Flagged(n, flag, at=40), str(tmp_path / "cache"))  # the part [32, 48) hangs at 40
    cb = Callback()

    def interrupt_once_the_rest_is_built():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and cb.value < n - 16:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)  # as a terminal's Ctrl-C or a notebook's interrupt button

    t = threading.Thread(target=interrupt_once_the_rest_is_built)
    t.start()
    started = time.monotonic()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        with pytest.raises(KeyboardInterrupt):
            run(ds, engine, part_size=16, callback=cb)
        assert engine.processes() == []  # the worker stuck in the source was ended, not waited for
    t.join()
    assert time.monotonic() - started < 60
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own handler is back
    assert ds.missing().tolist() == list(range(32, 48))  # every finished part joined the cache
    assert ds.verify() == n - 16
    src = Named(n)
    assert all(same(ds[i], src[i]) for i in [*range(32), *range(48, n)])
    ds.close()


def test_a_second_ctrl_c_raises_at_once(ctrl_c_live):
    from nbkit.cluster.driver import _Interrupt

    with _Interrupt() as interrupt:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert interrupt.hit  # the first is noted, for the loop to act on
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# -- what run() takes, how many parts it keeps out, what its progress counts (issue 37) ----------------


def test_run_takes_an_engine_name_and_closes_the_engine_it_made(tmp_path, monkeypatch):
    from nbkit.cluster import engine as engine_module

    made = []

    def processes(num_workers=None):
        made.append(LocalEngine(1, multiprocessing_context="fork"))
        return made[-1]

    monkeypatch.setattr(engine_module, "_factory", lambda name: processes)
    ds = nbkit.CachedDataset(Named(32), str(tmp_path / "cache"))
    report = run(ds, "processes", part_size=16)
    assert report.computed == 32 and len(made) == 1 and made[0]._pool is None  # made for the build, closed after it
    ds.close()
    check_cache(ds.root, Named(32))


@pytest.mark.parametrize("engine, error, says", [
    ("spark", ValueError, r"unknown engine 'spark': use one of 'processes', 'ray', 'dask', an Engine, or an executor"),
    (42, TypeError, r"engine must be a name \('processes', 'ray', 'dask'\), an Engine or an executor, not int"),
])
def test_run_says_what_it_takes_for_an_engine_it_does_not_know(tmp_path, engine, error, says):
    ds = nbkit.CachedDataset(Named(8), str(tmp_path / "cache"))
    with pytest.raises(error, match=says):  # was: AttributeError: 'str' object has no attribute 'share'
        run(ds, engine)
    assert len(ds.missing()) == 8
    ds.close()


def test_the_driver_keeps_two_parts_a_worker_out_as_the_docs_say(tmp_path):
    from nbkit.cluster.driver import AHEAD

    out, most, lock = [0], [0], threading.Lock()
    engine = threads(2)
    submit = engine.submit

    def counting(fn, spec):
        with lock:
            out[0] += 1
            most[0] = max(most[0], out[0])

        def done(_):
            with lock:
                out[0] -= 1
        f = submit(fn, spec)
        f.add_done_callback(done)
        return f

    engine.submit = counting
    ds = nbkit.CachedDataset(Named(160, delay=0.005), str(tmp_path / "cache"))
    with engine:
        run(ds, engine, part_size=8)
    ds.close()
    assert AHEAD == 2 and most[0] == AHEAD * engine.workers == 4
    guide = open(os.path.join(HERE, "..", "..", "docs", "build.md")).read()
    assert "keeps 2 × `engine.workers` parts submitted" in guide  # the guide said `engine.workers`


def test_gs_progress_counts_only_what_is_composed_and_never_goes_back(gcs):
    """A part compose refuses at the end (damaged after its upload) used to take its samples back
    off the count (400 -> 350 on a real build): an upload is not a merge."""
    from nbkit.cluster.compose import parts_url

    n, url = 64, f"{gcs.url}/caches/progress"
    ds = nbkit.CachedDataset(Named(n), url, storage_options=gcs.storage_options)
    with threads() as engine:
        first = run(ds, engine, part_size=16, shard=(0, 2))  # uploads [0, 16) and [32, 48); no compose yet
    assert first.computed == 32
    part = f"{parts_url(url)}/part-0000000000032-0000000000048"
    raw = bytearray(gcs.fs.cat_file(f"{part}/heap.bin"))
    raw[len(raw) // 2] ^= 0xFF  # same size, other bytes: only the read after compose finds it
    gcs.fs.pipe_file(f"{part}/heap.bin", bytes(raw))
    gcs.fs.invalidate_cache()

    class Seen(Callback):
        values: list = []

        def call(self, *args, **kwargs):
            Seen.values.append(self.value)

    Seen.values = []
    cb = Seen()
    with threads() as engine:
        again = run(ds, engine, part_size=16, callback=cb)
    assert again.refused == 1 and not again.stopped and again.computed + again.reused == n
    values = [v for v in Seen.values if v is not None]
    assert values == sorted(values), values  # never backwards
    assert set(values) == {0, n} and cb.value == n  # nothing counted before compose published the cache
    ds.close()


def test_a_part_gone_before_its_merge_is_built_again_and_the_build_ends_whole(tmp_path, monkeypatch):
    """Issue 37: a part removed between its build and its merge (another driver refused it, someone cleaned
    the directory) was counted as "merged by another driver", and the build said done with its samples
    missing. Now its samples are planned again, and the end of a build looks once more for what is missing."""
    from nbkit.cluster import driver
    from nbkit.cluster.part import remove_part

    removed = []
    real = driver.merge

    def first_merge_finds_it_gone(store, path, **kwargs):
        if not removed:
            removed.append(path)
            remove_part(path)
        return real(store, path, **kwargs)

    monkeypatch.setattr(driver, "merge", first_merge_finds_it_gone)
    ds = nbkit.CachedDataset(Named(48), str(tmp_path / "cache"))
    report = run(ds, threads(), part_size=16)
    assert removed and report.computed == 48 and not report.stopped
    assert len(ds.missing()) == 0
    ds.close()
    check_cache(ds.root, Named(48))


def test_parts_a_stop_merges_count_in_the_workers_table(tmp_path):
    """A part whose call ended while the Stop was handled is merged by the salvage: its worker's row
    counts it, so the table's samples add up to the samples computed (the panel's table after Stop)."""
    n = 64
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "cache"))
    cb = Callback()
    engine = threads(1)
    real, submitted = engine.submit, []

    def submit(fn, spec):
        submitted.append(real(fn, spec))
        return submitted[-1]
    engine.submit = submit
    plain = cb.should_stop

    def should_stop():  # Stop once the second part's call has ended, before the loop has seen it
        if len(submitted) >= 2:
            submitted[1].result()
            return True
        return plain()
    cb.should_stop = should_stop
    report = run(ds, engine, part_size=16, callback=cb)
    engine.close()
    assert report.stopped and report.computed >= 32
    assert sum(r.samples for r in cb.workers.rows) == report.computed
    assert sum(r.parts for r in cb.workers.rows) == report.parts
    ds.close()
