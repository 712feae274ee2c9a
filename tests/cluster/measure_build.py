"""Build throughput: nbkit.cluster.run with the local engine against warmup(num_workers=N), same source,
same run (ratios only: docs/notes/issue29-parts.md). ``python tests/cluster/measure_build.py [N] [COST_US]``.

The source is MNIST-shaped (1x28x28 float32 and a label) with a preprocessing cost of ``COST_US``
microseconds a sample of pure-Python work (a decode and resize stand-in), so the compute is what a
real build parallelises."""

import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import nbkit
from nbkit.cluster import LocalEngine, run

from buildsources import Costly


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    cost = float(sys.argv[2]) if len(sys.argv) > 2 else 200.0
    base = tempfile.mkdtemp()
    src = Costly(n, cost)
    rows = []

    def timed(label, fn):
        path = os.path.join(base, label.replace(" ", "_"))
        ds = nbkit.CachedDataset(src, path, fingerprint_samples=0)
        t0 = time.perf_counter()
        fn(ds)
        dt = time.perf_counter() - t0
        assert len(ds.missing()) == 0
        ds.close()
        shutil.rmtree(path)
        rows.append((label, dt))
        print(f"{label:34s} {dt:7.2f} s  {n / dt:9,.0f} samples/s", flush=True)

    for rep in range(2):
        timed(f"warmup(num_workers=0) #{rep}", lambda ds: ds.warmup())
        timed(f"warmup(num_workers=2) #{rep}", lambda ds: ds.warmup(num_workers=2, multiprocessing_context="fork"))
        for w in (1, 2):
            def build(ds, w=w):
                with LocalEngine(w, multiprocessing_context="fork") as engine:
                    run(ds, engine, part_size=1024)
            timed(f"build LocalEngine({w}) #{rep}", build)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
