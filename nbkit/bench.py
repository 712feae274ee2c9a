"""Raw vs cached epochs, measured the way a notebook user would: :func:`compare_epochs` times a few
DataLoader epochs over the raw source and then over its :class:`~nbkit.CachedDataset`, counts the
cache's hits per epoch (:class:`nbkit.stats.EpochCounter`), reports the filling epoch apart from
the steady-state ones, and renders one line, a table and a plot; :func:`mnist_like` loads an
MNIST-style torchvision dataset, or offline stand-in files (:mod:`nbkit.offline`) without a network.

Example:
    >>> import tempfile, torch
    >>> import nbkit
    >>> from nbkit.bench import compare_epochs
    >>> raw = torch.utils.data.TensorDataset(torch.randn(512, 8), torch.arange(512))
    >>> cached = nbkit.CachedDataset(raw, tempfile.mkdtemp() + "/cache")
    >>> result = compare_epochs(raw, cached, epochs=2, batch_size=128)
    >>> [(r.dataset, r.epoch, r.filling) for r in result.rows]
    [('raw', 1, False), ('raw', 2, False), ('cached', 1, True), ('cached', 2, False)]
    >>> result.rows[-1].hit_rate
    1.0
"""

from __future__ import annotations

import html
import math
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from .extras import require
from .progress import as_callback
from .stats import EpochCounter
from .text import Table, format_count, format_percent, format_seconds

__all__ = ["EpochRow", "EpochComparison", "compare_epochs", "TrainingRow", "TrainingComparison", "compare_training",
           "mnist_like", "MNIST_LIKE"]

#: The dataset names :func:`mnist_like` accepts (the tutorials' form field).
MNIST_LIKE = ("MNIST", "FashionMNIST", "KMNIST", "EMNIST")

# Colours chosen to stay apart for colour-blind readers and in greyscale.
_RAW_COLOUR = "#9a9a9a"
_FILL_COLOUR = "#f28e2b"
_CACHED_COLOUR = "#2f6db5"


@dataclass(frozen=True)
class EpochRow:
    """One timed epoch.

    Attributes:
        dataset: ``"raw"`` or ``"cached"``.
        epoch: 1-based epoch number within that dataset's run.
        seconds: wall-clock time of the whole epoch (every batch loaded).
        samples: samples loaded in the epoch.
        hit_rate: fraction of samples served from the cache (``None`` for the raw dataset).
        filling: ``True`` when the epoch had cache misses, i.e. it computed and stored samples.

    Example:
        >>> row = EpochRow("cached", 1, seconds=0.5, samples=1000, hit_rate=0.0, filling=True)
        >>> row.samples_per_s, row.label
        (2000.0, 'cached 1 (filling)')
    """

    dataset: str
    epoch: int
    seconds: float
    samples: int
    hit_rate: float | None = None
    filling: bool = False

    @property
    def samples_per_s(self) -> float:
        """Throughput of the epoch."""
        return self.samples / self.seconds if self.seconds > 0 else math.inf

    @property
    def label(self) -> str:
        """A short name for the epoch, e.g. ``"cached 1 (filling)"``."""
        return f"{self.dataset} {self.epoch}" + (" (filling)" if self.filling else "")


class EpochComparison:
    """The result of :func:`compare_epochs`: per-epoch rows, a table, a plot and the speedup.

    In a notebook, the object renders as an HTML table; ``print(result)`` gives the text table.

    Example:
        >>> rows = [EpochRow("raw", 1, 2.0, 1000), EpochRow("cached", 1, 2.5, 1000, 0.0, True),
        ...         EpochRow("cached", 2, 0.1, 1000, 1.0)]
        >>> EpochComparison(rows).speedup
        20.0
    """

    def __init__(self, rows, *, batch_size: int | None = None, num_workers: int | None = None):
        self.rows = list(rows)
        self.batch_size = batch_size
        self.num_workers = num_workers

    # --- summary numbers --------------------------------------------------------------------
    def _seconds(self, dataset: str, filling: bool | None = None) -> list[float]:
        return [
            r.seconds
            for r in self.rows
            if r.dataset == dataset and (filling is None or r.filling == filling)
        ]

    @property
    def raw_seconds(self) -> float:
        """Mean seconds of a raw epoch."""
        return _mean(self._seconds("raw"))

    @property
    def cached_seconds(self) -> float:
        """Mean seconds of a steady-state (non-filling) cached epoch; NaN if there was none."""
        return _mean(self._seconds("cached", filling=False))

    @property
    def filling_seconds(self) -> float:
        """Mean seconds of the cached epochs that filled the cache; NaN if the cache was warm."""
        return _mean(self._seconds("cached", filling=True))

    @property
    def speedup(self) -> float:
        """Raw mean epoch time / steady-state cached mean epoch time; NaN without both, and
        :attr:`no_speedup` says why."""
        if self.no_speedup:
            return math.nan
        return self.raw_seconds / self.cached_seconds if self.cached_seconds > 0 else math.inf

    @property
    def no_speedup(self) -> str:
        """Why there is no speedup to report (``""`` when there is one).

        Example:
            >>> one = EpochComparison([EpochRow("raw", 1, 2.0, 1000), EpochRow("cached", 1, 2.5, 1000, 0.0, True)])
            >>> one.speedup
            nan
            >>> one.no_speedup
            'the only cached epoch filled the cache (an epoch that fills the cache computes and stores every sample, so it shows no speedup); run 2 or more epochs, or warm the cache up first'
        """
        reason, detail, fix = self._no_speedup()
        return f"{reason}{detail}; {fix}" if reason else ""

    def _no_speedup(self) -> tuple:
        """(why there is no speedup, an explanation, the fix), or three empty strings."""
        if not self._seconds("raw"):
            return "no raw epoch was timed", "", "include the raw dataset's epochs"
        cached = self._seconds("cached")
        if not cached:
            return "no cached epoch was timed", "", "include the cached dataset's epochs"
        if not self._seconds("cached", filling=False):
            only = "the only cached epoch" if len(cached) == 1 else "every cached epoch"
            return (f"{only} filled the cache", " (an epoch that fills the cache computes and stores every "
                    "sample, so it shows no speedup)", "run 2 or more epochs, or warm the cache up first")
        return "", "", ""

    def summary(self) -> str:
        """One sentence: how much faster the cached epochs were, and what filling cost."""
        if self.no_speedup:
            text = f"raw epochs took {self.raw_seconds:.3g} s; no speedup measured: {self.no_speedup}"
        else:
            text = (
                f"cached epochs are {self.speedup:.1f}x faster than raw: "
                f"{self.cached_seconds:.3g} s vs {self.raw_seconds:.3g} s an epoch"
            )
        if not math.isnan(self.filling_seconds):
            text += f"; filling the cache took {self.filling_seconds:.3g} s (once)"
        return text

    # --- table -------------------------------------------------------------------------------
    _HEADER = ("dataset", "epoch", "seconds", "samples/s", "hit rate", "note")

    def _table(self) -> Table:
        cells = []
        for r in self.rows:
            hit = "—" if r.hit_rate is None else format_percent(r.hit_rate, digits=0)
            note = "fills the cache" if r.filling else ""
            cells.append((r.dataset, str(r.epoch), f"{r.seconds:.3f}", format_count(r.samples_per_s), hit, note))
        return Table(cells, self._HEADER)

    def table(self, fmt: str = "markdown") -> str:
        """The per-epoch table as ``"markdown"`` (default) or aligned plain ``"text"``."""
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
        bold = ["font-weight:bold" if r.dataset == "cached" and not r.filling else "" for r in self.rows]
        return self._table().html(row_styles=bold) + f"<p>{html.escape(self.summary())}</p>"

    # --- plot --------------------------------------------------------------------------------
    def plot(self, path=None, *, title: str = ""):
        """A bar per epoch, seconds across: raw epochs, the epoch that filled the cache, cached epochs.

        Each bar is labelled with its time, throughput and (cached epochs) hit rate; the headline
        gives the steady-state speedup, or says why there is none. The figure is 6.4 inches wide
        and grows in height with the epochs, so it stays legible in a narrow notebook column.

        Args:
            path: if given, the figure is also saved there (PNG, SVG, ... by extension).
            title: what was measured, e.g. ``"MNIST, ToTensor + Normalize"``; shown under the
                headline with the epoch size and loader settings.

        Returns:
            A :class:`matplotlib.figure.Figure` (shown when it is a cell's last value).

        Raises:
            ImportError: matplotlib is not installed (``pip install 'nbkit[notebook]'``).
        """
        plt = require("matplotlib.pyplot", extra="notebook", feature="nbkit.bench plots")
        Patch = require("matplotlib.patches", extra="notebook", feature="nbkit.bench plots").Patch

        colours = [
            _RAW_COLOUR if r.dataset == "raw" else _FILL_COLOUR if r.filling else _CACHED_COLOUR
            for r in self.rows
        ]
        # Top to bottom in run order, with a gap between the raw and the cached group.
        ys, y, previous = [], 0.0, None
        for r in self.rows:
            if previous is not None and r.dataset != previous:
                y += 0.5
            ys.append(-y)
            y += 1.0
            previous = r.dataset
        names = [f"{r.dataset}, epoch {r.epoch}" for r in self.rows]
        labels = []
        for r in self.rows:
            label = f"{_seconds_label(r.seconds)} · {_rate_label(r.samples_per_s)}/s"
            if r.hit_rate is not None:
                label += f" · hits {format_percent(r.hit_rate, digits=0)}"
            labels.append(label)

        # Made through pyplot so that IPython's inline backend is loaded and renders the returned
        # Figure as a picture; closed at once so the backend does not show it a second time.
        fig = plt.figure(figsize=(6.4, 2.4 + 0.36 * len(self.rows)), layout="constrained")
        plt.close(fig)
        ax = fig.subplots()
        bars = ax.barh(ys, [r.seconds for r in self.rows], height=0.75, color=colours, edgecolor="black",
                       linewidth=0.6)
        for bar, r in zip(bars, self.rows):
            if r.filling:
                bar.set_hatch("//")
        _label_bars(ax, [r.seconds for r in self.rows], ys, labels, fontsize=10)
        ax.set_yticks(ys, names, fontsize=10.5)
        ax.tick_params(axis="x", labelsize=10)
        ax.set_xlabel("seconds per epoch (shorter is better)", fontsize=10.5)
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)

        legend = [Patch(facecolor=_RAW_COLOUR, edgecolor="black", label="raw: transforms every epoch")]
        if any(r.filling for r in self.rows):
            legend.append(Patch(facecolor=_FILL_COLOUR, edgecolor="black", hatch="//", label="cached, filling the cache"))
        if any(r.dataset == "cached" and not r.filling for r in self.rows):
            legend.append(Patch(facecolor=_CACHED_COLOUR, edgecolor="black", label="cached, read from the cache"))
        fig.legend(handles=legend, loc="outside lower center", ncols=min(len(legend), 2), frameon=False, fontsize=10)

        headline = "No speedup measured" if self.no_speedup else f"Cached epochs are {self.speedup:.1f}× faster than raw"
        details = [f"{self.rows[0].samples if self.rows else 0:,} samples an epoch"]
        if self.batch_size is not None:
            details.append(f"batch size {self.batch_size}")
        if self.num_workers is not None:
            details.append(f"num_workers={self.num_workers}")
        fig.suptitle(headline, fontsize=13, fontweight="bold")
        subtitle = (f"{title}\n" if title else "") + " · ".join(details)
        if self.no_speedup:  # why, in a line that fits the figure
            reason, _, fix = self._no_speedup()
            subtitle += f"\n{reason}: {fix.split(',')[0]}"
        ax.set_title(subtitle, fontsize=10, color="#444444")
        if path is not None:
            fig.savefig(path, dpi=150)
        return fig


def _label_bars(ax, ends, ys, labels, *, fontsize) -> None:
    """Label each bar (ending at ``ends[i]``, centred on ``ys[i]``) inside its end when the bar is
    long, else just after it: no label runs off a narrow figure, whatever the longest bar."""
    longest = max(ends, default=0) or 1.0
    ax.set_xlim(0, longest * 1.02)
    for end, y, label in zip(ends, ys, labels):
        if end > 0.55 * longest:  # on a light box, readable over any bar colour or hatch
            ax.annotate(label, (end, y), xytext=(-5, 0), textcoords="offset points", ha="right", va="center",
                        fontsize=fontsize, bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none",
                                                     alpha=0.85))
        else:
            ax.annotate(label, (end, y), xytext=(4, 0), textcoords="offset points", ha="left", va="center",
                        fontsize=fontsize)


def _seconds_label(v: float) -> str:
    return format_seconds(v, digits=2)


def _rate_label(v: float) -> str:
    """Three significant digits: ``3612`` → ``'3.61k'``, so close rates never read the same."""
    if not math.isfinite(v):
        return "∞"
    scale, suffix = next(((k, x) for k, x in ((1e9, "G"), (1e6, "M"), (1e3, "k")) if v >= k), (1, ""))
    return f"{v / scale:#.3g}".rstrip(".") + suffix


def _mean(values) -> float:
    return statistics.fmean(values) if values else math.nan


def _default_collate(ds):
    # A CachedDataset's __getitems__ returns a SampleBatch, which nbkit.collate turns into tensors
    # without re-stacking; every other dataset gets the DataLoader's own default.
    import nbkit

    return nbkit.collate if isinstance(ds, nbkit.CachedDataset) else None


def _timed_epochs(ds, name, *, epochs, batch_size, num_workers, collate_fn, callback):
    from torch.utils.data import DataLoader

    loader = DataLoader(
        ds,
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        collate_fn=collate_fn if collate_fn is not None else _default_collate(ds),
        persistent_workers=num_workers > 0,
    )
    counter = EpochCounter(ds) if hasattr(ds, "stats") else None
    rows = []
    for epoch in range(1, epochs + 1):
        callback.set_description(f"{name} epoch {epoch}/{epochs}")
        if counter is not None:
            counter.new_epoch()
        start = time.perf_counter()
        for _batch in loader:
            callback.relative_update(1)
        seconds = time.perf_counter() - start
        hit_rate, filling = None, False
        if counter is not None:
            counted = counter.count()
            hit_rate, filling = counted.hit_rate, counted.filling
        rows.append(EpochRow(name, epoch, seconds, len(ds), hit_rate, filling))
    return rows


def compare_epochs(raw, cached, *, epochs: int = 3, batch_size: int = 256, num_workers: int = 0,
                   collate_fn=None, callback=None) -> EpochComparison:
    """Time ``epochs`` shuffled DataLoader epochs over ``raw``, then over ``cached``.

    Run it on a cold cache to see the filling epoch, or on a warmed one to see only the
    steady state. Raw epochs go first, so the cache's filling epoch cannot warm the source.

    Args:
        raw: the source dataset (any map-style dataset).
        cached: an :class:`nbkit.CachedDataset` over ``raw`` (anything with ``.stats`` works).
        epochs: epochs for each dataset; use 2 or more to see a steady-state cached epoch.
        batch_size, num_workers: passed to each ``DataLoader`` (``num_workers=0`` is the fast
            setting for a cache; give the raw dataset the same to compare like with like).
        collate_fn: for both loaders; by default ``nbkit.collate`` for a ``CachedDataset`` and
            the DataLoader's default for anything else.
        callback: an :class:`nbkit.progress.Callback` told of every batch, e.g.
            ``nbkit.TextProgress("bench")`` for a progress line.

    Returns:
        An :class:`EpochComparison` with one :class:`EpochRow` per epoch.

    Example:
        >>> import tempfile, torch, nbkit
        >>> raw = torch.utils.data.TensorDataset(torch.randn(256, 4))
        >>> cached = nbkit.CachedDataset(raw, tempfile.mkdtemp() + "/c")
        >>> compare_epochs(raw, cached, epochs=2, batch_size=64).rows[2].filling
        True
    """
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
    callback = as_callback(callback)
    callback.set_size(2 * epochs * math.ceil(len(raw) / batch_size))
    kwargs = dict(epochs=epochs, batch_size=batch_size, num_workers=num_workers,
                  collate_fn=collate_fn, callback=callback)
    rows = _timed_epochs(raw, "raw", **kwargs) + _timed_epochs(cached, "cached", **kwargs)
    return EpochComparison(rows, batch_size=batch_size, num_workers=num_workers)


@dataclass(frozen=True)
class TrainingRow:
    """One way of feeding the training loop, timed.

    Attributes:
        loader: what fed the model (``"raw DataLoader"``, ``"nbkit ds.loader"``, ``"on-device limit"``).
        seconds: the best timed pass (a whole epoch, or the ``steps`` batches of a step budget).
        epochs: every timed pass, in order.
        samples: samples a timed pass.
    """

    loader: str
    seconds: float
    epochs: tuple
    samples: int


class TrainingComparison:
    """The result of :func:`compare_training`: training epochs against the on-device limit.

    The **data wait** of a row is the share of its epoch beyond the on-device limit (the same
    training with the whole dataset already in device memory): ``1 - limit / seconds``.

    Example:
        >>> r = TrainingComparison([TrainingRow("raw DataLoader", 4.0, (4.0,), 100),
        ...                         TrainingRow("on-device limit", 1.0, (1.0,), 100)], device="cpu")
        >>> format_percent(r.wait_share(r.rows[0]), digits=0)
        '75%'
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
    def limit_seconds(self) -> float:
        return next((r.seconds for r in self.rows if r.loader == self.LIMIT), math.nan)

    def wait_share(self, row: TrainingRow) -> float:
        """The share of ``row``'s epoch spent waiting for data (NaN without a limit row)."""
        return max(0.0, 1.0 - self.limit_seconds / row.seconds) if row.seconds > 0 else math.nan

    def summary(self) -> str:
        parts = [f"{r.loader} {format_seconds(r.seconds, digits=2)} ({r.seconds / self.limit_seconds:.2f}x the limit, "
                 f"data wait {format_percent(self.wait_share(r), digits=0)})" for r in self.rows if r.loader != self.LIMIT]
        return f"training on {self.device} ({self.measured}): " + "; ".join(parts) + \
            f"; on-device limit {format_seconds(self.limit_seconds, digits=2)}"

    def _table(self) -> Table:
        cells = [(r.loader, format_seconds(r.seconds, digits=2), f"{r.seconds / self.limit_seconds:.2f}x",
                  format_percent(self.wait_share(r), digits=0), format_count(r.samples / r.seconds)) for r in self.rows]
        return Table(cells, ("loader", self._unit, "x on-device limit", "data wait", "samples/s"))

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
        return self._table().html() + f"<p>{html.escape(self.summary())}</p>"

    def plot(self, path=None, *, title: str = ""):
        """Stacked bars per loader: the time the device computes (the on-device limit) and the
        time it waits for data on top. Returns a matplotlib ``Figure``; saved to ``path`` if given."""
        plt = require("matplotlib.pyplot", extra="notebook", feature="nbkit.bench plots")
        # 6.4 inches wide with 10-point text: legible when a notebook scales it to a 600-pixel column.
        fig = plt.figure(figsize=(6.4, 2.2 + 0.5 * len(self.rows)), layout="constrained")
        plt.close(fig)
        ax = fig.subplots()
        limit = self.limit_seconds
        ys = list(range(len(self.rows)))[::-1]
        compute = [min(r.seconds, limit) for r in self.rows]
        wait = [max(0.0, r.seconds - limit) for r in self.rows]
        ax.barh(ys, compute, height=0.7, color=_CACHED_COLOUR, edgecolor="black", linewidth=0.6,
                label="training (the on-device limit)")
        bars = ax.barh(ys, wait, left=compute, height=0.7, color=_FILL_COLOUR, hatch="//", edgecolor="black",
                       linewidth=0.6, label="waiting for data")
        labels = [f"{format_seconds(r.seconds, digits=2)}" + ("" if r.loader == self.LIMIT else
                  f" · waits {format_percent(self.wait_share(r), digits=0)}") for r in self.rows]
        _label_bars(ax, [r.seconds for r in self.rows], [b.get_y() + b.get_height() / 2 for b in bars], labels,
                    fontsize=10)
        ax.set_yticks(ys, [r.loader for r in self.rows], fontsize=10.5)
        ax.tick_params(axis="x", labelsize=10)
        ax.set_xlabel(f"seconds per {self._unit} (shorter is better)", fontsize=10.5)
        ax.spines[["top", "right"]].set_visible(False)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
        fig.legend(loc="outside lower center", ncols=2, fontsize=10, frameon=False)
        details = [f"{self.measured} on {self.device}" if self.rows else self.device]
        if self.batch_size:
            details.append(f"batch size {self.batch_size}")
        ax.set_title((f"{title}\n" if title else "") + " · ".join(details), fontsize=10, color="#444444")
        if path is not None:
            fig.savefig(path, dpi=150)
        return fig


def _resolve_device(device):
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device if isinstance(device, torch.device) else torch.device(device)


def _sync(device) -> None:
    from .tpu import xla

    xla.wait(device)


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


def compare_training(raw, cached, model, *, device=None, epochs: int = 2, steps: int | None = None,
                     seconds: float | None = None, batch_size: int = 256, num_workers: int = 0, lr: float = 0.01,
                     loss_fn=None, seed: int = 0, callback=None) -> TrainingComparison:
    """Time training fed three ways: the raw dataset through a ``DataLoader``, the cache through
    ``cached.loader(...)``, and the **on-device limit** (the whole preprocessed dataset already in
    device memory). The gap to the limit is what the device spends waiting for data.

    Every feed trains on the same batches (the same shuffled order, from ``seed``), so the times
    compare like for like. Samples must be ``(input, target)``. One model is trained through all
    three (SGD, ``lr``): the numbers are timings, not a training run.

    Three ways to size the work, for the device at hand:

    * full epochs (the default; for an accelerator): one untimed epoch (compilation, thread
      start), then ``epochs`` timed ones; the best counts.
    * ``steps=n``: two untimed batches, then ``n`` timed batches per feed (at most an epoch).
    * ``seconds=s`` (for a CPU, where an epoch of a CNN takes minutes): the raw feed trains until
      ``s`` seconds have passed; the batches it managed set ``steps`` for the other feeds.

    The cache is warmed up first if it is not complete (the limit needs every sample).

    Args:
        raw: the source dataset.
        cached: an :class:`nbkit.CachedDataset` over ``raw``.
        model: a ``torch.nn.Module``; moved to ``device``.
        device: ``"cuda"``, an XLA device, ``"cpu"`` …; default CUDA when there is a GPU, else the CPU.
        epochs: timed epochs per feed (full-epoch mode).
        steps: timed batches per feed instead of epochs.
        seconds: a time budget for the raw feed's timed batches instead of epochs.
        batch_size: samples per batch; num_workers: the raw ``DataLoader``'s workers.
        lr: the SGD learning rate; loss_fn: default ``cross_entropy``; seed: the shuffle seed.
        callback: told of every batch (``nbkit.TextProgress()`` for a progress line).

    Example:
        >>> import tempfile, torch, nbkit
        >>> raw = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
        >>> cached = nbkit.CachedDataset(raw, tempfile.mkdtemp() + "/c")
        >>> r = compare_training(raw, cached, torch.nn.Linear(8, 2), epochs=1, batch_size=64)
        >>> [row.loader for row in r.rows]
        ['raw DataLoader', 'nbkit ds.loader', 'on-device limit']
        >>> compare_training(raw, cached, torch.nn.Linear(8, 2), steps=1, batch_size=64).measured
        '1 batch of 64 per feed (25% of an epoch), after 2 untimed, the same batches for every feed'
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
    device = _resolve_device(device)
    loss_fn = loss_fn or F.cross_entropy
    callback = as_callback(callback)
    if not cached.is_complete:
        cached.warmup()
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = len(raw)
    per_epoch = math.ceil(n / batch_size)
    budgeted = steps is not None or seconds is not None
    warm = min(2, per_epoch - 1) if budgeted else 0
    if steps is not None:
        steps = min(steps, per_epoch - warm)
    order = _Order(n, seed)
    on_device = _OnDevice(cached, device, batch_size)
    feeds = (
        ("raw DataLoader", lambda: DataLoader(raw, batch_size=batch_size, sampler=order, num_workers=num_workers,
                                              pin_memory=device.type == "cuda")),
        ("nbkit ds.loader", lambda: cached.loader(batch_size, device=device, seed=seed, rank=0, world_size=1)),
        (TrainingComparison.LIMIT, lambda: on_device),
    )
    passes = 1 if budgeted else epochs + 1
    callback.set_size(len(feeds) * (warm + (steps or per_epoch - warm) if budgeted else passes * per_epoch))

    def step(x, y):
        loss = loss_fn(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        _step_done(device)
        callback.relative_update(1)

    rows = []
    for name, make in feeds:
        batches = make()
        times = []
        for epoch in range(passes):
            order.epoch = epoch
            on_device.order = order.sampler.indices(epoch)
            timed = epoch > 0 or budgeted
            callback.set_description(f"{name}, " + ("timed batches" if budgeted else f"epoch {epoch}/{epochs}")
                                     + ("" if timed else " (untimed)"))
            it = iter(batches)
            done, start = 0, None
            for k, (x, y, *_) in enumerate(it):
                if k == warm:
                    _sync(device)
                    start = time.perf_counter()
                step(x, y)
                done = k + 1 - warm
                if steps is not None and done >= steps:
                    break
                if seconds is not None and steps is None and start is not None and time.perf_counter() - start >= seconds:
                    break
            if hasattr(it, "close"):
                it.close()  # ds.loader's pass: stops its thread when we break early
            _sync(device)
            if timed:
                times.append(time.perf_counter() - start)
        if budgeted and steps is None:
            steps = max(1, done)  # the raw feed's count under the budget: the others train as many batches
        timed_samples = n if not budgeted else min(n - warm * batch_size, steps * batch_size)
        rows.append(TrainingRow(name, min(times), tuple(times), timed_samples))
    if budgeted:
        budget = f"; a {seconds:g} s budget for the raw feed set the count" if seconds is not None else ""
        measured = (f"{steps} batch{'es' if steps != 1 else ''} of {batch_size} per feed "
                    f"({format_percent(steps / per_epoch, digits=0)} of an epoch), after {warm} untimed, "
                    f"the same batches for every feed{budget}")
    else:
        measured = (f"best of {epochs} epoch{'s' if epochs != 1 else ''} of {n:,} samples after one untimed epoch, "
                    "the same batches for every feed")
    unit = f"{steps} training batch{'es' if steps != 1 else ''}" if budgeted else "training epoch"
    return TrainingComparison(rows, device=str(device), batch_size=batch_size, measured=measured, unit=unit)


def _step_done(device) -> None:
    from .tpu import xla

    xla.step_done(device)


def mnist_like(name: str = "MNIST", root="data", *, train: bool = True, transform=None,
               download: bool = True, offline_samples: int = 60000, timeout: float = 5.0):
    """An MNIST-style torchvision dataset: the real one if it can be had, else offline files.

    The real data is used when it is already under ``root`` or (with ``download=True``) can be
    downloaded. Without a network the download fails within ``timeout`` seconds and the
    dataset falls back to MNIST-format files written by :func:`nbkit.offline.write_mnist` under
    ``root/nbkit-offline-<n>`` (kept apart so they are never taken for the real data). EMNIST
    (``split="digits"``) has no offline layout of its own, so its fallback is MNIST-format
    data. A message says which data was used.

    Args:
        name: one of ``MNIST_LIKE``: ``"MNIST"``, ``"FashionMNIST"``, ``"KMNIST"``, ``"EMNIST"``.
        root: torchvision's ``root`` folder.
        train: the training split (else the test split).
        transform: passed to the torchvision dataset.
        download: try to download the real data when it is not under ``root``.
        offline_samples: size of the offline training split (the test split is a sixth of it).
        timeout: socket timeout of the download attempt, in seconds.

    Returns:
        The torchvision dataset. Its ``nbkit_source`` attribute says ``"real"`` or ``"offline"``.

    Example:
        >>> import tempfile
        >>> ds = mnist_like("KMNIST", tempfile.mkdtemp(), download=False, offline_samples=120)  # doctest: +ELLIPSIS
        Using offline KMNIST-format stand-in data (120 samples): ...
        >>> len(ds), ds.nbkit_source
        (120, 'offline')
    """
    try:
        from torchvision import datasets
    except ImportError as e:
        raise ImportError("nbkit.bench.mnist_like needs torchvision: pip install torchvision") from e
    if name not in MNIST_LIKE:
        raise ValueError(f"mnist_like(name={name!r}): expected one of {', '.join(MNIST_LIKE)}")

    cls = getattr(datasets, name)
    kwargs = dict(train=train, transform=transform)
    if name == "EMNIST":
        kwargs["split"] = "digits"  # ten classes, like the others, so the same model fits
    reason = "download=False and the data is not under root"
    try:
        ds = cls(root, download=False, **kwargs)
        ds.nbkit_source = "real"
        return ds
    except RuntimeError:
        pass  # not there yet (torchvision raises RuntimeError("Dataset not found ..."))
    if download:
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            ds = cls(root, download=True, **kwargs)
            ds.nbkit_source = "real"
            return ds
        except (RuntimeError, OSError) as e:  # URLError and socket timeouts are OSErrors
            reason = f"the download failed ({_first_line(e)})"
        finally:
            socket.setdefaulttimeout(previous)

    from nbkit.offline import has_mnist, write_mnist

    layout = "MNIST" if name == "EMNIST" else name
    offline_root = Path(root) / f"nbkit-offline-{offline_samples}"
    if not has_mnist(offline_root, layout):
        write_mnist(offline_root, name=layout, n_train=offline_samples,
                    n_test=max(1, offline_samples // 6))
    ds = getattr(datasets, layout)(offline_root, download=False, train=train, transform=transform)
    ds.nbkit_source = "offline"
    note = " (EMNIST has no offline layout; using MNIST-format data instead)" if name == "EMNIST" else ""
    print(
        f"Using offline {layout}-format stand-in data ({len(ds):,} samples): {reason}. "
        f"The images are synthetic, learnable patterns, not real {name}{note}."
    )
    return ds


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    # torchvision's message starts with "Error downloading X:" and names the cause further down.
    return " / ".join(line.strip() for line in text[:3] if line.strip()) or type(error).__name__
