"""TorchTPU (the ``torch-tpu`` package, module ``torch_tpu``): what nbkit knows about it, in one place.

TorchTPU is torch_xla's successor: a native ``"tpu"`` torch device (torch's PrivateUse1 backend,
renamed) and a ``torch.distributed`` backend, ``"tpu_dist"`` (also registered as ``"tpu"``), on an
unpatched torch. Read from the installed package (0.2.0): it registers itself through torch's
device-backend autoload (the ``torch.backends`` entry point ``torch_tpu._loader:load``, run by
``import torch`` unless ``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), and only where it finds TPU chips on
the PCI bus: elsewhere ``torch.device("tpu")`` does not exist, and neither does its backend. Its
launcher helper ``torch.tpu.distributed.set_tpu_launch_env`` fills in what every process of a job
must agree on before a launcher (``torch.multiprocessing``, ``torchrun``) starts them.

This module finds it without importing it (:func:`version`), reads the torch it needs from its
metadata (:func:`torch_specifier`), builds the install pytorch.org documents for a Colab TPU runtime
(:func:`install_commands`), and holds the device check :func:`nbkit.tpu.setup` runs in a subprocess.

Example:
    >>> install_commands("2.9.0+cpu", python="python", torchvision=False)[0][-3:]
    ['--index-url', 'https://download.pytorch.org/whl/cpu', '--upgrade']
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from typing import Mapping, Optional

from nbkit.trust import requirement_specifier

__all__ = ["DEVICE", "BACKEND", "version", "torch_specifier", "torch_fits", "install_commands",
           "registered", "no_device_reason", "torch_range"]

DISTRIBUTION = "torch-tpu"
DEVICE = "tpu"  # the name torch_tpu._loader gives PrivateUse1 (torch.utils.rename_privateuse1_backend)
BACKEND = "tpu_dist"  # its torch.distributed backend: torch.distributed.Backend.default_device_backend_map["tpu"]
AUTOLOAD = "TORCH_DEVICE_BACKEND_AUTOLOAD"
# torch-tpu 0.2.0's Requires-Dist (torch>=2.11.0,<=2.15.0), for when its metadata cannot be read.
DOCUMENTED_TORCH = ">=2.11,<=2.15"
# pytorch.org's Get Started for a Colab TPU runtime: a CPU torch from this index, then torch-tpu.
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def version() -> Optional[str]:
    """TorchTPU's version when ``torch_tpu`` is installed (found without importing it), else ``None``.

    Example:
        >>> version() is None or isinstance(version(), str)
        True
    """
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return "installed" if importlib.util.find_spec("torch_tpu") is not None else None
    except (ImportError, ValueError):
        return None


def torch_specifier() -> str:
    """The torch versions TorchTPU needs: its installed metadata's ``Requires-Dist`` on torch, or
    the documented range (``>=2.11,<=2.15``) when it is not installed or says nothing readable.

    Example:
        >>> torch_specifier().startswith(">=2.")
        True
    """
    try:
        lines = importlib.metadata.requires(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        lines = None
    return requirement_specifier(lines, "torch") or DOCUMENTED_TORCH


def torch_range(specifier: Optional[str] = None) -> str:
    """The torch versions TorchTPU needs, in words for people (a narrow output wraps them between
    words): ``">=2.11.0,<=2.15.0"`` reads ``"torch 2.11.0 to 2.15.0"``; any other specifier is shown as it is.

    Example:
        >>> torch_range(">=2.11.0,<=2.15.0"), torch_range(">=2.11")
        ('torch 2.11.0 to 2.15.0', 'torch >=2.11')
    """
    spec = torch_specifier() if specifier is None else specifier
    parts = dict(p.strip().split("=", 1) for p in spec.split(",") if p.strip()[:2] in (">=", "<="))
    if set(parts) == {">", "<"}:
        return f"torch {parts['>']} to {parts['<']}"
    return f"torch {spec}"


def torch_fits(torch_version: str, specifier: Optional[str] = None) -> bool:
    """Whether ``torch_version`` (a local tag like ``+cpu`` ignored) is one TorchTPU supports.

    Example:
        >>> torch_fits("2.9.0+cpu", ">=2.11,<=2.15"), torch_fits("2.15.0", ">=2.11,<=2.15")
        (False, True)
    """
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(torch_version.split("+")[0]) in SpecifierSet(specifier or torch_specifier())
    except InvalidVersion:
        return False


def install_commands(torch_version: str, *, python: str = sys.executable, torchvision: Optional[bool] = None) -> list:
    """The install pytorch.org documents for TorchTPU on Colab's TPU runtime, for this torch:
    ``pip install torch --index-url https://download.pytorch.org/whl/cpu`` (pinned to the torch
    TorchTPU supports, with torchvision when it is installed, so that the two still match; left out
    when the installed torch already fits), then ``pip install torch-tpu``.

    Args:
        torch_version: the installed torch.
        python: the interpreter whose pip runs.
        torchvision: whether torchvision is installed (default: looked up).

    Example:
        >>> install_commands("2.15.0", python="python")
        [['python', '-m', 'pip', 'install', 'torch-tpu']]
    """
    spec = torch_specifier()
    commands = []
    if not torch_fits(torch_version, spec):
        if torchvision is None:
            torchvision = importlib.util.find_spec("torchvision") is not None
        commands.append([python, "-m", "pip", "install", f"torch{spec}", *(["torchvision"] if torchvision else []),
                         "--index-url", CPU_INDEX, "--upgrade"])
    commands.append([python, "-m", "pip", "install", DISTRIBUTION])
    return commands


def registered() -> bool:
    """Whether this process has TorchTPU's ``"tpu"`` device (its backend loaded on TPU hardware).
    Asks torch for the PrivateUse1 name only: starts no runtime, imports nothing new.

    Example:
        >>> registered() in (True, False)
        True
    """
    import torch

    return torch._C._get_privateuse1_backend_name() == DEVICE


def no_device_reason(tpu_version: str, is_tpu: bool, environ: Mapping[str, str]) -> str:
    """Why the ``"tpu"`` device is missing although ``torch_tpu`` is installed, and what to do.

    Example:
        >>> no_device_reason("0.2.0", False, {}).startswith("torch_tpu 0.2.0 is installed, but this machine has no TPU device")
        True
    """
    if environ.get(AUTOLOAD) == "0":
        return (f"torch_tpu {tpu_version} is installed, but the environment variable {AUTOLOAD} is 0, which stops torch "
                f"from loading it, so the '{DEVICE}' device is not registered: unset it (TorchTPU registers itself when "
                "torch is imported)")
    if is_tpu:
        return (f"torch_tpu {tpu_version} is installed and this runtime shows a TPU, but the '{DEVICE}' device did "
                "not register: is another process (an old notebook kernel) holding the TPU? Restart the runtime")
    return (f"torch_tpu {tpu_version} is installed, but this machine has no TPU device: TorchTPU registers its "
            f"'{DEVICE}' device only where it finds TPU chips. On Colab choose Runtime > Change runtime type > TPU; "
            "here, train on 'cuda' or the CPU (ds.loader(256, device=...))")


# Runs in a subprocess of setup(): the notebook's own process never touches the TPU runtime.
VERIFY_CODE = r"""
import json, os, torch
import torch_tpu  # registered by torch's autoload already, where there is a TPU
name = torch._C._get_privateuse1_backend_name()
if name != "tpu":
    print("NBKIT-VERIFY " + json.dumps({"absent": True, "privateuse1": name}))
else:
    import torch.distributed as dist
    device = torch.device("tpu")
    x = torch.arange(6.0).reshape(2, 3).to(device)
    result = (x @ x.T).sum().item()
    print("NBKIT-VERIFY " + json.dumps({"device": str(device), "device_type": "TPU (torch_tpu)", "result": result,
                                        "backend": dist.Backend.default_device_backend_map.get("tpu")}))
"""
