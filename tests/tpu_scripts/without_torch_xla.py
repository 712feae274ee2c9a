"""nbkit without torch_xla, run by tests/tpu/test_run.py as ``python -c <this text>``.

Hides torch_xla (as if not installed), then checks that ``import nbkit`` and ``describe()`` work
without it and that the functions needing it raise an ImportError naming the pip command.
Prints one JSON object.
"""

import json
import sys

sys.modules["torch_xla"] = None  # any "import torch_xla" now raises ImportError

import nbkit
from nbkit import tpu
from nbkit.tpu import torchtpu

torchtpu.version = lambda: None  # nor TorchTPU (tests/tpu/test_torch_tpu_real.py: with it, and no TPU device)

out = {"kind": tpu.describe().kind}
try:
    tpu.device_loader([0, 1, 2], batch_size=1)
    out["device_loader"] = "no error"
except ImportError as e:
    out["device_loader"] = str(e)
out["nbkit_all"] = sorted(nbkit.__all__)
print(json.dumps(out))
