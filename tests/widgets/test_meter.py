"""nbkit.widgets.meter without a browser: track loaders, read the HitRateMeter's widget values.

tests/widgets/test_view.py reruns this directory with ipywidgets 7.7.1 (Colab's TPU runtime).
"""

from __future__ import annotations

import io
import re
import time

import pytest
import torch
from torch.utils.data import DataLoader

import nbkit
from nbkit.widgets import HitRateMeter
from sources import TupleSource
from widget_sources import filled as _filled


def test_meter_tracks_the_filling_epoch_and_the_later_ones(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(600), str(tmp_path / "c"))
    out = io.StringIO()
    meter = HitRateMeter(ds, file=out)
    loader = DataLoader(ds, batch_size=50, shuffle=True)
    for _ in range(3):
        n = sum(len(y) for _, y in meter.track(loader))
        assert n == 600
    assert [(e.epoch, e.hits, e.misses) for e in meter.epochs] == [(1, 0, 600), (2, 600, 0), (3, 600, 0)]
    assert [e.filling for e in meter.epochs] == [True, False, False]
    assert meter.current.hit_rate == 1.0 and meter.overall().hit_rate == pytest.approx(2 / 3)
    assert "epoch 3: <b>100.0%</b>" in meter.headline.value and "overall 66.7%" in meter.headline.value
    assert re.sub(r"<[^>]+>", "", meter.counts_label.value).startswith("hits 1,200 · misses 600 · ")
    assert meter.rate_bar.value == 1.0
    table = meter.table.value
    assert table.count("<tr>") == 4  # header + 3 epochs
    assert "filling the cache" in table and "from the cache" in table
    assert "running" not in table  # the last pass ended
    # No kernel here: one text line per finished epoch went to the log.
    finished = [line for line in out.getvalue().splitlines() if "hit rate" in line]
    assert finished[-1].startswith("nbkit hit rate: epoch 3 100.0% (600 hits, 0 misses")
    assert len(finished) <= 3 + 3  # per epoch at most one summary and one periodic line


def test_meter_counts_reads_in_dataloader_workers(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(800), str(tmp_path / "c"))
    meter = HitRateMeter(ds, file=io.StringIO())
    loader = DataLoader(ds, batch_size=100, num_workers=2, collate_fn=nbkit.collate)
    for _ in range(2):
        for _ in meter.track(loader):
            pass
    assert [(e.hits, e.misses) for e in meter.epochs] == [(0, 800), (800, 0)]


def test_meter_update_is_throttled(tmp_path):
    ds = _filled(tmp_path, n=100)
    meter = HitRateMeter(ds, min_interval=3600, file=io.StringIO())
    first = meter.renders
    for i in range(100):
        ds[i]
        meter.update()
    assert meter.renders == first  # an hour has not passed
    meter.update(force=True)
    assert meter.renders == first + 1 and meter.current.hits == 100

    eager = HitRateMeter(ds, min_interval=0, file=io.StringIO())
    before = eager.renders
    for _ in range(10):
        eager.update()
    assert eager.renders == before + 10


def test_meter_manual_epochs_and_reset_stats(tmp_path):
    ds = _filled(tmp_path, n=50)
    meter = HitRateMeter(ds, file=io.StringIO())
    meter.new_epoch()  # before any read: harmless
    meter.new_epoch()
    assert len(meter.epochs) == 1
    for i in range(50):
        ds[i]
    meter.new_epoch()
    ds.reset_stats()  # counters go back to zero under the meter's feet
    for i in range(20):
        ds[i]
    meter.update(force=True)
    assert [(e.epoch, e.hits, e.misses) for e in meter.epochs] == [(1, 50, 0), (2, 20, 0)]
    assert meter.overall().hits == 70


def test_meter_shows_the_running_epoch_while_tracking(tmp_path):
    ds = _filled(tmp_path, n=40)
    meter = HitRateMeter(ds, min_interval=0, file=io.StringIO())
    seen = []
    for _ in meter.track(DataLoader(ds, batch_size=10)):
        seen.append(("running" in meter.table.value, meter.current.hits))
    assert seen == [(True, 10), (True, 20), (True, 30), (True, 40)]
    assert "running" not in meter.table.value and len(meter.track(range(3))) == 3



def test_meter_text_before_the_first_read_says_so(tmp_path):
    ds = _filled(tmp_path, 40)
    meter = HitRateMeter(ds, min_interval=0)
    assert meter.text() == "nbkit hit rate: no samples read yet"
    for _ in meter.track(DataLoader(ds, batch_size=10)):
        pass
    assert meter.text().startswith("nbkit hit rate: epoch 1 100.0% (40 hits, 0 misses, ")


def test_hit_rate_meter_shows_the_byte_budget(tmp_path):
    n = 400
    ds = nbkit.CachedDataset(TupleSource(n), str(tmp_path / "c"), max_bytes=n * 24 + 100 * (8 * 8 * 4 + 8))
    ds.warmup()
    meter = HitRateMeter(ds, min_interval=0)
    for _ in meter.track(torch.utils.data.DataLoader(ds, batch_size=50, shuffle=True, collate_fn=nbkit.collate)):
        pass
    meter.update(force=True)
    assert "budget: 100 of 400 samples cacheable (25.0% max hit rate)" in meter.text()
    assert "budget" in meter.counts_label.value
    assert abs(meter.overall().hit_rate - 0.25) < 1e-9


# -- what the loop consumed, not what the loader read ahead (issue 13, point 10) ---------------------


def _wait_for_read_ahead(ds, beyond):
    """Wait until the cache has served more than ``beyond`` samples: the loader has read ahead."""
    deadline = time.monotonic() + 60
    while ds.stats.reads <= beyond:
        assert time.monotonic() < deadline, f"the loader never read past {beyond} samples"
        time.sleep(0.01)


def test_a_device_loader_epoch_counts_the_batches_the_loop_got(tmp_path):
    ds = _filled(tmp_path, n=400)
    meter = HitRateMeter(ds, min_interval=0, file=io.StringIO())
    loader = ds.loader(10, prefetch=3)
    for k, _ in enumerate(meter.track(loader)):
        if k == 4:
            _wait_for_read_ahead(ds, 50)  # the loader's thread holds batches the loop never takes
            break
    cut = meter.epochs[-1]
    assert (cut.samples, cut.hits, cut.misses, cut.batches, cut.planned) == (50, 50, 0, 5, 40)
    assert cut.cut_short and cut.read_ahead > 0
    assert f"epoch 1 cut short: 5 of 40 batches; {cut.read_ahead} samples read ahead were not used" in meter.table.value
    assert "cut short: 5 of 40 batches" in meter.text()
    for _ in meter.track(loader):
        pass
    full = meter.epochs[-1]
    assert (full.epoch, full.samples, full.hits, full.cut_short, full.read_ahead) == (2, 400, 400, False, 0)
    assert meter.overall().samples == 450 and meter.overall().hits == 450
    assert meter.table.value.count("cut short") == 2  # the row's last cell and its note


def test_a_dataloader_epoch_counts_consumed_samples_and_shows_its_workers_read_ahead(tmp_path):
    ds = _filled(tmp_path, n=400)
    meter = HitRateMeter(ds, min_interval=0, file=io.StringIO())
    loader = DataLoader(ds, batch_size=10, shuffle=True, num_workers=2, collate_fn=nbkit.collate)
    for k, _ in enumerate(meter.track(loader)):
        if k == 1:
            _wait_for_read_ahead(ds, 20)
            break
    e = meter.epochs[-1]
    # Workers cannot say which batch hit: hits and misses are the cache's reads over the pass,
    # read-ahead included, and the part the loop never got is shown apart.
    assert (e.samples, e.batches, e.cut_short) == (20, 2, True)
    assert e.reads > 20 and e.read_ahead == e.reads - 20
    assert (f"epoch 1 cut short: 2 of 40 batches; its hits and misses include {e.read_ahead} samples read ahead, "
            "never used") in meter.table.value


def test_steps_run_over_passes_each_one_epoch(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(100), str(tmp_path / "c"))
    meter = HitRateMeter(ds, min_interval=0, file=io.StringIO())
    loader = ds.loader(32, drop_last=True)  # 3 batches a pass
    tracked = meter.track(loader, steps=7)
    assert len(tracked) == 7
    sizes = [len(y) for _, y in tracked]
    assert sizes == [32] * 7
    assert [(e.epoch, e.samples, e.batches, e.cut_short) for e in meter.epochs] == [
        (1, 96, 3, False), (2, 96, 3, False), (3, 32, 1, True)]
    assert all(e.hits + e.misses == e.samples for e in meter.epochs)
    assert meter.epochs[0].misses == 96 and meter.overall().samples == 7 * 32
    assert "epoch 3 cut short: 1 of 3 batches" in meter.table.value and "running" not in meter.table.value
    assert loader.epoch == 3  # each pass was a new shuffle

    # A DataLoader, and steps that end exactly at the end of a pass: no epoch is cut short.
    meter = HitRateMeter(ds, min_interval=0, file=io.StringIO())
    assert sum(1 for _ in meter.track(DataLoader(ds, batch_size=20), steps=10)) == 10
    assert [(e.samples, e.cut_short) for e in meter.epochs] == [(100, False), (100, False)]


def test_steps_stop_with_a_clear_error_when_a_pass_yields_nothing(tmp_path):
    ds = _filled(tmp_path, n=50)
    meter = HitRateMeter(ds, file=io.StringIO())
    with pytest.raises(RuntimeError, match=r"pass 1 over the loader yielded no batch after 0 of 10 steps") as e:
        for _ in meter.track(ds.loader(64, drop_last=True), steps=10):
            pass
    message = str(e.value)
    assert "len(loader) = 0, len(dataset) = 50, batch_size = 64, drop_last = True" in message
    assert "drop_last=True with a batch_size larger than the dataset" in message

    batches = (b for b in DataLoader(ds, batch_size=10))  # a generator is used up after one pass
    with pytest.raises(RuntimeError, match=r"pass 2 over the loader yielded no batch after 5 of 100 steps.*iter\(loader\)"):
        for _ in meter.track(batches, steps=100):
            pass
    with pytest.raises(ValueError, match="steps"):
        meter.track(ds.loader(10), steps=-1).__iter__().__next__()


def test_items_of_an_unbatched_dataloader_are_single_samples(tmp_path):
    ds = _filled(tmp_path, n=20)
    meter = HitRateMeter(ds, file=io.StringIO())
    assert sum(1 for _ in meter.track(DataLoader(ds, batch_size=None), steps=25)) == 25
    assert [(e.samples, e.reads, e.cut_short) for e in meter.epochs] == [(20, 20, False), (5, 5, True)]


def test_the_meter_fits_a_narrow_screen(tmp_path):
    """Seven short cells a row that never wrap (tests/test_browser.py checks 400 and 600 px in both
    front ends); an epoch cut short is explained under the table; where the columns do not fit, each
    epoch becomes one line of whole units (a container query), never a box scrolled sideways."""
    ds = _filled(tmp_path, n=20)
    meter = HitRateMeter(ds, file=io.StringIO())
    for k, _ in enumerate(meter.track(DataLoader(ds, batch_size=5))):
        if k == 1:
            break
    html = meter.table.value
    style, table = re.fullmatch(r"<style>(.*)</style><div class='nbkit-epochs-box'>(<table.*)</div>", html).groups()
    assert table.count("<th ") == 7 and "class='nbkit-epochs'" in table
    assert table.count("white-space:nowrap") == 7 * 2  # header and the one epoch
    assert "<td style='padding:1px 4px;white-space:nowrap;text-align:left;color:#555555'>cut short</td>" in table
    assert "<li>epoch 1 cut short: 2 of 4 batches</li>" in table
    assert "container-type:inline-size" in style and "@container (max-width: 420px)" in style
    assert ".nbkit-epochs thead{display:none}" in style and ".nbkit-epochs td{display:inline-block" in style
    headline, counts, table_widget = meter.widget.children
    assert "wrap" in headline.layout.flex_flow and headline.children[1].layout.flex == "0 1 300px"  # shrinks to fit
    assert table_widget is meter.table  # no scroller around it
