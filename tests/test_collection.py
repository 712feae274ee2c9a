"""The README's test command collects every test the repository holds.

pytest's default ``norecursedirs`` skips every folder named ``build``, ``dist``, ``venv``, ``*.egg``
and dot folders, and ``collect_ignore`` lists skip more: a test file or doctest nobody collects
guards nothing (issue 37: 140 tests of ``tests/build/`` and ``nbkit/build/`` never ran in CI).
This test lists what the repository holds from the files themselves and compares it with what
pytest collected: in the full run (``make test``) the run's own collection, otherwise a
``--collect-only`` run of the same command.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from collection_record import COLLECTED, SKIPPED_FILES

ROOT = Path(__file__).resolve().parent.parent
# Folders of scripts that the tests run in subprocesses (tests/conftest.py's collect_ignore): they
# hold no test files, and this test checks that they never do.
NOT_TESTS = ("tests/tpu_scripts", "tests/notebooks", "tests/widgets7", "tests/ipykernel6")
DOCTEST = re.compile(r"^\s*>>> ", re.M)


def expected_files() -> set[str]:
    """Every ``tests/**/test_*.py`` and every ``nbkit/**/*.py`` with a doctest, as absolute paths."""
    tests = {p for p in (ROOT / "tests").rglob("test_*.py") if "__pycache__" not in p.parts}
    doctests = {p for p in (ROOT / "nbkit").rglob("*.py") if DOCTEST.search(p.read_text(encoding="utf-8"))}
    return {str(p) for p in tests | doctests}


def collected_by_a_fresh_run() -> set[str]:
    """The files of ``python -m pytest --collect-only`` from the repository root (the README's command)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTEST_ADDOPTS": ""})
    files = set()
    for line in out.stdout.splitlines():
        if "::" in line and not line.startswith("SKIPPED"):
            files.add(str(ROOT / line.split("::", 1)[0]))
        elif line.startswith("SKIPPED") and "] " in line:  # a file skipped whole: "SKIPPED [1] tests/x.py:19: why"
            files.add(str(ROOT / line.split("] ", 1)[1].split(":", 1)[0]))
    assert files, f"pytest --collect-only collected nothing:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return files


def full_run(config) -> bool:
    """Whether this session was started like ``make test``: no paths, no ``-k``, the configured testpaths."""
    args = list(config.invocation_params.args)
    while args:  # only marker expressions: "-m EXPR" or "-mEXPR" (make test's TEST_MARKS, make test-newest's)
        a = args.pop(0)
        if a == "-m" and args:
            args.pop(0)
        elif not a.startswith("-m"):
            return False
    return True


def test_no_test_file_sits_in_a_folder_of_scripts():
    stray = [str(p.relative_to(ROOT)) for d in NOT_TESTS for p in (ROOT / d).rglob("test_*.py")]
    assert not stray, f"test files in folders pytest is told to ignore (tests/conftest.py collect_ignore): {stray}"


def test_every_test_file_and_doctest_module_is_collected(request):
    if full_run(request.config):
        collected = request.config.stash[COLLECTED] | {str(ROOT / f) for f in SKIPPED_FILES}
    else:
        collected = collected_by_a_fresh_run()
    missing = sorted(os.path.relpath(p, ROOT) for p in expected_files() - collected)
    assert not missing, (
        f"{len(missing)} test files or doctest modules are not collected by `make test` (python -m pytest): "
        f"{missing[:20]}. A folder named build, dist, venv or starting with a dot is skipped by pytest's "
        "norecursedirs, and tests/conftest.py's collect_ignore skips more: rename the folder or move the file.")


def test_test_files_have_unique_names():
    """Test folders are not packages (pytest's rootdir import mode): two test files of one name in two
    folders stop the whole collection ("import file mismatch")."""
    seen: dict = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"test files of one name in two folders: {twins}; rename one (e.g. test_<topic>_<what>.py)"


@pytest.mark.parametrize("folder", ["build", "dist", "venv", "_darcs", "CVS", "node_modules"])
def test_no_package_or_test_folder_has_a_name_tools_skip(folder):
    hits = [str(p.relative_to(ROOT)) for top in ("nbkit", "tests", "benchmarks")
            for p in (ROOT / top).rglob(folder) if p.is_dir()]
    assert not hits, f"{hits}: pytest and other tools skip folders of this name; rename them"
