"""Build time of one cache by 2 ranks (run_ranks, real gloo processes) against one process's
``warmup()`` on the same source: ``python tests/cluster/measure_ranks.py N DELAY_US PART_SIZE [gs]``.

Prints the seconds of each (the ranks' ``report.seconds``: from the first barrier to the complete
cache, without process start and ``init_process_group``). With ``gs``, the ranks build on a GCS
emulator started here (parts pushed, composed by rank 0, pulled by both)."""

import os
import pathlib
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import nbkit
import test_ranks
from buildsources import Named


def main():
    n, delay, part_size = int(sys.argv[1]), float(sys.argv[2]) / 1e6, int(sys.argv[3])
    on_gs = len(sys.argv) > 4 and sys.argv[4] == "gs"
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="measure-ranks-"))
    t0 = time.perf_counter()
    nbkit.CachedDataset(Named(n, delay=delay), str(tmp / "one")).warmup()
    print(f"warmup() in one process: {time.perf_counter() - t0:.2f} s")
    test_ranks.N = n
    env = {"RANKS_DELAY": str(delay), "RANKS_PART_SIZE": str(part_size)}
    if on_gs:
        from fixtures_gcs import GCSEmulator

        emulator = GCSEmulator(tmp / "gcs")
        emulator.start()
        bucket = emulator.make_bucket()
        cache, options = f"{bucket.url}/caches/m", bucket.storage_options
    else:
        cache, options = str(tmp / "shared"), None
    t0 = time.perf_counter()
    results = test_ranks.run_job(tmp, cache, options=options, env_of=lambda r: env, timeout=1200)
    wall = time.perf_counter() - t0
    reports = test_ranks.assert_built(results)
    print(f"run_ranks, 2 ranks{' on gs://' if on_gs else ''}: " + ", ".join(f"rank {r}: {rep['seconds']:.2f} s" for r, rep in enumerate(reports))
          + f"; {wall:.2f} s with process start and init")
    if on_gs:
        emulator.kill()


if __name__ == "__main__":
    main()
