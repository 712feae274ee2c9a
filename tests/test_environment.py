"""The environments the suite runs in: environment.yml matches ``make setup``, and tests never install.

* environment.yml (conda) pins the stack ``make setup`` builds: the Python version the Makefile
  prefers, its TORCH_STACK and JAX_STACK, ``-e .[dev]`` and PJRT_DEVICE. Both are read, so they cannot drift apart.
* ``make test`` / ``make test-newest`` run pytest with the package index unreachable, and nothing under
  tests/ or scripts/ installs packages or makes a virtual environment at test time except the builder
  ``make setup`` runs (tests/testenvs.py); a missing test environment fails with "run make setup".
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import testenvs
import yaml

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = (REPO / "Makefile").read_text()


def make_variable(name: str) -> str:
    """The value of ``NAME := ...`` (or ``=``, ``?=``) in the Makefile."""
    m = re.search(rf"^(?:export[ \t]+)?{name}[ \t]*[:?]?=[ \t]*(.*)$", MAKEFILE, re.M)
    assert m, f"the Makefile sets no {name}"
    return m.group(1).strip()


def recipe(target: str) -> list[str]:
    """The recipe lines of ``target:`` in the Makefile."""
    m = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)*)", MAKEFILE, re.M)
    assert m, f"the Makefile has no {target} target"
    return [line.strip() for line in m.group(1).splitlines()]


# -- environment.yml --------------------------------------------------------------------------------------


def test_environment_yml_pins_the_stack_make_setup_builds():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    deps = env["dependencies"]
    pythons = [d.split("=", 1)[1] for d in deps if isinstance(d, str) and re.match(r"python\s*=", d)]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)

    # The Python the Makefile looks for (PY313: pyenv's 3.13.* or python3.13 on PATH).
    preferred = set(re.findall(r"python(\d+\.\d+)", make_variable("PY313")))
    assert len(preferred) == 1, preferred
    assert pythons == [preferred.pop()], (pythons, make_variable("PY313"))

    assert pip == [*make_variable("TORCH_STACK").split(), *make_variable("JAX_STACK").split(), "-e .[dev]"]
    assert "$(call venv_recipe,$(VENV),$(TORCH_STACK) $(JAX_STACK))" in MAKEFILE  # make setup installs both ...
    assert "pip install -e '.[dev]' $(2)" in MAKEFILE  # ... and the dev extra with it
    assert env["variables"] == {"PJRT_DEVICE": make_variable("PJRT_DEVICE")}


# -- no installs at test time --------------------------------------------------------------------------------

OFFLINE = {"PIP_NO_INDEX": "1", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "UV_OFFLINE": "1"}


def test_make_runs_pytest_with_the_package_index_unreachable():
    offline = dict(item.split("=", 1) for item in make_variable("OFFLINE").split())
    assert offline == OFFLINE
    runs = {t: [line for line in recipe(t) if "-m pytest" in line] for t in ("test", "test-newest", "crash")}
    for target, lines in runs.items():
        assert lines and all(line.startswith("$(OFFLINE) ") for line in lines), (target, lines)
    # make setup and make setup-newest build the test environments (with the index reachable).
    assert recipe("setup") == ["$(BIN)/python tests/testenvs.py build"]
    assert recipe("setup-newest") == ["$(VENV_NEWEST)/bin/python tests/testenvs.py build"]
    assert recipe("test")[0].startswith("$(OFFLINE) $(BIN)/python -m pytest") and "setup" in re.search(r"^test:(.*)$", MAKEFILE, re.M).group(1)
    # make test alone runs every test: its marker expression (TEST_MARKS, which .ci/run sets to share
    # the suites out) is empty unless given, and only then is -m passed.
    assert make_variable("TEST_MARKS") == "" and '$(if $(TEST_MARKS),-m "$(TEST_MARKS)")' in recipe("test")[0]


@pytest.mark.skipif("MAKELEVEL" not in os.environ, reason="checks the environment make test gives pytest (run by make)")
def test_under_make_the_package_index_is_unreachable():
    assert {k: os.environ.get(k) for k in OFFLINE} == OFFLINE


# Calls that install packages or make an environment: [python, "-m", "pip" (or venv, ...)], ["pip", "install"],
# venv.create / venv.EnvBuilder.
_INSTALLS = re.compile(
    r"""["']-m["']\s*,\s*["'](?:pip|venv|ensurepip|virtualenv|uv)["']"""
    r"""|["'](?:pip|pip3|uv)["']\s*,\s*["'](?:install|download|sync|venv|pip)["']"""
    r"""|\bvenv\.(?:create|EnvBuilder)\b""")
# Every file that may: what it is, and why it does not install at test time.
_ALLOWED = {
    "tests/testenvs.py": "the builder of the test environments: make setup runs it, tests only read them",
    "tests/tpu/test_setup.py": "runs pip with --no-index on a package that does not exist, to check the error",
    "tests/tpu/test_torch_tpu_real.py": "compares the install commands setup() builds with pytorch.org's; runs none",
    "tests/tpu/test_stacks.py": "checks that every install command setup() shows is quoted for a shell; runs none",
    "scripts/stamp_notebooks.py": "the notebooks' install cell, which runs on Colab (tests/test_install_cell.py "
                                  "runs it with a stand-in pip, or the real one with PIP_NO_INDEX on a wheel)",
}


def test_no_test_installs_packages_or_makes_an_environment():
    found = {}
    for path in sorted([*(REPO / "tests").rglob("*.py"), *(REPO / "scripts").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel == "tests/test_environment.py":
            continue
        hits = [m.group(0) for m in _INSTALLS.finditer(path.read_text())]
        if hits:
            found[rel] = hits
    assert set(found) == set(_ALLOWED), found
    # Nothing but the Makefile calls the builder.
    callers = [p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("*.py")
               if re.search(r"\bbuild(?:_one)?\(", p.read_text()) and "testenvs" in p.read_text()
               and p.name not in ("testenvs.py", "test_environment.py")]
    assert callers == []
    assert subprocess.run(["git", "check-ignore", "-q", ".venvs/x"], cwd=REPO).returncode == 0  # never committed


def test_a_missing_test_environment_fails_with_make_setup_and_installs_nothing(tmp_path, monkeypatch):
    def no_subprocess(*args, **kwargs):
        raise AssertionError(f"a test environment getter ran a process: {args}")

    monkeypatch.setenv("NBKIT_TEST_ENVS", str(tmp_path / "envs"))
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(subprocess, "Popen", no_subprocess)
    for get in (testenvs.widgets7_dir, testenvs.ipykernel6_dir, testenvs.classic_python):
        with pytest.raises(testenvs.Missing, match=r"is not built\. Run `make setup`"):
            get()
        # What the fixtures and tests call: the test fails with that message, no traceback.
        with pytest.raises(pytest.fail.Exception, match=r"Run `make setup`") as failed:
            testenvs.required(get)
        assert failed.value.pytrace is False
    assert not (tmp_path / "envs").exists()
    # One built from other requirements (a pin changed since make setup) is not used either.
    old = tmp_path / "envs" / "ipywidgets7"
    old.mkdir(parents=True)
    (old / ".complete").write_text('{"requirements": "ipywidgets==7.6.0\\n"}')
    with pytest.raises(testenvs.Missing, match=r"was built from other requirements\. Run `make setup`"):
        testenvs.widgets7_dir()
