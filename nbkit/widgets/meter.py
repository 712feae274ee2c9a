"""The hit-rate meter: the cache's hit rate this epoch and overall, live, while a training loop runs.

A view: the per-epoch accounting is :class:`nbkit.stats.EpochCounter` (the samples the training
loop received, their hits and misses, from the loader or from ``ds.stats``, whose counters include
reads in DataLoader worker processes); the meter only draws it, at most every ``min_interval``
seconds, as a widget in a kernel or as text lines anywhere else.

Example:
    >>> import tempfile, torch, nbkit
    >>> from nbkit.widgets.meter import HitRateMeter
    >>> cache = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8.0)), tempfile.mkdtemp())
    >>> meter = HitRateMeter(cache)
    >>> for batch in meter.track(torch.utils.data.DataLoader(cache, batch_size=4)):
    ...     pass
    >>> meter.epochs[-1].hit_rate, meter.epochs[-1].misses
    (0.0, 8)
"""

from __future__ import annotations

import sys
import time

from nbkit.stats import EpochCounter, EpochStats
from nbkit.text import Table, format_count, format_percent, format_seconds

from .view import GREY, View, in_kernel, ipywidgets as _w, units_html

__all__ = ["HitRateMeter"]


def _pct(e: EpochStats) -> str:
    return format_percent(e.hit_rate if e.reads else None)  # "–" before the first read


class HitRateMeter(View):
    """Live cache hit rate, this epoch and overall, while a training loop runs.

    Wrap a loader with :meth:`track` to count each pass over it as an epoch of the samples the
    loop received (a batch the loader read ahead but the loop never got is not counted), or call
    :meth:`update` and :meth:`new_epoch` yourself to count every read of ``ds.stats`` (whose
    counters include reads done in DataLoader worker processes). It redraws at most every
    ``min_interval`` seconds, so :meth:`update` is cheap enough to call per batch. A table shows
    every epoch, the first (filling) epoch apart from the later ones served from the cache, and
    marks an epoch cut short (``break``, ``steps=``) with the batches it got.

    Args:
        ds: the :class:`nbkit.CachedDataset` to watch.
        min_interval: seconds between redraws.
        file: where the terminal fallback writes (default ``sys.stderr``).

    Attributes:
        epochs: one :class:`~nbkit.stats.EpochStats` per epoch (``samples``, ``hits``, ``misses``,
            ``cut_short`` …); the last one is the current epoch.
        counter: the :class:`~nbkit.stats.EpochCounter` doing the accounting.

    Example:
        >>> import torch, tempfile
        >>> import nbkit
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
        self.terminal = not in_kernel()
        self._tty = bool(getattr(file if file is not None else sys.stderr, "isatty", lambda: False)())
        self._last_render = float("-inf")
        self._last_print = float("-inf")
        self._final_printed = 0
        self.renders = 0  # how many times the view was redrawn (throttling is observable)
        self.counter = EpochCounter(ds)

        self.headline = _w.HTML()
        # Narrow screens (a phone, Colab's side panel): the bar shrinks and wraps under the headline,
        # the counts line wraps (an HTML, where a Label would clip it), and the table turns into one
        # line of whole units per epoch where its columns would not fit (_TABLE_CSS). No scroller:
        # one without a visible scrollbar hides columns.
        self.rate_bar = _w.FloatProgress(value=0.0, min=0.0, max=1.0,
                                         layout=_w.Layout(width="auto", flex="0 1 300px", min_width="6em"))
        self.counts_label = _w.HTML()
        # As wide as the meter (its margin taken off), so that the table's container query sees that width.
        self.table = _w.HTML(layout=_w.Layout(width="100%", margin="0"))
        self.widget = _w.VBox([_w.HBox([self.headline, self.rate_bar], layout=_w.Layout(flex_flow="row wrap")),
                               self.counts_label, self.table], layout=_w.Layout(max_width="100%"))
        self._render(time.perf_counter())

    @property
    def epochs(self) -> list:
        return self.counter.epochs

    @property
    def current(self) -> EpochStats:
        """The epoch being counted now."""
        return self.counter.current

    def overall(self) -> EpochStats:
        """Every epoch so far as one :class:`~nbkit.stats.EpochStats` (``epoch=0``): the samples the
        loop received, their hits and misses, and the seconds since the meter was created."""
        return self.counter.overall()

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
        if self.counter.count().reads:
            self._render(now, final=True)  # the finished epoch's last word
        self.counter.new_epoch()
        self._render(now)

    def track(self, loader, steps: int | None = None):
        """Wrap ``loader`` (a DataLoader, an :class:`nbkit.DeviceLoader`): yields its batches,
        updating the view per batch; each pass over the loader is one epoch.

        Args:
            loader: what the training loop iterates.
            steps: ``None``: each iteration of the returned object is one pass. ``N``: one
                iteration yields ``N`` batches over as many passes as that takes (a new epoch per
                pass, the last one cut short); it raises ``RuntimeError`` if a pass yields no batch.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(10, 2)), tempfile.mkdtemp())
            >>> meter = HitRateMeter(ds)
            >>> for (x,) in meter.track(ds.loader(4, drop_last=True), steps=3):
            ...     pass
            >>> [(e.samples, e.cut_short) for e in meter.epochs]
            [(8, False), (4, True)]
        """
        return _Tracked(self, loader, steps)

    def text(self) -> str:
        """The meter as one line of text (what a terminal shows)."""
        cur, tot = self.current, self.overall()
        budget = self._budget()
        if not tot.reads:
            return "nbkit hit rate: no samples read yet" + (f"  [{budget}]" if budget else "")
        cut = f", {_cut(cur)}" if cur.cut_short else ""
        return (
            f"nbkit hit rate: epoch {cur.epoch} {_pct(cur)} ({format_count(cur.hits)} hits, {format_count(cur.misses)} misses, "
            f"{format_count(cur.rate)} samples/s{cut})  overall {_pct(tot)} ({format_count(tot.hits)} hits, "
            f"{format_count(tot.misses)} misses)" + (f"  [{budget}]" if budget else "")
        )

    def _budget(self) -> str:
        # Under a byte budget the hit rate cannot exceed the cached fraction: say so next to it.
        stats = self.counter.last
        if not stats.budgeted:
            return ""
        return (f"budget: {format_count(stats.capacity)} of {format_count(stats.total)} samples cacheable "
                f"({format_percent(stats.capacity / max(stats.total, 1))} max hit rate)")

    def _render(self, now: float, final: bool = False) -> None:
        self.counter.count()
        self._last_render = now
        self.renders += 1
        cur, tot = self.current, self.overall()
        # Two units; the "·" ends the first, so it never starts a line.
        self.headline.value = (
            f"<span style='white-space:nowrap'><b>Hit rate</b> epoch {cur.epoch}: <b>{_pct(cur)}</b> ·</span>"
            f" <span style='color:{GREY};white-space:nowrap'>overall {_pct(tot)}</span>&nbsp;"
        )
        self.rate_bar.value = cur.hit_rate
        self.rate_bar.bar_style = "success" if cur.reads and cur.hit_rate >= 0.999 else "info"
        budget = self._budget()
        self.counts_label.value = units_html(
            [f"hits {format_count(tot.hits)}", f"misses {format_count(tot.misses)}", f"{format_count(cur.rate)} samples/s this epoch"],
            color="",
        ) + (f"<div style='white-space:normal'>{budget}</div>" if budget else "")  # a sentence: it may wrap
        table = self._table().html(
            css_class="nbkit-epochs", style="border-collapse:collapse;font-variant-numeric:tabular-nums;font-size:92%",
            cell_style="padding:1px 4px;white-space:nowrap", column_styles=("",) * 6 + (f"color:{GREY}",),
            note_style=f"margin:4px 0 0 0;padding-left:18px;color:{GREY};white-space:normal;overflow-wrap:break-word",
        )
        self.table.value = f"<style>{_TABLE_CSS}</style><div class='nbkit-epochs-box'>{table}</div>"
        if self.terminal:
            self._print(now, final)

    def _table(self) -> Table:
        # Narrow on purpose (Colab's side panel, a phone: ~470 px of output): short cells that never
        # wrap, and what needs a sentence (an epoch cut short) in notes under the table, which may.
        rows, notes = [], []
        for e in self.epochs:
            if e is self.current and self.counter.running:
                kind = "running"
            elif e.cut_short:
                kind = "cut short"
                notes.append(_cut_note(e))
            else:
                kind = ("filling the cache" if e.filling else "from the cache") if e.reads else ""
            rows.append((e.epoch, format_count(e.samples), format_count(e.hits), format_count(e.misses), _pct(e),
                         format_seconds(e.seconds, digits=2), kind))
        header = ("epoch", "samples", "hits", "misses", "hit rate", "time", "")
        return Table(rows, header, align="rrrrrrl", notes=notes[-3:])

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


#: Where the table's columns do not fit (under 420 px: a phone, Colab's side panel), each epoch is one
#: line of whole units that wraps between them ("epoch 2 · 3,000 samples · … · from the cache"); the
#: header then goes, its words move next to the numbers. A container query: the width that counts is
#: the output area's, not the window's.
_TABLE_CSS = (
    ".nbkit-epochs-box{container-type:inline-size}"
    "@container (max-width: 420px){"
    ".nbkit-epochs,.nbkit-epochs tbody{display:block}.nbkit-epochs thead{display:none}"
    ".nbkit-epochs tr{display:block;margin:0 0 3px 0}"
    ".nbkit-epochs td{display:inline-block;padding:0 0.25em 0 0 !important}"
    ".nbkit-epochs td:nth-child(1)::before{content:'epoch '}"
    ".nbkit-epochs td:nth-child(2)::after{content:' samples \\b7'}"
    ".nbkit-epochs td:nth-child(3)::after{content:' hits \\b7'}"
    ".nbkit-epochs td:nth-child(4)::after{content:' misses \\b7'}"
    ".nbkit-epochs td:nth-child(5)::after{content:' hit rate \\b7'}"
    ".nbkit-epochs td:nth-child(1)::after,.nbkit-epochs td:nth-child(6):not(:last-child)::after{content:' \\b7'}"
    "}"
)


def _cut(e: EpochStats) -> str:
    if e.planned is None:
        return f"cut short after {format_count(e.batches)} batches"
    return f"cut short: {format_count(e.batches)} of {format_count(e.planned)} batches"


def _cut_note(e: EpochStats) -> str:
    note = f"epoch {e.epoch} {_cut(e)}"
    if e.read_ahead and e.reads > e.samples:  # a DataLoader: the cache's reads include its workers' read-ahead
        return note + f"; its hits and misses include {format_count(e.read_ahead)} samples read ahead, never used"
    if e.read_ahead:
        return note + f"; {format_count(e.read_ahead)} samples read ahead were not used"
    return note


class _Tracked:
    """What :meth:`HitRateMeter.track` returns: an iterable of ``steps`` batches, or of one pass."""

    def __init__(self, meter: HitRateMeter, loader, steps: int | None):
        self.meter = meter
        self.loader = loader
        self.steps = steps

    def __len__(self):
        return self.steps if self.steps is not None else len(self.loader)

    def __iter__(self):
        meter = self.meter
        meter.new_epoch()  # closes (and prints) an epoch of reads made before tracking started
        batches = meter.counter.track(self.loader, steps=self.steps, on_batch=meter.update,
                                      on_pass_end=lambda: meter._render(time.perf_counter(), final=True))
        meter._render(time.perf_counter())
        return batches
