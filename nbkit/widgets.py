"""Notebook views of a cache: :class:`WarmupPanel` and :class:`HitRateMeter`.

Both are views, in the sense of ``tqdm.notebook``: they render numbers the engine already keeps
(the progress :class:`~nbkit.progress.Callback` it calls, and ``ds.stats``) and hold no caching
logic. Outside a notebook kernel (a terminal, a script, CI logs) the same calls print a plain
text line instead of drawing widgets.

Works with ipywidgets 8 and with ipywidgets 7.7.1 (what Colab's TPU runtime ships).

Example:
    >>> import torch, tempfile
    >>> import nbkit
    >>> from nbkit.widgets import HitRateMeter, WarmupPanel
    >>> source = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> ds = nbkit.CachedDataset(source, tempfile.mkdtemp())
    >>> panel = WarmupPanel(ds)
    >>> panel.warmup_button.click(); panel.wait(timeout=60)
    True
    >>> panel.state.value
    'done'
    >>> meter = HitRateMeter(ds)
    >>> for _ in meter.track(torch.utils.data.DataLoader(ds, batch_size=4)): pass
    >>> meter.epochs[-1].hit_rate
    1.0
"""

from __future__ import annotations

import enum
import html
import re
import sys
import threading
import time
from dataclasses import dataclass

try:
    import ipywidgets as _w
except ImportError as e:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("nbkit.widgets needs ipywidgets: pip install 'nbkit[notebook]'") from e

from nbkit.progress import Callback, TextProgress, format_seconds

__all__ = ["WarmupPanel", "HitRateMeter", "PanelState", "EpochStats"]

# Front ends redraw a few times a second at most; more only costs kernel messages.
_RENDER_INTERVAL = 0.2
_RED, _GREEN, _GREY = "#c62828", "#2e7d32", "#555555"


def _in_kernel() -> bool:
    """True inside a Jupyter/Colab/Voila kernel, where widgets have a front end to draw in."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    shell = ipython.get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class _View:
    """What both views share: a widget in a kernel, one line of text (``text()``) anywhere else."""

    def _ipython_display_(self):
        if self._terminal:
            print(self.text())
        else:
            from IPython.display import display

            display(self.widget)

    def __repr__(self):
        return f"{type(self).__name__}({self.text()})"


def _fmt_bytes(n) -> str:
    n = float(n or 0)
    if abs(n) < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB", "GB"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} TB"


def _fmt_amount(n, unit: str) -> str:
    return _fmt_bytes(n) if unit == "bytes" else f"{int(n):,}"


def _fmt_rate(rate: float, unit: str) -> str:
    return f"{_fmt_bytes(rate)}/s" if unit == "bytes" else f"{rate:,.0f} {unit}/s"


def _status_html(text: str, color: str = _GREY, *, bold: bool = False) -> str:
    weight = "bold" if bold else "normal"
    return f'<span style="color:{color};font-weight:{weight}">{html.escape(text)}</span>'


class PanelState(str, enum.Enum):
    """What a :class:`WarmupPanel` is doing, shown in its status line.

    Example:
        >>> PanelState("done") is PanelState.DONE, PanelState.RUNNING.value
        (True, 'running')
    """

    READY = "ready"  # nothing running; the cache may be partly filled
    RUNNING = "running"  # a warmup, export or upload runs in the background
    STOPPING = "stopping"  # Stop was clicked; the operation ends after its current chunk
    STOPPED = "stopped"  # a warmup was stopped; Warm up resumes it
    DONE = "done"  # the last operation finished
    ERROR = "error"  # the last operation failed; see ``panel.last_error``


class _PanelProgress(Callback):
    """The callback one panel operation hands to the engine; it only forwards numbers to the panel."""

    def __init__(self, panel: "WarmupPanel", label: str, unit: str):
        super().__init__()
        self.panel = panel
        self.label = label
        self.unit = unit
        self.moved = 0  # units done by this operation (not the ones already cached before it)
        self.started = time.perf_counter()
        self.first_move = None
        self._last_render = 0.0
        self._text = None  # a TextProgress when there is no notebook front end

    def set_size(self, size):
        if self.label == "warmup" and self.finished:
            # ds.warmup on a remote (gs://) cache goes on to publish it through the same callback,
            # counting bytes: start a new phase rather than show bytes as samples.
            self.unit, self.value, self.moved, self.first_move, self._text = "bytes", 0, 0, None, None
        super().set_size(size)

    def relative_update(self, inc=1):
        if self.first_move is None:
            self.first_move = time.perf_counter()
            if self.panel._terminal:
                self._text = TextProgress(self.label, size=self.size, value=self.value, unit=self.unit)
        self.moved += inc
        super().relative_update(inc)

    def rate(self) -> float:
        if self.first_move is None or self.moved == 0:
            return 0.0
        return self.moved / max(time.perf_counter() - self.first_move, 1e-9)

    def call(self, *args, **kwargs):
        if self._text is not None:
            self._text.size, self._text.value = self.size, self.value
            self._text.description = self.description
            self._text.call()
        now = time.perf_counter()
        if now - self._last_render < _RENDER_INTERVAL and not self.finished:
            return
        self._last_render = now
        self.panel._render_progress(self)

    def close(self):
        if self._text is not None:
            self._text.close()


class WarmupPanel(_View):
    """A click-through panel for one cache: warm it up, stop, resume, export a tar, upload.

    Warm up runs ``ds.warmup`` in a background thread, so the notebook stays usable; **Stop** asks
    it to end after the current chunk and a later **Warm up** resumes with the samples still
    missing. **Export tar** calls :func:`nbkit.export_tar` with the path in ``tar_field``;
    **Upload** calls :func:`nbkit.push` with the ``gs://…`` URL in ``url_field``. Errors show in
    red in the status line and stay in :attr:`last_error`; nothing here writes to the cache.

    Args:
        ds: the :class:`nbkit.CachedDataset` to show.
        num_workers: worker processes for warmup (0 = in this process).
        tar_path: initial value of the Export tar field.
        upload_url: initial value of the Upload field, e.g. ``"gs://my-bucket/mnist-cache"``.
        storage_options: passed to :func:`nbkit.push` (e.g. ``{"token": "anon"}``).

    Attributes:
        state: a :class:`PanelState`.
        last_error: the exception that ended the last operation, or ``None``.
        report: what the last operation returned (a ``WarmupReport`` for warmup).

    Example:
        >>> import torch, tempfile
        >>> import nbkit
        >>> from nbkit.widgets import WarmupPanel
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(6, 2)), tempfile.mkdtemp())
        >>> panel = WarmupPanel(ds, tar_path=tempfile.mkdtemp() + "/cache.tar")
        >>> panel.warmup_button.click(); panel.wait(timeout=60)
        True
        >>> panel.export_button.click(); panel.wait(timeout=60)
        True
        >>> panel.last_error is None
        True
    """

    def __init__(self, ds, *, num_workers: int = 0, tar_path: str = "", upload_url: str = "", storage_options=None):
        self.ds = ds
        self.num_workers = num_workers
        self.storage_options = dict(storage_options or {})
        self.state = PanelState.READY
        self.last_error = None
        self.report = None
        self._thread = None
        self._callback = None
        self._terminal = not _in_kernel()
        # Guards state changes that the Stop button (kernel thread) and the worker thread race on.
        self._lock = threading.RLock()

        button = _w.Layout(width="110px")
        self.warmup_button = _w.Button(description="Warm up", button_style="primary", icon="play", layout=button)
        self.stop_button = _w.Button(description="Stop", button_style="warning", icon="stop", layout=button, disabled=True)
        self.export_button = _w.Button(description="Export tar", icon="archive", layout=button)
        self.upload_button = _w.Button(description="Upload", icon="upload", layout=button)
        field = _w.Layout(width="420px")
        self.tar_field = _w.Text(value=tar_path, placeholder="/content/my-cache.tar", layout=field)
        self.url_field = _w.Text(value=upload_url, placeholder="gs://my-bucket/my-cache", layout=field)
        self.progress = _w.FloatProgress(
            value=0.0, min=0.0, max=1.0, description="Cache", style={"description_width": "56px"},
            layout=_w.Layout(width="476px"),
        )
        self.percent_label = _w.Label(value="0%")
        self.done_label = _w.Label()
        self.rate_label = _w.Label(value="– samples/s")
        self.eta_label = _w.Label(value="ETA –")
        self.bytes_label = _w.Label()
        self.status = _w.HTML()
        self.title = _w.HTML()

        self.warmup_button.on_click(lambda _: self.warmup())
        self.stop_button.on_click(lambda _: self.stop())
        self.export_button.on_click(lambda _: self.export())
        self.upload_button.on_click(lambda _: self.upload())

        def row(*children):
            return _w.HBox(list(children), layout=_w.Layout(align_items="center"))

        def caption(text):
            return _w.Label(value=text, layout=_w.Layout(width="80px"))

        sep = lambda: _w.Label(value="·")  # noqa: E731 - a tiny separator factory
        self.widget = _w.VBox(
            [
                self.title,
                row(self.warmup_button, self.stop_button, self.progress, self.percent_label),
                row(self.done_label, sep(), self.rate_label, sep(), self.eta_label, sep(), self.bytes_label),
                row(caption("Tar file"), self.tar_field, self.export_button),
                row(caption("Upload to"), self.url_field, self.upload_button),
                self.status,
            ]
        )
        self._show_cache_state()

    # -- what the buttons do ------------------------------------------------------------------

    def warmup(self) -> None:
        """Start (or resume) filling the cache in the background; same as clicking **Warm up**."""
        reason = self._warmup_unavailable(self.ds.stats)
        if reason:
            self._set_status(reason, _GREY)
            return
        self._start(
            "warmup",
            "samples",
            lambda cb: self.ds.warmup(num_workers=self.num_workers, callback=cb),
        )

    def stop(self) -> None:
        """Ask the running operation to stop after its current chunk; same as clicking **Stop**."""
        with self._lock:
            cb = self._callback
            if cb is None or self.state is not PanelState.RUNNING:
                return
            cb.request_stop()
            self.state = PanelState.STOPPING
            self.stop_button.disabled = True
            self._set_status("Stopping after the current chunk…", _GREY)

    def export(self, path: str | None = None) -> None:
        """Write the cache to a tar file (``tar_field``, or ``path``); same as **Export tar**."""
        if path is not None:
            self.tar_field.value = path
        path = self.tar_field.value.strip()
        if not path:
            self._fail(ValueError("Export needs a destination: type a tar path, e.g. /content/my-cache.tar"))
            return

        def run(cb):
            from nbkit.archive import export_tar  # written alongside; imported when first used

            return export_tar(self.ds.root, path, callback=cb)

        self._start("export", "bytes", run, done=lambda cb: f"Exported {_fmt_bytes(cb.value)} to {path}")

    def upload(self, url: str | None = None) -> None:
        """Copy the cache to a URL (``url_field``, or ``url``), e.g. ``gs://bucket/prefix``; same as **Upload**."""
        if url is not None:
            self.url_field.value = url
        url = self.url_field.value.strip()
        if "://" not in url:
            self._fail(ValueError(f"Upload needs a URL like gs://my-bucket/my-cache, got {url!r}"))
            return

        def run(cb):
            from nbkit.transfer import push  # written alongside; imported when first used

            return push(self.ds.root, url, callback=cb, storage_options=self.storage_options)

        self._start("upload", "bytes", run, done=lambda cb: f"Uploaded {_fmt_bytes(cb.value)} to {url}")

    @property
    def running(self) -> bool:
        """True while a background operation runs."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background operation ends (for headless runs). Returns False on timeout."""
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def close(self) -> None:
        """Stop any running operation and close the widgets."""
        self.stop()
        self.wait(timeout=30)
        self.widget.close()

    # -- display --------------------------------------------------------------------------------

    def text(self) -> str:
        """The panel as one line of text (what a terminal shows)."""
        if self.state in (PanelState.RUNNING, PanelState.STOPPING):
            parts = [self.done_label.value, self.rate_label.value, self.eta_label.value, self.bytes_label.value]
        else:
            parts = [self.done_label.value]
        parts.append(self.status_text())
        return "nbkit: " + "  ".join(p for p in parts if p)

    def status_text(self) -> str:
        """The status line without markup."""
        return html.unescape(re.sub(r"<[^>]+>", "", self.status.value))

    # -- internals --------------------------------------------------------------------------------

    def _warmup_unavailable(self, stats) -> str:
        if self.ds.source is None:
            return (
                "Warm up is off: this cache was opened without its source dataset. "
                "To fill it, build it with nbkit.CachedDataset(source, path)."
            )
        if stats.complete:
            return "Nothing to warm up: every sample is already cached."
        return ""

    def _show_title(self, stats) -> None:
        if stats.complete:
            fill = f"<span style='color:{_GREEN}'>complete</span>"
        else:
            fill = f"{int(stats.cached):,} cached"
        self.title.value = (
            f"<b>nbkit cache</b> <code>{html.escape(str(getattr(self.ds, 'path', '')))}</code>"
            f" <span style='color:{_GREY}'>· {int(stats.total):,} samples · {fill}</span>"
        )

    def _show_cache_state(self) -> None:
        """The panel before its first operation: how full the cache is and what Warm up would do."""
        stats = self.ds.stats
        self._finish_buttons(stats)
        total = int(stats.total)
        self.progress.value = (stats.cached / total) if total else 1.0
        self.progress.bar_style = "success" if stats.complete else ""
        self.percent_label.value = f"{100.0 * self.progress.value:.0f}%"
        self.done_label.value = f"{int(stats.cached):,}/{total:,} samples"
        if stats.complete:
            self._set_status(f"Cache complete: {total:,} samples, {_fmt_bytes(stats.bytes)} stored.", _GREEN, bold=True)
        elif self.ds.source is None:
            self._set_status(self._warmup_unavailable(stats) + f" {total - int(stats.cached):,} samples are missing.", _GREY)
        else:
            self._set_status(f"Ready: {total - int(stats.cached):,} of {total:,} samples to compute. Click Warm up.")

    def _start(self, name: str, unit: str, fn, *, done=None) -> None:
        with self._lock:
            if self.running:
                self._set_status(f"Busy: wait for the current {self._callback.label} to finish, or click Stop.", _GREY)
                return
            cb = _PanelProgress(self, name, unit)
            self._callback = cb
            self.state = PanelState.RUNNING
            self.last_error = None
            self.report = None
            for b in (self.warmup_button, self.export_button, self.upload_button):
                b.disabled = True
            self.stop_button.disabled = False
            self.progress.description = {"warmup": "Cache"}.get(name, name.capitalize())
            self.progress.bar_style = "info"
            if name != "warmup":  # the bar now measures this transfer, not how full the cache is
                self.progress.value = 0.0
                self.percent_label.value = "0%"
            self._set_status(f"{name.capitalize()}…", _GREY)
            # A daemon thread: a stuck upload must not keep the kernel from shutting down.
            self._thread = threading.Thread(target=self._run, args=(cb, fn, done), name=f"nbkit-{name}", daemon=True)
            self._thread.start()

    def _run(self, cb: _PanelProgress, fn, done) -> None:
        try:
            report = fn(cb)
        # The panel is the place errors of a button click surface: any failure of the operation is
        # shown in red and kept in last_error rather than lost in a background thread.
        except Exception as e:  # noqa: BLE001
            cb.close()
            self._fail(e)
            return
        cb.close()
        with self._lock:
            self._show_result(cb, report, done)

    def _show_result(self, cb: _PanelProgress, report, done) -> None:
        self.report = report
        stopped = bool(getattr(report, "stopped", False)) or (cb.stop_requested and not cb.finished)
        self.state = PanelState.STOPPED if stopped else PanelState.DONE
        self._render_progress(cb)
        stats = self.ds.stats
        self._finish_buttons(stats)
        if cb.label == "warmup":
            if stopped:
                self.progress.bar_style = "warning"
                self._set_status(
                    f"Stopped at {int(stats.cached):,}/{int(stats.total):,} samples. Click Warm up to resume.", _GREY, bold=True
                )
            else:
                seconds = getattr(report, "seconds", time.perf_counter() - cb.started)
                computed = getattr(report, "computed", cb.moved)
                self.progress.bar_style = "success"
                self._set_status(
                    f"Cache complete: {int(stats.total):,} samples, {_fmt_bytes(stats.bytes)} stored "
                    f"({computed:,} computed in {format_seconds(seconds)}).",
                    _GREEN,
                    bold=True,
                )
        else:
            self.progress.bar_style = "warning" if stopped else "success"
            if stopped:
                self._set_status(f"Stopped: the {cb.label} was interrupted.", _GREY, bold=True)
            else:
                self._set_status(done(cb) + ".", _GREEN, bold=True)
        if self._terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.last_error = error
            self.state = PanelState.ERROR
            self.progress.bar_style = "danger"
            self._finish_buttons(self.ds.stats)
            self._set_status(f"Error: {type(error).__name__}: {error}", _RED, bold=True)
        if self._terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _finish_buttons(self, stats) -> None:
        """Buttons, stored bytes and title for a panel with nothing running."""
        self.stop_button.disabled = True
        self.export_button.disabled = False
        self.upload_button.disabled = False
        unavailable = self._warmup_unavailable(stats)
        self.warmup_button.disabled = bool(unavailable)
        self.warmup_button.tooltip = unavailable
        self.bytes_label.value = f"{_fmt_bytes(stats.bytes)} stored"
        self._show_title(stats)

    def _render_progress(self, cb: _PanelProgress) -> None:
        size, value, unit = cb.size, cb.value, cb.unit
        if size:
            self.progress.value = min(value / size, 1.0)
            self.percent_label.value = f"{100.0 * value / size:.0f}%"
            self.done_label.value = f"{_fmt_amount(value, unit)}/{_fmt_amount(size, unit)} {'' if unit == 'bytes' else unit}".rstrip()
        else:
            self.done_label.value = f"{_fmt_amount(value, unit)} {'' if unit == 'bytes' else unit}".rstrip()
        rate = cb.rate()
        self.rate_label.value = _fmt_rate(rate, unit) if rate else f"0 {unit}/s"
        if cb.finished:
            self.eta_label.value = f"took {format_seconds(time.perf_counter() - cb.started)}"
        elif size and rate > 0:
            self.eta_label.value = f"ETA {format_seconds((size - value) / rate)}"
        else:
            self.eta_label.value = "ETA –"
        if cb.label == "warmup":
            stats = self.ds.stats
            self.bytes_label.value = f"{_fmt_bytes(stats.bytes)} stored"
            self._show_title(stats)
        if self.state is PanelState.RUNNING and cb.description:
            self._set_status(f"{cb.label.capitalize()}: {cb.description}…", _GREY)

    def _set_status(self, text: str, color: str = _GREY, *, bold: bool = False) -> None:
        self.status.value = _status_html(text, color, bold=bold)


@dataclass
class EpochStats:
    """Reads in one epoch, as counted by ``ds.stats``.

    Attributes:
        epoch: 1 for the first epoch.
        hits: samples served from the cache.
        misses: samples computed from the source (and stored).
        seconds: wall time of the epoch so far.

    Example:
        >>> e = EpochStats(epoch=2, hits=90, misses=10, seconds=0.5)
        >>> e.reads, e.hit_rate, e.rate, e.filling
        (100, 0.9, 200.0, True)
    """

    epoch: int
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0

    @property
    def reads(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Hits / reads (``nan`` before the first read)."""
        return self.hits / self.reads if self.reads else float("nan")

    @property
    def rate(self) -> float:
        """Samples read per second."""
        return self.reads / self.seconds if self.seconds > 0 else 0.0

    @property
    def filling(self) -> bool:
        """True when this epoch computed samples (typically the first), False when all were hits."""
        return self.misses > 0


def _pct(x: float) -> str:
    return "–" if x != x else f"{100.0 * x:.1f}%"  # x != x: nan before the first read


class HitRateMeter(_View):
    """Live cache hit rate, this epoch and overall, while a training loop runs.

    It reads ``ds.stats`` (whose counters include reads done in DataLoader worker processes) at
    most every ``min_interval`` seconds, so :meth:`update` is cheap enough to call per batch.
    Wrap a loader with :meth:`track` to update per batch and mark each pass over it as an epoch,
    or call :meth:`update` and :meth:`new_epoch` yourself. A table shows every epoch, with the
    first (filling) epoch apart from the later ones served from the cache.

    Args:
        ds: the :class:`nbkit.CachedDataset` to watch.
        min_interval: seconds between redraws.
        file: where the terminal fallback writes (default ``sys.stderr``).

    Attributes:
        epochs: one :class:`EpochStats` per epoch; the last one is the current epoch.

    Example:
        >>> import torch, tempfile
        >>> import nbkit
        >>> from nbkit.widgets import HitRateMeter
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(8, 2)), tempfile.mkdtemp())
        >>> meter = HitRateMeter(ds)
        >>> loader = torch.utils.data.DataLoader(ds, batch_size=4)
        >>> for epoch in range(2):
        ...     for batch in meter.track(loader):
        ...         pass
        >>> [(e.epoch, e.misses, e.hits) for e in meter.epochs]
        [(1, 8, 0), (2, 0, 8)]
    """

    def __init__(self, ds, *, min_interval: float = 0.25, file=None):
        self.ds = ds
        self.min_interval = min_interval
        self.file = file
        self._terminal = not _in_kernel()
        self._tty = bool(getattr(file if file is not None else sys.stderr, "isatty", lambda: False)())
        self._last_render = float("-inf")
        self._last_print = float("-inf")
        self._final_printed = 0
        self._in_pass = False  # inside a track() pass: the current epoch is still running
        self.renders = 0  # how many times the view was redrawn (throttling is observable)

        stats = ds.stats
        self._base = (stats.hits, stats.misses)  # counters at construction: "overall" starts here
        self._epoch_base = self._base
        self._epoch_start = time.perf_counter()
        self._start = self._epoch_start
        self._last_counts = self._base
        self.epochs = [EpochStats(epoch=1)]

        self.headline = _w.HTML()
        self.rate_bar = _w.FloatProgress(value=0.0, min=0.0, max=1.0, layout=_w.Layout(width="300px"))
        self.counts_label = _w.Label()
        self.table = _w.HTML()
        self.widget = _w.VBox([_w.HBox([self.headline, self.rate_bar]), self.counts_label, self.table])
        self._render(time.perf_counter())

    @property
    def current(self) -> EpochStats:
        """The epoch being counted now."""
        return self.epochs[-1]

    def update(self, force: bool = False) -> None:
        """Redraw from ``ds.stats`` if ``min_interval`` has passed (always with ``force=True``)."""
        now = time.perf_counter()
        if force or now - self._last_render >= self.min_interval:
            self._render(now)

    def new_epoch(self) -> None:
        """Close the current epoch and start counting the next one.

        Does nothing but restart the clock when the current epoch has not read anything yet, so
        calling it before the first epoch is harmless.
        """
        now = time.perf_counter()
        self._count(now)
        if self.current.reads == 0:
            self._epoch_start = now
            self.current.seconds = 0.0
        else:
            self._render(now, final=True)
            self._epoch_base = self._last_counts
            self._epoch_start = now
            self.epochs.append(EpochStats(epoch=self.current.epoch + 1))
        self._render(now)

    def track(self, iterable):
        """Wrap ``iterable`` (e.g. a DataLoader): yields its items, updating per item.

        Each pass over the returned object is one epoch: :meth:`new_epoch` runs when a pass
        starts, and the view is redrawn when it ends.
        """
        return _Tracked(self, iterable)

    def overall(self) -> EpochStats:
        """All reads since the meter was created, as one :class:`EpochStats` (``epoch=0``)."""
        hits, misses = (c - b for c, b in zip(self._last_counts, self._base))
        return EpochStats(epoch=0, hits=hits, misses=misses, seconds=self._last_time - self._start)

    def text(self) -> str:
        """The meter as one line of text (what a terminal shows)."""
        cur, tot = self.current, self.overall()
        budget = f"  [{self._budget}]" if self._budget else ""
        return (
            f"nbkit hit rate: epoch {cur.epoch} {_pct(cur.hit_rate)} ({cur.hits:,} hits, {cur.misses:,} misses, "
            f"{cur.rate:,.0f} samples/s)  overall {_pct(tot.hit_rate)} ({tot.hits:,} hits, {tot.misses:,} misses)"
            f"{budget}"
        )

    def _count(self, now: float) -> None:
        stats = self.ds.stats
        counts = (int(stats.hits), int(stats.misses))
        if counts[0] < self._epoch_base[0] or counts[1] < self._epoch_base[1]:
            # Someone called ds.reset_stats(): count on from zero rather than show negative reads.
            done = self.epochs[:-1]
            prior = (sum(e.hits for e in done), sum(e.misses for e in done))
            self._base = (-prior[0], -prior[1])
            self._epoch_base = (0, 0)
        self._last_counts = counts
        self._last_time = now
        # Under a byte budget the hit rate cannot exceed the cached fraction: say so next to it.
        self._budget = ""
        if stats.budgeted:
            self._budget = (f"budget: {stats.capacity:,} of {stats.total:,} samples cacheable "
                            f"({_pct(stats.capacity / max(stats.total, 1))} max hit rate)")
        cur = self.current
        cur.hits = counts[0] - self._epoch_base[0]
        cur.misses = counts[1] - self._epoch_base[1]
        cur.seconds = now - self._epoch_start

    def _render(self, now: float, final: bool = False) -> None:
        self._count(now)
        self._last_render = now
        self.renders += 1
        cur, tot = self.current, self.overall()
        rate = cur.hit_rate
        self.headline.value = (
            f"<b>Hit rate</b> epoch {cur.epoch}: <b>{_pct(rate)}</b>"
            f" <span style='color:{_GREY}'>· overall {_pct(tot.hit_rate)}</span>&nbsp;"
        )
        self.rate_bar.value = 0.0 if rate != rate else rate
        self.rate_bar.bar_style = "success" if rate == rate and rate >= 0.999 else "info"
        self.counts_label.value = (
            f"hits {tot.hits:,} · misses {tot.misses:,} · {cur.rate:,.0f} samples/s this epoch"
            + (f" · {self._budget}" if self._budget else "")
        )
        self.table.value = self._table_html()
        if self._terminal:
            self._print(now, final)

    def _table_html(self) -> str:
        head = "".join(
            f"<th style='padding:2px 10px;text-align:right'>{h}</th>"
            for h in ("epoch", "samples", "hits", "misses", "hit rate", "time", "samples/s", "")
        )
        rows = []
        for e in self.epochs:
            kind = "filling the cache" if e.filling else ("from the cache" if e.reads else "")
            if e is self.current and self._in_pass:
                kind = (kind + " (running)").strip()
            cells = (
                e.epoch, f"{e.reads:,}", f"{e.hits:,}", f"{e.misses:,}", _pct(e.hit_rate),
                f"{e.seconds:.2f}s" if e.seconds < 10 else format_seconds(e.seconds), f"{e.rate:,.0f}", kind,
            )
            tds = [f"<td style='padding:2px 10px;text-align:right'>{c}</td>" for c in cells[:-1]]
            tds.append(f"<td style='padding:2px 10px;text-align:left;color:{_GREY}'>{cells[-1]}</td>")
            rows.append("<tr>" + "".join(tds) + "</tr>")
        return f"<table style='border-collapse:collapse;font-variant-numeric:tabular-nums'><tr>{head}</tr>{''.join(rows)}</table>"

    def _print(self, now: float, final: bool) -> None:
        # On a TTY one line is rewritten; in logs, print epoch summaries and a line every few seconds.
        out = self.file if self.file is not None else sys.stderr
        if self.current.reads == 0 and not final or (final and self._final_printed == self.current.epoch):
            return
        if final:
            self._final_printed = self.current.epoch
        if self._tty:
            print(self.text(), end="\n" if final else "\r", file=out, flush=True)
        elif final or now - self._last_print >= max(self.min_interval, 5.0):
            self._last_print = now
            print(self.text(), file=out, flush=True)


class _Tracked:
    """What :meth:`HitRateMeter.track` returns: an iterable whose every pass is one epoch."""

    def __init__(self, meter: HitRateMeter, iterable):
        self.meter = meter
        self.iterable = iterable

    def __len__(self):
        return len(self.iterable)

    def __iter__(self):
        meter = self.meter
        meter.new_epoch()
        meter._in_pass = True
        try:
            for item in self.iterable:
                meter.update()  # before the loop body runs: the view includes this batch's reads
                yield item
        finally:
            meter._in_pass = False
        meter._render(time.perf_counter(), final=True)
