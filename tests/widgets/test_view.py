"""What both widgets share (nbkit.widgets.view): the optional ipywidgets import, text outside a
kernel, widgets inside one, and ipywidgets 7.7.1.

Run: ``PJRT_DEVICE=CPU .venv/bin/python -m pytest tests/widgets``. The last test runs this whole
directory again in a subprocess with ipywidgets 7.7.1 (Colab's TPU runtime) first on the path, from
``.venvs/ipywidgets7`` (``make setup`` builds it: tests/testenvs.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import testenvs

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


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
    assert r.stdout.strip() == "nbkit.widgets needs the ipywidgets package (nbkit-cache's 'notebook' extra): pip install ipywidgets"


def test_running_ipywidgets_version():
    # In the ipywidgets 7 run (see the last test) this proves the old version was the one imported.
    import ipywidgets

    expected = os.environ.get("NBKIT_EXPECT_IPYWIDGETS")
    if expected:
        assert ipywidgets.__version__ == expected
    else:
        assert int(ipywidgets.__version__.split(".")[0]) >= 8


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
        "nbkit hit rate: no samples read yet",
    ]


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
        print(panel.state.value, panel.counts[0], [(e.hits, e.misses) for e in meter.epochs])
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


@pytest.mark.slow
@pytest.mark.one_stack  # Colab's widgets with Colab's torch stack (make test)
@pytest.mark.skipif(bool(os.environ.get("NBKIT_EXPECT_IPYWIDGETS")), reason="already the ipywidgets 7 run")
def test_this_directory_passes_with_ipywidgets_7_7_1():
    # make setup builds both directories (tests/testenvs.py); a missing one fails the test and says so.
    target = testenvs.required(testenvs.widgets7_dir)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "NBKIT_EXPECT_IPYWIDGETS": "7.7.1",
        # Colab pairs ipywidgets 7.7.1 with ipykernel 6: test_poll.py also starts a kernel with it.
        "NBKIT_IPYKERNEL6_PATH": str(testenvs.required(testenvs.ipykernel6_dir)),
    }
    r = subprocess.run(
        # Left out: tests that exercise no ipywidgets code (the import checks) or only wait (the
        # unreachable upload spends ~35 s in gcsfs's retries); they run once, in the main run.
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE),
         "-k", "not unreachable_server and not import_nbkit and not missing_ipywidgets",
         "-W", "ignore::DeprecationWarning"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=900,
    )
    assert r.returncode == 0, f"tests/widgets/ failed under ipywidgets 7.7.1:\n{r.stdout[-6000:]}\n{r.stderr[-3000:]}"
    assert re.search(r"\d+ passed", r.stdout), r.stdout[-3000:]



def test_status_lines_break_between_words_never_inside_a_path():
    from nbkit.widgets.view import status_html

    line = status_html("Exported 9.5 MB to export/mnist-cache.tar.", "#2e7d32", bold=True)
    assert "to <span style='white-space:nowrap'>export/mnist-cache.tar.</span>" in line  # not "mnist-" / "cache"
    assert "Exported 9.5 MB" in line and "word-break:normal" in line and "overflow-wrap:break-word" in line
    url = "gs://" + "b" * 60  # longer than a phone's line: it may break inside itself rather than be cut
    assert url in status_html(url) and f"nowrap'>{url}" not in status_html(url)
