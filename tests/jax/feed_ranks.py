"""One process of tests/jax/test_feed.py's multi-process tests: python feed_ranks.py CACHE PORT RANK OUT [STOP [STATE]].

Two such processes form one JAX job on the CPU (jax.distributed); each feeds its shard of every
batch through JaxLoader, which makes global arrays with jax.make_array_from_process_local_data.
STOP (> 0): train that many steps of epoch 0, then save the loader's state in OUT and stop (as a
run killed after its checkpoint). STATE: a JSON file of a state (or a list of every rank's) to resume
from first, perhaps saved by another number of processes or another batch size.
"""

import json
import sys

import jax
import numpy as np

import nbkit
from nbkit.jax import JaxLoader


def main():
    cache, port, rank, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    stop = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank)

    loader = JaxLoader(nbkit.CachedDataset.open(cache), 4, seed=5, drop_last=True)
    found = {"rank": loader.rank, "world": loader.world_size, "batches": []}
    if len(sys.argv) > 6:
        with open(sys.argv[6]) as f:
            loader.load_state_dict(json.load(f))
        found["resumed_epoch"] = loader.epoch
    it = iter(loader)
    for step, (image, half, label) in enumerate(it):
        local = [np.asarray(s.data) for s in label.addressable_shards]
        assert image.shape == (2 * len(np.concatenate(local)), 2, 4), image.shape  # the global batch
        assert not image.is_fully_addressable
        keys = np.concatenate([np.asarray(s.data)[:, 0, 0] for s in image.addressable_shards])  # which samples
        found["batches"].append({"local_labels": np.concatenate(local).tolist(), "spec": list(label.sharding.spec),
                                 "local_keys": keys.tolist()})
        if "resumed_epoch" not in found:
            found["batches"][-1]["indices"] = loader.batches(0)[step].tolist()
        if step + 1 == stop:
            break
    found["state"] = loader.state_dict()
    with open(out, "w") as f:
        json.dump(found, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
