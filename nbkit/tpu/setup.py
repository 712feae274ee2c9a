"""Make a runtime ready for nbkit's TPU path: :func:`setup` picks the TPU stack (torch_xla matching the
installed torch, or TorchTPU, ``torch_tpu``, torch_xla's successor), computes (and, when asked, runs)
its pip commands, sets ``PJRT_DEVICE`` (``TPU``, or ``CPU`` as a fallback that keeps a tutorial
runnable) and checks the device with a tiny computation **in a subprocess**, so the notebook's own
process stays free to :func:`nbkit.tpu.spawn`. It returns a :class:`SetupReport`.

Example:
    >>> from nbkit.tpu.setup import setup
    >>> setup(dry_run=True, environ={}, root="/nonexistent").env
    {'PJRT_DEVICE': 'CPU'}
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Mapping, MutableMapping, Optional, Sequence

from nbkit.text import Table
from nbkit.extras import DISTRIBUTION

from . import torchtpu
from .runtime import (STACKS, RuntimeInfo, describe, dist_version, libtpu_version, past_xla, pip_display, shell_command,
                      xla_requirements)

__all__ = ["SetupReport", "setup"]

# What Colab's TPU runtime ships (its published package list, 2026-08).
COLAB_TPU_FACTS = (
    "Colab's TPU runtime (a v5e-1 on the free tier) ships Python 3.13, torch 2.9 with torch_xla 2.9 (keep them: "
    "torch_xla has no release for a newer torch), jax, grain and ipywidgets 7.7.1, but not gcsfs "
    "(setup(install=True) adds it, and only what is missing)"
)

# Generous: the first TPU initialisation of a fresh VM can take a minute.
_VERIFY_TIMEOUT = 300.0

# The nbkit extras, for when nbkit's own metadata is not installed (a source checkout on sys.path).
_EXTRAS_FALLBACK = {
    "gcs": ("gcsfs>=2023.1",),
    "notebook": ("ipywidgets>=7.7", "matplotlib>=3.5"),
    "zst": ("zstandard",),
}



@dataclass
class SetupReport:
    """What :func:`setup` found and did. Renders as a table in notebooks.

    Attributes:
        info: the :class:`RuntimeInfo` it acted on.
        requirements: everything the runtime needs (pip requirement strings).
        missing: the part of ``requirements`` not yet satisfied.
        pip_command: the command installing ``missing`` (``None`` when nothing is missing).
        torch_command: for TorchTPU on a torch it does not support, the command run first that
            installs a supported CPU torch from pytorch.org's index (``None`` otherwise).
        stack: ``"torch_xla"``, ``"torch_tpu"`` or ``None`` (neither needed: a GPU or CPU runtime).
        installed: whether the command was run (``install=True``) and succeeded.
        env: the environment variables set, e.g. ``{"PJRT_DEVICE": "TPU"}``.
        device: the XLA device the verification ran on (e.g. ``"xla:0"``), or ``None``.
        device_type: what PJRT ran on (``"TPU"`` / ``"CPU"``), or ``None`` if not verified.
        verified: ``True`` / ``False``, or ``None`` when skipped (``dry_run``, or TorchTPU on a machine
            without a TPU: then ``no_device`` says so).
        no_device: why TorchTPU's ``"tpu"`` device is missing, when the check found it missing.
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
    torch_command: Optional[list] = None
    stack: Optional[str] = None
    installed: bool = False
    env: dict = field(default_factory=dict)
    device: Optional[str] = None
    device_type: Optional[str] = None
    verified: Optional[bool] = None
    messages: list = field(default_factory=list)
    no_device: Optional[str] = None

    def commands(self) -> str:
        """The commands that install what is missing, for a person to paste into a shell or a ``!``
        cell (each argument quoted), ``""`` when nothing is missing."""
        return " && ".join(pip_display(c[4:]) for c in (self.torch_command, self.pip_command) if c)

    @property
    def ok(self) -> bool:
        """True when nothing is missing and the verification did not fail."""
        return not self.missing and self.verified is not False

    def rows(self) -> list:
        verified = {True: f"yes, on {self.device} ({self.device_type})", False: "FAILED", None: "skipped"}[self.verified]
        if self.no_device:
            verified += ": no TPU device (torch_tpu is installed)"
        commands = [c for c in (self.torch_command, self.pip_command) if c]
        return [
            ("runtime", f"{self.info.kind} ({self.info.platform})"),
            ("to install", " ".join(self.missing) or "nothing"),
            ("pip command", " && ".join(shell_command(c) for c in commands) or "-"),  # pasteable: quoted
            ("installed now", "yes" if self.installed else "no"),
            ("environment", ", ".join(f"{k}={v}" for k, v in self.env.items()) or "-"),
            ("device check", verified),
        ]

    def __str__(self) -> str:
        return Table(self.rows(), align="ll", notes=self.messages, note_prefix="- ").text()

    def _repr_html_(self) -> str:
        # The notes' indent kept small: a 400-pixel output fits a long name (an environment variable) on a line.
        return Table(self.rows(), align="ll", notes=self.messages).html(css_class="nbkit-setup", row_headers=True,
                                                                        note_style="margin:0;padding-left:1em;font-size:85%", keep_words=True)


def setup(
    *,
    install: bool = False,
    dry_run: bool = False,
    extras: Sequence[str] = ("gcs", "notebook"),
    environ: Optional[MutableMapping[str, str]] = None,
    root="/",
    stack: str = "auto",
) -> SetupReport:
    """Make this runtime ready for the TPU path of nbkit. Safe to run again.

    1. Describes the runtime (:func:`describe`).
    2. Picks the stack (``stack="auto"``): TorchTPU when ``torch_tpu`` is installed, or on a TPU
       whose torch is newer than torch_xla's last release (2.9); else torch_xla where torch 2.9
       has it (Colab's TPU runtime ships torch 2.9 + torch_xla 2.9); else neither (a GPU or CPU
       runtime on a newer torch). Then the requirements: the torch_xla matching the installed
       torch (``torch_xla[tpu]`` on a TPU; plain ``torch_xla``, which runs on the CPU,
       elsewhere), pinned to that torch so pip cannot swap it; or ``torch-tpu`` and the torch it
       needs (from its metadata), installed as pytorch.org documents for Colab; plus the packages
       of nbkit's ``extras``. Only unsatisfied ones go into the commands, which run when
       ``install=True`` and not ``dry_run``. With TorchTPU installed it never asks for torch_xla.
    3. Sets ``PJRT_DEVICE``: ``TPU`` on a TPU, otherwise ``CPU`` (torch_xla then runs on the CPU,
       so the tutorial keeps working, slowly). A value already set is kept when it can work.
    4. Unless ``dry_run``, runs a tiny computation on the XLA device **in a subprocess**, so this
       process never initialises the XLA runtime and :func:`spawn` still works afterwards (on
       TorchTPU's ``"tpu"`` device with that stack: without TPU chips the check says that the
       package is installed but there is no TPU device; untested on real TPU hardware).

    Args:
        install: run the pip command (needs network; on Colab and Kaggle, torch_xla is preinstalled).
        dry_run: compute and report only: no pip, no device check (the environment is still set).
        extras: nbkit extras whose packages to require (``"gcs"``, ``"notebook"``, ``"zst"``).
        environ: the environment to read and update (default ``os.environ``).
        root: file-system root to probe (see :func:`describe`).
        stack: ``"auto"``, ``"torch_xla"`` or ``"torch_tpu"`` (e.g. ``setup(stack="torch_tpu",
            install=True)`` moves Colab's TPU runtime from torch_xla to TorchTPU: a newer CPU
            torch, then ``torch-tpu``; restart the runtime afterwards).

    Returns:
        A :class:`SetupReport`; it renders as a table, ``report.ok`` sums it up.

    Example:
        >>> env = {}
        >>> report = setup(dry_run=True, environ=env, root="/nonexistent")
        >>> env["PJRT_DEVICE"], report.verified
        ('CPU', None)
    """
    if stack not in STACKS:
        raise ValueError(f"setup(stack={stack!r}): choose one of {', '.join(map(repr, STACKS))}")
    env = os.environ if environ is None else environ
    info = describe(environ=env, root=root, stack=stack)  # its advice is for the stack chosen here
    messages: list = []

    # torch_xla stopped at 2.9: TorchTPU (on torch 2.11+) is the TPU stack past it. A GPU or CPU
    # runtime on a newer torch needs neither.
    use_tpu, need_xla = info.stack == "torch_tpu", info.stack == "torch_xla"
    if use_tpu:
        stack_requirements = (*(() if torchtpu.torch_fits(info.torch) else (f"torch{torchtpu.torch_specifier()}",)),
                              torchtpu.DISTRIBUTION)
    else:
        stack_requirements = xla_requirements(info.torch, info.is_tpu) if need_xla else ()
    requirements = stack_requirements + _extra_requirements(extras)
    missing = tuple(r for r in requirements if not _satisfied(r, env))
    torch_command = None
    if use_tpu and any(r.startswith("torch") and r != torchtpu.DISTRIBUTION for r in missing):
        torch_command = torchtpu.install_commands(info.torch)[0]
        missing_after = tuple(r for r in missing if not r.startswith("torch") or r == torchtpu.DISTRIBUTION)
    else:
        missing_after = missing
    pip_command = _pip_command(missing_after, requirements)
    report = SetupReport(info=info, requirements=requirements, missing=missing, pip_command=pip_command,
                         torch_command=torch_command, stack="torch_tpu" if use_tpu else "torch_xla" if need_xla else None)

    if info.is_tpu:
        messages.append(f"TPU runtime: {info.kind}, {info.accelerator or 'TPU'}" + (f" × {info.accelerator_count}" if info.accelerator_count else ""))
        if info.kind == "colab-tpu":
            messages.append(COLAB_TPU_FACTS)
    elif info.kind == "gpu":
        messages.append(
            f"no TPU here, but a GPU ({info.accelerator}): "
            + ("the XLA path runs on the CPU (PJRT_DEVICE=CPU); " if need_xla else "")
            + "for speed, train on torch.device('cuda') directly"
        )
    else:
        messages.append(
            ("no TPU here: the XLA path runs on the CPU (PJRT_DEVICE=CPU), so the tutorial works, slowly; " if need_xla
             else "no TPU here: train on the CPU; ")
            + "for a TPU on Colab choose Runtime > Change runtime type > TPU"
        )
    messages.extend(info.notes)
    messages.extend(info.warnings)
    if need_xla and past_xla(info.torch):
        messages.append(f"torch {info.torch} is newer than torch_xla's last release (2.9): the XLA path needs torch 2.9; "
                        "TorchTPU runs on this torch instead: setup(stack='torch_tpu')")
    if use_tpu:
        messages.append(f"TPU stack: TorchTPU (torch-tpu, needs {torchtpu.torch_range()}), installed as pytorch.org "
                        "documents for Colab; torch_xla is not needed")
    elif need_xla and info.is_tpu:
        messages.append("TPU stack: torch_xla; TorchTPU (torch_xla's successor) is the other one: "
                        "setup(stack='torch_tpu', install=True) installs it (a newer CPU torch, then torch-tpu; restart "
                        "the runtime afterwards)")

    if not missing:
        messages.append("all requirements are already installed")
    elif install and not dry_run:
        for command in (torch_command, pip_command):
            if command:
                _run_pip(command)
        importlib.invalidate_caches()
        report.installed = True
        report.missing = tuple(r for r in requirements if not _satisfied(r, env))
        messages.append(f"installed: {' '.join(missing)}")
        if "torch_xla" in sys.modules and any(r.startswith("torch_xla") for r in missing):
            messages.append("torch_xla was already imported in this process: restart the runtime to use the new one")
        if torch_command:
            messages.append(f"torch {info.torch} was already imported in this process: restart the runtime to use the new torch")
    else:
        messages.append(f"missing: {' '.join(missing)}; install with setup(install=True) or: {report.commands()}")

    report.env = _set_pjrt_device(env, info, messages)

    if dry_run:
        messages.append("dry run: device check skipped")
    elif use_tpu:
        tpu_version = torchtpu.version()
        if tpu_version is None:
            report.verified = False
            messages.append("device check not possible: torch_tpu is not installed; run setup(stack='torch_tpu', install=True)")
        elif torch_command and report.installed:
            messages.append("device check skipped: restart the runtime first (torch was replaced), then run setup() again")
        elif not torchtpu.torch_fits(info.torch):
            # torch_tpu cannot import on this torch: the check would only show its traceback.
            report.verified = False
            messages.append(f"device check not possible: torch_tpu {tpu_version} needs {torchtpu.torch_range()}, not "
                            f"torch {info.torch}; run setup(stack='torch_tpu', install=True) or: {report.commands()}, "
                            "then restart the runtime and run setup() again")
        else:
            _verify(report, env, messages, code=torchtpu.VERIFY_CODE, tpu_version=tpu_version)
    elif not need_xla:
        messages.append(f"device check skipped: no torch_xla for torch {info.torch} (its last release is 2.9) and none "
                        "needed here; batches go to 'cuda' or stay on the CPU (ds.loader(..., device=...))")
    elif dist_version("torch_xla") is None:
        report.verified = False
        messages.append(f"device check not possible: torch_xla is not installed; run {pip_display(xla_requirements(info.torch, info.is_tpu))}")
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


def _extra_requirements(extras: Sequence[str]) -> tuple:
    if isinstance(extras, str):
        extras = (extras,)
    try:
        declared = importlib.metadata.requires(DISTRIBUTION) or []
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
        return dist_version(name) is not None and ("[tpu]" not in requirement or libtpu_version(environ) is not None)

    req = Requirement(requirement)
    version = dist_version(req.name)
    if version is None or not req.specifier.contains(version.split("+")[0], prereleases=True):
        return False
    # torch_xla[tpu] is the one requirement with an extra: what it adds is a libtpu torch_xla can load
    # (a pip wheel, or a copy the image bundles, as on Colab).
    return "tpu" not in req.extras or libtpu_version(environ) is not None


def _run_pip(command: list) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"pip failed (exit {done.returncode}) running {shell_command(command)}:\n{tail}")


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


def _verify(report: SetupReport, env: Mapping[str, str], messages: list, code: str = _VERIFY_CODE,
            tpu_version: Optional[str] = None) -> None:
    try:
        done = subprocess.run(
            [sys.executable, "-c", code],
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
        if report.missing and report.commands():
            hint = f" (install the missing packages first: {report.commands()})"
        elif report.stack == "torch_tpu":
            hint = (f" (torch_tpu did not import: it needs {torchtpu.torch_range()} and a libtpu; this is torch "
                    f"{report.info.torch})")
        elif report.info.is_tpu:
            hint = " (is another process, e.g. an old notebook kernel, holding the TPU?)"
        else:
            hint = ""
        messages.append(f"device check failed{hint}:\n{tail}")
        return
    result = json.loads(line[len("NBKIT-VERIFY "):])
    if result.get("absent"):  # TorchTPU installed, its "tpu" device not registered
        report.no_device = torchtpu.no_device_reason(tpu_version or "?", report.info.is_tpu, env)
        report.verified = False if report.info.is_tpu else None
        messages.append(f"device check: {report.no_device}")
        return
    report.device, report.device_type = result["device"], result["device_type"]
    report.verified = abs(result["result"] - _VERIFY_EXPECTED) < 1e-3
    messages.append(
        f"device check: on {report.device} ({report.device_type}), [[0,1,2],[3,4,5]] times its transpose, "
        f"summed, gave {result['result']:g} "
        + ("(right: the device computes)" if report.verified else f"instead of {_VERIFY_EXPECTED:g}: the device is not usable")
    )
