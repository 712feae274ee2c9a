"""The terminal demo runs end to end on offline data."""

import subprocess
import sys


def test_demo_runs_and_prints_the_table(tmp_path):
    out = subprocess.run([sys.executable, "-m", "nbkit.demo", "--samples", "3000", "--epochs", "1",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "cached, nbkit.collate (best)" in out.stdout and "reopening the cache" in out.stdout
    assert "warmup" in out.stderr  # the progress line
    # Its first lines say the data is synthetic, in the notebooks' words (nbkit.offline.mnist_like).
    head = out.stdout.splitlines()[:3]
    assert any(line.startswith("Using offline MNIST-format stand-in data (3,000 samples)") and
               "The images are synthetic, learnable patterns, not real MNIST." in line for line in head), head
