"""nbkit.tpu.runtime: describe() on this machine and on simulated Colab / Kaggle / TPU-VM runtimes
(a fake environment plus a fake file-system root); it never imports torch_xla and never hangs."""

import importlib.metadata
import sys
import time
from pathlib import Path

import torch

from nbkit import tpu
from nbkit.tpu import runtime
from tpu_fakes import COLAB, KAGGLE_TPU, fake_root, metadata_server, run_script


def test_describe_this_machine():
    info = tpu.describe()
    has_gpu = any(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    assert info.kind == ("gpu" if has_gpu else "cpu")
    assert info.platform in ("colab", "kaggle", "gce", "local")
    assert info.torch == torch.__version__
    assert info.torch_xla == runtime.dist_version("torch_xla")  # None where torch_xla is not installed
    assert info.python == ".".join(map(str, sys.version_info[:3]))
    assert not info.runtime_initialized
    assert not any("do not match" in w for w in info.warnings)
    text = str(info)
    xla = info.torch_xla or "not installed"
    assert "torch_xla" in text and xla in text and info.kind in text
    html = info._repr_html_()
    assert html.startswith("<table") and f"<td style='text-align:left'>{xla}</td>" in html


def test_import_nbkit_and_describe_do_not_import_torch_xla():
    out = run_script("import_is_light.py", timeout=120)
    assert out["torch_xla_imported"] is False
    assert out["kind"] in tpu.KINDS


def test_describe_colab_tpu_v5e(tmp_path, metadata_server):
    server = metadata_server(accelerator_type="v5litepod-1")
    root = fake_root(tmp_path, tpu_pci=["0x0063"], dirs=["content"])
    info = tpu.describe(environ={**COLAB, "GCE_METADATA_HOST": server.host}, root=root)
    assert (info.kind, info.platform) == ("colab-tpu", "colab")
    assert info.is_tpu
    assert (info.accelerator, info.accelerator_count) == ("v5litepod-1", 1)  # type: metadata server; count: PCI
    assert server.requests == [("/computeMetadata/v1/instance/attributes/accelerator-type", "Google")]
    assert "colab-tpu" in str(info) and "v5litepod-1 × 1" in str(info)


def test_describe_kaggle_tpu_uses_environment_without_network(tmp_path, metadata_server, monkeypatch):
    monkeypatch.setattr(runtime, "libtpu_version", lambda environ=None: None)  # torch-tpu brings one to the newest venv
    monkeypatch.setattr(runtime, "torch_tpu_version", lambda: None)
    server = metadata_server()
    root = fake_root(tmp_path, dirs=["kaggle/input"])
    info = tpu.describe(environ={**KAGGLE_TPU, "GCE_METADATA_HOST": server.host}, root=root)
    assert (info.kind, info.platform) == ("kaggle-tpu", "kaggle")
    assert (info.accelerator, info.accelerator_count) == ("v3-8", 4)
    assert server.requests == []
    assert info.libtpu is None
    # torch_xla: only on Colab's TPU stack; a torch past torch_xla's last release is told TorchTPU's install instead
    missing = ("libtpu" if info.torch_xla else "TorchTPU (torch-tpu" if runtime.past_xla(info.torch)
               else "torch_xla is not installed")
    assert any(missing in w and "setup(install=True)" in w for w in info.warnings)


def test_describe_cloud_tpu_vm_asks_metadata_server(tmp_path, metadata_server):
    server = metadata_server(accelerator_type="v4-8")
    root = fake_root(tmp_path, tpu_pci=["0x005e"] * 4, dmi="Google Compute Engine")
    info = tpu.describe(environ={"GCE_METADATA_HOST": server.host}, root=root)
    assert (info.kind, info.platform) == ("tpu-vm", "gce")
    assert (info.accelerator, info.accelerator_count) == ("v4-8", 4)
    assert len(server.requests) == 1


def test_describe_plain_gce_vm_does_not_ask_metadata_server(tmp_path, metadata_server):
    server = metadata_server()
    root = fake_root(tmp_path, dmi="Google Compute Engine")
    info = tpu.describe(environ={"GCE_METADATA_HOST": server.host}, root=root)
    assert (info.kind, info.platform, info.accelerator) == ("cpu", "gce", None)
    assert server.requests == []


def test_describe_silent_metadata_server_does_not_hang(tmp_path, metadata_server):
    server = metadata_server(silent=True)
    root = fake_root(tmp_path, tpu_pci=["0x006f"] * 8, dmi="Google Compute Engine")
    start = time.monotonic()
    info = tpu.describe(environ={"GCE_METADATA_HOST": server.host}, root=root)
    elapsed = time.monotonic() - start
    # Not a speed target: a hang would be unbounded; the probe's own timeout is 0.5 s.
    assert elapsed < 10
    assert server.requests == [("connected", None)]
    assert (info.kind, info.accelerator, info.accelerator_count) == ("tpu-vm", "TPU v6e", 8)
    assert any("did not answer" in w for w in info.warnings)


def test_describe_colab_gpu(tmp_path):
    root = fake_root(tmp_path, gpus=["Tesla T4"])
    info = tpu.describe(environ={**COLAB, "COLAB_GPU": "1"}, root=root)
    assert (info.kind, info.platform, info.accelerator, info.accelerator_count) == ("gpu", "colab", "Tesla T4", 1)
    assert not info.is_tpu


def test_describe_legacy_colab_tpu_node(tmp_path):
    info = tpu.describe(environ={**COLAB, "COLAB_TPU_ADDR": "10.0.0.2:8470"}, root=fake_root(tmp_path))
    assert info.kind == "cpu" and info.accelerator == "TPU Node (legacy)"
    assert any("TPU VM runtime" in w for w in info.warnings)


def test_describe_warns_about_pjrt_tpu_without_tpu(tmp_path):
    info = tpu.describe(environ={"PJRT_DEVICE": "TPU"}, root=fake_root(tmp_path))
    assert info.pjrt_device == "TPU"
    assert any("setup()" in w and "PJRT_DEVICE=CPU" in w for w in info.warnings)


def test_version_mismatch_warning_names_the_fix():
    warning = runtime._version_mismatch("2.8.0+cu126", "2.9.0")
    assert "do not match" in warning
    assert "pip install 'torch_xla[tpu]~=2.8.0' 'torch==2.8.0'" in warning
    assert runtime._version_mismatch("2.9.0+cu128", "2.9.0") is None
    assert runtime._version_mismatch("2.9.1", "2.9.0") is None
    assert runtime._version_mismatch("2.9.0", None) is None


def test_the_package_keeps_its_public_names():
    assert tpu.__all__ == ["RuntimeInfo", "SetupReport", "describe", "drive_path", "setup", "spawn", "warmup_shared", "device_loader"]
    assert callable(tpu.setup) and tpu.describe is runtime.describe and tpu.RuntimeInfo is runtime.RuntimeInfo
