#!/usr/bin/env python
"""Write the repository's home, from ``[tool.nbkit] repository`` in pyproject.toml, into every
notebook's "Install nbkit" cell and Colab badge.

The URL lives in one place: change it in pyproject.toml, then run this (``make notebooks`` does).
While it is empty (the repository is not published yet) the install cell says so plainly and installs
an uploaded wheel, and no notebook carries an "Open in Colab" badge (it would lead nowhere); once it
is set, each notebook gets its badge under its title. ``tests/test_install_cell.py`` fails while a
notebook disagrees with pyproject.toml.

Usage::

    python scripts/stamp_notebooks.py            # stamp notebooks/*.ipynb in place
    python scripts/stamp_notebooks.py 01 03      # only these notebooks
    python scripts/stamp_notebooks.py --check    # exit 1 and list what disagrees; change nothing

The install cell (the code cell whose first line is ``#@title Install nbkit``) is replaced as a whole
by :data:`INSTALL_CELL`; its cell id, tags and position are kept. Only Colab badges are rewritten in
markdown: ``https://colab.research.google.com/github/<owner>/<repo>/blob/<branch>/notebooks/<name>.ipynb``.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
BRANCH = "main"
TITLE = "#@title Install nbkit"
DISTRIBUTION = "nbkit-cache"  # nbkit.extras.DISTRIBUTION; the index's "nbkit" is an unrelated project

# The cell every notebook starts with. It runs on Colab only, and only when nbkit-cache is not
# installed; its logic is tested by tests/test_install_cell.py, which executes this very text.
INSTALL_CELL = '''\
#@title Install nbkit (on Colab only) { display-mode: "form" }
# Colab starts every runtime from a clean machine, so nbkit is installed there; anywhere else (your
# laptop, CI) the nbkit already installed is used and this cell does nothing. nbkit's distribution is
# nbkit-cache and it is not on the package index (the index's "nbkit" is an unrelated project). Where
# from, the first that applies: the nbkit_source field (a wheel's path or URL, a git+https:// URL);
# an nbkit_cache-*.whl uploaded next to this notebook (/content on Colab; `make dist` builds one);
# else the repository below, once it is published.
nbkit_source = ""  #@param {type:"string"}
NBKIT_REPOSITORY = "{repository}"  # written by scripts/stamp_notebooks.py from pyproject.toml; empty: not published yet

import glob
import importlib
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

_FIXES = ("Fix it either way, then run this cell again:\\n"
          "  1. where you have nbkit's source, run `make dist`, and upload dist/nbkit_cache-*.whl to "
          f"{os.getcwd()} (Colab: the folder icon on the left, then Upload);\\n"
          "  2. or set nbkit_source in this cell's form to a wheel's path or URL, or to the repository as "
          "git+https://github.com/<owner>/<repo>.")


def _installed(name):
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _nbkit_candidates():
    """(pip requirement, where it comes from) for the first source that applies; what was skipped."""
    extras = "nbkit-cache[notebook,gcs]"
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
        raise ValueError(f"nbkit_source = {source!r} is not a wheel or a URL. nbkit is not on the package index "
                         "(its 'nbkit' is an unrelated project): give a wheel's path or URL, or "
                         "git+https://github.com/<owner>/<repo>.")
    checked.append("the nbkit_source field: empty")
    wheels = sorted(glob.glob(os.path.join(os.getcwd(), "nbkit_cache-*.whl")), key=os.path.getmtime)
    if wheels:
        return f"{extras} @ file://{wheels[-1]}", f"the uploaded wheel {wheels[-1]}", checked
    checked.append(f"nbkit_cache-*.whl in {os.getcwd()}: none")
    if not NBKIT_REPOSITORY:
        raise RuntimeError("Cannot install nbkit: this notebook names no repository (nbkit is not published yet), "
                           "and it is not on the package index (the index's 'nbkit' is an unrelated project).\\n"
                           + "".join(f"  Checked: {c}\\n" for c in checked) + _FIXES)
    return f"{extras} @ git+{NBKIT_REPOSITORY}", f"the repository {NBKIT_REPOSITORY}", checked

if "google.colab" in sys.modules and not (_installed("nbkit-cache") and importlib.util.find_spec("nbkit")):
    requirement, origin, checked = _nbkit_candidates()
    if _installed("nbkit"):  # the package index's unrelated "nbkit" owns the same import name
        print("Removing the package index's unrelated 'nbkit' package first ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", "-q", "nbkit"], capture_output=True)
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
            + "".join(f"  Checked first: {c}\\n" for c in checked) + _FIXES)
    print(f"nbkit installed from {origin}")
'''

BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"
# A badge on a line of its own, and the blank line after it.
_BADGE_LINE = re.compile(r"^\[!\[Open In Colab\]\([^)\s]*\)\]\([^)\s]*\)[ \t]*(\n\n?|$)", re.M)


def repository_url(pyproject=REPO / "pyproject.toml") -> str:
    """``[tool.nbkit] repository`` of pyproject.toml without a trailing slash or ``.git``; ``""`` while unset."""
    text = Path(pyproject).read_text()
    try:
        import tomllib
    except ImportError:  # Python 3.10: a line match is enough for this one key
        match = re.search(r'^repository\s*=\s*"([^"]*)"', text, re.M)
        url = match.group(1) if match else None
    else:
        url = tomllib.loads(text).get("tool", {}).get("nbkit", {}).get("repository")
    if url is None:
        raise SystemExit(f"{pyproject}: no [tool.nbkit] repository = \"https://github.com/<owner>/<repo>\" "
                         "(or \"\" while the repository is not published)")
    url = url.strip().rstrip("/").removesuffix(".git")
    if url and not re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url):
        raise SystemExit(f"{pyproject}: repository = {url!r}: expected https://github.com/<owner>/<repo> "
                         "(Colab opens notebooks from GitHub), or \"\" while it is not published")
    return url


def install_cell(url: str) -> str:
    """The install cell's source for the repository ``url``."""
    return INSTALL_CELL.replace("{repository}", url)


def colab_badge(url: str, notebook: str) -> str:
    """The "Open in Colab" link of ``notebooks/<notebook>`` (a file name) in the repository ``url``."""
    return f"https://colab.research.google.com/github/{url.removeprefix('https://github.com/')}/blob/{BRANCH}/notebooks/{notebook}"


def stamped_markdown(source: str, url: str, notebook: str, first: bool) -> str:
    """A markdown cell as stamped: no badge anywhere, except (when ``url`` is set) one under the title of
    the notebook's first markdown cell."""
    text = _BADGE_LINE.sub("", source)
    if url and first:
        title, _, rest = text.partition("\n")
        badge = f"[![Open In Colab]({BADGE_IMAGE})]({colab_badge(url, notebook)})"
        text = f"{title}\n\n{badge}\n\n{rest.lstrip(chr(10))}".rstrip("\n") if rest.strip() else f"{title}\n\n{badge}"
    return text


def _stamped(nb, url: str, name: str):
    """(the install cell's index, [(markdown cell index, stamped source)]) of notebook ``nb``."""
    installs = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.startswith(TITLE)]
    markdown = [i for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    return installs, [(i, stamped_markdown(nb.cells[i].source, url, name, i == markdown[0])) for i in markdown]


def stamp_notebook(path, url: str) -> list[str]:
    """Stamp one notebook in place (only if something changes); return what changed."""
    import nbformat

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    installs, markdown = _stamped(nb, url, path.name)
    if len(installs) != 1:
        raise SystemExit(f"{path}: expected one code cell starting with {TITLE!r}, found {len(installs)}")
    changes = []
    if nb.cells[installs[0]].source != install_cell(url):
        nb.cells[installs[0]].source = install_cell(url)
        changes.append("install cell")
    for i, source in markdown:
        if nb.cells[i].source != source:
            nb.cells[i].source = source
            changes.append(f"badge in cell {i}")
    if changes:
        nbformat.write(nb, str(path))
    return changes


def disagreements(url: str, names=None) -> list[str]:
    """What disagrees with ``url``: notebooks without the stamped install cell or badge."""
    import nbformat

    problems = []
    home = url or "no repository (not published yet)"
    for path in _notebooks(names):
        nb = nbformat.read(str(path), as_version=4)
        installs, markdown = _stamped(nb, url, path.name)
        if len(installs) != 1 or nb.cells[installs[0]].source != install_cell(url):
            problems.append(f"notebooks/{path.name}: the install cell is not the stamped one for {home}")
        for i, source in markdown:
            if nb.cells[i].source != source:
                problems.append(f"notebooks/{path.name}: cell {i}'s Colab badge is not the one for {home}")
    return problems


def _notebooks(names=None) -> list[Path]:
    paths = sorted(NOTEBOOKS.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.stem == n or p.stem.startswith(n) for n in names)]
    return paths


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", metavar="NN", help="notebook numbers or names (default: all)")
    parser.add_argument("--check", action="store_true", help="list what disagrees with pyproject.toml; change nothing")
    args = parser.parse_args(argv)
    url = repository_url()
    paths = _notebooks(args.only)
    if args.only and not paths:
        parser.error(f"no notebook matches {' '.join(args.only)}")
    if args.check:
        problems = disagreements(url, args.only)
        for p in problems:
            print(p, file=sys.stderr)
        if problems:
            print("fix: python scripts/stamp_notebooks.py", file=sys.stderr)
        return 1 if problems else 0
    for path in paths:
        changes = stamp_notebook(path, url)
        print(f"notebooks/{path.name}: {', '.join(changes) if changes else 'already stamped'}")
    if url:
        print(f"repository: {url}")
    else:
        print("repository: not set ([tool.nbkit] repository in pyproject.toml is empty): the install cells say so "
              "and install an uploaded wheel; no Colab badges")
    return 0


if __name__ == "__main__":
    sys.exit(main())
