"""nbkit.widgets.meter without a browser: track loaders, read the HitRateMeter's widget values.

tests/widgets/test_view.py reruns this directory with ipywidgets 7.7.1 (Colab's TPU runtime).
"""

from __future__ import annotations

import io

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
    assert meter.counts_label.value.startswith("hits 1,200 · misses 600 · ")
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
