"""warmup(num_workers=N) before and after it became the build protocol: the same source, each run a
fresh process, the two trees alternating, several repeats; prints each pair and the median ratio.

    python tests/cluster/measure_warmup.py BEFORE_TREE AFTER_TREE [N] [COST_US] [REPEATS] [WORKERS] [CHUNK]

e.g. ``python tests/cluster/measure_warmup.py /work/main $PWD 8000 200 7``. The source is MNIST-shaped
(1x28x28 float32 and a label) with ``COST_US`` microseconds of pure-Python work a sample."""

import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time, tempfile, shutil
import nbkit
sys.path.insert(0, sys.argv[6])  # tests/cluster of this checkout: the same source for both trees
from buildsources import Costly

n, cost, workers, chunk = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
path = os.path.join(tempfile.mkdtemp(dir=sys.argv[5]), "c")
ds = nbkit.CachedDataset(Costly(n, cost), path, fingerprint_samples=0)
t0, c0 = time.perf_counter(), os.times()
report = ds.warmup(num_workers=workers, chunk_size=chunk, multiprocessing_context="fork")
dt, c1 = time.perf_counter() - t0, os.times()
cpu = sum(c1[:4]) - sum(c0[:4])  # this process and its workers (joined by now): user + system
assert report.computed == n and len(ds.missing()) == 0
ds.close()
shutil.rmtree(os.path.dirname(path))
print(dt, cpu)
"""


def once(tree: str, n: int, cost: float, workers: int, chunk: int, scratch: str) -> tuple:
    env = dict(os.environ, PYTHONPATH=tree)
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(cost), str(workers), str(chunk), scratch, here], env=env,
                         capture_output=True, text=True, timeout=600, cwd=tree)
    if out.returncode != 0:
        raise RuntimeError(out.stderr)
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def main():
    before, after = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8000
    cost = float(sys.argv[4]) if len(sys.argv) > 4 else 200.0
    repeats = int(sys.argv[5]) if len(sys.argv) > 5 else 5
    workers = int(sys.argv[6]) if len(sys.argv) > 6 else 2
    chunk = int(sys.argv[7]) if len(sys.argv) > 7 else 256
    scratch = tempfile.mkdtemp()
    walls, cpus = [], []
    for r in range(repeats):
        order = [before, after] if r % 2 == 0 else [after, before]
        t = {tree: once(tree, n, cost, workers, chunk, scratch) for tree in order}
        walls.append(t[after][0] / t[before][0])
        cpus.append(t[after][1] / t[before][1])
        print(f"#{r}: wall before {t[before][0]:.2f} s, after {t[after][0]:.2f} s ({walls[-1]:.3f}); "
              f"cpu before {t[before][1]:.2f} s, after {t[after][1]:.2f} s ({cpus[-1]:.3f})", flush=True)
    print(f"median after/before over {repeats} pairs: wall {statistics.median(walls):.3f}, cpu {statistics.median(cpus):.3f} "
          f"(n={n}, {cost:.0f} us a sample, num_workers={workers}, chunk_size={chunk})")


if __name__ == "__main__":
    main()
