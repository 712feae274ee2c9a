"""Coming from torch_xla: the CachedDataset tutorial's flow runs on nbkit unchanged but for the import,
with real torch_xla 2.9 on the CPU (PJRT_DEVICE=CPU) in a subprocess (tests/tpu_scripts/xla_tutorial.py)."""

import json
import subprocess

import pytest
import torch

import nbkit
from tpu_fakes import run_script, needs_xla


@needs_xla
@pytest.mark.slow
def test_torch_xla_tutorial_flow_in_xmp_spawn_then_tar_czf(mnist_root, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    build = tmp_path / "build"
    build.mkdir()
    steps = 3
    run_script("xla_tutorial.py", str(mnist_root), str(build / "cache"), str(out_dir), str(steps),
               env={"CPU_NUM_DEVICES": "2"}, timeout=300)
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("result-*.json"))]
    assert sorted(r["ordinal"] for r in results) == [0, 1] and {r["world"] for r in results} == {2}
    for r in results:
        # The old keywords were accepted, each with a FutureWarning saying what nbkit does instead.
        future = [w for w in r["warnings"] if w.startswith("FutureWarning")]
        assert len(future) == 2, r["warnings"]
        assert any("max_files_per_folder=1000" in w and "no file per sample" in w for w in future)
        assert any("compress=True" in w and "compression='zst'" in w for w in future)
        assert len(r["losses"]) == steps
    trained = sorted({i for r in results for i in r["trained_on"]})
    assert len(trained) == 2 * steps * 16

    # Carry the cache as the tutorial did: a plain tar czf, extracted elsewhere.
    archive = tmp_path / "cache.tar.gz"
    subprocess.run(["tar", "czf", str(archive), "-C", str(build), "cache"], check=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run(["tar", "xzf", str(archive), "-C", str(elsewhere)], check=True)

    ds = nbkit.CachedDataset(None, str(elsewhere / "cache"))  # the seed spelling: no source
    missing = ds.missing()  # MpDeviceLoader read ahead of the last step: more than `trained` is cached, not all
    assert len(ds) == 2000 and 0 < len(missing) < 2000 - len(trained) and ds.verify() == 2000 - len(missing)
    from torchvision import datasets, transforms

    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    src = datasets.MNIST(mnist_root, train=True, download=False, transform=tf)
    for i in trained[:5] + trained[-5:]:
        x, y = ds[i]
        assert torch.equal(x, src[i][0]) and y == src[i][1]
    never_read = int(missing[0])
    try:
        ds[never_read]
    except RuntimeError as e:  # torch_xla's CachedDataset raised RuntimeError for a sample it lacked
        assert isinstance(e, nbkit.MissingSampleError) and f"sample {never_read} is not in the cache" in str(e)
    else:
        pytest.fail("a sample never cached must raise")
