"""The TorchTPU seam: with ``torch_tpu`` installed (a fake here: tests/tpu_scripts/fake_torch_tpu, a
native "tpu" device built on torch's PrivateUse1 backend, renamed, as the real package does where it
finds TPU chips), describe() and setup() say how nbkit uses it, and ``ds.loader(..., device="tpu")``
delivers batches there through the path every torch device takes. The real package registers no
device without TPU chips, so it is tested apart (test_torch_tpu_real.py); untested on real TPU hardware."""

import os

import pytest
import torch.utils.backend_registration as backend_registration

from nbkit import tpu
from nbkit.tpu import torchtpu
from tpu_fakes import SCRIPTS, run_script

FAKE = str(SCRIPTS / "fake_torch_tpu")
needs_python_backend = pytest.mark.skipif(
    not hasattr(backend_registration, "_setup_privateuseone_for_python_backend"),
    reason="the fake 'tpu' device needs torch's Python backend hooks (torch >= 2.10); make test-newest runs this")


@needs_python_backend
def test_loader_delivers_batches_on_a_fake_tpu_device():
    out = run_script("torch_tpu_seam.py", env={"PYTHONPATH": FAKE}, timeout=180)
    assert out["describe_torch_tpu"] in ("installed", torchtpu.version()) and not out["torch_tpu_imported_by_describe"]
    assert any("ds.loader(batch_size, device='tpu')" in n and "untested on real TPU hardware" in n for n in out["notes"])
    assert out["devices"] == ["tpu:0"] and out["types"] == ["FakeTPUTensor"]
    assert out["labels"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert out["doubled"] == [[0.0, 8.0, 16.0, 24.0], [32.0, 40.0, 48.0, 56.0], [64.0, 72.0]]  # batch_transform ran on it
    assert out["shuffled_is_permutation"] and out["forward_device"] == "tpu:0"
    assert not out["torch_xla_before"] and not out["torch_xla_after"]  # the seam never touches torch_xla


@needs_python_backend
def test_setup_checks_the_torch_tpu_device_in_a_subprocess(monkeypatch):
    monkeypatch.syspath_prepend(FAKE)  # describe() finds it here (without importing it), the check's subprocess by PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    env["PYTHONPATH"] = FAKE
    report = tpu.setup(environ=env)
    if not report.info.torch_tpu:
        pytest.fail(f"describe() did not find the fake torch_tpu: {report.info}")
    if report.info.torch_xla and not tpu.runtime.past_xla(report.info.torch):
        pytest.skip("torch_xla matches this torch, so setup() checks the XLA device instead")
    assert report.verified is True, report.messages
    assert (report.device, report.device_type) == ("tpu", "TPU (torch_tpu)")
    assert not any(r.startswith("torch_xla") for r in report.requirements)


def test_loader_on_tpu_without_torch_tpus_device_names_torch_tpu(monkeypatch, tmp_path):
    """``ds.loader(device="tpu")`` where TorchTPU's device is not registered: the error is about TorchTPU
    (not installed: its install; installed without chips: why there is no device), never torch_xla's device."""
    import torch

    import nbkit

    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(4, 2)), tmp_path / "cache")
    with pytest.raises(ValueError, match=r"device='tpu' is TorchTPU's device, and it is not here: torch_tpu") as e:
        ds.loader(2, device="tpu")
    assert "setup(stack='torch_tpu', install=True)" in str(e.value) and "torch_xla.device()" not in str(e.value)
    assert "nbkit.tpu.describe() says which" in str(e.value)
    with pytest.raises(ValueError, match=r"device='tpu:0' is TorchTPU's device.*TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        nbkit.DeviceLoader(ds, 2, device="tpu:0")
