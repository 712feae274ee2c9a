"""One process of tests/jax/test_build_ranks.py: ``python build_ranks.py CACHE PORT RANK N OUT``.

Two such processes form one JAX job on the CPU (``jax.distributed``, no torch.distributed): each
calls ``nbkit.cluster.run_ranks`` with no ranks given, so the build takes them from JAX
(:func:`nbkit.cluster.ranks.jax_ranks`: ``process_index``/``process_count`` and a barrier over every
process's devices); then each reads the whole cache back and writes its report to OUT.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "cluster"))

import jax

import nbkit
from nbkit.cluster.ranks import current_ranks, run_ranks

from buildsources import Named, same


def main():
    cache, port, rank, n, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)
    ranks = current_ranks()
    ds = nbkit.CachedDataset(Named(n), cache)
    report = run_ranks(ds, part_size=16)
    got = report.dataset
    plain = Named(n)
    read = sum(same(got[i], plain[i]) for i in range(n))
    with open(out, "w") as f:
        json.dump({"ranks": [ranks.rank, ranks.world], "parts": report.parts, "built": report.built,
                   "computed": report.computed, "merged": report.merged, "missing": len(got.missing()),
                   "verified": got.verify(), "read": read}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
