"""nbkit.widgets.panel without a browser: click the WarmupPanel's buttons, read the widget values.

tests/widgets/test_view.py reruns this directory with ipywidgets 7.7.1 (Colab's TPU runtime).
"""

from __future__ import annotations

import html
import os
import re
import threading
import time

import pytest
import torch

import nbkit
from nbkit.widgets import PanelState, WarmupPanel
from nbkit.widgets.panel import ERROR_LINE_CHARS, error_html
from servers import free_port
from sources import TupleSource
from widget_sources import FailingSource, GatedSource
from widget_sources import filled as _filled


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
    # Idle again: the line under the bar is the cache (no rate or ETA); the status has the warmup's numbers.
    assert panel.counts[0] == "1,000/1,000 samples" and panel.counts[1].endswith(" of sample data") and len(panel.counts) == 2
    assert panel.status_text().startswith("Cache complete: 1,000 samples")
    assert re.search(r"\(1,000 computed in [\d.]+ ?m?s, [\d,]+ samples/s\)\.$", panel.status_text()), panel.status_text()
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
    assert panel.status_text() == "The warmup stopped at 512 of 3,000 samples, every one kept in the cache. Click Warm up to resume."
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
    assert panel.status_text() == f"Cache complete: 300 samples, {panel.counts[1]}."
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
    assert panel.counts[0] == "300/1,000 samples"
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
    pytest.importorskip("nbkit.transfer.archive", reason="nbkit.transfer.archive (export_tar/import_tar) is not in this checkout yet")
    ds = _filled(tmp_path)
    tar = tmp_path / "out.tar"
    panel = WarmupPanel(ds, tar_path=str(tar))
    panel.export_button.click()
    assert panel.wait(timeout=60)
    assert panel.last_error is None, panel.last_error
    assert panel.state is PanelState.DONE
    assert re.fullmatch(rf"Exported [\d.]+ [KM]B to {re.escape(str(tar))}\.", panel.status_text()), panel.status_text()
    # Idle after the export: the bar is the cache again, not "Export 100%".
    assert panel.progress.description == "Cache" and panel.progress.value == 1.0
    nbkit.import_tar(str(tar), str(tmp_path / "restored"))
    restored = nbkit.CachedDataset.open(str(tmp_path / "restored"))
    assert restored.stats.complete and torch.equal(restored[5][0], ds[5][0])


def test_export_to_a_bad_path_shows_the_error(tmp_path):
    pytest.importorskip("nbkit.transfer.archive", reason="nbkit.transfer.archive (export_tar/import_tar) is not in this checkout yet")
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


def shown_lines(panel):
    """The error's lines the panel shows without a click, and the text of its "details" disclosure."""
    shown, _, details = panel.status.value.partition("<details")
    return [html.unescape(re.sub(r"<[^>]+>", "", ln)) for ln in shown.split("<br>")], html.unescape(details)


def test_a_failed_upload_says_what_happened_in_three_short_lines(tmp_path):
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    port = free_port()  # nothing listens
    panel = WarmupPanel(_filled(tmp_path), upload_url="gs://nbkit-test/cache",
                        storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon", "project": "test"})
    panel.upload_button.click()
    assert panel.wait(timeout=120) and panel.state is PanelState.ERROR
    lines, details = shown_lines(panel)
    assert lines[0] == f"Error: OSError: cannot reach the endpoint 127.0.0.1:{port} (connection refused)"
    assert len(lines) <= 3 and all(len(ln) <= len("Error: OSError: ") + ERROR_LINE_CHARS for ln in lines)
    assert "resume" not in panel.status.value  # nothing was uploaded
    # One click away: the whole message (the fix included) and its cause, no traceback.
    assert "<summary" in details and "click Upload again" in details and "ConnectionRefusedError" in details
    assert "nbkit.push(" not in details  # the fix for where the user is: the panel's button, not a Python call
    assert "Traceback" not in details
    assert panel.status_text().startswith("Error: OSError: cannot reach") and "ConnectionRefusedError" not in panel.status_text()


def test_an_upload_to_a_bare_gs_url_says_there_is_no_bucket(tmp_path):
    panel = WarmupPanel(_filled(tmp_path), upload_url="gs://")
    panel.upload_button.click()
    assert panel.wait(timeout=60) and panel.state is PanelState.ERROR
    lines, _ = shown_lines(panel)
    assert lines[0].startswith("Error: ValueError: no bucket in the URL 'gs://'")
    assert isinstance(panel.error("upload"), ValueError)


def test_a_long_error_shows_three_cut_lines_and_the_rest_in_details():
    long_line = "word " * 100
    try:
        try:
            raise ConnectionResetError("the peer went away")
        except ConnectionResetError as e:
            raise OSError("\n".join(f"line {i}: {long_line}" for i in range(8))) from e
    except OSError as e:
        error = e
    shown, _, details = error_html(error).partition("<details")
    lines = shown.split("<br>")
    assert len(lines) == 3 and all(len(re.sub(r"<[^>]+>", "", ln)) <= len("Error: OSError: ") + ERROR_LINE_CHARS for ln in lines)
    assert re.sub(r"<[^>]+>", "", lines[2]).endswith("…")
    assert "line 7: word" in details and "caused by ConnectionResetError: the peer went away" in details
    assert error_html(ValueError("short")).count("<details") == 0  # nothing left out: no disclosure
    # The control shows its triangle even where a stylesheet turns summaries into plain blocks
    # (the classic Notebook's, under ipywidgets 7): display:list-item set on the element itself.
    summary = re.search(r"<summary style=\"([^\"]*)\">details</summary>", details)
    assert summary and "display:list-item" in summary.group(1) and "cursor:pointer" in summary.group(1)


def test_the_disk_line_says_reserved_while_the_preallocated_files_are_not_filled(tmp_path):
    """At a warmup's start the files are already their full size: "reserved", beside "0 B of sample data"."""
    from nbkit.widgets.panel import disk_text

    ds = nbkit.CachedDataset(TupleSource(1000), str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    text = html.unescape(re.sub(r"<[^>]+>", "", panel.disk_label.value))
    assert ds.stats.bytes == 0 and ds.stats.disk_bytes > 0
    assert re.match(r"[\d.]+ [KMG]?B reserved on disk \(sample data, index and metadata\) in .*, allocated for "
                    r"the whole cache up front\. ", text), text
    assert "0 B of sample data" in panel.counts
    ds.warmup()
    assert " on disk (sample data" in disk_text(ds, ds.stats) and "reserved" not in disk_text(ds, ds.stats)


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



class _PublishingCache(nbkit.CachedDataset):
    """A cache whose warmup goes on to a second phase, as a remote (gs://) cache publishes its copy."""

    def warmup(self, num_workers=0, callback=None, **kw):
        report = super().warmup(num_workers=num_workers, callback=callback, **kw)
        callback.start_phase("publish", unit="bytes", size=3_000_000)
        callback.set_description("pushing to gs://bucket/cache")
        callback.relative_update(3_000_000)
        return report


def test_a_second_phase_is_shown_in_its_own_unit(tmp_path):
    ds = _PublishingCache(TupleSource(300), str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    seen = []
    panel.counters.observe(lambda change: seen.append(panel.counts), names="value")
    panel.warmup_button.click()
    assert panel.wait(timeout=60)
    assert panel.state is PanelState.DONE and panel.report.computed == 300
    cb = panel.job.callback
    assert (cb.phase, cb.unit, cb.value) == ("publish", "bytes", 3_000_000)
    published = [c for c in seen if c[0] == "3.0 MB/3.0 MB"]  # bytes, not 3,000,000 "samples"
    assert published and published[-1][1].endswith("B/s"), seen
    assert panel.status_text().startswith("Cache complete: 300 samples")


# -- each operation keeps its own outcome (issue 13, points 3 and 4) ---------------------------------


def _stopped_midway(tmp_path, n=3000, at=300, **panel_kw):
    """A panel whose warmup was stopped by its Stop button after two chunks of 256."""
    source = GatedSource(n)
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    panel = WarmupPanel(ds, **panel_kw)
    source.at = at
    panel.warmup_button.click()
    assert source.reached.wait(timeout=60), "warmup never reached the gate"
    panel.stop_button.click()
    source.release.set()
    assert panel.wait(timeout=60)
    source.at = None
    assert panel.state is PanelState.STOPPED and ds.stats.cached == 512
    return ds, panel


def test_export_after_stop_then_run_warmup_returns_the_warmup_report(tmp_path):
    ds, panel = _stopped_midway(tmp_path, tar_path=str(tmp_path / "x.tar"))
    panel.export_button.click()
    assert panel.wait(timeout=60) and panel.state is PanelState.DONE
    assert type(panel.report).__name__ == "TransferReport"  # the old `report`: whatever ran last

    report = panel.run("warmup")  # what the notebook's wait-for-warmup cell calls
    assert report is panel.warmup_report and (report.skipped, report.computed) == (512, 2488)
    assert type(panel.export_report).__name__ == "TransferReport" and panel.export_report.bytes > 0
    assert panel.upload_report is None and ds.stats.complete
    # Nothing left to do: run() does not press Warm up again, and still returns the report.
    assert panel.run("warmup") is report and panel.job.name == "warmup"


def test_an_old_upload_error_does_not_come_back_in_the_warmup_cell(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(600), str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    panel.upload_button.click()  # empty URL: refused before any job starts
    assert isinstance(panel.error("upload"), ValueError) and panel.last_error is panel.error("upload")
    assert panel.error("warmup") is None and panel.error("export") is None

    assert panel.run("warmup").computed == 600
    assert panel.error("warmup") is None and panel.last_error is None and panel.state is PanelState.DONE
    assert isinstance(panel.error("upload"), ValueError)  # still the upload's, until an upload runs
    with pytest.raises(ValueError, match="Upload needs a URL"):
        panel.run("upload")  # the cell that wants an upload does get the upload's error
    assert panel.run("warmup").computed == 600  # and the warmup cell still does not
    with pytest.raises(ValueError, match="unknown panel operation 'train'"):
        panel.error("train")


def test_run_raises_its_own_job_error(tmp_path):
    source = FailingSource(1000, bad=700)
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    source.armed = True
    panel = WarmupPanel(ds, tar_path=str(tmp_path / "partial.tar"))
    with pytest.raises(OSError, match="source image 700 is unreadable"):
        panel.run("warmup")
    panel.run("export")  # the export succeeds; its cell does not see the warmup's error
    assert panel.error("export") is None and isinstance(panel.error("warmup"), OSError)
    panel.tar_field.value = "  "
    with pytest.raises(ValueError, match="type a tar path"):
        panel.run("export")
    assert isinstance(panel.error("export"), ValueError)


def test_run_returns_a_stopped_report_when_stop_is_clicked_while_it_waits(tmp_path, monkeypatch, capsys):
    """Stop is an outcome, not an error: the cell ends without a traceback (Run All goes on), and
    prints the panel's own sentence, what was kept and the one way to resume."""
    import threading

    source = GatedSource(3000)
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    monkeypatch.setattr(panel, "terminal", False)  # as in a kernel: run() prints the sentence itself
    source.at = 300
    outcome = {}

    def cell():
        try:
            outcome["report"] = panel.run("warmup")
        except Exception as e:  # noqa: BLE001 - the test fails on any
            outcome["error"] = e

    t = threading.Thread(target=cell)
    t.start()
    assert source.reached.wait(timeout=60)
    panel.stop_button.click()
    source.release.set()
    t.join(timeout=60)
    assert "error" not in outcome, outcome
    report = outcome["report"]
    assert report.stopped and report.computed == 512
    sentence = "The warmup stopped at 512 of 3,000 samples, every one kept in the cache. Click Warm up to resume."
    assert panel.status_text() == sentence
    assert " ".join(capsys.readouterr().out.split()) == sentence  # the cell says what the panel says
    assert panel.stopped("warmup") and not panel.stopped("export")
    source.at = None
    assert panel.run("warmup").computed == 2488  # Warm up (which run() presses) resumes
    assert not panel.stopped("warmup")


def test_run_warmup_of_a_cache_without_source_says_why(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(1000), str(tmp_path / "c"))
    ds.warmup(chunk_size=100, callback=_StopAfter(3))
    panel = WarmupPanel(nbkit.CachedDataset.open(str(tmp_path / "c")))
    with pytest.raises(ValueError, match="opened without its source dataset.*700 samples are missing"):
        panel.run("warmup")


# -- a partial or stale export is never taken for a good one (point 2) ----------------------------------


def test_partial_export_is_amber_with_the_cached_fraction(tmp_path):
    tar = tmp_path / "x.tar"
    ds, panel = _stopped_midway(tmp_path, tar_path=str(tar))
    panel.export_button.click()
    assert panel.wait(timeout=60) and panel.error("export") is None
    size = re.match(r"Exported ([\d.]+ [KM]B)", panel.status_text()).group(1)
    assert panel.status_text() == (
        f"Exported {size} to {tar} — partial: 17% of samples cached (512 of 3,000). Warm up, then export again."
    )
    assert "#a15c00" in panel.status.value and "#2e7d32" not in panel.status.value  # amber, not green
    assert panel.progress.bar_style == "warning"


def test_run_export_rewrites_a_stale_tar_and_keeps_a_current_one(tmp_path):
    from nbkit.transfer.archive import stale_tar_reason

    tar = tmp_path / "x.tar"
    ds, panel = _stopped_midway(tmp_path, tar_path=str(tar))
    panel.export_button.click()  # a partial tar, as after Stop → Export tar
    assert panel.wait(timeout=60)
    panel.run("warmup")
    assert "holds 512 of 3,000 samples; the cache now holds 3,000" in stale_tar_reason(tar, ds.root)

    first = panel.run("export")  # stale: exported again
    assert first.bytes > 0 and panel.export_report is first
    assert stale_tar_reason(tar, ds.root) is None
    assert panel.status_text().startswith("Exported ") and "partial" not in panel.status_text()

    # A later session (a new panel, the same cache and tar): the tar is current, nothing to do.
    again = WarmupPanel(nbkit.CachedDataset(GatedSource(3000), str(tmp_path / "c")), tar_path=str(tar))
    assert again.run("export") is None and again.job is None
    assert again.status_text() == f"{tar} already holds this cache as it is now; not exported again."

    # A tar of another cache at that path (a previous run of another notebook) is replaced.
    other = _filled(tmp_path, n=50, name="other")
    nbkit.export_tar(other.root, tar)
    assert "exported from another cache" in stale_tar_reason(tar, ds.root)
    assert again.run("export").bytes > 0 and stale_tar_reason(tar, ds.root) is None


# -- glitches (point 8) ------------------------------------------------------------------------------------


def test_a_refused_upload_does_not_repaint_the_export_bar(tmp_path):
    ds = _filled(tmp_path)
    panel = WarmupPanel(ds, tar_path=str(tmp_path / "x.tar"))
    panel.run("export")
    bar = (panel.progress.description, panel.progress.bar_style, panel.progress.value, panel.percent_label.value)
    assert bar == ("Cache", "success", 1.0, "100%")
    panel.upload_button.click()
    assert (panel.progress.description, panel.progress.bar_style, panel.progress.value, panel.percent_label.value) == bar
    assert panel.status_text().startswith("Error: ValueError: Upload needs a URL") and "#c62828" in panel.status.value
    assert panel.state is PanelState.ERROR and panel.export_report is not None


def test_a_stopped_panel_shows_no_eta_or_live_rate(tmp_path):
    ds, panel = _stopped_midway(tmp_path)
    idle = ("512/3,000 samples", f"{panel.counts[1]}")
    assert panel.counts == idle and panel.counts[1].endswith(" of sample data")
    rate, elapsed = panel.job.callback.rate(), panel.job.callback.elapsed()
    panel._render_progress(panel.job.callback)  # a late redraw changes nothing: the clock stopped
    assert panel.counts == idle and "ETA" not in panel.counters.value
    assert (panel.job.callback.rate(), panel.job.callback.elapsed()) == (rate, elapsed)
    panel.warmup_button.click()
    assert panel.wait(timeout=60)
    assert panel.counts == ("3,000/3,000 samples", panel.counts[1]) and "samples/s" not in panel.counters.value


def test_resume_starts_the_bar_from_the_cached_fraction(tmp_path):
    ds, panel = _stopped_midway(tmp_path, tar_path=str(tmp_path / "x.tar"))
    panel.run("export")
    assert (panel.progress.description, panel.progress.value) == ("Cache", pytest.approx(512 / 3000))
    seen = []
    panel.progress.observe(lambda change: seen.append(change["new"]), names="value")
    panel.run("warmup")
    assert seen and min(seen) >= 512 / 3000, seen[:5]  # never back to 0%
    assert panel.progress.value == 1.0
    assert panel.progress.description == "Cache"


def test_layout_has_no_fixed_widths(tmp_path):
    panel = WarmupPanel(_filled(tmp_path))

    def walk(w):
        yield w
        for child in getattr(w, "children", ()):
            yield from walk(child)

    widths = [(type(w).__name__, w.layout.width) for w in walk(panel.widget) if w.layout.width]
    assert widths and not [w for w in widths if w[1].endswith("px")], widths
    rows = [w for w in walk(panel.widget) if type(w).__name__ == "HBox"]
    bar = next(r for r in rows if panel.progress in r.children)
    assert bar.layout.flex_flow == "row nowrap" and bar.children == (panel.progress, panel.percent_label)
    assert all(r.layout.flex_flow == "row wrap" for r in rows if r is not bar)
    for b in (panel.warmup_button, panel.stop_button, panel.export_button, panel.upload_button):
        assert b.layout.width == "auto" and b.layout.min_width.endswith("em")


# -- what the bar and texts say in every state (issue 21, point 8) ---------------------------------------


def _says(panel) -> str:
    return " | ".join((panel.progress.description, panel.percent_label.value, *panel.counts, panel.status_text()))


def _idle_truths(panel, ds):
    """An idle panel's bar is the cache (labelled so) and its counts line holds no live numbers."""
    stats = ds.stats
    says = _says(panel)
    assert panel.progress.description == "Cache" and panel.progress.value == pytest.approx(stats.cached / stats.total), says
    assert panel.counts == (f"{stats.cached:,}/{stats.total:,} samples", panel.counts[1]), says
    assert panel.counts[1].endswith(" of sample data"), says
    assert "–" not in panel.counters.value and "ETA" not in says and "/s" not in " ".join(panel.counts), says
    assert "Warmup:" not in says and ".)." not in says and says.count("to resume") <= 1, says


def test_every_idle_state_shows_the_cache_and_what_is_true(tmp_path):
    complete = _filled(tmp_path, name="complete")
    panel = WarmupPanel(complete, tar_path=str(tmp_path / "x.tar"))  # idle, complete cache
    _idle_truths(panel, complete)
    assert panel.progress.bar_style == "success"
    panel.run("export")  # after export: the bar is the cache again, the status the export's outcome
    _idle_truths(panel, complete)
    assert panel.status_text().startswith("Exported ") and panel.progress.bar_style == "success"

    partial = nbkit.CachedDataset(TupleSource(1000), str(tmp_path / "partial"))
    partial.warmup(chunk_size=100, callback=_StopAfter(3))
    panel = WarmupPanel(partial)  # idle, partial, with its source
    _idle_truths(panel, partial)
    assert panel.status_text() == "Ready: 700 of 1,000 samples to compute. Click Warm up."
    assert panel.progress.bar_style == ""

    ds, panel = _stopped_midway(tmp_path / "stopped")  # stopped
    _idle_truths(panel, ds)
    assert panel.status_text() == "The warmup stopped at 512 of 3,000 samples, every one kept in the cache. Click Warm up to resume."
    assert panel.progress.bar_style == "warning"

    source = FailingSource(1000, bad=700)
    failing = nbkit.CachedDataset(source, str(tmp_path / "failing"))
    source.armed = True
    panel = WarmupPanel(failing)
    panel.warmup_button.click()
    assert panel.wait(timeout=60) and panel.state is PanelState.ERROR  # failed
    _idle_truths(panel, failing)
    assert panel.progress.bar_style == "danger" and "source image 700 is unreadable" in panel.status_text()


def test_a_partial_cache_without_source_is_said_plainly(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(1000), str(tmp_path / "c"))
    ds.warmup(chunk_size=100, callback=_StopAfter(3))
    panel = WarmupPanel(nbkit.CachedDataset.open(str(tmp_path / "c")))
    assert panel.status_text().startswith(
        "This cache holds 300 of 1,000 samples; training will stop at the first missing one. Warm up is off:")
    assert "#a15c00" in panel.status.value  # amber: usable, but not whole


def test_while_it_runs_the_status_says_what_it_does_once(tmp_path):
    source = GatedSource(3000)
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    panel = WarmupPanel(ds)
    source.at = 300
    panel.warmup_button.click()
    assert source.reached.wait(timeout=60)
    panel._render_progress(panel.job.callback)  # what the next throttled redraw shows
    try:
        assert panel.status_text() == "Warming up…"
        assert panel.progress.description == "Cache" and panel.counts[0] == "256/3,000 samples"
        assert panel.counts[1].endswith("samples/s") and panel.counts[2].startswith("ETA ")
    finally:
        source.release.set()
        assert panel.wait(timeout=60)


def test_the_counts_line_wraps_between_whole_units(tmp_path):
    panel = WarmupPanel(_filled(tmp_path))
    spans = re.findall(r"<span style='([^']*)'>([^<]*)</span>", panel.counters.value)
    assert [text for _, text in spans] == [f"{panel.counts[0]} ·", panel.counts[1]]
    assert all("white-space:nowrap" in style and "inline-block" in style for style, _ in spans)
    # The title: the path may break inside itself (when longer than the line), its counts may not.
    title = re.findall(r"<span style='(display:[^']*)'>", panel.title.value)
    assert len(title) == 3 and "nowrap" not in title[0] and all("nowrap" in t for t in title[1:])


# -- a warmup built by several workers: the workers table, Stop keeps finished parts -----------------


class _SlowTuples(TupleSource):
    """A moment a sample, so both worker processes get parts."""

    def __getitem__(self, i):
        time.sleep(0.002)
        return super().__getitem__(i)


#: The gates of _NamedGate sources, by name: a source that pickles (a build sends it to its workers)
#: and still meets the test's events when its workers are threads of this process.
_GATES = {}


class _NamedGate(TupleSource):
    """GatedSource for a build: blocks at index ``at`` until the test releases it."""

    def __init__(self, n, name, at):
        super().__init__(n)
        self.name, self.at = name, at
        _GATES[name] = (threading.Event(), threading.Event())

    def __getitem__(self, i):
        reached, release = _GATES[self.name]
        if self.at is not None and i == self.at:
            reached.set()
            release.wait(timeout=60)
        return super().__getitem__(i)


def _table_rows(panel):
    """The workers table's body rows as (worker, parts, samples, rate, amber)."""
    rows = re.findall(r"<tr( style='[^']*')?>(<td.*?)</tr>", panel.workers_table.value)
    return [tuple(html.unescape(c) for c in re.findall(r"<td[^>]*>(.*?)</td>", cells)) + ("#a15c00" in (style or ""),)
            for style, cells in rows]


def test_an_engine_build_shows_each_worker_and_the_slowest(tmp_path):
    import multiprocessing as mp
    import socket

    from nbkit.cluster import LocalEngine

    if "fork" not in mp.get_all_start_methods():
        pytest.skip("needs fork (the source is defined in this test module)")
    n = 240
    ds = nbkit.CachedDataset(_SlowTuples(n), str(tmp_path / "c"))
    with LocalEngine(2, multiprocessing_context="fork") as engine:
        panel = WarmupPanel(ds, engine=engine, part_size=30)
        assert panel.workers_table.value == ""  # nothing built yet: no table
        report = panel.run("warmup", timeout=120)
    assert report.computed == n and not report.stopped and ds.stats.complete
    assert panel.state is PanelState.DONE and panel.status_text().startswith("Cache complete: 240 samples")
    text = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", panel.workers_table.value)).split())
    assert "parts 8/8" in text and ("2 workers" in text or "1 worker" in text)
    rows = _table_rows(panel)
    assert 1 <= len(rows) <= 2 and sum(int(r[1]) for r in rows) == 8 and sum(int(r[2].replace(",", "")) for r in rows) == n
    assert all(r[0].startswith(socket.gethostname() + ":") and r[3].endswith("/s") for r in rows)
    if len(rows) == 2:  # the slowest first, in amber, and named on the summary line
        assert rows[0][4] and not rows[1][4] and f"slowest: {rows[0][0]}" in text
    assert f"{rows[0][0]}" in panel.workers_table.value
    ds.close()


def test_stop_cancels_the_parts_not_built_and_keeps_every_finished_one(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from nbkit.cluster.engine import ExecutorEngine
    from nbkit.cluster.part import list_parts, parts_dir

    source = _NamedGate(1000, str(tmp_path), at=250)  # the third part of 100 waits; the other worker builds the rest
    reached, release = _GATES[source.name]
    ds = nbkit.CachedDataset(source, str(tmp_path / "c"))
    with ThreadPoolExecutor(2) as pool:
        panel = WarmupPanel(ds, engine=ExecutorEngine(pool, workers=2, name="threads", owned=False), part_size=100)
        panel.warmup_button.click()
        assert reached.wait(timeout=60), panel.status_text()
        deadline = time.monotonic() + 60
        while ds.stats.cached < 900 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ds.stats.cached == 900
        panel.stop_button.click()
        assert panel.state is PanelState.STOPPING
        assert panel.status_text() == "Stopping: cancelling the parts not yet built; every finished part is kept…"
        assert panel.wait(timeout=60)
        assert panel.state is PanelState.STOPPED and panel.warmup_report.stopped
        shown = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", panel.workers_table.value)).split())
        assert "parts 9/10" in shown, shown  # the parts in the cache: 900 samples
        rows = [r for r in panel.job.callback.workers.rows]
        # The table's rows add up to the samples in the cache (a part merged at the Stop has a row of its own).
        from nbkit.widgets.panel import settled_workers
        settled = settled_workers(panel.job.callback.workers, panel.warmup_report)
        assert sum(r.samples for r in settled.rows) == ds.stats.cached == 900, (rows, settled)
        release.set()  # the part that was running finishes after the stop: kept for the next run
    assert [os.path.basename(p) for p in list_parts(parts_dir(ds.root))] == ["part-0000000000200-0000000000300"]
    assert panel.status_text() == "The warmup stopped at 900 of 1,000 samples, every one kept in the cache. Click Warm up to resume."

    with ThreadPoolExecutor(2) as pool:
        panel.engine = ExecutorEngine(pool, workers=2, name="threads", owned=False)
        report = panel.run("warmup", timeout=60)
    assert (report.reused, report.computed, report.stopped) == (100, 0, False)  # merged, never computed again
    assert ds.stats.complete and ds.verify() == 1000
