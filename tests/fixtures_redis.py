"""Real ``redis-server`` processes for tests (Debian package ``redis-server``; CI installs it through
``scripts/install-system-deps.sh``), each on a free 127.0.0.1 port, with persistence off
(``--save '' --appendonly no``) and its own temporary directory and log file.

Import the fixtures into a test module with ``from fixtures_redis import redis_server, redis_url, …``.

* ``redis_server`` (session): one server shared by every test that needs a namespace.
* ``redis_url`` (function): ``redis://127.0.0.1:<port>/0/<fresh namespace>`` on that server.
* ``redis_trio`` (session): three servers, for sharding.
* ``redis_factory`` (function): ``redis_factory(*extra_args)`` starts a private server (e.g. with
  ``--maxmemory 4mb``) that the test may :meth:`~RedisServer.kill` and :meth:`~RedisServer.start`
  again on the same port; all are killed at teardown.
* ``fake_server`` (function): ``fake_server(reply)`` starts a :class:`FakeServer` on 127.0.0.1 that
  accepts connections and answers every read with ``reply`` (``None``: never answers).

Without ``redis-server`` on the PATH, the tests that use these fixtures are skipped.
"""

from __future__ import annotations

import shutil
import socket
import threading
import uuid
from pathlib import Path

import pytest
from servers import LoopbackServer

__all__ = ["RedisServer", "FakeServer", "redis_server", "redis_url", "redis_trio", "redis_factory", "fake_server", "namespace",
           "sharded_url"]


def namespace() -> str:
    """A fresh cache name, so tests sharing a server never see each other's keys.

    Example:
        >>> namespace().startswith("t-"), namespace() != namespace()
        (True, True)
    """
    return f"t-{uuid.uuid4().hex[:10]}"


def sharded_url(servers, name: str | None = None) -> str:
    """The URL of a cache sharded over ``servers`` (in that order), database 0.

    Example:
        >>> from types import SimpleNamespace
        >>> sharded_url([SimpleNamespace(address="10.0.0.1:6379"), SimpleNamespace(address="10.0.0.2:6379")], "mnist")
        'redis://10.0.0.1:6379,10.0.0.2:6379/0/mnist'
    """
    return "redis://" + ",".join(s.address for s in servers) + f"/0/{name or namespace()}"


class RedisServer(LoopbackServer):
    """One ``redis-server`` on 127.0.0.1 that can be killed and started again on the same port.

    Nothing is persisted: a restart comes back empty, as a server that lost its memory does.

    Example:
        >>> import shutil, tempfile
        >>> if shutil.which("redis-server"):  # the tests that need it are skipped without it
        ...     with tempfile.TemporaryDirectory() as d:
        ...         server = RedisServer(d).start()
        ...         assert server.ready() and server.url("mnist").endswith("/0/mnist")
        ...         server.kill()
    """

    name = "redis-server"
    poll_interval = 0.02

    def __init__(self, workdir: Path, *extra_args: str):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed: run `sh scripts/install-system-deps.sh` (apt-get install redis-server)")
        super().__init__(workdir, "redis-server.log")
        self.extra_args = list(extra_args)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, name: str | None = None, db: int = 0) -> str:
        return f"redis://{self.address}/{db}/{name or namespace()}"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port)

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--protected-mode", "no", *self.extra_args]

    def ready(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))  # -NOAUTH: up, with --requirepass

    def restart(self) -> "RedisServer":
        self.kill()
        return self.start()

    def keys(self, pattern: str = "*") -> list[bytes]:
        return list(self.client().scan_iter(match=pattern, count=1000))


def _need_redis():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (sh scripts/install-system-deps.sh installs it)")
    pytest.importorskip("redis", reason="the redis package is not installed: pip install redis (make setup)")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A redis-server shared by the whole session."""
    _need_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-shared")).start()
    yield server
    server.kill()


@pytest.fixture
def redis_url(redis_server):
    """A fresh namespace on the shared server: ``redis://127.0.0.1:<port>/0/<name>``."""
    return redis_server.url()


@pytest.fixture(scope="session")
def redis_trio(tmp_path_factory):
    """Three servers, for a cache sharded across them."""
    _need_redis()
    servers = [RedisServer(tmp_path_factory.mktemp(f"redis-shard{k}")).start() for k in range(3)]
    yield servers
    for s in servers:
        s.kill()


@pytest.fixture
def redis_factory(tmp_path):
    """``redis_factory(*extra_args)`` starts a private server; every one is killed at teardown."""
    _need_redis()
    started = []

    def start(*extra_args: str) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(started)}", *extra_args).start()
        started.append(server)
        return server

    yield start
    for s in started:
        s.kill()


class FakeServer:
    """A TCP listener on 127.0.0.1 that is no Redis server: it accepts connections and answers every
    read with ``reply`` (``None``: reads and never answers, as a stopped or hung server does).

    Example:
        >>> with FakeServer(b"-ERR unknown command 'HELLO'\\r\\n") as fake:
        ...     with socket.create_connection(("127.0.0.1", fake.port), timeout=5) as s:
        ...         s.sendall(b"PING\\r\\n")
        ...         s.recv(64)
        b"-ERR unknown command 'HELLO'\\r\\n"
    """

    def __init__(self, reply: bytes | None):
        self.reply = reply
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._conns: list = []
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name="fake-redis", daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, name: str | None = None) -> str:
        return f"redis://{self.address}/0/{name or namespace()}"

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn) -> None:
        try:
            while conn.recv(65536):
                if self.reply is not None:
                    conn.sendall(self.reply)
        except OSError:
            pass

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> "FakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def fake_server():
    """``fake_server(reply)`` starts a :class:`FakeServer`; every one is closed at teardown."""
    started = []

    def start(reply: bytes | None) -> FakeServer:
        started.append(FakeServer(reply))
        return started[-1]

    yield start
    for s in started:
        s.close()
