"""DeviceLoader onto a real XLA device (torch_xla on the CPU): batches arrive on xla:0, equal to
the source, and a linear model's loss goes down. Run by tests/test_loader.py."""

import sys

import torch
import torch_xla

import nbkit
from sources import TupleSource

src = TupleSource(64)
ds = nbkit.CachedDataset(src, sys.argv[1] + "/c")
ds.warmup()
device = torch_xla.device()
loader = ds.loader(16, device=device, shuffle=False)
model = torch.nn.Linear(64, 10).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
losses = []
for epoch in range(3):
    for k, (x, y) in enumerate(loader):
        assert x.device.type == "xla", x.device
        if epoch == 0:
            want = torch.stack([src[i][0] for i in range(16 * k, 16 * k + 16)])
            assert torch.equal(x.cpu(), want)
        loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
assert losses[-1] < losses[0], losses
print("ok xla", len(losses), round(losses[0], 3), round(losses[-1], 3))
