"""Real servers on 127.0.0.1 for tests: start, probe until ready, SIGKILL, start again on the same port.

The GCS emulator (``fixtures_gcs``) and ``redis-server`` (``fixtures_redis``) subclass
:class:`LoopbackServer`; their logs go to a file (never a pipe nobody reads).
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                raise RuntimeError(f"{self.name} exited with {self._proc.returncode}; log: {self.log_path}")
            try:
                if self.ready():
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
