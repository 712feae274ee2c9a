"""The widgets and notebook 02 in real front ends, in headless Chromium.

* Voila serves small notebooks (``tests/notebooks/``): the WarmupPanel's buttons, the hit-rate meter.
* ``notebooks/02_cache_mnist.ipynb`` itself, with small offline parameters, in **JupyterLab 4 with
  ipywidgets 8** and the **classic Notebook 6 with ipywidgets 7.7.1** (Colab's widget version):
  Run All; the click-through Warm up → Stop → Export tar → the remaining cells; Upload with an
  empty URL → the remaining cells; Stop while a cell blocks in ``panel.wait()``; screenshots of the
  panel and the meter at 400, 600, 1000 and 1400 px, and nothing cut at 400 or 600 px; the
  ``overwrite`` box ticked and Run All twice: the complete cache is kept.
* **Every notebook** (01 to 06) at 400 px in both front ends, after Run All with its small
  offline parameters (``scripts/run_notebooks.py``'s ``SMALL``, on the CPU): in every output, nothing
  cut, no printed or shown word broken across lines, nothing scrolling sideways without a scrollbar.

The front ends and the driver are in ``tests/frontends.py``. Run alone:
``PJRT_DEVICE=CPU .venv/bin/python -m pytest tests/test_browser.py`` (after ``make setup``, which also
builds the classic Notebook's environment: tests/testenvs.py). Screenshots land in ``test-artifacts/screenshots/``;
``python tests/frontends.py update-docs`` copies them into ``docs/screenshots/``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from fixtures_browser import (
    ARTIFACTS, chromium, classic_server, frontend, lab_server, notebook_dir, page, voila,
)
from frontends import SCREENSHOTS, CellError, Notebook, clipped, flat, set_parameters

# one_stack: the front ends render and click the same on every torch (test_notebooks runs every
# notebook on both stacks); make test runs these, make test-newest leaves them out.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.one_stack]

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = Path(__file__).parent / "notebooks" / "warmup_panel.ipynb"
N_TRAIN = 10_000

_spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)

NB02 = REPO / "notebooks" / "02_cache_mnist.ipynb"
# CI's small offline parameters, on the CPU device (no XLA compilation to wait for).
SMALL_02 = {**run_notebooks.SMALL["02_cache_mnist"], "device": "cpu"}
# Enough samples that a warmup takes seconds (about 4,500 samples/s here), so Stop lands mid-way.
STOPPABLE_SAMPLES = 12_000
# While a cell blocks in panel.wait(), a Stop click must act within this many seconds; the warmup
# of LONG_SAMPLES takes many times longer, so a click queued behind the cell cannot pass.
STOP_WITHIN_S = 8
LONG_SAMPLES = 60_000
WIDTHS = (400, 600, 1000, 1400)
# Where nothing may be cut: a phone or Colab's side panel (400 px), a small window (600 px).
NARROW = (400, 600)
STOPPED = re.compile(r"(?i)\bstopped\b")


def test_warmup_then_export_in_chromium(page, tmp_path):
    pytest.importorskip("nbkit.transfer.archive", reason="nbkit.transfer.archive (export_tar/import_tar) is not in this checkout yet")
    import nbkit
    from nbkit.offline import write_mnist

    write_mnist(tmp_path / "data", n_train=N_TRAIN, n_test=100)
    tar = tmp_path / "mnist-cache.tar"
    env = {"NBKIT_BROWSER_WORKDIR": str(tmp_path)}  # the notebook works there with relative paths

    with voila(NOTEBOOK, env=env, log=ARTIFACTS / "voila.log") as url:
        page.goto(url, timeout=90_000)
        warm = page.get_by_role("button", name="Warm up")
        warm.wait_for(timeout=90_000)
        panel = page.locator(".widget-vbox").first
        assert "Ready: 10,000 of 10,000 samples to compute" in panel.inner_text()
        # (a no-break space binds the path to its "·": a separator never starts a line)
        assert "nbkit cache mnist-cache · 10,000 samples · 0 cached" in panel.inner_text().replace("\xa0", " ")
        # The tar field shows the destination the notebook passed in.
        assert page.locator("input[type=text]").first.input_value() == "mnist-cache.tar"

        warm.click()
        bar = page.locator(".widget-hprogress .progress-bar").first
        page.wait_for_function(
            "el => el.style.width === '100%'", arg=bar.element_handle(), timeout=120_000
        )
        page.get_by_text("Cache complete").wait_for(timeout=60_000)
        text = panel.inner_text()
        assert "10,000/10,000 samples" in text
        assert "100%" in text
        assert re.search(r"[\d,]+ samples/s", text), text
        assert "10,000 samples · complete" in text
        assert page.get_by_role("button", name="Warm up").is_disabled()  # nothing left to warm up
        ARTIFACTS.mkdir(exist_ok=True)
        panel.screenshot(path=str(ARTIFACTS / "warmup_panel_warm.png"))

        page.get_by_role("button", name="Export tar").click()
        page.get_by_text(re.compile(r"Exported [\d.]+ MB to mnist-cache\.tar\.")).wait_for(timeout=120_000)
        assert "Error" not in panel.inner_text()

        panel.screenshot(path=str(ARTIFACTS / "warmup_panel.png"))

    assert tar.is_file() and tar.stat().st_size > 0
    restored = tmp_path / "restored"
    nbkit.import_tar(str(tar), str(restored))
    again = nbkit.CachedDataset.open(str(restored))
    assert len(again) == N_TRAIN and again.stats.complete
    image, label = again[7]
    assert tuple(image.shape) == (1, 28, 28)
    assert again.verify() == N_TRAIN


def test_hit_rate_meter_in_chromium(page, tmp_path):
    from nbkit.offline import write_mnist

    mnist = tmp_path / "mnist"
    write_mnist(mnist, n_train=3000, n_test=100)
    env = {"NBKIT_BROWSER_MNIST": str(mnist), "NBKIT_BROWSER_CACHE": str(tmp_path / "cache")}

    with voila(NOTEBOOK.with_name("hit_rate_meter.ipynb"), env=env, log=ARTIFACTS / "voila-meter.log") as url:
        page.goto(url, timeout=90_000)
        table = page.locator(".widget-html table").first
        table.wait_for(timeout=90_000)
        # The notebook trains 3 epochs with 2 DataLoader workers; wait for the third to be counted.
        page.wait_for_function(
            "() => [...document.querySelectorAll('.widget-html table tr')].length === 4"
            " && document.body.innerText.includes('hits 6,000 · misses 3,000')",
            timeout=120_000,
        )
        rows = [r.split("\t") for r in table.inner_text().strip().splitlines()]
        assert rows[0][:5] == ["epoch", "samples", "hits", "misses", "hit rate"], rows
        assert rows[1][:5] == ["1", "3,000", "0", "3,000", "0.0%"] and rows[1][-1] == "filling the cache"
        assert rows[2][:5] == ["2", "3,000", "3,000", "0", "100.0%"] and rows[2][-1] == "from the cache"
        assert rows[3][:5] == ["3", "3,000", "3,000", "0", "100.0%"]
        headline = page.locator(".widget-html").first.inner_text()
        assert "epoch 3: 100.0%" in headline and "overall 66.7%" in headline
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(".widget-vbox").first.screenshot(path=str(ARTIFACTS / "hit_rate_meter.png"))


# -- JupyterLab 4 (ipywidgets 8) and the classic Notebook 6 (ipywidgets 7.7.1) ----------------------------


def _notebook(path: Path, cells: list[str]) -> Path:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def test_front_end_runs_its_ipywidgets_and_the_driver_works(page, frontend, notebook_dir):
    """The harness itself: the kernel's ipywidgets version, Run All, a click, widget text, an error."""
    path = _notebook(notebook_dir / "driver.ipynb", [
        "import ipywidgets, nbkit.widgets\nprint(ipywidgets.__version__)",
        "label = ipywidgets.Label('not clicked')\nbutton = ipywidgets.Button(description='Press me')\n"
        "button.on_click(lambda _: setattr(label, 'value', 'clicked once'))\nipywidgets.VBox([button, label])",
        "raise ValueError('a cell that fails')",
        "print('never runs')",
    ])
    nb = Notebook(page, frontend, path).open()
    nb.run_all()
    with pytest.raises(CellError, match=r"(?s)cell 2 failed.*ValueError: a cell that fails"):
        nb.wait(3, timeout=60)
    assert nb.error(2) == "ValueError: a cell that fails"
    version = nb.text(0).strip()
    # The classic set-up is Colab's: ipywidgets 7.7.1 in the kernel, not this environment's 8.
    assert version == "7.7.1" if frontend.kind == "classic" else version.startswith("8."), version
    assert "not clicked" in nb.widget_text(1)
    nb.click(1, "Press me")
    nb.wait_for_text(1, "clicked once", timeout=30)
    frontend.shut_down_kernel(path)


@pytest.fixture
def open_02(page, frontend, notebook_dir):
    """Open a copy of notebooks/02_cache_mnist.ipynb with small offline parameters (overridable)."""
    opened = []

    def open_(**parameters) -> Notebook:
        path = notebook_dir / NB02.name
        shutil.copyfile(NB02, path)
        set_parameters(path, **{**SMALL_02, **parameters})
        nb = Notebook(page, frontend, path).open()
        opened.append(path)
        return nb

    yield open_
    for path in opened:  # stop what the test left running (a warmup, a training loop)
        try:
            frontend.shut_down_kernel(path)
        except OSError:
            pass


def _landmarks(nb: Notebook) -> tuple[int, int]:
    """The cells of notebook 02 the tests act on: the panel's, and the first one that waits for it."""
    panel = nb.index("WarmupPanel(")
    waits = next(i for i, c in enumerate(nb.cells()) if i > panel and c["type"] == "code"
                 and re.search(r"panel\.(wait|run)\(", c["source"]))
    return panel, waits


def _until(predicate, timeout: float, what: str, show):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f}s; the panel shows:\n{show()}")
        time.sleep(0.05)
    return value


def _wait_for_job_end(nb: Notebook, panel: int, before: str, timeout: float = 60):
    """After a click: wait until the panel's text changed and Stop is off again (no job runs)."""
    _until(lambda: nb.widget_text(panel) != before and nb.button(panel, "Stop").is_disabled(),
           timeout, "the operation's end", lambda: nb.widget_text(panel))


def _bar_label(nb: Notebook, panel: int) -> str:
    """The label of the panel's bar: what the bar measures ("Cache", or the running transfer)."""
    return nb.output(panel).locator(".widget-hprogress .widget-label").first.inner_text().strip()


def _idle_panel_is_true(nb: Notebook, panel: int):
    """An idle panel's bar is the cache, and no live number (a rate, an ETA) is left on it."""
    # The front end applies the kernel's last updates a moment after the job's end: wait for them.
    # (The status is not the panel's last line: the disk line follows it.)
    _until(lambda: not any(line.rstrip().endswith("…") for line in nb.widget_text(panel).splitlines())
           and _bar_label(nb, panel) == "Cache", 30, "the operation's end, the bar back on the cache",
           lambda: nb.widget_text(panel))
    text = nb.widget_text(panel)
    assert "ETA" not in text and "–" not in text and "/s" not in text, text
    assert "Warmup:" not in text and ".)." not in text, text


def _cache(nb: Notebook):
    import nbkit

    return nbkit.CachedDataset.open(str(nb.path.parent / "cache" / "mnist"))


def test_02_click_through_warmup_stop_export_then_the_rest(open_02, tmp_path):
    """Warm up, Stop mid-way, Export tar, then the remaining cells: they finish and the tar is whole."""
    import nbkit

    nb = open_02(offline_samples=STOPPABLE_SAMPLES)
    panel, _ = _landmarks(nb)
    nb.run(0, panel + 1)
    nb.wait(panel, timeout=120)

    nb.click(panel, "Warm up")
    _until(lambda: 0 < (nb.progress(panel) or 0) < 100, 60, "warmup progress", lambda: nb.widget_text(panel))
    nb.click(panel, "Stop")
    _until(lambda: STOPPED.search(nb.widget_text(panel)), 30, "a stopped status", lambda: nb.widget_text(panel))
    stats = _cache(nb).stats
    assert 0 < stats.cached < stats.total, f"harness: Stop did not land mid-way ({stats}); raise STOPPABLE_SAMPLES"

    _until(lambda: nb.button(panel, "Stop").is_disabled(), 30, "the stopped warmup's end", lambda: nb.widget_text(panel))
    _idle_panel_is_true(nb, panel)
    assert re.search(r"The warmup stopped at [\d,]+ of 12,000 samples, every one kept in the cache\. Click Warm up to resume\.",
                     flat(nb.widget_text(panel)))

    before = nb.widget_text(panel)
    nb.click(panel, "Export tar")
    _wait_for_job_end(nb, panel, before)
    _idle_panel_is_true(nb, panel)  # the bar shows the (partial) cache again, not "Export 100%"
    assert "partial" in nb.widget_text(panel)

    nb.run(panel + 1)
    nb.wait_all(timeout=300)  # every cell ran without an error, training included (bounded: no hang)

    restored = tmp_path / "restored"
    nbkit.import_tar(str(nb.path.parent / "export" / "mnist-cache.tar"), str(restored))
    again = nbkit.CachedDataset.open(str(restored))
    assert len(again) == STOPPABLE_SAMPLES
    assert again.stats.complete, f"the notebook kept a tar of a partial cache: {again.stats}"


def test_02_upload_with_an_empty_url_then_the_rest(open_02):
    """Warm up, then an Upload refused for its empty URL: the panel shows it, the later cells pass."""
    nb = open_02(upload_url="")
    panel, _ = _landmarks(nb)
    nb.run(0, panel + 1)
    nb.wait(panel, timeout=120)
    # With the cache complete, the later cells click nothing: only the Upload error could stop them.
    before = nb.widget_text(panel)
    nb.click(panel, "Warm up")
    _wait_for_job_end(nb, panel, before)
    assert _cache(nb).stats.complete, nb.widget_text(panel)

    before = nb.widget_text(panel)
    nb.click(panel, "Upload")
    text = _until(lambda: (t := nb.widget_text(panel)) != before and re.search(r"(?i)\b(error|url)\b", t) and t,
                  30, "the Upload error in the panel", lambda: nb.widget_text(panel))
    assert re.search(r"(?i)url", text), text

    nb.run(panel + 1)
    nb.wait_all(timeout=300)  # no cell re-raises the Upload error
    _, waits = _landmarks(nb)
    printed = flat(nb.text(waits))  # the warmup's own outcome, not the panel's last status
    assert re.search(r"warmup: [\d,]+ samples computed in [\d.]+ s cache complete", printed), printed
    assert "Upload" not in printed and "Error" not in printed, printed


def test_02_upload_to_an_unreachable_endpoint_short_error_details_on_click_then_retry(open_02):
    """Upload to an endpoint that refuses connections: a short classified error at once, its
    details (the cause) one click away, and Upload again says the same, with no stale text."""
    import socket

    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nb = open_02(upload_url="gs://nbkit-nowhere/cache",
                 storage_options={"endpoint_url": f"http://127.0.0.1:{port}", "token": "anon"})
    panel, _ = _landmarks(nb)
    nb.run(0, panel + 1)
    nb.wait(panel, timeout=120)
    for attempt in range(2):  # the first try, then a retry
        nb.click(panel, "Upload")
        # The cause stays in the closed details (so a retry's fresh error is told from the opened one).
        text = _until(lambda: "cannot reach" in (t := nb.widget_text(panel)) and "ConnectionRefusedError" not in t
                      and nb.button(panel, "Stop").is_disabled() and t, 60, "the Upload's error", lambda: nb.widget_text(panel))
        assert f"cannot reach the endpoint 127.0.0.1:{port} (connection refused)" in text and "Traceback" not in text, text
        assert "it resumes" not in text, text  # nothing was uploaded
        error = text[text.index("Error: OSError"):].splitlines()
        assert error[3:4] == ["details"], text  # three lines, then the disclosure
        summary = nb.output(panel).locator("summary", has_text="details").first
        # It looks clickable in both front ends: a hand cursor and a disclosure triangle, ▸ then ▾
        # (the classic Notebook's stylesheet makes summaries blocks without one, under ipywidgets 7).
        assert _summary_look(summary) == ("pointer", "list-item", "disclosure-closed")
        summary.click()
        opened = _until(lambda: "ConnectionRefusedError" in (t := nb.widget_text(panel)) and t, 10,
                        "the details shown", lambda: nb.widget_text(panel))
        assert _summary_look(summary) == ("pointer", "list-item", "disclosure-open")
        assert opened.count("cannot reach the endpoint") == 2, opened  # the line, and the whole message once


def _summary_look(summary) -> tuple[str, str, str]:
    """A ``<summary>``'s cursor, display and list-style type, as the browser computes them."""
    return tuple(summary.evaluate("el => { const s = getComputedStyle(el);"
                                  " return [s.cursor, s.display, s.listStyleType]; }"))


def test_02_overwrite_left_ticked_run_all_twice_keeps_the_complete_cache(open_02):
    """The form's overwrite ticked, Run All, then Run All again (a user who left the box on): the
    second run reopens the complete cache, warms up nothing, and says so."""
    import nbkit

    nb = open_02(overwrite=True)
    nb.run_all()
    nb.wait_all(timeout=300)
    meta = nbkit.format.read_meta(str(nb.path.parent / "cache" / "mnist"))
    assert _cache(nb).stats.complete
    opened = nb.index("nbkit.CachedDataset(source, cache_path")
    assert "created a new cache at" in nb.text(opened), nb.text(opened)

    nb.run_all()
    nb.wait_all(timeout=300)
    again = nbkit.format.read_meta(str(nb.path.parent / "cache" / "mnist"))
    assert again["generation"] == meta["generation"], "the second run rebuilt the cache"
    text = flat(nb.text(opened))  # (printed lines are filled to a narrow width)
    assert "reopened the cache at cache/mnist, built from this source (overwrite keeps it;" in text, text
    warm = flat(nb.text(nb.index('panel.run("warmup")')))
    assert "warmup: nothing to do, every sample was already cached" in warm, warm


def test_02_stop_while_a_cell_waits_for_the_panel(open_02):
    """Run All blocks in panel.wait(); a Stop click must stop the warmup there and then."""
    nb = open_02(offline_samples=LONG_SAMPLES)
    panel, waits = _landmarks(nb)
    nb.run_all()
    nb.wait_started(waits, timeout=120)
    _until(lambda: 0 < (nb.progress(panel) or 0) < 50, 120, "warmup progress", lambda: nb.widget_text(panel))
    assert nb.cells()[waits]["running"], "harness: the panel.wait() cell is not running any more"

    clicked = time.monotonic()
    nb.click(panel, "Stop", timeout=5)
    deadline = clicked + STOP_WITHIN_S
    # Run All goes on past the Stop: the next cell (the export) may replace the panel's status at
    # once, so the cell's own line (the panel's sentence) counts as well.
    while not (STOPPED.search(text := nb.widget_text(panel)) or STOPPED.search(nb.text(waits))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    took = time.monotonic() - clicked
    assert STOPPED.search(text) or STOPPED.search(nb.text(waits)), (
        f"Stop, clicked while cell {waits} blocked in panel.wait(), had not stopped the warmup after "
        f"{took:.1f}s (the click waits behind the running cell); the panel shows:\n{text}\n"
        f"cell {waits} printed:\n{nb.text(waits)[-3000:]}")
    assert (nb.progress(panel) or 0) < 100, f"the warmup ran to the end before it stopped:\n{text}"
    # A Stop is a result: the cell ends without a traceback, saying what the panel says, and Run All
    # goes on (the training reads the cache with its source: a missing sample is computed).
    nb.wait_all(timeout=300)
    said = flat(nb.text(waits))
    sentence = re.search(r"The warmup stopped at [\d,]+ of 60,000 samples, every one kept in the cache\. "
                         r"Click Warm up to resume\.", said)
    assert sentence, said
    if STOPPED.search(text):  # the panel's status, caught before the next cell replaced it: the same words
        assert sentence.group(0) in flat(text), text
    assert nb.error(waits) is None


@pytest.fixture(scope="module", params=["lab", "classic"])
def ran_02(request, chromium):
    """Notebook 02 after Run All in one front end: ``(notebook, error or None)``; shared by two tests."""
    server = request.getfixturevalue(f"{request.param}_server")
    context = chromium.new_context(viewport={"width": 1400, "height": 900}, device_scale_factor=2)
    page = context.new_page()
    console = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    page.console_log = console
    path = server.root / "run-all" / NB02.name
    path.parent.mkdir(exist_ok=True)
    shutil.copyfile(NB02, path)
    set_parameters(path, **SMALL_02)
    nb = Notebook(page, server, path).open()
    nb.run_all()
    try:
        nb.wait_all(timeout=300)
        error = None
    except CellError as e:
        error = e
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"run-all-{server.kind}-failure.png"), full_page=True)
    yield nb, error
    (ARTIFACTS / f"run-all-{server.kind}-console.txt").write_text("\n".join(console))
    server.shut_down_kernel(path)
    context.close()


def test_02_run_all(ran_02):
    nb, error = ran_02
    if error is not None:
        pytest.fail(str(error))
    panel, _ = _landmarks(nb)
    try:
        assert nb.progress(panel) == 100, nb.widget_text(panel)
        assert _cache(nb).stats.complete
        _idle_panel_is_true(nb, panel)  # after the export cell: the cache's fill, not "Export 100%"
        assert "cache complete: True" in flat(nb.text(nb.index('panel.run("warmup")')))
        meter = nb.index("HitRateMeter(")
        assert "hit rate" in nb.widget_text(meter).lower()
    except AssertionError:
        ARTIFACTS.mkdir(exist_ok=True)
        nb.page.screenshot(path=str(ARTIFACTS / f"run-all-{nb.server.kind}-failure.png"), full_page=True)
        (ARTIFACTS / f"run-all-{nb.server.kind}-console.txt").write_text("\n".join(nb.page.console_log))
        raise


def test_02_screenshots_and_nothing_cut_at_400_or_600px(ran_02):
    """Screenshots of the panel and the meter at each width; at 400 and 600 px nothing is cut, split
    mid-word, hidden in a scroller without a scrollbar, or left alone at a line's start."""
    nb, error = ran_02
    panel, meter = nb.index("WarmupPanel("), nb.index("HitRateMeter(")
    problems = {}
    for width in WIDTHS:
        for name, index in (("warmup-panel", panel), ("hit-rate-meter", meter)):
            nb.screenshot(index, SCREENSHOTS / f"{nb.server.kind}-{name}-{width}.png", width)
            if width in NARROW:
                problems[f"{name} at {width} px"] = clipped(nb.output(index))
    assert error is None, f"the screenshots show a failed run: {error}"
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, f"cut in {nb.server.kind}: {problems}"


# -- every notebook at 400 px ----------------------------------------------------------------------------


def small_parameters(path: Path) -> dict:
    """The notebook's small offline parameters (``run_notebooks.SMALL``), on the CPU device where it has one."""
    parameters = dict(run_notebooks.SMALL[path.stem])
    cell = next(c for c in nbformat.read(str(path), as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    if re.search(r"^device\s*=", cell.source, re.M):
        parameters["device"] = "cpu"  # no XLA compilation to wait for
    return parameters


def narrow_problems(nb: Notebook, width: int = 400) -> dict:
    """At ``width`` px, what :func:`frontends.clipped` finds in each code cell's output: a label or a
    text cut, a word (printed or in a widget) broken across lines, a table or text scrolling sideways
    without a visible scrollbar."""
    nb.page.set_viewport_size({"width": width, "height": 900})
    nb.page.wait_for_timeout(600)  # the front end lays out again on resize
    problems = {}
    for i, cell in enumerate(nb.cells()):
        if cell["type"] == "code" and cell["outputs"] and (found := clipped(nb.output(i))):
            problems[f"cell {i}"] = found
    return problems


# Each line of the printed text (``pre``) as the page lays it out: a new line wherever the next
# character sits lower, whether the text broke there or the browser wrapped it.
_SHOWN_LINES_JS = """el => [...el.querySelectorAll('pre')].flatMap(p => {
    const r = document.createRange(), lines = [];
    let top = null, line = '';
    const walk = document.createTreeWalker(p, NodeFilter.SHOW_TEXT);
    for (let n = walk.nextNode(); n; n = walk.nextNode()) for (let i = 0; i < n.data.length; i++) {
        const ch = n.data[i];
        if (ch === '\\n') { lines.push(line); line = ''; top = null; continue; }
        r.setStart(n, i); r.setEnd(n, i + 1);
        const box = [...r.getClientRects()].find(b => b.width > 0);
        if (!box) { line += ' '; continue; }
        const t = Math.round(box.top);
        if (top !== null && Math.abs(t - top) > 2) { lines.push(line); line = ''; }
        top = t; line += ch;
    }
    lines.push(line);
    return lines;
})"""


def _words_intact(nb: Notebook, index: int) -> list[str]:
    """The lines of what cell ``index`` printed, as the page shows them, that hold a piece of a
    word (the browser broke a word across lines): none when every line is whole printed words."""
    words = set(nb.text(index).split())
    shown = nb.output(index).evaluate(_SHOWN_LINES_JS)
    return [ln for ln in shown if any(w not in words for w in ln.split())]


#: Lines as the notebooks print them, with the words the classic Notebook once broke at 400 px
#: ("ther / e", "60,00 / 0", "188.6 M / B"): each fill of say() must fit the real output area.
SAID = [
    "cache complete: True (60,000 of 60,000 samples, 188.6 MB); there is nothing left to compute",
    "The warmup stopped at 32,768 of 60,000 samples, every one kept in the cache. Click Warm up to resume.",
    "dask engine kept running: Warm up in the panel needs it to finish the cache. Run this cell again "
    "once it is complete; running the notebook again uses it.",
    "verified: every one of 60,000 samples matches its checksum; 188.6 MB of sample data, 60,000 samples",
    "its 2 processes hold 1,734 MiB of memory (resident, measured now; the largest 868 MiB)",
]


def test_say_fits_the_printed_width_at_400_and_600px(page, frontend, notebook_dir):
    """The output area's real width in characters, measured in each front end at 400 and 600 px: a
    line of say() (nbkit.text.NARROW_COLUMNS) fits it, and what the notebooks print shows with no
    word broken across lines."""
    from nbkit.text import NARROW_COLUMNS

    path = _notebook(notebook_dir / "width.ipynb", [
        "print('0123456789' * 12)",
        f"from nbkit.text import say\nfor line in {SAID!r}:\n    say(line)",
        # A long output: the classic Notebook scrolls it in a box whose scrollbar takes its width.
        "print('0123456789' * 12)\nfor k in range(300):\n    print(k)",
        f"for k in range(40):\n    for line in {SAID!r}:\n        say(line)",
    ])
    nb = Notebook(page, frontend, path).open()
    nb.run_all()
    try:
        nb.wait_all(timeout=120)
        measured = {}
        for width in NARROW:
            page.set_viewport_size({"width": width, "height": 900})
            page.wait_for_timeout(600)  # the front end lays out again on resize
            # A line with no space breaks anywhere: its first shown line is the area's width in characters.
            measured[width] = min(len(nb.output(i).evaluate(_SHOWN_LINES_JS)[0]) for i in (0, 2))
            broken = {i: b for i in (1, 3) if (b := _words_intact(nb, i))}
            assert not broken, f"at {width} px in {frontend.kind}, say() lines broken mid-word: {broken}"
    finally:
        page.set_viewport_size({"width": 1400, "height": 900})
        frontend.shut_down_kernel(path)
    print(f"{frontend.kind}: columns of printed text by width {measured}")
    # say() keeps two columns of room (nbkit.text.NARROW_COLUMNS says why) in every front end.
    assert NARROW_COLUMNS + 2 <= measured[400] <= measured[600], (frontend.kind, measured)


@pytest.mark.parametrize("name", ["01_tpu_setup", "03_benchmark", "04_resume", "05_build_on_a_cluster", "06_jax"])
def test_a_notebook_at_400_and_600px_nothing_cut_no_word_broken(name, page, frontend, notebook_dir):
    """Run All with the small parameters, then at 400 and 600 px: every output fits, no printed word is
    broken across lines (02's is checked on ``ran_02``)."""
    if name == "06_jax" and not all(importlib.util.find_spec(m) for m in ("jax", "grain")):
        pytest.skip("06_jax needs nbkit's jax extra (jax, grain): run `make setup`")
    path = notebook_dir / f"{name}.ipynb"
    shutil.copyfile(REPO / "notebooks" / path.name, path)
    set_parameters(path, **small_parameters(path))
    nb = Notebook(page, frontend, path).open()
    nb.run_all()
    try:
        try:
            nb.wait_all(timeout=540)
        except CellError as e:
            # torch_xla 2.9's CPU client now and then segfaults in a spawned process (dmesg: "segfault
            # ... in _XLAC"), which 01's spawn cell reports as BrokenProcessPool. That is torch_xla's,
            # not this test's subject (the layout): run it once more, and only for that.
            if "BrokenProcessPool" not in str(e):
                raise
            frontend.shut_down_kernel(path)
            shutil.copyfile(REPO / "notebooks" / path.name, path)
            set_parameters(path, **small_parameters(path))
            nb = Notebook(page, frontend, path).open()
            nb.run_all()
            nb.wait_all(timeout=540)
        stderr = [o.get("text") for c in nb.cells() if c["type"] == "code" for o in c["outputs"] if o.get("name") == "stderr"]
        assert not stderr, f"{name} in {frontend.kind} wrote to stderr (red on the page): {stderr}"
        problems, broken = {}, {}
        for width in NARROW:  # a phone or Colab's side panel, a small window
            if found := narrow_problems(nb, width):
                problems[width] = found
            if found := _broken_words(nb):
                broken[width] = found
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"{frontend.kind}-{name}-{width}.png"), full_page=True)
    finally:
        frontend.shut_down_kernel(path)
    assert not problems, f"{name} in {frontend.kind}, by width: {problems}"
    assert not broken, f"{name} in {frontend.kind}, printed lines with broken words, by width: {broken}"


def _broken_words(nb: Notebook) -> dict:
    """The code cells whose printed lines show a word broken across lines, as laid out now."""
    return {i: b for i in range(len(nb.cells())) if nb.cells()[i]["type"] == "code" and (b := _words_intact(nb, i))}


def test_02_at_400_and_600px_nothing_cut_no_word_broken(ran_02):
    nb, error = ran_02
    assert error is None, f"the run failed: {error}"
    problems, broken = {}, {}
    for width in NARROW:
        if found := narrow_problems(nb, width):
            problems[width] = found
        if found := _broken_words(nb):
            broken[width] = found
    nb.page.set_viewport_size({"width": 1400, "height": 900})  # as the other tests on ran_02 expect it
    assert not problems, f"02 in {nb.server.kind}, by width: {problems}"
    assert not broken, f"02 in {nb.server.kind}, printed lines with broken words, by width: {broken}"


@pytest.mark.parametrize("engine_name", ["dask", "ray"])
def test_05_stop_on_a_cluster_is_a_result_and_the_next_run_all_reuses_the_cluster(engine_name, page, frontend,
                                                                                  notebook_dir):
    """Notebook 05 as a user drives it: Run All, Stop clicked while the build cell waits. The cell ends
    without a traceback, nothing is written to stderr, the panel's counts are the cache's; the next
    Run All uses the cluster still up (never a second one) and finishes the cache."""
    import nbkit

    pytest.importorskip("distributed" if engine_name == "dask" else "ray", reason="make setup installs it")
    if engine_name == "ray" and frontend.kind != "lab":
        pytest.skip("Ray's local instance (~15 s, 1 GiB) is clicked through in JupyterLab only")
    path = notebook_dir / "05_build_on_a_cluster.ipynb"
    shutil.copyfile(REPO / "notebooks" / path.name, path)
    set_parameters(path, **{**run_notebooks.SMALL["05_build_on_a_cluster"], "engine_name": engine_name,
                            "offline_samples": 30_000, "part_size": 1024})
    nb = Notebook(page, frontend, path).open()
    panel, build = nb.index("WarmupPanel("), nb.index('panel.run("warmup")')
    close = nb.index("engine kept running")
    try:
        nb.run_all()
        nb.wait_started(build, timeout=240)
        _until(lambda: 0 < (nb.progress(panel) or 0) < 60, 240, "build progress", lambda: nb.widget_text(panel))
        nb.click(panel, "Stop", timeout=10)
        nb.wait_all(timeout=300)  # no cell failed: a Stop is a result, and Run All went on
        cells = nb.cells()
        stderr = [o.get("text") for c in cells if c["type"] == "code" for o in c["outputs"] if o.get("name") == "stderr"]
        assert not stderr, f"stderr on the page: {stderr}"
        stats = nbkit.CachedDataset.open(str(notebook_dir / "cache" / "mnist-built")).stats
        assert 0 < stats.cached < stats.total, f"harness: the Stop did not land mid-way ({stats})"
        sentence = (f"The warmup stopped at {stats.cached:,} of {stats.total:,} samples, every one kept in the cache. "
                    "Click Warm up to resume.")
        assert sentence in flat(nb.text(build)), nb.text(build)
        assert "Traceback" not in nb.text(build)
        shown = flat(nb.widget_text(panel))
        assert f"{stats.cached:,} of {stats.total:,}" in shown or sentence in shown, shown
        assert f"{engine_name} engine kept running" in flat(nb.text(close)), nb.text(close)

        nb.run_all()  # again, in the same kernel: the cluster still up is used, and the build finishes
        nb.wait_all(timeout=300)
        engine_cell = nb.index("engine_for(")
        said = flat(nb.text(engine_cell))
        assert f"{engine_name}: the 2 workers started before are still up; using them" in said, said
        assert f"starting {engine_name}" not in said, said
        assert f"{engine_name} engine closed" in flat(nb.text(close)), nb.text(close)
        assert nbkit.CachedDataset.open(str(notebook_dir / "cache" / "mnist-built")).stats.complete
    finally:
        frontend.shut_down_kernel(path)
