"""nbkit.cluster.reaper: waiting for a process to end, whatever descriptors the waiter already holds."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap

import pytest

from nbkit.cluster.reaper import wait_for_exit


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux 5.3+)")
def test_a_waiter_holding_more_than_1024_descriptors_sees_the_process_end():
    """select() refuses a descriptor past 1023: a worker of a process with a cache of many columns
    open got "filedescriptor out of range" from the pidfd it waited on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the descriptor limit here is {hard}")
    script = textwrap.dedent("""
        import os, resource, subprocess, sys
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(2048, hard) if hard != resource.RLIM_INFINITY else 2048, hard))
        held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
        from nbkit.cluster.reaper import wait_for_exit
        probe = os.pidfd_open(child.pid); os.close(probe)
        assert probe > 1023, probe
        wait_for_exit(child.pid)
        assert child.poll() is not None or child.wait(5) is not None
        print("ended")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ended", out.stderr[-2000:]


def test_an_ended_process_returns_at_once():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    wait_for_exit(child.pid)  # reaped: no such process (a pidfd cannot be opened)
