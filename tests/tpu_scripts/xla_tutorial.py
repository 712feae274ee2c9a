"""torch_xla's CachedDataset tutorial, ported by changing the import only: caches built by training
inside ``xmp.spawn`` (with the old ``max_files_per_folder=`` / ``compress=`` keywords), then carried
with ``tar czf``. Run by tests/tpu/test_migration.py as ``python -c <this text> ARGS``.

Args (argv): MNIST root, cache directory, output directory, training steps per process.
Every process writes ``result-<ordinal>.json`` (the warnings it saw, the samples it trained on).
"""

import json
import os
import sys
import warnings

import torch
import torch.nn.functional as F
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp
import torch_xla.runtime as xr
from torchvision import datasets, transforms

from nbkit import CachedDataset  # was: from torch_xla.utils.cached_dataset import CachedDataset

MNIST_ROOT, CACHE, OUT, STEPS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])


class IndexedSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that remembers the indices it gave (to check the cache afterwards)."""

    seen = None

    def __iter__(self):
        self.seen = list(super().__iter__())
        return iter(self.seen)


def _mp_fn(index):
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    train_dataset = datasets.MNIST(MNIST_ROOT, train=True, download=False, transform=tf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_dataset = CachedDataset(train_dataset, CACHE, max_files_per_folder=1000, compress=True)
    device = torch_xla.device()
    sampler = IndexedSampler(train_dataset, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=True)
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=16, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step, (data, target) in enumerate(pl.MpDeviceLoader(train_loader, device)):
        opt.zero_grad()
        output = model(data)
        loss = F.cross_entropy(output, target)
        loss.backward()
        opt.step()  # the tutorial's xm.optimizer_step(opt) all-reduces: XLA:CPU has no collectives across processes
        xm.mark_step()
        losses.append(loss.item())
        if step + 1 == STEPS:
            break
    result = {
        "ordinal": xr.global_ordinal(),
        "world": xr.world_size(),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "trained_on": sampler.seen[: STEPS * 16],
        "losses": losses,
    }
    with open(os.path.join(OUT, f"result-{index}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(), start_method="fork")
    print("parent done", flush=True)
