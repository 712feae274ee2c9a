"""URL resolution and remote caches: CachedDataset(source, "gs://…") end to end, several hosts on one prefix."""

import json
import os
import time
import uuid

import hypothesis
import hypothesis.strategies
import pytest
import torch

import nbkit
from fixtures_gcs import gcs, gcs_server
from nbkit import format as fmt
from nbkit.transfer.remote import url_to_fs
from nbkit.stores import mirror
from nbkit.stores.registry import resolve
from servers import free_port
from sources import CountingSource, TupleSource, assert_equal, computed_counts


def test_local_paths_resolve_to_themselves(tmp_path):
    for given in (str(tmp_path / "c"), tmp_path / "c", f"file://{tmp_path}/c"):
        loc = resolve(given)
        assert loc.root == str(tmp_path / "c") and not loc.is_remote
        assert loc.prepare() is False and loc.publish() is False
    assert not (tmp_path / "c").exists()


def test_remote_urls_get_distinct_working_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "wc"))
    a = resolve("gs://bucket/mnist")
    assert a.is_remote and a.url == "gs://bucket/mnist"
    assert os.path.dirname(a.root) == str(tmp_path / "wc") and os.path.basename(a.root).startswith("mnist-")
    assert resolve("gs://bucket/mnist/").root == a.root
    assert resolve("gs://other/mnist").root != a.root
    assert resolve("gs://bucket/mnist", {"endpoint_url": "http://127.0.0.1:1"}).root != a.root
    assert resolve("memory://bucket/mnist").is_remote


@pytest.fixture(params=["memory", "gcs"])
def remote(request):
    if request.param == "memory":
        return f"memory://nbkit-tests/{uuid.uuid4().hex}/cache", None
    bucket = request.getfixturevalue("gcs")
    return f"{bucket.url}/shared/mnist", bucket.storage_options


def host(monkeypatch, tmp_path, name):
    """Pretend to be another machine: its own working-copy directory."""
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / name))


def test_cached_dataset_on_a_remote_url_end_to_end(tmp_path, monkeypatch, remote):
    url, so = remote
    log = tmp_path / "log"
    log.mkdir()
    host(monkeypatch, tmp_path, "host-a")
    a = nbkit.CachedDataset(CountingSource(n=64, log_dir=str(log)), url, storage_options=so)
    assert a.path == url and a.root.startswith(str(tmp_path / "host-a"))
    report = a.warmup()
    assert report.computed == 64
    fs, root = url_to_fs(url, so)
    fs.invalidate_cache()
    assert fs.exists(f"{root}/{fmt.META}")  # published after warmup
    before = computed_counts(log)

    # A second machine finds the complete cache and pulls it instead of warming.
    host(monkeypatch, tmp_path, "host-b")
    b = nbkit.CachedDataset(CountingSource(n=64, log_dir=str(log)), url, storage_options=so)
    assert b.root.startswith(str(tmp_path / "host-b")) and len(b.missing()) == 0
    assert b.warmup().computed == 0
    # Host B only ran the source's fingerprint probes (3 indices), never a warmup.
    after = computed_counts(log)
    assert len({i for i in after if after[i] != before.get(i)}) <= 3
    src = TupleSource(n=64)
    for i in (0, 17, 63):
        assert_equal(b[i], src[i], f"sample {i} on host B")
    # Reading it back is a local, memory-mapped cache: no network per sample.
    assert b.stats.hits >= 3 and b.stats.misses == 0

    # Without a source (new session, same machine): opens the working copy.
    c = nbkit.CachedDataset.open(url, storage_options=so)
    assert_equal(c[5], src[5])


def test_partial_cache_is_not_published(tmp_path, monkeypatch, remote):
    url, so = remote
    host(monkeypatch, tmp_path, "host-a")
    a = nbkit.CachedDataset(TupleSource(n=64), url, storage_options=so)
    a.warmup(shard=(0, 2))
    fs, root = url_to_fs(url, so)
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{fmt.META}")
    assert a.sync() is None and not fs.exists(f"{root}/{fmt.META}")
    a.warmup()
    fs.invalidate_cache()
    assert fs.exists(f"{root}/{fmt.META}")


def test_older_working_copy_is_refreshed_and_up_to_date_one_is_kept(tmp_path, monkeypatch, remote):
    url, so = remote
    host(monkeypatch, tmp_path, "host-b")
    stale = nbkit.CachedDataset(TupleSource(n=64), url, storage_options=so)
    stale.warmup(shard=(0, 4))  # a quarter, never published
    host(monkeypatch, tmp_path, "host-a")
    nbkit.CachedDataset(TupleSource(n=64), url, storage_options=so).warmup()

    host(monkeypatch, tmp_path, "host-b")
    loc = resolve(url, so)
    assert loc.root == stale.root
    assert loc.prepare() is True  # remote holds more samples: pulled
    assert len(nbkit.CachedDataset.open(loc.root).missing()) == 0
    assert loc.prepare() is False  # now up to date: nothing to do
    assert loc.publish() is False  # the remote already holds this complete cache


def test_publish_waits_for_another_hosts_lease(tmp_path, monkeypatch, remote):
    url, so = remote
    host(monkeypatch, tmp_path, "host-a")
    ds = nbkit.CachedDataset(TupleSource(n=32), url, storage_options=so)
    fs, root = url_to_fs(url, so)
    lease = f"{root}/{mirror.LEASE}"
    fs.pipe_file(lease, json.dumps({"host": "other", "time": time.time(), "token": "x"}).encode())
    ds.warmup()  # publish is skipped: another host is publishing
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{fmt.META}")
    # An abandoned lease (older than LEASE_SECONDS) is taken over.
    fs.pipe_file(lease, json.dumps({"host": "other", "time": time.time() - mirror.LEASE_SECONDS - 1, "token": "x"}).encode())
    ds.sync()
    fs.invalidate_cache()
    assert fs.exists(f"{root}/{fmt.META}") and not fs.exists(lease)


@pytest.mark.parametrize("body", [b"[1, 2]", b'{"time": "soon", "token": 3}', b'{"time": 1e999}', b"\xff" * 10000,
                                  b"[" * 100000])
def test_a_malformed_lease_in_a_shared_bucket_is_taken_as_abandoned(tmp_path, monkeypatch, body):
    """A bucket is shared: its lease object may be anything. It is read bounded, and one that is not
    nbkit's is taken as abandoned (it used to raise AttributeError/RecursionError from inside publish)."""
    url = "memory://lease-garbage/c"
    host(monkeypatch, tmp_path, "host-a")
    ds = nbkit.CachedDataset(TupleSource(n=8), url)
    fs, root = url_to_fs(url, None)
    fs.pipe_file(f"{root}/{mirror.LEASE}", body)
    ds.warmup()
    assert fs.exists(f"{root}/{fmt.META}") and not fs.exists(f"{root}/{mirror.LEASE}")
    fs.rm(root, recursive=True)


def test_remote_without_cache_leaves_working_copy_alone(tmp_path, monkeypatch, remote):
    url, so = remote
    host(monkeypatch, tmp_path, "host-a")
    loc = resolve(url, so)
    assert loc.prepare() is False and not os.path.exists(loc.root)
    with pytest.raises(FileNotFoundError) as err:
        nbkit.CachedDataset.open(url, storage_options=so)
    text = str(err.value)
    assert text.startswith(f"no nbkit cache at {url}: nothing has been published there")
    assert f"nbkit.CachedDataset(source, {url!r})" in text and f"nbkit.push(cache_dir, {url!r})" in text
    assert loc.root not in text  # the hashed working copy is not where the user should look or build


def test_cache_filled_by_training_is_published(tmp_path, monkeypatch, remote):
    url, so = remote
    host(monkeypatch, tmp_path, "host-a")
    ds = nbkit.CachedDataset(TupleSource(n=64), url, storage_options=so)
    fs, root = url_to_fs(url, so)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    for i in order[:40]:  # part of an epoch, read the way training reads: no warmup(), no sync()
        ds[i]
    ds.__getitems__(order[40:63])
    fs.invalidate_cache()
    assert not fs.exists(f"{root}/{fmt.META}")  # one sample missing: nothing published yet
    ds[order[63]]  # the read that completes the cache publishes it
    fs.invalidate_cache()
    assert fs.exists(f"{root}/{fmt.META}") and not fs.exists(f"{root}/{mirror.LEASE}")

    host(monkeypatch, tmp_path, "host-b")  # another machine, without the source
    other = nbkit.CachedDataset.open(url, storage_options=so)
    assert other.root.startswith(str(tmp_path / "host-b")) and len(other.missing()) == 0
    src = TupleSource(n=64)
    for i in range(64):
        assert_equal(other[i], src[i], f"sample {i} on host B")


def logging_push(pushes):
    """``mirror.push`` that first appends the id of the process pushing to the file ``pushes``."""
    real_push = mirror.push

    def logged_push(*args, **kwargs):
        with open(pushes, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real_push(*args, **kwargs)

    return logged_push


def assert_published_once(pushes, url, so, n, monkeypatch, tmp_path):
    """One push happened, and another machine opening ``url`` without the source finds all ``n`` samples."""
    assert len(pushes.read_text().split()) == 1
    host(monkeypatch, tmp_path, "host-b")
    other = nbkit.CachedDataset.open(url, storage_options=so)
    assert len(other.missing()) == 0
    assert_equal(other[n - 1], TupleSource(n=n)[n - 1])


def test_dataloader_workers_publish_a_completed_cache_once(tmp_path, monkeypatch, gcs):
    url, so = f"{gcs.url}/trained", gcs.storage_options
    host(monkeypatch, tmp_path, "host-a")
    pushes = tmp_path / "pushes"
    monkeypatch.setattr(mirror, "push", logging_push(pushes))  # forked workers keep the patch
    ds = nbkit.CachedDataset(TupleSource(n=96), url, storage_options=so)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2,
                                         multiprocessing_context="fork")
    for epoch in range(2):  # both workers may see the cache complete; the second epoch only reads
        assert sum(len(y) for _, y in loader) == 96
    assert_published_once(pushes, url, so, 96, monkeypatch, tmp_path)


def test_unreachable_bucket_fails_at_once_naming_the_endpoint(tmp_path, monkeypatch):
    host(monkeypatch, tmp_path, "host-a")
    nothing_listens = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "token": "anon", "project": "test"}
    with pytest.raises(OSError, match=r"(?s)^cannot reach the endpoint 127\.0\.0\.1:\d+ \(connection refused\)\nwhile looking "
                                      r"for a cache at gs://nbkit-nowhere/mnist\.\n.*open the cache again") as err:
        nbkit.CachedDataset(TupleSource(n=8), "gs://nbkit-nowhere/mnist", storage_options=nothing_listens)
    assert isinstance(err.value.__cause__, ConnectionRefusedError)


def _read_half(url, so, half, pushes):
    mirror.push = logging_push(pushes)  # in this child process only
    ds = nbkit.CachedDataset(TupleSource(n=64), url, storage_options=so)
    for start in range(half, 64, 16):  # the two processes interleave their reads
        ds.__getitems__(list(range(start, start + 8)))


def test_processes_filling_one_cache_by_reads_publish_it_once(tmp_path, monkeypatch, gcs):
    import multiprocessing

    url, so = f"{gcs.url}/two-processes", gcs.storage_options
    host(monkeypatch, tmp_path, "host-a")
    pushes = tmp_path / "pushes"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_read_half, args=(url, so, half, str(pushes))) for half in (0, 8)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert_published_once(pushes, url, so, 64, monkeypatch, tmp_path)


def test_failed_publish_after_training_warns_and_training_goes_on(tmp_path, monkeypatch):
    host(monkeypatch, tmp_path, "host-a")
    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/cache"
    ds = nbkit.CachedDataset(TupleSource(n=8), url)

    def unreachable(*args, **kwargs):
        raise ConnectionError("the endpoint went away")

    monkeypatch.setattr(mirror, "push", unreachable)
    with pytest.warns(RuntimeWarning, match=rf"(?s)cache at {url} is complete but could not be published; training goes "
                                            r"on .*the endpoint went away.*call sync\(\) on the dataset again"):
        ds.__getitems__(list(range(8)))
    assert_equal(ds[7], TupleSource(n=8)[7])  # the working copy serves reads; no second try per read
    monkeypatch.undo()
    ds.sync()
    fs, root = url_to_fs(url, None)
    assert fs.exists(f"{root}/{fmt.META}")


def test_working_copy_takes_only_cache_files_from_the_bucket(tmp_path, monkeypatch):
    # issue 17: the prefix is untrusted; the publish lease is the one other object a pull accepts.
    from nbkit.errors import UnsafeArchiveError

    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/cache"
    host(monkeypatch, tmp_path, "host-a")
    nbkit.CachedDataset(TupleSource(n=16), url).warmup()
    fs, root = url_to_fs(url)
    fs.pipe_file(f"{root}/{mirror.LEASE}", json.dumps({"host": "other", "time": time.time(), "token": "x"}).encode())
    host(monkeypatch, tmp_path, "host-b")
    loc = resolve(url)
    assert loc.prepare() is True  # pulled while another host holds the lease
    fs.pipe_file(f"{root}/evil.py", b"raise SystemExit")
    host(monkeypatch, tmp_path, "host-c")
    with pytest.raises(UnsafeArchiveError, match=f"{url}.*evil.py"):
        resolve(url).prepare()
    assert not os.path.exists(resolve(url).root)  # nothing came in
    fs.rm(root, recursive=True)


@pytest.mark.fuzz
@hypothesis.given(hypothesis.strategies.binary(max_size=5000) | hypothesis.strategies.sampled_from(
    [b'{"time": 1, "token": "t"}', b"[]", b"null", b'{"time": NaN}', b"[" * 5000]))
def test_any_lease_object_reads_as_a_dict(body):
    """Whatever a shared bucket holds under the lease's name, reading it gives a dict (maybe empty),
    read bounded, never an exception."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe_file("/lease-fuzz/lease", body)
    got = mirror._lease_body(fs, "/lease-fuzz/lease")
    assert isinstance(got, dict)
    if body == b'{"time": 1, "token": "t"}':
        assert got == {"time": 1, "token": "t"}


def test_an_origin_file_that_is_a_directory_is_replaced_on_open_and_removed_with_the_copy(tmp_path, monkeypatch):
    """A tampered working copy (issue 37): its ``.origin.json`` is a directory holding a file. Opening the
    remote cache writes the origin again; removing the copy removes it; neither raises IsADirectoryError."""
    host(monkeypatch, tmp_path, "host-a")
    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/cache"
    ds = nbkit.CachedDataset(TupleSource(n=8), url)
    ds.warmup()
    origin = ds.root + mirror.ORIGIN_SUFFIX
    os.remove(origin)
    os.makedirs(os.path.join(origin, "inside"))
    open(os.path.join(origin, "inside", "f"), "w").close()
    again = nbkit.CachedDataset(TupleSource(n=8), url)
    assert os.path.isfile(origin) and mirror.read_origin(again.root)["url"] == url
    for i in range(8):
        assert_equal(again[i], TupleSource(n=8)[i])
    os.remove(origin)
    os.makedirs(os.path.join(origin, "inside"))
    ds.close()
    again.close()
    nbkit.remove(again.root)
    assert not os.path.lexists(origin) and not os.path.lexists(again.root)
