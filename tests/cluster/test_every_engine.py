"""The same cache built by every engine (this machine's processes, a real local Dask cluster and a
real local Ray instance, 2 workers each) into a local directory and into gs:// (the GCS emulator):
every sample equals the source, verify() passes, and every reader reads it: the dataset opened with
and without its source, the device loader, a tar exported and imported, and for gs:// a pull and a
read-through copy."""

import os

import pytest

import nbkit
from nbkit.cluster import LocalEngine, run

from buildsources import Named, same
from fixtures_gcs import gcs, gcs_server
from test_remote_build import check_remote

N = 80


@pytest.fixture
def local_engine():
    with LocalEngine(2) as engine:
        yield engine


def read_every_way(path, src, tmp_path):
    """Every reader of a local cache sees exactly ``src``."""
    with nbkit.CachedDataset.open(path) as ds:  # without its source: nothing may be computed
        assert len(ds) == len(src) and ds.verify() == len(src) and len(ds.missing()) == 0
        assert all(same(ds[i], src[i]) for i in range(len(src)))
        seen = 0
        for batch in ds.loader(16, shuffle=False, device="cpu"):
            images, labels, names = batch
            for j in range(len(labels)):
                assert same((images[j], labels[j], names[j]), src[seen + j])
            seen += len(labels)
        assert seen == len(src)
    tar = str(tmp_path / "cache.tar")
    nbkit.export_tar(path, tar)
    imported = str(tmp_path / "imported")
    nbkit.import_tar(tar, imported)
    with nbkit.CachedDataset.open(imported) as back:
        assert back.verify() == len(src) and all(same(back[i], src[i]) for i in range(len(src)))


@pytest.mark.parametrize("where", ["local", "gs"])
@pytest.mark.parametrize("which", ["local_engine", "dask_engine", "ray_engine"])
def test_every_engine_builds_the_same_cache(which, where, request, tmp_path):
    engine = request.getfixturevalue(which)
    src = Named(N)
    if where == "local":
        path, opts = str(tmp_path / "cache"), None
    else:
        bucket = request.getfixturevalue("gcs")
        path, opts = f"{bucket.url}/caches/{which}", bucket.storage_options
    ds = nbkit.CachedDataset(src, path, storage_options=opts) if opts else nbkit.CachedDataset(src, path)
    cb = nbkit.Callback()
    report = run(ds, engine, part_size=16, callback=cb)
    assert (report.computed, report.parts, report.refused, report.stopped) == (N, 5, 0, False), report
    builders = {int(row.worker.rsplit(":", 1)[1]) for row in cb.workers.rows}
    assert builders and os.getpid() not in builders  # the engine's own processes built the parts
    ds.close()
    if where == "local":
        read_every_way(path, src, tmp_path)
    else:
        check_remote(path, opts, src)
        copy = str(tmp_path / "pulled")
        nbkit.pull(path, copy, storage_options=opts)
        read_every_way(copy, src, tmp_path)
