"""`import nbkit` needs torch, numpy and fsspec only; the optional world loads on use."""

import subprocess
import sys

# (zstandard is left out: fsspec itself imports it when installed.)
OPTIONAL = ["ipywidgets", "matplotlib", "gcsfs", "torch_xla", "torchvision", "IPython", "PIL", "jax", "grain", "ray", "dask",
            "datasets", "pyarrow"]


def test_import_nbkit_loads_no_optional_package():
    code = ("import sys, nbkit; ds = nbkit.CachedDataset; "
            f"print([m for m in {OPTIONAL!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_public_api_is_small_and_complete():
    import nbkit

    for name in nbkit.__all__:
        assert getattr(nbkit, name) is not None, name
    # 16, register_namedtuple (reading a cache never imports: docs/SECURITY.md), caches/remove/prune (issue 19),
    # EpochSampler/PrefetchSampler (issue 28: the README sends users to both)
    assert len(nbkit.__all__) <= 22


def test_the_samplers_are_public():
    import nbkit
    import nbkit.samplers

    assert nbkit.EpochSampler is nbkit.samplers.EpochSampler
    assert nbkit.PrefetchSampler is nbkit.samplers.PrefetchSampler
    for name in ("EpochSampler", "PrefetchSampler"):
        assert name in nbkit.__all__ and name in dir(nbkit)


def test_the_public_samplers_load_no_torch_on_import():
    code = ("import sys, nbkit; assert 'EpochSampler' in dir(nbkit); print('torch' in sys.modules); "
            "nbkit.EpochSampler; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_submodules_load_on_first_attribute_access():
    code = "import sys, nbkit; assert 'nbkit.tpu' not in sys.modules; nbkit.tpu.describe; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
