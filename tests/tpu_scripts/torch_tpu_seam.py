"""Run with the fake torch_tpu on sys.path (tests/tpu_scripts/fake_torch_tpu): what describe() says,
and batches from ds.loader(..., device="tpu") and a DataLoader moved with .to("tpu"). Prints JSON."""

import json
import sys
import tempfile

import torch

import nbkit
from nbkit import tpu

out = {"torch_xla_before": "torch_xla" in sys.modules}
info = tpu.describe()  # finds torch_tpu without importing it
out["torch_tpu_imported_by_describe"] = "torch_tpu" in sys.modules
out["describe_torch_tpu"] = info.torch_tpu
out["notes"] = list(info.notes)

import torch_tpu

src = torch.utils.data.TensorDataset(torch.arange(40.0).reshape(10, 4), torch.arange(10))
ds = nbkit.CachedDataset(src, tempfile.mkdtemp() + "/c")
batches = list(ds.loader(4, device="tpu", shuffle=False, batch_transform=lambda b: (b[0] * 2, b[1])))
out["devices"] = sorted({str(t.device) for b in batches for t in b})
out["types"] = sorted({type(t).__name__ for b in batches for t in b})
out["labels"] = [b[1].cpu().tolist() for b in batches]
out["doubled"] = [b[0].cpu()[:, 0].tolist() for b in batches]
shuffled = [b[1].cpu().tolist() for b in ds.loader(4, device="tpu", seed=3)]
out["shuffled_is_permutation"] = sorted(sum(shuffled, [])) == list(range(10))
model = torch.nn.Linear(4, 2).to("tpu")
out["forward_device"] = str(model(batches[0][0]).device)
out["torch_xla_after"] = "torch_xla" in sys.modules
print(json.dumps(out))
