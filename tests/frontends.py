"""Real notebook front ends for the browser tests, and one driver for both.

* **JupyterLab 4 with ipywidgets 8**: the ``jupyterlab`` of this environment (``make setup``
  installs it through the ``dev`` extra).
* **The classic Notebook 6 with ipywidgets 7.7.1** (Colab's widget version): a separate virtual
  environment made from ``tests/widgets7/classic.txt`` by ``make setup`` (tests/testenvs.py;
  :func:`classic_env`), whose server *and* kernel import ipywidgets 7.7.1; a ``.pth`` file puts this
  environment's site-packages (``NBKIT_MAIN_SITE``) after its own, so the kernel still imports torch,
  torchvision and nbkit from here.

Both servers run on a free 127.0.0.1 port with a token, serve a directory of notebook copies (they
autosave), and keep their settings, runtime files and kernels away from the user's ``~/.jupyter``.
:class:`Notebook` drives either one in a playwright page: open, run all or a range of cells, wait
for a cell, click a widget button, read widget text and cell outputs, take screenshots.

Cells are run through each front end's own API (JupyterLab's ``window.jupyterapp.commands``, the
classic ``Jupyter.notebook``), not its menus: clicking *Run All* in JupyterLab's menu failed once in
eleven tries here, the command API never did.

Copy chosen screenshots into the docs: ``python tests/frontends.py update-docs``.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import testenvs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ARTIFACTS = REPO / "test-artifacts"
SCREENSHOTS = ARTIFACTS / "screenshots"
DOCS_SCREENSHOTS = REPO / "docs" / "screenshots"
# The screenshots ``update-docs`` copies into docs/screenshots/ (the README shows the 600 px ones).
DOCS_CHOICE = [
    f"{frontend}-{what}-{width}.png"
    for frontend in ("lab", "classic") for what in ("warmup-panel", "hit-rate-meter") for width in (400, 600, 1000, 1400)
]
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# -- the classic Notebook 6 environment -------------------------------------------------------------


def classic_env() -> Path:
    """The python of the classic Notebook 6 environment (tests/testenvs.py; ``make setup`` builds it).

    Raises :class:`testenvs.Missing` (its message says to run ``make setup``) when it is not built:
    the tests never install packages. The servers run it with ``NBKIT_MAIN_SITE`` set to the running
    stack's site-packages (:func:`_isolated_env`), so its kernel gets ipywidgets 7.7.1,
    ipykernel 6 and Notebook 6 from it and torch, torchvision and nbkit from here.
    """
    return testenvs.classic_python()


# -- servers ---------------------------------------------------------------------------------------------


@dataclass
class Server:
    """A running notebook server: ``kind`` is ``"lab"`` or ``"classic"``."""

    kind: str
    url: str
    token: str
    root: Path
    log: Path

    def notebook_url(self, path: Path) -> str:
        if self.kind == "lab":
            # A workspace of its own: the default one would reopen every notebook an earlier page opened.
            return f"{self.url}lab/workspaces/{secrets.token_hex(4)}/tree/{self.relative(path)}?token={self.token}"
        return f"{self.url}notebooks/{self.relative(path)}?token={self.token}"

    def relative(self, path: Path) -> str:
        return Path(path).resolve().relative_to(self.root.resolve()).as_posix()

    def api(self, method: str, endpoint: str):
        """Call the server's REST API (``/api/...``) with the token; return the decoded JSON or None."""
        request = urllib.request.Request(f"{self.url}api/{endpoint}", method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as r:
            body = r.read()
        return json.loads(body) if body else None

    def shut_down_kernel(self, path: Path):
        """End the kernel of the notebook at ``path`` (so a test's leftover work stops using the CPU)."""
        rel = self.relative(path)
        for session in self.api("GET", "sessions"):
            if session.get("path") == rel or session.get("notebook", {}).get("path") == rel:
                self.api("DELETE", f"sessions/{session['id']}")


def _isolated_env(state: Path) -> dict:
    """Settings, runtime files and data paths of a server's own, so ~/.jupyter cannot change a run."""
    dirs = {name: state / name for name in ("config", "data", "runtime", "settings", "workspaces")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    # JupyterLab: render every cell (no windowing, so each cell's output is in the DOM), no news
    # or update checks (offline here, and their toasts cover the notebook).
    lab_settings = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    }
    for name, value in lab_settings.items():
        plugin, file = name.split("/", 2)[:2], name.split("/", 2)[2]
        target = dirs["settings"] / "/".join(plugin) / file
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(value))
    env = {**os.environ}
    env.update({
        "JUPYTER_CONFIG_DIR": str(dirs["config"]),
        "JUPYTER_DATA_DIR": str(dirs["data"]),
        "JUPYTER_RUNTIME_DIR": str(dirs["runtime"]),
        "JUPYTERLAB_SETTINGS_DIR": str(dirs["settings"]),
        "JUPYTERLAB_WORKSPACES_DIR": str(dirs["workspaces"]),
        "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"),
        # The classic Notebook's environment adds this environment's packages after its own (testenvs.py).
        "NBKIT_MAIN_SITE": sysconfig.get_paths()["purelib"],
        # The kernels import the checkout under test (not some other installed nbkit).
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    })
    env.pop("JUPYTER_PATH", None)
    return env


@contextmanager
def serve(kind: str, root: Path, state: Path, *, python: str | None = None, timeout: float = 120):
    """Run a ``"lab"`` or ``"classic"`` server on ``root``; yield a :class:`Server`.

    ``python`` is the interpreter whose server runs (and whose kernel it starts): this one for
    JupyterLab, :func:`classic_env`'s for the classic Notebook. Its log is ``state/<kind>.log``.
    """
    from servers import free_port

    port, token = free_port(), secrets.token_hex(16)
    python = python or sys.executable
    common = ["--no-browser", f"--port={port}", "--ip=127.0.0.1"]
    if os.geteuid() == 0:
        common.append("--allow-root")
    if kind == "lab":
        cmd = [python, "-m", "jupyterlab", *common, f"--ServerApp.root_dir={root}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    elif kind == "classic":
        cmd = [python, "-m", "notebook", *common, f"--NotebookApp.notebook_dir={root}",
               "--NotebookApp.port_retries=0", f"--NotebookApp.token={token}"]
    else:
        raise ValueError(f"front end {kind!r}: expected 'lab' or 'classic'")
    log = state / f"{kind}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=_isolated_env(state), cwd=root)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} server exited with code {proc.returncode}; log:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{kind} server did not answer on {url} within {timeout:.0f}s; log:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield Server(kind, url, token, Path(root), log)
    finally:
        proc.terminate()  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


# -- the driver -----------------------------------------------------------------------------------------

# Each front end's answers to the same questions, as JavaScript functions of the cell index.
_JS = {
    "lab": {
        "ready": """() => {
            const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
            // The widget manager registers its comm target once the kernel is connected.
            return !!(k && k.connectionStatus === 'connected' && k.status === 'idle'
                      && w.content.widgets.length > 0 && (!k._targetRegistry || k._targetRegistry['jupyter.widget']));
        }""",
        "cells": """() => window.jupyterapp.shell.currentWidget.content.widgets.map(c => ({
            type: c.model.type, source: c.model.sharedModel.getSource(),
            count: c.model.type === 'code' ? c.model.executionCount : null,
            running: c.model.type === 'code' && (c.model.executionState === 'running' || c.promptNode.textContent.includes('*')),
            outputs: c.model.type === 'code' ? c.model.outputs.toJSON() : []}))""",
        "run_all": "() => { void window.jupyterapp.commands.execute('notebook:run-all-cells'); }",
        "run_range": """([start, stop]) => {
            const nb = window.jupyterapp.shell.currentWidget.content;
            nb.activeCellIndex = start; nb.deselectAll(); nb.extendContiguousSelectionTo(stop - 1);
            void window.jupyterapp.commands.execute('notebook:run-cell');
        }""",
        "cell": ".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook .jp-Cell",
        "output": ".jp-Cell-outputWrapper",
    },
    "classic": {
        "ready": """() => {
            const nb = window.Jupyter && Jupyter.notebook, k = nb && nb.kernel;
            return !!(k && k.is_connected() && nb._fully_loaded && k.comm_manager.targets['jupyter.widget']
                      && document.querySelector('#kernel_indicator_icon.kernel_idle_icon'));
        }""",
        "cells": """() => Jupyter.notebook.get_cells().map(c => ({
            type: c.cell_type, source: c.get_text(),
            count: c.cell_type === 'code' && typeof c.input_prompt_number === 'number' ? c.input_prompt_number : null,
            running: c.cell_type === 'code' && c.element.hasClass('running'),
            outputs: c.cell_type === 'code' ? c.output_area.outputs : []}))""",
        "run_all": "() => { Jupyter.notebook.execute_all_cells(); }",
        "run_range": "([start, stop]) => { Jupyter.notebook.execute_cell_range(start, stop); }",
        "cell": "#notebook-container > .cell",
        "output": ".output_wrapper",
    },
}


# Marks (before the page's own scripts run) when the classic widget manager falls back to listing the
# kernel's comms, the step after which its restore of the kernel's widgets ends.
_CLASSIC_WIDGETS_RESTORED = """(() => {
    const warn = console.warn.bind(console);
    console.warn = (...args) => {
        if (String(args[0]).includes('jupyter.widget.control')) window.__nbkitWidgetsFallback = true;
        warn(...args);
    };
})();"""


class CellError(AssertionError):
    """A cell ended with an error, was not run, or did not finish in time; the message says which."""


class Notebook:
    """One notebook open in a page of either front end; the same calls drive both.

    Cell indices count every cell, markdown included, as in the ``.ipynb`` file.
    """

    def __init__(self, page, server: Server, path: Path):
        self.page, self.server, self.path = page, server, Path(path)
        self.js = _JS[server.kind]

    # -- opening and running --

    def open(self, timeout: float = 120) -> "Notebook":
        """Load the notebook and wait until its kernel is idle and widgets can render."""
        if self.server.kind == "classic":
            self.page.add_init_script(_CLASSIC_WIDGETS_RESTORED)
        self.page.goto(self.server.notebook_url(self.path), timeout=timeout * 1000)
        self.page.wait_for_function(self.js["ready"], timeout=timeout * 1000, polling=200)
        if self.server.kind == "classic":
            # The widget manager restores the kernel's widgets after the kernel is ready, then renders
            # again every output holding a widget: a cell run before that ends loses its widget views
            # (the outputs go blank). Wait for the restore: with ipywidgets 7.7.1 it asks the
            # "jupyter.widget.control" comm (the kernel has none, so it says so in the console), then
            # lists the open comms (a reply the kernel's message callbacks wait for).
            self.page.wait_for_function(
                "() => window.__nbkitWidgetsFallback && Object.keys(Jupyter.notebook.kernel._msg_callbacks).length === 0",
                timeout=15_000, polling=100)
        if self.server.kind == "lab":
            # The file browser opens with JupyterLab and takes 450 px of a narrow screen; the notebook is
            # what the tests look at (at 600 px the output area is then ~470 px: Lab's 1000 px with it open).
            self.page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        return self

    def cells(self) -> list[dict]:
        """Each cell as ``{type, source, count, running, outputs}`` (outputs in nbformat JSON)."""
        return self.page.evaluate(self.js["cells"])

    def index(self, text: str) -> int:
        """The index of the first code cell whose source contains ``text``."""
        for i, cell in enumerate(self.cells()):
            if cell["type"] == "code" and text in cell["source"]:
                return i
        raise LookupError(f"no code cell of {self.path.name} contains {text!r}")

    def run_all(self):
        self.page.evaluate(self.js["run_all"])

    def run(self, start: int, stop: int | None = None):
        """Queue cells ``start`` to ``stop - 1`` (to the end when ``stop`` is None); do not wait."""
        stop = len(self.cells()) if stop is None else stop
        self.page.evaluate(self.js["run_range"], [start, stop])

    def wait_started(self, index: int, timeout: float = 60):
        """Wait until cell ``index`` runs (or has run)."""
        self._wait(lambda c: c["running"] or c["count"] is not None, index, timeout, "start")

    def wait(self, index: int, timeout: float = 120):
        """Wait until cell ``index`` has run and is done; raise :class:`CellError` if it failed.

        When an earlier cell failed, the front end skips the rest: the message names that cell.
        """
        self._wait(lambda c: c["count"] is not None and not c["running"], index, timeout, "finish",
                   give_up=lambda cells: self._first_error(cells, index) is not None)
        self.check(index, index + 1)

    def wait_all(self, timeout: float = 300):
        """Wait for the last code cell, and check that every code cell ran without an error."""
        cells = self.cells()
        last = max(i for i, c in enumerate(cells) if c["type"] == "code")
        self.wait(last, timeout)
        self.check(0, len(cells))

    def check(self, start: int, stop: int):
        """Raise :class:`CellError` unless every code cell in ``start..stop-1`` ran without an error."""
        cells = self.cells()
        failed = self._first_error(cells, stop)
        if failed is not None and failed >= start:
            raise CellError(f"cell {failed} of {self.path.name} failed in {self.server.kind}:\n{self.text(failed, cells)[-4000:]}")
        not_run = [i for i in range(start, stop) if cells[i]["type"] == "code" and cells[i]["count"] is None]
        if not_run:
            raise CellError(f"cells {not_run} of {self.path.name} did not run in {self.server.kind}")

    def _first_error(self, cells, stop):
        for i, cell in enumerate(cells[:stop]):
            if any(o.get("output_type") == "error" for o in cell["outputs"]):
                return i
        return None

    def _wait(self, done, index, timeout, what, give_up=lambda cells: False):
        deadline = time.monotonic() + timeout
        while True:
            cells = self.cells()
            if done(cells[index]):
                return
            if give_up(cells):
                failed = self._first_error(cells, index)
                raise CellError(f"cell {index} of {self.path.name} will not run in {self.server.kind}: cell {failed} "
                                f"failed:\n{self.text(failed, cells)[-4000:]}")
            if time.monotonic() > deadline:
                running = [i for i, c in enumerate(cells) if c["running"]]
                raise CellError(f"cell {index} of {self.path.name} did not {what} within {timeout:.0f}s in "
                                f"{self.server.kind} (running: {running}); its output so far:\n{self.text(index, cells)[-4000:]}")
            self.page.wait_for_timeout(200)

    # -- reading --

    def text(self, index: int, cells: list | None = None) -> str:
        """What cell ``index`` printed: streams, text results and tracebacks (ANSI colours removed)."""
        parts = []
        for out in (cells or self.cells())[index]["outputs"]:
            kind = out.get("output_type")
            if kind == "stream":
                parts.append("".join(out.get("text", "")))
            elif kind == "error":
                parts.append("\n".join(out.get("traceback", [])) or f"{out.get('ename')}: {out.get('evalue')}")
            elif "text/plain" in out.get("data", {}) and "application/vnd.jupyter.widget-view+json" not in out["data"]:
                parts.append("".join(out["data"]["text/plain"]))
        return _ANSI.sub("", "\n".join(parts))

    def error(self, index: int) -> str | None:
        """``"Name: message"`` of the error cell ``index`` ended with, or None."""
        for out in self.cells()[index]["outputs"]:
            if out.get("output_type") == "error":
                return f"{out.get('ename')}: {_ANSI.sub('', str(out.get('evalue')))}"
        return None

    def output(self, index: int):
        """The playwright locator of cell ``index``'s output area (widgets render there)."""
        return self.page.locator(self.js["cell"]).nth(index).locator(self.js["output"])

    def widget_text(self, index: int) -> str:
        return self.output(index).inner_text()

    def progress(self, index: int) -> float | None:
        """The fill, in percent, of the first progress bar in cell ``index``'s output (None if it has none)."""
        return self.output(index).evaluate(
            "el => { const bar = el.querySelector('.widget-hprogress .progress-bar');"
            " return bar ? parseFloat(bar.style.width || '0') : null; }")

    def button(self, index: int, label: str):
        # The accessible name starts with the icon's glyph (Font Awesome's ::before content) where the
        # icon font loads (the classic Notebook serves it): match the label after any such prefix.
        name = re.compile(rf"^\W*{re.escape(label)}\s*$")
        return self.output(index).get_by_role("button", name=name)

    def click(self, index: int, label: str, timeout: float = 30):
        """Click the widget button labelled ``label`` in cell ``index``'s output."""
        self.button(index, label).click(timeout=timeout * 1000)

    def wait_for_text(self, index: int, pattern: str, timeout: float = 60) -> str:
        """Wait until cell ``index``'s output text matches the regular expression; return the text."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.widget_text(index)
            if re.search(pattern, text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} did not appear in cell {index}'s output within {timeout:.0f}s "
                                     f"in {self.server.kind}; it shows:\n{text}")
            self.page.wait_for_timeout(100)

    def screenshot(self, index: int, path: Path, width: int, height: int = 900) -> Path:
        """Screenshot cell ``index``'s output at a viewport ``width`` px wide."""
        self.page.set_viewport_size({"width": width, "height": height})
        self.page.wait_for_timeout(400)  # the front end lays out again on resize
        output = self.output(index)
        output.scroll_into_view_if_needed()
        path.parent.mkdir(parents=True, exist_ok=True)
        output.screenshot(path=str(path))
        if os.environ.get("NBKIT_FULL_SCREENSHOTS"):  # the whole page too, to see the layout around it
            self.page.screenshot(path=str(path.with_name(path.stem + "-page.png")))
        return path



def flat(text: str) -> str:
    """Printed text with its narrow-output line breaks undone: every run of white space (the breaks of
    lines filled by nbkit.text.say, no-break spaces) one space, and a path that nbkit.text.fill broke
    after a ``/`` (it was longer than a line) whole again."""
    return " ".join(re.sub(r"/\n", "/", text).split())

# What a narrow screen must not do to a widget: labels cut, text clipped, a sideways scroller with no
# visible scrollbar, a word split across lines, table cells wrapped, a separator or a percent alone at
# the start of a line (rows wrap as units), a panel far narrower than the output area it sits in.
CLIPPED_JS = """root => {
    const problems = [], describe = el => `${el.tagName.toLowerCase()}.${[...el.classList].join('.')} "${el.innerText.trim().slice(0, 40)}"`;
    const shown = el => el.offsetParent !== null && el.getClientRects().length > 0;
    const lines = el => {
        const range = document.createRange(); range.selectNodeContents(el);
        return new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top))).size;
    };
    for (const el of root.querySelectorAll('button, .widget-label, .widget-readout, .widget-inline-hbox .widget-html-content')) {
        if (!shown(el) || !el.innerText.trim()) continue;
        if (el.scrollWidth > el.clientWidth + 1) problems.push(`cut: ${describe(el)} (${el.scrollWidth} > ${el.clientWidth} px)`);
    }
    const edge = root.getBoundingClientRect().right;
    for (const el of root.querySelectorAll('button, .widget-label, .widget-readout, .widget-html-content, .widget-hprogress, input, table')) {
        if (shown(el) && el.getBoundingClientRect().right > edge + 1) problems.push(`past the right edge: ${describe(el)}`);
    }
    for (const el of root.querySelectorAll('.widget-html table')) {
        for (const cell of el.querySelectorAll('td, th')) if (cell.innerText.trim() && lines(cell) > 1) problems.push(`wraps: ${describe(cell)}`);
    }
    for (const el of root.querySelectorAll('*')) {
        if (!shown(el) || el.scrollWidth <= el.clientWidth + 1 || !el.innerText.trim()) continue;
        const style = getComputedStyle(el);
        if (style.overflowX === 'visible') continue;
        const bar = el.offsetHeight - el.clientHeight - parseFloat(style.borderTopWidth) - parseFloat(style.borderBottomWidth);
        if (style.overflowX === 'hidden' || style.overflowX === 'clip' || bar < 4)
            problems.push(`hidden scroller: ${describe(el)} (${el.scrollWidth} > ${el.clientWidth} px, scrollbar ${bar} px)`);
    }
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const el = node.parentElement;
        if (!el || !shown(el)) continue;
        for (const m of node.data.matchAll(/\\S+/g)) {
            const range = document.createRange();
            range.setStart(node, m.index); range.setEnd(node, m.index + m[0].length);
            const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
            if (tops.size > 1) problems.push(`split across lines: "${m[0]}" in ${describe(el)}`);
        }
        const dot = node.data.indexOf('·');
        if (dot >= 0 && !node.data.slice(0, dot).trim()) {  // a text that starts with a separator
            const range = document.createRange(); range.setStart(node, dot); range.setEnd(node, dot + 1);
            const box = range.getBoundingClientRect(), line = (el.closest('.widget-html-content, .widget-label, td, li') || el).getBoundingClientRect();
            if (box.width > 0 && box.left - line.left < 2) problems.push(`"·" starts a line in ${describe(el)}`);
        }
    }
    for (const el of root.querySelectorAll('.widget-label, .widget-html-content span')) {
        const text = el.innerText.trim();
        if (!shown(el) || !(text === '·' || /^\\d+%$/.test(text))) continue;
        const box = el.getBoundingClientRect(), parent = el.parentElement.getBoundingClientRect();
        if (box.left - parent.left < 2) problems.push(`alone at the start of a line: ${describe(el)}`);
    }
    for (const el of root.querySelectorAll('.widget-vbox')) {
        if (!shown(el) || (el.parentElement && el.parentElement.closest('.widget-vbox, .widget-hbox'))) continue;
        const width = el.getBoundingClientRect().width, room = el.parentElement.getBoundingClientRect().width;
        const max = getComputedStyle(el).maxWidth;
        if (width < 0.9 * Math.min(room, max.endsWith('px') ? parseFloat(max) : room))
            problems.push(`narrow: ${describe(el)} is ${Math.round(width)} px in ${Math.round(room)} px`);
    }
    return problems;
}"""


def clipped(locator) -> list[str]:
    """What is cut, clipped or wrapped inside ``locator`` (an output area) at the current width."""
    return locator.evaluate(CLIPPED_JS)


def set_parameters(notebook: Path, **values):
    """Rewrite ``notebook``'s cell tagged ``parameters`` in place: each ``name = ...`` line gets a new value."""
    import nbformat

    nb = nbformat.read(str(notebook), as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    lines = cell.source.splitlines()
    for name, value in values.items():
        for i, line in enumerate(lines):
            if re.match(rf"{name}\s*=", line):
                lines[i] = f"{name} = {value!r}"
                break
        else:
            raise KeyError(f"{notebook.name}'s parameters cell has no {name!r}")
    cell.source = "\n".join(lines)
    nbformat.write(nb, str(notebook))


def update_docs(names=DOCS_CHOICE) -> list[Path]:
    """Copy the chosen screenshots from test-artifacts/screenshots/ into docs/screenshots/."""
    missing = [n for n in names if not (SCREENSHOTS / n).is_file()]
    if missing:
        raise FileNotFoundError(f"not in {SCREENSHOTS}: {', '.join(missing)}; run "
                                "`python -m pytest tests/test_browser.py -k screenshots` first")
    DOCS_SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copyfile(SCREENSHOTS / n, DOCS_SCREENSHOTS / n)) for n in names]


if __name__ == "__main__":
    if sys.argv[1:] != ["update-docs"]:
        sys.exit("usage: python tests/frontends.py update-docs   (copies test-artifacts/screenshots/ to docs/screenshots/)")
    for copied in update_docs():
        print(f"updated {copied.relative_to(REPO)}")
