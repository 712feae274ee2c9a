"""Notebook-style use of nbkit.tpu, run by tests/tpu/test_run.py as ``python -c <this text> ARGS``.

Run through ``-c``, ``__main__`` has no file, exactly like a notebook: ``train`` below can only
reach the replicas by ``fork``, which is what ``nbkit.tpu.spawn`` picks.

Args (argv): MNIST root, cache directory, output directory, steps per replica[, start method].
Every replica writes ``result-<ordinal>.json``; every source call appends its index to
``calls-<pid>-<thread>.txt`` in the output directory.
"""

import json
import os
import sys
import threading

import torch
import torch.nn.functional as F
from torchvision import datasets, transforms

import nbkit
from nbkit import tpu

MNIST_ROOT, CACHE, OUT, STEPS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
START_METHOD = sys.argv[5] if len(sys.argv) > 5 else None


class CountingMNIST(torch.utils.data.Dataset):
    """torchvision MNIST (ToTensor + Normalize) that logs every sample it computes."""

    def __init__(self, root):
        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        self.inner = datasets.MNIST(root, train=True, download=False, transform=tf)
        self.log_dir = None  # off while the parent fingerprints the source

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if self.log_dir:
            name = os.path.join(self.log_dir, f"calls-{os.getpid()}-{threading.get_native_id()}.txt")
            with open(name, "a") as f:
                f.write(f"{i}\n")
        return self.inner[i]


def train(index, ds, out, steps):
    import torch_xla
    import torch_xla.runtime as xr

    report = tpu.warmup_shared(ds)
    missing_after_barrier = len(ds.missing())

    device = torch_xla.device()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = tpu.device_loader(ds, batch_size=32)
    shard = sorted(int(i) for i in loader.sampler)  # epoch 0's shard; training starts at epoch 1
    losses, shapes = [], set()
    while len(losses) < steps:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            # Each replica steps on its own: XLA:CPU has no collectives, so no xm.optimizer_step here.
            opt.step()
            torch_xla.sync()
            losses.append(loss.item())
            shapes.add((tuple(x.shape), str(x.device), str(y.dtype)))
            if len(losses) == steps:
                break
    result = {
        "index": index,
        "ordinal": xr.global_ordinal(),
        "world": xr.world_size(),
        "pid": os.getpid(),
        "warmup": {"computed": report.computed, "skipped": report.skipped, "total": report.total},
        "missing_after_barrier": missing_after_barrier,
        "batches_per_epoch": len(loader),
        "shard": shard,
        "shapes": sorted(map(list, shapes)),
        "losses": losses,
    }
    with open(os.path.join(out, f"result-{index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    source = CountingMNIST(MNIST_ROOT)
    ds = nbkit.CachedDataset(source, CACHE)
    source.log_dir = OUT  # from here on, every computed sample is counted
    tpu.spawn(train, args=(ds, OUT, STEPS), start_method=START_METHOD)
    print("parent done", os.getpid(), flush=True)
