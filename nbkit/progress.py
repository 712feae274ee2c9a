"""Progress reporting: a callback object the engine calls (its default does nothing), and
:class:`Job`, one long operation run in a background thread.

Modelled on :mod:`fsspec.callbacks` and compatible with it both ways: an nbkit callback can be
handed to ``fs.put(..., callback=cb)``, and :func:`as_callback` makes any fsspec callback safe for
nbkit's long operations (warmup, verify, export, import, push, pull), which call ``set_size(n)``,
``absolute_update(v)`` / ``relative_update(k)``, ``set_description(text)``, and ask
:meth:`Callback.should_stop` between units of work. An operation that runs several phases through one
callback (fill the cache in samples, then upload it in bytes) says so with
:meth:`Callback.start_phase`. Front ends (the notebook panel, :class:`TextProgress`) only render
what a callback holds: its size, value, phase, unit, :meth:`~Callback.rate` and
:meth:`~Callback.eta`. An operation run by several workers (a build on an engine: processes, a Ray or
Dask cluster, many hosts) also reports who did what through :meth:`Callback.set_workers`: a
:class:`Workers` snapshot of parts done of all and each worker's samples and rate, naming the slowest.

Example:
    >>> from nbkit.progress import Callback, Job
    >>> cb = Callback()
    >>> cb.set_size(10); cb.relative_update(3); (cb.value, cb.size)
    (3, 10)
    >>> job = Job("count", lambda cb: cb.set_size(5) or "counted").start()
    >>> job.wait(timeout=10), job.state.value, job.report
    (True, 'done', 'counted')
"""

from __future__ import annotations

import enum
import os
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from fsspec.callbacks import Callback as _FsspecCallback

from .text import NARROW_COLUMNS, fill, format_amount, format_count, format_rate, format_seconds, in_kernel, plural, printable

__all__ = ["Callback", "TextProgress", "NoOpCallback", "as_callback", "Job", "JobState", "Workers", "WorkerRate"]


#: A part out this many times longer than the longest part took so far is shown (:attr:`Workers.overdue`)…
OVERDUE = 3.0
#: …once it has been out at least this many seconds.
OVERDUE_SECONDS = 30.0


@dataclass(frozen=True)
class WorkerRate:
    """What one worker of a build has done: parts, samples, and the seconds it spent on them.

    Attributes:
        worker: who it is: ``"host:pid"`` (a process on a machine: the same on every engine).
        parts: parts it built that were merged.
        samples: samples in those parts.
        seconds: seconds it spent building them (its busy time, not the wall time).

    Example:
        >>> WorkerRate("host:4242", parts=2, samples=600, seconds=2.0).rate
        300.0
    """

    worker: str
    parts: int = 0
    samples: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Samples a second while it worked (0.0 before its first part)."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Workers:
    """A snapshot of a build across its workers and hosts: parts done of all, and one
    :class:`WorkerRate` per worker. Immutable, so a front end on another thread reads a consistent
    one; :meth:`record` gives the next snapshot.

    Example:
        >>> w = Workers(parts_total=4).record("a:1", 100, 1.0).record("b:2", 100, 4.0).record("a:1", 100, 1.0)
        >>> w.parts_done, w.parts_total, [(r.worker, r.rate) for r in w.rows], w.slowest.worker
        (3, 4, [('a:1', 100.0), ('b:2', 25.0)], 'b:2')
        >>> w.text()
        'parts 3/4 · 2 workers · slowest: b:2 25/s'
        >>> w.out(1, 60.0).text()  # a part out far longer than parts take: a stuck or lost worker shows
        'parts 3/4 · 2 workers · slowest: b:2 25/s · 1 part out, the oldest for 1m00s'
    """

    parts_done: int = 0
    parts_total: int = 0
    rows: tuple = ()
    #: parts submitted and not back yet, and seconds since the oldest of them was submitted
    outstanding: int = 0
    oldest: float = 0.0

    def record(self, worker: str, samples: int, seconds: float) -> "Workers":
        """The snapshot after ``worker`` finished a part of ``samples`` samples in ``seconds``."""
        rows, found = [], False
        for r in self.rows:
            if r.worker == worker:
                r, found = replace(r, parts=r.parts + 1, samples=r.samples + int(samples), seconds=r.seconds + float(seconds)), True
            rows.append(r)
        if not found:
            rows.append(WorkerRate(worker, 1, int(samples), float(seconds)))
        return replace(self, parts_done=self.parts_done + 1, rows=tuple(rows))

    def out(self, outstanding: int, oldest: float) -> "Workers":
        """The snapshot with ``outstanding`` parts out, the oldest submitted ``oldest`` seconds ago.

        Example:
            >>> w = Workers(parts_total=2).record("a:1", 100, 2.0)
            >>> w.out(1, 5.0).overdue, w.out(1, 60.0).overdue  # parts take 2 s here; overdue from 30 s
            (False, True)
        """
        return replace(self, outstanding=int(outstanding), oldest=float(oldest))

    @property
    def overdue(self) -> bool:
        """The oldest part out has taken far longer than parts take (:data:`OVERDUE` times the
        longest a part has taken, and at least :data:`OVERDUE_SECONDS`): a worker stuck or lost."""
        longest = max((r.seconds / r.parts for r in self.rows if r.parts), default=0.0)
        return self.outstanding > 0 and self.oldest >= max(OVERDUE_SECONDS, OVERDUE * longest)

    @property
    def slowest(self) -> WorkerRate | None:
        """The worker with the lowest rate, once two or more have finished a part (``None`` before)."""
        working = [r for r in self.rows if r.seconds > 0]
        return min(working, key=lambda r: r.rate) if len(working) >= 2 else None

    def text(self) -> str:
        """One line: ``parts 3/10 · 2 workers · slowest: host:pid 300/s``."""
        units = [f"parts {format_count(self.parts_done)}/{format_count(self.parts_total)}"]
        if self.rows:
            units.append(plural(len(self.rows), "worker"))
        slowest = self.slowest
        if slowest is not None:
            units.append(f"slowest: {printable(slowest.worker)} {format_count(slowest.rate)}/s")
        if self.overdue:
            units.append(f"{plural(self.outstanding, 'part')} out, the oldest for {format_seconds(self.oldest)}")
        return " · ".join(units)


class Callback(_FsspecCallback):
    """A progress sink with a stop flag, a phase and a rate. Subclass and override :meth:`call` to render.

    Attributes:
        size: total units of work, or ``None`` until known.
        value: units done so far.
        description: what the operation does now, e.g. ``"warming up"``.
        phase: the named step of the operation, e.g. ``"warmup"`` then ``"publish"``.
        unit: what ``size`` and ``value`` count: ``"samples"`` or ``"bytes"``.
        stop_requested: set by :meth:`request_stop`; long operations stop at the next unit.
        workers: the last :class:`Workers` snapshot of an operation run by several workers, else ``None``.

    Example:
        >>> cb = Callback(phase="warmup")
        >>> cb.set_size(100); cb.absolute_update(40); cb.relative_update(10)
        >>> cb.moved, cb.finished, cb.rate() > 0
        (10, False, True)
        >>> cb.start_phase("publish", unit="bytes", size=2000); (cb.phase, cb.unit, cb.value, cb.moved)
        ('publish', 'bytes', 0, 0)
        >>> cb.request_stop(); cb.should_stop()
        True
    """

    #: Seconds for ``elapsed``, ``rate`` and ``eta`` (a front end may be given another, e.g. in tests).
    clock = time.perf_counter

    def __init__(self, size=None, value=0, hooks=None, *, phase: str = "", unit: str = "samples", **kwargs):
        super().__init__(size=size, value=value, hooks=hooks, **kwargs)
        self.description = ""
        self.stop_requested = False
        self.phase = phase
        self.unit = unit
        self.workers = None
        self._restart_clock()

    def _restart_clock(self) -> None:
        self.started = self.clock()
        self.ended = None  # set by close(): a finished operation's rate and time stay as they were
        self._base = self.value  # work done before this operation (e.g. samples already cached) is not speed
        self._based = False

    @property
    def finished(self) -> bool:
        """All of a known size is done."""
        return self.size is not None and self.value >= self.size

    @property
    def moved(self):
        """Units done by this phase of the operation (not those done before it started)."""
        return self.value - self._base

    def elapsed(self) -> float:
        """Seconds since this phase started (until :meth:`close`, once the operation has ended)."""
        return (self.ended if self.ended is not None else self.clock()) - self.started

    def rate(self) -> float:
        """Units per second in this phase (0.0 before anything moved)."""
        moved = self.moved
        return moved / max(self.elapsed(), 1e-9) if moved > 0 else 0.0

    def eta(self) -> float | None:
        """Seconds left at the current rate, or ``None`` when unknown (or once the operation has ended)."""
        rate = self.rate()
        if not self.size or rate <= 0 or self.ended is not None:
            return None
        return max(self.size - self.value, 0) / rate

    def absolute_update(self, value):
        if not self._based:
            # The first absolute value of a phase says where it starts (e.g. samples already cached).
            self._base, self._based = value, True
        super().absolute_update(value)

    def start_phase(self, name: str, *, unit: str = "samples", size=None) -> None:
        """Begin the next named step of an operation: new unit, counts from 0, clock, no description; front ends re-render."""
        self.phase, self.unit, self.size, self.value, self.description = name, unit, size, 0, ""
        self._restart_clock()
        self._based = True  # the phase starts at 0: its first absolute value is progress, not a starting point
        self.call()

    def close(self) -> None:
        """The operation has ended: stop the clock (``elapsed``, ``rate`` and ``eta`` stop moving)."""
        if self.ended is None:
            self.ended = self.clock()

    def request_stop(self) -> None:
        """Ask the running operation to stop after its current unit of work."""
        self.stop_requested = True

    def should_stop(self) -> bool:
        """Whether the operation should stop now: the one question long operations ask, between units of work,
        of the callback :func:`as_callback` gave them (only a real ``True`` flag counts)."""
        return self.stop_requested is True

    def set_description(self, text: str) -> None:
        """Say what the operation does now and let the front end re-render."""
        self.description = text
        self.call()

    def set_workers(self, workers: Workers) -> None:
        """Say who does the work (an operation run by several workers: parts done of all, each
        worker's rate, the slowest) and let the front end re-render. Operations run in one process
        never call it."""
        self.workers = workers
        self.call()


class NoOpCallback(Callback):
    """The default: does nothing."""

    def call(self, *args, **kwargs):
        return None


class _FsspecAdapter(Callback):
    """Lets a plain fsspec callback (no ``set_description``, no ``stop_requested`` flag) follow an nbkit operation."""

    def __init__(self, inner):
        self.inner = inner
        super().__init__(size=inner.size, value=inner.value)

    @property
    def stop_requested(self) -> bool:
        # fsspec's Callback answers every unknown attribute with a no-op method, which is truthy:
        # only a real flag of the inner callback counts.
        inner = getattr(self.inner, "stop_requested", False)
        return self._stop or (isinstance(inner, bool) and inner)

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        self._stop = bool(value)

    def set_size(self, size):
        self.size = size
        self.inner.set_size(size)

    def absolute_update(self, value):
        super().absolute_update(value)
        self.inner.absolute_update(value)

    def relative_update(self, inc=1):
        self.value += inc
        self.inner.relative_update(inc)

    def set_description(self, text: str) -> None:
        self.description = text
        forward = getattr(self.inner, "set_description", None)
        if callable(forward):
            forward(text)

    def start_phase(self, name: str, *, unit: str = "samples", size=None) -> None:
        super().start_phase(name, unit=unit, size=size)
        self.inner.set_size(size)  # a plain callback has no phases: its counts start again
        self.inner.absolute_update(0)

    def branched(self, path_1, path_2, **kwargs):
        return self.inner.branched(path_1, path_2, **kwargs)

    def call(self, *args, **kwargs):
        return None  # the inner callback renders on its own updates

    def close(self):
        super().close()
        self.inner.close()


def as_callback(callback) -> Callback:
    """The callback an operation reports to: ``callback`` itself when it is an nbkit :class:`Callback`,
    any other fsspec-style callback wrapped so that ``set_description`` and ``should_stop`` are
    safe, and a do-nothing :class:`NoOpCallback` for ``None``. Operations call the result's methods
    directly: nothing else needs to guard against a callback that lacks one.

    Example:
        >>> import fsspec.callbacks
        >>> plain = fsspec.callbacks.Callback()
        >>> cb = as_callback(plain)
        >>> cb.set_description("any phase"); cb.set_size(3); cb.relative_update(2)
        >>> plain.value, cb.should_stop()
        (2, False)
    """
    if callback is None:
        return NoOpCallback()
    if isinstance(callback, Callback):
        return callback
    return _FsspecAdapter(callback)


class TextProgress(Callback):
    """A plain one-line progress meter for terminals, scripts and CI logs.

    On a terminal (the stream's ``isatty()``) it rewrites one line with ``\\r``, at most every
    ``min_interval`` seconds. Anywhere else (a log file, a pipe, a notebook's captured output) it
    prints a line at each tenth of the work (:data:`LOG_STEPS`) or after :data:`LOG_SECONDS` without
    one, whichever comes first, and the last line once: about a dozen lines for a long warmup.

    Progress only moves forward. Until its total is known a line shows a count and a rate, no
    percent; a count past the total shows as the total (100%); a total revised upward holds the
    percent where it was until the work catches up. Each phase of an operation
    (:meth:`~Callback.start_phase`: hash in bytes, then verify in samples) ends with one final line
    and starts a line of its own, in its own unit, never a fraction that falls.

    Args:
        label: what runs, at the start of the line.
        file: the stream (default ``sys.stderr``).
        min_interval: seconds between redraws on a terminal.
        unit: what the counts count (``"samples"``, ``"bytes"``).
        clock: seconds, for when to print and for the rate and ETA (default :func:`time.perf_counter`).

    Example:
        >>> import io
        >>> out = io.StringIO()
        >>> now = [0.0]
        >>> p = TextProgress("import", file=out, unit="bytes", clock=lambda: now[0])
        >>> p.set_size(4000); now[0] = 2.0; p.relative_update(4000)
        >>> p.start_phase("verify", size=2); now[0] = 3.0; p.relative_update(2); p.close()
        >>> print(out.getvalue())
        import  0 B/4.0 KB    0.0%  0 B/s  0.0s
        import  4.0 KB/4.0 KB  100.0%  2.0 KB/s  2.0s
        import verify  0/2    0.0%  0 samples/s  0.0s
        import verify  2/2  100.0%  2 samples/s  1.0s
        <BLANKLINE>
    """

    #: Off a terminal, a line each time the work crosses another 1/LOG_STEPS of its size ...
    LOG_STEPS = 10
    #: ... or when this many seconds passed since the last line.
    LOG_SECONDS = 30.0

    def __init__(self, label: str = "", *, file=None, min_interval: float = 0.5, unit: str = "samples",
                 clock=time.perf_counter, **kwargs):
        self.clock = clock  # first: the callback's own clock starts in super().__init__
        super().__init__(unit=unit, **kwargs)
        self.label = label
        self.file = file if file is not None else sys.stderr
        self.min_interval = min_interval
        self._last_print = None
        self._tty = bool(getattr(self.file, "isatty", lambda: False)())
        self._printed = False  # anything at all was printed (close prints a line if not)
        self._open = ""  # on a terminal: the text of the line drawn and not yet ended
        self._new_phase()
        self._closed = False

    def _new_phase(self) -> None:
        self._floor = 0.0
        self._logged_step = None  # the tenth of the work the last logged line was in
        self._final_logged = False  # the finished line is in the log
        self._drawn_phase = False  # this phase printed a line

    def fraction(self) -> float | None:
        """The share of this phase done, from 0 to 1, or ``None`` while its total is unknown (or before
        it is set: a line is never drawn against another phase's total). Never less than before in this
        phase, never more than 1."""
        if self.size is None:
            return None
        now = 1.0 if self.size <= 0 else min(1.0, max(0.0, self.value / self.size))
        self._floor = max(self._floor, now)
        return self._floor

    def _what(self) -> str:
        label = printable(self.label) or "progress"
        return f"{label} {printable(self.phase)}" if self.phase and self.phase != self.label else label

    def line(self) -> str:
        """The text of the progress line, e.g. ``warmup  1,200/60,000   2.0%  5,400 samples/s  ETA 11s``
        (``hash  12.0 MB  30.0 MB/s  0.4s`` while the total is unknown)."""
        parts = [self._what()]
        fraction = self.fraction()
        if fraction is not None:
            done = min(self.value, self.size) if self.size > 0 else self.value
            parts.append(f"{format_amount(done, self.unit)}/{format_amount(self.size, self.unit)}")
            parts.append(f"{100.0 * fraction:5.1f}%")
        else:
            parts.append(format_amount(self.value, self.unit) + ("" if self.unit == "bytes" else f" {self.unit}"))
        parts.append(format_rate(self.rate(), self.unit))
        eta = self.eta()
        parts.append(f"ETA {format_seconds(eta)}" if eta is not None and not self.finished else format_seconds(self.elapsed()))
        if self.workers is not None:
            parts.append(self.workers.text())  # parts done of all, the workers, the slowest: what the description said, and more
        elif self.description:
            parts.append(printable(self.description))  # it may name a tar or a URL
        return "  ".join(parts)

    def _fit(self, text: str) -> str:
        """``text`` as this stream shows it: cut to one row of a terminal (a line redrawn with ``\\r``
        must not wrap), in lines of :data:`~nbkit.text.NARROW_COLUMNS` in a notebook (as
        :func:`nbkit.text.say`), whole into a log."""
        if self._tty:
            width = _columns(self.file)
            return text if width is None or len(text) < width else text[: max(width - 2, 1)] + "…"
        return fill(text, NARROW_COLUMNS) if in_kernel() else text

    def call(self, *args, **kwargs):
        if self._closed:
            return
        now = self.clock()
        if self._tty:
            if not self.finished and self._last_print is not None and now - self._last_print < self.min_interval:
                return
            text = self._fit(self.line())
            if text != self._open:  # the same text again (a finished phase's last calls) is not redrawn
                self._draw(now, text)
        elif self._log_due(now):
            self._print(now, self.line())

    def _log_due(self, now: float) -> bool:
        """Off a terminal: whether this update gets a line (and note that it does)."""
        if self.finished:
            due, self._final_logged = not self._final_logged, True
            return due
        self._final_logged = False  # more work: its end gets a line again
        fraction = self.fraction()
        step = int(self.LOG_STEPS * fraction) if fraction is not None else None
        if (step is not None and step != self._logged_step) or not self._drawn_phase \
                or now - self._last_print >= self.LOG_SECONDS:
            self._logged_step = step
            return True
        return False

    def _draw(self, now: float, text: str) -> None:
        """On a terminal: rewrite this phase's line (blanking what a longer one left), without ending it."""
        pad = " " * max(0, len(self._open) - len(text))
        self._last_print, self._open, self._drawn_phase, self._printed = now, text, True, True
        print("\r" + text + pad, end="", file=self.file, flush=True)

    def _print(self, now: float, text: str) -> None:
        self._last_print, self._drawn_phase, self._printed = now, True, True
        print(self._fit(text), file=self.file, flush=True)

    def _end_line(self) -> None:
        """End this phase's line with its final state: once, whether it finished or stopped."""
        if self.value == 0 and not self.size and self.ended is None:
            return  # a phase that did nothing (connecting, a step with no work): the next line takes its place
        if self._tty:
            if self._open:
                text = self._fit(self.line())
                pad = " " * max(0, len(self._open) - len(text))
                print("\r" + text + pad, file=self.file, flush=True)
                self._open = ""
        elif self._drawn_phase and not self._final_logged:
            self._print(self.clock(), self.line())

    def start_phase(self, name: str, *, unit: str = "samples", size=None) -> None:
        """End the line of the phase that ran (its final state), then start the next phase on a line of its own."""
        if not self._closed:
            self._end_line()
        self._new_phase()
        super().start_phase(name, unit=unit, size=size)

    def close(self):
        if not self._closed:
            super().close()
            if self._printed:
                self._end_line()
            else:  # a run that never reported still ends with one line: its state
                self._print(self.clock(), self.line())
            self._closed = True


def _columns(stream) -> int | None:
    """The width of the terminal ``stream`` writes to (``$COLUMNS`` first), or ``None`` if unknown."""
    try:
        return int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        pass
    try:
        return os.get_terminal_size(stream.fileno()).columns or None
    except (AttributeError, OSError, ValueError):
        return None  # not a real file (a StringIO that says it is a terminal), or no terminal after all


class JobState(str, enum.Enum):
    """Where a :class:`Job` is.

    Example:
        >>> JobState("done") is JobState.DONE, JobState.RUNNING.value
        (True, 'running')
    """

    READY = "ready"  # not started
    RUNNING = "running"  # the operation runs in the background
    STOPPING = "stopping"  # a stop was requested; the operation ends after its current unit of work
    STOPPED = "stopped"  # it ended early because a stop was requested
    DONE = "done"  # it finished
    ERROR = "error"  # it raised; see ``job.error``


class Job:
    """One long operation (``fn(callback)``) run in a background thread: start, stop, wait, its report or error.

    The thread is a daemon, so a stuck upload cannot keep a notebook kernel from shutting down.
    Whatever ``fn`` raises is kept in :attr:`error` (a background thread has nowhere else to put it);
    ``on_end(job)``, if given, runs in that thread once the job has ended, to render the outcome.

    Args:
        name: what the operation is, e.g. ``"warmup"``, ``"export"``, ``"upload"``.
        fn: called with the job's callback; returns the operation's report.
        callback: the :class:`Callback` the operation reports to (default: a silent one).
        on_end: called with the job after ``fn`` returned or raised.

    Attributes:
        report: what ``fn`` returned (``None`` until it did).
        error: the exception ``fn`` raised, or ``None``.

    Example:
        >>> def count(cb):
        ...     cb.set_size(3)
        ...     for _ in range(3):
        ...         cb.relative_update(1)
        ...     return "counted"
        >>> job = Job("count", count).start()
        >>> job.wait(timeout=10), job.state, job.report, job.callback.value
        (True, <JobState.DONE: 'done'>, 'counted', 3)
    """

    def __init__(self, name: str, fn: Callable[[Callback], Any], *, callback: Callback | None = None,
                 on_end: Callable[["Job"], None] | None = None):
        self.name = name
        self.fn = fn
        self.callback = callback if callback is not None else NoOpCallback(phase=name)
        self.on_end = on_end
        self.report = None
        self.error = None
        self._thread = None
        self._ended = False
        # Set once on_end has run. Waiting on it rather than joining the thread: a KeyboardInterrupt
        # in Thread.join can leave the thread looking dead while it still runs (CPython 3.11).
        self._finished = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> "Job":
        """Run the operation in a background thread; returns the job."""
        if self._thread is not None:
            raise RuntimeError(f"the {self.name} job was already started; make a new Job to run it again")
        self._thread = threading.Thread(target=self._run, name=f"nbkit-{self.name}", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.report = self.fn(self.callback)
        # Any failure of the operation is the job's outcome, shown by whoever renders it, rather
        # than a traceback lost in a background thread.
        except Exception as e:  # noqa: BLE001 - the job's outcome (above)
            self.error = e
        finally:
            self.callback.close()
            with self._lock:
                self._ended = True
        try:
            if self.on_end is not None:
                self.on_end(self)
        finally:
            self._finished.set()

    def stop(self) -> bool:
        """Ask the operation to stop after its current unit of work; False if it is not running."""
        with self._lock:
            if self._thread is None or self._ended:
                return False
            self.callback.request_stop()
            return True

    @property
    def running(self) -> bool:
        """Started and not yet ended."""
        return self._thread is not None and not self._ended

    @property
    def state(self) -> JobState:
        if self._thread is None:
            return JobState.READY
        if not self._ended:
            return JobState.STOPPING if self.callback.should_stop() else JobState.RUNNING
        if self.error is not None:
            return JobState.ERROR
        return JobState.STOPPED if self.stopped else JobState.DONE

    @property
    def stopped(self) -> bool:
        """The operation ended early because a stop was requested."""
        if bool(getattr(self.report, "stopped", False)):
            return True
        return self._ended and self.callback.should_stop() and not self.callback.finished

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job has ended (and ``on_end`` ran); False on timeout."""
        if self._thread is None:
            return True
        return self._finished.wait(timeout)
