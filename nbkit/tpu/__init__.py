"""TPU runtime: detect it, set up torch_xla, and run a cached dataset on every TPU process.

Everything torch_xla-specific in nbkit lives in this package and in :mod:`nbkit.devices` (the
engine's adapter: device, transfer, step cut, wait), so a successor runtime can be swapped in
there alone: :mod:`~nbkit.tpu.runtime` (:func:`describe`: what runtime this is, without
importing torch_xla or blocking on the network), :mod:`~nbkit.tpu.setup` (:func:`setup`: install
the matching torch_xla, set ``PJRT_DEVICE``, check the device in a subprocess) and
:mod:`~nbkit.tpu.run` (:func:`spawn`, :func:`warmup_shared`, :func:`device_loader`: one process per
device, one shared cache). ``import nbkit`` and ``import nbkit.tpu`` never import torch_xla; the
functions that need it import it when called and, when it is missing, raise an ``ImportError``
that names the pip command.

Example:
    >>> from nbkit import tpu
    >>> info = tpu.describe()
    >>> info.kind in ("colab-tpu", "kaggle-tpu", "tpu-vm", "gpu", "cpu")
    True
"""

from .runtime import KINDS as KINDS  # the runtime kinds describe() reports, kept as nbkit.tpu.KINDS
from .runtime import RuntimeInfo, describe, drive_path
from .run import device_loader, spawn, warmup_shared
from .setup import SetupReport, setup  # the function shadows its module's name; import_module("nbkit.tpu.setup") gets the module

__all__ = [
    "RuntimeInfo",
    "SetupReport",
    "describe",
    "drive_path",
    "setup",
    "spawn",
    "warmup_shared",
    "device_loader",
]
