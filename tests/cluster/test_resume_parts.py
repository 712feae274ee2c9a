"""A build resumed with another ``part_size`` (issue 37): the parts an earlier plan left are kept and
the missing ranges are planned around them, on a local cache and on ``gs://`` (the GCS emulator)."""

import os
import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import nbkit
from nbkit.cluster import run
from nbkit.cluster.compose import parts_url
from nbkit.cluster.engine import ExecutorEngine
from nbkit.cluster.part import build_part, list_parts, parse_part_name, parts_dir, remote_parts
from nbkit.cluster.plan import gaps, plan_around

from buildsources import Named
from fixtures_gcs import gcs, gcs_server
from test_remote_build import check_remote


def _engine():
    return ExecutorEngine(ThreadPoolExecutor(2), workers=2)


def test_plan_around_keeps_disjoint_parts_and_plans_only_what_none_holds():
    keep, drop = plan_around([(0, 16), (8, 24), (16, 32), (40, 64)])
    assert keep == [(0, 16), (16, 32), (40, 64)] and drop == [(8, 24)]
    # Aligned to the new size, cut around what is kept: no range is built twice.
    assert gaps(64, 24, keep) == [(32, 40)]
    assert gaps(100, 24, [(0, 16), (50, 60)]) == [(16, 24), (24, 48), (48, 50), (60, 72), (72, 96), (96, 100)]
    assert gaps(10, 4, []) == [(0, 4), (4, 8), (8, 10)]
    assert gaps(64, 16, [(0, 64)]) == []
    # A shard's share: only the given ranges' aligned keys.
    assert gaps(64, 16, [(0, 8)], keys=[0, 32]) == [(8, 16), (32, 48)]


def test_a_gs_build_resumed_with_another_part_size_finishes(gcs):
    n, url = 64, f"{gcs.url}/caches/resized"
    ds = nbkit.CachedDataset(Named(n), url, storage_options=gcs.storage_options)
    with _engine() as engine:
        first = run(ds, engine, part_size=16, shard=(0, 2))  # [0, 16) and [32, 48) uploaded, not composed
        assert first.computed == 32 and remote_parts(parts_url(url), gcs.storage_options) == [(0, 16), (32, 48)]
        again = run(ds, engine, part_size=24)  # another plan: [0, 24), [24, 48), [48, 64)
    assert (again.reused, again.computed, again.stopped) == (32, 32, False)  # nothing it had is built again
    assert gcs.fs.exists(f"{url}/nbkit.json") and not gcs.fs.exists(parts_url(url))
    ds.close()
    check_remote(url, gcs.storage_options, Named(n))


def test_gs_parts_of_two_plans_that_overlap_are_cut_to_one_and_the_build_finishes(gcs):
    n, url = 48, f"{gcs.url}/caches/overlap"
    ds = nbkit.CachedDataset(Named(n), url, storage_options=gcs.storage_options)
    upload = {"url": parts_url(url), "storage_options": gcs.storage_options}
    for start, stop in [(0, 16), (0, 24), (8, 40)]:  # three plans' parts (two drivers' at once, a resumed one)
        assert build_part(dict(cache=ds.root, parts=None, upload=upload, start=start, stop=stop, todo=np.arange(start, stop),
                               meta=ds.store.meta, source=("pickled", f"t{start}", pickle.dumps(ds))))["kept"]
    assert remote_parts(parts_url(url), gcs.storage_options) == [(0, 16), (0, 24), (8, 40)]
    with _engine() as engine:
        again = run(ds, engine, part_size=16)
    # [0, 16) kept, [0, 24) and [8, 40) removed (each overlaps it), [16, 32), [32, 48) built
    assert (again.reused, again.computed, again.refused, again.stopped) == (16, 32, 0, False)
    ds.close()
    check_remote(url, gcs.storage_options, Named(n))


def test_a_local_build_resumed_with_another_part_size_finishes(tmp_path):
    n = 64
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "c"))
    parts = parts_dir(ds.root)
    for start, stop in [(0, 16), (32, 48), (8, 40)]:  # two earlier plans' parts, one overlapping both
        build_part(dict(cache=ds.root, parts=parts, start=start, stop=stop, todo=np.arange(start, stop),
                        meta=ds.store.meta, source=("pickled", f"t{start}", pickle.dumps(ds))))
    with _engine() as engine:
        report = run(ds, engine, part_size=24)
    assert report.computed + report.reused == n and not report.stopped and report.refused == 0
    assert ds.verify() == n and not os.path.exists(parts)
    got = ds.__getitems__(list(range(n)))
    src = Named(n)
    assert all(str(got[i][2]) == src[i][2] for i in range(n))
    ds.close()


def test_a_local_plan_leaves_out_the_ranges_another_driver_has_built(tmp_path):
    n = 64
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "c"))
    parts = parts_dir(ds.root)
    # Another driver of part size 24 built [24, 48): it merges it; this driver (size 16) plans around it.
    build_part(dict(cache=ds.root, parts=parts, start=24, stop=48, todo=np.arange(24, 48), meta=ds.store.meta,
                    source=("pickled", "other", pickle.dumps(ds))))
    from nbkit.cluster.driver import LocalMerge

    how = LocalMerge(ds, ds.store, _engine(), nbkit.Callback())
    planned = [(p.start, p.stop) for p in how.plan(16, None)]
    assert planned == [(0, 16), (16, 24), (48, 64)], planned
    assert [parse_part_name(os.path.basename(p)) for p in list_parts(parts)] == [(24, 48)]
    ds.close()
