"""The adapter between nbkit and torch_xla: the torch_xla calls made outside :mod:`nbkit.tpu.run`
(the device loader's transfer and step cut, the sampler's rank and world size, the notebooks'
device and wait) go through here, so that torch_xla's successor (TorchTPU, a native ``"tpu"`` torch device that
needs none of them) changes one module. torch_xla is imported when a function is called.

Example:
    >>> import torch
    >>> from nbkit.tpu import xla
    >>> xla.step_done(torch.device("cpu"))   # no-op off XLA
    >>> xla.wait(torch.device("cpu"))
"""

from __future__ import annotations

import torch

__all__ = ["device", "step_done", "wait", "send", "runtime_started", "rank_world"]


def device() -> torch.device:
    """torch_xla's device for this process (``xla:0`` on one chip, or the replica's own under spawn)."""
    import torch_xla

    return torch_xla.device()


def step_done(dev: torch.device) -> None:
    """End a training step: on XLA, cut and run the step's graph (what ``MpDeviceLoader`` does per batch)."""
    if dev.type == "xla":
        import torch_xla

        torch_xla.sync()


def wait(dev: torch.device) -> None:
    """Block until ``dev`` has finished its queued work (CUDA, XLA; eager devices need nothing)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    elif dev.type == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        torch_xla.sync()
        xm.wait_device_ops()
    else:
        module = getattr(torch, dev.type, None)  # e.g. torch.tpu from TorchTPU, if it has one
        synchronize = getattr(module, "synchronize", None)
        if dev.type not in ("cpu", "meta") and callable(synchronize):
            synchronize()


def send(batch, dev: torch.device):
    """``batch`` (any nesting of host tensors) sent to the XLA device ``dev`` as ``MpDeviceLoader`` sends it."""
    import torch_xla.core.xla_model as xm

    return xm.send_cpu_data_to_device(batch, dev)


def runtime_started() -> bool:
    """Whether this process has started torch_xla's runtime (never imports torch_xla: only a process
    that imported it can have started it, and asking the runtime anything would start it).

    Example:
        >>> runtime_started() in (True, False)
        True
    """
    import sys

    module = sys.modules.get("torch_xla")
    if module is None:
        return False
    try:
        return bool(module._XLAC._xla_runtime_is_initialized())
    except AttributeError:
        return False


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` from torch_xla's runtime; call only when :func:`runtime_started`."""
    import torch_xla.runtime as xr  # already imported by whoever started the runtime

    return int(xr.global_ordinal()), int(xr.world_size())
