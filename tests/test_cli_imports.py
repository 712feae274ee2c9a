"""No ``nbkit`` command imports torch: listing, describing, checking, copying and removing a cache need none (issue 26).

Each command runs in a fresh interpreter on a real cache, and reports what it left in ``sys.modules``.
How fast that makes them is measured by ``benchmarks/bench_cli.py``, not asserted here.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import nbkit

REPO = Path(__file__).resolve().parent.parent

# Runs one command as the console script does, then says on stderr what it loaded.
CHILD = """
import json, sys
from nbkit.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
loaded = sorted({m.partition(".")[0] for m in sys.modules} & {"torch", "numpy", "fsspec"})
print("LOADED " + json.dumps({"rc": rc, "loaded": loaded}), file=sys.stderr)
"""


def run(env, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("LOADED ")]
    assert lines, out.stderr
    return json.loads(lines[-1].removeprefix("LOADED "))


def make_cache(path, n=32) -> str:
    ds = nbkit.CachedDataset(TensorDataset(torch.randn(n, 1, 8, 8), torch.arange(n)), str(path))
    ds.warmup()
    root = ds.root
    del ds
    gc.collect()
    return root


@pytest.fixture
def env(tmp_path):
    d = tmp_path / "nbkit-cache-dir"
    d.mkdir()
    return {**os.environ, "NBKIT_CACHE_DIR": str(d), "PYTHONPATH": str(REPO)}


def test_help_loads_neither_torch_nor_numpy(env):
    for args in (["--help"], ["ls", "--help"], ["verify", "--help"], ["build", "--help"]):
        assert run(env, *args) == {"rc": 0, "loaded": []}, args


def test_no_command_imports_torch(tmp_path, env):
    root = make_cache(tmp_path / "caches" / "c")
    doomed = make_cache(tmp_path / "caches" / "doomed")
    copy = make_cache(Path(env["NBKIT_CACHE_DIR"]) / "copy")
    commands = [
        ["ls"], ["ls", tmp_path / "caches"], ["ls", "--json", tmp_path / "caches"],
        ["info", root], ["info", "--json", root],
        ["verify", root], ["verify", "--json", "--progress", root],
        ["rm", "--dry-run", doomed], ["rm", doomed],
        ["prune", "--older-than", "0s", "--dry-run"], ["prune", "--max-size", "0"],
        ["export", root, tmp_path / "c.tar"], ["import", tmp_path / "c.tar", tmp_path / "imported"],
        ["push", root, f"file://{tmp_path}/bucket/c"], ["pull", f"file://{tmp_path}/bucket/c", tmp_path / "pulled"],
        ["verify", f"file://{tmp_path}/bucket/c"],
    ]
    for args in commands:
        result = run(env, *args)
        assert result["rc"] == 0, args
        assert "torch" not in result["loaded"], args
    assert not os.path.exists(doomed) and not os.path.exists(copy)  # rm and prune really removed them
    assert os.path.isdir(root)


def test_a_damaged_cache_fails_verify_without_torch(tmp_path, env):
    root = make_cache(tmp_path / "c")
    col = Path(root) / "col-0.bin"
    raw = bytearray(col.read_bytes())
    raw[3 * 256 + 5] ^= 0xFF  # sample 3's row (1×8×8 float32 = 256 bytes)
    col.write_bytes(bytes(raw))
    result = run(env, "verify", root)
    assert result["rc"] == 1 and "torch" not in result["loaded"]


def test_import_nbkit_alone_imports_no_torch():
    code = "import sys, nbkit; nbkit.__version__; nbkit.CorruptCacheError; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "False", out.stderr
