"""export_tar / import_tar: round trips, reproducible bytes, remote tars, and hostile or damaged archives."""

import io
import os
import subprocess
import sys
import tarfile

import pytest

import nbkit
from fixtures_gcs import gcs, gcs_server  # noqa: F401 - pytest fixtures
from nbkit import format as fmt
from nbkit.archive import open_decompressed
from nbkit.errors import CorruptCacheError, UnsafeArchiveError
from nbkit.progress import Callback
from sources import DictSource, TupleSource, assert_equal


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    ds = nbkit.CachedDataset(DictSource(n=40), tmp_path_factory.mktemp("src") / "cache")
    ds.warmup()
    return ds.root


def assert_same_samples(path, src=None):
    src = src or DictSource(n=40)
    copy = nbkit.CachedDataset.open(path)
    assert len(copy.missing()) == 0
    for i in range(len(src)):
        assert_equal(copy[i], src[i], f"sample {i}")


@pytest.mark.parametrize("compression", [None, "gz", "zst"])
def test_round_trip_and_reproducible(tmp_path, cache, compression):
    cb = Callback()
    a, b = tmp_path / "a.tar", tmp_path / "b.tar"
    report = nbkit.export_tar(cache, a, compression=compression, callback=cb)
    assert cb.value == cb.size == report.bytes
    os.utime(os.path.join(cache, fmt.INDEX), (1, 1))  # file times must not leak into the archive
    nbkit.export_tar(cache, b, compression=compression)
    assert a.read_bytes() == b.read_bytes()
    with open(a, "rb") as raw, tarfile.open(fileobj=open_decompressed(raw), mode="r|") as tar:
        members = list(tar)
    names = [m.name for m in members]
    # The manifest first (an import knows every size before it writes), then the metadata, then the data.
    assert names[:2] == ["manifest.json", fmt.META] and names[2:] == sorted(names[2:])
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" and m.isreg() for m in members)

    report = nbkit.import_tar(a, tmp_path / "copy")
    assert report.transferred[-1] == fmt.META
    assert_same_samples(tmp_path / "copy")
    assert sorted(os.listdir(tmp_path)) == ["a.tar", "b.tar", "copy"]


def test_remote_tar_on_gcs_and_memory(tmp_path, cache, gcs):
    for url, so in ((f"{gcs.url}/exports/cache.tar.zst", gcs.storage_options), ("memory://nbkit-tests/archive/c.tar.gz", None)):
        nbkit.export_tar(cache, url, compression="zst" if url.endswith("zst") else "gz", storage_options=so)
        dest = tmp_path / url.rsplit("/", 1)[-1]
        nbkit.import_tar(url, dest, storage_options=so)
        assert_same_samples(dest)


def test_plain_tar_of_a_cache_directory_imports(tmp_path, cache):
    tar = tmp_path / "plain.tar"
    subprocess.run(["tar", "cf", str(tar), "-C", cache, "."], check=True)
    nbkit.import_tar(tar, tmp_path / "copy")
    assert_same_samples(tmp_path / "copy")


def _hostile(tmp_path, cache, kind):
    """A tar with one good file, then one unsafe member of the given kind."""
    path = tmp_path / f"{kind}.tar"
    with tarfile.open(path, "w") as tar:
        tar.add(os.path.join(cache, fmt.INDEX), arcname=fmt.INDEX)
        ti = tarfile.TarInfo("col-0.bin")
        if kind == "absolute":
            ti.name = str(tmp_path / "pwned")
        elif kind == "dotdot":
            ti.name = "../pwned"
        elif kind == "nested-dotdot":
            ti.name = "./sub/../../pwned"
        elif kind == "symlink":
            ti.type, ti.linkname = tarfile.SYMTYPE, str(tmp_path / "pwned")
        elif kind == "hardlink":
            ti.type, ti.linkname = tarfile.LNKTYPE, "/etc/passwd"
        elif kind == "chardev":
            ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
        elif kind == "blockdev":
            ti.type, ti.devmajor, ti.devminor = tarfile.BLKTYPE, 7, 0
        elif kind == "fifo":
            ti.type = tarfile.FIFOTYPE
        elif kind == "duplicate":
            ti.name = fmt.INDEX
        data = b"x" * 16 if ti.type == tarfile.REGTYPE else b""
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data))
        tar.add(os.path.join(cache, fmt.META), arcname=fmt.META)
    return path


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "nested-dotdot", "symlink", "hardlink", "chardev", "blockdev", "fifo", "duplicate"])
def test_hostile_members_are_refused(tmp_path, cache, kind):
    tar = _hostile(tmp_path, cache, kind)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(UnsafeArchiveError):
        nbkit.import_tar(tar, tmp_path / "dest" / "copy")
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["dest"])
    assert os.listdir(tmp_path / "dest") == []  # no cache, no temporary directory
    assert not (tmp_path.parent / "pwned").exists() and not (tmp_path / "pwned").exists()


def test_tampered_byte_in_tar_is_detected(tmp_path, cache):
    tar = tmp_path / "c.tar"
    nbkit.export_tar(cache, tar)
    data = bytearray(tar.read_bytes())
    with tarfile.open(tar) as t:
        col = t.getmember("col-0.bin")
    data[col.offset_data + col.size // 2] ^= 0x40
    tar.write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError, match="col-0.bin"):
        nbkit.import_tar(tar, tmp_path / "dest" / "copy")
    assert os.listdir(tmp_path / "dest") == []


def test_tampered_plain_tar_is_caught_by_sample_checksums(tmp_path, cache):
    # A tar without manifest (made with plain tar) still goes through verify() before use.
    work = tmp_path / "work"
    subprocess.run(["cp", "-r", cache, str(work)], check=True)
    with open(work / "col-0.bin", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    subprocess.run(["tar", "cf", str(tmp_path / "t.tar"), "-C", str(work), "."], check=True)
    with pytest.raises(CorruptCacheError, match="checksum"):
        nbkit.import_tar(tmp_path / "t.tar", tmp_path / "dest" / "copy")
    assert os.listdir(tmp_path / "dest") == []


def test_interrupted_import_leaves_no_cache(tmp_path, cache):
    tar = tmp_path / "c.tar"
    nbkit.export_tar(cache, tar)
    with tarfile.open(tar) as t:
        meta_offset = t.getmember(fmt.META).offset
    # Cut just before nbkit.json, and in the middle of the data.
    for cut in (meta_offset, len(tar.read_bytes()) // 2):
        (tmp_path / "cut.tar").write_bytes(tar.read_bytes()[:cut])
        with pytest.raises(CorruptCacheError):
            nbkit.import_tar(tmp_path / "cut.tar", tmp_path / "dest" / "copy")
        assert os.listdir(tmp_path / "dest") == []


def test_import_replaces_an_old_cache_but_not_other_directories(tmp_path, cache):
    old = nbkit.CachedDataset(TupleSource(n=10), tmp_path / "copy")
    old.warmup()
    tar = tmp_path / "c.tar"
    nbkit.export_tar(cache, tar)
    nbkit.import_tar(tar, tmp_path / "copy")
    assert_same_samples(tmp_path / "copy")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("keep")
    with pytest.raises(FileExistsError):
        nbkit.import_tar(tar, tmp_path / "notes")
    assert (tmp_path / "notes" / "a.txt").read_text() == "keep"


def test_stop_requested_leaves_no_tar(tmp_path, cache):
    class Stop(Callback):
        def call(self, *args, **kwargs):
            if self.value:
                self.request_stop()

    report = nbkit.export_tar(cache, tmp_path / "c.tar", callback=Stop())
    assert report.stopped and os.listdir(tmp_path) == []


def test_missing_zstandard_names_the_extra(tmp_path, cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)
    with pytest.raises(ImportError, match=r"pip install 'nbkit\[zst\]'"):
        nbkit.export_tar(cache, tmp_path / "c.tar.zst", compression="zst")
    assert os.listdir(tmp_path) == []


def test_unknown_compression_is_refused(tmp_path, cache):
    with pytest.raises(ValueError, match="compression"):
        nbkit.export_tar(cache, tmp_path / "c.tar.xz", compression="xz")


@pytest.mark.parametrize("plain", [False, True], ids=["export_tar", "plain-tar"])
def test_a_plain_fsspec_callback_works(tmp_path, cache, plain):
    import fsspec.callbacks

    tar = tmp_path / "c.tar"
    if plain:  # no manifest: import_tar checks every sample's checksum, reporting through the callback
        subprocess.run(["tar", "cf", str(tar), "-C", cache, "."], check=True)
    else:
        cb = fsspec.callbacks.Callback()
        assert nbkit.export_tar(cache, tar, callback=cb).bytes == cb.size == cb.value
    cb = fsspec.callbacks.Callback()
    nbkit.import_tar(tar, tmp_path / "copy", callback=cb)
    assert cb.value == cb.size
    assert_same_samples(tmp_path / "copy")


# -- stale_tar_reason: is a tar the cache as it is now? ------------------------------------------------


def test_stale_tar_reason_tells_partial_other_and_current_tars(tmp_path):
    from nbkit.archive import stale_tar_reason

    tar = tmp_path / "x.tar"
    assert stale_tar_reason(tar, tmp_path) == f"{tar} does not exist yet."
    ds = nbkit.CachedDataset(TupleSource(600), tmp_path / "c")
    cb = Callback()
    cb.relative_update = lambda inc=1: cb.request_stop()  # stop after the first chunk
    ds.warmup(chunk_size=200, callback=cb)
    nbkit.export_tar(ds.root, tar)  # exported while partial
    assert stale_tar_reason(tar, ds.root) is None  # it is the cache as it is now
    ds.warmup()
    assert stale_tar_reason(tar, ds.root) == (
        f"{tar} holds 200 of 600 samples; the cache now holds 600: export it again."
    )
    for compression, name in ((None, "x.tar"), ("gz", "x.tar.gz"), ("zst", "x.tar.zst")):
        nbkit.export_tar(ds.root, tmp_path / name, compression=compression)
        assert stale_tar_reason(tmp_path / name, ds.root) is None, compression

    # Another cache's tar (another dataset, or a previous run of another notebook) at the same path.
    other = nbkit.CachedDataset(TupleSource(600, shape=(1, 4, 4)), tmp_path / "other")
    other.warmup()
    nbkit.export_tar(other.root, tar)
    assert "was exported from another cache" in stale_tar_reason(tar, ds.root)

    # The same counts, another version of the samples: the index (every sample's CRC) differs.
    nbkit.export_tar(ds.root, tar)
    with open(os.path.join(ds.root, fmt.INDEX), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(ds.root, fmt.INDEX)) - 1)
        last = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([last[0] ^ 0xFF]))
    assert f"holds another version of {fmt.INDEX}" in stale_tar_reason(tar, ds.root)


def test_stale_tar_reason_of_a_plain_tar_and_of_a_damaged_one(tmp_path, cache):
    from nbkit.archive import stale_tar_reason

    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as t:
        t.add(cache, arcname="cache")
    assert "holds no manifest.json" in stale_tar_reason(plain, cache)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(CorruptCacheError, match="not a readable tar archive"):
        stale_tar_reason(junk, cache)
    url = "memory://nbkit-tests/stale/c.tar.gz"  # any fsspec URL, as export_tar writes them
    nbkit.export_tar(cache, url, compression="gz")
    assert stale_tar_reason(url, cache) is None
