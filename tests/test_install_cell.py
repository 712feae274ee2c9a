"""The notebooks' "Install nbkit" cell: stamped from pyproject.toml, and its logic run for real.

The cell's text is taken from the notebooks (and from ``scripts/stamp_notebooks.py``, which writes
it) and executed in a fresh ``python -S`` process, as Colab would: a ``google.colab`` package on the
path makes it a Colab runtime, and ``-S`` hides this venv's nbkit, so the cell must install one.
``python -m pip`` inside the cell finds a recording stand-in for pip first on ``PYTHONPATH`` (it
logs its arguments and, when told to succeed, leaves an importable ``nbkit`` behind); one test
uses the real pip on a wheel instead. Nothing touches the network.
"""

import base64
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("stamp_notebooks", REPO / "scripts" / "stamp_notebooks.py")
stamp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stamp)

URL = stamp.repository_url()  # pyproject.toml's [tool.nbkit] repository; "" until published
HOME = "https://github.com/someone/nbkit"  # a published repository, for the tests of that case
NOTEBOOKS = sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))

FAKE_PIP = '''\
import json, os, sys
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "git_prompt": os.environ.get("GIT_TERMINAL_PROMPT")}) + "\\n")
if os.environ.get("FAKE_PIP_FAIL"):
    print("ERROR: Could not find a version that satisfies the requirement (fake pip)", file=sys.stderr)
    sys.exit(1)
site = os.environ.get("FAKE_PIP_SITE")
if site and sys.argv[1] == "uninstall":
    import shutil
    shutil.rmtree(os.path.join(site, "nbkit-0.0.10.dist-info"), ignore_errors=True)
elif site:
    for d in ("nbkit", "nbkit_cache-0.1.0.dist-info"):
        os.makedirs(os.path.join(site, d), exist_ok=True)
    open(os.path.join(site, "nbkit", "__init__.py"), "w").close()
    with open(os.path.join(site, "nbkit_cache-0.1.0.dist-info", "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\\nName: nbkit-cache\\nVersion: 0.1.0\\n")
'''

HARNESS = '''\
import sys
if sys.argv[1] == "colab":
    import google.colab  # Colab imports it at start-up; the cell looks for it in sys.modules
source = open(sys.argv[2]).read()
exec(compile(source, "install-cell", "exec"), {"__name__": "__main__"})
'''


def cell_of(notebook: str) -> str:
    nb = nbformat.read(str(REPO / "notebooks" / notebook), as_version=4)
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(stamp.TITLE)]
    return cell.source


class Runtime:
    """A scratch Colab-like runtime: a working folder (/content), a site folder, the fakes."""

    def __init__(self, tmp_path):
        self.content = tmp_path / "content"
        self.site = tmp_path / "site"
        self.colab = tmp_path / "colab"  # the google.colab package
        self.pip = tmp_path / "fakepip"  # the recording pip
        self.log = tmp_path / "pip.log"
        for d in (self.content, self.site, self.colab / "google" / "colab", self.pip / "pip"):
            d.mkdir(parents=True)
        (self.pip / "pip" / "__init__.py").write_text("")
        (self.pip / "pip" / "__main__.py").write_text(FAKE_PIP)
        (self.colab / "google" / "__init__.py").write_text("")
        (self.colab / "google" / "colab" / "__init__.py").write_text("")
        (tmp_path / "harness.py").write_text(HARNESS)
        self.tmp = tmp_path

    def run(self, source, *, colab=True, pip_fails=False, pip_installs=True, real_pip_target=None):
        """Execute ``source`` as the first cell of a fresh (Colab) runtime; the process's result."""
        cell = self.tmp / "cell.py"
        cell.write_text(source)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
        if real_pip_target:  # this venv's pip, kept off the venv: it installs into real_pip_target only
            path = [self.colab, real_pip_target, self.site]
            env.update(PIP_TARGET=str(real_pip_target), PIP_NO_INDEX="1", PIP_NO_DEPS="1",
                       PIP_DISABLE_PIP_VERSION_CHECK="1")
        else:
            path = [self.colab, self.pip, self.site]
        env.update(PYTHONPATH=os.pathsep.join(map(str, path)), FAKE_PIP_LOG=str(self.log))
        if pip_fails:
            env["FAKE_PIP_FAIL"] = "1"
        if pip_installs:
            env["FAKE_PIP_SITE"] = str(self.site)
        # -S: no site-packages, so this venv's nbkit is not importable, as on a fresh runtime.
        return subprocess.run([sys.executable, "-S", str(self.tmp / "harness.py"), "colab" if colab else "local",
                               str(cell)], cwd=self.content, env=env, capture_output=True, text=True, timeout=300)

    @property
    def pip_calls(self):
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def rt(tmp_path):
    return Runtime(tmp_path)


def requirement(rt):
    (call,) = rt.pip_calls
    assert call["argv"][:2] == ["install", "-q"]
    return call["argv"][2]


def with_field(source: str, value: str) -> str:
    """The cell as Colab's form leaves it after the user typed ``value`` into nbkit_source."""
    new = source.replace('nbkit_source = ""  #@param', f"nbkit_source = {value!r}  #@param")
    assert new != source
    return new


# -- stamped from pyproject.toml ----------------------------------------------------------------


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_notebook_agrees_with_pyproject(notebook):
    """Fails until `python scripts/stamp_notebooks.py` has been run after changing pyproject.toml."""
    assert cell_of(notebook) == stamp.install_cell(URL), "run: python scripts/stamp_notebooks.py"
    nb = nbformat.read(str(REPO / "notebooks" / notebook), as_version=4)
    badges = [c for c in nb.cells if c.cell_type == "markdown" and "colab-badge.svg" in c.source]
    if URL:
        assert stamp.colab_badge(URL, notebook) in nb.cells[0].source, "run: python scripts/stamp_notebooks.py"
    else:  # a badge to an unpublished repository leads nowhere
        assert badges == [], "run: python scripts/stamp_notebooks.py"


def test_everything_agrees_with_pyproject():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "stamp_notebooks.py"), "--check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _scratch_notebook(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# T\n\n[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                                      "(https://colab.research.google.com/github/old/place/blob/dev/notebooks/99_t.ipynb)"
                                      "\n\nText."),
        nbformat.v4.new_code_cell("#@title Install nbkit (on Colab only)\nprint('old')"),
        nbformat.v4.new_code_cell("x = 1"),
    ]
    (tmp_path / "notebooks").mkdir()
    path = tmp_path / "notebooks" / "99_t.ipynb"
    nbformat.write(nb, str(path))
    monkeypatch.setattr(stamp, "NOTEBOOKS", tmp_path / "notebooks")
    return path, [c.id for c in nb.cells]


def test_stamp_rewrites_cell_and_badges_and_check_notices(tmp_path, monkeypatch):
    path, ids = _scratch_notebook(tmp_path, monkeypatch)
    assert stamp.disagreements(HOME) == [
        f"notebooks/99_t.ipynb: the install cell is not the stamped one for {HOME}",
        f"notebooks/99_t.ipynb: cell 0's Colab badge is not the one for {HOME}",
    ]
    assert stamp.stamp_notebook(path, HOME) == ["install cell", "badge in cell 0"]
    assert stamp.stamp_notebook(path, HOME) == []  # idempotent
    assert stamp.disagreements(HOME) == []
    after = nbformat.read(str(path), as_version=4)
    assert [c.id for c in after.cells] == ids and after.cells[2].source == "x = 1"
    assert after.cells[0].source == ("# T\n\n[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
                                     f"({stamp.colab_badge(HOME, '99_t.ipynb')})\n\nText.")
    assert f'NBKIT_REPOSITORY = "{HOME}"' in after.cells[1].source


def test_an_unset_repository_removes_the_badges(tmp_path, monkeypatch):
    path, _ = _scratch_notebook(tmp_path, monkeypatch)
    assert stamp.stamp_notebook(path, "") == ["install cell", "badge in cell 0"]
    after = nbformat.read(str(path), as_version=4)
    assert after.cells[0].source == "# T\n\nText."
    assert 'NBKIT_REPOSITORY = ""' in after.cells[1].source
    assert stamp.disagreements("") == [] and stamp.stamp_notebook(path, "") == []
    assert stamp.stamp_notebook(path, HOME) == ["install cell", "badge in cell 0"]  # and back, once published
    assert stamp.colab_badge(HOME, "99_t.ipynb") in nbformat.read(str(path), as_version=4).cells[0].source


def test_repository_url_must_be_a_github_repository_or_empty(tmp_path):
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\nname = "nbkit-cache"\n[tool.nbkit]\nrepository = "https://example.com/nbkit"\n')
    with pytest.raises(SystemExit, match="expected https://github.com/<owner>/<repo>"):
        stamp.repository_url(bad)
    bad.write_text('[project]\nname = "nbkit-cache"\n')
    with pytest.raises(SystemExit, match=r"no \[tool.nbkit\] repository"):
        stamp.repository_url(bad)
    bad.write_text('[tool.nbkit]\nrepository = "https://github.com/me/nbkit.git/"\n')
    assert stamp.repository_url(bad) == "https://github.com/me/nbkit"
    bad.write_text('[tool.nbkit]\nrepository = ""\n')
    assert stamp.repository_url(bad) == ""


def test_the_distribution_name_is_ours():
    """The package index's "nbkit" is an unrelated project: the distribution is nbkit-cache everywhere."""
    from nbkit.extras import DISTRIBUTION

    try:
        import tomllib
    except ImportError:
        pytest.skip("tomllib needs Python 3.11")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == stamp.DISTRIBUTION == "nbkit-cache"
    assert f'extras = "{DISTRIBUTION}[notebook,gcs]"' in stamp.INSTALL_CELL


def test_no_document_or_message_sends_anyone_to_the_index_for_nbkit():
    """`pip install nbkit` (or nbkit[extra], or nbkit-cache, which is not published) from the index
    would install a stranger's project, or nothing: no text we ship says it."""
    texts = [REPO / "README.md", REPO / "Makefile", REPO / "environment.yml", *REPO.glob("docs/*.md"),
             *REPO.glob("notebooks/*.ipynb"), *REPO.glob("nbkit/**/*.py"), *REPO.glob("scripts/*.py"),
             *REPO.glob("benchmarks/*.py"), *REPO.glob("*.md")]
    index_install = re.compile(r"pip install (-[-\w]+ )*['\"]?nbkit(-cache)?(\[[\w,]*\])?(['\"]|\s|$|==|>=|~=)", re.M)
    bad = [f"{p.relative_to(REPO)}: {m.group(0)!r}" for p in texts if p.exists()
           for m in index_install.finditer(p.read_text())]
    assert bad == []
    assert "CHANGE-ME" not in "".join(p.read_text() for p in texts if p.exists())


# -- the cell's logic, executed ------------------------------------------------------------------------

CELL = stamp.install_cell(HOME)  # the cell once the repository is published
UNPUBLISHED = stamp.install_cell("")


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_each_notebooks_cell_installs_an_uploaded_wheel(rt, notebook):
    wheel = rt.content / "nbkit_cache-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    done = rt.run(cell_of(notebook))
    assert done.returncode == 0, done.stderr
    assert requirement(rt) == f"nbkit-cache[notebook,gcs] @ file://{wheel}"
    assert "nbkit installed from the uploaded wheel" in done.stdout


def test_installs_from_the_repository_once_published(rt):
    done = rt.run(CELL)
    assert done.returncode == 0, done.stderr
    assert requirement(rt) == f"nbkit-cache[notebook,gcs] @ git+{HOME}"
    assert f"Installing nbkit from the repository {HOME} ..." in done.stdout
    assert "nbkit installed from the repository" in done.stdout


def test_an_unpublished_repository_is_said_plainly_and_never_sent_to_pip(rt):
    done = rt.run(UNPUBLISHED)
    assert done.returncode != 0 and rt.pip_calls == []
    err = done.stderr
    assert "Cannot install nbkit: this notebook names no repository (nbkit is not published yet)" in err
    assert "the index's 'nbkit' is an unrelated project" in err
    assert f"Checked: nbkit_cache-*.whl in {rt.content}: none" in err
    assert f"run `make dist`, and upload dist/nbkit_cache-*.whl to {rt.content}" in err


def test_a_bare_name_in_the_field_is_refused_not_sent_to_the_index(rt):
    done = rt.run(with_field(CELL, "nbkit==0.1.0"))
    assert done.returncode != 0 and rt.pip_calls == []
    assert "is not a wheel or a URL. nbkit is not on the package index" in done.stderr


def test_the_index_s_unrelated_nbkit_is_removed_first(rt):
    (rt.site / "nbkit").mkdir()  # what `pip install nbkit` from the index leaves
    (rt.site / "nbkit" / "__init__.py").write_text("")
    (rt.site / "nbkit-0.0.10.dist-info").mkdir()
    (rt.site / "nbkit-0.0.10.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: nbkit\nVersion: 0.0.10\n")
    done = rt.run(CELL)
    assert done.returncode == 0, done.stderr
    assert [c["argv"][:4] for c in rt.pip_calls] == [["uninstall", "-y", "-q", "nbkit"],
                                                    ["install", "-q", f"nbkit-cache[notebook,gcs] @ git+{HOME}"]]
    assert "Removing the package index's unrelated 'nbkit' package first" in done.stdout


def test_outside_colab_it_does_nothing(rt):
    done = rt.run(CELL, colab=False)
    assert done.returncode == 0 and done.stdout == "" and rt.pip_calls == []


def test_nbkit_already_installed_means_no_pip(rt):
    (rt.site / "nbkit").mkdir()
    (rt.site / "nbkit" / "__init__.py").write_text("")
    (rt.site / "nbkit_cache-0.1.0.dist-info").mkdir()
    (rt.site / "nbkit_cache-0.1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: nbkit-cache\nVersion: 0.1.0\n")
    (rt.content / "nbkit_cache-0.1.0-py3-none-any.whl").write_bytes(b"")
    done = rt.run(with_field(CELL, "https://example.org/x.whl"))
    assert done.returncode == 0 and done.stdout == "" and rt.pip_calls == []


def test_an_uploaded_wheel_is_installed_the_newest_first(rt):
    old = rt.content / "nbkit_cache-0.1.0-py3-none-any.whl"
    new = rt.content / "nbkit_cache-0.2.0-py3-none-any.whl"
    old.write_bytes(b"")
    new.write_bytes(b"")
    os.utime(old, (1_000_000, 1_000_000))
    done = rt.run(CELL)
    assert done.returncode == 0, done.stderr
    assert requirement(rt) == f"nbkit-cache[notebook,gcs] @ file://{new}"
    assert f"Installing nbkit from the uploaded wheel {new}" in done.stdout


@pytest.mark.parametrize("field, expected", [
    ("git+https://github.com/me/nbkit@fix", "nbkit-cache[notebook,gcs] @ git+https://github.com/me/nbkit@fix"),
    ("https://example.org/nbkit_cache-0.1.0-py3-none-any.whl",
     "nbkit-cache[notebook,gcs] @ https://example.org/nbkit_cache-0.1.0-py3-none-any.whl"),
    ("wheels/nbkit_cache-0.3.0-py3-none-any.whl", "nbkit-cache[notebook,gcs] @ file://{content}/wheels/nbkit_cache-0.3.0-py3-none-any.whl"),
])
def test_the_field_wins_over_an_uploaded_wheel(rt, field, expected):
    (rt.content / "nbkit_cache-0.1.0-py3-none-any.whl").write_bytes(b"")
    (rt.content / "wheels").mkdir()
    (rt.content / "wheels" / "nbkit_cache-0.3.0-py3-none-any.whl").write_bytes(b"")
    done = rt.run(with_field(CELL, field))
    assert done.returncode == 0, done.stderr
    assert requirement(rt) == expected.format(content=rt.content)
    assert f"Installing nbkit from nbkit_source = {field!r}" in done.stdout


def test_a_missing_wheel_in_the_field_says_so_before_pip(rt):
    done = rt.run(with_field(CELL, "nbkit_cache-0.1.0-py3-none-any.whl"))
    assert done.returncode != 0 and rt.pip_calls == []
    assert "FileNotFoundError: nbkit_source = 'nbkit_cache-0.1.0-py3-none-any.whl': no such wheel file" in done.stderr


def test_pip_failing_gives_the_two_fixes(rt):
    done = rt.run(CELL, pip_fails=True)
    assert done.returncode != 0
    assert rt.pip_calls[0]["git_prompt"] == "0"  # a missing repository fails instead of asking for a password
    err = done.stderr
    assert f"RuntimeError: Could not install nbkit from the repository {HOME}." in err
    assert f"Tried: pip install -q 'nbkit-cache[notebook,gcs] @ git+{HOME}': pip exited with 1:" in err
    assert "Could not find a version that satisfies the requirement (fake pip)" in err  # pip's own words
    assert "Checked first: the nbkit_source field: empty" in err
    assert f"Checked first: nbkit_cache-*.whl in {rt.content}: none" in err
    assert f"run `make dist`, and upload dist/nbkit_cache-*.whl to {rt.content}" in err
    assert "set nbkit_source in this cell's form" in err


def test_pip_succeeding_without_nbkit_is_an_error_too(rt):
    done = rt.run(CELL, pip_installs=False)
    assert done.returncode != 0
    assert "pip succeeded but nbkit is still not importable" in done.stderr


def _wheel(path: Path) -> Path:
    """A minimal, valid nbkit wheel (what `make dist` builds, minus the code)."""
    files = {
        "nbkit/__init__.py": b"__version__ = '0.1.0'\n",
        "nbkit_cache-0.1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: nbkit-cache\nVersion: 0.1.0\n"
                                          b"Provides-Extra: gcs\nProvides-Extra: notebook\n",
        "nbkit_cache-0.1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        record.append("nbkit_cache-0.1.0.dist-info/RECORD,,")
        z.writestr("nbkit_cache-0.1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


def test_the_real_pip_installs_an_uploaded_wheel(rt, tmp_path):
    _wheel(rt.content / "nbkit_cache-0.1.0-py3-none-any.whl")
    target = tmp_path / "target"
    done = rt.run(CELL, real_pip_target=target)
    assert done.returncode == 0, done.stderr
    assert "nbkit installed from the uploaded wheel" in done.stdout
    assert (target / "nbkit" / "__init__.py").read_text() == "__version__ = '0.1.0'\n"


def test_make_dist_builds_the_wheel_the_cell_looks_for():
    makefile = (REPO / "Makefile").read_text()
    recipe = re.search(r"^dist:\n((?:\t.*\n)+)", makefile, re.M)
    assert recipe and "pip wheel --no-deps -w dist ." in recipe.group(1)
    assert "nbkit_cache-*.whl" in CELL and "make dist" in CELL
