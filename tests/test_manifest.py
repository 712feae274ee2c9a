"""nbkit.manifest: build, parse, check."""

import fsspec
import pytest
import torch

import nbkit
from nbkit.errors import CorruptCacheError
from nbkit.manifest import (build_manifest, check_bytes, check_name, digest, manifest_bytes, parse_manifest,
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
