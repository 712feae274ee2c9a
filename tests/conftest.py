"""Shared test fixtures. Per-topic fixtures live in tests/fixtures_*.py and are imported by the
test modules that use them."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest
from collection_record import COLLECTED, SKIPPED_FILES
# The clusters the build engines' tests share: registered here, once. A fixture imported into several
# test modules is a fixture of each module, so a "session" cluster would start once per module and
# stay up until the session ends (four idle Dask clusters and Ray instances per run).
from fixtures_clusters import dask_engine, ray_engine

# Scripts the tests run in subprocesses (they do real work at import): never collected.
collect_ignore = ["tpu_scripts", "notebooks", "widgets7"]

os.environ.setdefault("PJRT_DEVICE", "CPU")
# TorchTPU (torch_tpu, installed in the newest-torch venv) registers itself through torch's
# device-backend autoload: with it on, every `import torch` (this process and each subprocess) loads
# torch_tpu and libtpu (+5 s here) and writes a tcmalloc warning and libtpu log lines to stderr, and
# on a machine without TPU chips it registers nothing. Off for the suite; the tests of the real
# package (tests/tpu/test_torch_tpu_real.py) turn it on where they check what it does.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

# Working copies of remote caches (and what `nbkit ls`/`nbkit.caches()` list besides their roots) go
# to a folder of this run's own, never to the user's ~/.cache/nbkit: a run neither sees what another
# run or the user left there nor leaves anything behind. Subprocesses inherit it.
os.environ["NBKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="nbkit-wc-")  # short: the panel shows it
atexit.register(shutil.rmtree, os.environ["NBKIT_CACHE_DIR"], ignore_errors=True)

# Property-based tests (the fuzzing of everything nbkit parses) run a fixed, deterministic budget in
# CI; NBKIT_FUZZ=long runs many more examples with fresh randomness (see docs/SECURITY.md):
#   NBKIT_FUZZ=long .venv/bin/python -m pytest -m fuzz
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=60, derandomize=True, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.register_profile("long", max_examples=5000, deadline=None, print_blob=True,
                              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    settings.load_profile("long" if os.environ.get("NBKIT_FUZZ") == "long" else "ci")
except ImportError:  # hypothesis is in the dev extra; the fuzz tests import it themselves
    pass


@pytest.fixture(autouse=True)
def _no_part_source_outlives_its_test():
    """A part build keeps the source it unpickled per token (``nbkit.cluster.part._SOURCES``), and
    tests reuse tokens: a later test would build from an earlier test's dataset, whose cache (in its
    ``tmp_path``, removed when it passed) is gone. Each test starts without one."""
    yield
    part = sys.modules.get("nbkit.cluster.part")
    if part is not None:
        part._SOURCES.clear()


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory):
    """An offline MNIST-format root (2,000 train / 500 test images) for torchvision.datasets.MNIST."""
    from nbkit.offline import write_mnist

    root = tmp_path_factory.mktemp("mnist")
    write_mnist(root, n_train=2000, n_test=500)
    return root


# Every item this run collects, before `-m` deselects any (make test-newest leaves out one_stack
# tests): tests/test_collection.py checks from it that no test file and no doctest module is skipped
# by the collection rules (pytest's norecursedirs skips folders named build, dist, venv, ...). The key
# lives in tests/collection_record.py: `import conftest` can find another folder's conftest.py.


def pytest_configure(config):
    config.stash[COLLECTED] = set()


# pytest_collection_modifyitems goes through config.hook, which calls this conftest for every item of
# the session (the doctests of nbkit/ too); pytest_itemcollected would be called only for items under
# tests/ (a conftest's node hooks are scoped to its folder). tryfirst: before `-m` deselects.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    config.stash[COLLECTED].update(str(item.path) for item in items)


def pytest_collectreport(report):
    if report.skipped and report.nodeid and "::" not in report.nodeid:
        SKIPPED_FILES.add(report.nodeid)


# --doctest-modules would collect every conftest.py as a module named `conftest`; two folders' conftest
# files (tests/ and tests/cluster/) then collide in sys.modules ("import file mismatch", which failed
# CI on the newest stack). pytest loads them as conftests all the same; they hold no doctests.
def pytest_ignore_collect(collection_path, config):
    if collection_path.name == "conftest.py":
        return True
    return None
