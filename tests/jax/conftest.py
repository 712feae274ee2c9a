"""Fixtures of tests/jax: one cache written by a torch source and one by a numpy source, the same samples."""

import pytest

import nbkit
from jax_samples import CPU_ONLY, NumpySource, TorchSource


@pytest.fixture(scope="session")
def caches(tmp_path_factory):
    """``{"torch": CachedDataset, "numpy": CachedDataset}``, both warmed."""
    root = tmp_path_factory.mktemp("jax-caches")
    out = {}
    for name, source in (("torch", TorchSource()), ("numpy", NumpySource())):
        ds = nbkit.CachedDataset(source, root / name)
        ds.warmup()
        out[name] = ds
    return out


@pytest.fixture
def cpu_only_workers(monkeypatch):
    """Worker processes started by the test (Grain's, a spawn pool) inherit :data:`jax_samples.CPU_ONLY`."""
    for k, v in CPU_ONLY.items():
        monkeypatch.setenv(k, v)
