"""nbkit.build.run on a gs:// cache (the GCS emulator): parts built by local workers, uploaded beside
the cache and composed server-side; and the storage failing under a build, remote and local."""

import os
import threading
import time

import pytest

import nbkit
from nbkit.build import LocalEngine, run
from nbkit.build.compose import parts_url
from nbkit.build.driver import RETRIES, STRATEGIES, strategy_for
from nbkit.build.part import parts_dir

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


def test_a_local_part_directory_that_cannot_be_written_is_retried_then_stops_the_build(tmp_path):
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

    def unblock_after_the_first_failure():
        time.sleep(0.3)
        os.remove(blocker)

    threading.Thread(target=unblock_after_the_first_failure, daemon=True).start()
    with LocalEngine(2) as engine:
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
