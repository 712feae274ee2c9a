"""nbkit.widgets without a browser: click the buttons, read the widget values.

Run: ``PJRT_DEVICE=CPU .venv/bin/python -m pytest tests/test_widgets.py``. The last test runs this
same file again in a subprocess with ipywidgets 7.7.1 (Colab's TPU runtime) first on the path.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import nbkit
from nbkit.widgets import EpochStats, HitRateMeter, PanelState, WarmupPanel
from servers import free_port
from sources import TupleSource

REPO = Path(__file__).resolve().parents[1]
WIDGETS7_REQUIREMENTS = Path(__file__).parent / "widgets7" / "requirements.txt"


class GatedSource(TupleSource):
    """Blocks at index ``at`` once armed, until the test releases it: a warmup caught mid-run."""

    def __init__(self, n):
        super().__init__(n)
        self.at = None
        self.reached = threading.Event()
        self.release = threading.Event()

    def __getitem__(self, i):
        if self.at is not None and i == self.at:
            self.reached.set()
            self.release.wait(timeout=60)
        return super().__getitem__(i)


class FailingSource(TupleSource):
    """Raises at index ``bad`` once armed (after the cache was created)."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = bad
        self.armed = False

    def __getitem__(self, i):
        if self.armed and i == self.bad:
            raise OSError(f"source image {i} is unreadable")
        return super().__getitem__(i)


def _filled(tmp_path, n=300, name="cache"):
    ds = nbkit.CachedDataset(TupleSource(n), str(tmp_path / name))
    ds.warmup()
    return ds


# -- optional import --------------------------------------------------------------------------------


def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, cwd=REPO, timeout=120)


def test_import_nbkit_does_not_import_ipywidgets():
    r = _run_python("import sys, nbkit; print('ipywidgets' in sys.modules)")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_missing_ipywidgets_names_the_extra():
    r = _run_python(
        """
        import sys
        sys.modules["ipywidgets"] = None  # what Python does for a package that is not installed
        try:
            import nbkit.widgets
        except ImportError as e:
            print(e)
        """
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "nbkit.widgets needs ipywidgets: pip install 'nbkit[notebook]'"


def test_running_ipywidgets_version():
    # In the ipywidgets 7 run (see the last test) this proves the old version was the one imported.
    import ipywidgets

    expected = os.environ.get("NBKIT_EXPECT_IPYWIDGETS")
    if expected:
        assert ipywidgets.__version__ == expected
    else:
        assert int(ipywidgets.__version__.split(".")[0]) >= 8


# -- WarmupPanel ---------------------------------------------------------------------------------------


def test_warmup_click_fills_the_cache_and_shows_counters(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(1000), str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    assert panel.state is PanelState.READY
    assert "1,000 of 1,000 samples to compute" in panel.status_text()
    assert panel.progress.value == 0.0 and not panel.warmup_button.disabled

    panel.warmup_button.click()
    assert panel.wait(timeout=60)

    assert panel.last_error is None, panel.last_error
    assert panel.state is PanelState.DONE
    assert ds.stats.complete
    assert panel.report.computed == 1000 and not panel.report.stopped
    assert panel.progress.value == 1.0 and panel.progress.bar_style == "success"
    assert panel.percent_label.value == "100%"
    assert panel.done_label.value == "1,000/1,000 samples"
    assert panel.rate_label.value.endswith("samples/s") and panel.rate_label.value != "0 samples/s"
    assert panel.eta_label.value.startswith("took ")
    assert panel.bytes_label.value.endswith("stored")
    assert panel.status_text().startswith("Cache complete: 1,000 samples")
    assert "#2e7d32" in panel.status.value  # green
    # Nothing left to do: Warm up is off and says why; the transfers are available.
    assert panel.warmup_button.disabled and "already cached" in panel.warmup_button.tooltip
    assert panel.stop_button.disabled and not panel.export_button.disabled and not panel.upload_button.disabled


def test_stop_then_warm_up_resumes(tmp_path):
    source = GatedSource(3000)
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    source.at = 300  # inside the second chunk of 256

    panel.warmup_button.click()
    assert source.reached.wait(timeout=60), "warmup never reached sample 300"
    assert panel.state is PanelState.RUNNING
    assert panel.warmup_button.disabled and panel.export_button.disabled and not panel.stop_button.disabled
    panel.stop_button.click()
    assert panel.state is PanelState.STOPPING and panel.stop_button.disabled
    assert panel.status_text() == "Stopping after the current chunk…"
    source.release.set()
    assert panel.wait(timeout=60)

    assert panel.last_error is None, panel.last_error
    assert panel.state is PanelState.STOPPED and panel.report.stopped
    assert ds.stats.cached == 512  # the chunk that was running finished; no further one started
    assert panel.status_text() == "Stopped at 512/3,000 samples. Click Warm up to resume."
    assert panel.progress.bar_style == "warning"
    assert panel.progress.value == pytest.approx(512 / 3000)
    assert not panel.warmup_button.disabled and panel.stop_button.disabled

    source.at = None
    panel.warmup_button.click()
    assert panel.wait(timeout=60)
    assert panel.state is PanelState.DONE
    assert (panel.report.skipped, panel.report.computed) == (512, 2488)
    assert ds.stats.complete and panel.progress.value == 1.0
    assert ds.verify() == 3000


def test_already_complete_cache_says_so(tmp_path):
    ds = _filled(tmp_path)
    panel = WarmupPanel(ds)
    assert panel.status_text() == f"Cache complete: 300 samples, {panel.bytes_label.value}."
    assert panel.progress.value == 1.0 and panel.progress.bar_style == "success"
    assert panel.warmup_button.disabled
    panel.warmup_button.click()  # click() runs the handler even on a disabled button
    assert not panel.running and panel.state is PanelState.READY
    assert "Nothing to warm up" in panel.status_text()


def test_cache_opened_without_source_disables_warmup(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(1000), str(tmp_path / "c"))
    ds.warmup(chunk_size=100, callback=_StopAfter(3))
    opened = nbkit.CachedDataset.open(str(tmp_path / "c"))
    panel = WarmupPanel(opened)
    assert panel.warmup_button.disabled
    assert "opened without its source dataset" in panel.warmup_button.tooltip
    assert "opened without its source dataset" in panel.status_text()
    assert "700 samples are missing" in panel.status_text()
    assert panel.done_label.value == "300/1,000 samples"
    panel.warmup_button.click()
    assert not panel.running and panel.last_error is None


class _StopAfter(nbkit.Callback):
    """Stops a warmup after ``k`` progress updates (to leave a cache partly filled)."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def relative_update(self, inc=1):
        super().relative_update(inc)
        self.k -= 1
        if self.k <= 0:
            self.request_stop()


def test_error_in_the_source_shows_red_and_leaves_the_cache_consistent(tmp_path):
    source = FailingSource(1000, bad=700)
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    source.armed = True
    panel = WarmupPanel(ds)
    panel.warmup_button.click()
    assert panel.wait(timeout=60)
    assert panel.state is PanelState.ERROR
    assert isinstance(panel.last_error, OSError)
    assert panel.status_text() == "Error: OSError: source image 700 is unreadable"
    assert "#c62828" in panel.status.value  # red
    assert panel.progress.bar_style == "danger"
    assert not panel.warmup_button.disabled and panel.stop_button.disabled
    cached = ds.stats.cached
    assert 0 < cached < 1000 and ds.verify() == cached
    # Fix the source and resume: the panel recovers from its error state.
    source.armed = False
    panel.warmup_button.click()
    assert panel.wait(timeout=60)
    assert panel.state is PanelState.DONE and panel.last_error is None and ds.stats.complete


def test_export_with_empty_path_names_the_fix(tmp_path):
    panel = WarmupPanel(_filled(tmp_path))
    panel.export_button.click()
    assert not panel.running and panel.state is PanelState.ERROR
    assert isinstance(panel.last_error, ValueError)
    assert "type a tar path" in panel.status_text()


def test_export_tar_writes_an_archive_that_opens_as_a_cache(tmp_path):
    pytest.importorskip("nbkit.archive", reason="nbkit.archive (export_tar/import_tar) is not in this checkout yet")
    ds = _filled(tmp_path)
    tar = tmp_path / "out.tar"
    panel = WarmupPanel(ds, tar_path=str(tar))
    panel.export_button.click()
    assert panel.wait(timeout=60)
    assert panel.last_error is None, panel.last_error
    assert panel.state is PanelState.DONE
    assert panel.status_text() == f"Exported {panel.done_label.value.split('/')[0]} to {tar}."
    assert panel.progress.description == "Export" and panel.progress.value == 1.0
    nbkit.import_tar(str(tar), str(tmp_path / "restored"))
    restored = nbkit.CachedDataset.open(str(tmp_path / "restored"))
    assert restored.stats.complete and torch.equal(restored[5][0], ds[5][0])


def test_export_to_a_bad_path_shows_the_error(tmp_path):
    pytest.importorskip("nbkit.archive", reason="nbkit.archive (export_tar/import_tar) is not in this checkout yet")
    ds = _filled(tmp_path)
    not_a_dir = tmp_path / "file.txt"
    not_a_dir.write_text("x")
    bad = not_a_dir / "out.tar"  # a "directory" that is a file: nothing can be written there
    panel = WarmupPanel(ds)
    panel.export(str(bad))
    assert panel.tar_field.value == str(bad)
    assert panel.wait(timeout=60)
    assert panel.state is PanelState.ERROR
    assert isinstance(panel.last_error, OSError), repr(panel.last_error)
    assert panel.status_text().startswith("Error: ") and "#c62828" in panel.status.value
    assert not bad.exists()
    assert ds.stats.complete and ds.verify() == 300
    assert not panel.export_button.disabled and not panel.upload_button.disabled


def test_upload_needs_a_url(tmp_path):
    panel = WarmupPanel(_filled(tmp_path), upload_url="my-bucket/cache")
    panel.upload_button.click()
    assert not panel.running and panel.state is PanelState.ERROR
    assert "gs://my-bucket/my-cache" in panel.status_text()


@pytest.mark.slow
def test_failed_upload_to_an_unreachable_server_shows_the_error(tmp_path):
    # Must be set before gcsfs is imported, or each call first probes a gRPC API for ~60 s.
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    pytest.importorskip("nbkit.transfer", reason="nbkit.transfer (push/pull) is not in this checkout yet")
    ds = _filled(tmp_path)
    nothing_listens = f"http://127.0.0.1:{free_port()}"
    panel = WarmupPanel(
        ds,
        upload_url="gs://nbkit-test/cache",
        storage_options={"endpoint_url": nothing_listens, "token": "anon", "project": "test"},
    )
    panel.upload_button.click()
    assert panel.wait(timeout=180)
    assert panel.state is PanelState.ERROR
    assert panel.last_error is not None
    assert panel.status_text().startswith("Error: ") and "#c62828" in panel.status.value
    assert ds.stats.complete and ds.verify() == 300  # the local cache is untouched


def test_terminal_display_prints_a_text_line(tmp_path, capsys):
    ds = nbkit.CachedDataset(TupleSource(600), str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    panel._ipython_display_()
    assert capsys.readouterr().out.strip() == "nbkit: 0/600 samples  Ready: 600 of 600 samples to compute. Click Warm up."
    panel.warmup_button.click()
    assert panel.wait(timeout=60)
    err = capsys.readouterr().err
    assert "warmup  600/600  100.0%" in err  # the TextProgress line
    assert "nbkit: 600/600 samples  Cache complete: 600 samples" in err


def test_terminal_ipython_and_plain_python_show_text():
    # A terminal IPython (a shell, but no kernel) and a plain script must print, not fail.
    r = _run_python(
        """
        import tempfile, torch, nbkit
        from IPython.display import display
        from nbkit.widgets import WarmupPanel, HitRateMeter
        ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(40, 2)), tempfile.mkdtemp())
        display(WarmupPanel(ds))                      # plain python: display() prints the repr
        from IPython.core.interactiveshell import InteractiveShell
        InteractiveShell.instance()
        display(WarmupPanel(ds), HitRateMeter(ds))   # terminal IPython: _ipython_display_
        """
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines == [
        "WarmupPanel(nbkit: 0/40 samples  Ready: 40 of 40 samples to compute. Click Warm up.)",
        "nbkit: 0/40 samples  Ready: 40 of 40 samples to compute. Click Warm up.",
        "nbkit hit rate: epoch 1 – (0 hits, 0 misses, 0 samples/s)  overall – (0 hits, 0 misses)",
    ]


# -- HitRateMeter ---------------------------------------------------------------------------------------


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
    assert "(running)" not in table  # the last pass ended
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
        seen.append(("(running)" in meter.table.value, meter.current.hits))
    assert seen == [(True, 10), (True, 20), (True, 30), (True, 40)]
    assert "(running)" not in meter.table.value and len(meter.track(range(3))) == 3


def test_epoch_stats_before_any_read():
    e = EpochStats(epoch=1)
    assert e.reads == 0 and e.hit_rate != e.hit_rate and e.rate == 0.0 and not e.filling


# -- in a real kernel ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_in_a_kernel_both_widgets_render_as_widgets(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]))
    code = textwrap.dedent(
        f"""
        import torch, nbkit
        from IPython.display import display
        from nbkit.widgets import WarmupPanel, HitRateMeter
        from sources import TupleSource
        ds = nbkit.CachedDataset(TupleSource(500), {str(tmp_path / "c")!r})
        panel = WarmupPanel(ds)
        display(panel)
        panel.warmup_button.click(); panel.wait(60)
        meter = HitRateMeter(ds)
        display(meter)
        loader = torch.utils.data.DataLoader(ds, batch_size=50)
        for epoch in range(2):
            for batch in meter.track(loader):
                pass
        print(panel.state.value, panel.done_label.value, [(e.hits, e.misses) for e in meter.epochs])
        import ipywidgets; print(ipywidgets.__version__)
        """
    )
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 2, outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    import ipywidgets

    assert text.strip().splitlines() == ["done 500/500 samples [(500, 0), (500, 0)]", ipywidgets.__version__]
    assert "warmup  500/500" not in text  # no terminal fallback in a kernel
    # The front end received the live values: the saved widget state has the finished table.
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    html_values = [m["state"].get("value", "") for m in state.values() if m["model_name"] == "HTMLModel"]
    assert any("from the cache" in v and "<table" in v for v in html_values)
    assert any("Cache complete: 500 samples" in v for v in html_values)


# -- ipywidgets 7.7.1 (Colab's TPU runtime) --------------------------------------------------------------


def _widgets7_dir(request) -> Path:
    """ipywidgets 7.7.1 and its companions, pip-installed once into a cached directory."""
    pins = WIDGETS7_REQUIREMENTS.read_text()
    key = hashlib.sha256(pins.encode()).hexdigest()[:12]
    target = Path(request.config.cache.mkdir(f"ipywidgets7-{key}"))
    marker = target / ".complete"
    if marker.exists():
        return target
    # --no-deps: only these packages go first on the path; IPython, traitlets and ipykernel stay
    # the environment's own, as on Colab where ipywidgets 7 sits next to the runtime's kernel.
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--upgrade", "--disable-pip-version-check",
         "--target", str(target), "-r", str(WIDGETS7_REQUIREMENTS)],
        capture_output=True, text=True, timeout=600,
    )
    if r.returncode != 0:
        offline = ("Max retries exceeded", "NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
                   "No matching distribution found", "Could not fetch URL", "ConnectTimeout", "ProxyError")
        if any(s in r.stdout + r.stderr for s in offline):
            pytest.skip(
                "!!! ipywidgets 7.7.1 NOT TESTED: the package registry is unreachable, so pip could not install "
                f"{WIDGETS7_REQUIREMENTS.name}. pip said: {(r.stderr or r.stdout).strip().splitlines()[-1]}"
            )
        raise RuntimeError(f"pip install of ipywidgets 7.7.1 failed:\n{r.stdout}\n{r.stderr}")
    marker.write_text(json.dumps({"requirements": pins}))
    return target


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("NBKIT_EXPECT_IPYWIDGETS")), reason="already the ipywidgets 7 run")
def test_this_file_passes_with_ipywidgets_7_7_1(request):
    target = _widgets7_dir(request)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NBKIT_EXPECT_IPYWIDGETS": "7.7.1",
    }
    r = subprocess.run(
        # Left out: tests that exercise no ipywidgets code (the import checks) or only wait (the
        # unreachable upload spends ~35 s in gcsfs's retries); they run once, in the main run.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
         "-k", "not unreachable_server and not import_nbkit and not missing_ipywidgets",
         "-W", "ignore::DeprecationWarning"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=900,
    )
    assert r.returncode == 0, f"tests/test_widgets.py failed under ipywidgets 7.7.1:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-3000:]


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
