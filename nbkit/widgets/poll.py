"""Keep widgets live while a notebook cell waits: handle their clicks during ``panel.wait()``.

A Jupyter kernel runs one shell message at a time, and a button click is a shell message (a comm
message): while a cell blocks, say on a background warmup, the click waits behind it, so a Stop
button would act only once there is nothing left to stop. :func:`wait_until` blocks the way a
cell should, but between checks it reads the shell messages that arrived and handles the comm
ones (widget clicks and value changes) at once; every other message (the next cells of a Run All,
completions, ...) is handed back to the kernel, in order, to run after the cell as it would have.
This is what the ``jupyter-ui-poll`` package does through ``kernel.do_one_iteration``, which
ipykernel 7.4 no longer has; here it works on ipykernel 6 (Colab) and 7: the messages for the main
shell come from ``kernel.shell_stream`` in ipykernel 6 and from the shell channel thread's pipe to
the main thread in ipykernel 7. Outside a kernel (a script, a terminal) there is
nothing to handle and :func:`wait_until` only waits.

Example:
    >>> import threading
    >>> ready = threading.Event(); threading.Timer(0.05, ready.set).start()
    >>> wait_until(ready.is_set, timeout=10), why_not_live()
    (True, '')
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import Mapping
from typing import Callable

__all__ = ["wait_until", "why_not_live"]

#: Comm messages: what a widget's front end sends. Only these are handled while a cell waits.
_COMM = frozenset({"comm_open", "comm_msg", "comm_close"})
_active = threading.local()  # a click handled during a wait may itself wait: that one only waits


def _kernel():
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None)


class _Poller:
    """Reads the main shell's pending messages; handles comm messages, hands the rest back to the kernel."""

    def __init__(self, kernel):
        import zmq

        self.kernel, self._again = kernel, zmq.Again
        if hasattr(kernel, "shell_main"):  # ipykernel 7: a shell channel thread feeds the main thread
            thread = getattr(kernel, "shell_channel_thread", None)
            self.stream = (thread.manager.get_shell_channel_to_subshell_pair(None).to_stream
                           if thread is not None else kernel.shell_stream)

            def requeue(raw):
                self.stream.io_loop.add_callback(kernel.shell_main, None, raw)
        else:  # ipykernel 6: the main thread reads the shell socket itself into its message queue

            self.stream = kernel.shell_stream

            def requeue(raw):
                kernel.schedule_dispatch(kernel.dispatch_shell, raw)

        self._requeue = requeue
        self._flag = zmq.NOBLOCK

    def poll(self) -> None:
        session = self.kernel.session
        while True:
            try:
                raw = self.stream.socket.recv_multipart(self._flag, copy=False)
            except self._again:
                return
            idents, frames = session.feed_identities(raw, copy=False)
            # Only the header, unsigned: a message handed back is checked (once) by the kernel,
            # whose session refuses a signature it has already seen.
            header = session.unpack(frames[1].bytes)
            if header.get("msg_type") in _COMM:
                self._handle(idents, session.deserialize(frames, content=True, copy=False))
            else:
                self._requeue(raw)

    def _handle(self, idents, msg) -> None:
        kernel = self.kernel
        handler = kernel.shell_handlers.get(msg["header"]["msg_type"])
        if handler is None:
            return
        # The cell's output must keep going to the cell: restore its parent message afterwards.
        saved = kernel._parent_ident
        saved_ident = saved["shell"] if isinstance(saved, Mapping) else saved
        saved_parent = kernel.get_parent("shell")
        kernel.set_parent(idents, msg, channel="shell")
        try:
            result = handler(self.stream, idents, msg)
            if inspect.isawaitable(result):
                _run_now(result)
        # A failing widget callback must not end the wait (the kernel's own dispatch logs it too).
        except Exception:
            kernel.log.error("Exception in a widget message handled while a cell waited", exc_info=True)
        finally:
            kernel.set_parent(saved_ident, saved_parent, channel="shell")

    def finish(self) -> None:
        # Messages may have arrived after the last poll; have the kernel's stream look again
        # (its socket's descriptor is edge-triggered, and this thread read from it directly).
        import zmq

        self.stream.io_loop.add_callback(self.stream.flush, zmq.POLLIN)


def _run_now(awaitable) -> None:
    """Run a handler's coroutine to its end here; comm handlers never wait on anything."""
    coro = awaitable.__await__()
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("a widget message handler waited on I/O while a cell was running; it was cancelled")


def _poller():
    kernel = _kernel()
    if kernel is None or getattr(_active, "polling", False):
        return None, ""
    if not (hasattr(kernel, "shell_main") or hasattr(kernel, "schedule_dispatch")) or \
            getattr(kernel, "session", None) is None or not hasattr(kernel, "shell_handlers"):
        return None, f"this kernel ({type(kernel).__module__}) does not let nbkit handle clicks while a cell runs"
    try:
        return _Poller(kernel), ""
    except (AttributeError, ImportError) as e:
        return None, f"this kernel does not let nbkit handle clicks while a cell runs ({e})"


def why_not_live() -> str:
    """Why widget clicks cannot be handled while a cell waits in this kernel, or ``""`` when they
    can (or when there is no kernel, and so no click to handle)."""
    return _poller()[1]


def wait_until(done: Callable[[], bool], timeout: float | None = None, *, interval: float = 0.05,
               sleep: Callable[[float], object] | None = None) -> bool:
    """Block until ``done()`` is true, handling widget messages meanwhile; False on timeout.

    Args:
        done: checked every ``interval`` seconds.
        timeout: seconds to wait at most (``None``: no limit).
        sleep: how to pass ``interval`` seconds (e.g. a thread's ``join``); default :func:`time.sleep`.
    """
    poller, _ = _poller()
    sleep = sleep or time.sleep
    deadline = None if timeout is None else time.monotonic() + timeout
    if poller is not None:
        _active.polling = True
    try:
        while True:
            if poller is not None:
                poller.poll()
            if done():
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            sleep(interval if left is None else min(interval, left))
    finally:
        if poller is not None:
            _active.polling = False
            poller.finish()
