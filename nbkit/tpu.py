"""TPU runtime: detect it, set up torch_xla, and run a cached dataset on every TPU process.

Everything torch_xla-specific in nbkit lives in this module, so a successor runtime can be
swapped in here alone. ``import nbkit`` never imports torch_xla; the functions that need it import
it when called and, when it is missing, raise an ``ImportError`` that names the pip command.

The flow in a notebook:

* :func:`describe` says what this runtime is (Colab / Kaggle TPU, a Cloud TPU VM, GPU, CPU), which
  versions are installed, and warns about known-bad states. It never imports torch_xla and never
  blocks on the network.
* :func:`setup` computes (and, when asked, runs) the pip command for the torch_xla matching the
  installed torch, sets ``PJRT_DEVICE`` (``TPU``, or ``CPU`` as a fallback that keeps the rest of a
  tutorial runnable) and verifies the device with a tiny computation **in a subprocess**, so the
  notebook's own process stays free to :func:`spawn`.
* :func:`spawn` runs ``fn(index, *args)`` on every TPU process of the host; inside it,
  :func:`warmup_shared` fills one shared cache, each process computing only its own shard, and
  :func:`device_loader` feeds the process's device from its own sampler shard.

Example:
    >>> from nbkit import tpu
    >>> info = tpu.describe()
    >>> info.kind in ("colab-tpu", "kaggle-tpu", "tpu-vm", "gpu", "cpu")
    True
"""

from __future__ import annotations

import html
import importlib
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing
import os
import pickle
import platform
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, MutableMapping, Optional, Sequence

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = [
    "RuntimeInfo",
    "SetupReport",
    "describe",
    "setup",
    "spawn",
    "warmup_shared",
    "device_loader",
]

KINDS = ("colab-tpu", "kaggle-tpu", "tpu-vm", "gpu", "cpu")

# PCI ids of TPU chips (vendor 0x1ae0 is Google), as torch_xla and JAX read them.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {
    "0x0027": "v2/v3",
    "0x005e": "v4",
    "0x0062": "v5p",
    "0x0063": "v5e",
    "0x006f": "v6e",
    "0x0076": "v7x",
}
# The GCE metadata server, by IP so that no DNS lookup can block; GCE_METADATA_HOST overrides it
# (the variable Google's own client libraries honour).
_METADATA_HOST = "169.254.169.254"
_METADATA_TIMEOUT = 0.5
# Generous: the first TPU initialisation of a fresh VM can take a minute.
_VERIFY_TIMEOUT = 300.0

# The nbkit extras, for when nbkit's own metadata is not installed (a source checkout on sys.path).
_EXTRAS_FALLBACK = {
    "gcs": ("gcsfs>=2023.1",),
    "notebook": ("ipywidgets>=7.7", "matplotlib>=3.5"),
    "zst": ("zstandard",),
}


# ----------------------------------------------------------------------------------------------
# describe()


@dataclass(frozen=True)
class RuntimeInfo:
    """What runtime this is. Returned by :func:`describe`; renders as a table in notebooks.

    Attributes:
        kind: ``"colab-tpu"``, ``"kaggle-tpu"``, ``"tpu-vm"``, ``"gpu"`` or ``"cpu"``.
        platform: ``"colab"``, ``"kaggle"``, ``"gce"`` (a Google Compute Engine VM) or ``"local"``.
        accelerator: e.g. ``"v5litepod-1"``, ``"TPU v5e"``, ``"Tesla T4"``; ``None`` when unknown.
        accelerator_count: chips (TPU) or GPUs on this host, when knowable.
        python, torch, torch_xla, libtpu: installed versions (``None`` when not installed).
        pjrt_device: the current ``PJRT_DEVICE``, if set.
        runtime_initialized: this process already started the XLA runtime (spawning will fail).
        warnings: known-bad states, each naming its fix.

    Example:
        >>> info = describe(environ={"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_SKIP_MDS_QUERY": "1"}, root="/nonexistent")
        >>> info.kind, info.accelerator, info.is_tpu
        ('tpu-vm', 'v5litepod-1', True)
    """

    kind: str
    platform: str
    accelerator: Optional[str]
    accelerator_count: Optional[int]
    python: str
    torch: str
    torch_xla: Optional[str]
    libtpu: Optional[str]
    pjrt_device: Optional[str]
    runtime_initialized: bool
    warnings: tuple = ()

    @property
    def is_tpu(self) -> bool:
        """True on a TPU runtime (Colab, Kaggle or a Cloud TPU VM)."""
        return self.kind in ("colab-tpu", "kaggle-tpu", "tpu-vm")

    def rows(self) -> list:
        """``(field, value)`` pairs, in display order."""
        acc = self.accelerator or "-"
        if self.accelerator_count:
            acc = f"{acc} × {self.accelerator_count}"
        return [
            ("runtime", f"{self.kind} ({self.platform})"),
            ("accelerator", acc),
            ("python", self.python),
            ("torch", self.torch),
            ("torch_xla", self.torch_xla or "not installed"),
            ("libtpu", self.libtpu or "not installed"),
            ("PJRT_DEVICE", self.pjrt_device or "unset"),
            ("XLA runtime started here", "yes" if self.runtime_initialized else "no"),
        ]

    def __str__(self) -> str:
        return _text_table(self.rows(), [f"warning: {w}" for w in self.warnings])

    def _repr_html_(self) -> str:
        return _html_table("nbkit-runtime", self.rows(), self.warnings, "color:#b45309")


def describe(*, environ: Optional[Mapping[str, str]] = None, root="/") -> RuntimeInfo:
    """Say what runtime this is, without importing torch_xla and without blocking.

    The GCE metadata server is asked for the TPU type only on a Google Cloud VM (GCE, Colab,
    Kaggle) that shows a TPU but not its type, with a 0.5 s timeout, by IP (no DNS lookup).

    Args:
        environ: the environment to read (default ``os.environ``); tests pass a fake one.
        root: the file-system root under which ``/sys``, ``/proc`` and ``/dev`` are probed
            (default ``/``); tests pass a temporary directory laid out like a Colab or TPU VM.

    Returns:
        A :class:`RuntimeInfo`; ``print(info)`` gives a text table, a notebook shows an HTML one.

    Example:
        >>> info = describe(environ={}, root="/nonexistent")
        >>> (info.kind, info.platform)
        ('cpu', 'local')
    """
    env = os.environ if environ is None else environ
    root = Path(root)
    warnings: list = []

    platform_name = _platform(env, root)
    tpu_chips, tpu_generation = _pci_tpu_chips(root)
    is_tpu = _tpu_hints(env, root, tpu_chips)
    accel_type = env.get("TPU_ACCELERATOR_TYPE") or None
    if is_tpu and accel_type is None and platform_name in ("gce", "colab", "kaggle"):
        accel_type = _metadata_accelerator_type(env, warnings)
    legacy_node = bool(env.get("COLAB_TPU_ADDR") or env.get("XRT_TPU_CONFIG"))

    gpus = _nvidia_gpus(root)
    if is_tpu:
        kind = {"colab": "colab-tpu", "kaggle": "kaggle-tpu"}.get(platform_name, "tpu-vm")
        accelerator = accel_type or (f"TPU {tpu_generation}" if tpu_generation else "TPU")
        count = tpu_chips or _chips_from_env(env)
    elif legacy_node:
        kind, accelerator, count = "cpu", "TPU Node (legacy)", None
        warnings.append(
            "this is a legacy TPU Node runtime (COLAB_TPU_ADDR / XRT_TPU_CONFIG), which torch_xla 2.x "
            "cannot use; choose a TPU VM runtime (Colab: Runtime > Change runtime type > a TPU such as v5e-1)"
        )
    elif gpus:
        kind, accelerator, count = "gpu", gpus[0], len(gpus)
    else:
        kind, accelerator, count = "cpu", None, None

    torch_version = torch.__version__
    xla_version = _dist_version("torch_xla")  # importlib.metadata normalises "-" and "_"
    libtpu_version = _libtpu_version(env)
    mismatch = _version_mismatch(torch_version, xla_version)
    if mismatch:
        warnings.append(mismatch)
    initialized = _runtime_initialized()
    if initialized:
        warnings.append(
            "the XLA runtime is already initialised in this process, so spawn() will fail with "
            "'Runtime is already initialized'; restart the runtime and call nbkit.tpu.spawn before "
            "touching the XLA device in the notebook (torch_xla.device(), .to(device), xm.* calls)"
        )
    pjrt = env.get("PJRT_DEVICE") or None
    if pjrt == "TPU" and not is_tpu:
        warnings.append("PJRT_DEVICE=TPU but no TPU was found; run nbkit.tpu.setup() to fall back to PJRT_DEVICE=CPU")
    if is_tpu and (xla_version is None or libtpu_version is None):
        what = "torch_xla is not installed" if xla_version is None else "libtpu (torch_xla's TPU runtime) is not installed"
        warnings.append(f"{what}; run nbkit.tpu.setup(install=True) or: {_pip_display(_xla_requirements(torch_version, True))}")

    return RuntimeInfo(
        kind=kind,
        platform=platform_name,
        accelerator=accelerator,
        accelerator_count=count,
        python=platform.python_version(),
        torch=torch_version,
        torch_xla=xla_version,
        libtpu=libtpu_version,
        pjrt_device=pjrt,
        runtime_initialized=initialized,
        warnings=tuple(warnings),
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def _platform(env: Mapping[str, str], root: Path) -> str:
    if env.get("COLAB_RELEASE_TAG") or env.get("COLAB_GPU") is not None or env.get("COLAB_BACKEND_VERSION"):
        return "colab"
    if env.get("KAGGLE_KERNEL_RUN_TYPE") or env.get("KAGGLE_URL_BASE") or (root / "kaggle" / "input").is_dir():
        return "kaggle"
    dmi = root / "sys" / "class" / "dmi" / "id"
    if "Google" in _read(dmi / "product_name") or "Google" in _read(dmi / "bios_vendor"):
        return "gce"
    return "local"


def _pci_tpu_chips(root: Path) -> tuple:
    """(number of TPU chips on the PCI bus, their generation or None)."""
    chips, generation = 0, None
    for vendor in sorted((root / "sys" / "bus" / "pci" / "devices").glob("*/vendor")):
        if _read(vendor) != _GOOGLE_PCI_VENDOR:
            continue
        device = _read(vendor.parent / "device")
        if device in _TPU_PCI_DEVICES:
            chips += 1
            generation = _TPU_PCI_DEVICES[device]
    return chips, generation


def _tpu_hints(env: Mapping[str, str], root: Path, pci_chips: int) -> bool:
    """Signs of a TPU VM that do not need the metadata server."""
    if pci_chips or env.get("TPU_ACCELERATOR_TYPE") or env.get("ISTPUVM") == "1":
        return True
    if env.get("TPU_CHIPS_PER_HOST_BOUNDS") or env.get("TPU_WORKER_ID") is not None:
        return True
    return any((root / "dev").glob("accel[0-9]*"))


def _chips_from_env(env: Mapping[str, str]) -> Optional[int]:
    bounds = env.get("TPU_CHIPS_PER_HOST_BOUNDS")
    if not bounds:
        return None
    try:
        return math.prod(int(d) for d in bounds.split(","))
    except ValueError:
        return None


def _metadata_accelerator_type(env: Mapping[str, str], warnings: list) -> Optional[str]:
    if env.get("TPU_SKIP_MDS_QUERY"):
        return None
    host = env.get("GCE_METADATA_HOST") or env.get("GCE_METADATA_IP") or _METADATA_HOST
    url = f"http://{host}/computeMetadata/v1/instance/attributes/accelerator-type"
    request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
    try:
        with urllib.request.urlopen(request, timeout=_METADATA_TIMEOUT) as response:
            return response.read(200).decode("utf-8", "replace").strip() or None
    except urllib.error.HTTPError:
        return None  # a plain GCE VM without a TPU: the attribute does not exist
    except (OSError, ValueError) as e:  # URLError and socket timeouts are OSErrors
        warnings.append(f"the GCE metadata server at {host} did not answer within {_METADATA_TIMEOUT}s ({e}); TPU type unknown")
        return None


def _nvidia_gpus(root: Path) -> list:
    # /proc/driver/nvidia/gpus/<bus id>/information says "Model: Tesla T4"; reading it does not
    # initialise CUDA (torch.cuda.is_available() would, and a forked spawn() then breaks).
    models = []
    for info in sorted((root / "proc" / "driver" / "nvidia" / "gpus").glob("*/information")):
        model = "NVIDIA GPU"
        for line in _read(info).splitlines():
            if line.startswith("Model:"):
                model = line.split(":", 1)[1].strip() or model
        models.append(model)
    return models


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _libtpu_version(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The libtpu torch_xla would load: a pip package's version, ``"bundled"``, or ``None``."""
    version = _dist_version("libtpu") or _dist_version("libtpu-nightly")
    if version:
        return version
    env = os.environ if environ is None else environ
    if env.get("TPU_LIBRARY_PATH") and os.path.isfile(env["TPU_LIBRARY_PATH"]):
        return "TPU_LIBRARY_PATH"
    try:  # locates the package without importing it
        spec = importlib.util.find_spec("torch_xla")
    except (ImportError, ValueError, AttributeError):  # a broken or deliberately hidden torch_xla
        spec = None
    if spec is not None and spec.submodule_search_locations:
        if any(os.path.isfile(os.path.join(d, "lib", "libtpu.so")) for d in spec.submodule_search_locations):
            return "bundled with torch_xla"
    return None


def _major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _version_mismatch(torch_version: str, xla_version: Optional[str]) -> Optional[str]:
    if not xla_version:
        return None
    if _major_minor(torch_version) == _major_minor(xla_version):
        return None
    return (
        f"torch {torch_version} and torch_xla {xla_version} do not match (torch_xla must have the same "
        f"major.minor as torch); run: {_pip_display(_xla_requirements(torch_version, True))} "
        "and restart the runtime"
    )


def _runtime_initialized() -> bool:
    # Only a process that imported torch_xla can have started its runtime; never import it here.
    xla = sys.modules.get("torch_xla")
    if xla is None:
        return False
    try:
        return bool(xla._XLAC._xla_runtime_is_initialized())
    except AttributeError:
        return False


# ----------------------------------------------------------------------------------------------
# setup()


@dataclass
class SetupReport:
    """What :func:`setup` found and did. Renders as a table in notebooks.

    Attributes:
        info: the :class:`RuntimeInfo` it acted on.
        requirements: everything the runtime needs (pip requirement strings).
        missing: the part of ``requirements`` not yet satisfied.
        pip_command: the command installing ``missing`` (``None`` when nothing is missing).
        installed: whether the command was run (``install=True``) and succeeded.
        env: the environment variables set, e.g. ``{"PJRT_DEVICE": "TPU"}``.
        device: the XLA device the verification ran on (e.g. ``"xla:0"``), or ``None``.
        device_type: what PJRT ran on (``"TPU"`` / ``"CPU"``), or ``None`` if not verified.
        verified: ``True`` / ``False``, or ``None`` when skipped (``dry_run``).
        messages: what happened, in order, for a person to read.

    Example:
        >>> report = setup(dry_run=True, environ={}, root="/nonexistent")
        >>> report.info.kind, report.env, report.verified
        ('cpu', {'PJRT_DEVICE': 'CPU'}, None)
    """

    info: RuntimeInfo
    requirements: tuple
    missing: tuple
    pip_command: Optional[list]
    installed: bool = False
    env: dict = field(default_factory=dict)
    device: Optional[str] = None
    device_type: Optional[str] = None
    verified: Optional[bool] = None
    messages: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is missing and the verification did not fail."""
        return not self.missing and self.verified is not False

    def rows(self) -> list:
        verified = {True: f"yes, on {self.device} ({self.device_type})", False: "FAILED", None: "skipped"}[self.verified]
        return [
            ("runtime", f"{self.info.kind} ({self.info.platform})"),
            ("to install", " ".join(self.missing) or "nothing"),
            ("pip command", " ".join(self.pip_command) if self.pip_command else "-"),
            ("installed now", "yes" if self.installed else "no"),
            ("environment", ", ".join(f"{k}={v}" for k, v in self.env.items()) or "-"),
            ("device check", verified),
        ]

    def __str__(self) -> str:
        return _text_table(self.rows(), [f"- {m}" for m in self.messages])

    def _repr_html_(self) -> str:
        return _html_table("nbkit-setup", self.rows(), self.messages, "")


def _text_table(rows: list, notes: list) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join([f"{k.ljust(width)}  {v}" for k, v in rows] + notes)


def _html_table(css_class: str, rows: list, notes: list, note_style: str) -> str:
    body = "".join(
        f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
        f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
        for k, v in rows
    )
    items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
    return f"<table class='{css_class}'>{body}</table>" + (f"<ul style='{note_style}'>{items}</ul>" if items else "")


def setup(
    *,
    install: bool = False,
    dry_run: bool = False,
    extras: Sequence[str] = ("gcs", "notebook"),
    environ: Optional[MutableMapping[str, str]] = None,
    root="/",
) -> SetupReport:
    """Make this runtime ready for the TPU path of nbkit. Safe to run again.

    1. Describes the runtime (:func:`describe`).
    2. Computes the requirements: the torch_xla matching the installed torch (``torch_xla[tpu]`` on a
       TPU; plain ``torch_xla``, which runs on the CPU, elsewhere), pinned to the installed torch so
       pip cannot swap torch, plus the packages of nbkit's ``extras``. Only unsatisfied ones go
       into ``pip_command``, which runs when ``install=True`` and not ``dry_run``.
    3. Sets ``PJRT_DEVICE``: ``TPU`` on a TPU, otherwise ``CPU`` (torch_xla then runs on the CPU,
       so the tutorial keeps working, slowly). A value already set is kept when it can work.
    4. Unless ``dry_run``, runs a tiny computation on the XLA device **in a subprocess**, so this
       process never initialises the XLA runtime and :func:`spawn` still works afterwards.

    Args:
        install: run the pip command (needs network; on Colab and Kaggle, torch_xla is preinstalled).
        dry_run: compute and report only: no pip, no device check (the environment is still set).
        extras: nbkit extras whose packages to require (``"gcs"``, ``"notebook"``, ``"zst"``).
        environ: the environment to read and update (default ``os.environ``).
        root: file-system root to probe (see :func:`describe`).

    Returns:
        A :class:`SetupReport`; it renders as a table, ``report.ok`` sums it up.

    Example:
        >>> env = {}
        >>> report = setup(dry_run=True, environ=env, root="/nonexistent")
        >>> env["PJRT_DEVICE"], report.verified
        ('CPU', None)
    """
    env = os.environ if environ is None else environ
    info = describe(environ=env, root=root)
    messages: list = []

    requirements = _xla_requirements(info.torch, info.is_tpu) + _extra_requirements(extras)
    missing = tuple(r for r in requirements if not _satisfied(r, env))
    pip_command = _pip_command(missing, requirements)
    report = SetupReport(info=info, requirements=requirements, missing=missing, pip_command=pip_command)

    if info.is_tpu:
        messages.append(f"TPU runtime: {info.kind}, {info.accelerator or 'TPU'}" + (f" × {info.accelerator_count}" if info.accelerator_count else ""))
    elif info.kind == "gpu":
        messages.append(
            f"no TPU here, but a GPU ({info.accelerator}): the XLA path runs on the CPU (PJRT_DEVICE=CPU); "
            "for speed, train on torch.device('cuda') directly"
        )
    else:
        messages.append(
            "no TPU here: the XLA path runs on the CPU (PJRT_DEVICE=CPU), so the tutorial works, slowly; "
            "for a TPU on Colab choose Runtime > Change runtime type > TPU"
        )
    messages.extend(info.warnings)

    if not missing:
        messages.append("all requirements are already installed")
    elif install and not dry_run:
        _run_pip(pip_command)
        importlib.invalidate_caches()
        report.installed = True
        report.missing = tuple(r for r in requirements if not _satisfied(r, env))
        messages.append(f"installed: {' '.join(missing)}")
        if "torch_xla" in sys.modules and any(r.startswith("torch_xla") for r in missing):
            messages.append("torch_xla was already imported in this process: restart the runtime to use the new one")
    else:
        messages.append(f"missing: {' '.join(missing)}; install with setup(install=True) or: {_pip_display(pip_command[4:])}")

    report.env = _set_pjrt_device(env, info, messages)

    if dry_run:
        messages.append("dry run: device check skipped")
    elif _dist_version("torch_xla") is None:
        report.verified = False
        messages.append(f"device check not possible: torch_xla is not installed; run {_pip_display(_xla_requirements(info.torch, info.is_tpu))}")
    else:
        _verify(report, env, messages)
    report.messages = messages
    return report


def _pip_command(missing: tuple, requirements: tuple) -> Optional[list]:
    if not missing:
        return None
    pins = [r for r in requirements if r.startswith("torch==") and r not in missing]
    if any(r.startswith("torch_xla") for r in missing):
        missing = (*missing, *pins)  # keep pip from replacing the installed torch
    return [sys.executable, "-m", "pip", "install", *missing]


def _xla_requirements(torch_version: str, tpu: bool) -> tuple:
    base = torch_version.split("+")[0]
    major, minor = _major_minor(base)
    xla = f"torch_xla[tpu]~={major}.{minor}.0" if tpu else f"torch_xla~={major}.{minor}.0"
    # Pin the torch that is already there: pip must fail loudly rather than replace it.
    return (xla, f"torch=={base}")


def _extra_requirements(extras: Sequence[str]) -> tuple:
    if isinstance(extras, str):
        extras = (extras,)
    try:
        declared = importlib.metadata.requires("nbkit") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    out = []
    for extra in extras:
        marker = f'extra == "{extra}"'
        found = [r.split(";")[0].strip() for r in declared if marker in r]
        if not found:
            found = list(_EXTRAS_FALLBACK.get(extra, ()))
        if not found:
            raise ValueError(f"unknown nbkit extra {extra!r}; choose from {sorted(_EXTRAS_FALLBACK)}")
        out.extend(r for r in found if r not in out)
    return tuple(out)


def _satisfied(requirement: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Installed in a matching version (and ``torch_xla[tpu]`` with a libtpu)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging is almost always there (pip, matplotlib, pytest need it); if not, presence decides
        name = requirement.split("[")[0].split("~")[0].split("=")[0].split(">")[0].strip()
        return _dist_version(name) is not None and ("[tpu]" not in requirement or _libtpu_version(environ) is not None)

    req = Requirement(requirement)
    version = _dist_version(req.name)
    if version is None or not req.specifier.contains(version.split("+")[0], prereleases=True):
        return False
    # torch_xla[tpu] is the one requirement with an extra: what it adds is a libtpu torch_xla can load
    # (a pip wheel, or a copy the image bundles, as on Colab).
    return "tpu" not in req.extras or _libtpu_version(environ) is not None


def _pip_display(requirements) -> str:
    return "pip install " + " ".join(f"'{r}'" for r in requirements)


def _run_pip(command: list) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"pip failed (exit {done.returncode}) running {' '.join(command)}:\n{tail}")


def _set_pjrt_device(env: MutableMapping[str, str], info: RuntimeInfo, messages: list) -> dict:
    current = env.get("PJRT_DEVICE")
    wanted = "TPU" if info.is_tpu else "CPU"
    if current == wanted:
        messages.append(f"PJRT_DEVICE={current} (already set)")
        return {"PJRT_DEVICE": current}
    if current and current != "TPU":
        # e.g. CPU on a TPU on purpose, or a GPU/plugin device: respect the user's choice.
        messages.append(f"PJRT_DEVICE={current} kept as set (a TPU would use PJRT_DEVICE=TPU)" if info.is_tpu else f"PJRT_DEVICE={current} kept as set")
        return {"PJRT_DEVICE": current}
    env["PJRT_DEVICE"] = wanted
    if current == "TPU":
        messages.append("PJRT_DEVICE was TPU but there is no TPU: set PJRT_DEVICE=CPU")
    else:
        messages.append(f"set PJRT_DEVICE={wanted}")
    if info.runtime_initialized:
        messages.append("the XLA runtime already started in this process and keeps its old device; restart the runtime")
    return {"PJRT_DEVICE": wanted}


_VERIFY_CODE = r"""
import json, torch, torch_xla, torch_xla.runtime as xr
device = torch_xla.device()
x = torch.arange(6.0).reshape(2, 3).to(device)
result = (x @ x.T).sum().item()
print("NBKIT-VERIFY " + json.dumps({"device": str(device), "device_type": xr.device_type(), "result": result}))
"""
_VERIFY_EXPECTED = 83.0  # [[0,1,2],[3,4,5]] @ its transpose = [[5,14],[14,50]]


def _verify(report: SetupReport, env: Mapping[str, str], messages: list) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", _VERIFY_CODE],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=_VERIFY_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        report.verified = False
        messages.append(f"device check did not finish within {_VERIFY_TIMEOUT:.0f}s (is another process holding the TPU?)")
        return
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("NBKIT-VERIFY ")), None)
    if done.returncode != 0 or line is None:
        report.verified = False
        tail = "\n".join(done.stderr.strip().splitlines()[-8:])
        if report.missing:
            hint = f" (install the missing packages first: {_pip_display(report.pip_command[4:])})"
        elif report.info.is_tpu:
            hint = " (is another process, e.g. an old notebook kernel, holding the TPU?)"
        else:
            hint = ""
        messages.append(f"device check failed{hint}:\n{tail}")
        return
    result = json.loads(line[len("NBKIT-VERIFY "):])
    report.device, report.device_type = result["device"], result["device_type"]
    report.verified = abs(result["result"] - _VERIFY_EXPECTED) < 1e-3
    messages.append(
        f"device check: {report.device} ({report.device_type}) computed {result['result']:g}"
        + ("" if report.verified else f", expected {_VERIFY_EXPECTED:g}")
    )


# ----------------------------------------------------------------------------------------------
# Running on every TPU process


def _require_xla():
    """Import torch_xla, or raise an ImportError that names the pip command."""
    try:
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.parallel_loader as pl
        import torch_xla.distributed.xla_multiprocessing as xmp
        import torch_xla.runtime as xr
    except ImportError as e:
        raise ImportError(
            "nbkit.tpu needs torch_xla matching torch "
            f"{torch.__version__}: {_pip_display(_xla_requirements(torch.__version__, True))} "
            "(or pip install 'nbkit[tpu]'; without a TPU, drop the [tpu] extra)"
        ) from e
    return torch_xla, xm, xr, xmp, pl


def _default_start_method() -> str:
    # fork lets a function defined in a notebook (module __main__, no file to re-import) reach the
    # children, and is safe as long as this process has not started the XLA runtime (checked).
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def spawn(fn: Callable, args: tuple = (), *, nprocs: Optional[int] = None, start_method: Optional[str] = None) -> None:
    """Run ``fn(index, *args)`` once per TPU device of this host, each in its own replica.

    Wraps ``torch_xla.distributed.xla_multiprocessing.spawn``. The default start method is
    ``fork`` (where the platform has it), so a function defined in a notebook works; the XLA
    runtime must not be started in this process before (call :func:`setup`, which verifies in a
    subprocess, instead of touching the device here).

    On a TPU each chip gets its own process. With ``PJRT_DEVICE=CPU`` torch_xla runs the
    ``CPU_NUM_DEVICES`` replicas as threads of one process, and XLA:CPU has no collectives
    (pytorch/xla#5005): there, step each replica with ``optimizer.step()``, not
    ``xm.optimizer_step`` or ``xm.all_reduce``, unless ``CPU_NUM_DEVICES`` is 1.

    Args:
        fn: a function defined with ``def`` at the top level of a module or notebook.
        args: extra arguments, after the process index. They are pickled.
        nprocs: ``None`` for every device of the host, or ``1`` to run in this process.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; default as above.

    Example:
        >>> def train(index, ds):
        ...     warmup_shared(ds)
        ...     for x, y in device_loader(ds, batch_size=64):
        ...         ...
        >>> spawn(train, args=(ds,))  # doctest: +SKIP
    """
    if nprocs not in (None, 1):
        raise ValueError(
            f"nprocs={nprocs!r}: torch_xla runs one replica per device, so nprocs must be None (all devices "
            "of the host) or 1; to use fewer devices set TPU_PROCESS_BOUNDS/TPU_VISIBLE_CHIPS on a TPU, "
            "or CPU_NUM_DEVICES with PJRT_DEVICE=CPU"
        )
    method = start_method or _default_start_method()
    if method != "fork" and getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in a notebook, which start_method={method!r} cannot "
            "re-import in a new process; use start_method='fork' (the default on Linux) or move the function "
            "into a .py module and import it"
        )
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"spawn() sends fn and args to each process by pickling, and this failed: {e}. Define fn with "
            "'def' at the top level of the notebook or a module (not a lambda or a nested function), and pass "
            "objects that pickle (a CachedDataset does)"
        ) from e

    torch_xla, xm, xr, xmp, pl = _require_xla()
    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise RuntimeError(
            "the XLA runtime is already initialised in this process (something used the XLA device, e.g. "
            "torch_xla.device() or tensor.to(device)), so torch_xla cannot start one process per device. "
            "Restart the runtime and call nbkit.tpu.spawn before touching the device in the notebook; "
            "nbkit.tpu.setup() checks the device in a subprocess and is safe to call first"
        )
    if not os.environ.get("PJRT_DEVICE"):
        os.environ["PJRT_DEVICE"] = "TPU" if describe().is_tpu else "CPU"
    return xmp.spawn(fn, args=args, nprocs=nprocs, start_method=method)


def _local_shard() -> tuple:
    """(this replica's index, number of replicas) on this host, from the torch_xla runtime."""
    _, _, xr, _, _ = _require_xla()
    # The cache is a directory on this host, so its warmup is split among this host's replicas.
    return xr.local_ordinal(), xr.local_device_count()


def warmup_shared(ds, *, callback=None, stall_timeout: float = 600.0, poll_interval: float = 0.05):
    """Fill a cache shared by all replicas of this host, each computing only its shard.

    Call it inside the function given to :func:`spawn`. Replica ``r`` of ``w`` warms the indices
    ``i % w == r`` (``ds.warmup(shard=(r, w))``), so no sample is computed twice, then waits until
    the whole cache is stored. The barrier is the cache itself, not an XLA collective: XLA:CPU has
    no collectives, and a peer that stops making progress is reported instead of waited on forever.

    The cache is a directory on this host, so the shards are split among this host's replicas
    (``xr.local_ordinal()`` of ``xr.local_device_count()``); on one host that is the whole world.

    Args:
        ds: an :class:`nbkit.CachedDataset` (with its source).
        callback: progress for this replica's shard (see :mod:`nbkit.progress`).
        stall_timeout: seconds without any newly stored sample after which waiting fails.
        poll_interval: first delay between checks of the other replicas' progress.

    Returns:
        This replica's ``WarmupReport``.

    Raises:
        TimeoutError: other replicas stopped storing samples for ``stall_timeout`` seconds.

    Example:
        >>> def train(index, ds):
        ...     warmup_shared(ds)        # afterwards, every sample is cached
        >>> spawn(train, args=(ds,))     # doctest: +SKIP
    """
    rank, world = _local_shard()
    report = ds.warmup(shard=(rank, world), callback=callback)
    if getattr(report, "stopped", False):
        return report
    _wait_until_complete(ds, stall_timeout, poll_interval, f"replica {rank} of {world}")
    return report


def _wait_until_complete(ds, stall_timeout: float, poll_interval: float, who: str) -> None:
    left = len(ds.missing())
    last_progress = time.monotonic()
    delay = poll_interval
    while left:
        time.sleep(delay)
        now_left = len(ds.missing())
        if now_left < left:
            left, last_progress, delay = now_left, time.monotonic(), poll_interval
        elif time.monotonic() - last_progress > stall_timeout:
            raise TimeoutError(
                f"{who}: {left} samples of {ds.path} are still missing and no replica stored one for "
                f"{stall_timeout:.0f}s; another replica probably failed or was stopped (see its traceback). "
                "Run warmup_shared again to resume"
            )
        else:
            delay = min(delay * 1.5, 1.0)


class _EpochShuffledSampler(DistributedSampler):
    """A ``DistributedSampler`` that reshuffles every time it is iterated (no ``set_epoch`` needed)."""

    def __iter__(self):
        it = super().__iter__()
        self.set_epoch(self.epoch + 1)
        return it


def device_loader(ds, *, batch_size: int, shuffle: bool = True, num_workers: int = 0, drop_last: bool = True, **kw):
    """Batches of this replica's shard of ``ds``, already on its XLA device.

    A ``torch_xla`` ``MpDeviceLoader`` over a ``DataLoader`` with a ``DistributedSampler`` for this
    replica (rank and world size from the torch_xla runtime) and ``collate_fn=nbkit.collate``.
    Every replica gets the same number of batches, and the order changes each epoch (each
    iteration of the loader, or of its ``sampler`` attribute, starts the next epoch's shuffle).

    Args:
        ds: the dataset, usually an :class:`nbkit.CachedDataset`.
        batch_size: samples per batch on each replica.
        shuffle: shuffle (differently each epoch).
        num_workers: DataLoader workers; 0 is fastest for a cache served from memory.
        drop_last: drop the last incomplete batch (keeps shapes static, so XLA compiles once).
        **kw: more ``DataLoader`` arguments (e.g. ``collate_fn`` to override ``nbkit.collate``).

    Example:
        >>> def train(index, ds):
        ...     for images, labels in device_loader(ds, batch_size=128):
        ...         ...
        >>> spawn(train, args=(ds,))  # doctest: +SKIP
    """
    torch_xla, xm, xr, xmp, pl = _require_xla()
    import nbkit

    sampler = _EpochShuffledSampler(ds, num_replicas=xr.world_size(), rank=xr.global_ordinal(), shuffle=shuffle)
    kw.setdefault("collate_fn", nbkit.collate)
    loader = DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=num_workers, drop_last=drop_last, **kw)
    device_loader = pl.MpDeviceLoader(loader, torch_xla.device())
    device_loader.sampler = sampler  # this replica's shard; iterating it starts a new epoch
    return device_loader
