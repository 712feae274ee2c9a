"""Real servers on 127.0.0.1 for tests: start, probe until ready, SIGKILL, start again on the same port.

The GCS emulator (``fixtures_gcs``) and ``redis-server`` (``fixtures_redis``) subclass
:class:`LoopbackServer`; their logs go to a file (never a pipe nobody reads).
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

#: How many ports below the kernel's ephemeral range :func:`free_port` draws from.
PORT_SPAN = 12_000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free loopback port **below the kernel's ephemeral range**.

    A server killed by a test is started again on its port; while it is down, a port from the
    ephemeral range can be taken by any ``bind(("", 0))`` or outgoing connection of another process
    (CI runs two test suites at once), and the restarted server then cannot listen, or a probe
    reaches a stranger. Ports below the range are only ever taken by name.

    Example:
        >>> 1024 <= free_port() < _ephemeral_low()
        True
    """
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(max(1024, low - PORT_SPAN), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds the socket listening on TCP ``port`` (``True`` without ``/proc``).

    Example:
        >>> with socket.create_server(("127.0.0.1", 0)) as s:
        ...     listens(os.getpid(), s.getsockname()[1]), listens(os.getpid(), free_port())
        (True, False)
    """
    inodes, seen = set(), False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        seen = True
        for row in rows:
            fields = row.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not seen:
        return True
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class LoopbackServer:
    """A server process on a fixed free port. Subclasses give :meth:`command` and :meth:`ready`."""

    name = "server"
    poll_interval = 0.05

    def __init__(self, workdir: Path, log_name: str):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = self.workdir / log_name
        self._proc: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """One probe: does the server answer yet? (``OSError`` counts as no.)"""
        raise NotImplementedError

    def start(self, timeout: float = 15.0):
        if self.running:
            return self
        self._log = open(self.log_path, "ab")
        self._proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode} (is port {self.port} taken?); log: {self.log_path}")
            try:
                # Only our own process's answer counts: another may hold the port meanwhile.
                if self.ready() and listens(self._proc.pid, self.port):
                    return self
            except OSError:
                pass
            time.sleep(self.poll_interval)
        self.kill()
        raise RuntimeError(f"{self.name} did not answer within {timeout}s; log: {self.log_path}")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server, as a crash or a lost network would: no graceful shutdown."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
