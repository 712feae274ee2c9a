"""Notebook 04 (resume) driven as a user drives it, in **JupyterLab 4 with ipywidgets 8** and the
**classic Notebook 6 with ipywidgets 7.7.1** (Colab's), in headless Chromium.

One browser session per front end walks the sequence a user clicks through, each step a Run All of
a fresh copy of the notebook in one folder (so the cache and the checkpoint carry over, as on a
runtime's disk or Drive), with the form set as the user would set it:

1. ``disconnect_after_steps=13``: the kernel dies once, and the line saying so is shown first;
2. Run All again, the same form: it resumes from the checkpoint, says which steps it trains again
   and that it will not simulate another disconnect, and finishes;
3. the cache deleted, the checkpoint kept (a recycled runtime): it rebuilds the cache and resumes;
4. ``batch_size`` changed: it goes on with the rest of the epoch in the new batches (elastic
   resume), one line saying so;
5. another ``dataset``: its own cache and checkpoint;
6. ``checkpoint_url`` pointing at that other run's checkpoint: the reason in one line, no traceback;
   then ``start_over`` ticked: the checkpoint is moved aside and training starts at step 0.

Run alone: ``PJRT_DEVICE=CPU .venv/bin/python -m pytest tests/test_browser_04.py`` (after ``make setup``).
"""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import pytest

from fixtures_browser import (
    ARTIFACTS, chromium, classic_server, frontend, lab_server, notebook_dir, page,
)
from frontends import CellError, Notebook, flat, set_parameters

# one_stack: the front ends render and click the same on every torch (test_notebooks runs every
# notebook on both stacks); make test runs these, make test-newest leaves them out.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.one_stack]

REPO = Path(__file__).resolve().parents[1]
NB04 = REPO / "notebooks" / "04_resume.ipynb"

_spec = importlib.util.spec_from_file_location("run_notebooks", REPO / "scripts" / "run_notebooks.py")
run_notebooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_notebooks)

# CI's small offline parameters on the CPU: 300 samples, 9 batches of 32 an epoch, a checkpoint every 5 steps.
SMALL_04 = {**run_notebooks.SMALL["04_resume"], "device": "cpu"}


def test_04_disconnect_resume_lost_cache_changed_form(page, frontend, notebook_dir):
    step = [0]

    def open_04(**parameters) -> Notebook:
        """A fresh copy of 04 with the form set, opened in this page, in the same folder as the others."""
        step[0] += 1
        path = notebook_dir / f"04_resume-{step[0]}.ipynb"
        shutil.copyfile(NB04, path)
        set_parameters(path, **{**SMALL_04, **parameters})
        return Notebook(page, frontend, path).open()

    def run_all(nb: Notebook) -> str:
        nb.run_all()
        try:
            nb.wait_all(timeout=240)
        except CellError:
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / f"04-{frontend.kind}-step{step[0]}-failure.png"), full_page=True)
            raise
        return flat("\n".join(nb.text(i) for i, c in enumerate(nb.cells()) if c["type"] == "code"))

    def done(nb: Notebook):
        frontend.shut_down_kernel(nb.path)

    # 1. A simulated disconnect: the kernel dies after 13 steps, and says so first.
    nb = open_04(disconnect_after_steps=13)
    train = nb.index("run_steps = 0")
    nb.run_all()
    text = nb.wait_for_text(train, r"killing\s+this\s+kernel\s+now", timeout=240)
    assert re.search(r"simulating\s+a\s+disconnect\s+at\s+step\s+13", text), text
    page.wait_for_timeout(3000)
    summary = nb.index("losses = [float(l)")
    assert nb.cells()[summary]["count"] is None  # the kernel died in the training cell
    assert (notebook_dir / "cache" / "mnist-resume-checkpoint.pt.disconnected").exists()
    done(nb)

    # 2. Run All again with the same form: it resumes, and does not kill itself again.
    nb = open_04(disconnect_after_steps=13)
    out = run_all(nb)
    assert "reopened cache/mnist-resume without its source dataset: 300 MNIST samples" in out
    assert "resumed from cache/mnist-resume-checkpoint.pt at step 10: epoch 1, 1 of its 9 batches" in out
    assert "steps 11–13 will be trained again" in out
    assert "a disconnect was already simulated (at step 13), so this run will not simulate another" in out
    assert "trained 14 steps in this run, to step 24" in out
    assert nb.progress(train) == 100.0  # the training bar, at train_steps
    done(nb)

    # 3. The runtime's disk lost the cache; the checkpoint was kept: rebuilt from the same source, resumed.
    shutil.rmtree(notebook_dir / "cache" / "mnist-resume")
    nb = open_04(disconnect_after_steps=13, train_steps=30)
    out = run_all(nb)
    assert "built cache/mnist-resume: 300 samples computed" in out
    assert "resumed from cache/mnist-resume-checkpoint.pt at step 24" in out
    assert "(the cache was rebuilt from the same source: the same batches)" in out
    assert "trained 6 steps in this run, to step 30" in out
    assert nb.progress(nb.index("def open_complete_cache")) == 100.0  # the cache build's bar
    done(nb)

    # 4. Another batch_size: the rest of the epoch in the new batches (elastic resume), one line saying so.
    nb = open_04(batch_size=16, train_steps=40)
    out = run_all(nb)
    assert ("resumed from cache/mnist-resume-checkpoint.pt at step 30, with batch_size 16 (the checkpoint's: 32): "
            "the samples of epoch 3 it had not trained on come once each, in batches of 16, then whole epochs") in out, out
    assert "trained 10 steps in this run, to step 40" in out
    done(nb)

    # 5. Another dataset in the form: its own cache and checkpoint, never the MNIST ones.
    nb = open_04(dataset="FashionMNIST", train_steps=5)
    out = run_all(nb)
    assert "cache: cache/fashionmnist-resume checkpoint: cache/fashionmnist-resume-checkpoint.pt" in out
    assert "built cache/fashionmnist-resume: 300 samples computed" in out
    assert "no checkpoint at cache/fashionmnist-resume-checkpoint.pt: starting at step 0" in out
    done(nb)

    # 6. A checkpoint of another run (checkpoint_url): one line saying why, no traceback; then start_over.
    other = "cache/fashionmnist-resume-checkpoint.pt"
    nb = open_04(checkpoint_url=other, train_steps=30)
    nb.run_all()
    model = nb.index("def load_checkpoint")
    with pytest.raises(CellError):
        nb.wait_all(timeout=240)
    error = nb.error(model)
    assert error and error.startswith(f"Stop: The checkpoint {other} does not fit"), error
    shown = nb.text(model)
    assert "Traceback" not in shown and "File " not in shown, shown
    assert "a cache of another source" in flat(shown) and "tick start_over" in flat(shown), shown
    done(nb)
    nb = open_04(checkpoint_url=other, train_steps=30, start_over=True)
    out = run_all(nb)
    assert re.search(r"so it was moved to cache/fashionmnist-resume-checkpoint\.started-over-[0-9-]+\.pt; starting at "
                     r"step 0", out), out
    assert "trained 30 steps in this run, to step 30" in out
    assert len(list((notebook_dir / "cache").glob("fashionmnist-resume-checkpoint.started-over-*.pt"))) == 1
    done(nb)
