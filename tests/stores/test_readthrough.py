"""Read-through (nbkit.stores.readthrough): a pushed cache read from the GCS emulator through a local area
smaller than the cache, with real gcsfs, real torchvision MNIST (offline files) and real DataLoader
workers."""

import json
import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest
import torch
from fixtures_gcs import gcs, gcs_server
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

import nbkit
from nbkit import format as fmt
from nbkit.errors import CorruptCacheError
from nbkit.samplers import PrefetchSampler
from nbkit.stores.readthrough import area_usage, store_of
from nbkit.stores.readthrough.area import area_lock


def _mnist(root):
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    return datasets.MNIST(str(root), train=True, download=False, transform=tf)


@pytest.fixture(scope="module")
def source(mnist_root):
    """The 2,000-sample MNIST source and all its samples, computed once."""
    src = _mnist(mnist_root)
    images = torch.stack([src[i][0] for i in range(len(src))])
    labels = torch.tensor([src[i][1] for i in range(len(src))])
    return src, images, labels


@pytest.fixture(autouse=True)
def local_areas(tmp_path, monkeypatch):
    """Local areas (and working copies) go under the test's tmp dir."""
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "areas"))


def _push(source, tmp_path, bucket, *, name="mnist", only=None):
    """Warm a local cache of ``source`` (all samples, or ``only``), push it to ``bucket``; return (url, bytes)."""
    src = source[0]
    ds = nbkit.CachedDataset(src, tmp_path / f"local-{name}")
    if only is None:
        ds.warmup()
    else:
        ds[list(only)]
    url = f"{bucket.url}/{name}"
    nbkit.push(ds.root, url, storage_options=bucket.storage_options)
    size = sum((tmp_path / f"local-{name}" / n).stat().st_size for n in fmt.list_cache_files(ds.root))
    return url, size


class UsageMonitor:
    """Samples the local area's size every millisecond in a thread; ``peak`` is the largest seen.

    Each sample is taken under the area lock (as a fetch's evict-then-reserve step is), so it sees
    the directory between two such steps rather than halfway through one.
    """

    def __init__(self, root):
        self.root, self.peak, self._stop = root, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            with area_lock(self.root):
                self.peak = max(self.peak, area_usage(self.root))
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, area_usage(self.root))


def _check_batch(batch, idx, images, labels):
    x, y = batch
    assert torch.equal(x, images[idx]), "wrong image data"
    assert torch.equal(y, labels[idx]), "wrong labels"


def test_epoch_equals_source_within_a_quarter_of_the_cache(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs)
    limit = size // 4
    ds = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=limit)
    store = store_of(ds)
    n_pieces = store.geometry.n_column_pieces
    assert n_pieces >= 20
    sampler = PrefetchSampler(ds, seed=1)
    seen = []
    with UsageMonitor(ds.root) as usage:
        for idx in BatchSampler(sampler, 128, drop_last=False):
            _check_batch(nbkit.collate(ds.__getitems__(idx)), idx, images, labels)
            seen += idx
    assert sorted(seen) == list(range(len(src)))
    assert 0 < usage.peak <= limit
    assert store.counters["max_local_bytes"] <= limit
    assert store.prefetch_error is None
    c = store.counters
    # The cache is 4x the local area: pieces were evicted, and the sampler's windows made the epoch
    # fetch every piece about once (a piece may be fetched again when the reader overtakes the
    # prefetch thread at a window's edge).
    assert c["evicted"] > 0
    assert n_pieces <= c["fetched"] <= n_pieces * 1.1 and c["refetched"] <= n_pieces * 0.1, c
    assert ds.stats.hits == len(src) and ds.stats.misses == 0
    # Nothing was pulled whole: the local area never held more than the limit, and holds the index.
    assert area_usage(ds.root) <= limit


def test_pieces_are_evicted_and_refetched_and_a_plain_shuffle_is_still_right(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs)
    limit = size // 4
    ds = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=limit)
    store = store_of(ds)
    sampler = PrefetchSampler(ds, seed=2)
    with UsageMonitor(ds.root) as usage:
        for epoch in range(2):
            for idx in BatchSampler(sampler, 256, drop_last=False):
                _check_batch(nbkit.collate(ds.__getitems__(idx)), idx, images, labels)
        first_two = dict(store.counters)
        # A plain random sampler touches most pieces in every batch: it thrashes, but stays correct.
        for k, idx in enumerate(BatchSampler(RandomSampler(range(len(src))), 256, drop_last=False)):
            _check_batch(nbkit.collate(ds.__getitems__(idx)), idx, images, labels)
            if k == 2:
                break
    assert usage.peak <= limit
    n_pieces = store.geometry.n_column_pieces
    assert first_two["refetched"] >= n_pieces * 0.9  # epoch 2 fetched (nearly) everything again
    assert store.counters["fetched"] > first_two["fetched"]
    assert store.counters["evicted"] >= store.counters["fetched"] - limit // store.geometry.piece_size(("c", 0))


def test_prefetch_fetches_ahead(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs)
    ds = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=size // 4)
    store = store_of(ds)
    want = np.arange(120, 320)  # 5 pieces of 40 rows: within half the local area, all queued
    queued = store.prefetch(want)
    assert queued == len(store.pieces_of(want)) == 5
    assert store.wait_prefetched(timeout=60)
    assert store.counters["prefetched"] == queued and store.counters["on_demand"] == 0
    _check_batch(nbkit.collate(ds.__getitems__(want.tolist())), want, images, labels)
    assert store.counters["on_demand"] == 0  # every piece was already local

    # The sampler asks for the next window halfway through the current one: once it has handed
    # out half of window 0, window 1's pieces arrive without any read of window 1.
    sampler = PrefetchSampler(ds, seed=3)
    windows = sampler.windows()
    assert len(windows) >= 3
    it = iter(sampler)
    for _ in range(len(windows[0]) // 2 + 1):
        next(it)
    assert store.wait_prefetched(timeout=60)
    for key in store.pieces_of(windows[1]):
        assert os.path.exists(store._path(key)), key


def _prefetchers():
    return [t for t in threading.enumerate() if t.name == "nbkit-readthrough-prefetch"]


def test_a_fork_ends_an_idle_prefetch_thread_first(source, tmp_path, gcs):
    # A DataLoader forking its workers must not fork a process running our threads (Python warns:
    # the child may inherit a lock one of them held). One that waits for work is ended first.
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs)
    ds = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=size // 4)
    store = store_of(ds)
    assert store.prefetch(np.arange(0, 80)) and store.wait_prefetched(timeout=60)
    assert _prefetchers()  # done, waiting for more
    child = mp.get_context("fork").Process(target=int)
    child.start()
    child.join()
    assert child.exitcode == 0 and _prefetchers() == [] and store._thread is None
    want = np.arange(120, 200)
    assert store.prefetch(want) and store.wait_prefetched(timeout=60)  # the next prefetch starts a new one
    assert store.counters["prefetched"] == len(store.pieces_of(np.arange(0, 80))) + len(store.pieces_of(want))
    _check_batch(nbkit.collate(ds.__getitems__(want.tolist())), want, images, labels)
    ds.close()
    assert _prefetchers() == []


def test_dataloader_workers_share_one_bounded_area(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs)
    limit = size // 4
    ds = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=limit)
    sampler = PrefetchSampler(ds, seed=4)
    order = [i for w in sampler.windows() for i in w.tolist()]  # the order the next iteration yields
    loader = DataLoader(ds, batch_size=128, sampler=sampler, num_workers=2, collate_fn=nbkit.collate)
    with UsageMonitor(ds.root) as usage:
        batches = list(loader)
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert torch.equal(x, images[order]) and torch.equal(y, labels[order])
    assert usage.peak <= limit
    assert ds.stats.hits == len(src)  # counted in the workers, summed here


def test_missing_bucket_prefix_and_too_small_a_limit_are_clear(source, tmp_path, gcs):
    so = gcs.storage_options
    with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket-nbkit' does not exist"):
        nbkit.CachedDataset.open("gs://no-such-bucket-nbkit/cache", storage_options=so, local_max_bytes=1 << 20)
    with pytest.raises(FileNotFoundError, match="holds no complete nbkit cache.*nbkit.push"):
        nbkit.CachedDataset.open(f"{gcs.url}/nothing-here", storage_options=so, local_max_bytes=1 << 20)
    url, size = _push(source, tmp_path, gcs)
    with pytest.raises(ValueError, match="too small.*at least"):
        nbkit.CachedDataset.open(url, storage_options=so, local_max_bytes=50_000)
    with pytest.raises(ValueError, match="only applies to a remote cache"):
        nbkit.CachedDataset.open(tmp_path / "local-mnist", local_max_bytes=1 << 20)


def test_read_only_with_source_computes_what_the_bucket_lacks(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs, name="half", only=range(0, len(source[0]), 2))
    before = sorted(gcs.fs.find(f"{gcs.name}/half"))
    ds = nbkit.CachedDataset(src, url, storage_options=gcs.storage_options, local_max_bytes=size // 2)
    assert ds.stats.cached == len(src) // 2
    idx = list(range(0, 300))
    got = ds.__getitems__(idx)
    assert all(torch.equal(got[j][0], images[i]) and got[j][1] == labels[i] for j, i in enumerate(idx))
    assert ds.stats.cached == len(src) // 2  # computed, not stored
    assert ds.warmup().computed == 0  # nothing to warm: the cache is read-only here
    assert sorted(gcs.fs.find(f"{gcs.name}/half")) == before  # nothing written to the bucket
    # overwrite=True keeps a cache of this source; replacing one of another source needs a writable store.
    kept = nbkit.CachedDataset(src, url, storage_options=gcs.storage_options, local_max_bytes=size // 2, overwrite=True)
    assert kept.opened == "reopened"
    other = torch.utils.data.TensorDataset(torch.zeros(len(src), 1, 28, 28), torch.zeros(len(src), dtype=torch.long))
    with pytest.raises(PermissionError, match="read-only"):
        nbkit.CachedDataset(other, url, storage_options=gcs.storage_options, local_max_bytes=size // 2, overwrite=True)
    # Without the source, a sample the bucket lacks is a clear MissingSampleError.
    ro = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=size // 2)
    assert torch.equal(ro[0][0], images[0])
    with pytest.raises(nbkit.MissingSampleError, match="not in the cache"):
        ro[1]


def test_damaged_bytes_in_the_bucket_are_caught_by_the_checksums(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs, name="damaged")
    fs = gcs.fs
    path = f"{gcs.name}/damaged/col-0.bin"
    data = bytearray(fs.cat_file(path))
    data[5 * 3136 + 100] ^= 0xFF  # sample 5's image
    fs.pipe_file(path, bytes(data))

    ro = nbkit.CachedDataset.open(url, storage_options=gcs.storage_options, local_max_bytes=size // 4)
    assert torch.equal(ro[4][0], images[4])
    with pytest.raises(CorruptCacheError, match="sample 5 .* fails its checksum"):
        ro[5]
    assert store_of(ro).counters["retried"] == 1  # fetched twice before handing it to the engine

    rw = nbkit.CachedDataset(src, url, storage_options=gcs.storage_options, local_max_bytes=size // 4)
    got = rw.__getitems__([3, 5, 6])
    assert torch.equal(got[1][0], images[5])
    assert rw.stats.recomputed == 1
    assert torch.equal(rw[5][0], images[5])  # the recomputed sample is kept (in memory) for this process


def test_a_cache_pushed_again_replaces_the_local_pieces(source, tmp_path, gcs):
    src, images, labels = source
    url, size = _push(source, tmp_path, gcs, name="again")
    so = gcs.storage_options
    ds = nbkit.CachedDataset.open(url, storage_options=so, local_max_bytes=size // 4)
    assert torch.equal(ds[7][0], images[7])
    old_tag = store_of(ds).geometry.tag
    # A different cache (other source, same shape) pushed over the same prefix.
    other = torch.utils.data.TensorDataset(-images, labels)
    local = nbkit.CachedDataset(other, tmp_path / "other")
    local.warmup()
    nbkit.push(local.root, url, storage_options=so)
    again = nbkit.CachedDataset.open(url, storage_options=so, local_max_bytes=size // 4)
    assert again.root == ds.root
    assert torch.equal(again[7][0], -images[7])
    pieces = list((tmp_path / "areas").glob("*.readthrough/pieces/*.bin"))
    assert pieces and not any(p.name.startswith(old_tag.split("-")[0]) for p in pieces)


def test_a_bucket_with_foreign_objects_or_impossible_sizes_is_refused_at_open(tmp_path, monkeypatch):
    # issue 17: the manifest's sizes are checked against the listing before any range read.
    import json
    import uuid

    from nbkit.errors import UnsafeArchiveError
    from nbkit.transfer.remote import url_to_fs

    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(64.0).reshape(16, 4)), tmp_path / "c")
    ds.warmup()
    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/rt"
    nbkit.push(ds.root, url)
    fs, rroot = url_to_fs(url)
    good = fs.cat_file(f"{rroot}/manifest.json")
    m = json.loads(good)
    m["files"]["col-0.bin"]["size"] = 2**50
    fs.pipe_file(f"{rroot}/manifest.json", json.dumps(m).encode())
    reads = []
    real = type(fs).cat_file
    monkeypatch.setattr(type(fs), "cat_file", lambda self, p, *a, **k: reads.append(p) or real(self, p, *a, **k))
    with pytest.raises(CorruptCacheError, match=f"{url}/col-0.bin is .* bytes but its manifest says 1125899906842624"):
        nbkit.CachedDataset.open(url, local_max_bytes=1 << 20)
    assert not any(p.endswith("col-0.bin") for p in reads)
    fs.pipe_file(f"{rroot}/manifest.json", good)
    fs.pipe_file(f"{rroot}/evil.py", b"x")
    with pytest.raises(UnsafeArchiveError, match="evil.py"):
        nbkit.CachedDataset.open(url, local_max_bytes=1 << 20)
    fs.rm(rroot, recursive=True)


@pytest.mark.parametrize("name", ["index.bin", "nbkit.json"])
def test_every_remote_read_at_open_is_bounded_by_the_manifest(tmp_path, monkeypatch, name):
    # issue 25: an object larger than its manifest entry (and a listing that does not say so) is
    # never read whole: at most its entry's size and one byte come back, then it fails that entry.
    import uuid

    from nbkit.transfer.remote import url_to_fs

    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(64.0).reshape(16, 4)), tmp_path / "c")
    ds.warmup()
    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/rt"
    nbkit.push(ds.root, url)
    fs, rroot = url_to_fs(url)
    listed = json.loads(fs.cat_file(f"{rroot}/manifest.json"))["files"][name]["size"]
    fs.pipe_file(f"{rroot}/{name}", b"{" + b" " * (4 << 20))  # 4 MiB where a few hundred bytes belong
    cls = type(fs)
    real_ls, real_cat = cls.ls, cls.cat_file
    monkeypatch.setattr(cls, "ls", lambda self, p, detail=True, **k: [
        {**e, "size": None} for e in real_ls(self, p, detail=True, **k)])  # a listing without sizes
    got = []
    monkeypatch.setattr(cls, "cat_file", lambda self, p, *a, **k: (lambda d: got.append((p, len(d))) or d)(
        real_cat(self, p, *a, **k)))
    with pytest.raises(CorruptCacheError, match=rf"{url}/{name} does not match its manifest entry \(size {listed + 1} vs {listed}"):
        nbkit.CachedDataset.open(url, local_max_bytes=1 << 20)
    assert [n for p, n in got if p.endswith(name)] == [listed + 1]
    fs.rm(rroot, recursive=True)
