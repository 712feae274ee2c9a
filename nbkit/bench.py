"""Raw vs cached epochs, measured so that the result cannot claim the impossible.

:func:`compare_epochs` times DataLoader epochs over the raw source and over its
:class:`~nbkit.CachedDataset`; :func:`compare_training` times training fed three ways (a raw
``DataLoader``, ``cached.loader``, the on-device limit). Both follow the same rules:

* every feed gets the same untimed warm-up epoch (for a cold cache, the epoch that fills it,
  reported apart) and then reads the same batches;
* timed epochs are interleaved across feeds (raw, cached, raw, cached, ...), so a burst of load on
  a shared machine slows every feed alike, and there are at least :data:`MIN_TIMED` of them per
  feed, so each result has a spread: the median and the range;
* a ratio carries only the digits that spread supports (``"about 100× (99–120×)"``, never
  ``"99.9×"``), and a feed that beats the on-device limit by more than the spread is reported as
  noise (:data:`NOISE`), never as a result.

Progress goes to the ``callback`` (:mod:`nbkit.progress`): which feed and which epoch is being
timed, and every batch. The notebooks' MNIST-style data comes from :func:`nbkit.offline.mnist_like`.

Example:
    >>> import tempfile, torch
    >>> import nbkit
    >>> from nbkit.bench import compare_epochs
    >>> raw = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.arange(512))
    >>> cached = nbkit.CachedDataset(raw, tempfile.mkdtemp() + "/cache")
    >>> result = compare_epochs(raw, cached, epochs=3, batch_size=128)
    >>> [(r.dataset, r.epoch, r.filling) for r in result.rows][:4]
    [('raw', 0, False), ('cached', 0, True), ('raw', 1, False), ('cached', 1, False)]
    >>> result.rows[-1].hit_rate
    1.0
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from . import devices
from .extras import require
from .progress import as_callback
from .stats import EpochCounter
from .text import Table, fill, html_words, format_count, format_percent

__all__ = ["EpochRow", "EpochComparison", "compare_epochs", "TrainingRow", "TrainingComparison", "compare_training",
           "MIN_TIMED", "NOISE", "RULE", "EPOCH_RULE"]

#: Timed epochs (or passes) per feed at the least: fewer give no spread to judge a ratio by, so a
#: smaller ``epochs`` is raised to this and the result says so.
MIN_TIMED = 3
#: Under a time budget (``compare_training(seconds=...)``), up to this many timed passes per feed
#: when the spread stays wide; each raw pass gets ``seconds / MAX_TIMED``, so the budget holds.
MAX_TIMED = 5
#: A spread (range / median) wider than this asks for more timed passes while the budget allows.
WIDE_SPREAD = 0.2
#: What a feed that beats the on-device limit beyond both typical ranges is reported as (the numbers
#: used follow it: :meth:`TrainingComparison.basis`).
NOISE = "faster than the on-device limit, which nothing can be: noise in this comparison, rerun it on a quieter machine"
#: How :class:`TrainingComparison` judges a feed against the on-device limit, printed with every verdict.
RULE = ("rule: each feed's typical pass, median ± MAD (the median absolute deviation of its passes), against "
        "the limit's: above it, slower; overlapping it, at the limit; touching only at an edge, cannot tell; "
        "below it, noise")
#: How :class:`EpochComparison` decides that there is a speedup, printed with it.
EPOCH_RULE = "rule: a speedup only when the fastest raw epoch is slower than the slowest cached one"

# Colours chosen to stay apart for colour-blind readers and in greyscale.
_RAW_COLOUR = "#9a9a9a"
_FILL_COLOUR = "#f28e2b"
_CACHED_COLOUR = "#2f6db5"

# The clock every timed pass reads; tests replace it with a fake one.
_clock = time.perf_counter


# --- a spread and the digits it supports ----------------------------------------------------------


def _sig_step(value: float, digits: int) -> float:
    """The rounding step that keeps ``digits`` significant digits of ``value``."""
    return 10.0 ** (math.floor(math.log10(abs(value))) - digits + 1) if value else 0.0


def _rounded(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return f"{round(value / step) * step:.{decimals}f}"


class _Estimate:
    """A median and its range (``lo``–``hi``), and the one way nbkit.bench prints any number of it.

    The median keeps the digits its range supports, at least two significant ones and at most
    three (25.2 in 19–33 is "25", never "30"; 0.0149 in 0.014–0.028 is "0.015"), and never so few
    that the printed median leaves the range. Every number of the same quantity (the median, the
    ends, one epoch of the feed, a bar's label) goes through :meth:`fmt`, so the headline, the
    table and the plot print the same number to the same digits.

    Example:
        >>> e = _Estimate(19.0, 25.2, 33.0)
        >>> e.text(" s"), e.short(" s"), e.fmt(31.46)
        ('about 25 s (19–33 s)', '25 s', '31')
        >>> _Estimate(5.0, 5.0, 5.0).text("×")  # no spread: three significant digits, no "about"
        '5.00×'
    """

    def __init__(self, lo: float, mid: float, hi: float):
        self.lo, self.median, self.hi = float(lo), float(mid), float(hi)

    @property
    def finite(self) -> bool:
        return all(map(math.isfinite, (self.lo, self.median, self.hi)))

    @property
    def step(self) -> float:
        """The median's rounding step: the range's order of magnitude, between 2 and 3 significant digits."""
        lo, mid, hi = self.lo, self.median, self.hi
        finest = _sig_step(mid, 3) or 1e-12
        width = hi - lo
        if width <= 0:
            return finest
        step = max(min(10.0 ** math.floor(math.log10(width)), _sig_step(mid, 2) or math.inf), finest)
        while not lo <= float(_rounded(mid, step)) <= hi and step > finest:
            step /= 10
        return step

    def fmt(self, value: float) -> str:
        """``value`` (the median, an end, one measurement of the same quantity) at this estimate's digits."""
        if not math.isfinite(value):
            return "–"
        step = self.step
        if value:  # an end far from the median keeps 2 significant digits, never more than 3
            step = max(min(step, _sig_step(value, 2)), _sig_step(value, 3))
        return _rounded(value, step)

    def short(self, unit: str = " s") -> str:
        """The median alone, e.g. ``"25 s"`` (a bar's label)."""
        return f"{self.fmt(self.median)}{unit}" if self.finite else "–"

    def text(self, unit: str = " s") -> str:
        """``"about 25 s (19–33 s)"``; ``"5.00 s"`` without a spread; ``"–"`` without a number."""
        if not self.finite:
            return "–"
        if self.hi <= self.lo:
            return self.short(unit)
        return f"about {self.fmt(self.median)}{unit} ({self.fmt(self.lo)}–{self.fmt(self.hi)}{unit})"


class _Spread(_Estimate):
    """The timed passes of one feed: median, lowest, highest, and the middle of them (:attr:`typical`)."""

    def __init__(self, values):
        self.values = tuple(float(v) for v in values)
        self.n = len(self.values)
        super().__init__(min(self.values, default=math.nan),
                         statistics.median(self.values) if self.values else math.nan,
                         max(self.values, default=math.nan))

    @property
    def relative(self) -> float:
        """Range / median: 0.2 means the passes spread over 20% of the median."""
        return (self.hi - self.lo) / self.median if self.n and self.median > 0 else math.inf

    @property
    def typical(self) -> tuple[float, float]:
        """The median ± the median absolute deviation: where the middle of the passes lie, robust to
        one outlier (passes of 8.0, 8.1 and 15 s are typically 8.0–8.2 s; their range is 8.0–15 s).

        Example:
            >>> _Spread((8.0, 8.1, 15.0)).typical
            (8.0, 8.2)
        """
        if not self.n:
            return math.nan, math.nan
        mad = statistics.median(abs(v - self.median) for v in self.values)
        return round(self.median - mad, 12), round(self.median + mad, 12)


def _about(lo: float, mid: float, hi: float, unit: str = "×") -> str:
    """A median and its range, each with the digits the range supports (:class:`_Estimate`).

    Example:
        >>> _about(99.3, 103.0, 118.2), _about(2.91, 3.2, 3.64, " s"), _about(5.0, 5.0, 5.0)
        ('about 100× (99–120×)', 'about 3.2 s (2.9–3.6 s)', '5.00×')
        >>> _about(0.014, 0.0149, 0.028, " s")  # the median is never rounded out of its range
        'about 0.015 s (0.014–0.028 s)'
        >>> _about(67.0, 87.0, 110.0)  # never coarser than two significant digits: not "about 100×"
        'about 87× (67–110×)'
    """
    return _Estimate(lo, mid, hi).text(unit)


# --- compare_epochs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpochRow:
    """One epoch of :func:`compare_epochs`.

    Attributes:
        dataset: ``"raw"`` or ``"cached"``.
        epoch: 0 for the warm-up epoch, then 1, 2, ... for the timed ones.
        seconds: wall-clock time of the whole epoch (every batch loaded).
        samples: samples loaded in the epoch.
        hit_rate: fraction of samples served from the cache (``None`` for the raw dataset).
        filling: ``True`` when the epoch had cache misses, i.e. it computed and stored samples.
        warmup: the untimed warm-up epoch: shown, never counted.

    Example:
        >>> row = EpochRow("cached", 0, seconds=0.5, samples=1000, hit_rate=0.0, filling=True, warmup=True)
        >>> row.samples_per_s, row.label, row.counted
        (2000.0, 'cached 0 (filling)', False)
    """

    dataset: str
    epoch: int
    seconds: float
    samples: int
    hit_rate: float | None = None
    filling: bool = False
    warmup: bool = False

    @property
    def samples_per_s(self) -> float:
        """Throughput of the epoch."""
        return self.samples / self.seconds if self.seconds > 0 else math.inf

    @property
    def counted(self) -> bool:
        """Whether the epoch counts towards the speedup: timed, and read from a full cache."""
        return not self.warmup and not self.filling

    @property
    def label(self) -> str:
        """A short name for the epoch, e.g. ``"cached 0 (filling)"``."""
        note = " (filling)" if self.filling else " (warm-up)" if self.warmup else ""
        return f"{self.dataset} {self.epoch}{note}"


class EpochComparison:
    """The result of :func:`compare_epochs`: per-epoch rows, a table, a plot and the speedup.

    The speedup is the raw median epoch over the cached median epoch (timed epochs only), with
    the range the two spreads allow; it is stated only when the ranges do not overlap.
    In a notebook, the object renders as an HTML table; ``print(result)`` gives the text table.

    Example:
        >>> rows = [EpochRow("raw", k, t, 1000) for k, t in ((1, 2.0), (2, 2.2), (3, 1.9))]
        >>> rows += [EpochRow("cached", k, t, 1000, 1.0) for k, t in ((1, 0.10), (2, 0.11), (3, 0.09))]
        >>> result = EpochComparison(rows)
        >>> result.speedup, result.speedup_text
        (20.0, 'about 20× (17–24×)')
    """

    def __init__(self, rows, *, batch_size: int | None = None, num_workers: int | None = None, note: str = ""):
        self.rows = list(rows)
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.note = note  # e.g. that the timed epochs were raised to MIN_TIMED

    # --- summary numbers --------------------------------------------------------------------
    def _counted(self, dataset: str) -> list[float]:
        return [r.seconds for r in self.rows if r.dataset == dataset and r.counted]

    @property
    def raw(self) -> _Spread:
        """The raw dataset's timed epochs: ``median``, ``lo``, ``hi``."""
        return _Spread(self._counted("raw"))

    @property
    def cached(self) -> _Spread:
        """The cached dataset's timed epochs after filling."""
        return _Spread(self._counted("cached"))

    @property
    def raw_seconds(self) -> float:
        """Median seconds of a timed raw epoch."""
        return self.raw.median

    @property
    def cached_seconds(self) -> float:
        """Median seconds of a timed cached epoch read from the full cache; NaN if there was none."""
        return self.cached.median

    @property
    def filling_seconds(self) -> float:
        """Mean seconds of the cached epochs that filled the cache; NaN if the cache was warm."""
        filling = [r.seconds for r in self.rows if r.dataset == "cached" and r.filling]
        return statistics.fmean(filling) if filling else math.nan

    @property
    def speedup(self) -> float:
        """Raw median epoch / cached median epoch; NaN when :attr:`no_speedup` says why there is none."""
        if self.no_speedup:
            return math.nan
        return self.raw.median / self.cached.median if self.cached.median > 0 else math.inf

    @property
    def speedup_text(self) -> str:
        """The speedup with the digits its range supports, e.g. ``"about 80× (70–95×)"``; ``""`` without one."""
        if self.no_speedup:
            return ""
        raw, cached = self.raw, self.cached
        return _about(raw.lo / cached.hi, self.speedup, raw.hi / cached.lo)

    @property
    def no_speedup(self) -> str:
        """Why there is no speedup to report (``""`` when there is one).

        Example:
            >>> one = EpochComparison([EpochRow("raw", 1, 2.0, 1000), EpochRow("cached", 1, 2.5, 1000, 0.0, True)])
            >>> one.speedup
            nan
            >>> one.no_speedup
            'every cached epoch filled the cache (an epoch that fills the cache computes and stores every sample, so it shows no speedup); warm the cache up first, or time more epochs'
        """
        reason, detail, fix = self._no_speedup()
        return f"{reason}{detail}; {fix}" if reason else ""

    def _no_speedup(self) -> tuple:
        """(why there is no speedup, an explanation, the fix), or three empty strings."""
        raw, cached = self.raw, self.cached
        if not raw.n:
            return "no raw epoch was timed", "", "include the raw dataset's epochs"
        if not any(r.dataset == "cached" for r in self.rows):
            return "no cached epoch was timed", "", "include the cached dataset's epochs"
        if not cached.n:
            return ("every cached epoch filled the cache", " (an epoch that fills the cache computes and stores "
                    "every sample, so it shows no speedup)", "warm the cache up first, or time more epochs")
        if raw.n < 2 or cached.n < 2:
            return ("one timed epoch cannot be compared", " (a single epoch has no spread, and a shared machine's "
                    "noise can exceed any difference)", f"time {MIN_TIMED} or more epochs of each")
        if raw.lo <= cached.hi:
            return ("raw and cached epochs overlap within this run's spread",
                    f" (the fastest raw epoch, {raw.fmt(raw.lo)} s, is not slower than the slowest cached one, "
                    f"{cached.fmt(cached.hi)} s)", "rerun on a quieter machine, or with more epochs")
        return "", "", ""

    def summary(self) -> str:
        """One sentence: how much faster the cached epochs were (median and range), and what filling cost."""
        raw, cached = self.raw, self.cached
        if self.no_speedup:
            text = (f"raw epochs took {raw.text()}" if raw.n else "no raw epoch") + \
                f"; no speedup measured: {self.no_speedup}"
        else:
            text = (f"cached epochs are {self.speedup_text} faster than raw: {cached.text()} vs {raw.text()} an "
                    f"epoch (median and range of {min(raw.n, cached.n)} timed epochs each, interleaved)")
        if not math.isnan(self.filling_seconds):
            text += f"; filling the cache took {_once(self.filling_seconds)} (once)"
        if raw.n >= 2 and cached.n >= 2:
            text += f"; {EPOCH_RULE}"
        return text + (f"; {self.note}" if self.note else "")

    # --- table -------------------------------------------------------------------------------
    _HEADER = ("epoch", "seconds", "samples per second", "hit rate")
    #: Under the table: the rows the label marks are not in the medians.
    _NOTE = "(warm-up) and (filling) epochs are not counted"

    def _seconds(self, row: EpochRow) -> str:
        """An epoch's seconds as the summary and the plot print its feed: at the digits of the feed's
        spread (a median in the headline is the same string as its row here); the filling epoch once."""
        spread = {"raw": self.raw, "cached": self.cached}.get(row.dataset)
        if row.filling or spread is None or not spread.n:
            return _once(row.seconds)[:-2]
        return spread.fmt(row.seconds)

    def _table(self) -> Table:
        # Four columns that wrap at spaces: a 400-pixel output shows them without scrolling sideways.
        cells = []
        for r in self.rows:
            hit = "—" if r.hit_rate is None else format_percent(r.hit_rate, digits=0)
            cells.append((r.label, self._seconds(r), format_count(r.samples_per_s), hit))
        notes = (self._NOTE,) if any(not r.counted for r in self.rows) else ()
        return Table(cells, self._HEADER, notes=notes)

    def table(self, fmt: str = "markdown") -> str:
        """The per-epoch table, in the order the epochs ran, as ``"markdown"`` (default) or plain ``"text"``."""
        if fmt == "markdown":
            return self._table().markdown()
        if fmt == "text":
            return self._table().text()
        raise ValueError(f"table(fmt={fmt!r}): expected 'markdown' or 'text'")

    def __str__(self) -> str:
        return self.table("text") + "\n" + self.summary()

    def __repr__(self) -> str:
        return f"<EpochComparison {len(self.rows)} epochs: {self.summary()}>"

    def _repr_html_(self) -> str:
        bold = ["font-weight:bold" if r.dataset == "cached" and r.counted else "" for r in self.rows]
        return _html(self._table(), self.summary(), row_styles=bold)

    # --- plot --------------------------------------------------------------------------------
    def plot(self, path=None, *, title: str = "", width: float = 4.0):
        """Three bars, seconds across: a raw epoch, the epoch that filled the cache (once), a cached epoch.

        The raw and cached bars are the median timed epoch with a whisker over the range; each is
        labelled with its time. The headline gives the speedup with the digits its range supports,
        or says why there is none. Few, short labels: legible at 400 pixels wide (a phone,
        Colab's side panel) at the default ``width`` of 4 inches.

        Args:
            path: if given, the figure is also saved there (PNG, SVG, ... by extension).
            title: what was measured, e.g. ``"MNIST, ToTensor + Normalize"``.
            width: the figure's width in inches (at least 3); the text is wrapped to it.

        Returns:
            A :class:`matplotlib.figure.Figure` (shown when it is a cell's last value).

        Raises:
            ImportError: matplotlib is not installed (``pip install matplotlib``; the ``notebook`` extra).
        """
        plt = require("matplotlib.pyplot", extra="notebook", feature="nbkit.bench plots")
        raw, cached = self.raw, self.cached
        bars = []  # (name, median, lo, hi, parts, label): each label as the table and the summary print it
        if raw.n:
            bars.append(("raw", raw.median, raw.lo, raw.hi, [(0, raw.median, _RAW_COLOUR, "")], raw.short()))
        if not math.isnan(self.filling_seconds):
            filling = self.filling_seconds
            bars.append(("filling", filling, None, None, [(0, filling, _FILL_COLOUR, "//")], _once(filling) + " once"))
        if cached.n:
            bars.append(("cached", cached.median, cached.lo, cached.hi, [(0, cached.median, _CACHED_COLOUR, "")],
                         cached.short()))
        headline = "No speedup measured" if self.no_speedup else f"Cached: {self.speedup_text} faster"
        details = [f"{self.rows[0].samples if self.rows else 0:,} samples an epoch"]
        if self.batch_size is not None:
            details.append(f"batch {self.batch_size}")
        details.append(f"median of {min(raw.n, cached.n) or max(raw.n, cached.n)} timed epochs, bars show the range")
        if self.no_speedup:
            details.append(self._no_speedup()[0])
        return _bar_figure(plt, bars, headline=headline, subtitle=(title, details), width=width,
                           xlabel="seconds an epoch (shorter is better)", path=path)


#: The tables' HTML: cells wrap between words only (never at a range's dash or a label's hyphen),
#: in a slightly smaller type with little padding, so that a table fits a 400-pixel output (a phone,
#: Colab's side panel) instead of scrolling sideways behind a scrollbar that is not shown.
_TABLE_STYLE = "max-width:100%;width:auto;table-layout:auto;margin-left:0;font-size:0.85em"
_CELL_STYLE = "white-space:normal;overflow-wrap:normal;padding:0.2em 0.25em;vertical-align:top"


_GREY, _CARD_EDGE = "#616161", "#bdbdbd"


def _html(table: Table, summary: str, *, row_styles=()) -> str:
    return (table.html(style=_TABLE_STYLE, cell_style=_CELL_STYLE, row_styles=row_styles, keep_words=True,
                       note_style="margin:0 0 0.5em 0;padding-left:1.2em")
            + f"<p style='max-width:100%'>{html_words(summary)}</p>")


def _once(seconds: float) -> str:
    """A single measurement (no spread): three significant digits, ``29.12`` → ``'29.1 s'``."""
    return _Estimate(seconds, seconds, seconds).short(" s")


def _bar_figure(plt, bars, *, headline, subtitle, width, xlabel, path, legend=()):
    """Horizontal bars, top to bottom: ``(name, value, lo, hi, parts, label)``, where ``parts`` are the
    ``(left, length, colour, hatch)`` pieces the bar is drawn in (they end at ``value``). A whisker
    spans ``lo``–``hi``; each bar's label sits inside it when long, else after it; text wrapped to ``width``."""
    width = max(3.0, float(width))
    title, details = subtitle
    sub = fill((f"{title}: " if title else "") + ", ".join(details), int(width * 8.5))  # over the axes only
    head = fill(headline, int(width * 11))
    lines = sub.count("\n") + head.count("\n") + 2
    fig = plt.figure(figsize=(width, 1.3 + 0.45 * len(bars) + 0.2 * lines + 0.25 * len(legend)), layout="constrained")
    plt.close(fig)  # made through pyplot (the inline backend shows a returned Figure); not shown twice
    ax = fig.subplots()
    ys = list(range(len(bars)))[::-1]
    longest = max([b[3] if b[3] is not None else b[1] for b in bars if b[1] is not None] or [1.0]) or 1.0
    for y, (name, value, lo, hi, parts, label) in zip(ys, bars):
        for left, length, c, h in parts:
            ax.barh([y], [length], left=left, height=0.6, color=c, hatch=h, edgecolor="black", linewidth=0.6)
        if lo is not None and hi is not None and hi > lo:  # the range, drawn as a whisker with caps
            ax.hlines(y, lo, hi, color="black", linewidth=1)
            ax.vlines([lo, hi], y - 0.12, y + 0.12, color="black", linewidth=1)
        end = hi if hi is not None else value
        if value > 0.6 * longest:  # inside, from the bar's start, on a light box
            ax.annotate(label, (0, y), xytext=(4, 0), textcoords="offset points", ha="left", va="center",
                        fontsize=9, bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none",
                                              alpha=0.85))
        else:
            ax.annotate(label, (end, y), xytext=(4, 0), textcoords="offset points", ha="left", va="center",
                        fontsize=9)
    ax.set_xlim(0, longest * 1.05)
    ax.set_ylim(-0.6, len(bars) - 0.4)
    ax.set_yticks(ys, [b[0] for b in bars], fontsize=9)
    ax.tick_params(axis="x", labelsize=9)
    ax.locator_params(axis="x", nbins=4)
    ax.set_xlabel(fill(xlabel, int(width * 8)), fontsize=9)  # the axes is narrower than the figure
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    if legend:
        fig.legend(handles=list(legend), loc="outside lower center", ncols=1, frameon=False, fontsize=9)
    fig.suptitle(head, fontsize=11, fontweight="bold")
    ax.set_title(sub, fontsize=9, color="#444444")
    if path is not None:
        fig.savefig(path, dpi=150)
    return fig


def _default_collate(ds):
    # A CachedDataset's __getitems__ returns a SampleBatch, which nbkit.collate turns into tensors
    # without re-stacking; every other dataset gets the DataLoader's own default.
    import nbkit

    return nbkit.collate if isinstance(ds, nbkit.CachedDataset) else None


def _timed_count(epochs: int, what: str) -> tuple[int, str]:
    """Timed passes per feed (at least :data:`MIN_TIMED`) and, when raised, a note saying so."""
    if epochs >= MIN_TIMED:
        return epochs, ""
    return MIN_TIMED, (f"{what}={epochs} raised to {MIN_TIMED} timed epochs per feed: fewer have no spread "
                       "to judge a ratio by")


def compare_epochs(raw, cached, *, epochs: int = 3, batch_size: int = 256, num_workers: int = 0,
                   collate_fn=None, seed: int = 0, callback=None) -> EpochComparison:
    """Time shuffled DataLoader epochs over ``raw`` and over ``cached``, interleaved.

    Each dataset first gets one warm-up epoch, shown and not counted: for a cold cache it is the
    epoch that fills it (its time is reported apart, as the one-off cost). Then ``epochs`` timed
    epochs each (at least :data:`MIN_TIMED`), in turn: raw, cached, raw, cached, ... Both read the
    same shuffled batches (the order of epoch ``k`` comes from ``seed`` and ``k``).

    Args:
        raw: the source dataset (any map-style dataset).
        cached: an :class:`nbkit.CachedDataset` over ``raw`` (anything with ``.stats`` works).
        epochs: timed epochs per dataset after the warm-up; fewer than :data:`MIN_TIMED` are raised.
        batch_size, num_workers: passed to each ``DataLoader`` (``num_workers=0`` is the fast
            setting for a cache; give the raw dataset the same to compare like with like).
        collate_fn: for both loaders; by default ``nbkit.collate`` for a ``CachedDataset`` and
            the DataLoader's default for anything else.
        seed: the shuffle seed.
        callback: an :class:`nbkit.progress.Callback` told of every batch and, as its description,
            which dataset and epoch is being timed (``nbkit.TextProgress("bench")`` for a line,
            ``nbkit.widgets.ProgressBar("bench")`` for a bar in a notebook).

    Returns:
        An :class:`EpochComparison` with one :class:`EpochRow` per epoch, in the order they ran.

    Example:
        >>> import tempfile, torch, nbkit
        >>> raw = torch.utils.data.TensorDataset(torch.randn(256, 4))
        >>> cached = nbkit.CachedDataset(raw, tempfile.mkdtemp() + "/c")
        >>> result = compare_epochs(raw, cached, epochs=3, batch_size=64)
        >>> [r.label for r in result.rows[:4]]
        ['raw 0 (warm-up)', 'cached 0 (filling)', 'raw 1', 'cached 1']
    """
    from torch.utils.data import DataLoader

    if epochs < 1:
        raise ValueError(f"compare_epochs(epochs={epochs}): expected at least 1 epoch")
    if len(raw) != len(cached):
        raise ValueError(
            f"compare_epochs: raw has {len(raw)} samples but cached has {len(cached)}; "
            "pass the CachedDataset built over this raw dataset"
        )
    if not hasattr(cached, "stats"):
        raise TypeError(
            f"compare_epochs: cached is a {type(cached).__name__} without .stats; "
            "pass an nbkit.CachedDataset, e.g. nbkit.CachedDataset(raw, path)"
        )
    timed, note = _timed_count(epochs, "epochs")
    callback = as_callback(callback)
    n = len(raw)
    order = _Order(n, seed)
    feeds = []
    for name, ds in (("raw", raw), ("cached", cached)):
        loader = DataLoader(ds, batch_size=batch_size, sampler=order, num_workers=num_workers,
                            collate_fn=collate_fn if collate_fn is not None else _default_collate(ds),
                            persistent_workers=num_workers > 0)
        feeds.append((name, loader, EpochCounter(ds) if hasattr(ds, "stats") else None))
    callback.set_size(2 * (1 + timed) * len(feeds[0][1]))
    rows = []
    for epoch in range(timed + 1):
        order.epoch = epoch
        for name, loader, counter in feeds:
            callback.set_description(f"{name}, warm-up epoch (not counted)" if epoch == 0
                                     else f"{name}, timed epoch {epoch} of {timed}")
            if counter is not None:
                counter.new_epoch()
            start = _clock()
            for _batch in loader:
                callback.relative_update(1)
            seconds = _clock() - start
            hit_rate, filling = None, False
            if counter is not None:
                counted = counter.count()
                hit_rate, filling = counted.hit_rate, counted.filling
            rows.append(EpochRow(name, epoch, seconds, n, hit_rate, filling, warmup=epoch == 0))
    return EpochComparison(rows, batch_size=batch_size, num_workers=num_workers, note=note)


# --- compare_training -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainingRow:
    """One way of feeding the training loop, timed.

    Attributes:
        loader: what fed the model (``"raw DataLoader"``, ``"nbkit ds.loader"``, ``"on-device limit"``).
        seconds: the median timed pass (a whole epoch, or the batches of a step or time budget).
        epochs: every timed pass, in order.
        samples: samples a timed pass.

    Example:
        >>> TrainingRow("raw DataLoader", 3.0, (2.9, 3.0, 3.6), 1000).spread.text()
        'about 3.0 s (2.9–3.6 s)'
    """

    loader: str
    seconds: float
    epochs: tuple
    samples: int

    @property
    def spread(self) -> _Spread:
        """Median and range of the timed passes (the one ``seconds`` when none are listed)."""
        return _Spread(self.epochs or (self.seconds,))


class TrainingComparison:
    """The result of :func:`compare_training`: training passes against the on-device limit.

    Each feed is judged against the limit by the middle of its timed passes, its **typical range**
    (median ± median absolute deviation, :attr:`_Spread.typical`), so that one slow pass of either
    never decides; its median and full range are what the table, the summary and the plot print:

    * typical range above the limit's: ``"slower"``, with a ratio and the share of time spent
      waiting for data, their ranges from the two typical ranges;
    * typical ranges overlapping, and one median inside the other's typical range:
      ``"limit"``, "at the on-device limit, within this run's spread";
    * typical ranges touching only at their edges: ``"unsure"``, "cannot tell from this run's spread";
    * typical range below the limit's: ``"noise"`` (:data:`NOISE`), never a ratio (nothing feeds a
      device faster than data already in its memory);
    * a single pass on either side: ``"unsure"`` too (no spread, no comparison).

    The **data wait** of a slower feed is the share of its pass beyond the limit: ``1 - limit / seconds``
    (:meth:`wait`); it is derived only for a feed judged slower, and only there.

    Example:
        >>> limit = TrainingRow("on-device limit", 1.0, (1.0, 1.05, 0.95), 100)
        >>> slow = TrainingRow("raw DataLoader", 4.0, (4.0, 4.4, 3.8), 100)
        >>> fast = TrainingRow("nbkit ds.loader", 0.5, (0.5, 0.55, 0.45), 100)
        >>> r = TrainingComparison([slow, fast, limit], device="cpu")
        >>> r.verdict(slow), r.ratio_text(slow), r.wait(slow).text("%"), r.verdict(fast)
        ('slower', 'about 4.0× (3.6–4.4×)', 'about 75% (72–77%)', 'noise')
        >>> outlier = TrainingComparison([TrainingRow("raw DataLoader", 12, (11.8, 12, 12.3), 100),
        ...                               TrainingRow("on-device limit", 8.1, (8.0, 8.1, 15.0), 100)], device="cpu")
        >>> outlier.verdict(outlier.rows[0])  # one slow limit pass (15 s) does not make 12 s "at the limit"
        'slower'
    """

    LIMIT = "on-device limit"

    def __init__(self, rows, *, device: str, batch_size: int | None = None, measured: str = "",
                 unit: str = "training epoch"):
        self.rows = list(rows)
        self.device = device
        self.batch_size = batch_size
        self.measured = measured or (f"{self.rows[0].samples:,} samples an epoch" if self.rows else "")
        self._unit = unit

    @property
    def limit(self) -> TrainingRow | None:
        return next((r for r in self.rows if r.loader == self.LIMIT), None)

    @property
    def limit_seconds(self) -> float:
        return self.limit.seconds if self.limit is not None else math.nan

    def verdict(self, row: TrainingRow) -> str:
        """``"limit"`` (the limit itself, or within its spread), ``"slower"``, ``"noise"`` (beats the
        limit beyond the spreads) or ``"unsure"`` (the spreads cannot tell, or a single pass)."""
        limit = self.limit
        if limit is None:
            return "unsure"
        if row is limit:
            return "limit"
        mine, its = row.spread, limit.spread
        if mine.n < 2 or its.n < 2:
            return "unsure"
        (f_lo, f_hi), (l_lo, l_hi) = mine.typical, its.typical
        if f_lo > l_hi:
            return "slower"
        if f_hi < l_lo:
            return "noise"
        if l_lo <= mine.median <= l_hi or f_lo <= its.median <= f_hi:
            return "limit"
        return "unsure"

    def ratio(self, row: TrainingRow) -> _Estimate | None:
        """``row`` / the limit, for a feed judged slower: medians, and the range the typical ranges allow."""
        if self.verdict(row) != "slower":
            return None
        (f_lo, f_hi), (l_lo, l_hi) = row.spread.typical, self.limit.spread.typical
        return _Estimate(f_lo / l_hi, row.spread.median / self.limit.spread.median, f_hi / l_lo)

    def wait(self, row: TrainingRow) -> _Estimate | None:
        """The data wait in percent, for a feed judged slower (``None`` otherwise): the share of its
        pass beyond the limit, ``100 × (1 - limit / pass)``; the one place it is derived."""
        ratio = self.ratio(row)
        if ratio is None:
            return None
        return _Estimate(100 * (1 - 1 / ratio.lo), 100 * (1 - 1 / ratio.median), 100 * (1 - 1 / ratio.hi))

    def wait_share(self, row: TrainingRow) -> float:
        """The share of ``row``'s pass spent waiting for data: 0.0 for the limit itself, the median
        share for a feed judged slower, NaN where the spreads cannot give one."""
        if row is self.limit:
            return 0.0
        wait = self.wait(row)
        return wait.median / 100 if wait is not None else math.nan

    def basis(self, row: TrainingRow) -> str:
        """The numbers :meth:`verdict` used for ``row``: its typical range and the limit's (median ±
        MAD, :data:`RULE`); ``""`` for the limit itself or where there is no spread to judge by.

        Example:
            >>> limit = TrainingRow("on-device limit", 1.0, (1.0, 1.05, 0.95), 100)
            >>> fast = TrainingRow("nbkit ds.loader", 0.5, (0.5, 0.55, 0.45), 100)
            >>> TrainingComparison([fast, limit], device="cpu").basis(fast)
            'median ± MAD 0.5 ± 0.05 s = 0.45–0.55 s, the limit 1 ± 0.05 s = 0.95–1.05 s'
        """
        limit = self.limit
        if limit is None or row is limit or row.spread.n < 2 or limit.spread.n < 2:
            return ""

        def typical(spread):  # three significant digits: the numbers compared, not a result's precision
            lo, hi = spread.typical
            return f"{spread.median:.3g} ± {hi - spread.median:.3g} s = {lo:.3g}–{hi:.3g} s"

        return f"median ± MAD {typical(row.spread)}, the limit {typical(limit.spread)}"

    def ratio_text(self, row: TrainingRow) -> str:
        """How ``row`` compares with the limit, in words, with only the digits the spread supports."""
        verdict = self.verdict(row)
        if verdict == "noise":
            return NOISE
        if row is self.limit:
            return "the limit"
        if verdict == "limit":
            return "at the on-device limit, within this run's spread"
        if verdict == "unsure":
            if row.spread.n < 2 or self.limit is None or self.limit.spread.n < 2:
                return f"one timed pass cannot be compared with the limit (no spread); time {MIN_TIMED} or more"
            return "cannot tell from this run's spread whether it waits: rerun on a quieter machine"
        return self.ratio(row).text("×")

    def _wait_text(self, row: TrainingRow) -> str:
        if row is self.limit:
            return "0%"
        wait = self.wait(row)
        return wait.text("%") if wait is not None else "–"

    _VERSUS = {"noise": "noise: rerun", "limit": "at the limit", "unsure": "cannot tell"}

    def _versus(self, row: TrainingRow) -> str:
        if row is self.limit:
            return "the limit"
        verdict = self.verdict(row)
        if verdict == "unsure" and (row.spread.n < 2 or self.limit is None or self.limit.spread.n < 2):
            return "no spread"
        return self._VERSUS.get(verdict) or self.ratio(row).text("×")

    def summary(self) -> str:
        """What was measured and, for each feed, how it compares with the limit."""
        parts = []
        for r in self.rows:
            if r is self.limit:
                continue
            text = f"{r.loader} {r.spread.text()}: {self.ratio_text(r)}"
            if self.verdict(r) == "slower":
                text += f" the limit, waiting for data {self._wait_text(r)} of the time"
            if self.basis(r):
                text += f" ({self.basis(r)})"
            parts.append(text)
        limit = self.limit
        if limit is not None:
            parts.append(f"on-device limit {limit.spread.text()}")
            if limit.spread.n >= 2 and any(self.basis(r) for r in self.rows):
                parts.append(RULE)
        return f"training on {self.device} ({self.measured}): " + "; ".join(parts)

    def _table(self) -> Table:
        cells = [(r.loader, r.spread.text(), self._versus(r), self._wait_text(r)) for r in self.rows]
        return Table(cells, ("loader", f"{self._unit} (median, range)", "vs the limit", "data wait"))

    def table(self, fmt: str = "markdown") -> str:
        """The table as ``"markdown"`` (default) or aligned plain ``"text"``."""
        if fmt not in ("markdown", "text"):
            raise ValueError(f"table(fmt={fmt!r}): expected 'markdown' or 'text'")
        return self._table().markdown() if fmt == "markdown" else self._table().text()

    def __str__(self) -> str:
        return self.table("text") + "\n" + self.summary()

    def __repr__(self) -> str:
        return f"<TrainingComparison {self.summary()}>"

    def _repr_html_(self) -> str:
        """The table's cells as one card per feed (its name, then a line per column), the cards side by
        side where they fit and one under another on a narrow screen: four columns of ranges do not
        fit a 400-pixel output, and a card never scrolls sideways."""
        table = self._table()
        cards = []
        for row in table.rows:
            lines = "".join(f"<div><span style='color:{_GREY}'>{html_words(key)}:</span> {html_words(value)}</div>"
                            for key, value in zip(table.header[1:], row[1:]))
            cards.append(f"<div style='flex:1 1 14em;min-width:0;max-width:22em;padding:0.3em 0.5em;"
                         f"border-left:3px solid {_CARD_EDGE}'><div style='font-weight:bold'>{html_words(row[0])}</div>"
                         f"{lines}</div>")
        return (f"<div style='display:flex;flex-wrap:wrap;gap:0.5em 1em;max-width:100%;margin:0.3em 0'>{''.join(cards)}</div>"
                f"<p style='max-width:100%'>{html_words(self.summary())}</p>")

    def _bars(self) -> list:
        """The plot's bars: every feed at its own median, its whisker its own fastest to slowest pass.
        A feed judged slower is split at the limit's median: training (the limit) and, beyond it, the
        data wait of :meth:`wait`; any other feed is one piece, labelled with its verdict."""
        limit = self.limit
        bars = []
        for r in self.rows:
            verdict, s = self.verdict(r), r.spread
            label = s.short()
            if verdict == "slower":
                compute = limit.spread.median
                parts = [(0, compute, _CACHED_COLOUR, ""), (compute, s.median - compute, _FILL_COLOUR, "//")]
                label += f", waits {self.wait(r).short('%')}"
            elif verdict == "noise":
                parts, label = [(0, s.median, _RAW_COLOUR, "")], label + ", noise: rerun"
            else:
                parts = [(0, s.median, _CACHED_COLOUR, "")]
                if r is not limit:
                    label += ", at the limit" if verdict == "limit" else ", cannot tell"
            bars.append((r.loader, s.median, s.lo if s.n > 1 else None, s.hi if s.n > 1 else None, parts, label))
        return bars

    def headline(self) -> str:
        """The result in one line, a clause per feed (the plot's headline): "noise" qualifies only the
        feed it concerns.

        Example:
            >>> limit = TrainingRow("on-device limit", 1.0, (1.0, 1.05, 0.95), 100)
            >>> slow = TrainingRow("raw DataLoader", 4.0, (4.0, 4.4, 3.8), 100)
            >>> fast = TrainingRow("nbkit ds.loader", 0.5, (0.5, 0.55, 0.45), 100)
            >>> TrainingComparison([slow, fast, limit], device="cpu").headline()
            'raw DataLoader waits for data 75%; nbkit ds.loader faster than the limit: noise, rerun'
        """
        said = []
        for r in self.rows:
            if r is self.limit:
                continue
            verdict = self.verdict(r)
            if verdict == "slower":
                said.append(f"{r.loader} waits for data {self.wait(r).short('%')}")
            elif verdict == "noise":
                said.append(f"{r.loader} faster than the limit: noise, rerun")
            elif verdict == "limit":
                said.append(f"{r.loader} at the limit")
            else:
                said.append(f"{r.loader}: cannot tell")
        return "; ".join(said) or "The on-device limit"

    def plot(self, path=None, *, title: str = "", width: float = 4.0):
        """One bar per feed at its median timed pass, a whisker over its fastest to slowest pass,
        labelled as the table prints it. A feed judged slower than the limit is split at the limit's
        median: the time the device computes, and on top (hatched) the time it waits for data. A
        feed reported as noise is drawn grey and labelled so. Legible at 400 pixels wide at the
        default ``width`` of 4 inches.

        Returns a matplotlib ``Figure``; saved to ``path`` if given.
        """
        plt = require("matplotlib.pyplot", extra="notebook", feature="nbkit.bench plots")
        Patch = require("matplotlib.patches", extra="notebook", feature="nbkit.bench plots").Patch
        verdicts = [self.verdict(r) for r in self.rows if r is not self.limit]
        legend = [Patch(facecolor=_CACHED_COLOUR, edgecolor="black", label="training")]
        if "slower" in verdicts:
            legend.append(Patch(facecolor=_FILL_COLOUR, edgecolor="black", hatch="//",
                                label="waiting for data (beyond the limit's median)"))
        if "noise" in verdicts:
            legend.append(Patch(facecolor=_RAW_COLOUR, edgecolor="black", label="faster than the limit: noise"))
        headline = self.headline()
        details = [f"on {self.device}"] + ([f"batch {self.batch_size}"] if self.batch_size else [])
        passes = max((r.spread.n for r in self.rows), default=0)
        details.append(f"median of {passes} timed passes, bars show the range")
        return _bar_figure(plt, self._bars(), headline=headline, subtitle=(title, details), width=width,
                           legend=legend, xlabel=f"seconds per {self._unit} (shorter is better)", path=path)


class _OnDevice:
    """The whole cached dataset in device memory, batches taken by index: the on-device limit."""

    def __init__(self, cached, device, batch_size: int):
        import numpy as np
        import torch

        from .collate import collate_columns, column_tensor, map_tensors

        n = len(cached)
        columns = cached.read_columns(np.arange(n))
        if columns is None:
            raise ValueError("compare_training: the on-device limit needs every sample stored in fixed-shape fields; "
                             "warm the cache up first (cached.warmup())")
        schema = cached.schema
        host = collate_columns(schema, [column_tensor(leaf, c) for leaf, c in zip(schema.columns, columns)], None, n)
        self.data = map_tensors(host, lambda t: t.to(device))
        self.n, self.device, self.batch_size = n, device, batch_size
        self._map = map_tensors
        self._torch = torch

        self.order = None  # set per pass: the indices, in the order every feed reads them

    def __iter__(self):
        perm = self._torch.as_tensor(self.order, device=self.device)
        for a in range(0, len(perm), self.batch_size):
            idx = perm[a:a + self.batch_size]
            yield self._map(self.data, lambda t: t[idx])


class _Order:
    """The same shuffled indices for every feed: pass ``k`` reads ``EpochSampler(seed).indices(k)``,
    which is also the order of ``cached.loader(seed=seed)``'s ``k``-th pass."""

    def __init__(self, n: int, seed: int):
        from .samplers import EpochSampler

        self.sampler = EpochSampler(n, seed=seed, rank=0, world_size=1)
        self.epoch = 0

    def __iter__(self):
        return iter(self.sampler.indices(self.epoch).tolist())

    def __len__(self) -> int:
        return len(self.sampler)



def compare_training(raw, cached, model, *, device=None, epochs: int = 3, steps: int | None = None,
                     seconds: float | None = None, batch_size: int = 256, num_workers: int = 0, lr: float = 0.01,
                     loss_fn=None, seed: int = 0, callback=None) -> TrainingComparison:
    """Time training fed three ways: the raw dataset through a ``DataLoader``, the cache through
    ``cached.loader(...)``, and the **on-device limit** (the whole preprocessed dataset already in
    device memory). The gap to the limit is what the device spends waiting for data.

    Every feed trains on the same batches (the same shuffled order, from ``seed``), after the same
    untimed warm-up, and the timed passes are interleaved (raw, cached, limit, raw, ...), so load
    on a shared machine hits every feed alike. Each feed gets at least :data:`MIN_TIMED` timed
    passes and is reported by their median and range; see :class:`TrainingComparison` for how a
    feed is judged against the limit. Samples must be ``(input, target)``. One model is trained
    through all three (SGD, ``lr``): the numbers are timings, not a training run.

    Three ways to size the work, for the device at hand:

    * full epochs (the default; for an accelerator): one untimed epoch per feed (compilation,
      thread start), then ``epochs`` timed ones (at least :data:`MIN_TIMED`).
    * ``steps=n``: :data:`MIN_TIMED` timed passes of ``n`` batches per feed (at most an epoch),
      each after two untimed batches.
    * ``seconds=s`` (for a CPU, where an epoch of a CNN takes minutes): ``s`` bounds the raw feed's
      timed batches in all. Its first pass trains for ``s / MAX_TIMED`` seconds; the batches it
      managed are every later pass's count, for every feed. :data:`MIN_TIMED` passes each, and up
      to :data:`MAX_TIMED` while the spread is wider than :data:`WIDE_SPREAD` and the budget lasts.

    The cache is warmed up first if it is not complete (the limit needs every sample).

    Args:
        raw: the source dataset.
        cached: an :class:`nbkit.CachedDataset` over ``raw``.
        model: a ``torch.nn.Module``; moved to ``device``.
        device: ``"cuda"``, ``"xla"``, ``"cpu"``, a ``torch.device`` …; default (``None``, ``"auto"``) CUDA
            when there is a GPU, else the CPU (:func:`nbkit.devices.resolve`).
        epochs: timed epochs per feed (full-epoch mode); fewer than :data:`MIN_TIMED` are raised.
        steps: timed batches per pass instead of epochs.
        seconds: a time budget for the raw feed's timed batches instead of epochs.
        batch_size: samples per batch; num_workers: the raw ``DataLoader``'s workers.
        lr: the SGD learning rate; loss_fn: default ``cross_entropy``; seed: the shuffle seed.
        callback: told of every batch and, as its description, of the feed and pass being timed
            (``nbkit.TextProgress()`` for a line, ``nbkit.widgets.ProgressBar()`` in a notebook).

    Example:
        >>> import tempfile, torch, nbkit
        >>> raw = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
        >>> cached = nbkit.CachedDataset(raw, tempfile.mkdtemp() + "/c")
        >>> r = compare_training(raw, cached, torch.nn.Linear(8, 2), epochs=3, batch_size=64)
        >>> [(row.loader, len(row.epochs)) for row in r.rows]
        [('raw DataLoader', 3), ('nbkit ds.loader', 3), ('on-device limit', 3)]
        >>> compare_training(raw, cached, torch.nn.Linear(8, 2), steps=1, batch_size=64).measured
        '1 batch of 64 a pass (25% of an epoch), median of 3 timed passes per feed, interleaved, each after 2 untimed, the same batches for every feed'
    """
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    if steps is None and seconds is None and epochs < 1:
        raise ValueError(f"compare_training(epochs={epochs}): expected at least 1 epoch")
    if steps is not None and seconds is not None:
        raise ValueError("compare_training: give steps= or seconds=, not both")
    if steps is not None and (not isinstance(steps, int) or isinstance(steps, bool) or steps < 1):
        raise ValueError(f"compare_training(steps={steps!r}): expected a positive int (timed batches per feed)")
    if seconds is not None and not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"compare_training(seconds={seconds!r}): expected a positive number of seconds")
    if not hasattr(cached, "loader"):
        raise TypeError(f"compare_training: cached is a {type(cached).__name__}; pass an nbkit.CachedDataset over raw")
    device = devices.resolve(device, caller="compare_training")
    loss_fn = loss_fn or F.cross_entropy
    callback = as_callback(callback)
    if not cached.is_complete:  # its own phase, in samples: the bar then starts again, in batches
        callback.start_phase("warmup", unit="samples")
        callback.set_description("warming the cache up (the limit needs every sample)")
        cached.warmup(callback=callback)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = len(raw)
    per_epoch = math.ceil(n / batch_size)
    budgeted = steps is not None or seconds is not None
    timed, note = (MIN_TIMED, "") if budgeted else _timed_count(epochs, "epochs")
    most = MAX_TIMED if seconds is not None else timed
    warm = min(2, per_epoch - 1) if budgeted else 0
    if steps is not None:
        steps = min(steps, per_epoch - warm)
    order = _Order(n, seed)
    on_device = _OnDevice(cached, device, batch_size)
    feeds = (
        ("raw DataLoader", DataLoader(raw, batch_size=batch_size, sampler=order, num_workers=num_workers,
                                      pin_memory=device.type == "cuda")),
        ("nbkit ds.loader", cached.loader(batch_size, device=device, seed=seed, rank=0, world_size=1)),
        (TrainingComparison.LIMIT, on_device),
    )
    # Progress in batches, its total known before the first batch of each phase and never raised
    # within one, so a bar only moves forward. A time budget has a first phase of unknown size (the
    # raw feed's first pass counts the batches that fit), then the passes that train that count,
    # then one phase per extra round, added only while the spreads stay wide.
    if seconds is not None:
        _phase(callback, "count", None)
    elif steps is not None:
        _phase(callback, "training", len(feeds) * timed * (warm + steps))
    else:
        _phase(callback, "training", len(feeds) * (1 + timed) * per_epoch)

    def step(x, y):
        loss = loss_fn(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        devices.step_done(device)
        callback.relative_update(1)

    def one_pass(batches, epoch, *, count=None, until=None):
        """Train one pass over ``batches`` (epoch ``epoch``'s order); (seconds timed, batches timed)."""
        order.epoch = epoch
        on_device.order = order.sampler.indices(epoch)
        if hasattr(batches, "set_epoch"):
            batches.set_epoch(epoch)  # ds.loader: the same order as the other feeds
        it = iter(batches)
        done, start = 0, None
        for k, (x, y, *_) in enumerate(it):
            if k == warm:
                devices.wait(device)
                start = _clock()
            step(x, y)
            done = k + 1 - warm
            if count is not None and done >= count:
                break
            if until is not None and start is not None and _clock() - start >= until:
                break
        if hasattr(it, "close"):
            it.close()  # ds.loader's pass: stops its thread when we break early
        devices.wait(device)
        return (_clock() - start if start is not None else 0.0), max(done, 0)

    first = 0
    if not budgeted:
        for name, batches in feeds:  # the same untimed warm-up epoch for every feed
            callback.set_description(f"{name}, warm-up epoch (not timed)")
            one_pass(batches, 0)
        first = 1
    times = {name: [] for name, _ in feeds}
    planned, kind = timed, "epoch" if not budgeted else "pass"
    for r in range(most):
        for name, batches in feeds:
            if seconds is not None and steps is None:  # the raw feed's first pass sets the count
                callback.set_description(f"{name}, timed {kind} 1 of {planned}: as many batches as fit in "
                                         f"{seconds / MAX_TIMED:.3g} s")
                t, done = one_pass(batches, first + r, until=seconds / MAX_TIMED)
                steps = max(1, done)
                _phase(callback, "training", (len(feeds) * timed - 1) * (warm + steps))
            else:
                callback.set_description(f"{name}, timed {kind} {r + 1} of {planned}")
                t, _ = one_pass(batches, first + r, count=steps if budgeted else None)
            times[name].append(t)
        if r + 1 < timed:
            continue
        wide = any(_Spread(t).relative > WIDE_SPREAD for t in times.values())
        raw_times = times[feeds[0][0]]
        room = seconds is not None and sum(raw_times) + statistics.median(raw_times) <= 1.2 * seconds
        if r + 1 >= most or not (wide and room):
            break
        planned = r + 2
        _phase(callback, "extra", len(feeds) * (warm + steps))  # spreads wider than WIDE_SPREAD: one more round
    passes = len(times[feeds[0][0]])
    timed_samples = n if not budgeted else min(n - warm * batch_size, steps * batch_size)
    rows = [TrainingRow(name, statistics.median(times[name]), tuple(times[name]), timed_samples) for name, _ in feeds]
    if budgeted:
        budget = f"; a {seconds:g} s budget for the raw feed set the count" if seconds is not None else ""
        measured = (f"{steps} batch{'es' if steps != 1 else ''} of {batch_size} a pass "
                    f"({format_percent(steps / per_epoch, digits=0)} of an epoch), median of {passes} timed passes "
                    f"per feed, interleaved, each after {warm} untimed, the same batches for every feed{budget}")
    else:
        measured = (f"median of {passes} timed epochs of {n:,} samples per feed, interleaved, after one untimed "
                    f"epoch each, the same batches for every feed" + (f"; {note}" if note else ""))
    unit = f"pass of {steps} batch{'es' if steps != 1 else ''}" if budgeted else "training epoch"
    return TrainingComparison(rows, device=str(device), batch_size=batch_size, measured=measured, unit=unit)


def _phase(callback, name: str, size) -> None:
    """Start the next phase of a benchmark's progress, in batches, with its total (``None``: unknown)."""
    callback.start_phase(name, unit="batches", size=size)
    if size is not None:
        callback.set_size(size)  # also tells a wrapped fsspec callback
