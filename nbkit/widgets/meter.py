"""The hit-rate meter: the cache's hit rate this epoch and overall, live, while a training loop runs.

A view: the per-epoch accounting is :class:`nbkit.stats.EpochCounter` over ``ds.stats`` (whose
counters include reads in DataLoader worker processes); the meter only draws it, at most every
``min_interval`` seconds, as a widget in a kernel or as text lines anywhere else.

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

from .view import GREY, View, in_kernel, ipywidgets as _w

__all__ = ["HitRateMeter"]


def _pct(e: EpochStats) -> str:
    return format_percent(e.hit_rate if e.reads else None)  # "–" before the first read


class HitRateMeter(View):
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
        epochs: one :class:`~nbkit.stats.EpochStats` per epoch; the last one is the current epoch.
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
        self._in_pass = False  # inside a track() pass: the current epoch is still running
        self.renders = 0  # how many times the view was redrawn (throttling is observable)
        self.counter = EpochCounter(ds)

        self.headline = _w.HTML()
        self.rate_bar = _w.FloatProgress(value=0.0, min=0.0, max=1.0, layout=_w.Layout(width="300px"))
        self.counts_label = _w.Label()
        self.table = _w.HTML()
        self.widget = _w.VBox([_w.HBox([self.headline, self.rate_bar]), self.counts_label, self.table])
        self._render(time.perf_counter())

    @property
    def epochs(self) -> list:
        return self.counter.epochs

    @property
    def current(self) -> EpochStats:
        """The epoch being counted now."""
        return self.counter.current

    def overall(self) -> EpochStats:
        """All reads since the meter was created, as one :class:`~nbkit.stats.EpochStats` (``epoch=0``)."""
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

    def track(self, iterable):
        """Wrap ``iterable`` (e.g. a DataLoader): yields its items, updating per item.

        Each pass over the returned object is one epoch: :meth:`new_epoch` runs when a pass
        starts, and the view is redrawn when it ends.
        """
        return _Tracked(self, iterable)

    def text(self) -> str:
        """The meter as one line of text (what a terminal shows)."""
        cur, tot = self.current, self.overall()
        budget = self._budget()
        return (
            f"nbkit hit rate: epoch {cur.epoch} {_pct(cur)} ({format_count(cur.hits)} hits, {format_count(cur.misses)} misses, "
            f"{format_count(cur.rate)} samples/s)  overall {_pct(tot)} ({format_count(tot.hits)} hits, "
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
        self.headline.value = (
            f"<b>Hit rate</b> epoch {cur.epoch}: <b>{_pct(cur)}</b>"
            f" <span style='color:{GREY}'>· overall {_pct(tot)}</span>&nbsp;"
        )
        self.rate_bar.value = cur.hit_rate
        self.rate_bar.bar_style = "success" if cur.reads and cur.hit_rate >= 0.999 else "info"
        budget = self._budget()
        self.counts_label.value = (
            f"hits {format_count(tot.hits)} · misses {format_count(tot.misses)} · {format_count(cur.rate)} samples/s this epoch"
            + (f" · {budget}" if budget else "")
        )
        self.table.value = self._table().html(
            style="border-collapse:collapse;font-variant-numeric:tabular-nums", cell_style="padding:2px 10px",
            column_styles=("",) * 7 + (f"color:{GREY}",),
        )
        if self.terminal:
            self._print(now, final)

    def _table(self) -> Table:
        rows = []
        for e in self.epochs:
            kind = "filling the cache" if e.filling else ("from the cache" if e.reads else "")
            if e is self.current and self._in_pass:
                kind = (kind + " (running)").strip()
            rows.append((e.epoch, format_count(e.reads), format_count(e.hits), format_count(e.misses), _pct(e),
                         format_seconds(e.seconds, digits=2), format_count(e.rate), kind))
        header = ("epoch", "samples", "hits", "misses", "hit rate", "time", "samples/s", "")
        return Table(rows, header, align="rrrrrrrl")

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
