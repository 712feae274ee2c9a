"""nbkit.cluster.run on a gs:// cache (the GCS emulator): parts built by local workers, uploaded beside
the cache and composed server-side; and the storage failing under a build, remote and local."""

import json
import os
import threading
import time

import numpy as np
import pytest

import nbkit
from nbkit.cluster import LocalEngine, run
from nbkit.cluster.compose import parts_url
from nbkit.cluster import driver
from nbkit.cluster.driver import RETRIES, STRATEGIES, strategy_for
from nbkit.cluster.part import build_part, parts_dir

from buildsources import Flagged, Named, same
from fixtures_gcs import gcs, gcs_emulator, gcs_server, short_gcsfs_retries
from test_compose import Wire


def check_remote(url, storage_options, src):
    """Every sample of the gs:// cache equals ``src``'s: pulled (verify()) and read through."""
    with nbkit.CachedDataset.open(url, storage_options=storage_options) as pulled:
        assert pulled.verify() == len(src)
        got = pulled.__getitems__(list(range(len(src))))
        assert all(same(got[i], src[i]) for i in range(len(src)))
    with nbkit.CachedDataset.open(url, local_max_bytes=1 << 20, storage_options=storage_options) as through:
        assert all(same(through[i], src[i]) for i in range(len(src)))


def test_the_strategy_follows_where_the_cache_lives(tmp_path):
    local = nbkit.CachedDataset(Named(4), str(tmp_path / "c"))
    assert strategy_for(local) == "local" and set(STRATEGIES) == {"local", "compose"}
    local.close()


def test_a_gs_cache_built_by_local_workers_is_composed_without_sample_bytes_through_the_driver(gcs, monkeypatch):
    n, url = 100, f"{gcs.url}/caches/named"
    src = Named(n)
    ds = nbkit.CachedDataset(src, url, storage_options=gcs.storage_options)
    wire = Wire(monkeypatch)  # this process's requests only: the workers are other processes
    cb = nbkit.Callback()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        report = run(ds, engine, part_size=32, callback=cb)
    assert (report.computed, report.parts, report.total, report.stopped) == (n, 4, n, False)
    assert (cb.value, cb.size) == (n, n)
    ds.close()
    assert not gcs.fs.exists(parts_url(url))  # the parts went once composed
    monkeypatch.undo()  # stop counting: what follows is the test's own reading
    sample_bytes = sent = 0
    for method, path, name, kwargs, out, got in wire.objects():  # what the driver moved: JSON and the index
        base = name.rsplit("/", 1)[-1]
        if base.startswith("col-") or base == "heap.bin":
            assert kwargs.get("alt") != "media" and "upload" not in path and "uploadType" not in kwargs, (method, path, name)
            assert got < 4096 and out < 4096  # an object's JSON description, never its bytes
        sent += out
    sample_bytes = sum(gcs.fs.size(f"{url}/{n}") for n in ("col-0.bin", "heap.bin"))
    assert sent < n * 24 + 64 * 1024 < sample_bytes + 64 * 1024
    check_remote(url, gcs.storage_options, src)


def test_the_endpoint_killed_mid_build_stops_it_with_the_fix_and_a_rerun_keeps_the_uploaded_parts(
        gcs_emulator, short_gcsfs_retries, tmp_path):
    n, flag = 96, str(tmp_path / "flag")
    bucket = gcs_emulator.make_bucket()
    url, opts = f"{bucket.url}/caches/killed", gcs_emulator.storage_options
    src = Flagged(n, flag, at=40)  # the part [32, 64) waits at 40 until flag.go exists
    ds = nbkit.CachedDataset(src, url, storage_options=opts)
    fs = bucket.fs
    first = f"{parts_url(url)}/part-0000000000000-0000000000032/nbkit.json"

    def kill_once_a_part_is_up():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (os.path.exists(flag) and fs.exists(first)):
            time.sleep(0.05)
        gcs_emulator.kill()
        open(flag + ".go", "w").close()

    killer = threading.Thread(target=kill_once_a_part_is_up, daemon=True)
    killer.start()
    t0 = time.monotonic()
    with LocalEngine(2, multiprocessing_context="fork") as engine, pytest.raises(OSError) as got:
        run(ds, engine, part_size=32)
    killer.join(10)
    notes = "".join(getattr(got.value, "__notes__", []))
    assert "cannot reach" in str(got.value) and gcs_emulator.endpoint.split("//")[1] in str(got.value)  # classified
    assert f"{RETRIES + 1} times" in notes and "finished parts are kept" in notes, notes
    assert time.monotonic() - t0 < 60
    gcs_emulator.start()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        again = run(ds, engine, part_size=32)
    assert again.reused >= 32 and again.reused + again.computed == n and not again.stopped  # uploaded parts kept
    ds.close()
    check_remote(url, opts, Named(n))


def _build_part_noting_storage_errors(spec):
    """``build_part``, touching ``$NBKIT_TEST_FAILED_FLAG`` when the storage failed under the part."""
    out = build_part(spec)
    if out.get("storage_error") is not None:
        open(os.environ["NBKIT_TEST_FAILED_FLAG"], "a").close()
    return out


def test_a_local_part_directory_that_cannot_be_written_is_retried_then_stops_the_build(tmp_path, monkeypatch):
    src = Named(64)
    ds = nbkit.CachedDataset(src, str(tmp_path / "cache"))
    blocker = parts_dir(ds.root)
    with open(blocker, "w") as f:  # a file where the parts directory goes: every part write fails
        f.write("in the way")
    with LocalEngine(2) as engine, pytest.raises(OSError) as got:
        run(ds, engine, part_size=16)
    assert blocker in str(got.value) or blocker in str(getattr(got.value, "filename", ""))
    assert "finished parts are kept" in "".join(getattr(got.value, "__notes__", []))
    assert len(ds.missing()) == 64  # nothing half-written

    failed = tmp_path / "a part failed"
    monkeypatch.setenv("NBKIT_TEST_FAILED_FLAG", str(failed))
    monkeypatch.setattr(driver, "build_part", _build_part_noting_storage_errors)  # the forked workers call it

    def unblock_after_the_first_failure():  # not after a fixed time: a loaded machine starts the workers later
        deadline = time.monotonic() + 60
        while not failed.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.remove(blocker)

    threading.Thread(target=unblock_after_the_first_failure, daemon=True).start()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        report = run(ds, engine, part_size=16)  # the storage came back between two tries: the build finishes
    assert report.retried >= 1 and report.computed == 64 and not report.stopped
    assert ds.verify() == 64 and not os.path.exists(blocker)
    ds.close()


def test_gs_shards_each_upload_their_parts_and_the_last_composes(gcs):
    n, url = 64, f"{gcs.url}/caches/sharded"
    ds = nbkit.CachedDataset(Named(n), url, storage_options=gcs.storage_options)
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        first = run(ds, engine, part_size=16, shard=(0, 2))
        assert first.computed == 32 and not gcs.fs.exists(f"{url}/nbkit.json")  # the other shard's parts are missing
        second = run(ds, engine, part_size=16, shard=(1, 2))
    assert second.computed == 32 and gcs.fs.exists(f"{url}/nbkit.json")
    ds.close()
    check_remote(url, gcs.storage_options, Named(n))


@pytest.mark.parametrize("damage", ["sample bytes", "index", "another cache"])
def test_a_damaged_uploaded_part_is_refused_removed_and_built_again(gcs, damage):
    n, url = 64, f"{gcs.url}/caches/damaged-{damage.replace(' ', '-')}"
    src = Named(n)
    ds = nbkit.CachedDataset(src, url, storage_options=gcs.storage_options)
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        first = run(ds, engine, part_size=16, shard=(0, 2))  # uploads [0, 16) and [32, 48); no compose yet
    assert first.computed == 32 and not gcs.fs.exists(f"{url}/nbkit.json")
    part = f"{parts_url(url)}/part-0000000000032-0000000000048"
    if damage == "sample bytes":  # same size, other bytes: only reading them shows it (after compose)
        raw = bytearray(gcs.fs.cat_file(f"{part}/heap.bin"))
        raw[len(raw) // 2] ^= 0xFF
        gcs.fs.pipe_file(f"{part}/heap.bin", bytes(raw))
    elif damage == "index":
        gcs.fs.pipe_file(f"{part}/index.bin", b"\0" * 10)
    else:  # a whole part of another build of the cache (another generation)
        meta = json.loads(gcs.fs.cat_file(f"{part}/nbkit.json"))
        meta["part"]["cache_generation"] = "0" * 32
        gcs.fs.pipe_file(f"{part}/nbkit.json", json.dumps(meta).encode())
    gcs.fs.invalidate_cache()
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        again = run(ds, engine, part_size=16)
    assert again.refused == 1 and not again.stopped
    assert again.computed == 48 and again.reused == 16, again  # the damaged part was built again, the whole one kept
    ds.close()
    assert not gcs.fs.exists(parts_url(url))
    check_remote(url, gcs.storage_options, src)


def test_a_part_refused_every_time_stops_the_build_with_the_reason(gcs, monkeypatch):
    from nbkit.cluster import compose as compose_module
    from nbkit.cluster.part import PartRefused

    def always_refused(url, **kwargs):
        raise PartRefused("part-0000000000000-0000000000016 differs", bounds=(0, 16))

    monkeypatch.setattr(compose_module, "compose", always_refused)
    url = f"{gcs.url}/caches/refused"
    ds = nbkit.CachedDataset(Named(32), url, storage_options=gcs.storage_options)
    with LocalEngine(2, multiprocessing_context="fork") as engine, pytest.raises(PartRefused) as got:
        run(ds, engine, part_size=16)
    assert f"refused {RETRIES + 1} times" in "".join(got.value.__notes__)
    ds.close()


def test_a_worker_killed_at_each_request_of_its_upload_leaves_the_part_absent_or_whole(gcs, tmp_path):
    """A real process builds one part of a gs:// cache and is killed (os._exit(137)) before its k-th
    request to the endpoint, for every request of the build: the part is there whole (its nbkit.json,
    written last) or not there at all for the build (no nbkit.json: not listed, overwritten by the
    next copy), and a rerun of the build composes a cache equal to the source."""
    import pickle
    import subprocess
    import sys

    from nbkit.cluster.compose import check_uploaded
    from nbkit.cluster.driver import ComposeParts, _source, _spec
    from nbkit.cluster.part import remote_parts
    from nbkit.cluster.plan import PlannedPart
    from nbkit.progress import as_callback

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(here)), here]))
    n = 48
    src = Named(n)

    def attempt(name, k):
        url = f"{gcs.url}/caches/{name}"
        ds = nbkit.CachedDataset(src, url, storage_options=gcs.storage_options)
        how = ComposeParts(ds, ds.store, None, as_callback(None))
        spec = _spec(PlannedPart(16, 32, np.arange(16, 32)), ds, ds.store.meta, how.spec(), _source(ds, None))
        spec_file = str(tmp_path / f"spec-{name}.pkl")
        with open(spec_file, "wb") as f:
            pickle.dump(spec, f)
        log = str(tmp_path / f"requests-{name}.jsonl")
        proc = subprocess.run([sys.executable, os.path.join(here, "killed_at_request.py"), str(k), log, "part", spec_file],
                              env=env, capture_output=True, text=True, timeout=120)
        with open(log) as f:
            requests = [json.loads(line) for line in f]
        return ds, url, proc, requests

    ds, url, proc, requests = attempt("whole", 0)
    assert proc.returncode == 0, proc.stderr
    ds.close()
    changing = [i + 1 for i, (method, _, _) in enumerate(requests) if method != "GET"]
    assert len(changing) >= 3  # index.bin, a column, nbkit.json (last: the kills below show it)
    points = range(1, len(requests) + 1) if os.environ.get("NBKIT_CRASH") == "all" else sorted(
        {1, *changing, len(requests)})  # the CI budget: every request that changes the bucket, the first and the last
    for k in points:
        ds, url, proc, _ = attempt(f"killed-{k}", k)
        assert proc.returncode == 137, (k, proc.returncode, proc.stderr[-2000:])
        gcs.fs.invalidate_cache()
        found = remote_parts(parts_url(url), gcs.storage_options)
        published = k > changing[-1]
        assert found == ([(16, 32)] if published else []), (k, found)
        if published:  # whole: it passes every check compose makes
            fs, root = gcs.fs, parts_url(url).split("://", 1)[1]
            check_uploaded(fs, root, (16, 32), ds.store.meta)
        with LocalEngine(2, multiprocessing_context="fork") as engine:
            report = run(ds, engine, part_size=16)
        assert (report.reused, report.computed, report.refused) == ((16, 32, 0) if published else (0, 48, 0)), (k, report)
        ds.close()
        assert not gcs.fs.exists(parts_url(url))
        check_remote(url, gcs.storage_options, src)


def test_the_parts_an_unfinished_gs_build_left_are_listed_and_removed(gcs):
    from concurrent.futures import ThreadPoolExecutor

    from nbkit.cluster.engine import ExecutorEngine

    n, url = 32, f"{gcs.url}/caches/unfinished"
    ds = nbkit.CachedDataset(Named(n), url, storage_options=gcs.storage_options)
    with ExecutorEngine(ThreadPoolExecutor(2), workers=2) as engine:
        run(ds, engine, part_size=8, shard=(0, 2))  # two parts uploaded, the other shard's missing: not composed
    ds.close()
    found = [c for c in nbkit.caches(f"{gcs.url}/caches", storage_options=gcs.storage_options) if not c.working_copy]
    assert [c.path for c in found] == [parts_url(url)] and found[0].leftover and "2 parts" in found[0].problem
    assert found[0].bytes > 0 and f"nbkit.remove({parts_url(url)!r})" in found[0].problem
    assert nbkit.remove(parts_url(url), storage_options=gcs.storage_options).bytes == found[0].bytes
    assert not gcs.fs.exists(parts_url(url))
    assert [c for c in nbkit.caches(f"{gcs.url}/caches", storage_options=gcs.storage_options) if not c.working_copy] == []
