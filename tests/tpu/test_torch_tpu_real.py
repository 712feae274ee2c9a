"""TorchTPU as published (``torch-tpu`` on the package index), on a machine without TPU chips: what the
package registers and where, what describe()/setup() say with it installed, and what the
multi-process helpers say when it has no device here. The newest-torch venv has it installed; Colab's
TPU stack (torch 2.9) cannot (it needs torch >= 2.11), and these tests skip there saying so.

The multi-process path TorchTPU takes (a torch.distributed group started by spawn) runs here on gloo
and the CPU, in both venvs."""

import importlib.metadata
import importlib.util
import json
import os

import pytest
import torch

import nbkit
from nbkit import tpu
from nbkit.tpu import torchtpu
from tpu_fakes import run_script

try:
    REAL = importlib.metadata.version("torch-tpu")
except importlib.metadata.PackageNotFoundError:
    REAL = None
needs_real = pytest.mark.skipif(
    REAL is None, reason=f"torch-tpu is not installed (it needs torch 2.11-2.15; this is torch {torch.__version__}): "
                         "make test-newest runs these with it")
QUIET = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "1", "PYTHONWARNINGS": "ignore:<TorchTpu/Performance/TcMalloc/"}


@needs_real
def test_the_package_registers_tpu_and_tpu_dist_only_where_it_finds_chips():
    out = run_script("torch_tpu_real.py", env=QUIET, timeout=120)
    # import torch loads it (torch's backend autoload), and without chips it registers nothing:
    assert out["autoloaded"] and out["chips_seen_by_package"] == 0 and not out["registered_without_chips"]
    assert "device type at start of device string: tpu" in out["device_error"]
    # its own registration, with its PCI probe told there is a chip: the names nbkit relies on
    assert out["registered_with_a_chip"] and out["privateuse1"] == torchtpu.DEVICE and out["device"] == "tpu:0"
    assert out["backend_for_tpu"] == torchtpu.BACKEND and sorted(out["backends"]) == ["tpu", "tpu_dist"]
    assert out["launch_env"]  # torch.tpu.distributed.set_tpu_launch_env, which spawn calls
    assert out["fake_device"] == out["privateuse1"]  # the seam tests' fake device has the real name


@needs_real
def test_torch_requirement_comes_from_the_package_metadata(monkeypatch):
    assert torchtpu.torch_specifier() == ">=2.11.0,<=2.15.0"  # torch-tpu 0.2.0's Requires-Dist
    assert torchtpu.version() == REAL and tpu.describe().torch_tpu == REAL
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: ["torch>=2.12; os_name == 'nt'", "numpy>=2"])
    assert torchtpu.torch_specifier() == torchtpu.DOCUMENTED_TORCH  # a marker: not read, the documented range
    monkeypatch.setattr(importlib.metadata, "requires", lambda name: ["torch>=2.12,<2.16"])
    assert torchtpu.torch_specifier() == ">=2.12,<2.16"
    assert not torchtpu.torch_fits("2.11.0") and torchtpu.torch_fits("2.15.1+cpu")


def test_the_colab_install_is_the_one_pytorch_org_documents():
    torch_cmd, tpu_cmd = torchtpu.install_commands("2.9.0+cpu", python="py", torchvision=True)
    spec = torchtpu.torch_specifier()
    assert torch_cmd == ["py", "-m", "pip", "install", f"torch{spec}", "torchvision",
                         "--index-url", "https://download.pytorch.org/whl/cpu", "--upgrade"]
    assert tpu_cmd == ["py", "-m", "pip", "install", "torch-tpu"]
    assert torchtpu.install_commands("2.13.0", python="py") == [tpu_cmd]


@needs_real
def test_setup_reports_torch_tpu_and_no_tpu_device_here_without_torch_xla():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    env.update(QUIET)
    report = tpu.setup(environ=env, extras=())
    assert report.stack == "torch_tpu" and report.info.torch_tpu == REAL
    assert not any("torch_xla" in r for r in report.requirements) and report.pip_command is None
    assert "torch_xla" not in (report.torch_command or [])
    assert report.verified is None and report.ok  # nothing is wrong: this machine has no TPU
    assert report.no_device.startswith(f"torch_tpu {REAL} is installed, but this machine has no TPU device")
    assert ("device check", "skipped: no TPU device (torch_tpu is installed)") in report.rows()
    assert f"device check: {report.no_device}" in report.messages
    note = next(n for n in report.info.notes if n.startswith(f"TorchTPU (torch_tpu {REAL}, needs torch 2.11.0 to 2.15.0)"))
    assert "'tpu_dist'" in note and note in str(report)


@needs_real
@pytest.mark.parametrize("autoload", ["1", "0"])
def test_the_helpers_without_a_tpu_device_say_what_is_missing(autoload, monkeypatch, tmp_path):
    if importlib.util.find_spec("torch_xla") is not None:
        pytest.skip("torch_xla is installed: the helpers run on it")
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", autoload)
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4.0)), str(tmp_path / "c"))
    why = ("this machine has no TPU device" if autoload == "1" else "the environment variable TORCH_DEVICE_BACKEND_AUTOLOAD is 0, which stops torch")
    for name, call in [("spawn", lambda: tpu.spawn(print)), ("warmup_shared", lambda: tpu.warmup_shared(ds)),
                       ("device_loader", lambda: tpu.device_loader(ds, batch_size=2))]:
        with pytest.raises(RuntimeError) as e:
            call()
        message = str(e.value)
        assert message.startswith(f"nbkit.tpu.{name} runs one process per TPU chip on TorchTPU's 'tpu' device or on "
                                  f"torch_xla, and has neither here: torch_tpu {REAL} is installed"), message
        assert why in message and "nbkit.cluster.run_ranks(ds)" in message


def test_spawn_runs_replicas_in_a_torch_distributed_group(tmp_path):
    """TorchTPU's path with gloo in place of 'tpu_dist': ranks, world, the shared warmup and the shards."""
    out = json.loads(run_script("spawn_dist.py", str(tmp_path), timeout=120).splitlines()[-1])
    assert [(r["index"], r["rank"], r["world"]) for r in out] == [(0, 0, 2), (1, 1, 2)]
    assert sum(r["warmed"] for r in out) == 20 and all(r["missing_after"] == 0 for r in out)
    assert sorted(out[0]["labels"] + out[1]["labels"]) == list(range(20)) and not set(out[0]["labels"]) & set(out[1]["labels"])
    assert {r["device"] for r in out} == {"cpu"}
