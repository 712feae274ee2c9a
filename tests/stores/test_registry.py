"""The store registry (nbkit.stores.registry)."""

import os
import re
import subprocess
import sys

import pytest

from nbkit.stores import registry
from nbkit.stores.local import LocalLocation
from nbkit.stores.mirror import MirrorLocation
from nbkit.stores.registry import resolve


def test_schemes_and_options_pick_the_backend(tmp_path):
    assert type(registry.resolve(tmp_path)) is LocalLocation
    assert type(registry.resolve(f"file://{tmp_path}")) is LocalLocation
    assert isinstance(registry.resolve("memory://b/c"), MirrorLocation)
    assert registry.backend_of("redis://h/0/x") == registry.backend_of("rediss://h/0/x") == "nbkit.stores.redis:resolve"
    assert registry.backend_of("gs://b/c", local_max_bytes=10) == "nbkit.stores.readthrough:resolve"
    assert registry.backend_of("gs://b/c", local_max_bytes=None) == "nbkit.stores.mirror:resolve"
    with pytest.raises(ValueError, match="only applies to a remote cache"):
        registry.resolve(tmp_path, local_max_bytes=10)


def test_register_a_scheme():
    registry.register("mine", "nbkit.stores.mirror:resolve")
    try:
        loc = registry.resolve("mine://b/c")
        assert isinstance(loc, MirrorLocation) and loc.url == "mine://b/c"
    finally:
        registry.SCHEMES.pop("mine")


def test_a_missing_backend_package_names_the_extra():
    code = ("import sys; sys.modules['gcsfs'] = None\n"
            "from nbkit.stores.registry import resolve\n"
            "try:\n    resolve('gs://bucket/cache')\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "gs:// caches needs the gcsfs package (nbkit-cache's 'gcs' extra): pip install gcsfs" in out.stdout, out.stderr


@pytest.mark.parametrize("typo, fix", [
    ("gs:/my-bucket/cache", "gs://my-bucket/cache"),
    ("gcs:/my-bucket/cache", "gcs://my-bucket/cache"),
    ("s3:/bucket/x", "s3://bucket/x"),
    ("gs:my-bucket/cache", "gs://my-bucket/cache"),
])
def test_url_typos_are_refused_with_the_fix(tmp_path, monkeypatch, typo, fix):
    """A typo in a URL never silently creates a local directory named after it (issue 17, point 7)."""
    import torch
    import nbkit

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(fix)):
        nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), typo)
    assert os.listdir(tmp_path) == []


def test_unknown_scheme_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="unknown scheme 'gz://'"):
        resolve("gz://bucket/cache")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("bad, kind", [(b"/tmp/cache", "bytes"), (3, "int"), (None, "NoneType")])
def test_path_of_the_wrong_type_names_the_argument(bad, kind):
    with pytest.raises(TypeError, match=rf"^path must be .*\({kind}\)"):
        resolve(bad)


def test_local_names_with_a_colon_still_work(tmp_path):
    """A one-letter scheme is a Windows drive, and './x:/y' is how to name such a local directory."""
    assert resolve(str(tmp_path / "a:b")).root == str(tmp_path / "a:b")
    assert resolve("./gs:/x").root == os.path.abspath("gs:/x")
