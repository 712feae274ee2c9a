#!/usr/bin/env python
"""Write the repository's home, from ``[project.urls] Repository`` in pyproject.toml, into every
notebook's "Install nbkit" cell and Colab badge, and into the README's Colab badges.

The URL lives in one place: change it in pyproject.toml, then run this (``make notebooks`` does).
``tests/test_install_cell.py`` fails while a notebook or the README disagrees with pyproject.toml.

Usage::

    python scripts/stamp_notebooks.py            # stamp notebooks/*.ipynb and README.md in place
    python scripts/stamp_notebooks.py 01 03      # only these notebooks (and no README)
    python scripts/stamp_notebooks.py --check    # exit 1 and list what disagrees; change nothing

The install cell (the code cell whose first line is ``#@title Install nbkit``) is replaced as a whole
by :data:`INSTALL_CELL`; its cell id, tags and position are kept. Only Colab badge links are
rewritten in markdown: ``https://colab.research.google.com/github/<owner>/<repo>/blob/<branch>/notebooks/<name>.ipynb``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
README = REPO / "README.md"
BRANCH = "main"
TITLE = "#@title Install nbkit"
PLACEHOLDER = "CHANGE-ME"  # the owner in pyproject.toml until the repository has a public home

# The cell every notebook starts with. It runs on Colab only, and only when nbkit is not importable;
# its logic is tested by tests/test_install_cell.py, which executes this very text.
INSTALL_CELL = '''\
#@title Install nbkit (on Colab only) { display-mode: "form" }
# Colab starts every runtime from a clean machine, so nbkit is installed there; anywhere else (your
# laptop, CI) the nbkit already installed is used and this cell does nothing. Where from, the first
# that applies: the nbkit_source field (a pip spec, a wheel's path or URL); an nbkit-*.whl uploaded
# next to this notebook (/content on Colab; `make dist` builds one); else the repository below.
nbkit_source = ""  #@param {type:"string"}
NBKIT_REPOSITORY = "{repository}"  # written by scripts/stamp_notebooks.py from pyproject.toml

import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys


def _nbkit_candidates():
    """(pip requirement, where it comes from) for the first source that applies; what was skipped."""
    extras = "nbkit[notebook,gcs]"
    checked = []
    source = nbkit_source.strip()
    if source:
        if os.path.exists(source):
            return f"{extras} @ file://{os.path.abspath(source)}", f"nbkit_source = {source!r}", checked
        if source.endswith(".whl") and "://" not in source:
            raise FileNotFoundError(f"nbkit_source = {source!r}: no such wheel file (upload it to {os.getcwd()}, "
                                    "or give its full path or a URL)")
        if re.match(r"^(git\\+)?[a-z]+://", source):
            return f"{extras} @ {source}", f"nbkit_source = {source!r}", checked
        return source, f"nbkit_source = {source!r}", checked
    checked.append("the nbkit_source field: empty")
    wheels = sorted(glob.glob(os.path.join(os.getcwd(), "nbkit-*.whl")), key=os.path.getmtime)
    if wheels:
        return f"{extras} @ file://{wheels[-1]}", f"the uploaded wheel {wheels[-1]}", checked
    checked.append(f"nbkit-*.whl in {os.getcwd()}: none")
    return f"{extras} @ git+{NBKIT_REPOSITORY}", f"the repository {NBKIT_REPOSITORY}", checked

if "google.colab" in sys.modules and importlib.util.find_spec("nbkit") is None:
    requirement, origin, checked = _nbkit_candidates()
    print(f"Installing nbkit from {origin} ...", flush=True)
    # No terminal prompt: a repository that does not exist (or is private) must fail, not wait.
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", requirement],
                          capture_output=True, text=True, env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    importlib.invalidate_caches()
    if done.returncode != 0 or importlib.util.find_spec("nbkit") is None:
        tail = "\\n    ".join((done.stderr or done.stdout).strip().splitlines()[-6:]) or "(no output)"
        problem = (f"pip exited with {done.returncode}" if done.returncode
                   else "pip succeeded but nbkit is still not importable")
        raise RuntimeError(
            f"Could not install nbkit from {origin}.\\n"
            f"  Tried: pip install -q '{requirement}': {problem}:\\n    {tail}\\n"
            + "".join(f"  Checked first: {c}\\n" for c in checked)
            + "Fix it either way, then run this cell again:\\n"
            f"  1. where you have nbkit's source, run `make dist`, and upload dist/nbkit-*.whl to {os.getcwd()} "
            "(Colab: the folder icon on the left, then Upload);\\n"
            "  2. or set nbkit_source in this cell's form to a pip spec, a wheel path or a URL you can reach, "
            "e.g. git+https://github.com/<you>/nbkit or https://.../nbkit-0.1.0-py3-none-any.whl.")
    print(f"nbkit installed from {origin}")
'''

_BADGE = re.compile(
    r"https://colab\.research\.google\.com/github/[^/\s)\"']+/[^/\s)\"']+/blob/[^/\s)\"']+/notebooks/"
    r"(?P<name>[\w.-]+\.ipynb)")


def repository_url(pyproject=REPO / "pyproject.toml") -> str:
    """``[project.urls] Repository`` of pyproject.toml, without a trailing slash or ``.git``."""
    text = Path(pyproject).read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: a line match is enough for this one key
        match = re.search(r'^Repository\s*=\s*"([^"]+)"', text, re.M)
        url = match.group(1) if match else None
    else:
        url = tomllib.loads(text).get("project", {}).get("urls", {}).get("Repository")
    if not url:
        raise SystemExit(f"{pyproject}: no [project.urls] Repository = \"https://github.com/<owner>/<repo>\"")
    url = url.rstrip("/").removesuffix(".git")
    if not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
        raise SystemExit(f"{pyproject}: Repository = {url!r}: expected https://github.com/<owner>/<repo> "
                         "(Colab opens notebooks from GitHub)")
    return url


def install_cell(url: str) -> str:
    """The install cell's source for the repository ``url``."""
    return INSTALL_CELL.replace("{repository}", url)


def colab_badge(url: str, notebook: str) -> str:
    """The "Open in Colab" link of ``notebooks/<notebook>`` (a file name) in the repository ``url``."""
    return f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}/blob/{BRANCH}/notebooks/{notebook}"


def _stamp_markdown(text: str, url: str) -> str:
    return _BADGE.sub(lambda m: colab_badge(url, m.group("name")), text)


def stamp_notebook(path, url: str) -> list[str]:
    """Stamp one notebook in place (only if something changes); return what changed."""
    import nbformat

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    changes = []
    installs = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(TITLE)]
    if len(installs) != 1:
        raise SystemExit(f"{path}: expected one code cell starting with {TITLE!r}, found {len(installs)}")
    if installs[0].source != install_cell(url):
        installs[0].source = install_cell(url)
        changes.append("install cell")
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            new = _stamp_markdown(cell.source, url)
            if new != cell.source:
                cell.source = new
                changes.append(f"badge in cell {i}")
    if changes:
        nbformat.write(nb, str(path))
    return changes


def disagreements(url: str, names=None, readme=True) -> list[str]:
    """What disagrees with ``url``: notebooks without the stamped install cell, stale badge links."""
    import nbformat

    problems = []
    for path in _notebooks(names):
        nb = nbformat.read(str(path), as_version=4)
        installs = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(TITLE)]
        if len(installs) != 1 or installs[0].source != install_cell(url):
            problems.append(f"notebooks/{path.name}: the install cell is not the stamped one for {url}")
        if not any(colab_badge(url, path.name) in c.source for c in nb.cells if c.cell_type == "markdown"):
            problems.append(f"notebooks/{path.name}: no Colab badge linking {colab_badge(url, path.name)}")
        for c in nb.cells:
            if c.cell_type == "markdown":
                for m in _BADGE.finditer(c.source):
                    if m.group(0) != colab_badge(url, m.group("name")):
                        problems.append(f"notebooks/{path.name}: stale Colab link {m.group(0)}")
    if readme:
        for m in _BADGE.finditer(README.read_text()):
            if m.group(0) != colab_badge(url, m.group("name")):
                problems.append(f"README.md: stale Colab link {m.group(0)}")
    return problems


def _notebooks(names=None) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.stem == n or p.stem.startswith(n) for n in names)]
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", metavar="NN", help="notebook numbers or names (default: all, and README.md)")
    parser.add_argument("--check", action="store_true", help="list what disagrees with pyproject.toml; change nothing")
    args = parser.parse_args(argv)
    url = repository_url()
    paths = _notebooks(args.only)
    if args.only and not paths:
        parser.error(f"no notebook matches {' '.join(args.only)}")
    if args.check:
        problems = disagreements(url, args.only, readme=not args.only)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("fix: python scripts/stamp_notebooks.py", file=sys.stderr)
        return 1 if problems else 0
    for path in paths:
        changes = stamp_notebook(path, url)
        print(f"notebooks/{path.name}: {', '.join(changes) if changes else 'already stamped'}")
    if not args.only:
        text = README.read_text()
        new = _stamp_markdown(text, url)
        if new != text:
            README.write_text(new)
        print(f"README.md: {'Colab badges' if new != text else 'already stamped'}")
    print(f"repository: {url}")
    if PLACEHOLDER in url:
        print(f"warning: {url} is the placeholder: set [project.urls] Repository in pyproject.toml to the "
              "repository's public home and run this again", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
