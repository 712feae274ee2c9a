"""Browser fixtures: Voila, JupyterLab 4 and the classic Notebook 6 on 127.0.0.1, and a headless Debian
Chromium driven by playwright (the front ends and their driver are in ``tests/frontends.py``).

Chromium is the system one (``/usr/bin/chromium``, installed by ``scripts/install-system-deps.sh``);
``playwright install`` is never run (it downloads browsers). Tests that use these fixtures are
skipped, with the reason, only when chromium is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import frontends
import pytest
import testenvs
from servers import free_port

REPO = Path(__file__).resolve().parents[1]
ARTIFACTS = REPO / "test-artifacts"
#: The servers' state (settings, workspaces, runtime files, log) is this venv's own: the two stacks'
#: suites run at once in one checkout in CI (.ci/run), and must not share a JupyterLab workspace.
RUN = "" if Path(sys.prefix).name == ".venv" else f"-{Path(sys.prefix).name.lstrip('.')}"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    """The system Chromium, or None."""
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


@contextmanager
def voila(notebook: Path, *, env: dict, log: Path, timeout: float = 120.0):
    """Serve ``notebook`` with Voila on a free 127.0.0.1 port; yield its URL.

    Readiness is checked on a static file: loading ``/`` would execute the notebook once more.
    """
    port = free_port()
    cmd = [
        sys.executable, "-m", "voila", str(notebook),
        "--no-browser", f"--port={port}", "--Voila.ip=127.0.0.1", "--show_tracebacks=True",
    ]
    full_env = {**os.environ, **env}
    # The kernel is started from this interpreter; make the checkout importable even when nbkit is
    # not pip-installed (e.g. a test run straight from a clone).
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), full_env.get("PYTHONPATH", "")) if p)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=notebook.parent)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"voila exited with code {proc.returncode}; log:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "voila/static/voila.js", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"voila did not answer on {url} within {timeout:.0f}s; log:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


# One browser for the whole run. Each test module that imports ``chromium`` gets a fixture of its own
# (pytest keys fixtures by the module they are defined in), and playwright's sync API runs only one
# instance per thread: so every copy of the fixture shares this one, and the last to finish closes it.
_BROWSER = {"users": 0, "playwright": None, "browser": None}


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium browser (playwright); skipped when /usr/bin/chromium is not installed."""
    path = chromium_path()
    if path is None:
        pytest.skip("browser tests need Debian chromium: run `sh scripts/install-system-deps.sh` (apt-get install chromium)")
    if _BROWSER["browser"] is None:
        from playwright.sync_api import sync_playwright

        _BROWSER["playwright"] = sync_playwright().start()
        _BROWSER["browser"] = _BROWSER["playwright"].chromium.launch(executable_path=path, headless=True,
                                                                      args=CHROMIUM_ARGS)
    _BROWSER["users"] += 1
    try:
        yield _BROWSER["browser"]
    finally:
        _BROWSER["users"] -= 1
        if _BROWSER["users"] == 0:
            browser, playwright = _BROWSER["browser"], _BROWSER["playwright"]
            _BROWSER.update(browser=None, playwright=None)
            try:
                browser.close()
            finally:
                playwright.stop()


@pytest.fixture
def page(chromium, request):
    """A fresh page; on failure its screenshot is kept under test-artifacts/."""
    context = chromium.new_context(viewport={"width": 1000, "height": 700}, device_scale_factor=2)
    page = context.new_page()
    console = []
    page.on("console", lambda msg: console.append(f"{msg.type}: {msg.text}"))
    page.console_log = console
    failed_before = request.session.testsfailed
    yield page
    if request.session.testsfailed > failed_before:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{request.node.name}-failure.png"), full_page=True)
        (ARTIFACTS / f"{request.node.name}-console.txt").write_text("\n".join(console))
    context.close()


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """JupyterLab 4 (ipywidgets 8) serving a temporary directory; tests put notebook copies in it."""
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed: pip install -e '.[dev]' (make setup)")
    root = tmp_path_factory.mktemp("lab-root")
    with frontends.serve("lab", root, ARTIFACTS / f"lab-server{RUN}") as server:
        yield server


@pytest.fixture(scope="session")
def classic_server(tmp_path_factory):
    """The classic Notebook 6 with ipywidgets 7.7.1 in server and kernel (see frontends.classic_env).

    ``make setup`` builds its environment; when it is missing the tests fail and say so (they never
    install packages).
    """
    python = testenvs.required(frontends.classic_env)
    root = tmp_path_factory.mktemp("classic-root")
    with frontends.serve("classic", root, ARTIFACTS / f"classic-server{RUN}", python=str(python)) as server:
        yield server


@pytest.fixture(params=["lab", "classic"])
def frontend(request, chromium):
    """Each test that takes this runs in JupyterLab 4 and in the classic Notebook 6."""
    return request.getfixturevalue(f"{request.param}_server")


@pytest.fixture
def notebook_dir(frontend, request):
    """A fresh directory inside the served root for this test's notebook copies."""
    path = frontend.root / re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    return path
