"""The warmup panel: buttons to fill a cache, stop, resume, export a tar and upload, with live progress.

A view in the sense of ``tqdm.notebook``: each button starts a :class:`nbkit.progress.Job` (the
operation runs in a background thread and reports through a callback) and the panel only renders
what the job and its callback hold, plus ``ds.stats``. Outside a notebook kernel the same calls
print plain text lines instead of drawing widgets. A warmup built by several workers (an ``engine``:
local processes, a Ray or Dask cluster) also shows a compact table of the workers under the bar
(:func:`workers_html`, from the callback's :class:`~nbkit.progress.Workers`); Stop cancels the
outstanding parts and keeps every finished one.

Example:
    >>> import torch, tempfile
    >>> import nbkit
    >>> from nbkit.widgets.panel import WarmupPanel
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8.0)), tempfile.mkdtemp())
    >>> panel = WarmupPanel(ds)
    >>> panel.run("warmup").computed
    8
    >>> panel.state.value
    'done'
"""

from __future__ import annotations

import html
import os
import re
import sys
import threading
import time

from nbkit.progress import Callback, Job, JobState, TextProgress, WorkerRate, Workers
from nbkit.stores.mirror import cache_dir
from nbkit.text import Table, format_amount, format_bytes, format_count, format_rate, format_seconds, say, speaking_to

from .poll import wait_until, why_not_live
from .view import AMBER, GREEN, GREY, RED, RENDER_INTERVAL, View, in_kernel, ipywidgets as _w, status_html, units_html

__all__ = ["WarmupPanel", "PanelState", "OPERATIONS", "disk_text", "workers_html", "settled_workers"]

#: What the panel's buttons run; :meth:`WarmupPanel.run` and :meth:`WarmupPanel.error` take one of these.
OPERATIONS = ("warmup", "export", "upload")

#: What a :class:`WarmupPanel` is doing: the state of its last job (``READY`` before the first one).
PanelState = JobState


class _PanelProgress(Callback):
    """The callback a panel job hands to the engine; it only asks the panel to redraw (throttled)."""

    def __init__(self, panel: "WarmupPanel", phase: str, unit: str, value=0):
        super().__init__(phase=phase, unit=unit, value=value)
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
            self._text.started = self.started  # the phase's clock, not this line's: a first rate is not samples/ms
        self._text.size, self._text.value, self._text.description = self.size, self.value, self.description
        self._text.workers = self.workers
        self._text.call()

    def close(self):
        super().close()
        if self._text is not None:
            self._text.close()


class WarmupPanel(View):
    """A click-through panel for one cache: warm it up, stop, resume, export a tar, upload.

    Warm up runs ``ds.warmup`` in a background :class:`~nbkit.progress.Job`, so the notebook stays
    usable; **Stop** asks it to end after the current chunk and a later **Warm up** resumes with
    the samples still missing. **Export tar** calls :func:`nbkit.export_tar` with the path in
    ``tar_field``; **Upload** calls :func:`nbkit.push` with the ``gs://…`` URL in ``url_field``.
    Each operation keeps its own outcome (:attr:`warmup_report`, :attr:`export_report`,
    :attr:`upload_report`, :meth:`error`), so a cell that waits for one never sees another's.
    A notebook cell calls :meth:`run` (click if needed, wait, raise, return the report); while it
    waits, the panel's buttons still work (Stop included). Nothing here writes to the cache.

    Args:
        ds: the :class:`nbkit.CachedDataset` to show.
        num_workers: worker processes for warmup (0 = in this process).
        engine: build the cache with this :class:`nbkit.cluster.engine.Engine` instead (local processes,
            a Ray or Dask cluster: :func:`nbkit.cluster.engine.engine_for`); the panel then shows each
            worker's rate and the slowest. The caller closes it.
        part_size: samples per part of an ``engine`` build.
        tar_path: initial value of the Export tar field.
        upload_url: initial value of the Upload field, e.g. ``"gs://my-bucket/mnist-cache"``.
        storage_options: passed to :func:`nbkit.push` (e.g. ``{"token": "anon"}``).

    Attributes:
        state: a :class:`PanelState`: that of the operation last started or refused.
        job: the last :class:`~nbkit.progress.Job`, or ``None``.

    Example:
        >>> import torch, tempfile
        >>> import nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(6, 2)), tempfile.mkdtemp())
        >>> panel = WarmupPanel(ds, tar_path=tempfile.mkdtemp() + "/cache.tar")
        >>> panel.run("warmup").computed, panel.run("export").stopped
        (6, False)
        >>> panel.upload("")  # refused: no URL; the error is the upload's, not the warmup's
        >>> panel.error("upload").__class__.__name__, panel.error("warmup")
        ('ValueError', None)
    """

    def __init__(self, ds, *, num_workers: int = 0, engine=None, part_size: int | None = None, tar_path: str = "",
                 upload_url: str = "", storage_options=None):
        self.ds = ds
        self.num_workers = num_workers
        self.engine = engine
        self.part_size = part_size
        self.storage_options = dict(storage_options or {})
        self.job = None
        self._jobs = {}  # operation -> its last Job
        self._refused = {}  # operation -> the error of a click refused before any job started
        self._last = None  # the operation last started or refused
        self._stats_at_start = None  # the cache's stats when the running transfer started
        self.terminal = not in_kernel()
        # Serialises what the Stop button (kernel thread) and a job's end (its thread) draw.
        self._lock = threading.RLock()

        # Layouts flex rather than fixed widths, so the panel fits a phone or Colab's side panel
        # (rows wrap) and no button label is ever cut. Only Layout attributes ipywidgets 7.7.1 has.
        def button_layout(label_em):
            return _w.Layout(width="auto", min_width=f"{label_em}em", flex="0 0 auto")

        self.warmup_button = _w.Button(description="Warm up", button_style="primary", icon="play", layout=button_layout(8))
        self.stop_button = _w.Button(description="Stop", button_style="warning", icon="stop", layout=button_layout(6))
        self.stop_button.disabled = True
        self.export_button = _w.Button(description="Export tar", icon="archive", layout=button_layout(8.5))
        self.upload_button = _w.Button(description="Upload", icon="upload", layout=button_layout(8.5))
        self.tar_field = _w.Text(value=tar_path, placeholder="/content/my-cache.tar", layout=self._field_layout())
        self.url_field = _w.Text(value=upload_url, placeholder="gs://my-bucket/my-cache", layout=self._field_layout())
        self.progress = _w.FloatProgress(
            value=0.0, min=0.0, max=1.0, description="Cache", style={"description_width": "4em"},
            layout=_w.Layout(width="auto", flex="1 1 12em", min_width="8em"),
        )
        self.percent_label = _w.Label(value="0%", layout=_w.Layout(min_width="3.5em", flex="0 0 auto"))
        # What the line under the bar says, one unit each ("512/3,000 samples", "1,200 samples/s", ...).
        self._counts = ()
        self._shown_workers = None  # the Workers snapshot the table shows
        self.counters = _w.HTML(layout=_w.Layout(width="auto"))
        self.workers_table = _w.HTML(layout=_w.Layout(width="auto"))  # workers_html(): a build's workers, else empty
        self.status = _w.HTML(layout=_w.Layout(width="auto"))
        self.title = _w.HTML(layout=_w.Layout(width="auto"))
        self.disk_label = _w.HTML(layout=_w.Layout(width="auto"))  # disk_text(): size on disk, where copies live

        self.warmup_button.on_click(lambda _: self.warmup())
        self.stop_button.on_click(lambda _: self.stop())
        self.export_button.on_click(lambda _: self.export())
        self.upload_button.on_click(lambda _: self.upload())

        def row(*children):
            return _w.HBox(list(children), layout=_w.Layout(flex_flow="row wrap", align_items="center", width="100%"))

        def caption(text):
            return _w.Label(value=text, layout=_w.Layout(min_width="5.5em", flex="0 0 auto"))

        # The bar and its percent wrap as one unit: a percent never sits alone on a line.
        bar = _w.HBox([self.progress, self.percent_label],
                      layout=_w.Layout(flex_flow="row nowrap", align_items="center", flex="1 1 14em", min_width="12em"))
        self.widget = _w.VBox(
            [
                self.title,
                row(self.warmup_button, self.stop_button, bar),
                self.counters,
                self.workers_table,
                row(caption("Tar file"), self.tar_field, self.export_button),
                row(caption("Upload to"), self.url_field, self.upload_button),
                self.status,
                self.disk_label,
            ],
            layout=_w.Layout(width="100%", max_width="56em"),
        )
        self._show_cache_state()

    @staticmethod
    def _field_layout():
        return _w.Layout(width="auto", flex="1 1 14em", min_width="8em")

    # -- what each operation says -----------------------------------------------------------------

    @property
    def state(self) -> PanelState:
        if self._last is None:
            return PanelState.READY
        if self._last in self._refused:
            return PanelState.ERROR
        return self._jobs[self._last].state

    def error(self, operation: str):
        """The exception that ended ``operation``'s last run (``"warmup"``, ``"export"``, ``"upload"``),
        or refused its last click (e.g. an empty Upload URL); ``None`` if it did not fail."""
        _check_operation(operation)
        if operation in self._refused:
            return self._refused[operation]
        job = self._jobs.get(operation)
        return job.error if job is not None else None

    def stopped(self, operation: str) -> bool:
        """Whether ``operation``'s last run (``"warmup"``, ``"export"``, ``"upload"``) ended by a Stop:
        what a notebook's later cells ask before using its result (a tar a stopped export never wrote)."""
        _check_operation(operation)
        job = self._jobs.get(operation)
        return job is not None and job.state is JobState.STOPPED and operation not in self._refused

    @property
    def warmup_report(self):
        """The last warmup's :class:`~nbkit.cluster.report.WarmupReport`, or ``None`` before one ended."""
        return self._report("warmup")

    @property
    def export_report(self):
        """The last export's :class:`~nbkit.transfer.TransferReport`, or ``None``."""
        return self._report("export")

    @property
    def upload_report(self):
        """The last upload's :class:`~nbkit.transfer.TransferReport`, or ``None``."""
        return self._report("upload")

    @property
    def last_error(self):
        """The error of the operation last started or refused (prefer :meth:`error`, which names it)."""
        return self.error(self._last) if self._last is not None else None

    @property
    def report(self):
        """What the last job returned, whichever it was (prefer :attr:`warmup_report` and the others)."""
        return self.job.report if self.job is not None else None

    @property
    def running(self) -> bool:
        """True while a background operation runs."""
        return self.job is not None and self.job.running

    def _report(self, operation):
        job = self._jobs.get(operation)
        return job.report if job is not None else None

    # -- what the buttons do ------------------------------------------------------------------

    def warmup(self) -> None:
        """Start (or resume) filling the cache in the background; same as clicking **Warm up**."""
        reason = self._warmup_unavailable(self.ds.stats)
        if reason:
            self._set_status(reason, GREY)
            return
        stats = self.ds.stats
        self._start("warmup", "samples", self._fill, value=int(stats.cached))

    def _fill(self, cb):
        """What Warm up runs: a warmup in this process or its workers, or a build on :attr:`engine`."""
        if self.engine is None:
            return self.ds.warmup(num_workers=self.num_workers, callback=cb)
        from nbkit.cluster import run  # imported when first used

        sizes = {} if self.part_size is None else {"part_size": self.part_size}
        return run(self.ds, self.engine, callback=cb, **sizes)

    def stop(self) -> None:
        """Ask the running operation to stop after its current chunk; same as clicking **Stop**."""
        with self._lock:
            if self.job is None or self.job.state is not JobState.RUNNING or not self.job.stop():
                return
            self.stop_button.disabled = True
            if self.job.name == "warmup" and self.engine is not None:
                self._set_status("Stopping: cancelling the parts not yet built; every finished part is kept…", GREY)
            else:
                self._set_status("Stopping after the current chunk…", GREY)

    def export(self, path: str | None = None) -> None:
        """Write the cache to a tar file (``tar_field``, or ``path``); same as **Export tar**."""
        if path is not None:
            self.tar_field.value = path
        path = self.tar_field.value.strip()
        if not path:
            self._refuse("export", ValueError("Export needs a destination: type a tar path, e.g. /content/my-cache.tar"))
            return

        def run(cb):
            from nbkit.transfer.archive import export_tar  # imported when first used

            return export_tar(self.ds.root, path, callback=cb)

        self._start("export", "bytes", run, done=lambda cb: (f"Exported {format_bytes(cb.value)} to {path}", "export"))

    def upload(self, url: str | None = None) -> None:
        """Copy the cache to a URL (``url_field``, or ``url``), e.g. ``gs://bucket/prefix``; same as **Upload**."""
        if url is not None:
            self.url_field.value = url
        url = self.url_field.value.strip()
        if "://" not in url:
            self._refuse("upload", ValueError(f"Upload needs a URL like gs://my-bucket/my-cache, got {url!r}"))
            return

        def run(cb):
            from nbkit.transfer import push  # imported when first used

            return push(self.ds.root, url, callback=cb, storage_options=self.storage_options)

        self._start("upload", "bytes", run, done=lambda cb: (f"Uploaded {format_bytes(cb.value)} to {url}", "upload"))

    def run(self, operation: str, timeout: float | None = None):
        """Make sure ``operation`` has run, as a notebook cell wants: press its button unless that is
        running or has nothing to do, wait for it (Stop still works meanwhile), raise its own error,
        and return its report.

        ``"warmup"`` does nothing when the cache is complete and resumes a stopped warmup;
        ``"export"`` keeps a tar that already holds the cache as it is now (see
        :func:`nbkit.transfer.archive.stale_tar_reason`) and writes it again otherwise (partial, or from an
        earlier state of the cache, whichever session made it); ``"upload"`` pushes (only the
        files the destination lacks).

        A Stop (the panel's button) ends the wait without an error: the cell prints the panel's
        sentence (what was kept, and that **Warm up** resumes) and returns the report, whose
        ``stopped`` is then true (``None`` for a transfer stopped before it reported).

        Raises:
            ValueError: the operation cannot start (no tar path, no URL, a cache without source to warm).
            TimeoutError: it did not end within ``timeout`` seconds (it goes on in the background).
            Exception: whatever the operation itself raised (e.g. ``OSError`` for an unwritable path).
        """
        _check_operation(operation)
        if self.running and self.job.name != operation and not self.wait(timeout):
            raise TimeoutError(f"the {self.job.name} still runs after {timeout} s; wait for it or click Stop, then run this again")
        if not (self.running and self.job.name == operation):
            if not self._press(operation):
                return self._report(operation)
        if not self.wait(timeout):
            raise TimeoutError(f"the {operation} did not end within {timeout} s; it goes on in the background (click Stop to end it)")
        error = self.error(operation)
        if error is not None:
            raise error
        job = self._jobs[operation]
        if job.state is JobState.STOPPED:
            # A Stop is an outcome the user chose, not a failure: the cell ends without a traceback
            # (Run All goes on) and says, in the panel's own words, what was kept and how to resume.
            if not self.terminal:  # a terminal already got the panel's line (on stderr)
                say(self._stopped_status(job))
        return job.report

    def _press(self, operation: str) -> bool:
        """Click ``operation``'s button for :meth:`run`; False when there is nothing to do."""
        if operation == "warmup":
            stats = self.ds.stats
            if stats.complete:
                return False
            reason = self._warmup_unavailable(stats)
            if reason:
                self._refuse("warmup", ValueError(f"{reason} {format_count(stats.total - stats.cached)} samples are missing."))
            else:
                self.warmup()
        elif operation == "export":
            path = self.tar_field.value.strip()
            if path:
                from nbkit.transfer.archive import stale_tar_reason  # imported when first used

                if stale_tar_reason(path, self.ds.root) is None:
                    self._refused.pop("export", None)
                    self._set_status(f"{path} already holds this cache as it is now; not exported again.", GREEN, bold=True)
                    return False
            self.export()
        else:
            self.upload()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the background operation ends; False on timeout. In a notebook, the panel's
        buttons keep working meanwhile (a Stop click is handled at once, even during Run All);
        interrupting the kernel stops the operation too."""
        job = self.job
        if job is None or not job.running:
            return job is None or job.wait(timeout)
        cannot = why_not_live() if not self.terminal else ""
        if cannot:
            with self._lock:
                if job.running:
                    self.stop_button.disabled = True
                    self.stop_button.tooltip = (f"Stop cannot act while a cell waits: {cannot}. "
                                                "Interrupt the kernel (■) to stop.")
        try:
            return wait_until(lambda: job.wait(0), timeout, sleep=job.wait)
        except KeyboardInterrupt:
            self.stop()  # an interrupted cell should not leave the operation running behind it
            raise
        finally:
            if cannot:
                with self._lock:
                    if job.state is JobState.RUNNING:
                        self.stop_button.disabled = False
                        self.stop_button.tooltip = ""

    def close(self) -> None:
        """Stop any running operation and close the widgets."""
        self.stop()
        self.wait(timeout=30)
        self.widget.close()

    # -- display --------------------------------------------------------------------------------

    def text(self) -> str:
        """The panel as one line of text (what a terminal shows)."""
        counts = self.counts if self.running else self.counts[:1]  # an idle status says what is stored
        return "nbkit: " + "  ".join(p for p in (*counts, self.status_text()) if p)

    @property
    def counts(self) -> tuple:
        """What the line under the bar says, one unit each: a running operation's progress, rate and
        time left; else how full the cache is and what it stores."""
        return self._counts

    def status_text(self) -> str:
        """The status line without markup (an error's details, one click away in the widget, left out)."""
        shown = re.sub(r"<details\b.*?</details>", "", self.status.value, flags=re.S)
        return html.unescape(re.sub(r"<[^>]+>", "", shown.replace("<br>", " ")))

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
        fill = f"<span style='color:{GREEN}'>complete</span>" if stats.complete else f"{format_count(stats.cached)} cached"
        path = html.escape(str(getattr(self.ds, "path", "")))
        # Only a path too long for the line breaks inside itself; the counts wrap as whole units.
        self.title.value = units_html(
            [f"<b>nbkit cache</b> <code style='overflow-wrap:anywhere'>{path}</code>",
             f"{format_count(stats.total)} samples", fill],
            path_first=True,
        )

    def _show_counts(self, *units: str) -> None:
        self._counts = tuple(u for u in units if u)
        self.counters.value = units_html([html.escape(u) for u in self._counts], color=GREY)

    def _show_fill(self, stats) -> None:
        """The bar as the cache's fill, and the counts line as what the cache holds."""
        total = int(stats.total)
        self.progress.description = "Cache"
        self.progress.value = (stats.cached / total) if total else 1.0
        self.percent_label.value = f"{_floor_percent(stats.cached, total)}%"
        self._show_counts(f"{format_count(stats.cached)}/{format_count(total)} samples", f"{format_bytes(stats.bytes)} of sample data")

    def _show_idle(self, stats, ended: Job | None = None) -> None:
        """Nothing runs: buttons on, the bar and counts show the cache (not the last operation, whose
        outcome is the status line's)."""
        self._finish_buttons(stats)
        self._show_fill(stats)
        if stats.complete:
            self.progress.bar_style = "success"
        elif ended is not None and ended.name == "warmup" and ended.error is not None:
            self.progress.bar_style = "danger"
        else:  # partial after an operation (a stopped warmup, a partial export): amber, never green
            self.progress.bar_style = "warning" if ended is not None else ""

    def _show_cache_state(self) -> None:
        """The panel before its first operation: how full the cache is and what Warm up would do."""
        stats = self.ds.stats
        self._show_idle(stats)
        total = int(stats.total)
        if stats.complete:
            self._set_status(f"Cache complete: {format_count(total)} samples, {format_bytes(stats.bytes)} of sample data.", GREEN, bold=True)
        elif self.ds.source is None:
            self._set_status(f"{_partial_text(stats)} {self._warmup_unavailable(stats)}", AMBER)
        else:
            missing = format_count(total - int(stats.cached))
            self._set_status(f"Ready: {missing} of {format_count(total)} samples to compute. Click Warm up.")

    def _stopped_status(self, job: Job) -> str:
        """What a stopped operation left and the one way to resume it: the panel's status line and
        what :meth:`run` prints, word for word."""
        if job.name == "warmup":
            stats = self.ds.stats
            return (f"The warmup stopped at {format_count(stats.cached)} of {format_count(stats.total)} samples, "
                    "every one kept in the cache. Click Warm up to resume.")
        where = self.tar_field.value.strip() if job.name == "export" else self.url_field.value.strip()
        return (f"The {job.name} stopped before it finished: {where} holds no complete copy. "
                f"Click {_BUTTON[job.name]} to start it again.")

    def _start(self, name: str, unit: str, fn, *, done=None, value=0) -> None:
        with self._lock:
            if self.running:
                self._set_status(f"Busy: wait for the current {self.job.name} to finish, or click Stop.", GREY)
                return
            self._refused.pop(name, None)
            self._last = name
            stats = self.ds.stats
            self._stats_at_start = stats
            for b in (self.warmup_button, self.export_button, self.upload_button):
                b.disabled = True
            self.stop_button.disabled = False
            self.stop_button.tooltip = ""
            self.progress.bar_style = "info"
            self.workers_table.value = ""  # the last build's workers are not this operation's
            self._shown_workers = None
            if name == "warmup":  # resume from the cached fraction, never from 0%
                self._show_fill(stats)
                self._show_counts(self._counts[0], f"– {unit}/s", "ETA –", self._counts[1])
            else:  # the bar, labelled so, now measures this transfer, not how full the cache is
                self.progress.description = name.capitalize()
                self.progress.value = 0.0
                self.percent_label.value = "0%"
                self._show_counts(f"– {unit}/s", "ETA –")
            self._set_status(_RUNNING[name] + "…", GREY)
            def in_panel(cb, fn=fn):
                with speaking_to("panel"):  # in the job's thread: a fix names the button ("click Upload again")
                    return fn(cb)

            self.job = Job(name, in_panel, callback=_PanelProgress(self, name, unit, value=value),
                           on_end=lambda job: self._show_end(job, done))
            self._jobs[name] = self.job
            self.job.start()

    def _show_end(self, job: Job, done) -> None:
        with self._lock:
            cb, stats = job.callback, self.ds.stats
            self._show_workers(settled_workers(cb.workers, job.report))  # as the build left them, counts matching the cache
            if job.error is not None:
                self._show_error(job.error)
                self._show_idle(stats, ended=job)
                return
            self._show_idle(stats, ended=job)
            if job.state is JobState.STOPPED:
                self._set_status(self._stopped_status(job), GREY, bold=True)
            elif job.name == "warmup":
                seconds = getattr(job.report, "seconds", cb.elapsed())
                computed = getattr(job.report, "computed", cb.moved)
                rate = f", {format_rate(computed / seconds, 'samples')}" if computed and seconds > 0 else ""
                self._set_status(
                    f"Cache complete: {format_count(stats.total)} samples, {format_bytes(stats.bytes)} of sample data "
                    f"({format_count(computed)} computed in {format_seconds(seconds)}{rate}).",
                    GREEN, bold=True,
                )
            else:
                text, verb = done(cb)
                copied = self._stats_at_start or stats
                if copied.complete:
                    self._set_status(text + ".", GREEN, bold=True)
                else:
                    # The copy is only as full as the cache was: say so, in amber, never as a plain success.
                    fix = ("Warm up, then " + verb + " again." if self.ds.source is not None
                           else "This cache has no source to fill it.")
                    self._set_status(
                        f"{text} — partial: {_floor_percent(copied.cached, copied.total)}% of samples cached "
                        f"({format_count(copied.cached)} of {format_count(copied.total)}). {fix}",
                        AMBER, bold=True,
                    )
        if self.terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _refuse(self, operation: str, error: BaseException) -> None:
        """A click refused before any job started: its error is that operation's; the bar (which
        shows another operation, or the cache) is left as it is, the status line says it."""
        with self._lock:
            self._refused[operation] = error
            self._last = operation
            self.status.value = error_html(error)
        if self.terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _show_error(self, error: BaseException) -> None:
        with self._lock:
            self.progress.bar_style = "danger"
            self._finish_buttons(self.ds.stats)
            self.status.value = error_html(error)
        if self.terminal:
            print(self.text(), file=sys.stderr, flush=True)

    def _finish_buttons(self, stats) -> None:
        """Buttons and title for a panel with nothing running."""
        self.stop_button.disabled = True
        self.stop_button.tooltip = ""
        self.export_button.disabled = False
        self.upload_button.disabled = False
        unavailable = self._warmup_unavailable(stats)
        self.warmup_button.disabled = bool(unavailable)
        self.warmup_button.tooltip = unavailable
        self.disk_label.value = status_html(disk_text(self.ds, stats))
        self._show_title(stats)

    def _render_progress(self, cb: Callback) -> None:
        job = self.job
        if job is None or job.callback is not cb or job.state not in (JobState.RUNNING, JobState.STOPPING):
            return  # a late redraw: the panel already shows how the operation ended
        size, value, unit = cb.size, cb.value, cb.unit
        suffix = "" if unit == "bytes" else f" {unit}"
        if size:
            self.progress.value = min(value / size, 1.0)
            self.percent_label.value = f"{_floor_percent(value, size)}%"
            done = f"{format_amount(value, unit)}/{format_amount(size, unit)}{suffix}"
        else:
            done = f"{format_amount(value, unit)}{suffix}"
        rate, eta = cb.rate(), cb.eta()
        live = (format_rate(rate, unit) if rate else f"0 {unit}/s", f"ETA {format_seconds(eta)}" if eta is not None else "ETA –")
        self._show_workers(cb.workers)
        if cb.phase == "warmup":
            stats = self.ds.stats
            self._show_counts(done, *live, f"{format_bytes(stats.bytes)} of sample data")
            self._show_title(stats)
        else:
            self._show_counts(done, *live)
        if job.state is JobState.RUNNING and cb.description and cb.description not in _ENDED:
            # The engine's words for what it does now ("warming up", "hashing", "pushing to gs://…").
            self._set_status(f"{cb.description[:1].upper()}{cb.description[1:]}…", GREY)

    def _set_status(self, text: str, color: str = GREY, *, bold: bool = False) -> None:
        self.status.value = status_html(text, color, bold=bold)

    def _show_workers(self, workers: Workers | None) -> None:
        if workers is not None and workers is not self._shown_workers:  # a new snapshot only
            self._shown_workers = workers
            self.workers_table.value = workers_html(workers)


#: The workers table shows at most this many rows, the slowest first; the rest are counted under it.
WORKER_ROWS = 6


def workers_html(workers: Workers, *, rows: int = WORKER_ROWS) -> str:
    """A build's workers as a compact HTML table under the bar: parts done of all and the slowest on
    one line, then one row a worker (slowest first, at most ``rows``; the slowest in amber) with its
    parts, samples and rate.

    Example:
        >>> w = Workers(parts_total=4).record("a:1", 100, 1.0).record("b:2", 100, 4.0)
        >>> table = workers_html(w)
        >>> table.count("<tr"), table.index(">b:2<") < table.index(">a:1<")  # a header, then the slowest first
        (3, True)
    """
    ranked = sorted(workers.rows, key=lambda r: (r.seconds <= 0, r.rate))  # slowest first; those yet to finish a part last
    slowest = workers.slowest
    shown = ranked[:rows]
    table = Table([(r.worker, format_count(r.parts), format_count(r.samples), f"{format_count(r.rate)}/s" if r.seconds > 0 else "–")
                   for r in shown],
                  header=("worker", "parts", "samples", "rate"), align="lrrr",
                  notes=[f"… and {len(ranked) - rows} more"] if len(ranked) > rows else ())
    styles = [f"color:{AMBER}" if slowest is not None and r is slowest else "" for r in shown]
    summary = status_html(workers.text())
    body = table.html(style="border-collapse:collapse;font-size:90%", cell_style="padding:0 0.8em 0 0", row_styles=styles,
                      note_style=f"margin:0;padding-left:1.2em;color:{GREY}") if shown else ""
    return f"<div style='overflow-x:auto;max-width:100%'>{summary}{body}</div>"


#: The row of a workers table for parts merged when the build ended (a Stop merges the parts that
#: were finished but not yet merged; which worker built them is not reported).
MERGED_AT_END = "merged at the end"


def settled_workers(workers: Workers | None, report) -> Workers | None:
    """The workers snapshot a finished build leaves, made to agree with its report: parts done are
    the parts merged, no part is out, and the samples of parts merged without a worker's report (a
    Stop merges the finished parts it finds) show in a row of their own, so the rows add up to the
    samples computed. ``workers`` as it is when there is no build report.

    Example:
        >>> from nbkit.cluster.report import BuildReport
        >>> w = Workers(parts_total=4).record("a:1", 100, 1.0).out(2, 3.0)
        >>> end = settled_workers(w, BuildReport(computed=300, skipped=0, total=400, seconds=2.0, stopped=True, parts=3))
        >>> end.text(), [(r.worker, r.parts, r.samples) for r in end.rows]
        ('parts 3/4 · 2 workers', [('a:1', 1, 100), ('merged at the end', 2, 200)])
    """
    parts, computed = getattr(report, "parts", None), getattr(report, "computed", None)
    if workers is None or parts is None or computed is None:
        return workers
    rows = workers.rows
    shown_parts = sum(r.parts for r in rows)
    shown_samples = sum(r.samples for r in rows)
    reused = max(0, workers.parts_done - shown_parts)  # parts merged from an earlier build, before any was built
    unreported = parts - reused - shown_parts
    if computed > shown_samples and unreported > 0:
        rows = rows + (WorkerRate(MERGED_AT_END, unreported, computed - shown_samples, 0.0),)
    return Workers(parts_done=parts, parts_total=max(workers.parts_total, parts), rows=rows)


#: An error in the panel: at most this many lines of at most this many characters; the rest is in "details".
ERROR_LINES, ERROR_LINE_CHARS = 3, 160
#: The "details" control of an error: a disclosure triangle and a dotted underline in any front end.
SUMMARY_STYLE = "cursor:pointer;display:list-item;list-style-position:inside;text-decoration:underline dotted"


def error_html(error: BaseException) -> str:
    """The status HTML for an operation that failed: its type and message's first lines (at most
    :data:`ERROR_LINES`, each cut at :data:`ERROR_LINE_CHARS`) in bold red, then, when anything was
    left out, a "details" disclosure with the whole message and its causes' (no traceback).

    Example:
        >>> print(error_html(ValueError("no bucket in the URL 'gs://'")))
        <span style="color:#c62828;font-weight:bold">Error: ValueError: no bucket in the URL &#x27;gs://&#x27;</span>
    """
    causes, cause = [], error.__cause__ or (None if error.__suppress_context__ else error.__context__)
    while cause is not None and len(causes) < 5:
        causes.append(f"caused by {type(cause).__name__}: {cause}")
        cause = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()] or [type(error).__name__]
    shown = [_cut(ln, ERROR_LINE_CHARS) for ln in lines[:ERROR_LINES]]
    out = f'<span style="color:{RED};font-weight:bold">{"<br>".join(html.escape(ln) for ln in [f"Error: {type(error).__name__}: {shown[0]}"] + shown[1:])}</span>'
    if causes or shown != lines:
        full = "\n\n".join([f"{type(error).__name__}: {error}"] + causes)
        # An explicit list-item summary: the disclosure triangle (▸, ▾ once open) shows in every front
        # end, also where a stylesheet makes summaries blocks without one (the classic Notebook's, for
        # ipywidgets 7); underlined, so it reads as something to click.
        out += (f'<details style="color:{GREY}"><summary style="{SUMMARY_STYLE}">details</summary>'
                f'<pre style="white-space:pre-wrap;overflow-wrap:anywhere;margin:0">{html.escape(full)}</pre></details>')
    return out


def _cut(line: str, n: int) -> str:
    """``line`` cut to at most ``n`` characters at a word boundary, with "…" when cut."""
    if len(line) <= n:
        return line
    head = line[: n - 1]
    return (head.rsplit(" ", 1)[0] if " " in head[n // 2:] else head) + "…"


def disk_text(ds, stats) -> str:
    """Where the panel's cache lives and what it takes on disk, and where working copies live.
    Paths are shown as the user gave them (a local cache) or under ``~`` (a working copy), so a
    narrow screen wraps the line between words.

    Example:
        >>> import torch, tempfile, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tempfile.mkdtemp())
        >>> disk_text(ds, ds.stats).startswith(nbkit.text.format_bytes(ds.stats.disk_bytes) + " reserved on disk (sample")
        True
        >>> ds.warmup().computed, disk_text(ds, ds.stats).startswith(nbkit.text.format_bytes(ds.stats.disk_bytes) + " on disk (sample")
        (8, True)
    """
    root = str(getattr(ds, "root", ""))
    if os.path.dirname(root) == cache_dir():
        where = f"in the working copy {_home_short(root)}"
    else:
        where = f"in {os.fspath(getattr(ds, 'path', None) or root)}"
    if stats.disk_bytes is None:
        size = ""
    elif not stats.complete and stats.disk_bytes > stats.bytes:
        # The column files are allocated whole when the cache is made: their size on disk is the
        # full cache's from the start, not what is stored yet (the counts line says that).
        size = (f"{format_bytes(stats.disk_bytes)} reserved on disk (sample data, index and metadata) {where}, "
                "allocated for the whole cache up front. ")
    else:
        size = f"{format_bytes(stats.disk_bytes)} on disk (sample data, index and metadata) {where}. "
    return (f"{size}Working copies of remote caches live in {_home_short(cache_dir())} ($NBKIT_CACHE_DIR): "
            "nbkit ls lists every cache, nbkit rm and nbkit prune free the space.")


def _home_short(path: str) -> str:
    """``path`` with the home directory written ``~``."""
    home = os.path.expanduser("~").rstrip(os.sep)
    return "~" + path[len(home):] if home and (path == home or path.startswith(home + os.sep)) else path


#: What the status line says while an operation starts, and each operation's button.
_RUNNING = {"warmup": "Warming up", "export": "Exporting", "upload": "Uploading"}
_BUTTON = {"warmup": "Warm up", "export": "Export tar", "upload": "Upload"}
#: The engine's descriptions of an operation that has ended (the status then says how it ended).
_ENDED = frozenset({"done", "stopped", "already complete", "up to date", "exported", "pushed", "pulled", "imported"})


def _partial_text(stats) -> str:
    """What a partly filled cache holds, plainly, for where it is opened.

    Example:
        >>> from types import SimpleNamespace
        >>> _partial_text(SimpleNamespace(total=60000, cached=10240))
        'This cache holds 10,240 of 60,000 samples; training will stop at the first missing one.'
    """
    return (f"This cache holds {format_count(stats.cached)} of {format_count(stats.total)} samples; "
            "training will stop at the first missing one.")


def _floor_percent(done, total) -> int:
    """Whole percent, rounded down: 99.6% of a cache is not "100%"."""
    return int(100 * done // total) if total else 100


def _check_operation(operation: str) -> None:
    if operation not in OPERATIONS:
        raise ValueError(f"unknown panel operation {operation!r}; use one of {', '.join(OPERATIONS)}")
