"""Merging a verified part: rows in place, blobs appended, records last; idempotent; refused parts removed."""

import os
import pickle

import numpy as np
import pytest

import nbkit
from nbkit.cluster.merge import merge, merge_rows
from nbkit.cluster.part import build_part, parts_dir, read_part

from buildsources import PART_N, Named, check_cache, same

N = PART_N  # the shared cache fixture's (conftest.py)


def built(ds, start, stop, todo=None, token=None):
    """A part of ``ds`` built; ``token`` names its source (a process keeps the source it unpickled per
    token: by default one per cache, as another test's cache may be gone)."""
    out = build_part(dict(cache=ds.root, parts=parts_dir(ds.root), start=start, stop=stop,
                          todo=np.arange(start, stop) if todo is None else np.asarray(todo), meta=ds.store.meta,
                          source=("pickled", token or f"tok:{ds.root}", pickle.dumps(ds))))
    return os.path.join(parts_dir(ds.root), out["name"])


def test_merged_parts_make_the_whole_cache(cache):
    paths = [built(cache, s, min(s + 16, N)) for s in range(0, N, 16)]
    for p in paths:
        r = merge(cache.store, p)
        assert r.merged == len(range(int(os.path.basename(p)[5:18]), int(os.path.basename(p)[19:]))) and not r.refused
        assert not os.path.exists(p)
    cache.close()
    check_cache(cache.root, Named(N))
    assert cache.root and nbkit.cli.main(["verify", cache.root]) == 0


def test_merge_skips_what_the_cache_holds_and_is_idempotent(cache):
    cache.compute_and_store(np.array([3, 4]))
    path = built(cache, 0, 8)
    part = read_part(path, cache.store.meta)
    heap = os.path.getsize(os.path.join(cache.root, "heap.bin"))
    assert merge_rows(cache.store, part) == (6, 2)
    grown = os.path.getsize(os.path.join(cache.root, "heap.bin"))
    assert merge_rows(cache.store, part) == (0, 8)  # a second merge (a driver killed before removing the part) adds nothing
    assert os.path.getsize(os.path.join(cache.root, "heap.bin")) == grown > heap
    part.close()
    src = Named(N)
    assert all(same(cache[i], src[i]) for i in range(8)) and cache.verify() == 8


def test_a_refused_part_is_removed_and_never_merged(cache):
    path = built(cache, 0, 8)
    with open(os.path.join(path, "col-0.bin"), "r+b") as f:
        f.write(b"\x00\x01\x02\x03")
    r = merge(cache.store, path)
    assert "does not match the size and SHA-256" in r.refused and r.merged == 0
    assert not os.path.exists(path) and cache.missing().tolist() == list(range(N))


def test_a_part_merged_by_another_driver_is_gone(cache):
    path = built(cache, 0, 8)
    assert merge(cache.store, path).merged == 8
    assert merge(cache.store, path).gone


def test_merge_into_a_budgeted_cache_writes_slots(tmp_path):
    import torch
    src = torch.utils.data.TensorDataset(torch.arange(64 * 8, dtype=torch.float32).reshape(64, 8))
    ds = nbkit.CachedDataset(src, str(tmp_path / "b"), max_bytes=32 * 32)
    admitted = np.flatnonzero(ds.store.admitted(np.arange(64)))
    out = build_part(dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=64, todo=admitted, meta=ds.store.meta,
                          source=("pickled", f"tok:{ds.root}", pickle.dumps(ds))))
    assert merge(ds.store, os.path.join(parts_dir(ds.root), out["name"])).merged == len(admitted)
    assert len(ds.missing()) == 0 and ds.verify() == len(admitted)
    assert all(torch.equal(ds[int(i)][0], src[int(i)][0]) for i in range(64))
    ds.close()


def test_two_drivers_merging_overlapping_parts_at_once_append_each_blob_once(tmp_path, monkeypatch):
    """Issue 37: two drivers of two part sizes merged [0, 32) and [16, 48)'s overlap both, each finding the
    samples missing before the other wrote them (the cache exact, the heap larger). Merges into one cache
    now take turns (a lock on its parts directory), so the second finds the overlap stored."""
    import threading
    import time

    from nbkit.cluster import merge as merging

    n = 48
    ds = nbkit.CachedDataset(Named(n), str(tmp_path / "overlap"))
    a, b = built(ds, 0, 32, token="overlap"), built(ds, 16, 48, token="overlap")
    real = merging._merge_chunk

    def slow(*args):
        time.sleep(0.3)  # both would have decided what to write before either wrote
        return real(*args)

    monkeypatch.setattr(merging, "_merge_chunk", slow)
    handles = [nbkit.CachedDataset(Named(n), ds.root) for _ in range(2)]
    results = []
    threads = [threading.Thread(target=lambda h=h, p=p: results.append(merge(h.store, p))) for h, p in zip(handles, (a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in (*handles, ds):
        h.close()
    assert sorted(r.merged for r in results) == [16, 32] and sum(r.skipped for r in results) == 16
    check_cache(ds.root, Named(n))
    plain = nbkit.CachedDataset(Named(n), str(tmp_path / "plain"))
    plain.warmup()
    plain.close()
    assert os.path.getsize(os.path.join(ds.root, "heap.bin")) == os.path.getsize(os.path.join(plain.root, "heap.bin"))
