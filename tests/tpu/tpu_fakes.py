"""What the nbkit.tpu tests share: a fake file-system root laid out like a VM, a fake GCE metadata
server, the environments of Colab and Kaggle, and running a tests/tpu_scripts/ file as a notebook cell."""

import http.server
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "tpu_scripts"
TORCH_MM = ".".join(torch.__version__.split("+")[0].split(".")[:2])
TORCH_BASE = torch.__version__.split("+")[0]

# torch_xla stopped at 2.9: `make test-newest` runs without it, and what needs it skips there.
HAS_XLA = importlib.util.find_spec("torch_xla") is not None
needs_xla = pytest.mark.skipif(not HAS_XLA, reason="needs torch_xla (its last release, 2.9, needs torch 2.9): "
                                                   "`make test` runs Colab's TPU stack with it")


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
