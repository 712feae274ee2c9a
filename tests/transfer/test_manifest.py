"""nbkit.transfer.manifest: build, parse, check."""

import fsspec
import pytest
import torch

import nbkit
from nbkit.errors import CorruptCacheError
from nbkit.transfer.manifest import (build_manifest, check_bytes, check_name, digest, manifest_bytes, parse_manifest,
                            read_local_manifest, read_remote_manifest, trusted_remote_manifest)


@pytest.fixture
def cache(tmp_path):
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10.0)), tmp_path / "c")
    ds[:4]
    return ds.root


def test_build_counts_and_hashes(cache):
    m = build_manifest(cache)
    assert (m["stored"], m["length"]) == (4, 10) and set(m["files"]) == {"index.bin", "col-0.bin", "nbkit.json"}
    assert parse_manifest(manifest_bytes(m), "x") == m and len(digest(m)) == 12


def test_damage_is_named(cache, tmp_path):
    m = build_manifest(cache)
    with pytest.raises(CorruptCacheError, match="not valid JSON"):
        parse_manifest(b"{", "where")
    with pytest.raises(CorruptCacheError, match="not an nbkit manifest"):
        parse_manifest(b"{}", "where")
    with pytest.raises(CorruptCacheError, match="does not match its manifest entry"):
        check_bytes("url", "nbkit.json", m, b"other")
    with pytest.raises(CorruptCacheError, match="does not list col-9.bin"):
        check_bytes("url", "col-9.bin", m, b"")
    for bad in ("", "..", "a/b", "a\\b"):
        with pytest.raises(CorruptCacheError, match="not a plain file name"):
            check_name(bad, "where")
    assert read_local_manifest(str(tmp_path)) is None


def test_remote_manifest(cache):
    url = "memory://nbkit-manifest-test/c"
    nbkit.push(cache, url)
    fs = fsspec.filesystem("memory")
    assert read_remote_manifest(fs, "/nbkit-manifest-test/c") == build_manifest(cache)
    assert read_remote_manifest(fs, "/nbkit-manifest-test/none") is None
    fs.pipe_file("/nbkit-manifest-test/c/manifest.json", b"damaged")
    assert trusted_remote_manifest(fs, "/nbkit-manifest-test/c") is None


# -- the manifest is untrusted: spec, names, bounds ---------------------------------------------------

import json

from nbkit.errors import UnsafeArchiveError
from nbkit.transfer.manifest import check_listing, new_manifest


def test_the_spec_names_the_field_and_the_fix(cache):
    m = build_manifest(cache)
    for edit, field in ((lambda m: m["files"]["index.bin"].update(size="12"), "size"),
                        (lambda m: m["files"]["index.bin"].update(sha256="XYZ"), "sha256"),
                        (lambda m: m.update(stored=-1), "stored"),
                        (lambda m: m.update(files=[]), "files")):
        bad = json.loads(manifest_bytes(m))
        edit(bad)
        with pytest.raises(CorruptCacheError, match=f"t.tar:manifest.json is damaged: the field .*{field}.*Ask whoever"):
            parse_manifest(json.dumps(bad).encode(), "t.tar:manifest.json")
    with pytest.raises(UnsafeArchiveError, match="evil.py"):
        parse_manifest(manifest_bytes(new_manifest({"evil.py": {"size": 1, "sha256": "0" * 64}}, 0, 0)), "here")


def test_listing_sizes_must_match_the_manifest(cache):
    url = "memory://nbkit-manifest-test/listing"
    nbkit.push(cache, url)
    fs = fsspec.filesystem("memory")
    m = read_remote_manifest(fs, "/nbkit-manifest-test/listing")
    assert set(check_listing(fs, "/nbkit-manifest-test/listing", url, m)) >= set(m["files"])
    m["files"]["col-0.bin"]["size"] = 2**50
    with pytest.raises(CorruptCacheError, match="col-0.bin is .* bytes but its manifest says 1125899906842624"):
        check_listing(fs, "/nbkit-manifest-test/listing", url, m)
    fs.rm("/nbkit-manifest-test/listing", recursive=True)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

GOOD = manifest_bytes(new_manifest({"index.bin": {"size": 24, "sha256": "a" * 64},
                                    "nbkit.json": {"size": 300, "sha256": "b" * 64}}, 1, 1))


@pytest.mark.fuzz
@given(edits=st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, len(GOOD))))
def test_fuzz_parse_manifest_bytes(edits, cut):
    raw = bytearray(GOOD)
    for at, value in edits:
        raw[at] = value
    try:
        m = parse_manifest(bytes(raw[:cut]), "x.tar:manifest.json")
    except (CorruptCacheError, UnsafeArchiveError) as e:
        assert "x.tar:manifest.json" in str(e)
    else:
        assert all(isinstance(e["size"], int) and e["size"] >= 0 for e in m["files"].values())
