"""nbkit.bench: compare_epochs rows, table, plot, speedup; mnist_like's offline fallback."""

import doctest
import math
import subprocess
import sys
import time

import pytest
import torch

import nbkit
import nbkit.bench
from nbkit.bench import EpochComparison, EpochRow, compare_epochs, mnist_like
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
    assert [(r.dataset, r.epoch) for r in result.rows] == [
        ("raw", 1), ("raw", 2), ("raw", 3), ("cached", 1), ("cached", 2), ("cached", 3)]
    assert [r.filling for r in result.rows] == [False, False, False, True, False, False]
    assert [r.hit_rate for r in result.rows] == [None, None, None, 0.0, 1.0, 1.0]
    assert all(r.samples == 600 and r.seconds > 0 for r in result.rows)
    assert result.rows[0].samples_per_s == pytest.approx(600 / result.rows[0].seconds)
    assert cached.stats.complete  # the filling epoch stored every sample
    raw_mean = sum(r.seconds for r in result.rows[:3]) / 3
    steady_mean = (result.rows[4].seconds + result.rows[5].seconds) / 2
    assert result.raw_seconds == pytest.approx(raw_mean)
    assert result.cached_seconds == pytest.approx(steady_mean)
    assert result.filling_seconds == pytest.approx(result.rows[3].seconds)
    assert result.speedup == pytest.approx(raw_mean / steady_mean)


def test_a_warm_cache_has_no_filling_epoch(pair):
    raw, cached = pair
    cached.warmup()
    result = compare_epochs(raw, cached, epochs=2, batch_size=200)
    cached_rows = [r for r in result.rows if r.dataset == "cached"]
    assert [(r.filling, r.hit_rate) for r in cached_rows] == [(False, 1.0), (False, 1.0)]
    assert math.isnan(result.filling_seconds)
    assert "filling" not in result.summary()
    assert "faster than raw" in result.summary()


def test_a_partly_warm_cache_reports_its_hit_rate(pair):
    raw, cached = pair
    cached.warmup(shard=(0, 2))  # every other sample
    result = compare_epochs(raw, cached, epochs=2, batch_size=100)
    first, second = [r for r in result.rows if r.dataset == "cached"]
    assert first.filling and first.hit_rate == pytest.approx(0.5)
    assert not second.filling and second.hit_rate == 1.0


def test_hit_rates_count_reads_in_worker_processes(pair):
    raw, cached = pair
    result = compare_epochs(raw, cached, epochs=2, batch_size=100, num_workers=2)
    cached_rows = [r for r in result.rows if r.dataset == "cached"]
    assert [(r.filling, r.hit_rate) for r in cached_rows] == [(True, 0.0), (False, 1.0)]


def test_one_epoch_has_no_speedup_and_says_why(pair, tmp_path):
    raw, cached = pair
    result = compare_epochs(raw, cached, epochs=1)
    assert math.isnan(result.speedup)
    assert result.no_speedup.startswith("the only cached epoch filled the cache (an epoch that fills")
    assert result.no_speedup.endswith("run 2 or more epochs, or warm the cache up first")
    assert "nan" not in result.summary() and "no speedup measured: the only cached epoch" in result.summary()
    assert "nan" not in str(result) and "nan" not in result._repr_html_()
    pytest.importorskip("matplotlib")
    fig = result.plot(tmp_path / "one.png")
    assert fig._suptitle.get_text() == "No speedup measured"
    assert fig.axes[0].get_title().endswith("the only cached epoch filled the cache: run 2 or more epochs")
    # A warm cache has a steady-state epoch from the start: one epoch is enough then.
    assert compare_epochs(raw, cached, epochs=1).no_speedup == ""


def test_every_reason_for_no_speedup():
    filling = [EpochRow("cached", 1, 2.5, 1000, 0.0, True), EpochRow("cached", 2, 2.0, 1000, 0.5, True)]
    assert EpochComparison([EpochRow("raw", 1, 2.0, 1000)] + filling).no_speedup.startswith(
        "every cached epoch filled the cache")
    assert EpochComparison([EpochRow("raw", 1, 2.0, 1000)]).no_speedup == \
        "no cached epoch was timed; include the cached dataset's epochs"
    assert EpochComparison(filling[:1]).no_speedup.startswith("no raw epoch was timed")
    assert all(math.isnan(EpochComparison(rows).speedup) for rows in ([], filling))


def test_collate_defaults_and_override(pair):
    raw, cached = pair
    seen = []

    def collate(batch):
        seen.append(type(batch).__name__)
        return torch.utils.data.default_collate(list(batch))

    compare_epochs(raw, cached, epochs=1, batch_size=300, collate_fn=collate)
    # Both loaders use the given collate_fn: two raw batches of plain lists, two cached SampleBatches.
    assert seen == ["list", "list", "SampleBatch", "SampleBatch"]
    assert nbkit.bench._default_collate(cached) is nbkit.collate
    assert nbkit.bench._default_collate(raw) is None


def test_callback_hears_every_batch(pair):
    raw, cached = pair

    class Recorder(Callback):
        def __init__(self):
            super().__init__()
            self.descriptions = []

        def set_description(self, text):
            self.descriptions.append(text)

    cb = Recorder()
    compare_epochs(raw, cached, epochs=2, batch_size=256, callback=cb)  # 3 batches an epoch
    assert cb.size == 12 and cb.value == 12
    assert cb.descriptions == ["raw epoch 1/2", "raw epoch 2/2", "cached epoch 1/2", "cached epoch 2/2"]


def test_errors_name_the_fix(tmp_path, pair):
    raw, cached = pair
    with pytest.raises(ValueError, match="raw has 10 samples but cached has 600"):
        compare_epochs(SlowSource(n=10), cached)
    with pytest.raises(TypeError, match="pass an nbkit.CachedDataset"):
        compare_epochs(raw, SlowSource(n=600))
    with pytest.raises(ValueError, match="at least 1 epoch"):
        compare_epochs(raw, cached, epochs=0)


ROWS = [
    EpochRow("raw", 1, 2.0, 1000),
    EpochRow("raw", 2, 4.0, 1000),
    EpochRow("cached", 1, 5.0, 1000, 0.0, True),
    EpochRow("cached", 2, 0.25, 1000, 1.0),
    EpochRow("cached", 3, 0.15, 1000, 1.0),
]


def test_table_text_markdown_html():
    result = EpochComparison(ROWS)
    assert result.speedup == pytest.approx(3.0 / 0.2)
    md = result.table()
    lines = md.splitlines()
    assert lines[0] == "| dataset | epoch | seconds | samples/s | hit rate | note |"
    assert lines[4] == "| cached | 1 | 5.000 | 200 | 0% | fills the cache |"
    assert lines[5] == "| cached | 2 | 0.250 | 4,000 | 100% |  |"
    assert "| raw | 1 | 2.000 | 500 | — |  |" in md
    text = str(result)
    assert text.splitlines()[0].split() == ["dataset", "epoch", "seconds", "samples/s", "hit", "rate", "note"]
    assert "cached epochs are 15.0x faster than raw: 0.2 s vs 3 s an epoch; filling the cache took 5 s" in text
    page = result._repr_html_()
    assert page.count("<tr") == 6 and "<td>fills the cache</td>" in page and "15.0x faster" in page
    with pytest.raises(ValueError, match="expected 'markdown' or 'text'"):
        result.table("latex")


def test_plot_shows_raw_filling_and_cached_apart(tmp_path):
    pytest.importorskip("matplotlib")
    fig = EpochComparison(ROWS, batch_size=64, num_workers=2).plot(path=tmp_path / "plot.png", title="MNIST")
    (ax,) = fig.axes  # one panel: samples/s is the same story, so it is in the labels, not a second axis
    bars = ax.patches
    assert [b.get_width() for b in bars] == [2.0, 4.0, 5.0, 0.25, 0.15]
    colours = [b.get_facecolor() for b in bars]
    assert colours[0] == colours[1] != colours[2] != colours[3] == colours[4]
    assert bars[2].get_hatch() == "//" and not bars[3].get_hatch()
    # Run order from the top, with a gap between the raw and the cached group.
    ys = [b.get_y() for b in bars]
    assert ys == sorted(ys, reverse=True) and ys[1] - ys[2] > ys[0] - ys[1]
    assert [t.get_text() for t in ax.get_yticklabels()] == [
        "raw, epoch 1", "raw, epoch 2", "cached, epoch 1", "cached, epoch 2", "cached, epoch 3"]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["raw: transforms every epoch", "cached, filling the cache", "cached, read from the cache"]
    assert fig._suptitle.get_text() == "Cached epochs are 15.0× faster than raw"
    assert ax.get_title() == "MNIST\n1,000 samples an epoch · batch size 64 · num_workers=2"
    assert [t.get_text() for t in ax.texts] == [
        "2.00s · 500/s", "4.00s · 250/s", "5.00s · 200/s · hits 0%", "0.25s · 4.00k/s · hits 100%",
        "0.15s · 6.67k/s · hits 100%"]
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()  # lays the figure out as a notebook's PNG would
    return fig


def _readable_at_600_px(fig):
    """Shown 600 pixels wide (Colab's side panel, a phone), every text is at least ~8 pixels high:
    the figure is at most 6.4 inches wide and its text at least 10 points."""
    width, _ = fig.get_size_inches()
    assert width <= 6.4
    texts = [t for ax in fig.axes for t in (*ax.texts, *ax.get_yticklabels(), *ax.get_xticklabels(), ax.xaxis.label)]
    texts += list(fig.legends[0].get_texts())
    assert texts and min(t.get_fontsize() for t in texts if t.get_text()) >= 10
    # Nothing drawn outside the figure (a label running off the right edge is cut in a notebook).
    renderer = fig.canvas.get_renderer()
    right = fig.bbox.x1
    assert all(t.get_window_extent(renderer).x1 <= right + 1 for ax in fig.axes for t in ax.texts)


@pytest.mark.parametrize("rows", [
    ROWS,
    # Rates of 3,000-4,000 samples/s: the old plot's axis read "4k 4k 3k".
    [EpochRow("raw", 1, 1000 / 3000, 1000), EpochRow("raw", 2, 1000 / 3400, 1000),
     EpochRow("cached", 1, 1000 / 3700, 1000, 0.0, True), EpochRow("cached", 2, 1000 / 4000, 1000, 1.0)],
    # Ten epochs each (the notebook's slider maximum), from milliseconds to minutes.
    [EpochRow("raw", k, 90 + k, 60000) for k in range(1, 11)]
    + [EpochRow("cached", 1, 120, 60000, 0.0, True)] + [EpochRow("cached", k, 0.031, 60000, 1.0) for k in range(2, 11)],
])
def test_plot_reads_at_600_px_and_no_tick_label_repeats(rows, tmp_path):
    pytest.importorskip("matplotlib")
    fig = _drawn(EpochComparison(rows, batch_size=256, num_workers=0).plot(title="MNIST (offline stand-in), ToTensor + Normalize"))
    _readable_at_600_px(fig)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert len(ticks) >= 3 and len(set(ticks)) == len(ticks), ticks
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert len(set(labels)) == len(labels) or len(rows) > 6, labels  # distinct rates read distinct
    # The height grows with the epochs, so bars never get thinner than a line of text.
    assert fig.get_size_inches()[1] >= 0.36 * len(rows)


def test_rate_labels_keep_three_digits():
    from nbkit.bench import _rate_label

    assert [_rate_label(v) for v in (3012, 3499, 3987, 4012)] == ["3.01k", "3.50k", "3.99k", "4.01k"]
    assert [_rate_label(v) for v in (7.5, 250, 26000, 1.03e6, math.inf)] == ["7.50", "250", "26.0k", "1.03M", "∞"]


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
    assert "pip install 'nbkit[notebook]'" in out.stdout


def test_mnist_like_offline_fallback_says_so(tmp_path, capsys):
    ds = mnist_like("FashionMNIST", tmp_path, download=False, offline_samples=120)
    assert ds.nbkit_source == "offline" and len(ds) == 120
    assert type(ds).__name__ == "FashionMNIST"
    out = capsys.readouterr().out
    assert "Using offline FashionMNIST-format stand-in data (120 samples)" in out
    assert (tmp_path / "nbkit-offline-120" / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").exists()
    # The stand-in never masquerades as the real data: nothing under root/FashionMNIST.
    assert not (tmp_path / "FashionMNIST").exists()
    test = mnist_like("FashionMNIST", tmp_path, train=False, download=False, offline_samples=120)
    assert len(test) == 20


def test_mnist_like_reuses_offline_files(tmp_path):
    mnist_like("MNIST", tmp_path, download=False, offline_samples=60)
    images = tmp_path / "nbkit-offline-60" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    before = images.stat().st_mtime_ns
    mnist_like("MNIST", tmp_path, download=False, offline_samples=60)
    assert images.stat().st_mtime_ns == before


def test_emnist_falls_back_to_mnist_format(tmp_path, capsys):
    ds = mnist_like("EMNIST", tmp_path, download=False, offline_samples=60)
    assert type(ds).__name__ == "MNIST" and ds.nbkit_source == "offline"
    assert "EMNIST has no offline layout; using MNIST-format data instead" in capsys.readouterr().out


def test_real_data_under_root_is_used(tmp_path, capsys):
    from nbkit.offline import write_mnist

    write_mnist(tmp_path, name="KMNIST", n_train=50, n_test=10)  # as if downloaded earlier
    ds = mnist_like("KMNIST", tmp_path, download=False)
    assert ds.nbkit_source == "real" and len(ds) == 50
    assert capsys.readouterr().out == ""


def test_transform_is_applied(tmp_path):
    import torchvision.transforms as T

    ds = mnist_like("MNIST", tmp_path, download=False, offline_samples=60, transform=T.ToTensor())
    image, label = ds[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and 0 <= int(label) < 10


def test_download_attempt_falls_back_without_a_network(tmp_path, capsys):
    # This machine and CI have no route to the dataset mirrors: the attempt must fail (fast, with a
    # short socket timeout) and fall back. Where a network exists, the real data is fine too.
    ds = mnist_like("MNIST", tmp_path, download=True, offline_samples=60, timeout=3)
    if ds.nbkit_source == "offline":
        assert "the download failed" in capsys.readouterr().out
    else:
        assert len(ds) == 60000
    assert nbkit.bench.socket.getdefaulttimeout() is None  # the global timeout was restored


def test_unknown_dataset_name(tmp_path):
    with pytest.raises(ValueError, match="expected one of MNIST, FashionMNIST, KMNIST, EMNIST"):
        mnist_like("CIFAR10", tmp_path)


def test_docstring_examples(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    failures, tried = doctest.testmod(nbkit.bench, optionflags=doctest.ELLIPSIS)
    assert tried >= 4 and failures == 0


def test_compare_training_against_the_on_device_limit(tmp_path):
    from nbkit.bench import TrainingComparison, compare_training

    raw = TupleSource(96)
    cached = nbkit.CachedDataset(raw, tmp_path / "t")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    seen = []
    cb = Callback()
    cb.relative_update = lambda inc=1: seen.append(inc)
    result = compare_training(raw, cached, model, epochs=2, batch_size=32, callback=cb)
    assert cached.is_complete  # warmed first: the limit needs every sample
    assert [r.loader for r in result.rows] == ["raw DataLoader", "nbkit ds.loader", "on-device limit"]
    assert all(len(r.epochs) == 2 and r.seconds == min(r.epochs) and r.samples == 96 for r in result.rows)
    assert len(seen) == 3 * 3 * 3  # 3 loaders x (1 untimed + 2 timed) epochs x 3 batches
    assert result.wait_share(result.rows[-1]) == 0.0
    assert 0.0 <= result.wait_share(result.rows[0]) < 1.0
    text = str(result)
    assert "on-device limit" in text and "data wait" in text and f"training on {result.device} (" in text
    assert result.measured == "best of 2 epochs of 96 samples after one untimed epoch, the same batches for every feed"
    assert result.measured in text and text.splitlines()[0].split()[:3] == ["loader", "training", "epoch"]
    assert "<table" in result._repr_html_()
    fig = result.plot(path=tmp_path / "training.png", title="TupleSource")
    assert (tmp_path / "training.png").stat().st_size > 0
    assert "waits" in " ".join(t.get_text() for t in fig.axes[0].texts)
    _readable_at_600_px(_drawn(fig))
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


def test_compare_training_feeds_every_loader_the_same_batches(tmp_path):
    result, seen = _compare_recorded(tmp_path, 100, epochs=2)
    per_feed = len(seen) // 3
    raw_b, loader_b, limit_b = seen[:per_feed], seen[per_feed:2 * per_feed], seen[2 * per_feed:]
    assert raw_b == loader_b == limit_b and per_feed == 3 * 4  # (1 untimed + 2 timed) epochs x 4 batches
    assert raw_b[:4] != raw_b[4:8]  # reshuffled every epoch, the same way for every feed
    assert sorted(sum(raw_b[:4], [])) == list(range(100))
    assert all(len(r.epochs) == 2 for r in result.rows)


def test_compare_training_with_a_step_budget_times_the_same_batches(tmp_path):
    result, seen = _compare_recorded(tmp_path, 320, steps=3)
    assert len(seen) == 3 * (2 + 3)  # 2 untimed + 3 timed batches per feed, not 3 epochs of 10
    assert seen[:5] == seen[5:10] == seen[10:15]
    assert all(len(r.epochs) == 1 and r.samples == 3 * 32 for r in result.rows)
    assert result.measured == ("3 batches of 32 per feed (30% of an epoch), after 2 untimed, "
                               "the same batches for every feed")
    assert "3 training batches" in str(result).splitlines()[0]
    assert result.measured in result.summary()


def test_compare_training_with_a_time_budget_lets_the_raw_feed_set_the_count(tmp_path):
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
    start = time.perf_counter()
    result = compare_training(raw, cached, model, seconds=0.3, batch_size=50, loss_fn=_recording_loss(seen))
    assert time.perf_counter() - start < 20
    steps = len(seen) // 3 - 2
    assert 1 <= steps < 38  # a 50-sample raw batch takes >= 0.1 s: the budget stopped it well before the epoch
    assert seen[:steps + 2] == seen[steps + 2:2 * steps + 4] == seen[2 * steps + 4:]
    assert result.rows[0].seconds >= 0.3
    assert "a 0.3 s budget for the raw feed set the count" in result.measured


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
