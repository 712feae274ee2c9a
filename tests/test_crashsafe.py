"""The crash windows issue 25 named, one test each: every one failed before nbkit.commit (the one
commit protocol) and passes now. The crash-point harness (tests/crash, docs/CRASH.md) checks every
file-system call of every operation; these pin the named examples down in plain unit tests."""

import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import nbkit
from nbkit import commit, disk
from nbkit import format as fmt
from nbkit.errors import CorruptCacheError, DiskFullError, UnsafeArchiveError
from nbkit.text import speaking_to


def source(offset: float, n: int = 64):
    """Two sources of the same shape and dtypes whose values differ (offset)."""
    return torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32) + offset, torch.arange(n) % 10)


def values(ds) -> list:
    return [float(ds[i][0]) for i in range(len(ds))]


@pytest.fixture
def old_cache(tmp_path):
    # A private $NBKIT_CACHE_DIR: nbkit.caches() lists the working copies there too, and other tests'
    # remote caches leave theirs in the run's shared one. Not monkeypatch's: the tests undo its patches.
    shared = os.environ["NBKIT_CACHE_DIR"]
    os.environ["NBKIT_CACHE_DIR"] = str(tmp_path / "working-copies")
    try:
        ds = nbkit.CachedDataset(source(0.0), tmp_path / "c")
        ds.warmup()
        root = ds.root
        del ds
        yield root
    finally:
        os.environ["NBKIT_CACHE_DIR"] = shared


# -- removal: never adopted ---------------------------------------------------------------------


@pytest.mark.parametrize("how", ["killed after the metadata went", "nbkit.json deleted by hand"])
def test_data_files_without_metadata_are_never_adopted(old_cache, how):
    if how.startswith("killed"):
        # What a kill between remove's first step and its data files leaves.
        with commit.Dir(old_cache) as d:
            d.rename(fmt.META, commit.staging_name(fmt.META, "trash"))
        assert disk.caches(os.path.dirname(old_cache))[0].leftover
    else:
        os.unlink(os.path.join(old_cache, fmt.META))
    new = nbkit.CachedDataset(source(1000.0), old_cache)
    assert new.store.stored_count() == 0  # nothing of the old source is taken for stored
    assert values(new) == [float(v) for v in source(1000.0).tensors[0]]
    assert not [n for n in os.listdir(old_cache) if n.startswith(".")]  # markers gone once it is a cache again


def test_remove_marks_first_and_a_crash_leaves_a_listed_removable_leftover(old_cache, monkeypatch):
    from nbkit import cachedir

    def die(d):
        raise KeyboardInterrupt("killed")  # after the marker, before the data files

    monkeypatch.setattr(cachedir, "_remove_data", die)
    with pytest.raises(KeyboardInterrupt):
        nbkit.remove(old_cache)
    monkeypatch.undo()
    (info,) = disk.caches(os.path.dirname(old_cache))
    assert info.leftover and "interrupted removal" in info.problem and info.path == old_cache
    with pytest.raises(FileNotFoundError):
        nbkit.CachedDataset.open(old_cache)
    assert nbkit.remove(old_cache).left == ()
    assert not os.path.exists(old_cache)


# -- swap: a whole cache at the path at every instant ------------------------------------------


def test_swap_fallback_killed_between_renames_is_recovered_on_open(old_cache, tmp_path, monkeypatch):
    tar = str(tmp_path / "new.tar")
    newer = nbkit.CachedDataset(source(1000.0), tmp_path / "other")
    newer.warmup()
    nbkit.export_tar(newer.root, tar)
    monkeypatch.setattr(commit, "_exchange", lambda *a: False)  # a kernel without renameat2
    real = commit.Dir.rename
    calls = []

    def rename(self, src, dst, **kw):
        calls.append((src, dst))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the two renames")
        return real(self, src, dst, **kw)

    monkeypatch.setattr(commit.Dir, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        nbkit.import_tar(tar, old_cache)
    monkeypatch.undo()
    assert not os.path.exists(old_cache)  # the crash window: nothing at the path...
    ds = nbkit.CachedDataset.open(old_cache)  # ...until the next open puts the old whole cache back
    assert values(ds) == [float(v) for v in source(0.0).tensors[0]]


def test_swap_exchanges_in_one_step_where_the_kernel_can(old_cache, tmp_path, monkeypatch):
    if commit._renameat2() is None:
        pytest.skip("this libc has no renameat2 (the fallback is tested above)")
    tar = str(tmp_path / "new.tar")
    newer = nbkit.CachedDataset(source(1000.0), tmp_path / "other")
    newer.warmup()
    nbkit.export_tar(newer.root, tar)
    seen = []
    real = commit._exchange

    def exchange(fd, a, b):
        seen.append(os.path.exists(old_cache))
        ok = real(fd, a, b)
        seen.append(os.path.exists(os.path.join(old_cache, fmt.META)))
        return ok

    monkeypatch.setattr(commit, "_exchange", exchange)
    nbkit.import_tar(tar, old_cache)
    assert seen == [True, True]
    assert values(nbkit.CachedDataset.open(old_cache)) == [float(v) for v in source(1000.0).tensors[0]]


def test_import_and_pull_sync_every_file_before_the_swap(old_cache, tmp_path, monkeypatch):
    newer = nbkit.CachedDataset(source(1000.0), tmp_path / "other")
    newer.warmup()
    tar = str(tmp_path / "new.tar")
    nbkit.export_tar(newer.root, tar)
    nbkit.push(newer.root, f"file://{tmp_path / 'bucket'}")
    for run in (lambda: nbkit.import_tar(tar, old_cache), lambda: nbkit.pull(f"file://{tmp_path / 'bucket'}", old_cache)):
        synced, events = set(), []
        real_fsync, real_swap = os.fsync, commit.swap_in

        def fsync(fd):
            synced.add(os.readlink(f"/proc/self/fd/{fd}"))
            return real_fsync(fd)

        def swap(staged, dest):
            events.append({n for n in os.listdir(staged)} <= {os.path.basename(p) for p in synced if p.startswith(staged)})
            events.append(staged in synced)
            return real_swap(staged, dest)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(commit, "swap_in", swap)
        from nbkit import cachedir
        monkeypatch.setattr(cachedir, "swap_in", swap)
        run()
        monkeypatch.undo()
        assert events == [True, True]  # every file and the directory itself, before the swap
        assert os.path.dirname(old_cache) in synced  # and the parent after it


# -- export: staged beside the tar, never in $TMPDIR -------------------------------------------


def test_export_interrupted_keeps_the_old_tar_and_never_stages_in_tmpdir(old_cache, tmp_path, monkeypatch):
    target = tmp_path / "drive" / "cache.tar"
    nbkit.export_tar(old_cache, str(target))
    good = target.read_bytes()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "elsewhere"))
    (tmp_path / "elsewhere").mkdir()
    code = textwrap.dedent(f"""
        import os, tarfile, nbkit
        real = tarfile.TarFile.addfile
        n = [0]
        def addfile(self, *a, **k):
            n[0] += 1
            if n[0] == 3:
                os._exit(137)  # the runtime dies mid-export
            return real(self, *a, **k)
        tarfile.TarFile.addfile = addfile
        nbkit.export_tar({old_cache!r}, {str(target)!r})
    """)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert r.returncode == 137
    assert target.read_bytes() == good  # the previous good tar, whole
    assert os.listdir(tmp_path / "elsewhere") == []
    (left,) = [c for c in disk.caches(str(tmp_path / "drive")) if c.leftover]
    assert "export" in left.problem
    nbkit.export_tar(old_cache, str(target))  # the next export sweeps it
    assert os.listdir(tmp_path / "drive") == ["cache.tar"]


# -- paths followed once ------------------------------------------------------------------------


def test_warmup_refuses_to_write_through_a_hard_link(tmp_path):
    ds = nbkit.CachedDataset(source(0.0), tmp_path / "c")
    root = ds.root
    del ds
    outside = tmp_path / "precious.bin"
    col = os.path.join(root, "col-0.bin")
    os.replace(col, outside)
    before = outside.read_bytes()
    os.link(outside, col)
    with pytest.raises(UnsafeArchiveError, match="hard link"):
        nbkit.CachedDataset(source(0.0), root).warmup()
    assert outside.read_bytes() == before


def test_an_opener_racing_rm_gets_a_clear_error_and_recreates_nothing(old_cache, monkeypatch):
    from nbkit.stores import local

    real = local.LocalLocation.open_store

    def removed_meanwhile(self, meta, *, writable):
        nbkit.remove(old_cache)  # rm runs between the opener's metadata read and its file opens
        return real(self, meta, writable=writable)

    monkeypatch.setattr(local.LocalLocation, "open_store", removed_meanwhile)
    ds = nbkit.CachedDataset(source(0.0), old_cache)
    with pytest.raises((CorruptCacheError, nbkit.StaleCacheError, FileNotFoundError), match="removed|gone|no nbkit cache|Open it again"):
        ds[0]
    assert not os.path.exists(old_cache) or os.listdir(old_cache) == []


def test_rm_never_follows_a_directory_swapped_for_a_link(tmp_path, monkeypatch):
    a = nbkit.CachedDataset(source(0.0), tmp_path / "a")
    a.warmup()
    b = nbkit.CachedDataset(source(5.0), tmp_path / "b")
    b.warmup()
    a_root, b_root = a.root, b.root
    del a, b
    real = disk.unused

    def swapped(root):
        os.rename(a_root, str(tmp_path / "a-moved"))
        os.symlink(b_root, a_root)  # the path now leads to another cache
        return real(root)

    monkeypatch.setattr(disk, "unused", swapped)
    disk.remove(a_root)
    monkeypatch.undo()
    assert values(nbkit.CachedDataset.open(b_root)) == [float(v) for v in source(5.0).tensors[0]]
    assert os.path.islink(a_root)  # the link itself is not ours to remove either


# -- full disk ----------------------------------------------------------------------------------


def test_disk_full_names_the_file_the_room_and_the_fix(tmp_path):
    e = commit.disk_full(str(tmp_path / "c" / "col-0.bin"), 3 << 20)
    assert isinstance(e, DiskFullError) and isinstance(e, OSError) and e.errno == errno.ENOSPC
    text = str(e)
    assert str(tmp_path / "c" / "col-0.bin") in text and "3.1 MB" in text and "nbkit.prune(" in text
    with speaking_to("shell"):  # the fix in the words of where the user is
        assert "nbkit ls shows" in str(commit.disk_full(str(tmp_path / "c" / "col-0.bin"), 3 << 20))
    assert not text.startswith("[Errno")


# -- push uploads what it hashed ----------------------------------------------------------------


def test_push_refuses_a_file_that_changed_after_it_was_hashed(old_cache, tmp_path, monkeypatch):
    from nbkit.transfer import sync as transfer

    real = transfer.build_manifest

    def then_changed(root, **kwargs):
        m = real(root, **kwargs)
        with open(os.path.join(root, "col-0.bin"), "r+b") as f:  # a writer that ignores nbkit's lock
            f.write(b"\xff" * 4)
        return m

    monkeypatch.setattr(transfer, "build_manifest", then_changed)
    url = f"file://{tmp_path / 'bucket'}"
    with pytest.raises(OSError, match="changed while it was being pushed"):
        nbkit.push(old_cache, url)
    assert not os.path.exists(tmp_path / "bucket" / fmt.META)


def test_push_holds_writers_off_while_it_reads(tmp_path):
    from nbkit.cachedir import frozen

    empty = nbkit.CachedDataset(source(0.0), tmp_path / "c").root  # created, nothing stored yet
    code = textwrap.dedent(f"""
        import torch, nbkit
        src = torch.utils.data.TensorDataset(torch.arange(64, dtype=torch.float32), torch.arange(64) % 10)
        nbkit.CachedDataset(src, {empty!r}).warmup()
    """)
    with frozen(empty):
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
        try:
            p.wait(timeout=8)
            finished_while_frozen = True
        except subprocess.TimeoutExpired:
            finished_while_frozen = False
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0 and not finished_while_frozen, out


def test_staging_names_round_trip():
    for op in commit.LEFTOVER_OPS:
        name = commit.staging_name("my.cache", op)
        assert commit.leftover_of(name)[0] == "my.cache"
    assert commit.leftover_of("mnist") is None and commit.leftover_of(".mnist.nbkit-evil-0123456789ab") is None
    np.testing.assert_equal(commit.leftover_of(".index.bin.12.34.abcdef01.tmp")[0], "index.bin")
    with pytest.raises(ValueError):
        commit.staging_name("x", "evil")


def test_push_to_the_cache_itself_is_refused_before_anything_is_written(old_cache):
    before = {n: open(os.path.join(old_cache, n), "rb").read() for n in os.listdir(old_cache)}
    for url in (old_cache, f"file://{old_cache}", os.path.join(old_cache, "sub")):
        with pytest.raises(ValueError, match="the cache's own directory"):
            nbkit.push(old_cache, url)
    assert {n: open(os.path.join(old_cache, n), "rb").read() for n in os.listdir(old_cache)} == before
