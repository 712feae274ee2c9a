"""A progress bar for any long call that reports through a callback (``compare_epochs``,
``compare_training``, ``warmup``): a widget in a notebook, a :class:`~nbkit.progress.TextProgress`
line anywhere else, like ``tqdm.auto``.

A view only: it draws the callback's own counters (size, value, description) and holds no logic.

Example:
    >>> import io
    >>> from nbkit.widgets.bar import ProgressBar
    >>> bar = ProgressBar("bench", file=io.StringIO(), min_interval=0)
    >>> bar.set_size(4); bar.set_description("raw, timed epoch 1 of 3"); bar.relative_update(4); bar.close()
    >>> bar.text()
    'bench: 4 of 4 batches, raw, timed epoch 1 of 3'
"""

from __future__ import annotations

import time

from nbkit.progress import TextProgress
from nbkit.text import format_count

from .view import RENDER_INTERVAL, in_kernel, ipywidgets as _w, status_html

__all__ = ["ProgressBar"]


class ProgressBar(TextProgress):
    """A callback drawn as a bar and a line of text in a notebook (shown on its first update), or
    as :class:`TextProgress` lines outside one.

    Args:
        label: what runs, e.g. ``"benchmark"``.
        unit: what the size counts (``"batches"``).
        kwargs: for :class:`TextProgress` (``file``, ``min_interval``).

    Example:
        >>> import io
        >>> bar = ProgressBar("benchmark", file=io.StringIO())  # then e.g. compare_epochs(raw, cached, callback=bar)
        >>> bar.set_size(2); bar.relative_update(1); bar.text()
        'benchmark: 1 of 2 batches'
    """

    def __init__(self, label: str = "", *, unit: str = "batches", **kwargs):
        super().__init__(label, unit=unit, **kwargs)
        self.terminal = not in_kernel()
        self.bar = _w.IntProgress(value=0, min=0, max=1, layout=_w.Layout(width="100%", max_width="600px"))
        self.note = _w.HTML(layout=_w.Layout(width="100%"))
        self.widget = _w.VBox([self.bar, self.note], layout=_w.Layout(width="100%", max_width="600px"))
        self._shown = False
        self._drawn = 0.0

    def text(self) -> str:
        """The line under the bar: ``"bench: 120 of 470 batches, raw, timed epoch 1 of 3"``."""
        count = format_count(self.value) + (f" of {format_count(self.size)}" if self.size else "")
        return f"{self.label or 'progress'}: {count} {self.unit}" + (f", {self.description}" if self.description else "")

    def call(self, *args, **kwargs):
        if self.terminal:
            return super().call(*args, **kwargs)
        now = time.perf_counter()
        if self._shown and now - self._drawn < RENDER_INTERVAL and not self.finished:
            return
        self._drawn = now
        self._draw()

    def _draw(self) -> None:
        if not self._shown:
            from IPython.display import display

            self._shown = True
            display(self.widget)
        self.bar.max = max(1, int(self.size or 0))
        self.bar.value = min(int(self.value), self.bar.max)
        self.note.value = status_html(self.text())  # wraps at spaces in a narrow column, never inside a word

    def close(self):
        if self.terminal:
            return super().close()
        super(TextProgress, self).close()  # stop the clock; no text line under a widget
        self._draw()
        self.bar.bar_style = "success" if self.finished else ""
