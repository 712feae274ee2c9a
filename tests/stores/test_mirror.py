"""URL resolution and remote caches: CachedDataset(source, "gs://…") end to end, several hosts on one prefix."""

import json
import os
import time
import uuid

import pytest

import nbkit
from fixtures_gcs import gcs, gcs_server  # noqa: F401 - pytest fixtures
from nbkit import format as fmt
from nbkit.remote import url_to_fs
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


def test_remote_without_cache_leaves_working_copy_alone(tmp_path, monkeypatch, remote):
    url, so = remote
    host(monkeypatch, tmp_path, "host-a")
    loc = resolve(url, so)
    assert loc.prepare() is False and not os.path.exists(loc.root)
    with pytest.raises(FileNotFoundError):
        nbkit.CachedDataset.open(url, storage_options=so)


def test_unreachable_bucket_fails_at_once_naming_the_endpoint(tmp_path, monkeypatch):
    host(monkeypatch, tmp_path, "host-a")
    nothing_listens = {"endpoint_url": f"http://127.0.0.1:{free_port()}", "token": "anon", "project": "test"}
    with pytest.raises(OSError, match=r"could not reach the endpoint http://127\.0\.0\.1:\d+ while looking for a "
                                      r"cache at gs://nbkit-nowhere/mnist .*open the cache again") as err:
        nbkit.CachedDataset(TupleSource(n=8), "gs://nbkit-nowhere/mnist", storage_options=nothing_listens)
    assert isinstance(err.value.__cause__, ConnectionRefusedError)
