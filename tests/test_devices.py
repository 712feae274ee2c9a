"""nbkit.devices: the one resolver of ``device=`` arguments, and the one adapter to torch_xla."""

import subprocess
import sys

import pytest
import torch

from nbkit import devices


def test_none_and_auto_pick_the_gpu_when_there_is_one_else_the_cpu():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert devices.resolve(None).type == devices.resolve("auto").type == expected


def test_names_and_devices_resolve_to_torch_devices():
    assert devices.resolve("cpu") == torch.device("cpu")
    assert devices.resolve(torch.device("cpu")) == torch.device("cpu")
    assert devices.resolve("meta") == torch.device("meta")


def test_a_wrong_name_says_what_a_device_is_and_who_asked():
    with pytest.raises(ValueError, match=r"^DeviceLoader: device='gpu0' is not a device\. Use 'cuda'"):
        devices.resolve("gpu0", caller="DeviceLoader")
    with pytest.raises(ValueError, match=r"^compare_training: device=3\.5 is not a device"):
        devices.resolve(3.5, caller="compare_training")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a runtime without CUDA")
def test_cuda_without_a_gpu_names_the_fix():
    with pytest.raises(ValueError, match=r"no CUDA GPU .*Pass device=None or 'cpu'"):
        devices.resolve("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA")
def test_cuda_gets_the_current_gpus_number():
    assert devices.resolve("cuda") == torch.device("cuda", torch.cuda.current_device())
    assert devices.resolve("cuda:0").index == 0


def test_eager_devices_need_no_step_cut_and_no_wait():
    for dev in (torch.device("cpu"), torch.device("meta")):
        devices.step_done(dev)
        devices.wait(dev)


def test_no_torch_xla_until_an_xla_device_is_asked_for():
    code = ("import sys, nbkit, nbkit.devices as d, nbkit.loader, nbkit.bench; d.resolve('cpu'); "
            "print('torch_xla' in sys.modules, d.runtime_started())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


def test_xla_is_this_processs_torch_xla_device():
    pytest.importorskip("torch_xla")
    code = ("import os; os.environ.setdefault('PJRT_DEVICE', 'CPU'); import torch; from nbkit import devices; "
            "dev = devices.resolve('xla'); x = torch.ones(3, device=dev) * 2; devices.step_done(dev); devices.wait(dev); "
            "print(dev.type, devices.runtime_started(), devices.rank_world(), x.sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-5:] == ["xla", "True", "(0,", "1)", "6.0"]
