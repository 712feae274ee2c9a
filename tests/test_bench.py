"""nbkit.bench: compare_epochs rows, table, plot, speedup."""

import doctest
import math
import statistics
import re
import subprocess
import sys
import time

import pytest
import torch

import nbkit
from nbkit.text import html_words
import nbkit.bench
from nbkit.bench import NOISE, EpochComparison, EpochRow, compare_epochs
from nbkit.progress import Callback
from sources import TupleSource


class SlowSource(TupleSource):
    """A source that costs ~20 µs a sample, like a decode + transform."""

    def __getitem__(self, i):
        deadline = time.perf_counter() + 2e-5
        while time.perf_counter() < deadline:
            pass
        return super().__getitem__(i)


@pytest.fixture
def pair(tmp_path):
    raw = SlowSource(n=600)
    return raw, nbkit.CachedDataset(raw, tmp_path / "cache")


def test_rows_for_a_cold_cache(pair):
    raw, cached = pair
    result = compare_epochs(raw, cached, epochs=3, batch_size=128)
    # One warm-up epoch each (the cached one fills the cache), then timed epochs in turn.
    assert [(r.dataset, r.epoch) for r in result.rows] == [
        ("raw", 0), ("cached", 0), ("raw", 1), ("cached", 1), ("raw", 2), ("cached", 2), ("raw", 3), ("cached", 3)]
    assert [r.warmup for r in result.rows] == [True, True] + [False] * 6
    assert [r.filling for r in result.rows] == [False, True] + [False] * 6
    assert [r.hit_rate for r in result.rows] == [None, 0.0] + [None, 1.0] * 3
    assert all(r.samples == 600 and r.seconds > 0 for r in result.rows)
    assert result.rows[0].samples_per_s == pytest.approx(600 / result.rows[0].seconds)
    assert cached.stats.complete  # the filling epoch stored every sample
    raw_timed = [r.seconds for r in result.rows[2::2]]
    cached_timed = [r.seconds for r in result.rows[3::2]]
    assert result.raw_seconds == pytest.approx(sorted(raw_timed)[1])  # medians of the timed epochs
    assert result.cached_seconds == pytest.approx(sorted(cached_timed)[1])
    assert result.filling_seconds == pytest.approx(result.rows[1].seconds)
    if not result.no_speedup:
        assert result.speedup == pytest.approx(result.raw_seconds / result.cached_seconds)


def test_a_warm_cache_has_no_filling_epoch(pair):
    raw, cached = pair
    cached.warmup()
    result = compare_epochs(raw, cached, epochs=3, batch_size=200)
    cached_rows = [r for r in result.rows if r.dataset == "cached"]
    assert [(r.epoch, r.filling, r.hit_rate) for r in cached_rows] == [(0, False, 1.0), (1, False, 1.0),
                                                                        (2, False, 1.0), (3, False, 1.0)]
    assert math.isnan(result.filling_seconds)
    assert "filling" not in result.summary()


def test_a_partly_warm_cache_reports_its_hit_rate(pair):
    raw, cached = pair
    cached.warmup(shard=(0, 2))  # every other sample
    result = compare_epochs(raw, cached, epochs=3, batch_size=100)
    first, second, *_ = [r for r in result.rows if r.dataset == "cached"]
    assert first.filling and first.warmup and first.hit_rate == pytest.approx(0.5)
    assert not second.filling and second.hit_rate == 1.0


def test_hit_rates_count_reads_in_worker_processes(pair):
    raw, cached = pair
    result = compare_epochs(raw, cached, epochs=3, batch_size=100, num_workers=2)
    cached_rows = [r for r in result.rows if r.dataset == "cached"]
    assert [(r.filling, r.hit_rate) for r in cached_rows] == [(True, 0.0)] + [(False, 1.0)] * 3


def test_one_epoch_is_raised_to_three_timed_ones_and_says_so(pair):
    raw, cached = pair
    result = compare_epochs(raw, cached, epochs=1, batch_size=300)
    assert [r.epoch for r in result.rows if r.dataset == "raw"] == [0, 1, 2, 3]
    assert "epochs=1 raised to 3 timed epochs per feed: fewer have no spread" in result.summary()
    assert "nan" not in str(result) and "nan" not in result._repr_html_()


def _epochs(raw_times, cached_times, filling=None):
    rows = [EpochRow("raw", 0, raw_times[0] * 1.1, 1000, warmup=True)]
    if filling is not None:
        rows.append(EpochRow("cached", 0, filling, 1000, 0.0, True, warmup=True))
    for k, (a, b) in enumerate(zip(raw_times, cached_times), 1):
        rows += [EpochRow("raw", k, a, 1000), EpochRow("cached", k, b, 1000, 1.0)]
    return rows


def test_every_reason_for_no_speedup(tmp_path):
    filling = [EpochRow("cached", 1, 2.5, 1000, 0.0, True), EpochRow("cached", 2, 2.0, 1000, 0.5, True)]
    assert EpochComparison([EpochRow("raw", 1, 2.0, 1000)] + filling).no_speedup.startswith(
        "every cached epoch filled the cache")
    assert EpochComparison([EpochRow("raw", 1, 2.0, 1000)]).no_speedup == \
        "no cached epoch was timed; include the cached dataset's epochs"
    assert EpochComparison(filling[:1]).no_speedup.startswith("no raw epoch was timed")
    one = EpochComparison(_epochs([2.0], [0.1]))
    assert one.no_speedup.startswith("one timed epoch cannot be compared (a single epoch has no spread")
    # Raw 1.0-1.4 s, cached 0.9-1.1 s: the ranges overlap, so no speedup is claimed.
    overlap = EpochComparison(_epochs([1.0, 1.4, 1.2], [0.9, 1.1, 1.0]))
    assert overlap.no_speedup.startswith("raw and cached epochs overlap within this run's spread")
    for result in (one, overlap, EpochComparison(filling)):
        assert math.isnan(result.speedup) and result.speedup_text == ""
        assert "faster" not in result.summary() and "nan" not in str(result)
    pytest.importorskip("matplotlib")
    fig = overlap.plot(tmp_path / "none.png")
    assert fig._suptitle.get_text() == "No speedup measured"
    assert "overlap within this run's spread" in fig.axes[0].get_title().replace("\n", " ")


def test_speedup_carries_the_digits_its_spread_supports():
    # Raw epochs 2.0-2.4 s, cached 0.02-0.024 s: the ratio lies between 83x and 120x.
    result = EpochComparison(_epochs([2.0, 2.2, 2.4], [0.022, 0.020, 0.024], filling=3.0))
    assert result.speedup == pytest.approx(100.0)
    assert result.speedup_text == "about 100× (83–120×)"
    assert result.summary().startswith(
        "cached epochs are about 100× (83–120×) faster than raw: about 0.022 s (0.020–0.024 s) vs "
        "about 2.2 s (2.0–2.4 s) an epoch (median and range of 3 timed epochs each, interleaved); "
        "filling the cache took 3.00 s (once)")
    # A tight spread keeps more digits, never more than three.
    tight = EpochComparison(_epochs([2.000, 2.001, 2.002], [0.0400, 0.0401, 0.0402]))
    assert tight.speedup_text == "about 49.9× (49.8–50.0×)"
    assert EpochComparison(_epochs([2.00, 2.01, 2.02], [0.0200, 0.0201, 0.0202])).speedup_text == \
        "about 100× (99–101×)"


def test_collate_defaults_and_override(pair):
    raw, cached = pair
    seen = []

    def collate(batch):
        seen.append(type(batch).__name__)
        return torch.utils.data.default_collate(list(batch))

    compare_epochs(raw, cached, epochs=3, batch_size=300, collate_fn=collate)
    # Both loaders use the given collate_fn, in turn: raw batches of plain lists, cached SampleBatches.
    assert seen == ["list", "list", "SampleBatch", "SampleBatch"] * 4
    assert nbkit.bench._default_collate(cached) is nbkit.collate
    assert nbkit.bench._default_collate(raw) is None


def test_both_datasets_read_the_same_batches(tmp_path):
    raw = _Indexed(100)
    cached = nbkit.CachedDataset(raw, tmp_path / "c")
    seen = []

    def collate(batch):
        batch = torch.utils.data.default_collate(list(batch))
        seen.append(batch[1].tolist())
        return batch

    compare_epochs(raw, cached, epochs=3, batch_size=40, collate_fn=collate)
    passes = [seen[k:k + 3] for k in range(0, len(seen), 3)]  # 3 batches an epoch, raw and cached in turn
    assert len(passes) == 8
    assert all(passes[k] == passes[k + 1] for k in range(0, 8, 2))  # raw and cached: the same batches
    assert passes[0] != passes[2]  # reshuffled every epoch
    assert sorted(sum(passes[0], [])) == list(range(100))


class Recorder(Callback):
    """Records every description, and (phase, size, value) at every report a front end would draw."""

    def __init__(self):
        super().__init__()
        self.descriptions = []
        self.log = []

    def set_description(self, text):
        self.descriptions.append(text)

    def call(self, *args, **kwargs):
        self.log.append((self.phase, self.size, self.value))


def phases_of(log):
    """The reported progress as [(phase, sizes seen, values seen)], one entry per phase started."""
    out = []
    for phase, size, value in log:
        if not out or out[-1][0] != phase or (value == 0 and out[-1][2] and out[-1][2][-1] > 0):
            out.append((phase, [], []))
        out[-1][1].append(size)
        out[-1][2].append(value)
    return out


def assert_only_forward(log):
    """What a bar would show never goes backwards: in each phase the total is known before the first
    unit is reported (or unknown throughout: an indeterminate bar) and never changes, the count only
    grows and never passes the total, and a phase of known size ends full."""
    assert log
    for phase, sizes, values in phases_of(log):
        moved = [s for s, v in zip(sizes, values) if v > 0]
        assert len(set(moved)) <= 1, (phase, sorted(set(moved), key=str))
        total = moved[0] if moved else None
        assert all(s == total for s, v in zip(sizes, values) if v > 0), phase
        assert values == sorted(values), phase
        if total is not None:
            assert values[-1] == total, (phase, values[-1], total)


def test_callback_hears_every_batch_and_which_epoch_is_timed(pair):
    raw, cached = pair
    cb = Recorder()
    compare_epochs(raw, cached, epochs=3, batch_size=256, callback=cb)  # 3 batches an epoch
    assert cb.size == 2 * 4 * 3 and cb.value == cb.size
    assert_only_forward(cb.log)
    assert cb.descriptions == ["raw, warm-up epoch (not counted)", "cached, warm-up epoch (not counted)",
                               "raw, timed epoch 1 of 3", "cached, timed epoch 1 of 3",
                               "raw, timed epoch 2 of 3", "cached, timed epoch 2 of 3",
                               "raw, timed epoch 3 of 3", "cached, timed epoch 3 of 3"]


def test_errors_name_the_fix(tmp_path, pair):
    raw, cached = pair
    with pytest.raises(ValueError, match="raw has 10 samples but cached has 600"):
        compare_epochs(SlowSource(n=10), cached)
    with pytest.raises(TypeError, match="pass an nbkit.CachedDataset"):
        compare_epochs(raw, SlowSource(n=600))
    with pytest.raises(ValueError, match="at least 1 epoch"):
        compare_epochs(raw, cached, epochs=0)


ROWS = _epochs([2.0, 4.0, 3.0], [0.25, 0.15, 0.2], filling=5.0)


def test_table_text_markdown_html():
    result = EpochComparison(ROWS)
    assert result.speedup == pytest.approx(3.0 / 0.2)
    md = result.table()
    lines = md.splitlines()
    assert lines[0] == "| epoch | seconds | samples per second | hit rate |"
    # Each epoch at its feed's digits, so the medians in the summary are these very strings.
    assert lines[2] == "| raw 0 (warm-up) | 2.2 | 455 | — |"
    assert lines[3] == "| cached 0 (filling) | 5.00 | 200 | 0% |"
    assert lines[5] == "| cached 1 | 0.25 | 4,000 | 100% |"
    assert [line.split(" | ")[1] for line in lines[4::2]] == ["2.0", "4.0", "3.0"]
    text = str(result)
    assert text.splitlines()[0].split() == ["epoch", "seconds", "samples", "per", "second", "hit", "rate"]
    assert "(warm-up) and (filling) epochs are not counted" in text
    # 3.0 s / 0.20 s is 15x: printed as 15, never rounded to "20" by the width of its range.
    assert "cached epochs are about 15× (8.0–27×) faster than raw: about 0.20 s (0.15–0.25 s) vs about " \
        "3.0 s (2.0–4.0 s)" in text
    page = result._repr_html_()
    assert page.count("<tr") == 9 and ">cached 0 (filling)</td>" in page
    assert "15× <span style='white-space:nowrap'>(8.0–27×)</span>" in page  # a range never breaks at its dash
    assert "white-space:normal" in page  # cells wrap at spaces (tests the width in Chromium: test_both_tables_fit...)
    with pytest.raises(ValueError, match="expected 'markdown' or 'text'"):
        result.table("latex")


def test_plot_shows_raw_filling_and_cached_as_three_bars(tmp_path):
    pytest.importorskip("matplotlib")
    fig = EpochComparison(ROWS, batch_size=64, num_workers=2).plot(path=tmp_path / "plot.png", title="MNIST")
    (ax,) = fig.axes
    bars = ax.patches
    assert [b.get_width() for b in bars] == [3.0, 5.0, 0.2]  # medians; the filling epoch once
    assert bars[1].get_hatch() == "//" and not bars[2].get_hatch()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["raw", "filling", "cached"]
    assert fig._suptitle.get_text() == "Cached: about 15× (8.0–27×) faster"
    assert [t.get_text() for t in ax.texts] == ["3.0 s", "5.00 s once", "0.20 s"]  # as the table prints them
    assert ax.get_title().replace("\n", " ") == (
        "MNIST: 1,000 samples an epoch, batch 64, median of 3 timed epochs, bars show the range")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lays the figure out as a notebook's PNG would
    return fig


def _legible_at_400_px(fig):
    """Shown 400 pixels wide (a phone, Colab's side panel), every text is at least ~12 pixels high
    (a 4-inch figure is shown at its own size, 100 dpi), lies inside the figure, and overlaps no other."""
    fig = _drawn(fig)
    width, _ = fig.get_size_inches()
    assert width * fig.dpi <= 400
    renderer = fig.canvas.get_renderer()
    texts = [t for ax in fig.axes for t in (*ax.texts, *ax.get_yticklabels(), ax.xaxis.label, ax.title)]
    texts += [t for ax in fig.axes for t, x in zip(ax.get_xticklabels(), ax.get_xticks())
              if ax.get_xlim()[0] <= x <= ax.get_xlim()[1]]  # the ticks drawn
    texts += [fig._suptitle] + [t for legend in fig.legends for t in legend.get_texts()]
    texts = [t for t in texts if t.get_text() and t.get_visible()]
    assert min(t.get_fontsize() for t in texts) >= 9
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in texts]
    for text, box in boxes:
        assert box.x0 >= -1 and box.x1 <= fig.bbox.x1 + 1 and box.y0 >= -1 and box.y1 <= fig.bbox.y1 + 1, text
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            overlap_x = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
            overlap_y = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
            assert overlap_x <= 1 or overlap_y <= 1, f"{a!r} overlaps {b!r}"
    return fig


@pytest.mark.parametrize("rows", [
    ROWS,
    # Ten epochs each (the notebook's slider maximum), from milliseconds to minutes.
    _epochs([90 + k for k in range(10)], [0.031 + 0.001 * k for k in range(10)], filling=120),
    # No speedup: the reason is in the subtitle, wrapped to the width.
    _epochs([1.0, 1.4, 1.2], [0.9, 1.1, 1.0]),
])
def test_plot_is_legible_at_400_px(rows):
    pytest.importorskip("matplotlib")
    _legible_at_400_px(EpochComparison(rows, batch_size=256, num_workers=0).plot(
        title="MNIST (offline stand-in), ToTensor + Normalize"))


def test_plot_without_matplotlib_names_the_extra():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from nbkit.bench import EpochComparison, EpochRow\n"
        "try:\n"
        "    EpochComparison([EpochRow('raw', 1, 1.0, 10)]).plot()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "(nbkit-cache's 'notebook' extra): pip install matplotlib" in out.stdout


def test_docstring_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    failures, tried = doctest.testmod(nbkit.bench, optionflags=doctest.ELLIPSIS)
    assert tried >= 4 and failures == 0


def test_compare_training_against_the_on_device_limit(tmp_path):
    from nbkit.bench import TrainingComparison, compare_training

    raw = TupleSource(96)
    cached = nbkit.CachedDataset(raw, tmp_path / "t")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    cb = Recorder()
    result = compare_training(raw, cached, model, epochs=3, batch_size=32, callback=cb)
    assert cached.is_complete  # warmed first: the limit needs every sample
    assert [r.loader for r in result.rows] == ["raw DataLoader", "nbkit ds.loader", "on-device limit"]
    assert all(len(r.epochs) == 3 and r.seconds == sorted(r.epochs)[1] and r.samples == 96 for r in result.rows)
    # The cold cache is warmed first, in samples, then 3 feeds x (1 untimed + 3 timed) epochs x 3 batches.
    assert [(phase, sizes[-1], values[-1]) for phase, sizes, values in phases_of(cb.log)] == [
        ("warmup", 96, 96), ("training", 3 * 4 * 3, 3 * 4 * 3)]
    assert_only_forward(cb.log)
    assert result.wait_share(result.rows[-1]) == 0.0
    text = str(result)
    assert "on-device limit" in text and "data wait" in text and f"training on {result.device} (" in text
    assert result.measured == ("median of 3 timed epochs of 96 samples per feed, interleaved, after one untimed "
                               "epoch each, the same batches for every feed")
    assert result.measured in text and text.splitlines()[0].split()[:3] == ["loader", "training", "epoch"]
    page = result._repr_html_()  # a card per feed: its name, then each column of the table as a line
    assert "<table" not in page and page.count("data wait:") == 3
    assert all(html_words(r.loader) in page for r in result.rows)
    fig = result.plot(path=tmp_path / "training.png", title="TupleSource")
    assert (tmp_path / "training.png").stat().st_size > 0
    _legible_at_400_px(fig)
    assert isinstance(result, TrainingComparison)


def test_compare_training_errors_name_the_fix(tmp_path):
    from nbkit.bench import compare_training

    raw = TupleSource(8)
    with pytest.raises(ValueError, match="at least 1 epoch"):
        compare_training(raw, nbkit.CachedDataset(raw, tmp_path / "c"), torch.nn.Linear(64, 10), epochs=0)
    with pytest.raises(TypeError, match="pass an nbkit.CachedDataset"):
        compare_training(raw, raw, torch.nn.Linear(64, 10))


class _Indexed(torch.utils.data.Dataset):
    """(image, its own index): the labels a loss function sees say which samples a batch held."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((1, 8, 8), float(i % 7)), i


def _recording_loss(seen):
    def loss(out, y):
        seen.append(y.tolist())
        return torch.nn.functional.cross_entropy(out, y % 10)
    return loss


def _compare_recorded(tmp_path, n: int, **budget):
    """``compare_training`` over ``n`` indexed samples; returns the result and every batch's labels, in order."""
    from nbkit.bench import compare_training

    raw = _Indexed(n)
    seen = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    result = compare_training(raw, nbkit.CachedDataset(raw, tmp_path / "t"), model, batch_size=32,
                              loss_fn=_recording_loss(seen), **budget)
    return result, seen


def test_compare_training_feeds_every_loader_the_same_batches_in_turn(tmp_path):
    result, seen = _compare_recorded(tmp_path, 100, epochs=3)
    passes = [seen[k:k + 4] for k in range(0, len(seen), 4)]  # 4 batches an epoch
    assert len(passes) == 3 * (1 + 3)  # 3 feeds x (the warm-up + 3 timed epochs), interleaved
    for r in range(4):  # in each round, raw, ds.loader and the limit read the same batches
        assert passes[3 * r] == passes[3 * r + 1] == passes[3 * r + 2]
    assert passes[0] != passes[3]  # reshuffled every epoch, the same way for every feed
    assert sorted(sum(passes[0], [])) == list(range(100))
    assert all(len(r.epochs) == 3 for r in result.rows)


def test_compare_training_with_a_step_budget_times_the_same_batches(tmp_path):
    result, seen = _compare_recorded(tmp_path, 320, steps=3)
    assert len(seen) == 3 * 3 * (2 + 3)  # 3 passes x 3 feeds x (2 untimed + 3 timed batches), not epochs of 10
    passes = [seen[k:k + 5] for k in range(0, len(seen), 5)]
    assert passes[0] == passes[1] == passes[2] and passes[3] == passes[4] == passes[5]
    assert all(len(r.epochs) == 3 and r.samples == 3 * 32 for r in result.rows)
    assert result.measured == ("3 batches of 32 a pass (30% of an epoch), median of 3 timed passes per feed, "
                               "interleaved, each after 2 untimed, the same batches for every feed")
    assert "pass of 3 batches" in str(result).splitlines()[0]
    assert result.measured in result.summary()


class FakeClock(Recorder):
    """The clock of a run and its callback at once: every batch costs the time its feed is given
    for the current pass (``costs[feed][pass]``, the last one repeating), so timings are exact."""

    def __init__(self, costs):
        super().__init__()
        self.costs, self.now, self.passes = costs, 0.0, {}

    def __call__(self):
        return self.now

    def set_description(self, text):
        super().set_description(text)
        self.feed = text.split(",")[0]
        self.passes[self.feed] = self.passes.get(self.feed, -1) + 1

    def relative_update(self, inc=1):
        super().relative_update(inc)
        costs = self.costs[self.feed]
        self.now += costs[min(self.passes[self.feed], len(costs) - 1)]


def _timed(monkeypatch, tmp_path, costs, n=64, **budget):
    from nbkit.bench import compare_training

    clock = FakeClock(costs)
    monkeypatch.setattr(nbkit.bench, "_clock", clock)
    raw = _Indexed(n)
    cached = nbkit.CachedDataset(raw, tmp_path / "t")
    cached.warmup()
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    result = compare_training(raw, cached, model, batch_size=16, callback=clock,
                              loss_fn=_recording_loss([]), **budget)
    return result, clock


RAW, NBKIT, LIMIT = "raw DataLoader", "nbkit ds.loader", "on-device limit"


def test_timed_epochs_are_interleaved_after_the_same_warm_up(monkeypatch, tmp_path):
    result, clock = _timed(monkeypatch, tmp_path, {RAW: [1.0], NBKIT: [0.5], LIMIT: [0.25]}, epochs=3)
    assert clock.descriptions == [f"{f}, warm-up epoch (not timed)" for f in (RAW, NBKIT, LIMIT)] + [
        f"{f}, timed epoch {k} of 3" for k in (1, 2, 3) for f in (RAW, NBKIT, LIMIT)]
    # 4 batches an epoch at the fake costs: the warm-up epochs are not in the timings.
    assert [r.epochs for r in result.rows] == [(4.0,) * 3, (2.0,) * 3, (1.0,) * 3]
    assert clock.size == clock.value == 3 * 4 * 4
    assert_only_forward(clock.log)


def test_one_training_epoch_is_raised_to_three_and_says_so(monkeypatch, tmp_path):
    result, clock = _timed(monkeypatch, tmp_path, {RAW: [1.0], NBKIT: [0.5], LIMIT: [0.25]}, epochs=1)
    assert all(len(r.epochs) == 3 for r in result.rows)
    assert result.measured.endswith("epochs=1 raised to 3 timed epochs per feed: fewer have no spread to judge "
                                    "a ratio by")


def test_a_feed_slower_than_the_limit_gets_a_ratio_with_the_digits_its_spread_supports(monkeypatch, tmp_path):
    # Per batch: raw 1.0-1.2 s, ds.loader 0.26-0.27 s, limit 0.24-0.25 s (the warm-up epoch first).
    costs = {RAW: [1.0, 1.0, 1.2, 1.1], NBKIT: [0.26, 0.26, 0.27, 0.26], LIMIT: [0.25, 0.25, 0.24, 0.25]}
    result, _ = _timed(monkeypatch, tmp_path, costs, epochs=3)
    raw, nbkit_row, limit = result.rows
    # Ratios from the medians (4.4 s / 1.00 s), their ranges from the typical passes.
    assert result.verdict(raw) == "slower" and result.ratio_text(raw) == "about 4.4× (4.0–4.8×)"
    assert result.verdict(nbkit_row) == "slower" and result.ratio_text(nbkit_row) == "1.04×"
    summary = result.summary()
    assert "raw DataLoader about 4.4 s (4.0–4.8 s): about 4.4× (4.0–4.8×) the limit, waiting for data about " \
           "77% (75–79%) of the time" in summary
    assert "on-device limit about 1.00 s (0.96–1.00 s)" in summary
    assert not re.search(r"\d\.\d{3,}", summary)  # never more digits than the spread holds


def test_a_feed_within_the_limits_spread_is_at_the_limit(monkeypatch, tmp_path):
    # ds.loader's median (0.98 s) is below the limit's (1.00 s), but within the limit's range.
    costs = {RAW: [1.0], NBKIT: [0.25, 0.24, 0.25, 0.245], LIMIT: [0.25, 0.25, 0.24, 0.26]}
    result, _ = _timed(monkeypatch, tmp_path, costs, epochs=3)
    assert result.verdict(result.rows[1]) == "limit"
    assert "nbkit ds.loader about 0.98 s (0.96–1.00 s): at the on-device limit, within this run's spread" \
        in result.summary()
    assert "×" not in result.summary().split("nbkit ds.loader")[1]  # no ratio for it, below or above 1
    pytest.importorskip("matplotlib")
    ax = result.plot().axes[0]
    widths = {round(p.get_y() + p.get_height() / 2): p.get_width() for p in ax.patches if p.get_width() > 0}
    assert widths[1] == pytest.approx(0.98) and widths[0] == pytest.approx(1.0)  # each at its own median
    assert "0.98 s, at the limit" in [t.get_text() for t in ax.texts]
    headline = " ".join(ax.figure._suptitle.get_text().split())  # the result, a clause per feed
    assert re.fullmatch(r"raw DataLoader waits for data \d+%; nbkit ds\.loader at the limit", headline), headline
    from nbkit.bench import TrainingComparison

    alone = TrainingComparison(result.rows[1:], device="cpu")  # only the feed at the limit: no wait to show
    assert alone.plot()._suptitle.get_text() == "nbkit ds.loader at the limit"


def test_a_feed_faster_than_the_limit_beyond_the_spread_is_noise_never_a_ratio(monkeypatch, tmp_path):
    # As reported: a busy machine made the limit's epochs slower than the feeds' (39 s vs 11 s).
    costs = {RAW: [0.5, 0.55, 0.5, 0.6], NBKIT: [0.3, 0.28, 0.3, 0.29], LIMIT: [1.0, 0.98, 1.0, 1.03]}
    result, _ = _timed(monkeypatch, tmp_path, costs, epochs=1)
    assert [result.verdict(r) for r in result.rows] == ["noise", "noise", "limit"]
    summary, table = result.summary(), result.table("text")
    assert summary.count(NOISE) == 2
    assert not re.search(r"0\.\d+ ?[x×]", summary + table)  # no ratio below the limit, anywhere
    assert "noise: rerun" in table
    pytest.importorskip("matplotlib")
    fig = result.plot()
    ax = fig.axes[0]
    # The noisy feeds are drawn as measured, grey, each labelled as noise (never as a result).
    assert [p.get_width() for p in ax.patches if p.get_width() > 0] == pytest.approx([2.2, 1.16, 4.0])
    assert [t.get_text() for t in ax.texts][:2] == ["2.2 s, noise: rerun", "1.16 s, noise: rerun"]
    # The headline states the result; "noise" qualifies each comparison it concerns, not the run.
    assert " ".join(fig._suptitle.get_text().split()) == (
        "raw DataLoader faster than the limit: noise, rerun; nbkit ds.loader faster than the limit: noise, rerun")
    _legible_at_400_px(fig)


def test_every_verdict_prints_its_rule_and_the_numbers_it_used(monkeypatch, tmp_path):
    """Issue 39: "faster than the limit by more than the run's spread" while the printed ranges
    overlapped, and the rule never shown. Now the summary prints the rule once and, with each
    verdict, the median ± MAD of the feed and of the limit: the reader can check the verdict."""
    from nbkit.bench import RULE, TrainingComparison, TrainingRow

    # The printed ranges (min–max) overlap: 0.9–1.3 s and 1.0–1.6 s; the typical ranges do not.
    result = TrainingComparison([TrainingRow(RAW, 0.92, (0.9, 0.92, 1.3), 100),
                                 TrainingRow(NBKIT, 0.92, (0.92, 1.3, 0.9), 100),
                                 TrainingRow(LIMIT, 1.2, (1.2, 1.6, 1.0), 100)], device="cpu")
    summary = result.summary()
    assert summary.count(RULE) == 1, summary
    for row in result.rows[:2]:
        assert result.verdict(row) == "noise", summary
        basis = re.search(re.escape(row.loader) + r"[^;]*\(median ± MAD ([\d.]+) ± ([\d.]+) s = ([\d.]+)–([\d.]+) s, "
                          r"the limit ([\d.]+) ± ([\d.]+) s = ([\d.]+)–([\d.]+) s\)", summary)
        assert basis, summary
        feed_hi, limit_lo = float(basis.group(4)), float(basis.group(7))
        assert feed_hi < limit_lo  # the numbers printed are the ones that decided
        lo, hi = row.spread.typical
        assert float(basis.group(3)) == pytest.approx(lo, rel=0.01) and feed_hi == pytest.approx(hi, rel=0.01)


def test_single_passes_are_never_compared():
    from nbkit.bench import TrainingComparison, TrainingRow

    result = TrainingComparison([TrainingRow(RAW, 11.34, (11.34,), 100), TrainingRow(LIMIT, 39.29, (39.29,), 100)],
                                device="cpu")
    assert result.verdict(result.rows[0]) == "unsure"
    assert "one timed pass cannot be compared with the limit (no spread)" in result.summary()
    assert "0.29" not in str(result)


def test_a_time_budget_sets_the_count_and_adds_passes_only_while_the_spread_is_wide(monkeypatch, tmp_path):
    # seconds=10: each raw pass gets 10 / 5 = 2 s, i.e. 4 batches at 0.5 s (after 2 untimed ones).
    steady = {RAW: [0.5], NBKIT: [0.2], LIMIT: [0.1]}
    result, clock = _timed(monkeypatch, tmp_path, steady, n=160, seconds=10)
    assert [len(r.epochs) for r in result.rows] == [3, 3, 3]  # narrow spread: the minimum
    assert result.rows[0].epochs == (2.0, 2.0, 2.0) and result.rows[2].epochs == pytest.approx((0.4, 0.4, 0.4))
    assert clock.descriptions[:4] == [f"{RAW}, timed pass 1 of 3: as many batches as fit in 2 s",
                                      f"{NBKIT}, timed pass 1 of 3",
                                      f"{LIMIT}, timed pass 1 of 3", f"{RAW}, timed pass 2 of 3"]
    # The raw feed's first pass counts the batches that fit (an unknown total: an indeterminate bar),
    # then the other 8 passes train that count, a total known before their first batch.
    assert [(phase, sizes[-1], values[-1]) for phase, sizes, values in phases_of(clock.log)] == [
        ("count", None, 2 + 4), ("training", 8 * (2 + 4), 8 * (2 + 4))]
    assert_only_forward(clock.log)
    assert "4 batches of 16 a pass" in result.measured and "a 10 s budget for the raw feed" in result.measured
    # A wide spread (raw passes of 2 and 3 s): more passes, as many as the 10 s budget holds.
    wide = {RAW: [0.5, 0.75], NBKIT: [0.2, 0.3], LIMIT: [0.1]}
    result, clock = _timed(monkeypatch, tmp_path / "wide", wide, n=160, seconds=10)
    assert [len(r.epochs) for r in result.rows] == [4, 4, 4]  # 2 + 3 + 3 + 3 s; a fifth would pass 12 s
    assert f"{RAW}, timed pass 4 of 4" in clock.descriptions
    # The extra round is a phase of its own, added after the third: no total raised under a drawn bar.
    assert [(phase, sizes[-1], values[-1]) for phase, sizes, values in phases_of(clock.log)] == [
        ("count", None, 2 + 4), ("training", 8 * (2 + 4), 8 * (2 + 4)), ("extra", 3 * (2 + 4), 3 * (2 + 4))]
    assert_only_forward(clock.log)
    assert sum(result.rows[0].epochs) <= 12


def test_compare_training_with_a_real_time_budget_lets_the_raw_feed_set_the_count(tmp_path):
    from nbkit.bench import compare_training

    class Slow(_Indexed):
        def __getitem__(self, i):
            time.sleep(0.002)
            return super().__getitem__(i)

    raw = Slow(2000)
    cached = nbkit.CachedDataset(raw, tmp_path / "t")
    cached.warmup()
    seen = []
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    result = compare_training(raw, cached, model, seconds=1.0, batch_size=50, loss_fn=_recording_loss(seen))
    per_pass = len(seen) // (3 * len(result.rows[0].epochs))
    steps = per_pass - 2
    assert 1 <= steps < 38  # a 50-sample raw batch takes >= 0.1 s: 0.2 s a pass stopped well before the epoch
    assert seen[:per_pass] == seen[per_pass:2 * per_pass] == seen[2 * per_pass:3 * per_pass]
    assert "a 1 s budget for the raw feed set the count" in result.measured


def test_compare_training_budget_arguments_are_checked(tmp_path):
    from nbkit.bench import compare_training

    raw = TupleSource(8)
    cached = nbkit.CachedDataset(raw, tmp_path / "c")
    with pytest.raises(ValueError, match="steps= or seconds=, not both"):
        compare_training(raw, cached, torch.nn.Linear(64, 10), steps=1, seconds=1)
    with pytest.raises(ValueError, match="steps=0"):
        compare_training(raw, cached, torch.nn.Linear(64, 10), steps=0)
    with pytest.raises(ValueError, match="seconds=-1"):
        compare_training(raw, cached, torch.nn.Linear(64, 10), seconds=-1)


def test_progress_bar_renders_the_callback(capsys):
    pytest.importorskip("ipywidgets")
    from nbkit.widgets import ProgressBar

    bar = ProgressBar("benchmark", min_interval=0)
    bar.set_size(6)
    bar.set_description("raw, timed epoch 1 of 3")
    bar.relative_update(6)
    bar.close()
    assert bar.text() == "benchmark: 6 of 6 batches, raw, timed epoch 1 of 3"
    assert "6/6" in capsys.readouterr().err  # outside a kernel: TextProgress lines
    bar.terminal = False  # as in a notebook: the widget shows the same numbers
    bar._draw()
    assert (bar.bar.value, bar.bar.max) == (6, 6) and "raw, timed epoch 1 of 3" in bar.note.value


# -- properties: what is drawn and printed is what was measured -----------------------------------

from hypothesis import given, settings
from hypothesis import strategies as st

from nbkit.bench import TrainingComparison, TrainingRow
from nbkit.bench import _Estimate

_SECONDS = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)
_PASSES = st.lists(_SECONDS, min_size=2, max_size=6)


def _number(text):
    """The first number in ``text`` (``"about 25 s (19–33 s)"`` → ``"25"``)."""
    return re.search(r"\d+(?:\.\d+)?", text).group(0)


@given(st.floats(min_value=1e-4, max_value=1e4), st.floats(min_value=0, max_value=3),
       st.floats(min_value=0, max_value=3))
def test_a_median_is_printed_inside_its_range_with_at_least_two_significant_digits(mid, below, above):
    lo, hi = mid / (1 + below), mid * (1 + above)
    e = _Estimate(lo, mid, hi)
    printed = float(e.fmt(mid))
    assert lo <= printed <= hi or math.isclose(printed, mid, rel_tol=0.005)
    # Never coarser than two significant digits: 25.2 is "25", 87 is "87", never "30" or "100".
    assert abs(printed - mid) <= 0.05 * mid + 1e-12
    assert e.text(" s").startswith(("about " + e.fmt(mid) + " s", e.fmt(mid) + " s"))


@settings(max_examples=150, deadline=None)
@given(raw=_PASSES, nbkit_times=_PASSES, limit=_PASSES)
def test_training_bars_sit_in_their_whiskers_and_print_what_the_table_prints(raw, nbkit_times, limit):
    rows = [TrainingRow(RAW, statistics.median(raw), tuple(raw), 100),
            TrainingRow(NBKIT, statistics.median(nbkit_times), tuple(nbkit_times), 100),
            TrainingRow(LIMIT, statistics.median(limit), tuple(limit), 100)]
    result = TrainingComparison(rows, device="cpu")
    table = [line.strip("| ").split(" | ") for line in result.table().splitlines()[2:]]
    for row, (name, value, lo, hi, parts, label), cells in zip(rows, result._bars(), table):
        # Every bar at its own feed's median, inside its own whisker (its fastest to slowest pass).
        assert value == pytest.approx(row.spread.median)
        assert lo <= value <= hi and (lo, hi) == (min(row.epochs), max(row.epochs))
        assert sum(length for _, length, _, _ in parts) == pytest.approx(value)
        # The bar's label is the table's median, to the same digits; its wait, the table's wait.
        assert label.split(" s")[0] == _number(cells[1])
        verdict = result.verdict(row)
        if verdict == "slower":
            assert re.search(r"waits (\S+)%", label).group(1) == _number(cells[3])
            assert len(parts) == 2 and parts[0][1] == pytest.approx(result.limit.spread.median)
        else:
            assert "waits" not in label and (cells[3] == "–" or row is result.limit)
        # A feed clearly slower than every limit pass is never "at the limit", nor noise.
        if min(row.epochs) > max(limit):
            assert verdict == "slower"
        if max(row.epochs) < min(limit):
            assert verdict == "noise"
        if verdict in ("limit", "noise", "unsure"):
            assert "×" not in result.ratio_text(row)


@settings(max_examples=25, deadline=None)
@given(raw=st.lists(_SECONDS, min_size=3, max_size=5), cached=st.lists(_SECONDS, min_size=3, max_size=5))
def test_epoch_headline_table_and_bars_print_the_same_numbers(raw, cached):
    rows = _epochs(raw, (cached * len(raw))[:len(raw)], filling=raw[0] * 2)
    result = EpochComparison(rows)
    table = {cells[0]: cells[1] for cells in (line.strip("| ").split(" | ") for line in result.table().splitlines()[2:])}
    summary = result.summary()
    for name in ("raw", "cached"):
        spread = getattr(result, name)
        median_row = [k for k, r in enumerate(result.rows) if r.dataset == name and r.counted
                      and r.seconds == spread.median]
        if median_row:  # an odd count: the median is one of the epochs, printed as the summary prints it
            assert table[result.rows[median_row[0]].label.split(" (")[0]] == spread.fmt(spread.median)
        assert spread.text() in summary or result.no_speedup
    if result.speedup_text:
        assert result.speedup_text in summary
        pytest.importorskip("matplotlib")
        fig = result.plot()
        assert fig._suptitle.get_text() == f"Cached: {result.speedup_text} faster"
        labels = [t.get_text() for t in fig.axes[0].texts]
        assert labels[0] == result.raw.short() and labels[-1] == result.cached.short()


# -- the tables at 400 px -------------------------------------------------------------------------

from fixtures_browser import chromium, page

# JupyterLab 4's rules for an HTML output (13 px, cells padded 0.5em, right-aligned), in an output
# area as wide as a 400-pixel window leaves it (the prompt stacks above the output below 760 px).
_LAB_CSS = """
body { font-family: system-ui, sans-serif; margin: 0; }
.out { width: 340px; overflow: auto; font-size: 13px; }
.out table { border-collapse: collapse; table-layout: fixed; margin: 0 auto 1em auto; }
.out td, .out th { padding: 0.5em; white-space: normal; max-width: none; text-align: right; vertical-align: middle; }
"""


def _overflow(page, html_output):
    page.set_viewport_size({"width": 400, "height": 800})
    page.set_content(f"<style>{_LAB_CSS}</style><div class='out'>{html_output}</div>")
    return page.evaluate("() => { const o = document.querySelector('.out');"
                         " return [o.scrollWidth, o.clientWidth, o.firstElementChild.offsetWidth]; }")


@pytest.mark.browser
def test_both_tables_fit_a_400_px_output_without_scrolling(page):
    epochs = EpochComparison(_epochs([40.9, 35.2, 44.1], [0.0149, 0.014, 0.028], filling=29.1), batch_size=256)
    rows = [TrainingRow(RAW, 12.1, (11.8, 12.1, 12.34), 60000), TrainingRow(NBKIT, 8.31, (8.02, 8.31, 9.66), 60000),
            TrainingRow(LIMIT, 8.1, (8.0, 8.1, 15.2), 60000)]
    training = TrainingComparison(rows, device="cpu", unit="pass of 12 batches")
    for result in (epochs, training):
        scroll, client, table = _overflow(page, result._repr_html_())
        assert scroll <= client and table <= client, (type(result).__name__, scroll, client, table)
    # The measure can fail: the same training table with cells kept on one line scrolls sideways.
    scroll, client, _ = _overflow(page, training._table().html(cell_style="white-space:nowrap"))
    assert scroll > client
