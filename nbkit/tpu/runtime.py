"""What runtime this is (Colab / Kaggle TPU, a Cloud TPU VM, GPU, CPU), probed without importing
torch_xla and without blocking on the network: :func:`describe` returns a :class:`RuntimeInfo`
(versions installed, known-bad states with their fix), which renders as a table in notebooks.

Example:
    >>> from nbkit.tpu.runtime import describe
    >>> describe(environ={}, root="/nonexistent").kind
    'cpu'
"""

from __future__ import annotations

import html
import importlib.metadata
import importlib.util
import math
import os
import platform
import shlex
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from nbkit.text import Table

from . import torchtpu

__all__ = ["RuntimeInfo", "describe", "drive_path", "choose_stack", "shell_command", "KINDS", "STACKS", "XLA_LAST"]

KINDS = ("colab-tpu", "kaggle-tpu", "tpu-vm", "gpu", "cpu")
STACKS = ("auto", "torch_xla", "torch_tpu")  # what setup(stack=...) and describe(stack=...) take

# torch_xla's last release: it stopped at 2.9.0 (2025-11), and each release needs the torch of the
# same major.minor. A newer torch has no torch_xla: on a TPU the XLA path needs torch 2.9, or
# TorchTPU (the `torch_tpu` package, a native "tpu" device: nbkit.tpu.torchtpu).
XLA_LAST = (2, 9)
XLA_LAST_STACK = ("torch==2.9.0", "torchvision==0.24.0")
TORCH_TPU_NOTE = (
    "TorchTPU (torch_tpu {version}, needs {spec}) is installed: nbkit feeds its 'tpu' device as any torch "
    "device, ds.loader(batch_size, device='tpu'), and nbkit.tpu.spawn, warmup_shared and device_loader run on "
    "its torch.distributed backend ('tpu_dist') instead of torch_xla (untested on real TPU hardware: nbkit's "
    "tests run without a TPU)"
)

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


@dataclass(frozen=True)
class RuntimeInfo:
    """What runtime this is. Returned by :func:`describe`; renders as a table in notebooks.

    Attributes:
        kind: ``"colab-tpu"``, ``"kaggle-tpu"``, ``"tpu-vm"``, ``"gpu"`` or ``"cpu"``.
        platform: ``"colab"``, ``"kaggle"``, ``"gce"`` (a Google Compute Engine VM) or ``"local"``.
        accelerator: e.g. ``"v5litepod-1"``, ``"TPU v5e"``, ``"Tesla T4"``; ``None`` when unknown.
        accelerator_count: chips (TPU) or GPUs on this host, when knowable.
        python, torch, torch_xla, libtpu, torch_tpu: installed versions (``None`` when not installed;
            ``torch_tpu`` is TorchTPU, torch_xla's successor).
        pjrt_device: the current ``PJRT_DEVICE``, if set.
        runtime_initialized: this process already started the XLA runtime (spawning will fail).
        warnings: known-bad states, each naming its fix.
        notes: what to know that is not wrong (e.g. TorchTPU is installed and how nbkit uses it).
        stack: the TPU stack the advice is for (:func:`choose_stack`): ``"torch_xla"``, ``"torch_tpu"``
            or ``None`` (neither needed: a GPU or CPU runtime on a torch newer than torch_xla's last release).

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
    torch_tpu: Optional[str] = None
    notes: tuple = ()
    stack: Optional[str] = None

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
            ("torch_tpu (TorchTPU)", self.torch_tpu or "not installed"),
            ("PJRT_DEVICE", self.pjrt_device or "unset"),
            ("XLA runtime started here", "yes" if self.runtime_initialized else "no"),
        ]

    def __str__(self) -> str:
        lines = [f"note: {n}" for n in self.notes] + [f"warning: {w}" for w in self.warnings]
        return Table(self.rows(), align="ll", notes=lines).text()

    def _repr_html_(self) -> str:
        out = Table(self.rows(), align="ll", notes=self.warnings).html(
            css_class="nbkit-runtime", row_headers=True, note_style="color:#b45309")
        if self.notes:
            out += "<ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in self.notes) + "</ul>"
        return out


def describe(*, environ: Optional[Mapping[str, str]] = None, root="/", stack: str = "auto") -> RuntimeInfo:
    """Say what runtime this is, without importing torch_xla and without blocking.

    The GCE metadata server is asked for the TPU type only on a Google Cloud VM (GCE, Colab,
    Kaggle) that shows a TPU but not its type, with a 0.5 s timeout, by IP (no DNS lookup).

    Args:
        environ: the environment to read (default ``os.environ``); tests pass a fake one.
        root: the file-system root under which ``/sys``, ``/proc`` and ``/dev`` are probed
            (default ``/``); tests pass a temporary directory laid out like a Colab or TPU VM.
        stack: the TPU stack to advise on (``"auto"``, ``"torch_xla"``, ``"torch_tpu"``, as
            :func:`nbkit.tpu.setup` takes it): the install commands in the warnings are that stack's
            only, so that advice for torch_xla never downgrades the torch TorchTPU needs.

    Returns:
        A :class:`RuntimeInfo`; ``print(info)`` gives a text table, a notebook shows an HTML one.

    Example:
        >>> info = describe(environ={}, root="/nonexistent")
        >>> (info.kind, info.platform)
        ('cpu', 'local')
    """
    if stack not in STACKS:
        raise ValueError(f"stack={stack!r}: choose one of {', '.join(map(repr, STACKS))}")
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
    xla_version = dist_version("torch_xla")  # importlib.metadata normalises "-" and "_"
    libtpu = libtpu_version(env)
    tpu_version = torch_tpu_version()
    chosen = choose_stack(stack, torch_version, tpu_version, is_tpu)
    notes = []
    if tpu_version:
        spec = torchtpu.torch_specifier()
        notes.append(TORCH_TPU_NOTE.format(version=tpu_version, spec=torchtpu.torch_range(spec)))
        if chosen == "torch_tpu" and not torchtpu.torch_fits(torch_version, spec):
            warnings.append(f"torch_tpu {tpu_version} needs {torchtpu.torch_range(spec)}, not torch {torch_version}; run "
                            f"nbkit.tpu.setup(install=True) or: {install_display(torch_version)}, then restart "
                            "the runtime")
    mismatch = _version_mismatch(torch_version, xla_version)
    if mismatch and chosen == "torch_tpu":  # TorchTPU replaces it: never suggest pulling torch back for torch_xla
        notes.append(f"torch_xla {xla_version} does not match torch {torch_version}, and TorchTPU does not need it "
                     "(pip uninstall -y torch_xla removes it)")
    elif mismatch:
        warnings.append(mismatch)
    initialized = runtime_initialized()
    if initialized:
        warnings.append(
            "the XLA runtime is already initialised in this process, so spawn() will fail with "
            "'Runtime is already initialized'; restart the runtime and call nbkit.tpu.spawn before "
            "touching the XLA device in the notebook (torch_xla.device(), .to(device), xm.* calls)"
        )
    pjrt = env.get("PJRT_DEVICE") or None
    if pjrt == "TPU" and not is_tpu:
        warnings.append("PJRT_DEVICE=TPU but no TPU was found; run nbkit.tpu.setup() to fall back to PJRT_DEVICE=CPU")
    if is_tpu and chosen == "torch_tpu" and not tpu_version:
        call = "nbkit.tpu.setup(install=True)" if stack == "auto" else f"nbkit.tpu.setup(stack={stack!r}, install=True)"
        warnings.append(f"TorchTPU (torch-tpu, needs {torchtpu.torch_range()}) is not installed; run {call} or: "
                        f"{install_display(torch_version)}, then restart the runtime")
    elif is_tpu and chosen == "torch_xla" and (xla_version is None or libtpu is None):
        what = "torch_xla is not installed" if xla_version is None else "libtpu (torch_xla's TPU runtime) is not installed"
        warnings.append(f"{what}; run nbkit.tpu.setup(install=True) or: {pip_display(xla_requirements(torch_version, True))}"
                        + (_past_xla(torch_version) if past_xla(torch_version) else ""))
    elif not is_tpu and xla_version is None and past_xla(torch_version):
        notes.append(f"torch {torch_version} has no torch_xla (its last release, 2.9, needs torch 2.9), so the XLA "
                     "path is off here; nothing else needs it: train on 'cuda' or the CPU, e.g. ds.loader(256, device='cuda')")

    return RuntimeInfo(
        kind=kind,
        platform=platform_name,
        accelerator=accelerator,
        accelerator_count=count,
        python=platform.python_version(),
        torch=torch_version,
        torch_xla=xla_version,
        libtpu=libtpu,
        pjrt_device=pjrt,
        runtime_initialized=initialized,
        warnings=tuple(warnings),
        torch_tpu=tpu_version,
        notes=tuple(notes),
        stack=chosen,
    )


def choose_stack(stack: str, torch_version: str, torch_tpu: Optional[str], is_tpu: bool) -> Optional[str]:
    """The TPU stack nbkit sets up: ``stack`` when it names one; for ``"auto"``, TorchTPU where
    ``torch_tpu`` is installed or a TPU runs a torch newer than torch_xla's last release (2.9), else
    torch_xla where this torch has one, else ``None`` (a GPU or CPU runtime on a newer torch needs neither).

    Example:
        >>> choose_stack("auto", "2.9.0+cpu", None, True), choose_stack("auto", "2.15.0", None, True)
        ('torch_xla', 'torch_tpu')
        >>> choose_stack("auto", "2.11.0", None, False) is None
        True
    """
    if stack == "torch_tpu" or (stack == "auto" and bool(torch_tpu or (is_tpu and past_xla(torch_version)))):
        return "torch_tpu"
    if stack == "torch_xla" or not past_xla(torch_version):
        return "torch_xla"
    return None


def drive_path(path, *, mount_point: str = "/content/drive", folder: str = "nbkit") -> tuple:
    """Where to keep ``path`` so that it outlives the runtime: Google Drive on Colab.

    A Colab runtime's disk disappears with the runtime. On Colab this mounts Google Drive at
    ``mount_point`` (Colab asks for permission the first time) and returns
    ``<mount_point>/MyDrive/<folder>/<file name>``, creating the folder. Anywhere else it does
    nothing and returns ``path`` unchanged, with a message saying so.

    Args:
        path: the local path, e.g. the tar to export (only its file name is kept on Drive).
        mount_point: where Colab mounts Drive.
        folder: the folder under ``MyDrive``.

    Returns:
        ``(path to use, message for a person)``.

    Example:
        >>> drive_path("export/cache.tar")[0]  # not on Colab: unchanged
        'export/cache.tar'
    """
    path = os.fspath(path)
    colab = sys.modules.get("google.colab")
    if colab is None:
        return path, (f"drive: Google Drive is mounted only on Colab, and this is not Colab: nothing mounted, "
                      f"the file stays at {path}")
    from google.colab import drive  # the real one on Colab; tests put a fake in sys.modules

    drive.mount(mount_point)
    target_dir = os.path.join(mount_point, "MyDrive", folder)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, os.path.basename(path))
    return target, (f"drive: Google Drive mounted at {mount_point}; the file goes to {target}, "
                    "which outlives this runtime")


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


def dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def libtpu_version(environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The libtpu torch_xla would load: a pip package's version, ``"bundled"``, or ``None``."""
    version = dist_version("libtpu") or dist_version("libtpu-nightly")
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


def torch_tpu_version() -> Optional[str]:
    """TorchTPU's version when the ``torch_tpu`` package is installed (found without importing it)."""
    return torchtpu.version()


def past_xla(torch_version: str) -> bool:
    """True when ``torch_version`` is newer than any torch_xla release (2.9 is the last)."""
    return major_minor(torch_version) > XLA_LAST


def _past_xla(torch_version: str) -> str:
    return (f" (torch_xla's last release, 2.9, needs torch 2.9, so this installs torch 2.9 in place of "
            f"{torch_version}; restart the runtime afterwards. Colab's TPU runtime ships torch 2.9 with torch_xla 2.9: "
            "do not upgrade torch there)")


def major_minor(version: str) -> tuple:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def _version_mismatch(torch_version: str, xla_version: Optional[str]) -> Optional[str]:
    if not xla_version:
        return None
    if major_minor(torch_version) == major_minor(xla_version):
        return None
    if past_xla(torch_version):
        return (
            f"torch {torch_version} is newer than torch_xla {xla_version} supports: torch_xla stopped at 2.9, which "
            f"needs torch 2.9; run: {pip_display(xla_requirements(torch_version, True))} and restart the runtime "
            "(on Colab's TPU runtime, do not upgrade torch past 2.9)"
        )
    return (
        f"torch {torch_version} and torch_xla {xla_version} do not match (torch_xla must have the same "
        f"major.minor as torch); run: {pip_display(xla_requirements(torch_version, True))} "
        "and restart the runtime"
    )


def runtime_initialized() -> bool:
    from ..devices import runtime_started

    return runtime_started()


def xla_requirements(torch_version: str, tpu: bool) -> tuple:
    """The torch_xla matching ``torch_version``, with that torch pinned.

    Past torch_xla's last release (2.9) the only torch_xla is 2.9, and it needs torch 2.9 and
    torchvision 0.24: never a torch newer than torch_xla supports.

    Example:
        >>> xla_requirements("2.9.0+cpu", True)
        ('torch_xla[tpu]~=2.9.0', 'torch==2.9.0')
        >>> xla_requirements("2.14.1", False)
        ('torch_xla~=2.9.0', 'torch==2.9.0', 'torchvision==0.24.0')
    """
    base = torch_version.split("+")[0]
    if past_xla(base):
        major, minor = XLA_LAST
        torch_pins = XLA_LAST_STACK
    else:
        major, minor = major_minor(base)
        torch_pins = (f"torch=={base}",)  # the torch that is there: pip must fail loudly rather than replace it
    xla = f"torch_xla[tpu]~={major}.{minor}.0" if tpu else f"torch_xla~={major}.{minor}.0"
    return (xla, *torch_pins)



def pip_display(requirements) -> str:
    """A pip command for a person to paste into a shell or a ``!`` cell: each requirement quoted
    (``>``, ``<`` and ``[`` are special there), an option and a URL as they are.

    Example:
        >>> pip_display(["torch>=2.11", "--index-url", "https://download.pytorch.org/whl/cpu"])
        "pip install 'torch>=2.11' --index-url https://download.pytorch.org/whl/cpu"
    """
    return "pip install " + " ".join(_quoted(r) for r in requirements)


def install_display(torch_version: str) -> str:
    """TorchTPU's install commands (:func:`nbkit.tpu.torchtpu.install_commands`) as a person pastes them
    into a shell or a ``!`` cell: each quoted, joined by ``&&``.

    Example:
        >>> install_display("2.15.0")
        "pip install 'torch-tpu'"
    """
    return " && ".join(pip_display(c[4:]) for c in torchtpu.install_commands(torch_version))


def shell_command(argv) -> str:
    """A whole command line (``[python, "-m", "pip", "install", ...]``), quoted as :func:`pip_display`
    quotes it, ready to paste into a shell.

    Example:
        >>> shell_command(["/usr/bin/python3", "-m", "pip", "install", "torch>=2.11,<=2.15", "--upgrade"])
        "/usr/bin/python3 -m pip install 'torch>=2.11,<=2.15' --upgrade"
    """
    argv = list(argv)
    if argv[1:4] == ["-m", "pip", "install"]:
        return shlex.quote(argv[0]) + " -m pip install " + " ".join(_quoted(a) for a in argv[4:])
    return shlex.join(argv)


def _quoted(arg: str) -> str:
    # A requirement is always quoted, so that every command reads alike; shlex for what needs more than quotes.
    if arg.startswith("-") or (arg.startswith("https://") and shlex.quote(arg) == arg):
        return arg
    return f"'{arg}'" if "'" not in arg else shlex.quote(arg)

