"""A full disk on every write path (issue 25): a small tmpfs filled up, then a warmup, a CacheLoader
put, an import, an export, a pull and a metadata write on it.

Each must raise :class:`nbkit.errors.DiskFullError` (``ENOSPC``) naming the file, the room it needed
and what to do, and lose nothing: a cache that was whole still verifies, an older tar or an older
cache at the target is still whole, and nothing is left that ``nbkit ls`` does not list.
"""

import errno
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import nbkit
try:
    from nbkit.commit import atomic_write
except ImportError:  # before the commit protocol
    from nbkit.files import atomic_write
from sources import TupleSource, assert_equal

DiskFullError = getattr(nbkit.errors, "DiskFullError", OSError)  # absent before the commit protocol

MOUNT_SIZE = 4 << 20


class Big(TupleSource):
    """64 KiB a sample: a few dozen fill the disk."""

    def __init__(self, n=48):
        super().__init__(n, shape=(16, 32, 32))


class Varying(torch.utils.data.Dataset):
    """Samples of varying size (kept in heap.bin), 2 to 20 KiB each (1.3 MiB in all)."""

    def __init__(self, n=120):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange((i % 10 + 1) * 512, dtype=torch.float32) + i


@pytest.fixture
def disk(tmp_path):
    """A 4 MiB tmpfs (needs root: skipped elsewhere)."""
    d = tmp_path / "disk"
    d.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={MOUNT_SIZE}", "tmpfs", str(d)], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot run mount here ({e}): the full-disk tests need a small tmpfs")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): the full-disk tests need root")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)


def fill(disk, leave=0):
    """Take all the free room of ``disk`` but ``leave`` bytes (a file ``filler``; removed by :func:`unfill`)."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, os.fstat(fd).st_size, max(4096, free - leave))
    finally:
        os.close(fd)


def unfill(disk):
    os.unlink(disk / "filler")


def assert_disk_full(e, name):
    """A :class:`DiskFullError` naming ``name``, the room it needed and the fix."""
    assert isinstance(e, DiskFullError) and e.errno == errno.ENOSPC, f"{type(e).__name__}: {e}"
    text = str(e)
    assert not text.startswith("[Errno"), text
    assert name in text, f"{name} not named: {text}"
    assert re.search(r"[0-9] [KMGT]?B\b", text) and ("needs" in text or "need" in text), f"no room needed in: {text}"
    assert "Free some space" in text or "free some space" in text, f"no fix in: {text}"


def assert_all_listed(disk, *keep):
    """Every entry on the disk is a cache or tar we made, or something ``nbkit ls`` lists (a leftover),
    or a directory of such things (a build's ``<cache>.parts``: its finished parts are kept)."""
    listed = {c.path for c in nbkit.caches(disk, max_depth=2)}
    for name in os.listdir(disk):
        path = str(disk / name)
        if name in ("filler", *keep) or path in listed:
            continue
        if os.path.isdir(path) and os.listdir(path) and all(os.path.join(path, n) in listed for n in os.listdir(path)):
            continue
        raise AssertionError(f"{path} is left on the disk and nbkit ls does not list it ({sorted(listed)})")


def assert_whole(path, src, complete=False):
    ds = nbkit.CachedDataset.open(path)
    stored = [i for i in range(len(ds)) if i not in set(ds.missing().tolist())]
    assert ds.verify() == len(stored)
    assert not complete or ds.is_complete
    for i in stored:
        assert_equal(ds[i], src[i], f"sample {i}")
    return len(stored)


# ---------------------------------------------------------------------------------------------------
# warmup


def test_creating_a_cache_whose_columns_do_not_fit(disk):
    small = str(disk / "small")
    nbkit.CachedDataset(TupleSource(16), small).warmup()
    fill(disk, leave=1 << 20)
    with pytest.raises(OSError) as e:
        nbkit.CachedDataset(Big(48), str(disk / "big"))  # 3 MiB of columns, 1 MiB free
    assert_disk_full(e.value, "col-0.bin")
    assert_whole(small, TupleSource(16), complete=True)
    assert_all_listed(disk, "small")
    unfill(disk)
    ds = nbkit.CachedDataset(Big(48), str(disk / "big"))  # what the failed creation left is wiped, never adopted
    ds.warmup()
    assert assert_whole(str(disk / "big"), Big(48), complete=True) == 48


def test_a_disk_that_fills_while_a_warmup_appends_to_the_heap(disk):
    path = str(disk / "c")
    ds = nbkit.CachedDataset(Varying(), path)
    ds[:8]
    fill(disk, leave=400 << 10)  # room for about a quarter of the samples
    with pytest.raises(OSError) as e:
        ds.warmup(chunk_size=8)
    assert_disk_full(e.value, "heap.bin")
    stored = assert_whole(path, Varying())
    assert 8 < stored < len(ds)
    assert_all_listed(disk, "c")
    unfill(disk)
    ds.warmup(chunk_size=8)  # resumes where it stopped
    assert assert_whole(path, Varying(), complete=True) == len(ds)


def test_a_disk_full_in_warmup_workers(disk):
    from nbkit.cluster.part import list_parts, parts_dir, parse_part_name

    path = str(disk / "c")
    ds = nbkit.CachedDataset(Varying(), path)
    fill(disk, leave=400 << 10)
    with pytest.raises(OSError) as e:
        ds.warmup(chunk_size=8, num_workers=2, multiprocessing_context="fork")
    assert_disk_full(e.value, "heap.bin")
    stored = assert_whole(path, Varying())
    # What the workers computed is kept: merged into the cache, or in finished parts beside it (when
    # the parts out filled the disk before the first merge, every one of them), merged by the rerun.
    left = [parse_part_name(os.path.basename(p)) for p in list_parts(parts_dir(path))]
    assert stored + sum(stop - start for start, stop in left) > 0
    assert_all_listed(disk, "c")
    unfill(disk)
    ds.warmup(chunk_size=8, num_workers=2, multiprocessing_context="fork")
    assert assert_whole(path, Varying(), complete=True) == len(ds)
    assert not os.path.exists(parts_dir(path))


# ---------------------------------------------------------------------------------------------------
# CacheLoader


def test_a_cache_loader_put_on_a_full_disk(disk):
    loader = nbkit.CacheLoader(str(disk / "kv"))
    for k in range(4):
        loader.get(k, lambda key: torch.full((1024,), float(key)))
    fill(disk, leave=64 << 10)
    with pytest.raises(OSError) as e:
        loader.get("big", lambda key: torch.zeros(256 << 10))  # 1 MiB
    assert_disk_full(e.value, "values.bin")
    assert loader.verify() == 4 and len(loader) == 4
    assert torch.equal(loader.get(2), torch.full((1024,), 2.0))
    unfill(disk)
    assert loader.get("big", lambda key: torch.zeros(256 << 10)).shape == (256 << 10,)
    again = nbkit.CacheLoader(str(disk / "kv"))
    assert again.verify() == 5 and sorted(map(str, again.keys())) == ["0", "1", "2", "3", "big"]


# ---------------------------------------------------------------------------------------------------
# import, export, pull


@pytest.fixture
def big_cache(tmp_path):
    """A whole cache of 1.5 MiB on the ordinary disk, and an older small one of the same source."""
    path = str(tmp_path / "src")
    nbkit.CachedDataset(Big(24), path).warmup()
    older = str(tmp_path / "older")
    ds = nbkit.CachedDataset(Big(24), older)
    ds[:2]
    return path, older


def _lying_disk_usage(monkeypatch):
    """Room checks that see plenty of room: the writes themselves then meet the full disk."""
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 40))


def _copies(how: str, tmp_path):
    """``(publish(cache) -> source, bring(source, dest))`` for an import from a tar or a pull from a prefix."""
    if how == "import":
        def publish(cache, name):
            tar = str(tmp_path / f"{name}.tar")
            nbkit.export_tar(cache, tar)
            return tar
        return publish, nbkit.import_tar

    def push(cache, name):
        nbkit.push(cache, str(tmp_path / name))
        return str(tmp_path / name)
    return push, nbkit.pull


@pytest.mark.parametrize("how", ["import", "pull"])
@pytest.mark.parametrize("check", ["checked first", "found while writing"])
def test_a_copy_onto_a_full_disk_keeps_the_older_cache(disk, tmp_path, big_cache, monkeypatch, check, how):
    path, older = big_cache
    publish, bring = _copies(how, tmp_path)
    new, old = publish(path, "copy-new"), publish(older, "copy-older")
    dest = str(disk / "dest")
    bring(old, dest)
    fill(disk, leave=512 << 10)
    if check == "found while writing":
        _lying_disk_usage(monkeypatch)
    with pytest.raises(OSError) as e:
        bring(new, dest)
    assert_disk_full(e.value, "dest")
    assert assert_whole(dest, Big(24)) == 2
    assert_all_listed(disk, "dest")
    monkeypatch.undo()
    unfill(disk)
    bring(new, dest)
    assert assert_whole(dest, Big(24), complete=True) == 24


def test_exporting_onto_a_full_disk_keeps_the_older_tar(disk, big_cache):
    path, older = big_cache
    tar = str(disk / "c.tar")
    nbkit.export_tar(older, tar)
    before = Path(tar).read_bytes()
    fill(disk, leave=512 << 10)
    with pytest.raises(OSError) as e:
        nbkit.export_tar(path, tar)
    assert_disk_full(e.value, "c.tar")
    assert Path(tar).read_bytes() == before
    assert_all_listed(disk, "c.tar")


# ---------------------------------------------------------------------------------------------------
# metadata


@pytest.mark.parametrize("exclusive", [False, True])
def test_an_atomic_metadata_write_on_a_full_disk(disk, exclusive):
    target = disk / "meta.json"
    if not exclusive:
        target.write_bytes(b'{"old": true}')
    fill(disk, leave=0)
    with pytest.raises(OSError) as e:
        atomic_write(str(target), b"x" * (256 << 10), exclusive=exclusive)
    assert_disk_full(e.value, "meta.json")
    assert sorted(os.listdir(disk)) == ["filler"] + ([] if exclusive else ["meta.json"])  # no temporary left
    if not exclusive:
        assert target.read_bytes() == b'{"old": true}'


def test_creating_a_cache_on_a_full_disk_leaves_what_nbkit_ls_lists(disk):
    fill(disk, leave=0)
    with pytest.raises(OSError) as e:
        nbkit.CachedDataset(TupleSource(16), str(disk / "c"))
    assert_disk_full(e.value, "c")
    assert_all_listed(disk)
    for c in nbkit.caches(disk, max_depth=1):
        nbkit.remove(c.path)
    unfill(disk)
    nbkit.CachedDataset(TupleSource(16), str(disk / "c")).warmup()
    assert_whole(str(disk / "c"), TupleSource(16), complete=True)
