"""The warmup panel: buttons to fill a cache, stop, resume, export a tar and upload, with live progress.

A view in the sense of ``tqdm.notebook``: each button starts a :class:`nbkit.progress.Job` (the
operation runs in a background thread and reports through a callback) and the panel only renders
what the job and its callback hold, plus ``ds.stats``. Outside a notebook kernel the same calls
print plain text lines instead of drawing widgets.

Example:
    >>> import torch, tempfile
    >>> import nbkit
    >>> from nbkit.widgets.panel import WarmupPanel
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8.0)), tempfile.mkdtemp())
    >>> panel = WarmupPanel(ds)
    >>> panel.warmup_button.click(); panel.wait(timeout=60)
    True
    >>> panel.state.value
    'done'
"""

from __future__ import annotations

import html
import re
import sys
import threading
import time

from nbkit.progress import Callback, Job, JobState, TextProgress
from nbkit.text import format_amount, format_bytes, format_count, format_rate, format_seconds

from .view import GREEN, GREY, RED, RENDER_INTERVAL, View, in_kernel, ipywidgets as _w, status_html

__all__ = ["WarmupPanel", "PanelState"]

#: What a :class:`WarmupPanel` is doing: the state of its last job (``READY`` before the first one).
PanelState = JobState


class _PanelProgress(Callback):
    """The callback a panel job hands to the engine; it only asks the panel to redraw (throttled)."""

    def __init__(self, panel: "WarmupPanel", phase: str, unit: str):
        super().__init__(phase=phase, unit=unit)
        self.panel = panel
        self._last_render = 0.0
        self._text = None  # a TextProgress for this phase when there is no notebook front end

    def call(self, *args, **kwargs):
        if self.panel.terminal:
            self._echo()
        now = time.perf_counter()
        if now - self._last_render < RENDER_INTERVAL and not self.finished:
            return
        self._last_render = now
        self.panel._render_progress(self)

    def _echo(self) -> None:
        if self._text is not None and self._text.label != self.phase:
            self._text = None  # a new phase gets its own line
        if self._text is None:
            if self.moved <= 0:
                return  # nothing computed yet (or nothing to do): no progress line
            self._text = TextProgress(self.phase, size=self.size, value=self.value - self.moved, unit=self.unit)
        self._text.size, self._text.value, self._text.description = self.size, self.value, self.description
        self._text.call()

    def close(self):
        if self._text is not None:
            self._text.close()


class WarmupPanel(View):
    """A click-through panel for one cache: warm it up, stop, resume, export a tar, upload.

    Warm up runs ``ds.warmup`` in a background :class:`~nbkit.progress.Job`, so the notebook stays
    usable; **Stop** asks it to end after the current chunk and a later **Warm up** resumes with
    the samples still missing. **Export tar** calls :func:`nbkit.export_tar` with the path in
    ``tar_field``; **Upload** calls :func:`nbkit.push` with the ``gs://…`` URL in ``url_field``.
    Errors show in red in the status line and stay in :attr:`last_error`; nothing here writes to
    the cache.

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
        job: the last :class:`~nbkit.progress.Job`, or ``None``.

    Example:
        >>> import torch, tempfile
        >>> import nbkit
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
        self.job = None
        self._rejected = None  # a click refused before any job started (e.g. an empty tar path)
        self.terminal = not in_kernel()
        # Serialises what the Stop button (kernel thread) and a job's end (its thread) draw.
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

    # -- what the last job says -------------------------------------------------------------------

    @property
    def state(self) -> PanelState:
        if self._rejected is not None:
            return PanelState.ERROR
        return self.job.state if self.job is not None else PanelState.READY

    @property
    def last_error(self):
        if self._rejected is not None:
            return self._rejected
        return self.job.error if self.job is not None else None

    @property
    def report(self):
        return self.job.report if self.job is not None else None

    @property
    def running(self) -> bool:
        """True while a background operation runs."""
        return self.job is not None and self.job.running

    # -- what the buttons do ------------------------------------------------------------------

    def warmup(self) -> None:
        """Start (or resume) filling the cache in the background; same as clicking **Warm up**."""
        reason = self._warmup_unavailable(self.ds.stats)
        if reason:
            self._set_status(reason, GREY)
            return
        self._start("warmup", "samples", lambda cb: self.ds.warmup(num_workers=self.num_workers, callback=cb))

    def stop(self) -> None:
        """Ask the running operation to stop after its current chunk; same as clicking **Stop**."""
        with self._lock:
            if self.job is None or self.job.state is not JobState.RUNNING or not self.job.stop():
                return
            self.stop_button.disabled = True
            self._set_status("Stopping after the current chunk…", GREY)

    def export(self, path: str | None = None) -> None:
        """Write the cache to a tar file (``tar_field``, or ``path``); same as **Export tar**."""
        if path is not None:
            self.tar_field.value = path
        path = self.tar_field.value.strip()
        if not path:
            self._reject(ValueError("Export needs a destination: type a tar path, e.g. /content/my-cache.tar"))
            return

        def run(cb):
            from nbkit.archive import export_tar  # imported when first used

            return export_tar(self.ds.root, path, callback=cb)

        self._start("export", "bytes", run, done=lambda cb: f"Exported {format_bytes(cb.value)} to {path}")

    def upload(self, url: str | None = None) -> None:
        """Copy the cache to a URL (``url_field``, or ``url``), e.g. ``gs://bucket/prefix``; same as **Upload**."""
        if url is not None:
            self.url_field.value = url
        url = self.url_field.value.strip()
        if "://" not in url:
            self._reject(ValueError(f"Upload needs a URL like gs://my-bucket/my-cache, got {url!r}"))
            return

        def run(cb):
            from nbkit.transfer import push  # imported when first used

            return push(self.ds.root, url, callback=cb, storage_options=self.storage_options)

        self._start("upload", "bytes", run, done=lambda cb: f"Uploaded {format_bytes(cb.value)} to {url}")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background operation ends (for headless runs). Returns False on timeout."""
        return self.job is None or self.job.wait(timeout)

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
            fill = f"<span style='color:{GREEN}'>complete</span>"
        else:
            fill = f"{format_count(stats.cached)} cached"
        self.title.value = (
            f"<b>nbkit cache</b> <code>{html.escape(str(getattr(self.ds, 'path', '')))}</code>"
            f" <span style='color:{GREY}'>· {format_count(stats.total)} samples · {fill}</span>"
        )

    def _show_cache_state(self) -> None:
        """The panel before its first operation: how full the cache is and what Warm up would do."""
        stats = self.ds.stats
        self._finish_buttons(stats)
        total = int(stats.total)
        self.progress.value = (stats.cached / total) if total else 1.0
        self.progress.bar_style = "success" if stats.complete else ""
        self.percent_label.value = f"{100.0 * self.progress.value:.0f}%"
        self.done_label.value = f"{format_count(stats.cached)}/{format_count(total)} samples"
        missing = format_count(total - int(stats.cached))
        if stats.complete:
            self._set_status(f"Cache complete: {format_count(total)} samples, {format_bytes(stats.bytes)} stored.", GREEN, bold=True)
        elif self.ds.source is None:
            self._set_status(self._warmup_unavailable(stats) + f" {missing} samples are missing.", GREY)
        else:
            self._set_status(f"Ready: {missing} of {format_count(total)} samples to compute. Click Warm up.")

    def _start(self, name: str, unit: str, fn, *, done=None) -> None:
        with self._lock:
            if self.running:
                self._set_status(f"Busy: wait for the current {self.job.name} to finish, or click Stop.", GREY)
                return
            self._rejected = None
            for b in (self.warmup_button, self.export_button, self.upload_button):
                b.disabled = True
            self.stop_button.disabled = False
            self.progress.description = {"warmup": "Cache"}.get(name, name.capitalize())
            self.progress.bar_style = "info"
            if name != "warmup":  # the bar now measures this transfer, not how full the cache is
                self.progress.value = 0.0
                self.percent_label.value = "0%"
            self._set_status(f"{name.capitalize()}…", GREY)
            self.job = Job(name, fn, callback=_PanelProgress(self, name, unit), on_end=lambda job: self._show_end(job, done))
            self.job.start()

    def _show_end(self, job: Job, done) -> None:
        with self._lock:
            if job.error is not None:
                self._show_error(job.error)
                return
            cb, stats = job.callback, self.ds.stats
            stopped = job.state is JobState.STOPPED
            self._render_progress(cb)
            self._finish_buttons(stats)
            if job.name == "warmup":
                if stopped:
                    self.progress.bar_style = "warning"
                    self._set_status(
                        f"Stopped at {format_count(stats.cached)}/{format_count(stats.total)} samples. Click Warm up to resume.",
                        GREY, bold=True,
                    )
                else:
                    seconds = getattr(job.report, "seconds", cb.elapsed())
                    computed = getattr(job.report, "computed", cb.moved)
                    self.progress.bar_style = "success"
                    self._set_status(
                        f"Cache complete: {format_count(stats.total)} samples, {format_bytes(stats.bytes)} stored "
                        f"({format_count(computed)} computed in {format_seconds(seconds)}).",
                        GREEN, bold=True,
                    )
            else:
                self.progress.bar_style = "warning" if stopped else "success"
                if stopped:
                    self._set_status(f"Stopped: the {job.name} was interrupted.", GREY, bold=True)
                else:
                    self._set_status(done(cb) + ".", GREEN, bold=True)
        if self.terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _reject(self, error: BaseException) -> None:
        with self._lock:
            self._rejected = error
            self._show_error(error)

    def _show_error(self, error: BaseException) -> None:
        with self._lock:
            self.progress.bar_style = "danger"
            self._finish_buttons(self.ds.stats)
            self._set_status(f"Error: {type(error).__name__}: {error}", RED, bold=True)
        if self.terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _finish_buttons(self, stats) -> None:
        """Buttons, stored bytes and title for a panel with nothing running."""
        self.stop_button.disabled = True
        self.export_button.disabled = False
        self.upload_button.disabled = False
        unavailable = self._warmup_unavailable(stats)
        self.warmup_button.disabled = bool(unavailable)
        self.warmup_button.tooltip = unavailable
        self.bytes_label.value = f"{format_bytes(stats.bytes)} stored"
        self._show_title(stats)

    def _render_progress(self, cb: Callback) -> None:
        size, value, unit = cb.size, cb.value, cb.unit
        suffix = "" if unit == "bytes" else f" {unit}"
        if size:
            self.progress.value = min(value / size, 1.0)
            self.percent_label.value = f"{100.0 * value / size:.0f}%"
            self.done_label.value = f"{format_amount(value, unit)}/{format_amount(size, unit)}{suffix}"
        else:
            self.done_label.value = f"{format_amount(value, unit)}{suffix}"
        rate = cb.rate()
        self.rate_label.value = format_rate(rate, unit) if rate else f"0 {unit}/s"
        eta = cb.eta()
        if cb.finished:
            self.eta_label.value = f"took {format_seconds(cb.elapsed())}"
        elif eta is not None:
            self.eta_label.value = f"ETA {format_seconds(eta)}"
        else:
            self.eta_label.value = "ETA –"
        if cb.phase == "warmup":
            stats = self.ds.stats
            self.bytes_label.value = f"{format_bytes(stats.bytes)} stored"
            self._show_title(stats)
        if self.state is PanelState.RUNNING and cb.description:
            self._set_status(f"{cb.phase.capitalize()}: {cb.description}…", GREY)

    def _set_status(self, text: str, color: str = GREY, *, bold: bool = False) -> None:
        self.status.value = status_html(text, color, bold=bold)
