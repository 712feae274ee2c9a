"""Parts that a build did not make, or that are not what they seem: another user's, a link, renamed to
another range, holding a link or a deep tree, or locked by a process that never lets go. Each is refused,
never merged, removed (or reported with the command that removes it) and built again, in bounded time."""

import contextlib
import fcntl
import json
import os
import pickle
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import nbkit
import nbkit.cluster.part as part_mod
import nbkit.commit
from nbkit.cluster import run
from nbkit.cluster.engine import ExecutorEngine
from nbkit.cluster.merge import merge
from nbkit.cluster.part import PartRefused, build_part, list_parts, part_name, parts_dir, read_part

from buildsources import Named, check_cache

N = 40
STRANGER = 12345  # a uid that is not this process's (the tests run as root, which may chown)


@pytest.fixture
def cache(tmp_path):
    ds = nbkit.CachedDataset(Named(N), str(tmp_path / "cache"))
    yield ds
    ds.close()


def planted(ds, start, stop, *, seed=2, parts=None):
    """A part built from another source (seed 2) with the cache's metadata: its generation and
    fingerprint copied, its CRCs and hashes valid. Merged, it would serve samples that are not the source's."""
    out = build_part(dict(cache=ds.root, parts=parts or parts_dir(ds.root), start=start, stop=stop,
                          todo=np.arange(start, stop), meta=ds.store.meta,
                          source=("pickled", uuid.uuid4().hex, pickle.dumps(_source(ds, seed)))))
    assert out["kept"]
    return os.path.join(parts or parts_dir(ds.root), out["name"])


def _source(ds, seed):
    if seed == 1:
        return ds
    return nbkit.CachedDataset(Named(N, seed=seed), ds.root + f"-seed{seed}")


def chown_tree(path, uid):
    for dirpath, dirs, files in os.walk(path):
        for n in dirs + files:
            os.chown(os.path.join(dirpath, n), uid, uid, follow_symlinks=False)
    os.chown(path, uid, uid)


def threads(n=2):
    return ExecutorEngine(ThreadPoolExecutor(n), workers=n, name="threads")


needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown to another uid needs root")


# -- another user's parts -----------------------------------------------------------------------------


@needs_root
def test_a_part_of_another_user_is_refused_never_merged(cache):
    path = planted(cache, 8, 16)
    chown_tree(path, STRANGER)
    with pytest.raises(PartRefused, match=f"belongs to another user \\(uid {STRANGER}"):
        read_part(path, cache.store.meta)
    r = merge(cache.store, path)
    assert r.merged == 0 and "another user" in r.refused
    assert not os.path.lexists(path)
    cache.warmup()
    cache.close()
    check_cache(cache.root, Named(N))  # every sample the source's: none of seed 2's


@needs_root
def test_a_part_holding_a_file_of_another_user_is_refused(cache):
    path = planted(cache, 8, 16)
    os.chown(os.path.join(path, "heap.bin"), STRANGER, STRANGER)
    with pytest.raises(PartRefused, match=f"heap.bin belongs to another user \\(uid {STRANGER}"):
        read_part(path, cache.store.meta)
    cache.warmup()
    cache.close()
    check_cache(cache.root, Named(N))


@needs_root
def test_a_parts_directory_of_another_user_is_never_used(cache):
    parts = parts_dir(cache.root)
    path = planted(cache, 8, 16)
    os.chown(parts, STRANGER, STRANGER)
    with pytest.raises(PermissionError, match=f"belongs to another user \\(uid {STRANGER}.*rm -r"):
        cache.warmup()
    with threads() as engine, pytest.raises(PermissionError, match="belongs to another user"):
        run(cache, engine, part_size=8)
    assert os.path.isdir(path) and len(cache.missing()) == N  # nothing of it merged, nothing removed
    shutil.rmtree(parts)
    cache.warmup(num_workers=2, chunk_size=8)
    cache.close()
    check_cache(cache.root, Named(N))


def test_a_parts_directory_is_made_private(cache):
    planted(cache, 0, 8, seed=1)
    assert os.stat(parts_dir(cache.root)).st_mode & 0o777 == 0o700


# -- links ----------------------------------------------------------------------------------------------


def test_a_part_that_is_a_link_is_removed_and_built(cache, tmp_path):
    elsewhere = str(tmp_path / "elsewhere")
    target = planted(cache, 8, 16, parts=elsewhere)  # a whole part, reached through a link
    os.makedirs(parts_dir(cache.root))
    link = os.path.join(parts_dir(cache.root), part_name(8, 16))
    os.symlink(target, link)
    with threads() as engine:
        report = run(cache, engine, part_size=8)
    assert report.refused == 1 and not os.path.lexists(link)
    assert os.path.isdir(target) and os.listdir(target)  # the link was removed, never what it points to
    assert len(cache.missing()) == 0
    cache.close()
    check_cache(cache.root, Named(N))


def test_merge_refuses_a_link_rather_than_calling_it_gone(cache, tmp_path):
    target = planted(cache, 8, 16, parts=str(tmp_path / "elsewhere"))
    os.makedirs(parts_dir(cache.root))
    link = os.path.join(parts_dir(cache.root), part_name(8, 16))
    os.symlink(target, link)
    r = merge(cache.store, link)
    assert not r.gone and "symbolic link" in r.refused and r.merged == 0
    assert not os.path.lexists(link) and os.path.isdir(target)


def test_a_worker_builds_over_a_link_under_its_name(cache, tmp_path):
    target = planted(cache, 8, 16, parts=str(tmp_path / "elsewhere"))
    os.makedirs(parts_dir(cache.root))
    link = os.path.join(parts_dir(cache.root), part_name(8, 16))
    os.symlink(target, link)
    out = build_part(dict(cache=cache.root, parts=parts_dir(cache.root), start=8, stop=16, todo=np.arange(8, 16),
                          meta=cache.store.meta, source=("pickled", "t", pickle.dumps(cache))))
    assert out["kept"] and os.path.isdir(link) and not os.path.islink(link)
    assert merge(cache.store, link).merged == 8


def test_a_part_holding_a_linked_file_is_removed_and_built(cache, tmp_path):
    path = planted(cache, 8, 16, seed=1)
    outside = str(tmp_path / "outside.bin")
    os.rename(os.path.join(path, "heap.bin"), outside)
    os.symlink(outside, os.path.join(path, "heap.bin"))
    with pytest.raises(PartRefused, match="heap.bin.*symbolic link"):
        read_part(path, cache.store.meta)
    cache.warmup()  # not an UnsafeArchiveError telling to re-create the cache
    assert not os.path.lexists(path) and os.path.exists(outside)
    cache.close()
    check_cache(cache.root, Named(N))


# -- another range ----------------------------------------------------------------------------------------


def test_a_part_renamed_to_another_range_is_refused(cache):
    path = planted(cache, 8, 16, seed=1)  # the source's own samples 8..15
    moved = os.path.join(parts_dir(cache.root), part_name(24, 32))
    os.rename(path, moved)
    meta_path = os.path.join(moved, "nbkit.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["part"].update(start=24, stop=32)
    os.chmod(meta_path, 0o644)
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(PartRefused, match="built for another range"):
        read_part(moved, cache.store.meta)
    cache.warmup()
    cache.close()
    check_cache(cache.root, Named(N))  # sample 24 is the source's 24, not its 8


# -- deep trees, held locks ---------------------------------------------------------------------------


def test_a_part_holding_a_deep_tree_is_refused_and_removed(cache):
    path = planted(cache, 8, 16, seed=1)
    fd = os.open(path, os.O_RDONLY)
    try:
        for _ in range(3000):  # deeper than Python's recursion limit
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = sub
    finally:
        os.close(fd)
    with pytest.raises(PartRefused, match="'d', a directory"):
        read_part(path, cache.store.meta)
    cache.warmup()
    assert not os.path.lexists(path) and list_parts(parts_dir(cache.root)) == []
    cache.close()
    check_cache(cache.root, Named(N))


def _held(path, seconds):
    """``path`` locked exclusively through another descriptor (as another process would), released after ``seconds``."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    timer = threading.Timer(seconds, os.close, (fd,))  # never a test that hangs: a failing one
    timer.start()
    return timer


@pytest.mark.parametrize("locked", ["", "nbkit.json"])
def test_a_part_locked_for_good_is_refused_in_bounded_time(cache, monkeypatch, locked):
    monkeypatch.setattr(nbkit.commit, "LOCK_SECONDS", 0.3)
    path = planted(cache, 8, 16, seed=1)
    timer = _held(os.path.join(path, locked), 15)
    try:
        t0 = time.monotonic()
        r = merge(cache.store, path)
        assert time.monotonic() - t0 < 5
        assert "held its" in r.refused and "lock" in r.refused and not os.path.lexists(path)
        cache.warmup()
        assert time.monotonic() - t0 < 10
    finally:
        timer.cancel()
        with contextlib.suppress(OSError):  # closed by the timer already
            timer.function(*timer.args)
    cache.close()
    check_cache(cache.root, Named(N))


def test_a_refused_part_that_cannot_be_removed_names_the_command(cache, monkeypatch):
    path = planted(cache, 8, 16, seed=1)
    os.symlink("/nonexistent", os.path.join(path, "evil"))

    def denied(d, name):
        if name.startswith("."):  # the part, set aside for removal
            raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(nbkit.commit.Dir, "remove_tree", denied)
    r = merge(cache.store, path)
    assert "'evil', a symbolic link" in r.refused and "remove it with rm -rf" in r.refused and r.merged == 0


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

_NAMES = st.text(st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)), min_size=1, max_size=12).filter(
    lambda n: n not in (".", ".."))


@pytest.mark.fuzz
@given(entries=st.lists(st.tuples(st.sampled_from(["file", "dir", "link", "fifo", "swap"]), _NAMES), min_size=1, max_size=4))
def test_fuzz_odd_entries_in_a_part(tmp_path_factory, entries):
    """Anything put into a whole part (files, directories, links, fifos, a part file swapped for a link):
    a clean refusal naming the part, then a merge that removes it; or, for an entry a part may hold, the part."""
    root = tmp_path_factory.mktemp("odd")
    ds = nbkit.CachedDataset(Named(16), str(root / "cache"))
    path = planted(ds, 0, 8, seed=1)
    odd = False
    for kind, name in entries:
        target = os.path.join(path, name)
        if kind == "swap":
            name = ["index.bin", "col-0.bin", "heap.bin", "nbkit.json"][len(name) % 4]
            target = os.path.join(path, name)
            os.rename(target, str(root / "moved"))
            os.symlink(str(root / "moved"), target)
            odd = True
            continue
        if os.path.lexists(target):
            continue
        if kind == "file":
            open(target, "wb").close()
            odd = odd or part_mod._PART_ENTRY.match(name) is None  # a stray col-9.bin is never read: harmless
        elif kind == "dir":
            os.makedirs(os.path.join(target, "a", "b"))
            odd = True
        elif kind == "link":
            os.symlink(str(root), target)
            odd = True
        else:
            os.mkfifo(target)
            odd = True
    try:
        read_part(path, ds.store.meta).close()
    except PartRefused as e:
        assert path in str(e)
    else:
        assert not odd
    r = merge(ds.store, path)
    assert (r.refused != "") == odd and not os.path.lexists(path)
    assert os.path.isdir(str(root))  # a link was never followed out of the part
    ds.close()
    shutil.rmtree(str(root))
