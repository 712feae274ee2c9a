"""Devices: the one resolver of a ``device=`` argument, and nbkit's one adapter to torch_xla.

Every ``device=`` nbkit takes (``ds.loader``, ``DeviceLoader``, ``bench.compare_training``) is
resolved by :func:`resolve`; every torch_xla call made outside :mod:`nbkit.tpu.run` (the device
loader's transfer and step cut, the sampler's rank and world size, the notebooks' device and wait)
goes through here, so that torch_xla's successor (TorchTPU, a native ``"tpu"`` torch device that
needs none of them) changes one module. This module imports only torch; torch_xla is imported when
a function needs it, which the engine does only on an XLA device.

Example:
    >>> import torch
    >>> from nbkit import devices
    >>> devices.resolve("cpu")
    device(type='cpu')
    >>> devices.step_done(torch.device("cpu"))   # no-op off XLA
    >>> devices.wait(torch.device("cpu"))
"""

from __future__ import annotations

import sys

import torch

__all__ = ["resolve", "step_done", "wait", "send", "runtime_started", "rank_world"]


def resolve(device=None, *, caller: str = "device") -> torch.device:
    """The ``torch.device`` that ``device`` names, checked.

    Args:
        device: ``None`` or ``"auto"`` (CUDA when there is a GPU, else the CPU), ``"cpu"``,
            ``"cuda"``/``"cuda:1"`` (an unnumbered one becomes the current GPU), ``"xla"`` (this
            process's torch_xla device), any other name torch knows, or a ``torch.device``.
        caller: what took the argument, for the error message (``"DeviceLoader"``).

    Raises:
        ValueError: ``device`` is not a device, or names CUDA on a runtime without a GPU.

    Example:
        >>> resolve(None).type in ("cuda", "cpu")
        True
        >>> resolve("gpu0", caller="DeviceLoader")
        Traceback (most recent call last):
        ...
        ValueError: DeviceLoader: device='gpu0' is not a device. Use 'cuda', 'cuda:1', 'cpu', None (host tensors) or an XLA device (torch_xla.device()).
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "xla":
        import torch_xla

        return torch_xla.device()
    try:
        dev = device if isinstance(device, torch.device) else torch.device(device)
    except (RuntimeError, TypeError) as e:
        if isinstance(device, str) and device.split(":")[0] == "tpu":
            raise ValueError(f"{caller}: device={device!r} is TorchTPU's device, and it is not here: {_no_tpu()}") from e
        raise ValueError(
            f"{caller}: device={device!r} is not a device. Use 'cuda', 'cuda:1', 'cpu', None (host tensors) "
            "or an XLA device (torch_xla.device())."
        ) from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{caller}: device={device!r} but this runtime has no CUDA GPU (torch.cuda.is_available() is False). "
            "Pass device=None or 'cpu' for host tensors, or choose a GPU runtime."
        )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _no_tpu() -> str:
    """Why TorchTPU's ``"tpu"`` device may be missing, and the fix. Worded here, not asked of
    :mod:`nbkit.tpu` (the front layer: this module is below everything); ``nbkit.tpu.describe()``
    says which of the causes it is."""
    return ("torch_tpu (TorchTPU) is not installed, found no TPU chips, or its device autoload is off "
            "(TORCH_DEVICE_BACKEND_AUTOLOAD=0). nbkit.tpu.describe() says which; on a TPU runtime run "
            "nbkit.tpu.setup(stack='torch_tpu', install=True), then restart the runtime. For torch_xla's device "
            "pass device='xla'")


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
