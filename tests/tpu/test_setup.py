"""nbkit.tpu.setup: requirements, PJRT_DEVICE and the device check in a subprocess, on this machine
and on simulated runtimes."""

import importlib
import os
import sys

import pytest

from nbkit import tpu
from nbkit.tpu import runtime
from nbkit.tpu.runtime import past_xla
from tpu_fakes import COLAB, KAGGLE_TPU, TORCH_BASE, TORCH_MM, fake_root, needs_xla

PAST_XLA = past_xla(TORCH_BASE)  # a torch newer than torch_xla's last release (2.9): no torch_xla for it

setup_py = importlib.import_module("nbkit.tpu.setup")  # nbkit.tpu.setup is the function


def test_setup_dry_run_this_machine_is_idempotent():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    first = tpu.setup(dry_run=True, environ=env)
    assert env["PJRT_DEVICE"] == "CPU"
    if PAST_XLA:  # no TPU and no torch_xla for this torch: nothing asks for one
        assert not any(r.startswith(("torch_xla", "torch==")) for r in first.requirements)
    else:
        assert first.requirements[:2] == (f"torch_xla~={TORCH_MM}.0", f"torch=={TORCH_BASE}")
    assert {"gcsfs>=2023.1", "ipywidgets>=7.7", "matplotlib>=3.5"} <= set(first.requirements)
    assert first.missing == () and first.pip_command is None  # the dev environment has everything
    assert first.verified is None and first.ok
    assert any("no TPU here" in m for m in first.messages)
    second = tpu.setup(dry_run=True, environ=env)
    assert (second.env, second.missing, second.pip_command) == (first.env, first.missing, first.pip_command)
    assert "PJRT_DEVICE=CPU (already set)" in second.messages
    assert "device check" in str(second) and "<table" in second._repr_html_()


@needs_xla
def test_setup_dry_run_colab_tpu(tmp_path):
    env = dict(COLAB, TPU_ACCELERATOR_TYPE="v5litepod-1")
    report = tpu.setup(dry_run=True, environ=env, root=fake_root(tmp_path, tpu_pci=["0x0063"]))
    assert env["PJRT_DEVICE"] == "TPU" and report.env == {"PJRT_DEVICE": "TPU"}
    assert report.info.kind == "colab-tpu"
    assert report.requirements[0] == f"torch_xla[tpu]~={TORCH_MM}.0"
    # torch_xla is installed here, but not libtpu (its [tpu] extra), so it is missing, and the
    # command pins the installed torch so that pip cannot replace it.
    assert report.missing == (f"torch_xla[tpu]~={TORCH_MM}.0",)
    assert report.pip_command == [sys.executable, "-m", "pip", "install", f"torch_xla[tpu]~={TORCH_MM}.0", f"torch=={TORCH_BASE}"]
    assert report.verified is None and not report.installed and not report.ok
    assert any(m.startswith("TPU runtime: colab-tpu, v5litepod-1") for m in report.messages)


@needs_xla
def test_setup_dry_run_colab_tpu_with_everything_preinstalled(tmp_path):
    """Colab's TPU image ships torch_xla and a libtpu; then nothing is missing and pip never runs."""
    libtpu = tmp_path / "libtpu.so"
    libtpu.write_bytes(b"\x7fELF")
    env = dict(COLAB, TPU_LIBRARY_PATH=str(libtpu))
    report = tpu.setup(dry_run=True, install=True, environ=env, root=fake_root(tmp_path, tpu_pci=["0x0063"]))
    assert report.info.libtpu == "TPU_LIBRARY_PATH" and not report.info.warnings
    assert (report.missing, report.pip_command, report.installed) == ((), None, False)
    assert env["PJRT_DEVICE"] == "TPU" and report.ok


@needs_xla
def test_setup_dry_run_kaggle_tpu(tmp_path):
    env = dict(KAGGLE_TPU)
    report = tpu.setup(dry_run=True, environ=env, root=fake_root(tmp_path), extras=("gcs",))
    assert env["PJRT_DEVICE"] == "TPU"
    assert report.info.kind == "kaggle-tpu"
    assert report.requirements == (f"torch_xla[tpu]~={TORCH_MM}.0", f"torch=={TORCH_BASE}", "gcsfs>=2023.1")


def test_setup_dry_run_gpu_and_cpu_fallbacks(tmp_path):
    env = {**COLAB, "COLAB_GPU": "1", "PJRT_DEVICE": "TPU"}
    report = tpu.setup(dry_run=True, environ=env, root=fake_root(tmp_path, gpus=["Tesla T4"]))
    assert env["PJRT_DEVICE"] == "CPU"
    assert report.info.kind == "gpu"
    assert any("torch.device('cuda')" in m for m in report.messages)
    assert "PJRT_DEVICE was TPU but there is no TPU: set PJRT_DEVICE=CPU" in report.messages


def test_setup_respects_an_explicit_cpu_choice_on_a_tpu(tmp_path):
    env = dict(KAGGLE_TPU, PJRT_DEVICE="CPU")
    report = tpu.setup(dry_run=True, environ=env, root=fake_root(tmp_path))
    assert env["PJRT_DEVICE"] == "CPU"
    assert any("kept as set" in m for m in report.messages)


def test_setup_rejects_unknown_extra():
    with pytest.raises(ValueError, match="unknown nbkit extra 'gpu'"):
        tpu.setup(dry_run=True, environ={}, extras=("gpu",))


@needs_xla
def test_setup_verifies_the_device_in_a_subprocess():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    report = tpu.setup(environ=env)
    assert report.verified is True, report.messages
    assert (report.device, report.device_type) == ("xla:0", "CPU")
    assert report.ok
    # The number is explained, not a bare "computed 83".
    assert ("device check: on xla:0 (CPU), [[0,1,2],[3,4,5]] times its transpose, summed, gave 83 "
            "(right: the device computes)") in report.messages
    # The check ran elsewhere: this process can still spawn.
    assert not runtime.runtime_initialized()


@needs_xla
def test_setup_reports_a_failed_device_check(tmp_path):
    env = dict(os.environ, **COLAB)
    env.pop("PJRT_DEVICE", None)
    report = tpu.setup(environ=env, root=fake_root(tmp_path, tpu_pci=["0x0063"]))
    assert env["PJRT_DEVICE"] == "TPU"
    assert report.verified is False and not report.ok
    failure = next(m for m in report.messages if m.startswith("device check failed"))
    assert "install the missing packages first: pip install 'torch_xla[tpu]" in failure
    assert "libtpu" in failure  # torch_xla's own error, passed on


def test_pip_failure_names_command_and_reason():
    cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "nbkit-no-such-package"]
    with pytest.raises(RuntimeError, match="pip failed") as e:
        setup_py._run_pip(cmd)
    assert "nbkit-no-such-package" in str(e.value)
