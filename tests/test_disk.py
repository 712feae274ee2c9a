"""nbkit.caches / remove / prune (nbkit/disk.py) and the in-use lock every open cache holds
(nbkit.cachedir.in_use), on real directories and real processes."""

from __future__ import annotations

import errno
import gc
import html
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbkit
from nbkit import disk
from nbkit.cachedir import in_use
from nbkit.stores.mirror import ORIGIN_SUFFIX, read_origin, working_copy_dir

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A private $NBKIT_CACHE_DIR."""
    d = tmp_path / "nbkit-cache-dir"
    d.mkdir()
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(d))
    return d


def make_cache(path, n=32, *, fill=None, width=16) -> str:
    ds = nbkit.CachedDataset(TensorDataset(torch.randn(n, width), torch.arange(n)), str(path))
    if fill is None:
        ds.warmup()
    else:
        ds.__getitems__(list(range(fill)))
    root = ds.root
    del ds
    gc.collect()
    return root


def set_age(root, seconds_ago: float) -> None:
    """Make a cache (and its working-copy origin file) look last used ``seconds_ago``."""
    t = time.time() - seconds_ago
    for name in os.listdir(root):
        os.utime(os.path.join(root, name), (t, t), follow_symlinks=False)
    if os.path.exists(root + ORIGIN_SUFFIX):
        os.utime(root + ORIGIN_SUFFIX, (t, t))


def by_path(found) -> dict:
    return {c.path: c for c in found}


def holder(path, *extra, cwd=REPO):
    """A real other process holding an open CachedDataset at ``path`` (it has read one sample)."""
    code = ("import sys, nbkit\n"
            "ds = nbkit.CachedDataset.open(sys.argv[1]); ds[0]\n"
            "print('ready', flush=True); sys.stdin.read()\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", code, str(path), *extra], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=cwd, env=env)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def release(proc) -> None:
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


# -- listing --------------------------------------------------------------------------------------


def test_lists_complete_partial_nested_and_broken_caches(tmp_path, cache_dir):
    full = make_cache(tmp_path / "full")
    part = make_cache(tmp_path / "a" / "b" / "part", n=40, fill=10)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "nbkit.json").write_text('{"format": "nbkit-cache", "version": 1, "length": "many"}')
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "nbkit.json").write_text("not json at all")
    (tmp_path / "plain").mkdir()  # a folder without caches: not listed
    found = by_path(nbkit.caches(tmp_path))
    assert set(found) == {full, part, str(broken), str(foreign)}
    assert (found[full].stored, found[full].length, found[full].complete) == (32, 32, True)
    assert (found[part].stored, found[part].length, found[part].complete) == (10, 40, False)
    assert found[full].version == 1 and found[full].problem is None and not found[full].working_copy
    assert found[full].url is None and not found[full].in_use
    for bad in (str(broken), str(foreign)):
        assert found[bad].problem and found[bad].stored is None and not found[bad].complete
    assert "length" in found[str(broken)].problem
    assert "not valid JSON" in found[str(foreign)].problem


def test_bytes_are_the_blocks_allocated_not_the_file_sizes(tmp_path, cache_dir):
    root = make_cache(tmp_path / "c", n=4096, fill=10, width=256)
    sts = [os.lstat(os.path.join(root, n)) for n in os.listdir(root)]
    info = nbkit.caches(tmp_path)[0]
    assert info.bytes == sum(st.st_blocks * 512 for st in sts)
    # The listing reads the filesystem's allocation: apparent sizes are 4 MB of columns.
    assert sum(st.st_size for st in sts) > 4096 * 256 * 4


def test_links_are_never_followed_out_of_a_root(tmp_path, cache_dir):
    outside = tmp_path / "outside"
    make_cache(outside / "hidden")
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside, root / "link-to-dir")
    os.symlink(outside / "hidden", root / "link-to-cache")
    assert nbkit.caches(root) == []
    # A cache whose nbkit.json is a link out is listed as broken, and the link is not read.
    trap = root / "trap"
    trap.mkdir()
    os.symlink(outside / "hidden" / "nbkit.json", trap / "nbkit.json")
    (info,) = nbkit.caches(root)
    assert info.path == str(trap) and "symbolic link" in info.problem


def test_walk_depth_is_bounded(tmp_path, cache_dir):
    deep = make_cache(tmp_path.joinpath(*"abcdefgh"))
    assert nbkit.caches(tmp_path, max_depth=3) == []
    assert [c.path for c in nbkit.caches(tmp_path, max_depth=9)] == [deep]


def test_working_copies_are_listed_with_the_url_they_mirror(tmp_path, cache_dir):
    url = "memory://nbkit-disk-test/wc"
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(16)), url)
    ds.warmup()
    root = ds.root
    del ds
    gc.collect()
    assert root == working_copy_dir(url) and os.path.dirname(root) == str(cache_dir)
    assert read_origin(root)["url"] == url
    (info,) = nbkit.caches()  # no roots: $NBKIT_CACHE_DIR alone
    assert (info.path, info.url, info.working_copy, info.stored, info.length) == (root, url, True, 16, 16)
    table = nbkit.caches().table().text()
    assert url in table and "1 cache," in table


def test_listing_orders_least_recently_used_first_and_prints_a_table(tmp_path, cache_dir):
    old = make_cache(tmp_path / "old")
    new = make_cache(tmp_path / "new")
    set_age(old, 3 * 86400)
    found = nbkit.caches(tmp_path)
    assert [c.path for c in found] == [old, new]
    text = repr(found)
    assert text.splitlines()[0].split() == ["samples", "on", "disk", "last", "used", "path"] and "32/32" in text
    assert "3 days ago" in text and "2 caches," in text
    assert "<table" in found._repr_html_()


# -- in use ---------------------------------------------------------------------------------------


def test_in_use_while_another_process_holds_an_open_dataset(tmp_path, cache_dir):
    root = make_cache(tmp_path / "c")
    assert not in_use(root)
    proc = holder(root)
    try:
        assert in_use(root)
        assert nbkit.caches(tmp_path)[0].in_use
        with pytest.raises(OSError, match="a process has the cache open") as e:
            nbkit.remove(root)
        assert e.value.errno == errno.EBUSY
        assert os.path.exists(os.path.join(root, "nbkit.json"))
    finally:
        release(proc)
    assert not in_use(root)
    assert nbkit.remove(root).left == ()
    assert not os.path.exists(root)


def test_a_dataset_uses_its_cache_until_it_is_collected(tmp_path, cache_dir):
    root = make_cache(tmp_path / "c")
    ds = nbkit.CachedDataset.open(root)
    assert not in_use(root)  # the store opens on first use
    ds[0]
    assert in_use(root)
    ds.store.close()
    assert not in_use(root)
    ds = nbkit.CachedDataset.open(root)
    ds[1]
    del ds
    gc.collect()
    assert not in_use(root)


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_hold_the_cache_while_they_live(tmp_path, cache_dir, method):
    root = make_cache(tmp_path / "c", n=64)
    ds = nbkit.CachedDataset.open(root)
    loader = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True, multiprocessing_context=method,
                        collate_fn=nbkit.collate)
    it = iter(loader)
    next(it)
    next(it)
    # The main process gathers the workers' batch handles from its own store: close it, and the
    # workers' opens alone make the cache used.
    ds.store.close()
    assert in_use(root)
    del it, loader  # persistent workers end with their iterator
    gc.collect()
    deadline = time.monotonic() + 60
    while in_use(root) and time.monotonic() < deadline:
        time.sleep(0.1)  # workers are joined asynchronously
    assert not in_use(root)


# -- remove ---------------------------------------------------------------------------------------


def test_remove_refuses_a_directory_that_is_not_a_cache(tmp_path, cache_dir):
    d = tmp_path / "photos"
    d.mkdir()
    (d / "index.bin").write_bytes(b"mine")  # a cache file's name, but no nbkit.json: not a cache
    with pytest.raises(ValueError, match="not an nbkit cache"):
        nbkit.remove(d)
    assert (d / "index.bin").read_bytes() == b"mine"
    (d / "nbkit.json").write_text("{}")
    with pytest.raises(ValueError, match="not an nbkit cache"):
        nbkit.remove(d)
    assert (d / "index.bin").exists()
    with pytest.raises(FileNotFoundError):
        nbkit.remove(tmp_path / "absent")


def test_remove_refuses_roots(tmp_path, cache_dir, monkeypatch):
    for root in ("/", "~", str(cache_dir)):
        with pytest.raises(ValueError, match="root directory"):
            nbkit.remove(root)


def test_remove_refuses_a_path_that_is_a_link(tmp_path, cache_dir):
    root = make_cache(tmp_path / "real")
    link = tmp_path / "link"
    os.symlink(root, link)
    with pytest.raises(ValueError, match="symbolic link"):
        nbkit.remove(link)
    assert os.path.islink(link) and os.path.exists(os.path.join(root, "index.bin"))


def test_remove_never_follows_a_link_inside(tmp_path, cache_dir):
    root = make_cache(tmp_path / "c")
    victim = tmp_path / "precious"
    victim.mkdir()
    (victim / "heap.bin").write_bytes(b"keep me")
    (victim / "data.txt").write_bytes(b"keep me too")
    os.symlink(victim / "heap.bin", os.path.join(root, "heap.bin"))  # a cache file's name, pointing out
    os.symlink(victim, os.path.join(root, "elsewhere"))  # a link to a directory
    (Path(root) / "notes.txt").write_text("mine")
    removal = nbkit.remove(root)
    assert removal.left == ("elsewhere", "notes.txt")
    assert os.path.isdir(root) and not os.path.exists(os.path.join(root, "nbkit.json"))
    assert not os.path.lexists(os.path.join(root, "heap.bin"))
    assert (victim / "heap.bin").read_bytes() == b"keep me" and (victim / "data.txt").exists()


def test_remove_frees_the_bytes_and_removes_a_working_copys_files(tmp_path, cache_dir):
    url = "memory://nbkit-disk-test/rm"
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(16)), url)
    ds.warmup()
    root = ds.root
    del ds
    gc.collect()
    before = nbkit.caches()[0].bytes
    assert nbkit.remove(root, dry_run=True).bytes == before and os.path.isdir(root)
    assert nbkit.remove(root).bytes == before
    assert os.listdir(cache_dir) == []  # the directory, its origin file and its lock file


# -- prune ----------------------------------------------------------------------------------------


def three_copies(cache_dir) -> list:
    roots = [make_cache(cache_dir / name, n=n) for name, n in (("a", 64), ("b", 32), ("c", 16))]
    for root, days in zip(roots, (10, 5, 1)):
        set_age(root, days * 86400)
    return roots


def test_prune_by_age(cache_dir, tmp_path):
    a, b, c = three_copies(cache_dir)
    outside = make_cache(tmp_path / "not-a-working-copy")
    set_age(outside, 100 * 86400)
    planned = nbkit.prune(older_than=3 * 86400, dry_run=True)
    assert [r.path for r in planned] == [a, b] and all(os.path.isdir(p) for p in (a, b))
    removed = nbkit.prune(older_than=3 * 86400)
    assert [r.path for r in removed] == [a, b]
    assert not os.path.exists(a) and not os.path.exists(b) and os.path.isdir(c)
    assert os.path.isdir(outside)  # prune touches $NBKIT_CACHE_DIR only


def test_prune_by_size_removes_least_recently_used_first(cache_dir):
    a, b, c = three_copies(cache_dir)
    sizes = by_path(nbkit.caches())
    keep = sizes[c].bytes + sizes[b].bytes
    removed = nbkit.prune(max_bytes=keep)
    assert [r.path for r in removed] == [a]
    assert sum(r.bytes for r in removed) == sizes[a].bytes
    assert nbkit.prune(max_bytes=keep) == []
    assert [r.path for r in nbkit.prune(max_bytes=0)] == [b, c]


def test_prune_skips_a_copy_in_use(cache_dir):
    a, b, c = three_copies(cache_dir)
    proc = holder(a)
    try:
        removed = nbkit.prune(older_than=0)
    finally:
        release(proc)
    assert [r.path for r in removed] == [b, c] and os.path.isdir(a)


def test_a_prune_that_frees_nothing_says_why(cache_dir):
    assert "no working copies" in nbkit.prune(max_bytes=0).why_nothing
    a, b, c = three_copies(cache_dir)
    total = sum(x.bytes for x in nbkit.caches())
    within = nbkit.prune(max_bytes=total)
    assert within == [] and "the 3 working copies take" in within.why_nothing and "within the limit" in within.why_nothing
    recent = nbkit.prune(older_than=30 * 86400)
    assert "none was unused for 30 days" in recent.why_nothing and "last used 10 days ago" in recent.why_nothing
    procs = [holder(x) for x in (a, b, c)]
    try:
        busy = nbkit.prune(max_bytes=0)
    finally:
        for proc in procs:
            release(proc)
    assert busy == [] and "over the limit of 0 B" in busy.why_nothing
    assert "a, b, c in use" in busy.why_nothing
    assert nbkit.prune(max_bytes=0).why_nothing is None  # it freed something: nothing to explain


def test_prune_leaves_a_pull_in_progress_alone(cache_dir):
    a, b, c = three_copies(cache_dir)
    tmp = make_cache(cache_dir / ".b.pull-x1y2")  # the temporary sibling a pull fills, then renames
    set_age(tmp, 30 * 86400)
    assert [r.path for r in nbkit.prune(max_bytes=0)] == [a, b, c]
    assert os.path.isdir(tmp) and tmp in [x.path for x in nbkit.caches()]


def test_prune_checks_its_arguments(cache_dir):
    with pytest.raises(TypeError, match="older_than"):
        nbkit.prune(older_than="7d")
    with pytest.raises((TypeError, ValueError), match="max_bytes"):
        nbkit.prune(max_bytes=-1)


# -- untrusted files ------------------------------------------------------------------------------


@pytest.mark.fuzz
def test_fuzz_any_origin_file_and_metadata_lists_cleanly(tmp_path_factory):
    from hypothesis import given, strategies as st

    from nbkit.errors import CorruptCacheError

    good = json.dumps({"format": "nbkit-working-copy", "url": "gs://b/c", "endpoint": None}).encode()

    @given(st.one_of(st.binary(max_size=300), st.binary(max_size=40).map(lambda b: good[:20] + b + good[20:])))
    def check(raw):
        base = tmp_path_factory.mktemp("fuzz")
        root = base / "copy"
        root.mkdir()
        (base / ("copy" + ORIGIN_SUFFIX)).write_bytes(raw)
        (root / "nbkit.json").write_bytes(raw)
        try:
            origin = read_origin(str(root))
            assert isinstance(origin["url"], str)
        except CorruptCacheError:
            pass
        info = disk.describe(str(root))
        assert info.problem and info.stored is None

    check()


# -- the panel ------------------------------------------------------------------------------------


def test_panel_shows_size_on_disk_and_where_working_copies_live(tmp_path, cache_dir):
    pytest.importorskip("ipywidgets")
    from nbkit.widgets import WarmupPanel

    ds = nbkit.CachedDataset(TensorDataset(torch.randn(64, 8)), str(tmp_path / "local"))
    ds.warmup()
    panel = WarmupPanel(ds)
    text = _shown(panel.disk_label.value)
    assert text.startswith(f"{nbkit.text.format_bytes(ds.stats.disk_bytes)} on disk (sample data, index and metadata) in {ds.path}. ")
    assert str(cache_dir).replace(os.path.expanduser("~"), "~") in text and "nbkit prune" in text
    assert panel.disk_label in panel.widget.children
    remote = nbkit.CachedDataset(TensorDataset(torch.randn(64, 8)), "memory://nbkit-disk-test/panel")
    assert f"on disk (sample data, index and metadata) in the working copy {remote.root.replace(os.path.expanduser('~'), '~')}" in _shown(WarmupPanel(remote).disk_label.value)


def _shown(markup: str) -> str:
    """The text an HTML widget shows."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def test_an_unreadable_cache_or_a_missing_root_is_reported(tmp_path, cache_dir):
    with pytest.raises(FileNotFoundError, match="no directory"):
        nbkit.caches(tmp_path / "typo")
    root = make_cache(tmp_path / "c")
    os.chmod(root, 0)
    try:
        (info,) = nbkit.caches(tmp_path)
    finally:
        os.chmod(root, 0o755)
    if os.geteuid() != 0:  # root reads through permissions
        assert info.problem and info.stored is None


def test_the_origin_file_keeps_no_credential_that_came_with_the_url(tmp_path):
    from nbkit.stores import mirror

    root = str(tmp_path / "wc" / "copy")
    mirror._record_origin(root, "s3://key:secret@bucket/cache?X-Amz-Signature=abc",
                          {"endpoint_url": "http://user:pw@127.0.0.1:9000/?token=t"})
    written = open(root + ORIGIN_SUFFIX).read()
    assert "secret" not in written and "abc" not in written and "pw" not in written and "token" not in written
    assert read_origin(root) == {"format": "nbkit-working-copy", "url": "s3://bucket/cache",
                                 "endpoint": "http://127.0.0.1:9000/"}


# -- a build's parts beside a cache; untrusted trees of any depth or path length (issue 37) --------------


def _built_parts(tmp_path, n=32):
    """A cache with the parts of an unfinished build beside it: two whole parts and a staging leftover."""
    import pickle

    import numpy as np

    from nbkit.cluster.part import build_part, parts_dir
    from nbkit.commit import staging_name

    ds = nbkit.CachedDataset(TensorDataset(torch.arange(n)), str(tmp_path / "c"))
    parts = parts_dir(ds.root)
    for start, stop in [(0, 8), (8, 16)]:
        build_part(dict(cache=ds.root, parts=parts, start=start, stop=stop, todo=np.arange(start, stop), meta=ds.store.meta,
                        source=("pickled", "t", pickle.dumps(ds))))
    stage = os.path.join(parts, staging_name("part-0000000000016-0000000000024", "build"))
    os.mkdir(stage)  # a killed worker's
    root = ds.root
    ds.close()
    return root, parts, stage


def _deep_chain(top: str, levels: int, name: str = "d") -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir(name, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        os.close(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_parts_directory_is_one_listed_leftover_and_nbkit_rm_removes_it(tmp_path, cache_dir):
    root, parts, _ = _built_parts(tmp_path)
    found = by_path(disk.caches(str(tmp_path)))
    assert set(found) == {root, parts}  # the parts inside are not listed one by one
    info = found[parts]
    assert info.leftover and not info.in_use and info.bytes > 0
    assert "unfinished build of " + root in info.problem and "2 parts" in info.problem and "1 interrupted part build" in info.problem
    assert disk.remove(parts, dry_run=True).bytes == info.bytes and os.path.isdir(parts)
    removed = disk.remove(parts)
    assert removed.bytes == info.bytes and sorted(os.listdir(tmp_path)) == ["c", "nbkit-cache-dir"]
    assert set(by_path(disk.caches(str(tmp_path)))) == {root}


def test_removing_a_cache_removes_its_parts_and_a_running_build_is_refused(tmp_path, cache_dir):
    from nbkit.commit import claim, release

    root, parts, stage = _built_parts(tmp_path)
    claim(stage)  # a live worker writes this part
    try:
        assert by_path(disk.caches(str(tmp_path)))[parts].in_use
        with pytest.raises(OSError, match="running build") as got:
            disk.remove(parts)
        assert got.value.errno == errno.EBUSY and os.path.isdir(stage)
        kept = disk.remove(root)  # the cache goes; its parts stay while the build runs, and say so
        assert not os.path.exists(root) and os.path.isdir(parts) and any("c.parts" in x for x in kept.left)
    finally:
        release(stage)
    root, parts, _ = _built_parts(tmp_path)
    assert disk.remove(root).bytes > 0 and not os.path.exists(parts) and not os.path.exists(root)


def test_nbkit_rm_refuses_a_parts_named_directory_holding_anything_else(tmp_path, cache_dir):
    other = tmp_path / "notes.parts"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    assert str(other) not in by_path(disk.caches(str(tmp_path)))
    with pytest.raises(ValueError, match="not an nbkit cache"):
        disk.remove(str(other))
    assert (other / "mine.txt").read_text() == "keep"


def test_a_3000_level_chain_in_a_part_leftover_is_listed_and_removed_without_recursion(tmp_path, cache_dir):
    from nbkit.cli import main

    root, parts, stage = _built_parts(tmp_path)
    _deep_chain(stage, 3000)  # deeper than Python's recursion limit (1,000)
    found = by_path(disk.caches(str(tmp_path)))
    assert found[parts].bytes > 3000 * 512  # every level counted
    leftover = disk.describe(stage)
    assert leftover.leftover and leftover.bytes > 3000 * 512
    assert disk.remove(stage).bytes == leftover.bytes and not os.path.exists(stage)
    _deep_chain(os.path.join(parts, "part-0000000000000-0000000000008"), 3000, "x")  # inside a whole part too
    assert main(["ls", str(tmp_path)]) == 0
    assert main(["rm", parts]) == 0
    assert not os.path.exists(parts) and os.path.isdir(root)


def test_caches_finds_a_cache_below_path_max(tmp_path, cache_dir):
    top = tmp_path / "long"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for k in range(20):  # 20 names of 243 characters: paths past PATH_MAX (4096)
            name = f"d{k:02d}" + "x" * 240
            os.mkdir(name, dir_fd=fd)
            sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        made = make_cache(tmp_path / "short", 8)
        os.rename(made, "cache", dst_dir_fd=fd)  # a whole cache, moved where no path reaches
    finally:
        os.close(fd)
    found = [c for c in disk.caches(str(top), max_depth=30) if not c.working_copy]
    assert [(c.name, c.stored, c.length, c.problem) for c in found] == [("cache", 8, 8, None)]
    assert len(found[0].path) > 4096 and found[0].bytes > 0


def test_remote_parts_are_listed_and_removed_and_nothing_else_is(cache_dir):
    import fsspec

    fs = fsspec.filesystem("memory")
    base = "memory://nbkit-test-parts/caches"
    for name in ("part-0000000000000-0000000000016", "part-0000000000016-0000000000032"):
        fs.pipe(f"/nbkit-test-parts/caches/c.parts/{name}/nbkit.json", b"{}")
        fs.pipe(f"/nbkit-test-parts/caches/c.parts/{name}/col-0.bin", b"x" * 100)
    fs.pipe("/nbkit-test-parts/caches/other.parts/notes.txt", b"mine")  # named like parts, holding something else
    fs.pipe("/nbkit-test-parts/caches/c/nbkit.json", b"{}")  # the cache itself: never removed by nbkit rm
    try:
        found = [c for c in nbkit.caches(base) if not c.working_copy]
        assert [c.path for c in found] == [f"{base}/c.parts"]
        assert found[0].leftover and found[0].bytes == 204 and "2 parts uploaded" in found[0].problem
        assert [c.path for c in nbkit.caches(f"{base}/c.parts") if not c.working_copy] == [f"{base}/c.parts"]
        assert nbkit.remove(f"{base}/c.parts", dry_run=True).bytes == 204 and fs.exists("/nbkit-test-parts/caches/c.parts")
        with pytest.raises(ValueError, match="never a remote cache"):
            nbkit.remove(f"{base}/c")
        with pytest.raises(ValueError, match="more than a build's parts"):
            nbkit.remove(f"{base}/other.parts")
        assert nbkit.remove(f"{base}/c.parts").bytes == 204
        assert not fs.exists("/nbkit-test-parts/caches/c.parts") and fs.exists("/nbkit-test-parts/caches/c/nbkit.json")
        with pytest.raises(FileNotFoundError, match="no parts there"):
            nbkit.remove(f"{base}/c.parts")
    finally:
        fs.rm("/nbkit-test-parts", recursive=True)


def test_a_cache_list_printed_in_a_narrow_notebook_never_cuts_a_path(tmp_path):
    import torch

    import nbkit
    from nbkit.disk import CacheList

    root = tmp_path / ("a-folder-with-a-rather-long-name-" * 3) / "mnist"
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), str(root))
    ds.close()
    listed = nbkit.caches(str(tmp_path))
    assert isinstance(listed, CacheList)
    text = listed.text(60)
    assert f"    {root}" in text.splitlines() and "…" not in text  # whole, on its own line: copy-pasteable
    assert all(len(line) <= 60 or line.startswith("    /") for line in text.splitlines())  # (other caches listed too)
