"""export_tar / import_tar: round trips, reproducible bytes, remote tars, and hostile or damaged archives."""

import io
import os
import subprocess
import sys
import tarfile

import pytest

import nbkit
from fixtures_gcs import gcs, gcs_server
from nbkit import format as fmt
from nbkit.transfer.archive import open_decompressed
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
    with pytest.raises(ImportError, match=r"'zst' extra\): pip install zstandard"):
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
    from nbkit.transfer.archive import stale_tar_reason

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
    from nbkit.transfer.archive import stale_tar_reason

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


# -- issue 17: a tar is untrusted input -------------------------------------------------------------

import errno
import gzip
import hashlib
import json
import pathlib
import shutil

from nbkit.transfer.manifest import MANIFEST, manifest_bytes, new_manifest


def tree_digest(path):
    """name -> sha256 of every file under ``path`` (to show a cache is byte-for-byte unchanged)."""
    out = {}
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def good_dest(tmp_path):
    """A good cache at the destination (another one than ``cache``), and its digest."""
    ds = nbkit.CachedDataset(TupleSource(n=10), tmp_path / "dest" / "copy")
    ds.warmup()
    return ds.root, tree_digest(ds.root)


def cache_files(root):
    return {n: open(os.path.join(root, n), "rb").read() for n in os.listdir(root) if n != fmt.LOCK}


def make_tar(path, files, *, order=None, manifest=True, compression=None, stored_length=(40, 40)):
    """A tar of ``files`` (name -> bytes) with a manifest consistent with them, first by default."""
    members = dict(files)
    if manifest:
        entries = {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}
        members[MANIFEST] = manifest_bytes(new_manifest(entries, *stored_length))
    order = order or ([MANIFEST] if manifest else []) + sorted(files)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in order:
            ti = tarfile.TarInfo(name)
            ti.size = len(members[name])
            tar.addfile(ti, io.BytesIO(members[name]))
    data = buf.getvalue()
    if compression == "gz":
        data = gzip.compress(data, mtime=0)
    elif compression == "zst":
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def assert_refused(tar, dest, good, exc, match):
    parent = os.path.dirname(dest)
    before = sorted(os.listdir(parent))
    with pytest.raises(exc, match=match) as info:
        nbkit.import_tar(tar, dest)
    assert str(tar) in str(info.value)
    assert sorted(os.listdir(parent)) == before  # no temporary directory left, nothing else written
    assert tree_digest(dest) == good  # the previous cache, byte for byte
    return info.value


def test_a_member_that_is_not_a_cache_file_is_refused(tmp_path, cache, good_dest):
    # Problem 1: evil.py next to nbkit.json could be imported by a namedtuple's module name.
    dest, good = good_dest
    for order in ("first", "last"):
        files = cache_files(cache)
        files["evil.py"] = b"raise SystemExit('pwned')\n"
        tar = make_tar(tmp_path / f"evil-{order}.tar", files, manifest=False,
                       order=(["evil.py"] + sorted(cache_files(cache))) if order == "first" else None)
        e = assert_refused(tar, dest, good, UnsafeArchiveError, "evil.py")
        assert "not one of an nbkit cache's files" in str(e)
    assert not any("evil" in n for _, _, ns in os.walk(tmp_path / "dest") for n in ns)


def test_samples_failing_their_crc_keep_the_previous_cache(tmp_path, cache, good_dest):
    # Problem 3: the manifest's sha256s agree with the damaged files; only the CRCs tell.
    dest, good = good_dest
    files = cache_files(cache)
    col = bytearray(files["col-0.bin"])
    col[len(col) // 3] ^= 0x10
    files["col-0.bin"] = bytes(col)
    tar = make_tar(tmp_path / "crc.tar", files)
    assert_refused(tar, dest, good, CorruptCacheError, "fail their checksum")


def test_metadata_must_agree_with_the_files(tmp_path, cache, good_dest):
    dest, good = good_dest
    files = cache_files(cache)
    short = dict(files, **{"col-0.bin": files["col-0.bin"][:-8]})  # consistent manifest, wrong size for nbkit.json
    assert_refused(make_tar(tmp_path / "short.tar", short), dest, good, CorruptCacheError, "col-0.bin")
    extra = dict(files, **{"col-77.bin": b"x" * 16})  # a column file nbkit.json does not name
    assert_refused(make_tar(tmp_path / "extra.tar", extra), dest, good, CorruptCacheError, "col-77.bin")
    missing = {n: b for n, b in files.items() if n != "col-1.bin"}
    assert_refused(make_tar(tmp_path / "missing.tar", missing), dest, good, CorruptCacheError, "col-1.bin")


def test_a_tar_with_the_manifest_last_or_none_still_imports(tmp_path, cache):
    files = cache_files(cache)
    for manifest, order in ((True, sorted(files) + [MANIFEST]), (False, None)):
        tar = make_tar(tmp_path / f"old-{manifest}.tar", files, manifest=manifest, order=order)
        nbkit.import_tar(tar, tmp_path / f"copy-{manifest}")
        assert_same_samples(tmp_path / f"copy-{manifest}")


def _header(name, size, type=tarfile.REGTYPE, pax=None):
    ti = tarfile.TarInfo(name)
    ti.size, ti.type = size, type
    if pax:
        ti.pax_headers = pax
    return ti.tobuf(tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT)


@pytest.mark.parametrize("kind", ["gnu-type-S", "pax-0.0", "pax-0.1", "pax-1.0"])
def test_sparse_members_are_refused(tmp_path, good_dest, kind):
    # Problem 5: a small sparse member can claim far more than the disk holds.
    dest, good = good_dest
    big = str(1 << 50)
    if kind == "gnu-type-S":
        head = _header("col-0.bin", 512, tarfile.GNUTYPE_SPARSE)
    else:
        pax = {"pax-0.0": {"GNU.sparse.size": big, "GNU.sparse.numblocks": "1", "GNU.sparse.offset": "0",
                           "GNU.sparse.numbytes": "512"},
               "pax-0.1": {"GNU.sparse.size": big, "GNU.sparse.map": "0,512"},
               "pax-1.0": {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": big,
                           "GNU.sparse.name": "col-0.bin"}}[kind]
        head = _header("col-0.bin", 512, pax=pax)
    tar = tmp_path / "sparse.tar"
    tar.write_bytes(head + b"1\n512\n".ljust(512, b"\0") + b"\0" * 512 + b"\0" * 1024)
    assert_refused(tar, dest, good, UnsafeArchiveError, "sparse")


def test_a_real_gnu_tar_sparse_file_is_refused(tmp_path, good_dest):
    dest, good = good_dest
    work = tmp_path / "work"
    work.mkdir()
    with open(work / "col-0.bin", "wb") as f:
        f.truncate(1 << 30)  # 1 GiB of holes: a tar of a few KiB
        f.write(b"x")
    for fmt_ in ("gnu", "posix"):
        tar = tmp_path / f"sparse-{fmt_}.tar"
        subprocess.run(["tar", "--sparse", f"--format={fmt_}", "-cf", str(tar), "-C", str(work), "col-0.bin"], check=True)
        assert os.path.getsize(tar) < 1 << 20
        assert_refused(tar, dest, good, UnsafeArchiveError, "sparse")


def test_a_gzip_bomb_is_refused_before_anything_is_written(tmp_path, good_dest, monkeypatch):
    dest, good = good_dest
    free = shutil.disk_usage(tmp_path).free
    # A header claiming more than the disk holds, then zeros that compress 1000:1.
    data = _header("col-0.bin", free + (1 << 30)) + b"\0" * (8 << 20)
    tar = tmp_path / "bomb.tar.gz"
    tar.write_bytes(gzip.compress(data, mtime=0))
    written = []
    real_open = open

    def spy(file, mode="r", *a, **k):
        if "w" in mode or "x" in mode:
            written.append(file)
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr("builtins.open", spy)
    e = assert_refused(tar, dest, good, OSError, "free")
    assert e.errno == errno.ENOSPC
    assert not written
    # With a manifest first, a member larger than its entry is refused before it is written.
    files = {"index.bin": b"\0" * 24}
    entries = {"index.bin": {"size": 24, "sha256": "0" * 64}}
    head = manifest_bytes(new_manifest(entries, 0, 1))
    body = _header(MANIFEST, len(head)) + head.ljust(-(-len(head) // 512) * 512, b"\0") + _header("index.bin", 1 << 30)
    tar2 = tmp_path / "bomb2.tar.gz"
    tar2.write_bytes(gzip.compress(body + b"\0" * (4 << 20), mtime=0))
    assert_refused(tar2, dest, good, CorruptCacheError, "says 24")
    assert not written
    del files


@pytest.mark.parametrize("compression", [None, "gz", "zst"])
def test_truncated_or_fake_compressed_tars_are_named(tmp_path, cache, good_dest, compression):
    dest, good = good_dest
    tar = tmp_path / f"c.tar{'.' + compression if compression else ''}"
    nbkit.export_tar(cache, tar, compression=compression)
    data = tar.read_bytes()
    # (A plain tar cut in its end-of-archive padding still holds the whole cache.)
    for cut in (len(data) // 2, 10) + ((len(data) - 7,) if compression else ()):
        tar.write_bytes(data[:cut])
        assert_refused(tar, dest, good, CorruptCacheError, "export it again")
    magic = {None: b"", "gz": b"\x1f\x8b", "zst": b"\x28\xb5\x2f\xfd"}[compression]
    tar.write_bytes(magic + b"this is not a tar at all" * 50)
    assert_refused(tar, dest, good, CorruptCacheError, "not a readable tar")


def test_a_damaged_manifest_is_named_with_the_fix(tmp_path, cache, good_dest):
    dest, good = good_dest
    files = cache_files(cache)
    for bad, match in (({"size": "12", "sha256": "0" * 64}, "size"), ({"size": 1, "sha256": "xyz"}, "sha256"),
                       ({"size": -1, "sha256": "0" * 64}, "size")):
        manifest = json.loads(manifest_bytes(new_manifest(
            {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}, 40, 40)))
        manifest["files"]["index.bin"] = bad
        members = dict(files, **{MANIFEST: json.dumps(manifest).encode()})
        tar = make_tar(tmp_path / "m.tar", members, manifest=False, order=[MANIFEST] + sorted(files))
        e = assert_refused(tar, dest, good, CorruptCacheError, match)
        assert "Ask whoever exported it" in str(e) and "rerun" not in str(e)


def test_arguments_are_checked_naming_them(tmp_path, cache):
    with pytest.raises(TypeError, match="tar_path"):
        nbkit.import_tar(b"/tmp/x.tar", tmp_path / "c")
    with pytest.raises(TypeError, match="cache_path"):
        nbkit.import_tar(tmp_path / "x.tar", 3)
    with pytest.raises(ValueError, match="tar_path 'gs:/bucket/c.tar' looks like a URL with one slash"):
        nbkit.export_tar(cache, "gs:/bucket/c.tar")
    with pytest.raises(FileNotFoundError, match="tar_path"):
        nbkit.import_tar(tmp_path / "absent.tar", tmp_path / "c")
    with pytest.raises(ValueError, match="compression"):
        nbkit.export_tar(cache, tmp_path / "c.tar", compression=3)


def test_export_sends_only_cache_files_and_refuses_a_symlink(tmp_path, cache):
    work = tmp_path / "work"
    shutil.copytree(cache, work)
    (work / "notes.txt").write_text("private")
    tar = tmp_path / "c.tar"
    nbkit.export_tar(work, tar)
    with tarfile.open(tar) as t:
        assert "notes.txt" not in t.getnames()
    outside = tmp_path / "outside.bin"
    shutil.copyfile(work / "col-0.bin", outside)
    os.unlink(work / "col-0.bin")
    os.symlink(outside, work / "col-0.bin")
    with pytest.raises(UnsafeArchiveError, match="symbolic link"):
        nbkit.export_tar(work, tmp_path / "d.tar")
    assert not (tmp_path / "d.tar").exists()


def test_stale_tar_reason_reads_only_the_head(tmp_path, cache):
    from nbkit.transfer.archive import stale_tar_reason

    tar = tmp_path / "c.tar"
    nbkit.export_tar(cache, tar)
    with tarfile.open(tar) as t:
        cut = t.getmember(fmt.META).offset  # the manifest is all that is left
    tar.write_bytes(tar.read_bytes()[:cut])
    assert stale_tar_reason(tar, cache) is None


# -- fuzzing: mutated tar bytes and manifest values --------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

FUZZ_SOURCE = TupleSource(n=6, shape=(2, 3))


@pytest.fixture(scope="module")
def fuzz_cache(tmp_path_factory):
    """A small cache (a fixed-shape column, labels and a free-form heap would all be there in a
    bigger one; this one has index, two columns and metadata), its plain tar, and its files."""
    ds = nbkit.CachedDataset(FUZZ_SOURCE, tmp_path_factory.mktemp("fuzz") / "cache")
    ds.warmup()
    tar = tmp_path_factory.mktemp("fuzz-tar") / "c.tar"
    nbkit.export_tar(ds.root, tar)
    return Quiet((ds.root, tar.read_bytes(), cache_files(ds.root)))


class Quiet(tuple):
    def __repr__(self):  # hypothesis prints the arguments of a failing example
        return "<fuzz cache>"


class Arena:
    """A directory holding a good previous cache at ``dest``: each example imports into it and checks
    the outcome, then puts the good cache back."""

    def __init__(self, base, src_files=("fuzz.tar",)):
        self.base = base
        self.pristine = os.path.join(base, "pristine")
        ds = nbkit.CachedDataset(TupleSource(n=3, shape=(2, 3)), self.pristine)
        ds.warmup()
        self.good = tree_digest(self.pristine)
        self.parent = os.path.join(base, "work")
        self.dest = os.path.join(self.parent, "copy")
        shutil.copytree(self.pristine, self.dest)
        self.src = os.path.join(base, "src")  # where the tar under test lies, alone
        os.makedirs(self.src)
        self.tar = os.path.join(self.src, "fuzz.tar")
        self.listing = sorted(os.listdir(base)), sorted(os.listdir(self.parent)), list(src_files)

    def __repr__(self):
        return "<arena>"

    def check(self, run, source_name):
        """``run()`` imports or pulls into ``dest``: correct samples, or an nbkit error naming the source."""
        from hypothesis import event

        try:
            run()
        except (CorruptCacheError, UnsafeArchiveError, FileNotFoundError) as e:
            event(type(e).__name__)  # --hypothesis-show-statistics shows how the examples ended
            assert source_name in str(e), str(e)
            assert tree_digest(self.dest) == self.good
        except OSError as e:  # a size past the free disk: refused before writing
            assert e.errno == errno.ENOSPC and source_name in str(e), repr(e)
            assert tree_digest(self.dest) == self.good
        else:
            event("imported")
            copy = nbkit.CachedDataset.open(self.dest)
            assert len(copy) == len(FUZZ_SOURCE) and len(copy.missing()) == 0
            for i in range(len(FUZZ_SOURCE)):
                assert_equal(copy[i], FUZZ_SOURCE[i], f"sample {i}")
            shutil.rmtree(self.dest)
            shutil.copytree(self.pristine, self.dest)
        # Nothing written beside the destination or the source, no temporary directory left behind.
        assert (sorted(os.listdir(self.base)), sorted(os.listdir(self.parent)), os.listdir(self.src)) == self.listing


@pytest.fixture(scope="module")
def arena(tmp_path_factory):
    return Arena(str(tmp_path_factory.mktemp("arena")))


def _fix_checksum(data: bytearray, at: int) -> None:
    block = bytearray(data[at:at + 512])
    block[148:156] = b" " * 8
    data[at + 148:at + 156] = b"%06o\0 " % sum(block)


def _compress(data: bytes, compression) -> bytes:
    if compression == "gz":
        return gzip.compress(data, mtime=0)
    if compression == "zst":
        import zstandard

        return zstandard.ZstdCompressor().compress(data)
    return data


FIELDS = {"name": (0, 100), "mode": (100, 108), "size": (124, 136), "chksum": (148, 156), "type": (156, 157),
          "linkname": (157, 257), "magic": (257, 265), "pad": (500, 512), "anywhere": (0, 1024)}


@pytest.mark.fuzz
@given(compression=st.sampled_from([None, "gz", "zst"]), data=st.data())
def test_fuzz_tar_bytes(fuzz_cache, arena, compression, data):
    _, plain, _ = fuzz_cache
    with tarfile.open(fileobj=io.BytesIO(plain)) as t:
        offsets = [m.offset for m in t.getmembers()]
    tar_bytes = bytearray(plain)
    for _ in range(data.draw(st.integers(1, 3), "header edits")):
        at = data.draw(st.sampled_from(offsets), "member")
        field = data.draw(st.sampled_from(sorted(FIELDS)), "field")
        lo, hi = FIELDS[field]
        if field == "size" and data.draw(st.booleans(), "numeric size"):
            value = b"%011o\0" % data.draw(st.sampled_from([0, 1, 7, 511, 512, 4096, 8**11 - 1]), "size")
            tar_bytes[at + lo:at + hi] = value
        elif field == "type":
            tar_bytes[at + lo] = data.draw(st.sampled_from(b"0123456789SxgLK\0A"), "type")
        elif field == "name":
            name = data.draw(st.sampled_from([b"evil.py", b"../x", b"/etc/x", b"index.bin", b"col-0.bin", b"col-9.bin",
                                              b"./", b"a/b", b"nbkit.json", b"manifest.json"]), "name")
            tar_bytes[at:at + 100] = name.ljust(100, b"\0")
        else:
            pos = at + data.draw(st.integers(lo, hi - 1), "offset")
            if pos < len(tar_bytes):
                tar_bytes[pos] = data.draw(st.integers(0, 255), "byte")
        if data.draw(st.booleans(), "fix checksum") and at + 512 <= len(tar_bytes):
            _fix_checksum(tar_bytes, at)
    raw = bytearray(_compress(bytes(tar_bytes), compression))
    for _ in range(data.draw(st.integers(0, 2), "flips after compression")):
        pos = data.draw(st.integers(0, len(raw) - 1), "flip at")
        raw[pos] ^= 1 << data.draw(st.integers(0, 7), "bit")
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))), "cut")
    with open(arena.tar, "wb") as f:
        f.write(bytes(raw[:cut]))
    arena.check(lambda: nbkit.import_tar(arena.tar, arena.dest), arena.tar)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.sampled_from([0, 1, -1, 6, 2**50, 2**63, 10**30]) | st.integers()
    | st.floats(allow_nan=True) | st.text(max_size=20) | st.sampled_from(["0" * 64, "evil.py", "col-7.bin", "../x"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def mutate_json(manifest: dict, data) -> dict:
    """One hypothesis-chosen change to a manifest: a value replaced, a key removed or renamed."""
    paths = []

    def walk(node, path):
        for k, v in node.items():
            paths.append(path + (k,))
            if isinstance(v, dict):
                walk(v, path + (k,))

    walk(manifest, ())
    m = json.loads(json.dumps(manifest))
    for _ in range(data.draw(st.integers(1, 2), "changes")):
        path = data.draw(st.sampled_from(paths), "path")
        node = m
        try:
            for k in path[:-1]:
                node = node[k]
            key = path[-1]
            node[key]
        except (KeyError, TypeError):
            continue
        how = data.draw(st.sampled_from(["value", "delete", "rename", "same"]), "how")
        if how == "same":  # a manifest written differently (key order, spacing) but meaning the same
            continue
        if how == "value":
            node[key] = data.draw(JSON_VALUES, "value")
        elif how == "delete":
            del node[key]
        else:
            node[data.draw(st.sampled_from(["evil.py", "col-7.bin", "../x", "heap.bin", "", "nbkit.json"]) | st.text(max_size=12), "new key")] = node.pop(key)
    return m


@pytest.mark.fuzz
@given(data=st.data())
def test_fuzz_manifest_values_in_a_tar(fuzz_cache, arena, data):
    root, _, files = fuzz_cache
    from nbkit.transfer.manifest import build_manifest

    manifest = mutate_json(build_manifest(root), data)
    members = dict(files, **{MANIFEST: json.dumps(manifest).encode()})
    first = data.draw(st.booleans(), "manifest first")
    order = [MANIFEST] + sorted(files) if first else sorted(files) + [MANIFEST]
    make_tar(pathlib.Path(arena.tar), members, manifest=False, order=order)
    arena.check(lambda: nbkit.import_tar(arena.tar, arena.dest), arena.tar)


def test_metadata_claiming_a_huge_length_fails_before_anything_is_allocated(tmp_path, cache, good_dest):
    # The index's real size bounds the length: nothing is sized by the metadata's word alone.
    dest, good = good_dest
    files = cache_files(cache)
    for field, value in (("length", 10**15), ("capacity", 10**15), ("length", -1), ("length", "40")):
        meta = json.loads(files[fmt.META])
        meta[field] = value
        bad = dict(files, **{fmt.META: json.dumps(meta).encode()})
        assert_refused(make_tar(tmp_path / "huge.tar", bad), dest, good, CorruptCacheError, "nbkit.json")


def test_partial_and_budgeted_caches_import_and_their_damage_is_found(tmp_path):
    # The full check covers every stored sample, wherever its row is (gaps, a byte budget's slots).
    src = TupleSource(n=300, shape=(1, 4, 4))
    for name, kw, take in (("partial", {}, [0, 5, 7, 100, 101, 102, 299]), ("budget", {"max_bytes": 20000}, range(300))):
        ds = nbkit.CachedDataset(src, tmp_path / name, **kw)
        ds[list(take)]
        tar = tmp_path / f"{name}.tar"
        nbkit.export_tar(ds.root, tar)
        nbkit.import_tar(tar, tmp_path / f"{name}-copy")
        copy = nbkit.CachedDataset.open(tmp_path / f"{name}-copy")
        assert len(copy.missing()) == len(ds.missing())
        files = cache_files(ds.root)
        col = bytearray(files["col-0.bin"])
        row = 16 * 4
        slot = 101 if name == "partial" else 3
        col[slot * row + 1] ^= 0xFF
        with pytest.raises(CorruptCacheError, match="fail their checksum"):
            nbkit.import_tar(make_tar(tmp_path / f"{name}-bad.tar", dict(files, **{"col-0.bin": bytes(col)})),
                             tmp_path / f"{name}-copy")


def test_a_tar_of_thousands_of_empty_members_is_refused_at_the_bound(tmp_path, cache, good_dest):
    # Issue 25: 200,000 empty skipped members kept import_tar busy for minutes. A cache has at most
    # a few thousand files, so a tar with more members is refused at the first one past the bound.
    from nbkit.transfer.archive import stale_tar_reason
    from nbkit.trust import MAX_COLUMNS

    bound = 4 + MAX_COLUMNS + 2  # every file a cache can have, then ./ and heap.lock
    dest, good = good_dest
    plain = make_tar(tmp_path / "plain.tar", cache_files(cache), manifest=False).read_bytes()
    for skipped in (_header(fmt.LOCK, 0), _header("./", 0, tarfile.DIRTYPE)):
        tar = tmp_path / "many.tar"
        tar.write_bytes(skipped * (bound + 50) + plain)
        e = assert_refused(tar, dest, good, UnsafeArchiveError, f"more than {bound:,} members")
        assert f"refused at member {bound + 1:,}" in str(e) and "export it again" in str(e)
        with pytest.raises(UnsafeArchiveError, match="members"):
            stale_tar_reason(tar, cache)
    # With the manifest first, the bound is the files it lists: a handful of extra entries is enough.
    files = cache_files(cache)
    fine = make_tar(tmp_path / "fine.tar", files).read_bytes()
    with tarfile.open(fileobj=io.BytesIO(fine)) as t:
        after_manifest = t.getmember(fmt.META).offset
    tar = tmp_path / "after-manifest.tar"
    tar.write_bytes(fine[:after_manifest] + _header(fmt.LOCK, 0) * 10 + fine[after_manifest:])
    assert_refused(tar, dest, good, UnsafeArchiveError, f"the {len(files) + 1} files its manifest names")
    # A plain tar of a cache directory (./ and heap.lock included) still imports.
    tar = tmp_path / "ok.tar"
    tar.write_bytes(_header("./", 0, tarfile.DIRTYPE) + _header(fmt.LOCK, 0) + plain)
    nbkit.import_tar(tar, tmp_path / "ok")
    assert_same_samples(tmp_path / "ok")


def test_stop_is_honoured_on_every_member_skipped_ones_too(tmp_path, cache, good_dest):
    # Issue 25: Stop was read only while a member's data was copied, so a run of empty skipped
    # members (or a refused one after them) went on regardless.
    dest, good = good_dest

    class StopAtStart(Callback):
        def set_description(self, text):
            super().set_description(text)
            if text.startswith("importing"):
                self.request_stop()

    files = cache_files(cache)
    files["evil.py"] = b"raise SystemExit('pwned')\n"
    plain = make_tar(tmp_path / "plain.tar", files, manifest=False, order=["evil.py"] + sorted(cache_files(cache)))
    tar = tmp_path / "skipped-then-evil.tar"
    tar.write_bytes(_header(fmt.LOCK, 0) * 1000 + plain.read_bytes())
    parent = os.path.dirname(dest)
    before = sorted(os.listdir(parent))
    report = nbkit.import_tar(tar, dest, callback=StopAtStart())
    assert report.stopped and report.transferred == ()
    assert sorted(os.listdir(parent)) == before and tree_digest(dest) == good


def test_a_long_chain_of_extended_headers_is_refused_not_a_recursion_error(tmp_path, good_dest):
    # tarfile reads the header after a long-name or pax header by recursing: thousands in a row
    # ended in a RecursionError instead of an nbkit error.
    dest, good = good_dest
    for kind in (tarfile.GNUTYPE_LONGNAME, tarfile.XHDTYPE):
        body = b"heap.lock\0" if kind == tarfile.GNUTYPE_LONGNAME else b"18 path=heap.lock\n"
        link = _header("././@LongLink", len(body), kind) + body.ljust(512, b"\0")
        tar = tmp_path / "chain.tar"
        tar.write_bytes(link * 3000 + _header(fmt.LOCK, 0) + b"\0" * 1024)
        assert_refused(tar, dest, good, UnsafeArchiveError, "more than 8 extended headers in a row")


@pytest.mark.parametrize("name, magic", [("c.tar.gz", b"\x1f\x8b"), ("c.tgz", b"\x1f\x8b"),
                                         ("c.tar.zst", b"\x28\xb5\x2f\xfd"), ("c.tar", b"")])
def test_the_tar_s_name_chooses_its_compression(tmp_path, cache, name, magic):
    """`nbkit export cache c.tar.gz` writes gzip, as its name says (it wrote a plain tar before)."""
    tar = tmp_path / name
    nbkit.export_tar(cache, tar)
    head = tar.read_bytes()[:4]
    assert head.startswith(magic) and (magic or head not in (b"\x1f\x8b", b"\x28\xb5\x2f\xfd"))
    nbkit.import_tar(tar, tmp_path / "back")
    assert nbkit.CachedDataset.open(tmp_path / "back").verify() is not None
    plain = tmp_path / ("plain-" + name)
    nbkit.export_tar(cache, plain, compression=None)  # None: no compression, whatever the name
    assert not plain.read_bytes()[:2] == b"\x1f\x8b"
