"""nbkit.tpu with real torch_xla 2.9 on the CPU (PJRT_DEVICE=CPU).

Everything that starts the XLA runtime runs in a subprocess (the scripts in tests/tpu_scripts/),
so this pytest process never initialises it and spawn-based tests stay independent.
Simulated Colab / Kaggle / TPU-VM runtimes are a fake environment plus a fake file-system root
(PCI ids, DMI strings, NVIDIA driver files) handed to describe() and setup().
"""

import http.server
import importlib.metadata
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import nbkit
from nbkit import tpu

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "tpu_scripts"
TORCH_MM = ".".join(torch.__version__.split("+")[0].split(".")[:2])
TORCH_BASE = torch.__version__.split("+")[0]


# -- fakes -----------------------------------------------------------------------------------------


def fake_root(tmp_path, *, tpu_pci=(), dmi=None, gpus=(), dirs=()):
    """A file-system root laid out like a VM: TPU chips on the PCI bus, DMI strings, NVIDIA GPUs."""
    root = tmp_path / "root"
    devices = root / "sys" / "bus" / "pci" / "devices"
    other = devices / "0000:00:01.0"  # a non-Google device that must be ignored
    other.mkdir(parents=True)
    (other / "vendor").write_text("0x8086\n")
    (other / "device").write_text("0x0063\n")
    for k, device_id in enumerate(tpu_pci):
        d = devices / f"0000:00:{4 + k:02x}.0"
        d.mkdir(parents=True)
        (d / "vendor").write_text("0x1ae0\n")
        (d / "device").write_text(device_id + "\n")
    if dmi:
        d = root / "sys" / "class" / "dmi" / "id"
        d.mkdir(parents=True)
        (d / "product_name").write_text(dmi + "\n")
        (d / "bios_vendor").write_text("Google\n")
    for k, model in enumerate(gpus):
        d = root / "proc" / "driver" / "nvidia" / "gpus" / f"0000:00:{5 + k:02x}.0"
        d.mkdir(parents=True)
        (d / "information").write_text(f"Model: \t\t {model}\nIRQ:   \t\t 37\n")
    for name in dirs:
        (root / name).mkdir(parents=True, exist_ok=True)
    return root


class MetadataServer:
    """A GCE metadata server on 127.0.0.1 that answers accelerator-type, or never answers (silent)."""

    def __init__(self, accelerator_type="v4-8", silent=False):
        self.requests = []
        self.silent = silent
        self._held = []
        if silent:
            self._sock = socket.socket()
            self._sock.bind(("127.0.0.1", 0))
            self._sock.listen(8)
            self.port = self._sock.getsockname()[1]
            self._thread = threading.Thread(target=self._hold, daemon=True)
        else:
            outer = self

            class Handler(http.server.BaseHTTPRequestHandler):
                def do_GET(self):
                    outer.requests.append((self.path, self.headers.get("Metadata-Flavor")))
                    if self.path.endswith("/instance/attributes/accelerator-type") and self.headers.get("Metadata-Flavor") == "Google":
                        body = accelerator_type.encode()
                        self.send_response(200)
                    else:
                        body = b"not found"
                        self.send_response(404)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

                def log_message(self, *args):
                    pass

            self._http = http.server.HTTPServer(("127.0.0.1", 0), Handler)
            self.port = self._http.server_address[1]
            self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def _hold(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.requests.append(("connected", None))
            self._held.append(conn)  # never answer

    @property
    def host(self):
        return f"127.0.0.1:{self.port}"

    def close(self):
        if self.silent:
            self._sock.close()
            for c in self._held:
                c.close()
        else:
            self._http.shutdown()
            self._http.server_close()


@pytest.fixture
def metadata_server():
    servers = []

    def start(**kw):
        servers.append(MetadataServer(**kw))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


COLAB = {"COLAB_RELEASE_TAG": "release-colab_20251110-060000_RC00", "COLAB_BACKEND_VERSION": "2025.11"}
KAGGLE_TPU = {  # what a Kaggle TPU VM notebook exports
    "KAGGLE_KERNEL_RUN_TYPE": "Interactive",
    "KAGGLE_URL_BASE": "https://www.kaggle.com",
    "ISTPUVM": "1",
    "TPU_ACCELERATOR_TYPE": "v3-8",
    "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
    "TPU_SKIP_MDS_QUERY": "1",
}


# -- describe() --------------------------------------------------------------------------------------


def test_describe_this_machine():
    info = tpu.describe()
    has_gpu = any(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    assert info.kind == ("gpu" if has_gpu else "cpu")
    assert info.platform in ("colab", "kaggle", "gce", "local")
    assert info.torch == torch.__version__
    assert info.torch_xla == importlib.metadata.version("torch_xla")
    assert info.python == ".".join(map(str, sys.version_info[:3]))
    assert not info.runtime_initialized
    assert not any("do not match" in w for w in info.warnings)
    text = str(info)
    assert "torch_xla" in text and info.torch_xla in text and info.kind in text
    html = info._repr_html_()
    assert html.startswith("<table") and f"<td style='text-align:left'>{info.torch_xla}</td>" in html


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


def test_describe_kaggle_tpu_uses_environment_without_network(tmp_path, metadata_server):
    server = metadata_server()
    root = fake_root(tmp_path, dirs=["kaggle/input"])
    info = tpu.describe(environ={**KAGGLE_TPU, "GCE_METADATA_HOST": server.host}, root=root)
    assert (info.kind, info.platform) == ("kaggle-tpu", "kaggle")
    assert (info.accelerator, info.accelerator_count) == ("v3-8", 4)
    assert server.requests == []
    assert info.libtpu is None
    assert any("libtpu" in w and "setup(install=True)" in w for w in info.warnings)


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
    warning = tpu._version_mismatch("2.8.0+cu126", "2.9.0")
    assert "do not match" in warning
    assert "pip install 'torch_xla[tpu]~=2.8.0' 'torch==2.8.0'" in warning
    assert tpu._version_mismatch("2.9.0+cu128", "2.9.0") is None
    assert tpu._version_mismatch("2.9.1", "2.9.0") is None
    assert tpu._version_mismatch("2.9.0", None) is None


# -- setup() -------------------------------------------------------------------------------------------


def test_setup_dry_run_this_machine_is_idempotent():
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    first = tpu.setup(dry_run=True, environ=env)
    assert env["PJRT_DEVICE"] == "CPU"
    assert first.requirements[:2] == (f"torch_xla~={TORCH_MM}.0", f"torch=={TORCH_BASE}")
    assert {"gcsfs>=2023.1", "ipywidgets>=7.7", "matplotlib>=3.5"} <= set(first.requirements)
    assert first.missing == () and first.pip_command is None  # the dev environment has everything
    assert first.verified is None and first.ok
    assert any("no TPU here" in m for m in first.messages)
    second = tpu.setup(dry_run=True, environ=env)
    assert (second.env, second.missing, second.pip_command) == (first.env, first.missing, first.pip_command)
    assert "PJRT_DEVICE=CPU (already set)" in second.messages
    assert "device check" in str(second) and "<table" in second._repr_html_()


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


def test_setup_dry_run_colab_tpu_with_everything_preinstalled(tmp_path):
    """Colab's TPU image ships torch_xla and a libtpu; then nothing is missing and pip never runs."""
    libtpu = tmp_path / "libtpu.so"
    libtpu.write_bytes(b"\x7fELF")
    env = dict(COLAB, TPU_LIBRARY_PATH=str(libtpu))
    report = tpu.setup(dry_run=True, install=True, environ=env, root=fake_root(tmp_path, tpu_pci=["0x0063"]))
    assert report.info.libtpu == "TPU_LIBRARY_PATH" and not report.info.warnings
    assert (report.missing, report.pip_command, report.installed) == ((), None, False)
    assert env["PJRT_DEVICE"] == "TPU" and report.ok


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


def test_setup_verifies_the_device_in_a_subprocess():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES")}
    report = tpu.setup(environ=env)
    assert report.verified is True, report.messages
    assert (report.device, report.device_type) == ("xla:0", "CPU")
    assert report.ok
    # The check ran elsewhere: this process can still spawn.
    assert not tpu._runtime_initialized()


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
        tpu._run_pip(cmd)
    assert "nbkit-no-such-package" in str(e.value)


# -- without torch_xla, notebook mistakes ---------------------------------------------------------------


def test_missing_torch_xla_names_the_pip_command():
    out = run_script("without_torch_xla.py", timeout=120)
    assert out["kind"] in tpu.KINDS
    assert f"pip install 'torch_xla[tpu]~={TORCH_MM}.0' 'torch=={TORCH_BASE}'" in out["device_loader"]
    assert "nbkit[tpu]" in out["device_loader"]


def test_spawn_explains_notebook_mistakes():
    out = run_script("notebook_errors.py", timeout=180)
    assert out["spawn_method"].startswith("ValueError: 'work' is defined in a notebook")
    assert out["lambda"].startswith("TypeError: spawn() sends fn and args to each process by pickling")
    assert out["nprocs"].startswith("ValueError: nprocs=3")
    assert out["xla_imported_before"] is False  # argument checks come before importing torch_xla
    assert any("already initialised" in w for w in out["describe_warns"])
    assert out["initialized"].startswith("RuntimeError: the XLA runtime is already initialised")


# -- the multi-replica path, for real -------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 4])  # 1 device: test_setup_then_spawn_in_a_jupyter_kernel
def test_spawn_shared_warmup_and_training(devices, mnist_root, tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    steps = 12
    env = {"CPU_NUM_DEVICES": str(devices)}
    run_script("spawn_train.py", str(mnist_root), str(tmp_path / "cache"), str(out_dir), str(steps), env=env, timeout=300)

    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("result-*.json"))]
    assert sorted(r["ordinal"] for r in results) == list(range(devices))
    assert {r["world"] for r in results} == {devices}
    assert sorted(r["index"] for r in results) == list(range(devices))
    n = 2000
    # Each sample was computed exactly once across replicas, by the replica owning its shard.
    calls = {p.name: [int(x) for x in p.read_text().split()] for p in out_dir.glob("calls-*.txt")}
    all_calls = [i for c in calls.values() for i in c]
    assert sorted(all_calls) == list(range(n)), Counter(all_calls).most_common(3)
    assert len(calls) == devices
    assert sorted({i % devices for i in c}.pop() for c in calls.values()) == list(range(devices))
    assert all(len({i % devices for i in c}) == 1 for c in calls.values())
    for r in results:
        assert r["warmup"]["total"] == n // devices
        assert r["missing_after_barrier"] == 0
        assert r["batches_per_epoch"] == (n // devices) // 32
    # The loaders' sampler shards are disjoint and cover the dataset.
    shards = [r["shard"] for r in results]
    assert sorted(i for s in shards for i in s) == list(range(n))
    # The cache is complete and holds the source's samples.
    ds = nbkit.CachedDataset.open(tmp_path / "cache")
    assert len(ds.missing()) == 0
    from torchvision import datasets, transforms

    src = datasets.MNIST(mnist_root, train=True, download=False,
                         transform=transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]))
    for i in (0, 1, n // 2, n - 1):
        x, y = ds[i]
        assert torch.equal(torch.as_tensor(x), src[i][0]) and int(y) == src[i][1]
    # Every replica trained on its own XLA device from MpDeviceLoader batches, and learned.
    devices_seen = {r["shapes"][0][1] for r in results}
    assert devices_seen == {f"xla:{k}" for k in range(devices)}
    for r in results:
        assert r["shapes"] == [[[32, 1, 28, 28], r["shapes"][0][1], "torch.int64"]]
        losses = r["losses"]
        assert len(losses) == steps and all(np.isfinite(losses))
        assert np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


@pytest.mark.slow
def test_setup_then_spawn_in_a_jupyter_kernel(mnist_root, tmp_path, monkeypatch):
    """The Colab flow in a real kernel: setup() (device check), then spawn() of a cell's function.

    One device (the Colab v5e-1 shape): a single-replica model trains from the cache and learns."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(f"import sys\nsys.argv = ['notebook', {str(mnist_root)!r}, {str(tmp_path / 'cache')!r}, {str(out_dir)!r}, '12']"),
        nbformat.v4.new_code_cell("from nbkit import tpu\nreport = tpu.setup()\nassert report.verified, report.messages\nreport"),
        nbformat.v4.new_code_cell((SCRIPTS / "spawn_train.py").read_text()),
    ]
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    html = nb.cells[1].outputs[0]["data"]["text/html"]
    assert "<table class='nbkit-setup'>" in html and "yes, on xla:0 (CPU)" in html
    (result,) = [json.loads(p.read_text()) for p in out_dir.glob("result-*.json")]
    assert (result["ordinal"], result["world"], result["shapes"][0][1]) == (0, 1, "xla:0")
    assert result["pid"] != os.getpid()
    calls = [int(x) for p in out_dir.glob("calls-*.txt") for x in p.read_text().split()]
    assert sorted(calls) == list(range(2000))
    losses = result["losses"]
    assert len(losses) == 12 and np.mean(losses[-3:]) < 0.7 * np.mean(losses[:3]), losses


# -- pieces that need no XLA runtime ----------------------------------------------------------------------


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


def test_wait_until_complete_waits_for_peers_and_reports_a_stall(tmp_path):
    ds = nbkit.CachedDataset(_Slow(), tmp_path / "cache")
    ds.warmup(shard=(0, 2))
    with pytest.raises(TimeoutError, match="32 samples .* are still missing"):
        tpu._wait_until_complete(ds, stall_timeout=0.3, poll_interval=0.01, who="replica 0 of 2")

    peer = nbkit.CachedDataset(_Slow(), tmp_path / "cache")  # another replica, with its own handles
    t = threading.Thread(target=lambda: (time.sleep(0.2), peer.warmup(shard=(1, 2))))
    t.start()
    tpu._wait_until_complete(ds, stall_timeout=30, poll_interval=0.01, who="replica 0 of 2")
    t.join()
    assert len(ds.missing()) == 0


def test_sampler_shards_and_reshuffles_each_epoch():
    data = list(range(103))
    shards = [tpu._EpochShuffledSampler(data, num_replicas=4, rank=r, shuffle=True) for r in range(4)]
    first = [list(s) for s in shards]
    second = [list(s) for s in shards]
    assert sorted(set(i for s in first for i in s)) == data  # padded shards cover everything
    assert all(len(s) == 26 for s in first)
    assert sorted(set(i for s in second for i in s)) == data
    assert first != second  # a new order every epoch, without set_epoch()


# -- helpers ----------------------------------------------------------------------------------------------


def run_script(name, *args, env=None, timeout=300):
    """Run a tests/tpu_scripts/ file the way a notebook cell runs: as ``python -c`` (no ``__file__``)."""
    full_env = dict(os.environ, PJRT_DEVICE="CPU", **(env or {}))
    full_env.setdefault("CPU_NUM_DEVICES", "1")
    done = subprocess.run(
        [sys.executable, "-c", (SCRIPTS / name).read_text(), *args],
        cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    return json.loads("\n".join(lines)) if lines and name != "spawn_train.py" else done.stdout
