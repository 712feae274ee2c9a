"""Run with the real torch_tpu installed and TORCH_DEVICE_BACKEND_AUTOLOAD=1, on a machine without TPU
chips: what `import torch` does with it, then its own registration with its PCI probe told one chip is
there (everything else of the package runs as shipped; no TPU runtime is started). Prints JSON."""

import ast
import json
import sys

import torch

from nbkit.tpu import torchtpu

out = {"autoloaded": "torch_tpu._loader" in sys.modules, "registered_without_chips": torchtpu.registered()}
try:
    torch.device(torchtpu.DEVICE)
    out["device_error"] = None
except RuntimeError as e:
    out["device_error"] = str(e)

import torch_tpu._loader as loader
from torch_tpu._internal.utils import hardware

out["chips_seen_by_package"] = hardware.get_tpu_device_count()
hardware.get_tpu_device_count = lambda *a, **k: 1  # the package's PCI probe, told there is one chip
loader.load()
out["registered_with_a_chip"] = torchtpu.registered()
out["device"] = str(torch.device(torchtpu.DEVICE, 0))
out["privateuse1"] = torch._C._get_privateuse1_backend_name()
out["backend_for_tpu"] = torch.distributed.Backend.default_device_backend_map.get(torchtpu.DEVICE)
out["backends"] = [b for b in torch.distributed.Backend.backend_list if "tpu" in b]
out["launch_env"] = callable(torch.tpu.distributed.set_tpu_launch_env)

# The fake device the seam tests use (tests/tpu_scripts/fake_torch_tpu), read without importing it.
fake = ast.parse(open("tests/tpu_scripts/fake_torch_tpu/torch_tpu/__init__.py").read())
out["fake_device"] = next(n.value.value for n in fake.body if isinstance(n, ast.Assign)
                          and getattr(n.targets[0], "id", None) == "DEVICE")
print(json.dumps(out))
