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


def test_one_epoch_has_no_speedup_and_says_why(pair):
    raw, cached = pair
    result = compare_epochs(raw, cached, epochs=1)
    assert math.isnan(result.speedup)
    assert "epochs >= 2" in result.summary()


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
    ax_time, ax_rate = fig.axes
    assert [b.get_height() for b in ax_time.patches] == [2.0, 4.0, 5.0, 0.25, 0.15]
    assert [round(b.get_height()) for b in ax_rate.patches] == [500, 250, 200, 4000, 6667]
    colours = [b.get_facecolor() for b in ax_time.patches]
    assert colours[0] == colours[1] != colours[2] != colours[3] == colours[4]
    assert ax_time.patches[2].get_hatch() == "//" and not ax_time.patches[3].get_hatch()
    # Cached bars stand apart from the raw ones (a gap between the groups).
    xs = [b.get_x() for b in ax_time.patches]
    assert xs[2] - xs[1] > xs[1] - xs[0]
    ticks = [t.get_text() for t in ax_time.get_xticklabels()]
    assert ticks[0] == "raw\nepoch 1" and ticks[2] == "cached\nepoch 1\nhits 0%"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["raw dataset (transform every time)", "cached, first epoch (fills the cache)",
                      "cached, served from the cache"]
    assert "15.0× faster" in fig._suptitle.get_text()
    assert "MNIST · 1,000 samples an epoch · batch size 64 · num_workers=2" in [t.get_text() for t in fig.texts]
    assert [t.get_text() for t in ax_time.texts] == ["2.00s", "4.00s", "5.00s", "0.25s", "0.15s"]
    assert [t.get_text() for t in ax_rate.texts] == ["500", "250", "200", "4k", "7k"]
    png = (tmp_path / "plot.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


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
    assert "on-device limit" in text and "data wait" in text and f"training epochs on {result.device}" in text
    assert "<table" in result._repr_html_()
    fig = result.plot(path=tmp_path / "training.png", title="TupleSource")
    assert (tmp_path / "training.png").stat().st_size > 0
    assert "waits" in " ".join(t.get_text() for t in fig.axes[0].texts)
    assert isinstance(result, TrainingComparison)


def test_compare_training_errors_name_the_fix(tmp_path):
    from nbkit.bench import compare_training

    raw = TupleSource(8)
    with pytest.raises(ValueError, match="at least 1 epoch"):
        compare_training(raw, nbkit.CachedDataset(raw, tmp_path / "c"), torch.nn.Linear(64, 10), epochs=0)
    with pytest.raises(TypeError, match="pass an nbkit.CachedDataset"):
        compare_training(raw, raw, torch.nn.Linear(64, 10))
