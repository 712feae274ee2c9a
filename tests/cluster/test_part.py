"""Parts: written by a worker as a small cache of their slice, read back only once they verify."""

import json
import os
import pickle

import numpy as np
import pytest
import torch

import nbkit
from nbkit import cli
from nbkit.cluster.part import (PartRefused, build_part, list_parts, parse_part_name, part_name, parts_dir, read_part,
                              remove_part, sweep_builds)
from nbkit.commit import claim, release, staging_name

from buildsources import PART_N, Named, part_spec, same

N = PART_N  # the shared cache fixture's (conftest.py)


def spec(ds, start, stop, todo=None):
    return part_spec(ds, start, stop, todo)


def built(ds, start=8, stop=16, todo=None):
    out = build_part(spec(ds, start, stop, todo))
    assert out["kept"]
    return os.path.join(parts_dir(ds.root), out["name"])


def test_names_round_trip_and_refuse_others():
    assert parse_part_name(part_name(3, 9)) == (3, 9)
    for bad in ("part-1-2", "part-0000000000009-0000000000003", "part-0000000000000-0000000000001x", ".part-x", "cache"):
        assert parse_part_name(bad) is None


def test_a_part_is_a_cache_of_its_slice(cache):
    path = built(cache, 8, 16)
    part = read_part(path, cache.store.meta)
    assert (part.start, part.stop, part.stored) == (8, 16, 8)
    assert part.meta["part"]["cache_generation"] == cache.store.meta["generation"]
    assert set(part.meta["part"]["files"]) == {"index.bin", "col-0.bin", "col-1.bin", "heap.bin"}
    part.close()
    src = Named(N)
    with nbkit.CachedDataset.open(path) as p:  # an ordinary cache: every reader reads it
        assert len(p) == 8 and p.verify() == 8
        for slot in range(8):
            assert same(p[slot], src[8 + slot])
    assert cli.main(["info", path]) == 0
    assert cli.main(["verify", path]) == 0
    assert cache.missing().tolist() == list(range(N))  # the cache itself is untouched


def test_a_part_computes_only_its_todo(cache):
    path = built(cache, 0, 8, todo=[1, 5])
    part = read_part(path, cache.store.meta)
    assert part.stored == 2 and np.flatnonzero(part.files.state).tolist() == [1, 5]
    part.close()


def test_first_whole_copy_wins(cache):
    path = built(cache, 0, 8)
    before = {n: os.stat(os.path.join(path, n)).st_ino for n in os.listdir(path)}
    again = build_part(spec(cache, 0, 8))  # a retried task: the part is there, nothing computed
    assert (again["kept"], again["computed"]) == (False, 0)
    assert {n: os.stat(os.path.join(path, n)).st_ino for n in os.listdir(path)} == before
    assert os.listdir(parts_dir(cache.root)) == [os.path.basename(path)]


def test_a_copy_finishing_second_is_discarded(cache, monkeypatch):
    import nbkit.cluster.part as part_mod

    path = built(cache, 0, 8)
    monkeypatch.setattr(part_mod, "_copy_there", lambda p, name: False)  # the second copy started before the first ended
    out = build_part(spec(cache, 0, 8))
    monkeypatch.undo()
    assert out["kept"] is False
    assert os.listdir(parts_dir(cache.root)) == [os.path.basename(path)]  # its staging directory is gone too
    read_part(path, cache.store.meta).close()


def _flip(path, name, offset=0):
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _edit_meta(path, edit):
    with open(os.path.join(path, "nbkit.json")) as f:
        meta = json.load(f)
    edit(meta)
    os.chmod(os.path.join(path, "nbkit.json"), 0o644)
    with open(os.path.join(path, "nbkit.json"), "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("damage,reason", [
    (lambda p: _flip(p, "col-0.bin", 5), "col-0.bin does not match the size and SHA-256"),
    (lambda p: _flip(p, "heap.bin", 0), "heap.bin does not match"),
    (lambda p: _edit_meta(p, lambda m: m["part"].update(cache_generation="0" * 32)), "cache generation"),
    (lambda p: _edit_meta(p, lambda m: m["part"].update(start=9)), "its metadata says the range"),
    (lambda p: _edit_meta(p, lambda m: m["schema"].update(extra=1) if isinstance(m["schema"], dict) else m.update(schema=None)),
     "schema|damaged"),
    (lambda p: _edit_meta(p, lambda m: m["part"]["files"].pop("heap.bin")), "its manifest lists"),
    (lambda p: _edit_meta(p, lambda m: m.pop("part")), "no 'part' field"),
    (lambda p: _edit_meta(p, lambda m: m["part"]["files"]["index.bin"].update(size=-1)), "is damaged: the field .files"),
])
def test_damaged_parts_are_refused_with_the_reason(cache, damage, reason):
    path = built(cache, 8, 16)
    damage(path)
    with pytest.raises(PartRefused, match=reason):
        read_part(path, cache.store.meta)


def test_a_bad_crc_with_a_matching_manifest_is_refused(cache):
    """A worker that wrote a wrong sample and hashed it faithfully: the CRC check catches it."""
    path = built(cache, 8, 16)
    _flip(path, "col-0.bin", 0)

    def rehash(m):
        import hashlib
        with open(os.path.join(path, "col-0.bin"), "rb") as f:
            m["part"]["files"]["col-0.bin"]["sha256"] = hashlib.sha256(f.read()).hexdigest()
    _edit_meta(path, rehash)
    with pytest.raises(PartRefused, match="fail their checksum"):
        read_part(path, cache.store.meta)


def test_a_part_of_another_schema_is_refused(cache, tmp_path):
    other = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.zeros(N, 2)), str(tmp_path / "other"))
    other_meta = dict(other.store.meta, generation=cache.store.meta["generation"])
    out = build_part(dict(spec(other, 0, 8), meta=other_meta, parts=parts_dir(cache.root)))
    with pytest.raises(PartRefused, match="'schema' differs"):
        read_part(os.path.join(parts_dir(cache.root), out["name"]), cache.store.meta)
    other.close()


def test_a_part_beyond_the_cache_is_refused(cache):
    path = built(cache, 32, 40)
    with pytest.raises(PartRefused, match="does not fit the cache"):
        read_part(path, dict(cache.store.meta, length=36))


def test_killed_builds_are_listed_and_removable(cache):
    parts = parts_dir(cache.root)
    path = built(cache, 0, 8)
    stage = os.path.join(parts, staging_name(part_name(8, 16), "build"))
    os.mkdir(stage)
    open(os.path.join(stage, "index.bin"), "wb").close()
    beside = {c.path: c for c in nbkit.caches(os.path.dirname(cache.root))}  # the parts directory: one entry
    assert parts in beside and beside[parts].leftover and "1 part not merged yet" in beside[parts].problem
    listed = {c.path: c for c in nbkit.caches(parts)}  # looked into: each part and leftover
    assert path in listed and listed[path].stored == 8 and listed[path].problem is None
    assert stage in listed and "interrupted build of a part" in listed[stage].problem
    claim(stage)  # a live worker's build is left alone
    assert sweep_builds(parts) == []
    release(stage)
    nbkit.remove(stage)
    assert not os.path.exists(stage)
    nbkit.remove(path)  # a part is a cache: nbkit rm takes it whole
    assert list_parts(parts) == []


def test_remove_part(cache):
    path = built(cache, 0, 8)
    remove_part(path)
    remove_part(path)
    assert os.listdir(parts_dir(cache.root)) == []


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

_FUZZ = {}


def _fuzz_part(tmp_path_factory):
    if not _FUZZ:
        root = tmp_path_factory.mktemp("fuzzpart")
        ds = nbkit.CachedDataset(Named(16), str(root / "cache"))
        path = built(ds, 0, 8)
        with open(os.path.join(path, "nbkit.json"), "rb") as f:
            _FUZZ.update(path=path, raw=f.read(), meta=ds.store.meta)
        ds.close()
    return _FUZZ


@pytest.mark.fuzz
@given(data=st.data())
def test_fuzz_part_metadata(tmp_path_factory, data):
    """Any edit of a part's nbkit.json (its manifest): a clean refusal, or a part whose samples verify."""
    f = _fuzz_part(tmp_path_factory)
    raw = bytearray(f["raw"])
    edits = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=6))
    for at, value in edits:
        raw[at] = value
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))))
    meta_path = os.path.join(f["path"], "nbkit.json")
    os.chmod(meta_path, 0o644)
    with open(meta_path, "wb") as out:
        out.write(bytes(raw[:cut]))
    try:
        part = read_part(f["path"], f["meta"])
    except PartRefused as e:
        assert f["path"] in str(e)
    else:
        src = Named(16)
        assert part.stored == 8
        with nbkit.CachedDataset.open(f["path"]) as p:
            for slot in range(8):
                assert same(p[slot], src[slot])
        part.close()
    finally:
        with open(meta_path, "wb") as out:
            out.write(f["raw"])


@pytest.mark.fuzz
@given(edits=st.dictionaries(st.sampled_from(["start", "stop", "cache_length", "cache_generation", "files"]),
                             st.one_of(st.integers(-2, 2**41), st.text(max_size=40), st.none(), st.lists(st.integers(), max_size=3),
                                       st.dictionaries(st.text(max_size=12), st.integers(), max_size=3)), min_size=1))
def test_fuzz_part_fields(tmp_path_factory, edits):
    """Well-formed JSON with wrong values in the part field: refused, or (an edit that changes nothing) accepted."""
    f = _fuzz_part(tmp_path_factory)
    meta = json.loads(f["raw"])
    meta["part"].update(edits)
    meta_path = os.path.join(f["path"], "nbkit.json")
    with open(meta_path, "w") as out:
        json.dump(meta, out)
    try:
        read_part(f["path"], f["meta"]).close()
    except PartRefused as e:
        assert f["path"] in str(e)
    else:
        assert meta == json.loads(f["raw"])
    finally:
        with open(meta_path, "wb") as out:
            out.write(f["raw"])
