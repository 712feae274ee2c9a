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

from nbkit.progress import Callback, TextProgress
from nbkit.text import format_amount

from .view import RENDER_INTERVAL, in_kernel, ipywidgets as _w, status_html

__all__ = ["ProgressBar"]


#: How an indeterminate bar pulses (the bar's ``nbkit-indeterminate`` class); in the note's HTML, so
#: it reaches the page in every front end (JupyterLab, Notebook 6, Voila, Colab) without a custom widget.
_PULSE = ("<style>.nbkit-indeterminate .progress-bar{animation:nbkit-pulse 1.2s ease-in-out infinite alternate}"
          "@keyframes nbkit-pulse{from{opacity:.35}to{opacity:1}}</style>")


class ProgressBar(TextProgress):
    """A callback drawn as a bar and a line of text in a notebook (shown on its first update), or
    as :class:`TextProgress` lines outside one.

    Keeps :class:`~nbkit.progress.Callback`'s API (``set_size``, ``relative_update``,
    ``absolute_update``, ``set_description``, ``start_phase``, ``close``), and only moves forward:
    until ``set_size`` gives a total the bar is indeterminate (full, in the "info" colour, pulsing;
    the text says how many so far), never a bar at 100% of an unknown total; a count past the total
    shows as the total; a total revised upward holds the bar until the work catches up; each
    :meth:`~nbkit.progress.Callback.start_phase` leaves the last phase's bar finished (green) and
    starts a new bar below it, in the new phase's unit, or removes it when that phase ended short of
    its total (a bar never stays frozen mid-way).

    Args:
        label: what runs, e.g. ``"benchmark"``.
        unit: what the size counts (``"batches"``).
        kwargs: for :class:`TextProgress` (``file``, ``min_interval``).

    Example:
        >>> import io
        >>> bar = ProgressBar("benchmark", file=io.StringIO())  # then e.g. compare_epochs(raw, cached, callback=bar)
        >>> bar.relative_update(1); bar.text()
        'benchmark: 1 batches so far'
        >>> bar.set_size(2); bar.text()
        'benchmark: 1 of 2 batches'
    """

    def __init__(self, label: str = "", *, unit: str = "batches", **kwargs):
        super().__init__(label, unit=unit, **kwargs)
        self.terminal = not in_kernel()
        self.bars = []  # one (widget, bar, note) per phase shown, the last one live
        self._new_bar()

    def _new_bar(self) -> None:
        # Widths as the panel's: the inline widgets "auto" inside a full-width row (a width of 100%
        # plus their own margins would stick out of a narrow output and make it scroll sideways).
        self.bar = _w.IntProgress(value=0, min=0, max=1, layout=_w.Layout(width="auto", flex="1 1 auto", min_width="4em"))
        self.note = _w.HTML(layout=_w.Layout(width="auto"))
        row = _w.HBox([self.bar], layout=_w.Layout(width="100%"))
        self.widget = _w.VBox([row, self.note], layout=_w.Layout(width="100%", max_width="600px"))
        self._shown = False
        self._drawn = 0.0

    def text(self) -> str:
        """The line under the bar: ``"bench: 120 of 470 batches, raw, timed epoch 1 of 3"``."""
        unit = "" if self.unit == "bytes" else f" {self.unit}"  # bytes carry their unit: "1.2 MB"
        if self.size is not None:
            done = min(self.value, self.size) if self.size > 0 else self.value
            count = f"{format_amount(done, self.unit)} of {format_amount(self.size, self.unit)}{unit}"
        else:
            count = f"{format_amount(self.value, self.unit)}{unit} so far"
        return f"{self._what()}: {count}" + (f", {self.description}" if self.description else "")

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
            self.bars.append((self.widget, self.bar, self.note))
            display(self.widget)
        fraction = self.fraction()
        if fraction is None:  # no total yet: a pulsing full bar, never a percent of an unknown total
            self.bar.max, self.bar.value = 1, 1
            self.bar.bar_style = "info"
            self.bar.add_class("nbkit-indeterminate")
            self.note.value = _PULSE + status_html(self.text())
            return
        self.bar.remove_class("nbkit-indeterminate")
        if self.bar.bar_style == "info":
            self.bar.bar_style = ""
        self.bar.max = max(1, int(self.size))
        self.bar.value = min(self.bar.max, int(round(fraction * self.bar.max)))
        self.note.value = status_html(self.text())  # wraps at spaces in a narrow column, never inside a word

    def _end_bar(self, *, show: bool = False) -> None:
        """Draw this phase's bar as it ended (if it is shown, or ``show``): green when its work is all
        done. A phase of unknown size is all done when it ends (its count is its size). At a change of
        phase, a bar whose phase ended short of its total is removed rather than left frozen mid-way:
        the work goes on in the next phase's bar."""
        if not (self._shown or show):
            return
        if self.size is None and self.value > 0:
            self.size = self.value
        if not show and not self.finished:
            self.bars = [b for b in self.bars if b[0] is not self.widget]
            self.widget.close()
            return
        self._draw()
        self.bar.remove_class("nbkit-indeterminate")
        self.bar.bar_style = "success" if self.finished else ""

    def start_phase(self, name: str, *, unit: str = "samples", size=None) -> None:
        if self.terminal:
            return super().start_phase(name, unit=unit, size=size)
        self._end_bar()
        if self._shown:
            self._new_bar()  # the next phase gets its own bar, below the last one
        self._new_phase()
        Callback.start_phase(self, name, unit=unit, size=size)

    def close(self):
        if self.terminal:
            return super().close()
        Callback.close(self)  # stop the clock; no text line under a widget
        self._end_bar(show=True)
