"""nbkit.tpu.spawn's torch.distributed path (the one TorchTPU's 'tpu_dist' backend takes) run on gloo
and the CPU: two processes warm one cache with warmup_shared and read their shards with
device_loader. Argument: a directory. Prints JSON."""

import json
import sys

import torch

import nbkit
from nbkit.tpu import device_loader, run, warmup_shared


def train(index, ds, out_dir):
    import torch.distributed as dist

    report = warmup_shared(ds)
    loader = device_loader(ds, batch_size=4, shuffle=False, drop_last=False)
    labels = [int(y) for _, y in loader for y in y]
    result = {"index": index, "rank": dist.get_rank(), "world": dist.get_world_size(), "warmed": report.computed,
              "labels": labels, "device": str(next(iter(loader))[0].device), "missing_after": len(ds.missing())}
    with open(f"{out_dir}/{index}.json", "w") as f:
        json.dump(result, f)
    print(f"done {index}")


if __name__ == "__main__" or True:
    out_dir = sys.argv[1]
    src = torch.utils.data.TensorDataset(torch.arange(80.0).reshape(20, 4), torch.arange(20))
    ds = nbkit.CachedDataset(src, f"{out_dir}/cache")
    run._spawn_dist(train, (ds, out_dir), 2, "fork", True, backend="gloo", device_type="cpu")
    print(json.dumps([json.load(open(f"{out_dir}/{i}.json")) for i in range(2)]))
