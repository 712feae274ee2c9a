"""ProgressBar (nbkit/widgets/bar.py) as a notebook draws it: indeterminate until its total is known,
never past 100%, never backwards within a phase, and one bar per phase in that phase's unit."""

import io
from unittest import mock

import pytest

pytest.importorskip("ipywidgets")

from nbkit.widgets.bar import ProgressBar


def _in_notebook(label, **kwargs):
    """A bar as in a kernel, whose displays are kept rather than sent to a front end."""
    bar = ProgressBar(label, file=io.StringIO(), **kwargs)
    bar.terminal = False
    return bar


class _Watched:
    """Every (bar, max, value, style, indeterminate, text) a bar shows, as a front end would see it."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []
        self.shown = []

    def record(self):
        b = self.bar.bar
        self.seen.append((id(b), b.max, b.value, b.bar_style, "nbkit-indeterminate" in b._dom_classes, self.bar.note.value))


def _run(bar, steps):
    watched = _Watched(bar)
    with mock.patch("IPython.display.display", side_effect=watched.shown.append), \
            mock.patch("nbkit.widgets.bar.RENDER_INTERVAL", 0):
        for step in steps:
            step(bar)
            watched.record()
    return watched


def test_a_bar_without_a_total_is_indeterminate_never_full_of_an_unknown_total():
    w = _run(_in_notebook("training"), [lambda b: b.relative_update(1), lambda b: b.relative_update(1),
                                        lambda b: b.set_size(14), lambda b: b.relative_update(5)])
    first, second, sized, later = w.seen
    assert first[3] == "info" and first[4] and "2 batches so far" not in first[5] and "1 batches so far" in first[5]
    assert "%" not in first[5] and "nbkit-pulse" in first[5]  # the pulse's style comes with it
    assert sized[3] == "" and not sized[4] and (sized[1], sized[2]) == (14, 2) and "2 of 14 batches" in sized[5]
    assert (later[1], later[2]) == (14, 7)
    assert len(w.shown) == 1  # one bar for the one phase


def test_a_bar_never_goes_back_nor_past_its_total():
    def fractions(w):
        return [value / top for _, top, value, style, indeterminate, _ in w.seen if not indeterminate]

    w = _run(_in_notebook("bench"), [lambda b: b.set_size(10), lambda b: b.relative_update(6),
                                     lambda b: b.set_size(20),  # a total revised upward: the bar holds
                                     lambda b: b.relative_update(2), lambda b: b.relative_update(40), lambda b: b.close()])
    f = fractions(w)
    assert f == sorted(f) and max(f) == 1.0, f
    assert "20 of 20 batches" in w.seen[-1][5] and w.seen[-1][3] == "success"


def test_each_phase_gets_its_own_bar_in_its_own_unit():
    w = _run(_in_notebook("import", unit="bytes"), [
        lambda b: b.set_size(3_000_000), lambda b: b.relative_update(3_000_000),
        lambda b: b.start_phase("verify", unit="samples", size=600), lambda b: b.relative_update(300), lambda b: b.close()])
    assert len(w.shown) == 2 and len(w.bar.bars) == 2
    (first, first_bar, first_note), (_, second_bar, second_note) = w.bar.bars
    assert first_bar.bar_style == "success" and (first_bar.value, first_bar.max) == (3_000_000, 3_000_000)
    assert "3.0 MB of 3.0 MB" in first_note.value
    assert "import verify: 300 of 600 samples" in second_note.value and (second_bar.value, second_bar.max) == (300, 600)
    assert second_bar.bar_style == ""  # closed before the end (stopped): not green
    fractions = [value / top for bar_id, top, value, _, _, _ in w.seen if bar_id == id(second_bar)]
    assert fractions == sorted(fractions) and fractions[0] == 0


def test_outside_a_notebook_a_phase_is_a_line_of_its_own():
    out = io.StringIO()
    bar = ProgressBar("import", file=out, unit="bytes")
    bar.set_size(1000)
    bar.relative_update(1000)
    bar.start_phase("verify", size=4)
    bar.relative_update(4)
    bar.close()
    finals = [line for line in out.getvalue().splitlines() if "100.0%" in line]
    assert [line.split("  ")[:2] for line in finals] == [["import", "1.0 KB/1.0 KB"], ["import verify", "4/4"]]


def test_a_phase_that_ends_short_of_its_total_leaves_no_frozen_bar():
    """03's training cell: warm-up (ended short: the cache was filled by then), a count of unknown
    size, then training. Every bar left on the page is finished; none is frozen mid-phase."""
    w = _run(_in_notebook("training"), [
        lambda b: b.start_phase("warmup", unit="samples", size=100), lambda b: b.relative_update(40),
        lambda b: b.start_phase("count", unit="batches"), lambda b: b.relative_update(7),
        lambda b: b.start_phase("training", unit="batches", size=20), lambda b: b.relative_update(20),
        lambda b: b.close()])
    assert [bar.bar_style for _, bar, _ in w.bar.bars] == ["success", "success"]
    (count_widget, count_bar, count_note), _ = w.bar.bars
    assert (count_bar.value, count_bar.max) == (7, 7) and "7 of 7 batches" in count_note.value
    closed = [widget for widget in w.shown if widget not in [b[0] for b in w.bar.bars]]
    assert len(closed) == 1 and closed[0].comm is None  # the warm-up's bar, removed from the page
