"""One process of tests/jax/test_feed.py's multi-process test: python feed_ranks.py CACHE PORT RANK OUT.

Two such processes form one JAX job on the CPU (jax.distributed); each feeds its shard of every
batch through JaxLoader, which makes global arrays with jax.make_array_from_process_local_data.
"""

import json
import sys

import jax
import numpy as np

import nbkit
from nbkit.jax import JaxLoader


def main():
    cache, port, rank, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)

    loader = JaxLoader(nbkit.CachedDataset.open(cache), 4, seed=5, drop_last=True)
    found = {"rank": loader.rank, "world": loader.world_size, "batches": []}
    for (image, half, label), idx in zip(loader, loader.batches(0)):
        assert image.shape == (8, 2, 4) and label.shape == (8,), (image.shape, label.shape)  # the global batch
        assert not image.is_fully_addressable
        local = [np.asarray(s.data) for s in label.addressable_shards]
        found["batches"].append({"indices": idx.tolist(), "local_labels": np.concatenate(local).tolist(),
                                 "spec": list(label.sharding.spec)})
    with open(out, "w") as f:
        json.dump(found, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
