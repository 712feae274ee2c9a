"""The extra Python environments some tests run in: ``make setup`` builds them, the tests only use them.

* ``.venvs/ipywidgets7``: ipywidgets 7.7.1 and its companions (Colab's TPU runtime;
  ``tests/widgets7/requirements.txt``), ``pip install --no-deps --target``. tests/widgets/test_view.py
  reruns tests/widgets/ with it first on ``PYTHONPATH``.
* ``.venvs/ipykernel6``: ipykernel 6.17.1 (Colab's; ``tests/ipykernel6/requirements.txt``), the same
  way: that rerun also starts a kernel with it first on the path (tests/widgets/test_poll.py).
* ``.venvs/classic-py3.13`` (the running Python's version): a virtual environment made from the base
  interpreter, so with none of the stack's packages, holding the classic Notebook 6 and ipywidgets 7.7.1
  (``tests/widgets7/classic.txt``) for the browser tests' classic front end (tests/frontends.py). Its
  ``.pth`` file adds the site-packages named by ``NBKIT_MAIN_SITE`` after its own, and the tests set that
  to the stack under test, so its kernel imports torch, torchvision and nbkit from there.

None of them holds torch or anything built against it, so both stacks (``.venv``, ``.venv-newest``) share
them: the first two are pure-Python packages, the third is keyed by the Python version. Each is complete
when its ``.complete`` marker records the requirements it was built from; a changed requirements file
makes ``make setup`` build it again. Built once, in about a minute, then reused.

Tests never install: when an environment is missing or out of date, :func:`widgets7_dir`,
:func:`ipykernel6_dir` and :func:`classic_python` raise :class:`Missing`, whose message says to run
``make setup``. ``make test`` runs pytest with the package index unreachable (``PIP_NO_INDEX=1``).

Run: ``python tests/testenvs.py build`` (what ``make setup`` and ``make setup-newest`` run, with the
stack's python) or ``python tests/testenvs.py check``. ``NBKIT_TEST_ENVS`` moves the folder.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WIDGETS7_REQUIREMENTS = HERE / "widgets7" / "requirements.txt"
CLASSIC_REQUIREMENTS = HERE / "widgets7" / "classic.txt"
IPYKERNEL6_REQUIREMENTS = HERE / "ipykernel6" / "requirements.txt"
# The classic environment's kernel and server add this site-packages directory after their own.
MAIN_SITE_VARIABLE = "NBKIT_MAIN_SITE"
PTH = f"import os, site; p = os.environ.get({MAIN_SITE_VARIABLE!r}); p and site.addsitedir(p)\n"


class Missing(RuntimeError):
    """An environment the tests need is not built (or was built from other requirements): run make setup."""


def envs_dir() -> Path:
    return Path(os.environ.get("NBKIT_TEST_ENVS") or REPO / ".venvs")


def _python_version() -> str:
    return "%d.%d" % sys.version_info[:2]


# name -> (requirement files, "target" or "venv", what it is, for messages)
def _envs() -> dict:
    return {
        "ipywidgets7": ((WIDGETS7_REQUIREMENTS,), "target", "ipywidgets 7.7.1 (tests/widgets7/requirements.txt)"),
        "ipykernel6": ((IPYKERNEL6_REQUIREMENTS,), "target", "ipykernel 6 (tests/ipykernel6/requirements.txt)"),
        f"classic-py{_python_version()}": ((CLASSIC_REQUIREMENTS, WIDGETS7_REQUIREMENTS), "venv",
                                          "the classic Notebook 6 with ipywidgets 7.7.1 (tests/widgets7/classic.txt)"),
    }


def _record(files) -> dict:
    return {"requirements": "".join(Path(f).read_text() for f in files)}


def _ready(path: Path, files, kind: str) -> bool:
    marker = path / ".complete"
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if kind == "venv" and not (path / "bin" / "python").exists():  # e.g. its base interpreter is gone
        return False
    return recorded.get("requirements") == _record(files)["requirements"]


def _get(name: str) -> Path:
    files, kind, what = _envs()[name]
    path = envs_dir() / name
    if not _ready(path, files, kind):
        state = "was built from other requirements" if (path / ".complete").exists() else "is not built"
        raise Missing(
            f"{what}: {path} {state}. Run `make setup` (or `make setup-newest` for .venv-newest): it builds "
            f"the test environments once (python tests/testenvs.py build); the tests never install packages.")
    return path


def widgets7_dir() -> Path:
    """The directory with ipywidgets 7.7.1 and its companions, to put first on PYTHONPATH."""
    return _get("ipywidgets7")


def ipykernel6_dir() -> Path:
    """The directory with ipykernel 6, to put first on a kernel's PYTHONPATH."""
    return _get("ipykernel6")


def classic_python() -> Path:
    """The python of the classic Notebook 6 environment; run it with ``NBKIT_MAIN_SITE`` set."""
    return _get(f"classic-py{_python_version()}") / "bin" / "python"


def required(get):
    """``get()`` in a test or fixture: when the environment is missing, fail with :class:`Missing`'s message."""
    import pytest

    try:
        return get()
    except Missing as e:
        message = str(e)
    pytest.fail(message, pytrace=False)  # outside the except: no "during handling" traceback


# -- building (make setup) ---------------------------------------------------------------------------


def _base_python() -> str:
    """This interpreter's base (not a venv's): a new environment must not inherit a stack's packages."""
    base = Path(sys.base_prefix) / "bin" / f"python{_python_version()}"
    return str(base if base.exists() else sys.executable)


def _pip(python, *args):
    subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args], check=True)


def build_one(name: str) -> bool:
    """Build the environment ``name`` unless it is ready; return whether it was built."""
    files, kind, _ = _envs()[name]
    path = envs_dir() / name
    if _ready(path, files, kind):
        return False
    shutil.rmtree(path, ignore_errors=True)
    if kind == "target":
        # --no-deps: only these packages go first on the path; IPython, traitlets and the rest stay the
        # stack's own, as on Colab where ipywidgets 7 sits next to the runtime's kernel.
        path.mkdir(parents=True)
        _pip(sys.executable, "--no-deps", "--target", path, "-r", files[0])
    else:
        subprocess.run([_base_python(), "-m", "venv", str(path)], check=True)
        python = path / "bin" / "python"
        _pip(python, "-r", files[0])
        own_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  check=True, capture_output=True, text=True).stdout.strip()
        # addsitedir appends, and runs that directory's .pth files (the stack's editable nbkit, ...).
        (Path(own_site) / "zz_nbkit_main_env.pth").write_text(PTH)
    (path / ".complete").write_text(json.dumps(_record(files)))
    return True


def build() -> None:
    """Build every missing or outdated environment (one process at a time: ``make -j`` is safe)."""
    import fcntl

    envs_dir().mkdir(parents=True, exist_ok=True)
    with open(envs_dir() / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in _envs():
            start = time.monotonic()
            built = build_one(name)
            shown = os.path.relpath(envs_dir() / name)
            print(f"testenvs: {shown}: " + (f"built in {time.monotonic() - start:.0f} s" if built else "up to date"),
                  flush=True)


def main(argv) -> int:
    if argv == ["build"]:
        build()
        return 0
    if argv == ["check"]:
        problems = []
        for get in (widgets7_dir, ipykernel6_dir, classic_python):
            try:
                print(get())
            except Missing as e:
                problems.append(str(e))
        if problems:
            print("\n".join(problems), file=sys.stderr)
        return 1 if problems else 0
    print("usage: python tests/testenvs.py build|check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
