"""One rank of an SPMD build (tests/cluster/test_ranks.py): ``python ranks_script.py RANK WORLD PORT CACHE N OUT``.

Joins a torch.distributed gloo group through a TCP store on 127.0.0.1:PORT, opens ``Named(N)`` at
CACHE (a directory, or a URL with ``$RANKS_STORAGE_OPTIONS`` as JSON), calls
``nbkit.cluster.run_ranks`` and then reads every sample back: each must equal the source's, and
``verify()`` must pass. Writes ``{"report": ..., "read": n}`` or ``{"error": type, "message": ...}``
to OUT. ``$RANKS_DELAY``: seconds of source work a sample. ``$RANKS_VIA=warmup_shared``: through ``nbkit.tpu.warmup_shared``. ``$RANKS_DIE_AT``: this rank dies (``os._exit(137)``, as ``kill -9``) when its source is asked
for that index (a rank lost before its parts finish).
"""

import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch.distributed as dist

import nbkit
from nbkit.cluster.ranks import run_ranks

from buildsources import Named, same


def die_at(index):
    """Make ``Named`` end this process when asked for ``index`` (the class is patched, not
    subclassed: the cache's fingerprint names the source's type, which must stay the same)."""
    real = Named.__getitem__

    def getitem(self, i):
        if i == index:
            os._exit(137)
        return real(self, i)

    Named.__getitem__ = getitem


def warmup_shared_on_torch(ds, part_size):
    """``nbkit.tpu.warmup_shared`` as on a pod slice of ``world`` hosts with one replica each: only
    torch_xla's runtime queries are answered by torch.distributed (XLA:CPU has no collectives)."""
    from nbkit.cluster.ranks import torch_ranks
    from nbkit.tpu import run as tpu_run

    tpu_run._local_shard = lambda: (0, 1)  # this host runs one replica
    tpu_run.xla_ranks = torch_ranks  # global ordinal, world size, barrier
    return tpu_run.warmup_shared(ds, part_size=part_size)


def main():
    rank, world, port, cache, n, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6]
    options = json.loads(os.environ.get("RANKS_STORAGE_OPTIONS", "null"))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    if os.environ.get("RANKS_DIE_AT"):
        die_at(int(os.environ["RANKS_DIE_AT"]))
    ds = nbkit.CachedDataset(Named(n, delay=float(os.environ.get("RANKS_DELAY", "0"))), cache, storage_options=options)
    try:
        part_size = int(os.environ.get("RANKS_PART_SIZE", "16"))
        if os.environ.get("RANKS_VIA") == "warmup_shared":
            report = warmup_shared_on_torch(ds, part_size)
        else:
            report = run_ranks(ds, part_size=part_size)
    except Exception as e:  # noqa: BLE001 - any error is reported to the test
        with open(out, "w") as f:
            json.dump({"error": type(e).__name__, "message": str(e), "missing": getattr(e, "missing", None)}, f)
        os._exit(3)  # the group is broken: no clean teardown to wait for
    got = report.dataset
    assert len(got.missing()) == 0
    assert got.verify() == n
    plain = Named(n)
    for i in range(n):
        assert same(got[i], plain[i]), i
    with open(out, "w") as f:
        json.dump({"report": {"parts": report.parts, "built": report.built, "reused": report.reused,
                              "computed": report.computed, "merged": report.merged, "composed": report.composed,
                              "seconds": report.seconds},
                   "read": n, "root": got.root}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
