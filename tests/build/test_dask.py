"""nbkit.build.dask: DaskEngine on a real LocalCluster of 2 worker processes (one per session: fixtures_clusters)."""

import engine_checks
import pytest
from fixtures_clusters import dask_engine


def test_results_come_back(dask_engine):
    engine_checks.results_come_back(dask_engine)
    engine_checks.calls_run_in_other_processes(dask_engine)


def test_a_worker_killed_mid_call_is_rescheduled(dask_engine, tmp_path):
    engine_checks.killed_worker_call_completes(dask_engine, tmp_path)


def test_cancel_stops_queued_and_running_calls(dask_engine):
    engine_checks.cancel_stops_outstanding_calls(dask_engine)


def test_a_call_that_does_not_pickle_names_the_factory_form(dask_engine):
    engine_checks.unpicklable_call_names_the_factory_form(dask_engine)


def test_a_client_given_is_used_and_left_open(dask_engine):
    from nbkit.build.engine import engine_for
    engine = engine_for(dask_engine.client)  # a Client: its futures are not concurrent ones, so a DaskEngine
    # the workers the cluster has now (one may be restarting after an earlier test's cancel)
    assert type(engine).__name__ == "DaskEngine" and 1 <= engine.workers <= 2
    assert engine.submit(abs, -4).result(timeout=60) == 4
    engine.close()
    assert dask_engine.submit(abs, -5).result(timeout=60) == 5


def test_a_missing_dask_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "distributed", None)
    from nbkit.build.dask import DaskEngine
    with pytest.raises(ImportError, match=r"'dask' extra\): pip install 'dask\[distributed\]'"):
        DaskEngine()


def test_engine_for_refuses_an_unknown_name():
    from nbkit.build.engine import engine_for
    with pytest.raises(ValueError, match="unknown engine 'spark'.*'processes', 'ray', 'dask'"):
        engine_for("spark")


def test_worker_lost_tells_a_lost_worker_from_a_failed_call(dask_engine):
    import distributed
    assert dask_engine.worker_lost(distributed.KilledWorker("task", "tcp://127.0.0.1:1", 3))
    assert not dask_engine.worker_lost(ValueError("the source raised"))
