"""The WarmupPanel in a real browser: Voila serves a notebook, headless Chromium clicks the buttons.

Run alone: ``PJRT_DEVICE=CPU .venv/bin/python -m pytest tests/test_browser.py``. The finished
panel's screenshot is saved as ``test-artifacts/warmup_panel.png`` (``docs/warmup_panel.png`` is
a copy of a good one).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fixtures_browser import ARTIFACTS, chromium, page, voila  # noqa: F401 - fixtures

pytestmark = [pytest.mark.browser, pytest.mark.slow]

NOTEBOOK = Path(__file__).parent / "notebooks" / "warmup_panel.ipynb"
N_TRAIN = 10_000



def test_warmup_then_export_in_chromium(page, tmp_path):  # noqa: F811 - page is a fixture
    pytest.importorskip("nbkit.archive", reason="nbkit.archive (export_tar/import_tar) is not in this checkout yet")
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
        assert "nbkit cache mnist-cache · 10,000 samples · 0 cached" in panel.inner_text()
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


def test_hit_rate_meter_in_chromium(page, tmp_path):  # noqa: F811 - page is a fixture
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
