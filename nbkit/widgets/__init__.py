"""Notebook views of a cache: :class:`WarmupPanel` (fill, stop, resume, export, upload) and
:class:`HitRateMeter` (hit rate per epoch while training); :class:`ProgressBar` for any call
that reports through a callback (the benchmarks).

Both are views, in the sense of ``tqdm.notebook``: they render what the engine already keeps (a
:class:`nbkit.progress.Job` and its callback, ``ds.stats`` through :class:`nbkit.stats.EpochCounter`)
and hold no caching logic. Outside a notebook kernel the same calls print plain text lines. Works
with ipywidgets 8 and 7.7.1 (what Colab's TPU runtime ships); without ipywidgets, importing this
package raises an ``ImportError`` naming the ``notebook`` extra and ``pip install ipywidgets``.

Example:
    >>> import torch, tempfile
    >>> import nbkit
    >>> from nbkit.widgets import HitRateMeter, WarmupPanel
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8.0)), tempfile.mkdtemp())
    >>> panel = WarmupPanel(ds)
    >>> panel.run("warmup").computed  # what a notebook cell calls: click if needed, wait, raise, report
    8
    >>> meter = HitRateMeter(ds)
    >>> for _ in meter.track(torch.utils.data.DataLoader(ds, batch_size=4)): pass
    >>> meter.epochs[-1].hit_rate
    1.0
"""

from nbkit.stats import EpochStats

from .bar import ProgressBar
from .meter import HitRateMeter
from .panel import PanelState, WarmupPanel

__all__ = ["WarmupPanel", "HitRateMeter", "PanelState", "EpochStats", "ProgressBar"]
