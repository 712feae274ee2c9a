"""Notebook mistakes nbkit.tpu.spawn must explain, run by tests/tpu/test_run.py as ``python -c <this text>``.

Prints one JSON object: the error each attempt raised (``"no error"`` if none).
"""

import json
import sys
from nbkit import tpu

def work(index):
    pass

out = {}
def attempt(name, f):
    try:
        f()
        out[name] = "no error"
    except Exception as e:  # noqa: BLE001 - every error is the answer, reported as text
        out[name] = f"{type(e).__name__}: {e}"

attempt("spawn_method", lambda: tpu.spawn(work, start_method="spawn"))
attempt("lambda", lambda: tpu.spawn(lambda i: None))
attempt("nprocs", lambda: tpu.spawn(work, nprocs=3))
out["xla_imported_before"] = "torch_xla" in sys.modules
import torch
import torch_xla
(torch.ones(2, device=torch_xla.device()) * 2).cpu()
out["describe_warns"] = [w for w in tpu.describe().warnings]
attempt("initialized", lambda: tpu.spawn(work))
print(json.dumps(out))
