"""push / pull: one shared suite over a local directory, memory:// and the GCS emulator, then the
failure cases that need a real server (killed mid-push, tampered object)."""

import asyncio
import json
import os
import threading
import uuid

import pytest
import torch

import nbkit
from fixtures_gcs import (black_hole, gcs, gcs_emulator, gcs_server, refused_port, short_gcsfs_retries,
                          silent_metadata)
from nbkit import format as fmt
from nbkit.transfer import manifest
from nbkit.transfer import sync as transfer
from nbkit.transfer.remote import url_to_fs
from nbkit.errors import CorruptCacheError
from nbkit.progress import Callback
from sources import DictSource, TupleSource, assert_equal


class TwoImages(torch.utils.data.Dataset):
    """Two large fixed-shape leaves: two column files of ~10 MB each for n=400."""

    def __init__(self, n=400):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(3, 48, 48, generator=g), torch.randn(3, 48, 48, generator=g), i


def make_cache(path, src=None, warm=True):
    ds = nbkit.CachedDataset(src if src is not None else DictSource(n=40), path)
    if warm:
        ds.warmup()
    return ds


@pytest.fixture(params=["local", "memory", "gcs"])
def remote(request, tmp_path):
    """(url, storage_options) for each backend of the shared suite."""
    if request.param == "local":
        return str(tmp_path / "remote" / "cache"), None
    if request.param == "memory":
        return f"memory://nbkit-tests/{uuid.uuid4().hex}/cache", None
    bucket = request.getfixturevalue("gcs")
    return f"{bucket.url}/caches/cache", bucket.storage_options


def remote_names(url, storage_options):
    fs, root = url_to_fs(url, storage_options)
    fs.invalidate_cache()
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))


class Recorder(Callback):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def call(self, *args, **kwargs):
        self.calls += 1


def test_push_pull_round_trip(tmp_path, remote):
    url, so = remote
    ds = make_cache(tmp_path / "c")
    cb = Recorder()
    report = nbkit.push(ds.root, url, callback=cb, storage_options=so)
    assert report.transferred[-1] == fmt.META and not report.skipped
    assert cb.value == cb.size == report.bytes and cb.calls > 0
    expected = sorted(fmt.list_cache_files(ds.root) + [manifest.MANIFEST])
    assert remote_names(url, so) == expected  # one object per file, nothing else

    cb = Recorder()
    got = nbkit.pull(url, tmp_path / "other" / "copy", callback=cb, storage_options=so)
    assert got.transferred[-1] == fmt.META
    copy = nbkit.CachedDataset.open(tmp_path / "other" / "copy")
    assert len(copy.missing()) == 0
    src = DictSource(n=40)
    for i in range(len(src)):
        assert_equal(copy[i], src[i], f"pulled sample {i}")
    assert not [n for n in os.listdir(tmp_path / "other") if n != "copy"]  # no temporary leftovers


def test_second_push_skips_everything_and_changed_files_are_resent(tmp_path, remote):
    url, so = remote
    ds = nbkit.CachedDataset(TupleSource(n=64), tmp_path / "c")
    ds.warmup(shard=(0, 2))  # half the samples
    nbkit.push(ds.root, url, storage_options=so)
    again = nbkit.push(ds.root, url, storage_options=so)
    assert again.transferred == () and fmt.META in again.skipped and again.bytes == 0

    ds.warmup()  # the rest: index and columns change
    third = nbkit.push(ds.root, url, storage_options=so)
    assert fmt.INDEX in third.transferred and third.transferred[-1] == fmt.META  # unpublished first, republished last
    pulled = nbkit.pull(url, tmp_path / "copy", storage_options=so)
    assert len(nbkit.CachedDataset.open(tmp_path / "copy").missing()) == 0

    # Pulling over the old copy reuses what is unchanged locally and still ends complete.
    again = nbkit.pull(url, tmp_path / "copy", storage_options=so)
    assert set(again.skipped) == set(pulled.transferred) - {fmt.META}


def test_pull_refuses_a_prefix_without_published_metadata(tmp_path, remote):
    url, so = remote
    ds = make_cache(tmp_path / "c")
    nbkit.push(ds.root, url, storage_options=so)
    fs, root = url_to_fs(url, so)
    fs.rm_file(f"{root}/{fmt.META}")
    with pytest.raises(FileNotFoundError, match="no complete nbkit cache"):
        nbkit.pull(url, tmp_path / "copy", storage_options=so)
    assert not (tmp_path / "copy").exists()


def test_tampered_byte_is_detected_on_pull(tmp_path, remote):
    url, so = remote
    ds = make_cache(tmp_path / "c", TupleSource(n=50))
    nbkit.push(ds.root, url, storage_options=so)
    fs, root = url_to_fs(url, so)
    victim = f"{root}/col-0.bin"
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0x01
    fs.pipe_file(victim, bytes(data))
    fs.invalidate_cache()
    with pytest.raises(CorruptCacheError, match="col-0.bin"):
        nbkit.pull(url, tmp_path / "dst" / "copy", storage_options=so)
    assert os.listdir(tmp_path / "dst") == []  # nothing half-copied, no temporary directory left


def test_stop_requested_publishes_nothing(tmp_path, remote):
    url, so = remote
    ds = make_cache(tmp_path / "c", TupleSource(n=50))

    class StopAtOnce(Callback):
        def call(self, *args, **kwargs):
            if self.value:
                self.request_stop()

    report = nbkit.push(ds.root, url, callback=StopAtOnce(), storage_options=so, max_workers=1)
    assert report.stopped
    assert fmt.META not in remote_names(url, so)
    nbkit.push(ds.root, url, storage_options=so)  # and a rerun completes
    assert fmt.META in remote_names(url, so)


def test_push_refuses_a_directory_that_is_not_a_cache(tmp_path):
    with pytest.raises(FileNotFoundError, match="no nbkit cache"):
        nbkit.push(tmp_path, "memory://nbkit-tests/never")


def test_pull_refuses_to_replace_a_directory_that_is_not_a_cache(tmp_path):
    ds = make_cache(tmp_path / "c")
    nbkit.push(ds.root, "memory://nbkit-tests/replace")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "thesis.tex").write_text("do not delete")
    with pytest.raises(FileExistsError, match="not an nbkit cache"):
        nbkit.pull("memory://nbkit-tests/replace", tmp_path / "precious")
    assert (tmp_path / "precious" / "thesis.tex").read_text() == "do not delete"


class Watch:
    """aiohttp trace hooks on nbkit's own gcsfs session (``storage_options["session_kwargs"]``).

    Before each request nbkit sends, records (through a separate client) whether the prefix is
    published, and can kill the emulator just before a chosen request, so the failure point is
    certain rather than a race with the upload.
    """

    def __init__(self, emulator, prefix, kill=None):
        self.emulator, self.prefix, self.kill = emulator, prefix, kill
        self.observer = emulator.fs()
        self.published = []  # nbkit.json existed, before each request of the transfer
        self.requests = []  # (method, object name or "", has upload_id)
        self.urls = []  # (method, the request's URL as sent), in step with requests
        self.killed = False

    def storage_options(self):
        import aiohttp

        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._on_start)
        return dict(self.emulator.storage_options, session_kwargs={"trace_configs": [trace]})

    async def _on_start(self, session, ctx, params):
        if self.killed:
            return
        self.observer.invalidate_cache()
        self.published.append(await self.observer._exists(f"{self.prefix}/{fmt.META}"))
        q = params.url.query
        self.requests.append((params.method, q.get("name", ""), "upload_id" in q))
        self.urls.append((params.method, str(params.url)))
        if self.kill is not None and await self.kill(self):
            self.emulator.kill()  # and it stays down: every retry is refused, the failure is certain
            self.killed = True

    def parts_of(self, name):
        """Upload parts of ``name`` sent so far (resumable-upload requests with an upload id)."""
        return sum(1 for m, n, part in self.requests if part and n.endswith("/" + name))

    async def manifest_lists(self, name):
        try:
            raw = await self.observer._cat_file(f"{self.prefix}/{manifest.MANIFEST}")
        except FileNotFoundError:
            return False
        return name in json.loads(raw)["files"]


def test_emulator_killed_mid_push(tmp_path, gcs_emulator, short_gcsfs_retries, monkeypatch):
    """Kill the server in the middle of uploading a file and keep it down: a clear error; the prefix
    is never a cache before the push is whole; after a restart the rerun skips what was finished."""
    # Small blocks: the second column goes up as several parts of one resumable upload.
    monkeypatch.setattr(transfer, "BLOCK", 1 << 20)
    bucket = gcs_emulator.make_bucket()
    url = f"{bucket.url}/cache"
    ds = make_cache(tmp_path / "c", TwoImages())

    async def second_part_of_col1_after_checkpoint(watch):
        if watch.parts_of("col-1.bin") < 2:
            return False
        # col-0.bin is done; its checkpoint is written by the calling thread while col-1.bin goes
        # up. Wait for it (the loop serves it meanwhile), so what the rerun may skip is certain.
        for _ in range(1000):
            if await watch.manifest_lists("col-0.bin"):
                return True
            await asyncio.sleep(0.01)
        raise AssertionError("the checkpoint after col-0.bin never appeared")

    watch = Watch(gcs_emulator, f"{bucket.name}/cache", kill=second_part_of_col1_after_checkpoint)
    with pytest.raises(OSError, match=r"(?s)^cannot reach the endpoint 127\.0\.0\.1:\d+ \(connection refused\)\n"
                                      rf"while pushing to {url} \(uploading col-1\.bin; nothing was published\)\.\n"
                                      r".*then rerun nbkit\.push\(.*\): it resumes, skipping the 1 file already "
                                      r"uploaded\.$"):
        nbkit.push(ds.root, url, storage_options=watch.storage_options(), max_workers=1)
    assert watch.killed and watch.published and not any(watch.published)

    gcs_emulator.start()  # same port, same disk
    observer = gcs_emulator.fs()
    assert not observer.exists(f"{bucket.name}/cache/{fmt.META}")
    assert not observer.exists(f"{bucket.name}/cache/col-1.bin")  # the cut upload was not committed
    with pytest.raises(FileNotFoundError, match="no complete nbkit cache"):
        nbkit.pull(url, tmp_path / "early", storage_options=gcs_emulator.storage_options)

    again = Watch(gcs_emulator, f"{bucket.name}/cache")
    report = nbkit.push(ds.root, url, storage_options=again.storage_options(), max_workers=1)
    assert report.skipped == ("col-0.bin",)  # finished and checkpointed before the kill
    assert report.transferred[0] == "col-1.bin" and report.transferred[-1] == fmt.META
    assert again.published and not any(again.published)  # not published before the last request
    assert observer.exists(f"{bucket.name}/cache/{fmt.META}")
    nbkit.pull(url, tmp_path / "copy", storage_options=gcs_emulator.storage_options)
    copy = nbkit.CachedDataset.open(tmp_path / "copy")
    src = TwoImages()
    for i in (0, 199, 399):
        assert_equal(copy[i], src[i], f"sample {i}")


def test_emulator_killed_mid_pull(tmp_path, gcs_emulator, short_gcsfs_retries, monkeypatch):
    monkeypatch.setattr(transfer, "PART", 1 << 20)  # several ranged reads per column
    bucket = gcs_emulator.make_bucket()
    url = f"{bucket.url}/cache"
    so = gcs_emulator.storage_options
    old = make_cache(tmp_path / "old", TupleSource(n=50))
    nbkit.push(old.root, url, storage_options=so)
    nbkit.pull(url, tmp_path / "dst", storage_options=so)  # an older copy, which the failed pull must leave alone
    ds = make_cache(tmp_path / "c", TwoImages())
    nbkit.push(ds.root, url, storage_options=so)

    async def second_column_read(watch):  # after the probe and the small reads: a ranged read into a column
        return sum(1 for method, url in watch.urls if method == "GET" and "col-" in url) >= 2

    watch = Watch(gcs_emulator, f"{bucket.name}/cache", kill=second_column_read)
    with pytest.raises(OSError, match=r"^cannot reach the endpoint 127\.0\.0\.1:\d+ \(connection refused\)\nwhile "
                                      r"pulling from .* \(downloading col-\d\.bin; .*/dst is unchanged\)\.\n"):
        nbkit.pull(url, tmp_path / "dst", storage_options=watch.storage_options(), max_workers=1)
    assert watch.killed
    assert len(nbkit.CachedDataset.open(tmp_path / "dst")) == 50  # the old copy, untouched
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".dst")]  # no temporary directory left


def test_killed_before_any_file_was_uploaded_says_rerun_but_not_resume(tmp_path, gcs_emulator, short_gcsfs_retries,
                                                                       monkeypatch):
    monkeypatch.setattr(transfer, "BLOCK", 1 << 20)
    bucket = gcs_emulator.make_bucket()
    ds = make_cache(tmp_path / "c", TwoImages())

    async def first_part(watch):
        return any(part for _, _, part in watch.requests)

    watch = Watch(gcs_emulator, f"{bucket.name}/cache", kill=first_part)
    with pytest.raises(OSError, match=r"(?s)^cannot reach the endpoint .*\(uploading col-\d\.bin; nothing was published\)"
                                      r"\.\n.*then rerun nbkit\.push\([^)]*\)\.$") as err:
        nbkit.push(ds.root, f"{bucket.url}/cache", storage_options=watch.storage_options(), max_workers=1)
    assert watch.killed and "resume" not in str(err.value)  # nothing was uploaded, so nothing is skipped by a rerun


def test_unreachable_endpoint_fails_at_once_naming_the_fix(tmp_path, refused_port):
    ds = make_cache(tmp_path / "c")
    nothing_listens = {"endpoint_url": f"http://127.0.0.1:{refused_port}", "token": "anon", "project": "test"}
    with pytest.raises(OSError, match=rf"(?s)^cannot reach the endpoint 127\.0\.0\.1:{refused_port} \(connection refused\)\n"
                                      r"while pushing to gs://nbkit-nowhere/c\.\nCheck the URL.*then rerun nbkit\.push\("
                                      r"[^)]*\)\.$") as err:
        nbkit.push(ds.root, "gs://nbkit-nowhere/c", storage_options=nothing_listens)
    assert isinstance(err.value.__cause__, ConnectionRefusedError)  # from the probe, not after gcsfs's retries
    with pytest.raises(OSError, match=r"(?s)^cannot reach .*\nwhile pulling from gs://nbkit-nowhere/c\..*rerun nbkit\.pull"):
        nbkit.pull("gs://nbkit-nowhere/c", tmp_path / "copy", storage_options=nothing_listens)
    assert not (tmp_path / "copy").exists()


def in_thread(fn, timeout=30):
    """``fn()``'s result or error, or ``"still running"`` after ``timeout`` s (the old code hung > 90 s)."""
    outcome = ["still running"]

    def run():
        try:
            outcome[0] = fn()
        except Exception as e:  # noqa: BLE001 - returned for the assertions
            outcome[0] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout)
    return outcome[0]


def test_an_endpoint_that_never_answers_fails_within_seconds(tmp_path, black_hole):
    ds = make_cache(tmp_path / "c")
    so = {"endpoint_url": f"http://{black_hole.address}", "token": "anon", "project": "test"}
    err = in_thread(lambda: nbkit.push(ds.root, "gs://nbkit-hole/c", storage_options=so))
    assert isinstance(err, OSError), err
    assert str(err).startswith(f"cannot reach the endpoint {black_hole.address} (it accepted the connection but did not "
                               "answer within ")
    assert "resume" not in str(err)
    err = in_thread(lambda: nbkit.pull("gs://nbkit-hole/c", tmp_path / "copy", storage_options=so))
    assert isinstance(err, OSError) and str(err).startswith("cannot reach the endpoint"), err


def test_stop_ends_a_push_waiting_for_a_silent_endpoint(tmp_path, silent_metadata, black_hole, monkeypatch):
    from nbkit.transfer import remote

    monkeypatch.setattr(remote, "CREDENTIALS_SECONDS", 300.0)
    ds = make_cache(tmp_path / "c")
    cb = Callback()
    threading.Timer(0.3, cb.request_stop).start()
    report = in_thread(lambda: nbkit.push(ds.root, "gs://nbkit-hole/c", callback=cb,
                                          storage_options={"endpoint_url": f"http://{black_hole.address}"}))
    assert isinstance(report, transfer.TransferReport) and report.stopped and report.transferred == ()


@pytest.mark.parametrize("url", ["gs://", "gs:///c"])
def test_a_url_without_a_bucket_says_so(tmp_path, url, refused_port):
    ds = make_cache(tmp_path / "c")
    so = {"endpoint_url": f"http://127.0.0.1:{refused_port}", "token": "anon"}  # never reached: refused before
    with pytest.raises(ValueError, match=r"^no bucket in the URL"):
        nbkit.push(ds.root, url, storage_options=so)
    with pytest.raises(ValueError, match=r"^no bucket in the URL"):
        nbkit.pull(url, tmp_path / "copy", storage_options=so)


def test_a_missing_bucket_is_named(tmp_path, gcs_server):
    ds = make_cache(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match=r"^the bucket 'nbkit-missing' does not exist at 127\.0\.0\.1:\d+\n"
                                                r"while pushing to gs://nbkit-missing/c\.\n"):
        nbkit.push(ds.root, "gs://nbkit-missing/c", storage_options=gcs_server.storage_options)
    with pytest.raises(FileNotFoundError, match=r"^the bucket 'nbkit-missing' does not exist"):
        nbkit.pull("gs://nbkit-missing/c", tmp_path / "copy", storage_options=gcs_server.storage_options)


def test_push_without_credentials_says_so_and_sends_nothing(tmp_path, silent_metadata, gcs, monkeypatch):
    from nbkit.transfer import remote

    monkeypatch.setattr(remote, "CREDENTIALS_SECONDS", 1.0)
    ds = make_cache(tmp_path / "c")
    err = in_thread(lambda: nbkit.push(ds.root, f"{gcs.url}/c", storage_options={"endpoint_url": gcs.emulator.endpoint}))
    assert isinstance(err, PermissionError), err
    assert str(err).startswith(f"no credentials for {gcs.url}/c") and "auth.authenticate_user()" in str(err)
    assert gcs.fs.find(gcs.name) == []


def test_objects_pushed_stay_few(tmp_path, gcs):
    ds = make_cache(tmp_path / "c", TupleSource(n=2000, shape=(1, 28, 28)))
    nbkit.push(ds.root, f"{gcs.url}/c", storage_options=gcs.storage_options)
    size = sum(os.path.getsize(os.path.join(ds.root, n)) for n in fmt.list_cache_files(ds.root))
    objects = gcs.fs.find(f"{gcs.name}/c")
    assert len(objects) <= -(-size // (64 << 20)) + 4


def test_a_plain_fsspec_callback_works(tmp_path):
    import fsspec.callbacks

    ds = make_cache(tmp_path / "c")
    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/cache"
    cb = fsspec.callbacks.Callback()
    assert nbkit.push(ds.root, url, callback=cb).bytes == cb.size == cb.value
    cb = fsspec.callbacks.Callback()
    assert nbkit.pull(url, tmp_path / "copy", callback=cb).bytes > 0
    assert cb.size == cb.value == len(ds)  # the last phase: the pulled copy's samples verified
    assert len(nbkit.CachedDataset.open(tmp_path / "copy").missing()) == 0


# -- issue 17: a bucket prefix is untrusted input ---------------------------------------------------

import hashlib

from nbkit.errors import UnsafeArchiveError


def tree_digest(path):
    out = {}
    for n in sorted(os.listdir(path)):
        with open(os.path.join(path, n), "rb") as f:
            out[n] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def pushed(tmp_path):
    """(url, fs, rroot) of a cache pushed to memory://, and a good other cache at the destination."""
    ds = make_cache(tmp_path / "src")
    url = f"memory://nbkit-tests/{uuid.uuid4().hex}/cache"
    nbkit.push(ds.root, url)
    fs, rroot = url_to_fs(url)
    good = make_cache(tmp_path / "dest" / "copy", TupleSource(n=10))
    yield url, fs, rroot, good.root, tree_digest(good.root)
    fs.rm(rroot, recursive=True)


def set_manifest(fs, rroot, edit):
    m = json.loads(fs.cat_file(f"{rroot}/manifest.json"))
    edit(m)
    fs.pipe_file(f"{rroot}/manifest.json", json.dumps(m).encode())


def assert_pull_refused(url, dest, good, exc, match):
    parent = os.path.dirname(dest)
    before = sorted(os.listdir(parent))
    with pytest.raises(exc, match=match) as info:
        nbkit.pull(url, dest)
    assert url in str(info.value)
    assert sorted(os.listdir(parent)) == before and tree_digest(dest) == good
    return info.value


def test_pull_refuses_an_object_that_is_not_a_cache_file(pushed):
    url, fs, rroot, dest, good = pushed
    fs.pipe_file(f"{rroot}/evil.py", b"raise SystemExit('pwned')\n")
    assert_pull_refused(url, dest, good, UnsafeArchiveError, "evil.py")
    fs.rm_file(f"{rroot}/evil.py")
    # ... and one the manifest lists (with its right sha256) too.
    fs.pipe_file(f"{rroot}/evil.py", b"x")
    set_manifest(fs, rroot, lambda m: m["files"].update({"evil.py": {"size": 1, "sha256": hashlib.sha256(b"x").hexdigest()}}))
    assert_pull_refused(url, dest, good, UnsafeArchiveError, "evil.py")


def test_a_manifest_size_of_2_to_the_50_fails_at_once(pushed, monkeypatch):
    url, fs, rroot, dest, good = pushed
    set_manifest(fs, rroot, lambda m: m["files"]["col-0.bin"].update(size=2**50))
    reads = []
    real = type(fs).cat_file
    monkeypatch.setattr(type(fs), "cat_file", lambda self, path, *a, **k: reads.append(path) or real(self, path, *a, **k))
    assert_pull_refused(url, dest, good, CorruptCacheError, "col-0.bin is .* bytes but its manifest says 1125899906842624")
    assert all(p.endswith("manifest.json") for p in reads)  # no range read of any data file


def test_pull_checks_every_samples_crc_and_keeps_the_previous_cache(pushed, tmp_path):
    # The manifest's sha256s agree with the damaged file: only the CRCs tell.
    url, fs, rroot, dest, good = pushed
    col = bytearray(fs.cat_file(f"{rroot}/col-0.bin"))
    col[len(col) // 3] ^= 0x10
    fs.pipe_file(f"{rroot}/col-0.bin", bytes(col))
    set_manifest(fs, rroot, lambda m: m["files"]["col-0.bin"].update(sha256=hashlib.sha256(bytes(col)).hexdigest()))
    assert_pull_refused(url, dest, good, CorruptCacheError, "fail their checksum")


def test_pull_checks_the_metadata_names_exactly_the_files(pushed):
    url, fs, rroot, dest, good = pushed
    fs.pipe_file(f"{rroot}/col-77.bin", b"x" * 8)
    set_manifest(fs, rroot, lambda m: m["files"].update({"col-77.bin": {"size": 8, "sha256": hashlib.sha256(b"x" * 8).hexdigest()}}))
    assert_pull_refused(url, dest, good, CorruptCacheError, "col-77.bin")


@pytest.mark.parametrize("bad, field", [({"size": "12"}, "size"), ({"sha256": "xyz"}, "sha256"), ({"size": -1}, "size")])
def test_a_malformed_manifest_entry_is_named_with_the_fix(pushed, bad, field):
    url, fs, rroot, dest, good = pushed
    set_manifest(fs, rroot, lambda m: m["files"]["index.bin"].update(bad))
    e = assert_pull_refused(url, dest, good, CorruptCacheError, field)
    assert "Ask whoever pushed" in str(e) and "rerun" not in str(e)


def test_pull_and_push_check_their_arguments(tmp_path):
    ds = make_cache(tmp_path / "c", warm=False)
    with pytest.raises(TypeError, match="max_workers"):
        nbkit.pull("memory://x/y", tmp_path / "d", max_workers=1.5)
    with pytest.raises(TypeError, match="max_workers"):
        nbkit.push(ds.root, "memory://x/y", max_workers="2")
    with pytest.raises(TypeError, match="cache_path"):
        nbkit.pull("memory://x/y", b"/tmp/d")
    with pytest.raises(ValueError, match="url 'gs:/bucket/c' looks like a URL with one slash"):
        nbkit.pull("gs:/bucket/c", tmp_path / "d")


def test_push_refuses_a_symlinked_file(tmp_path):
    import shutil

    ds = make_cache(tmp_path / "c")
    outside = tmp_path / "outside.bin"
    shutil.copyfile(os.path.join(ds.root, "col-0.bin"), outside)
    os.unlink(os.path.join(ds.root, "col-0.bin"))
    os.symlink(outside, os.path.join(ds.root, "col-0.bin"))
    with pytest.raises(UnsafeArchiveError, match="symbolic link"):
        nbkit.push(ds.root, f"memory://nbkit-tests/{uuid.uuid4().hex}/c")


# -- fuzzing: mutated manifest values under a memory:// prefix ---------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from test_archive import FUZZ_SOURCE, Arena, mutate_json


class PushedPrefix:
    """A small cache pushed once to memory://; each example replaces its manifest, then restores it."""

    def __init__(self, base):
        ds = nbkit.CachedDataset(FUZZ_SOURCE, os.path.join(base, "src-cache"))
        ds.warmup()
        self.url = f"memory://nbkit-tests/fuzz-{uuid.uuid4().hex}/cache"
        nbkit.push(ds.root, self.url)
        self.fs, self.rroot = url_to_fs(self.url)
        self.manifest = json.loads(self.fs.cat_file(f"{self.rroot}/manifest.json"))
        self.objects = {p: self.fs.cat_file(p) for p in self.fs.find(self.rroot)}

    def restore(self):
        for p in set(self.fs.find(self.rroot)) - set(self.objects):
            self.fs.rm_file(p)
        for p, data in self.objects.items():
            self.fs.pipe_file(p, data)

    def __repr__(self):
        return "<pushed prefix>"


@pytest.fixture(scope="module")
def pull_arena(tmp_path_factory):
    base = tmp_path_factory.mktemp("pull-arena")
    prefix = PushedPrefix(str(base))
    yield Arena(str(base), src_files=()), prefix
    prefix.fs.rm(prefix.rroot, recursive=True)


@pytest.mark.fuzz
@given(data=st.data())
def test_fuzz_pull_with_a_mutated_manifest(pull_arena, data):
    arena, prefix = pull_arena
    manifest = mutate_json(prefix.manifest, data)
    if data.draw(st.booleans(), "extra object"):
        name = data.draw(st.sampled_from(["evil.py", "col-7.bin", "heap.bin", ".nbkit-publish-lease", "sub/x"]), "object")
        prefix.fs.pipe_file(f"{prefix.rroot}/{name}", b"x" * data.draw(st.integers(0, 64), "size"))
    prefix.fs.pipe_file(f"{prefix.rroot}/manifest.json", json.dumps(manifest).encode())
    try:
        arena.check(lambda: nbkit.pull(prefix.url, arena.dest), prefix.url)
    finally:
        prefix.restore()
