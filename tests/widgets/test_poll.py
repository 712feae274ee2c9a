"""nbkit.widgets.poll in a real kernel: a Stop click is handled while a cell waits in ``panel.wait()``.

A kernel started with jupyter_client (as nbclient starts one) runs the cells; this test plays the
front end: it sends the comm message a click on the Stop button sends, while the waiting cell
runs, with the next cells of a Run All already queued behind it. Runs with the installed
ipykernel (7) and, in the ipywidgets 7.7.1 rerun of this directory (tests/widgets/test_view.py),
also with ipykernel 6.17.1 (Colab's pair) when that run was given it.
"""

from __future__ import annotations

import os
import queue
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from nbkit.widgets.poll import wait_until, why_not_live

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

SETUP = """
import time, torch, nbkit
from nbkit.widgets import WarmupPanel

class Slow(torch.utils.data.Dataset):  # about 2 ms a sample: a full warmup takes about 40 s
    def __len__(self):
        return 20000
    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.full((4,), float(i)), i % 10

ds = nbkit.CachedDataset(Slow(), {path!r})
panel = WarmupPanel(ds)
print("stop button:", panel.stop_button.model_id)
"""


def test_outside_a_kernel_wait_until_only_waits():
    assert why_not_live() == ""
    calls = []
    assert wait_until(lambda: len(calls) >= 3, timeout=30, interval=0.001, sleep=lambda s: calls.append(s))
    assert not wait_until(lambda: False, timeout=0.01, interval=0.001)


class _Kernel:
    """A kernel and its client; ``execute`` queues a cell, ``outputs`` collects iopub by request."""

    def __init__(self, pythonpath: list[str], cwd):
        from jupyter_client import KernelManager

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(pythonpath + [str(REPO), os.environ.get("PYTHONPATH", "")])}
        self.km = KernelManager(kernel_name="python3")  # this Python's ipykernel, first on PYTHONPATH wins
        self.km.start_kernel(env=env, cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.events = queue.Queue()  # (msg_id, kind, text) in the order the kernel published them
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while not self._stop.is_set():
            try:
                msg = self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            parent = msg["parent_header"].get("msg_id")
            kind = msg["msg_type"]
            if kind == "stream":
                self.events.put((parent, "stream", msg["content"]["text"]))
            elif kind == "error":
                self.events.put((parent, "error", "\n".join(msg["content"]["traceback"])))
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                self.events.put((parent, "idle", ""))

    def execute(self, code: str) -> str:
        return self.kc.execute(textwrap.dedent(code))

    def until(self, pred, timeout=120):
        """Events up to and including the first for which ``pred(event)`` is true."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=1)
            except queue.Empty:
                continue
            seen.append(event)
            if event[1] == "error":
                pytest.fail(f"a cell failed in the kernel:\n{event[2]}")
            if pred(event):
                return seen
        pytest.fail(f"no such event within {timeout} s; saw {seen}")

    def click(self, model_id: str) -> None:
        # What a front end sends when the button is clicked (ipywidgets 7 and 8 alike).
        content = {"comm_id": model_id, "data": {"method": "custom", "content": {"event": "click"}}}
        self.kc.shell_channel.send(self.kc.session.msg("comm_msg", content))

    def close(self):
        self._stop.set()
        self._reader.join(timeout=10)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _kernels():
    kinds = [pytest.param([], id="installed-ipykernel")]
    six = os.environ.get("NBKIT_IPYKERNEL6_PATH")  # set by test_view.py's ipywidgets 7.7.1 rerun
    if six:
        kinds.append(pytest.param([six], id="ipykernel-6"))
    return kinds


def _text(events, msg_id):
    return "".join(text for parent, kind, text in events if parent == msg_id and kind == "stream")


@pytest.mark.slow
@pytest.mark.parametrize("pythonpath", _kernels())
def test_stop_click_is_handled_while_a_cell_waits(tmp_path, pythonpath):
    kernel = _Kernel(pythonpath, tmp_path)
    try:
        setup = kernel.execute(SETUP.format(path=str(tmp_path / "c")))
        events = kernel.until(lambda e: e[0] == setup and e[1] == "idle")
        model_id = _text(events, setup).split("stop button:")[1].split()[0]

        # Run All: the waiting cell, then the next two, all sent before anything is clicked.
        waiting = kernel.execute("""
            import ipykernel, ipywidgets
            print("versions:", ipykernel.__version__, ipywidgets.__version__, flush=True)
            panel.warmup_button.click()
            print("waiting", flush=True)
            panel.wait()
            print("after wait:", panel.state.value, ds.stats.cached, flush=True)
        """)
        after = kernel.execute('print("next cell saw:", panel.state.value, panel.warmup_report.stopped)')
        events = kernel.until(lambda e: e[0] == waiting and "waiting" in e[2])
        kernel.click(model_id)
        events += kernel.until(lambda e: e[0] == after and e[1] == "idle", timeout=180)
        last = kernel.execute('print("kernel still answers")')  # nothing was lost from the shell socket
        events += kernel.until(lambda e: e[0] == last and e[1] == "idle")
    finally:
        kernel.close()

    out = _text(events, waiting)
    print(out)
    state, cached = out.split("after wait:")[1].split()
    assert state == "stopped", out  # the click reached the panel while the cell was still waiting
    assert int(cached) < 20000, out  # (0 when the click came before the first chunk was stored)
    # The queued cells ran after the waiting one, in order, with their output in their own cells.
    assert _text(events, after) == "next cell saw: stopped True\n"
    order = [parent for parent, kind, _ in events if kind == "idle" and parent in (waiting, after, last)]
    assert order == [waiting, after, last], order
    assert _text(events, last) == "kernel still answers\n"
    versions = out.splitlines()[0].split()[1:]  # the kernel's ipykernel and ipywidgets
    assert versions[0].startswith("6.") if pythonpath else int(versions[0].split(".")[0]) >= 7, versions
    assert versions[1] == os.environ.get("NBKIT_EXPECT_IPYWIDGETS", versions[1]), versions


@pytest.mark.slow
def test_interrupting_the_kernel_during_wait_stops_the_warmup(tmp_path):
    kernel = _Kernel([], tmp_path)
    try:
        setup = kernel.execute(SETUP.format(path=str(tmp_path / "c")))
        kernel.until(lambda e: e[0] == setup and e[1] == "idle")
        # Say "waiting" from a timer, a second after the cell entered panel.wait(): an interrupt
        # sent on a print before the call could land before the wait began.
        waiting = kernel.execute("""
            import threading
            panel.warmup_button.click()
            threading.Timer(1.0, lambda: print("in wait", flush=True)).start()
            panel.wait()
        """)
        kernel.until(lambda e: "in wait" in e[2])
        kernel.km.interrupt_kernel()
        seen = []
        deadline = time.monotonic() + 120
        while not any(e[0] == waiting and e[1] == "idle" for e in seen) and time.monotonic() < deadline:
            try:
                seen.append(kernel.events.get(timeout=1))
            except queue.Empty:
                pass
        assert any(e[0] == waiting and e[1] == "error" and "KeyboardInterrupt" in e[2] and "WarmupPanel.wait" in e[2]
                   for e in seen), seen
        check = kernel.execute('print("after interrupt:", panel.wait(60), panel.state.value, ds.stats.cached)')
        events = kernel.until(lambda e: e[0] == check and e[1] == "idle")
    finally:
        kernel.close()
    waited, state, cached = _text(events, check).split("after interrupt:")[1].split()
    assert (waited, state) == ("True", "stopped") and int(cached) < 20000  # it did not go on behind the interrupted cell
