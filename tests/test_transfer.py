"""push / pull: one shared suite over a local directory, memory:// and the GCS emulator, then the
failure cases that need a real server (killed mid-push, tampered object)."""

import os

import pytest
import torch

import nbkit
from fixtures_gcs import gcs, gcs_emulator, gcs_server  # noqa: F401 - pytest fixtures
from nbkit import format as fmt
from nbkit import transfer
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
    """(url, storage_options, fs-listing function) for each backend of the shared suite."""
    import uuid

    if request.param == "local":
        return str(tmp_path / "remote" / "cache"), None
    if request.param == "memory":
        return f"memory://nbkit-tests/{uuid.uuid4().hex}/cache", None
    bucket = request.getfixturevalue("gcs")
    return f"{bucket.url}/caches/cache", bucket.storage_options


def remote_names(url, storage_options):
    fs, root = transfer._fs(url, storage_options)
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
    expected = sorted(fmt.list_cache_files(ds.root) + [transfer.MANIFEST])
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
    fs, root = transfer._fs(url, so)
    fs.rm_file(f"{root}/{fmt.META}")
    with pytest.raises(FileNotFoundError, match="no complete nbkit cache"):
        nbkit.pull(url, tmp_path / "copy", storage_options=so)
    assert not (tmp_path / "copy").exists()


def test_tampered_byte_is_detected_on_pull(tmp_path, remote):
    url, so = remote
    ds = make_cache(tmp_path / "c", TupleSource(n=50))
    nbkit.push(ds.root, url, storage_options=so)
    fs, root = transfer._fs(url, so)
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


def test_emulator_killed_mid_push(tmp_path, gcs_emulator, monkeypatch):
    """Kill the server while a file is being uploaded: a clear error, the prefix is never a cache
    before the push is whole, and the rerun skips what the first run finished."""
    # Small blocks, so the second column is a multi-request resumable upload in flight at the kill.
    monkeypatch.setattr(transfer, "BLOCK", 1 << 20)
    bucket = gcs_emulator.make_bucket()
    url, so = f"{bucket.url}/cache", bucket.storage_options
    ds = make_cache(tmp_path / "c", TwoImages())
    first_file = os.path.getsize(os.path.join(ds.root, "col-0.bin"))
    observer = gcs_emulator.fs()
    meta_path = f"{bucket.name}/cache/{fmt.META}"
    seen = []

    class KillOnce(Callback):
        killed = False

        def call(self, *args, **kwargs):
            if self.size and self.value < self.size and gcs_emulator.running:
                observer.invalidate_cache()
                seen.append(observer.exists(meta_path))
            if not KillOnce.killed and self.value > first_file + (3 << 20):
                KillOnce.killed = True
                gcs_emulator.kill()
                gcs_emulator.start()  # same port, same disk: the upload session in flight is gone

    with pytest.raises(OSError, match=r"failed while uploading col-1\.bin.*Rerun nbkit\.push"):
        nbkit.push(ds.root, url, callback=KillOnce(), storage_options=so, max_workers=1)
    assert KillOnce.killed and seen and not any(seen)
    observer.invalidate_cache()
    assert not observer.exists(meta_path)
    with pytest.raises(FileNotFoundError):
        nbkit.pull(url, tmp_path / "early", storage_options=so)

    seen.clear()
    report = nbkit.push(ds.root, url, callback=KillOnce(), storage_options=so, max_workers=1)
    assert "col-0.bin" in report.skipped and "col-1.bin" in report.transferred
    assert seen and not any(seen)
    nbkit.pull(url, tmp_path / "copy", storage_options=so)
    copy = nbkit.CachedDataset.open(tmp_path / "copy")
    src = TwoImages()
    for i in (0, 199, 399):
        assert_equal(copy[i], src[i], f"sample {i}")


def test_objects_pushed_stay_few(tmp_path, gcs):
    ds = make_cache(tmp_path / "c", TupleSource(n=2000, shape=(1, 28, 28)))
    nbkit.push(ds.root, f"{gcs.url}/c", storage_options=gcs.storage_options)
    size = sum(os.path.getsize(os.path.join(ds.root, n)) for n in fmt.list_cache_files(ds.root))
    objects = gcs.fs.find(f"{gcs.name}/c")
    assert len(objects) <= -(-size // (64 << 20)) + 4
