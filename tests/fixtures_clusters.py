"""Real local clusters for the build engines' tests: one Ray instance and one Dask ``LocalCluster``
per test session, each with 2 workers (starting Ray costs ~15-18 s and ~1 GiB here, Dask ~1.5 s and
~200 MiB: docs/notes/issue29-engines.md), so few tests start a cluster and none starts two.

tests/conftest.py registers them once for every test: never import them into a test module (a
fixture imported into a module is that module's own, so each module would start its own cluster and
keep it until the session ends). Each skips, saying so, when its package is not installed
(``pip install 'nbkit-cache[ray]'`` / ``[dask]``).

The workers import the calls the tests send from ``tests/cluster/engine_calls.py``: the fixtures put
``tests/cluster`` and the checkout on ``PYTHONPATH`` before the cluster starts (Ray's workers inherit
the environment; Dask's spawned workers also get this process's ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

__all__ = ["ray_engine", "dask_engine", "worker_pythonpath", "worker_env"]


def worker_pythonpath():
    """Put the checkout and tests/cluster on PYTHONPATH (what worker processes import from); returns the old value."""
    old = os.environ.get("PYTHONPATH")
    parts = [ROOT, os.path.join(HERE, "cluster"), HERE] + ([old] if old else [])
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    return old


def _needs(module: str, extra: str):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed: pip install 'nbkit-cache[{extra}]' (make setup installs it)")


def _started(module: str, extra: str, make):
    """The engine ``make()`` returns, started with the workers' PYTHONPATH; skips without ``module``."""
    _needs(module, extra)
    old = worker_pythonpath()
    try:
        return make()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="session")
def ray_engine():
    """A RayEngine over a local Ray instance with 2 worker CPUs, started once per session."""
    def make():
        import ray

        from nbkit.cluster.ray import RayEngine
        for attempt in range(3):
            try:
                return RayEngine(num_workers=2)
            except Exception as e:  # Ray waits a fixed 30 s for its raylet: a loaded machine can miss it
                if "timed out during startup" not in str(e) or attempt == 2:
                    raise
                ray.shutdown()

    engine = _started("ray", "ray", make)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def dask_engine():
    """A DaskEngine over a LocalCluster of 2 worker processes (1 thread each), started once per session."""
    def make():
        from nbkit.cluster.dask import DaskEngine
        return DaskEngine(num_workers=2)

    engine = _started("distributed", "dask", make)
    yield engine
    engine.close()


@pytest.fixture
def worker_env():
    """The workers' PYTHONPATH for a test that starts a cluster of its own (one that breaks it)."""
    old = worker_pythonpath()
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old
