"""The README's quick start runs as written (on offline MNIST-format files, as a user without a
network would: ``nbkit.offline.write_mnist`` first, as the README says)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.S | re.M)


def test_readme_is_short_and_carries_no_figures():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    # counts of tests and timings go stale on the next run: they live in BENCHMARKS.md
    assert not re.search(r"\b\d[\d,]* (tests|passed|skipped)\b", text)
    assert not re.search(r"\b\d+(\.\d+)? ?(s|min|ms|seconds|minutes)\b(?! *\()", text)


@pytest.mark.slow
def test_the_quick_start_runs_as_written(tmp_path):
    quick_start = python_blocks((REPO / "README.md").read_text())[0]
    script = tmp_path / "quick_start.py"
    script.write_text("from nbkit.offline import write_mnist\n"
                      "write_mnist('data', n_train=1200, n_test=200)\n"
                      + quick_start
                      + "\nassert len(ds) == 1200 and ds.is_complete\n"
                        "x, y = next(iter(loader))\n"
                        "assert tuple(x.shape) == (256, 1, 28, 28)\n"
                        "print('quick start ok')\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "quick start ok" in done.stdout
