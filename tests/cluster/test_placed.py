"""Placed parts: a local build writes each sample once, into the cache's own files; the merge links
index records only, and nothing placed is served before its record is in the cache's index."""

import json
import os
import pickle
import shutil

import numpy as np
import pytest

import nbkit
from nbkit import format as fmt
from nbkit.cluster import merge as merge_mod
from nbkit.cluster.merge import merge
from nbkit.cluster.part import PartRefused, build_part, parts_dir, read_part
from nbkit.errors import StaleCacheError

from buildsources import PART_N, Named, part_spec, same

N = PART_N  # the shared cache fixture's (conftest.py)


def spec(ds, start, stop, todo=None):
    return part_spec(ds, start, stop, todo, placed=True, hashes=False)


def placed(ds, start=8, stop=16, todo=None):
    out = build_part(spec(ds, start, stop, todo))
    assert out["kept"]
    return os.path.join(parts_dir(ds.root), out["name"])


def test_a_placed_part_holds_records_only_and_serves_nothing_before_its_merge(cache):
    path = placed(cache, 8, 16)
    assert sorted(os.listdir(path)) == ["index.bin", "nbkit.json"]
    assert os.path.getsize(os.path.join(path, "index.bin")) == 8 * fmt.RECORD.itemsize
    assert len(cache.missing()) == N  # rows placed, no record: not stored, never served
    with nbkit.CachedDataset.open(cache.path) as reader:
        assert len(reader.missing()) == N
    part = read_part(path, cache.store.meta, hashes=False)
    assert (part.stored, part.files) == (8, None)
    part.close()
    result = merge(cache.store, path, hashes=False)
    assert (result.merged, result.skipped, result.refused) == (8, 0, "")
    assert not os.path.exists(path)
    src = Named(N)
    with nbkit.CachedDataset.open(cache.path) as reader:  # another process's view: every record checks
        assert reader.verify() == 8
        assert all(same(reader[i], src[i]) for i in range(8, 16))


def test_the_merge_moves_no_sample_byte(cache, monkeypatch):
    path = placed(cache, 0, N)
    for name in ("write_rows", "append_blobs", "put"):
        monkeypatch.setattr(type(cache.store), name, lambda *a, **k: pytest.fail(f"the merge called {name}"))
    assert merge(cache.store, path, hashes=False).merged == N


def test_a_sample_stored_meanwhile_is_never_written_over(cache):
    _ = cache[10]  # a reader stored it before the part's worker got there
    before = [c[10].copy() for c in cache.store.columns]
    path = placed(cache, 8, 16)
    part = read_part(path, cache.store.meta, hashes=False)
    assert part.records["state"][10 - 8] == fmt.EMPTY and part.stored == 7
    part.close()
    assert all(np.array_equal(b, c[10]) for b, c in zip(before, cache.store.columns))
    result = merge(cache.store, path, hashes=False)
    assert (result.merged, result.skipped) == (7, 0)
    assert len(cache.missing()) == N - 8


def test_a_rebuilt_cache_is_never_written_into(cache, tmp_path):
    s = spec(cache, 0, 8)
    nbkit.CachedDataset(Named(N, seed=2), cache.path, overwrite=True).close()
    with pytest.raises(StaleCacheError):
        build_part(s)
    again = nbkit.CachedDataset(Named(N, seed=2), cache.path)
    assert len(again.missing()) == N
    again.close()


def test_a_part_placed_before_a_rebuild_is_refused(cache):
    path = placed(cache, 0, 8)
    fresh = nbkit.CachedDataset(Named(N, seed=2), cache.path, overwrite=True)
    result = merge(fresh.store, path, hashes=False)
    assert "generation" in result.refused and not os.path.exists(path)
    assert len(fresh.missing()) == N
    fresh.close()


def test_a_part_placed_in_files_since_replaced_is_refused(cache, tmp_path):
    path = placed(cache, 0, 8)
    cache.close()
    # A copy of the same build swapped in (what a pull or import does): the placed rows went into
    # the files it replaced, so the records must not be linked into the new ones.
    copy = str(tmp_path / "copy")
    shutil.copytree(cache.path, copy)
    shutil.rmtree(cache.path)
    os.rename(copy, cache.path)
    with open(os.path.join(cache.path, "col-0.bin"), "r+b") as f:  # what the replacing copy holds there
        f.write(b"\0" * 8 * 48)
    ds = nbkit.CachedDataset(Named(N), cache.path)
    assert "other files" in merge(ds.store, path, hashes=False).refused  # checked there: the rows are not
    assert len(ds.missing()) == N
    ds.close()


def test_damaged_records_are_refused(cache):
    path = placed(cache, 0, 8)
    with open(os.path.join(path, "index.bin"), "r+b") as f:
        f.write(b"\x07")  # a state nbkit never writes
    with pytest.raises(PartRefused, match="states"):
        read_part(path, cache.store.meta, hashes=False)
    assert merge(cache.store, path, hashes=False).refused
    assert len(cache.missing()) == N


def test_a_record_past_the_heap_is_refused(cache):
    path = placed(cache, 0, 8)
    part = read_part(path, cache.store.meta, hashes=False)
    part.records["off"][3] = 1 << 40
    with pytest.raises(PartRefused, match="past"):
        merge_mod.link_records(cache.store, part)
    part.close()
    assert len(cache.missing()) == N


def test_a_rerun_overwrites_the_rows_of_a_killed_attempt(cache):
    # A killed attempt leaves placed rows without records: garbage no reader sees, written over by the next.
    cols = cache.store.columns
    for c in cols:
        c[0:8] = 7
    path = placed(cache, 0, 8)
    assert merge(cache.store, path, hashes=False).merged == 8
    src = Named(N)
    assert all(same(cache[i], src[i]) for i in range(8))


def test_a_budgeted_cache_is_placed_at_its_slots(tmp_path):
    probe = nbkit.CachedDataset(Named(N), str(tmp_path / "probe"))
    row = sum(c.strides[0] for c in probe.store.columns)
    probe.close()
    ds = nbkit.CachedDataset(Named(N), str(tmp_path / "budget"), max_bytes=row * N // 2)
    admitted = int(ds.store.admitted(np.arange(N)).sum())
    assert 0 < admitted < N
    report = ds.warmup(num_workers=2, chunk_size=8)
    assert report.computed == admitted and len(ds.missing()) == 0
    src = Named(N)
    with nbkit.CachedDataset.open(ds.path) as reader:
        assert reader.verify() == admitted
        assert all(same(reader[int(i)], src[int(i)]) for i in np.flatnonzero(reader.store.admitted(np.arange(N))))
    ds.close()


def test_large_rows_are_placed_from_the_samples_own_arrays(tmp_path, monkeypatch):
    from nbkit.cluster.part import PlacedStore
    from sources import LargeRowSource, assert_equal

    got, real = [], PlacedStore.put
    monkeypatch.setattr(PlacedStore, "put", lambda self, idx, fl, crc, cpos, stacked, bp, bl: got.append(
        type(stacked[0])) or real(self, idx, fl, crc, cpos, stacked, bp, bl))
    src = LargeRowSource(24)
    ds = nbkit.CachedDataset(src, str(tmp_path / "c"), max_bytes=18 * (3 * 80 * 80 * 4 + 8) + 4096)
    admitted = np.flatnonzero(ds.store.admitted(np.arange(24)))
    first = int(admitted[admitted >= 8][0])
    _ = ds[first]  # stored meanwhile by a reader: the part's row for it is dropped, never written over
    before = [c[ds.store.slot_of[first]].copy() for c in ds.store.columns]
    path = placed(ds, 8, 24)
    assert got == [fmt.Rows]
    assert all(np.array_equal(b, c[ds.store.slot_of[first]]) for b, c in zip(before, ds.store.columns))
    assert merge(ds.store, path, hashes=False).merged == int((admitted >= 8).sum()) - 1
    ds.close()
    with nbkit.CachedDataset.open(str(tmp_path / "c")) as reader:
        stored = np.flatnonzero(reader.store.is_stored(np.arange(24)))
        assert stored.tolist() == admitted[admitted >= 8].tolist() and reader.verify() == len(stored)
        for i in stored:
            assert_equal(reader[int(i)], src[int(i)])


def test_a_local_build_places_its_parts(cache, monkeypatch):
    calls = []
    real = merge_mod.link_records
    monkeypatch.setattr(merge_mod, "link_records",
                        lambda c, p, fresh: calls.append((p.stop - p.start, p.rows_synced, fresh)) or real(c, p, fresh=fresh))
    monkeypatch.setattr(merge_mod, "merge_rows", lambda *a: pytest.fail("a local build copied a part's rows"))
    report = cache.warmup(num_workers=2, chunk_size=8)
    assert report.computed == N and len(cache.missing()) == 0 and sum(n for n, _, _ in calls) == N
    # This machine's workers leave the rows' sync to the merge, and each part is its own build's.
    assert {(synced, fresh) for _, synced, fresh in calls} == {(False, True)}
    assert not os.path.exists(parts_dir(cache.root))
    src = Named(N)
    with nbkit.CachedDataset.open(cache.path) as reader:
        assert reader.verify() == N
        assert all(same(reader[i], src[i]) for i in range(N))


def test_a_copied_cache_and_its_parts_merge_after_a_check_of_the_rows(cache, tmp_path):
    placed(cache, 0, 8)
    cache.close()
    moved = str(tmp_path / "moved")
    shutil.copytree(cache.path, moved)
    shutil.copytree(parts_dir(cache.root), parts_dir(moved))
    ds = nbkit.CachedDataset(Named(N), moved)
    part = os.path.join(parts_dir(moved), "part-0000000000000-0000000000008")
    assert merge(ds.store, part, hashes=False).merged == 8  # other inodes: the rows checked where they are now
    src = Named(N)
    assert all(same(ds[i], src[i]) for i in range(8))
    ds.close()


# -- rows a worker of this machine left unsynced -------------------------------------------------------


def unsynced(ds, start=8, stop=16):
    out = build_part(part_spec(ds, start, stop, placed=True, hashes=False, sync_rows=False))
    assert out["kept"]
    return os.path.join(parts_dir(ds.root), out["name"])


def test_a_worker_that_leaves_the_sync_to_the_merge_says_so_and_the_merge_syncs_before_any_record(cache, monkeypatch):
    path = unsynced(cache, 8, 16)
    assert fmt.read_meta(path)["part"]["rows_synced"] is False
    real = type(cache.store).sync_data
    seen = []

    def sync_data(store):
        seen.append(int((store.state[8:16] == fmt.STORED).sum()))  # records written before the rows are durable?
        real(store)

    monkeypatch.setattr(type(cache.store), "sync_data", sync_data)
    monkeypatch.setattr(merge_mod.PlacedStore, "verify", lambda self: pytest.fail("a fresh part's rows read again"))
    assert merge(cache.store, path, hashes=False, fresh=True).merged == 8
    assert seen[0] == 0  # the rows were synced before the first record was linked
    src = Named(N)
    assert all(same(cache[i], src[i]) for i in range(8, 16))


def test_a_part_left_unsynced_by_an_earlier_build_is_checked_and_refused_when_its_rows_were_lost(cache):
    path = unsynced(cache, 8, 16)
    # A power cut after the part was published lost its rows (the kernel had not written them yet).
    fd = os.open(os.path.join(cache.root, fmt.column_file(0)), os.O_WRONLY)
    try:
        row = cache.store.columns[0].strides[0]
        os.pwrite(fd, bytes(8 * row), 8 * row)
    finally:
        os.close(fd)
    result = merge(cache.store, path, hashes=False)  # not fresh: a leftover
    assert result.merged == 0 and "left unsynced by a build that ended" in result.refused
    assert not os.path.exists(path) and len(cache.missing()) == N
    assert cache.warmup().computed == N
    src = Named(N)
    assert all(same(cache[i], src[i]) for i in range(N))


def test_a_part_left_unsynced_whose_rows_survived_merges_after_one_check(cache, monkeypatch):
    path = unsynced(cache, 0, 8)
    checked = []
    real = merge_mod.PlacedStore.verify
    monkeypatch.setattr(merge_mod.PlacedStore, "verify", lambda self: checked.append(1) or real(self))
    assert merge(cache.store, path, hashes=False).merged == 8 and checked == [1]


def test_a_worker_of_this_machine_never_waits_for_the_disk(cache, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real(fd))
    path = unsynced(cache, 0, 8)  # rows, records and manifest: committed atomically, none of them synced
    assert synced == []
    assert merge(cache.store, path, hashes=False, fresh=True).merged == 8
    assert synced  # the merge made the rows durable, then the index
    synced.clear()
    placed(cache, 8, 16)  # a remote worker's part: its rows and its part durable before it is published
    assert synced


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


@pytest.mark.fuzz
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(edits=st.dictionaries(st.sampled_from(["placed", "rows_synced"]),
                             st.one_of(st.booleans(), st.integers(-2, 2), st.text(max_size=40), st.none(),
                                       st.lists(st.booleans(), max_size=2), st.just("0" * 32)), min_size=1))
def test_fuzz_a_placed_part_s_own_fields(cache, edits):
    """A placed part's ``placed`` and ``rows_synced`` fields are read at the trust boundary: a value of
    another type or shape is refused, never taken for true."""
    path = placed(cache, 0, 8) if not os.path.exists(os.path.join(parts_dir(cache.root), "part-0000000000000-0000000000008")) \
        else os.path.join(parts_dir(cache.root), "part-0000000000000-0000000000008")
    meta_path = os.path.join(path, "nbkit.json")
    raw = open(meta_path, "rb").read()
    meta = json.loads(raw)
    meta["part"].update(edits)
    os.chmod(meta_path, 0o644)
    with open(meta_path, "w") as out:
        json.dump(meta, out)
    try:
        part = read_part(path, cache.store.meta, hashes=False)
    except PartRefused as e:
        assert path in str(e)
        assert any(not isinstance(v, bool) for k, v in edits.items() if k == "rows_synced") or \
            any(not (isinstance(v, str) and len(v) == 32) for k, v in edits.items() if k == "placed")
    else:
        assert part.rows_synced is meta["part"]["rows_synced"] and part.placed == meta["part"]["placed"]
        part.close()
    finally:
        with open(meta_path, "wb") as out:
            out.write(raw)
