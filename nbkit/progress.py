"""Progress reporting: a callback object the engine calls, whose default does nothing.

Modelled on :mod:`fsspec.callbacks` (and compatible with it: an nbkit callback can be handed to
``fs.put(..., callback=cb)``). Long operations (warmup, export, push, pull) call

* ``set_size(n)`` once they know the total,
* ``relative_update(k)`` / ``absolute_update(v)`` as work is done,
* ``set_description(text)`` when the phase changes,

and check ``stop_requested`` between units of work, so a front end (the notebook panel, a
Stop button) can interrupt them cleanly. Front ends only render; they hold no logic.

Example:
    >>> from nbkit.progress import Callback
    >>> cb = Callback()
    >>> cb.set_size(10); cb.relative_update(3); (cb.value, cb.size)
    (3, 10)
"""

from __future__ import annotations

import sys
import time

from fsspec.callbacks import Callback as _FsspecCallback

__all__ = ["Callback", "TextProgress", "NoOpCallback", "as_callback"]


class Callback(_FsspecCallback):
    """A progress sink with a stop flag. Subclass and override :meth:`call` to render.

    Attributes:
        size: total units of work, or ``None`` until known.
        value: units done so far.
        description: the current phase, e.g. ``"warming up"``.
        stop_requested: set by :meth:`request_stop`; long operations stop at the next unit.
    """

    def __init__(self, size=None, value=0, hooks=None, **kwargs):
        super().__init__(size=size, value=value, hooks=hooks, **kwargs)
        self.description = ""
        self.stop_requested = False

    @property
    def finished(self) -> bool:
        """All of a known size is done."""
        return self.size is not None and self.value >= self.size

    def request_stop(self) -> None:
        """Ask the running operation to stop after its current unit of work."""
        self.stop_requested = True

    def set_description(self, text: str) -> None:
        """Name the current phase and let the front end re-render."""
        self.description = text
        self.call()


class NoOpCallback(Callback):
    """The default: does nothing."""

    def call(self, *args, **kwargs):
        return None


class TextProgress(Callback):
    """A plain one-line progress meter for terminals, scripts and CI logs.

    Rewrites one line with ``\\r`` when the stream is a TTY, otherwise prints a line at most every
    ``min_interval`` seconds (and always the last one), so logs stay short.

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> p = TextProgress("warmup", file=out, min_interval=0)
        >>> p.set_size(4); p.relative_update(4); p.close()
        >>> "4/4" in out.getvalue()
        True
    """

    def __init__(self, label: str = "", *, file=None, min_interval: float = 0.5, unit: str = "samples", **kwargs):
        super().__init__(**kwargs)
        self.label = label
        self.file = file if file is not None else sys.stderr
        self.min_interval = min_interval
        self.unit = unit
        self._start = time.perf_counter()
        self._last_print = 0.0
        self._start_value = None
        self._tty = bool(getattr(self.file, "isatty", lambda: False)())
        self._closed = False

    def line(self) -> str:
        """The text of the progress line, e.g. ``warmup  1200/60000  2.0%  5400 samples/s  ETA 11s``."""
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        if self._start_value is None:
            self._start_value = self.value
        done_now = self.value - self._start_value
        rate = done_now / elapsed
        parts = [self.label or "progress"]
        if self.size:
            parts.append(f"{self.value}/{self.size}")
            parts.append(f"{100.0 * self.value / self.size:5.1f}%")
        else:
            parts.append(f"{self.value}")
        parts.append(f"{rate:,.0f} {self.unit}/s")
        if self.size and rate > 0 and self.value < self.size:
            parts.append(f"ETA {format_seconds((self.size - self.value) / rate)}")
        else:
            parts.append(f"{format_seconds(elapsed)}")
        if self.description:
            parts.append(self.description)
        return "  ".join(parts)

    def call(self, *args, **kwargs):
        if self._start_value is None:
            self._start_value = self.value
        now = time.perf_counter()
        finished = self.finished
        if not finished and now - self._last_print < self.min_interval:
            return
        self._last_print = now
        end = "\r" if self._tty and not finished else "\n"
        print(self.line(), end=end, file=self.file, flush=True)

    def close(self):
        if not self._closed:
            self._closed = True
            if self._tty:
                print(self.line(), file=self.file, flush=True)
            elif not self.finished:
                print(self.line(), file=self.file, flush=True)


def format_seconds(seconds: float) -> str:
    """``75.2`` → ``'1m15s'``; ``3.21`` → ``'3.2s'``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def as_callback(callback) -> _FsspecCallback:
    """Return ``callback``, or a do-nothing :class:`NoOpCallback` when it is ``None``."""
    return NoOpCallback() if callback is None else callback
