"""Run by tests/tpu/test_runtime.py: ``import nbkit`` and ``nbkit.tpu.describe()`` must not import torch_xla."""

import json
import sys

import nbkit
import nbkit.tpu

info = nbkit.tpu.describe()
print(json.dumps({"kind": info.kind, "torch_xla_imported": "torch_xla" in sys.modules, "nbkit": nbkit.__version__}))
