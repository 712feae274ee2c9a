"""nbkit.cluster.dask: DaskEngine on a real LocalCluster of 2 worker processes (one per session: fixtures_clusters)."""

import os
import time

import engine_checks
import pytest
from fixtures_clusters import worker_env


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
    from nbkit.cluster.engine import engine_for
    engine = engine_for(dask_engine.client)  # a Client: its futures are not concurrent ones, so a DaskEngine
    # the workers the cluster has now (one may be restarting after an earlier test's cancel)
    assert type(engine).__name__ == "DaskEngine" and 1 <= engine.workers <= 2
    assert engine.submit(abs, -4).result(timeout=60) == 4
    engine.close()
    assert dask_engine.submit(abs, -5).result(timeout=60) == 5


def test_a_missing_dask_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "distributed", None)
    from nbkit.cluster.dask import DaskEngine
    with pytest.raises(ImportError, match=r"'dask' extra\): pip install 'dask\[distributed\]'"):
        DaskEngine()


def test_engine_for_refuses_an_unknown_name():
    from nbkit.cluster.engine import engine_for
    with pytest.raises(ValueError, match="unknown engine 'spark'.*'processes', 'ray', 'dask'"):
        engine_for("spark")


def test_worker_lost_tells_a_lost_worker_from_a_failed_call(dask_engine):
    import distributed
    assert dask_engine.worker_lost(distributed.KilledWorker("task", "tcp://127.0.0.1:1", 3))
    assert not dask_engine.worker_lost(ValueError("the source raised"))


def _break_restarts(engine, cluster):
    """Make the next restart of ``engine``'s busy workers end as it did under load (issue 37): the
    nannies close instead of starting fresh workers, and restart_workers reports it without raising."""
    def restart_workers(workers, timeout=None, raise_for_error=True):
        for nanny in list(cluster.workers.values()):
            cluster.sync(nanny.close, timeout=1)
        return {w: "timed out" for w in workers}

    engine.client.restart_workers = restart_workers


def _stop_a_running_call(engine):
    import engine_calls

    f = engine.submit(engine_calls.sleep, 60)
    deadline = time.monotonic() + 60
    while not any(engine.client.processing().values()):
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.05)
    with pytest.warns(RuntimeWarning, match=r"0 of the 1 workers came back"):
        engine.cancel([f])


def test_a_stop_that_loses_the_workers_of_its_own_cluster_leaves_the_engine_usable(worker_env, monkeypatch):
    import engine_calls
    from nbkit.cluster import dask as dask_module

    monkeypatch.setattr(dask_module, "RESTART_SECONDS", 3)
    with dask_module.DaskEngine(num_workers=1) as engine:
        old = dask_module._worker_pids(engine._cluster)
        _break_restarts(engine, engine._cluster)
        t0 = time.monotonic()
        _stop_a_running_call(engine)
        assert engine.unusable is None and time.monotonic() - t0 < 30
        assert engine.submit(engine_calls.square, 3).result(timeout=60) == 9  # a fresh local cluster runs it
        assert old and not [pid for pid in old if _alive(pid)]  # the replaced cluster's workers are gone
        new = dask_module._worker_pids(engine._cluster)
    assert new and not [pid for pid in new if _alive(pid)]  # and close() ends the fresh one's


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie not yet collected counts as ended)."""
    from nbkit.cluster.reaper import proc_stat

    fields = proc_stat(pid)
    return fields is not None and fields[0] != "Z"


def test_a_stop_that_leaves_a_joined_cluster_without_workers_says_so_and_the_next_run_raises(worker_env, monkeypatch):
    import distributed

    import engine_calls
    from nbkit.cluster import dask as dask_module

    monkeypatch.setattr(dask_module, "RESTART_SECONDS", 3)
    monkeypatch.setattr(dask_module, "WORKERS_SECONDS", 1)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, host="127.0.0.1",
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        engine = dask_module.DaskEngine(client)
        _break_restarts(engine, cluster)
        _stop_a_running_call(engine)
        assert "has no workers" in engine.unusable
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"has no workers: the Stop restarted .* Restart its workers"):
            engine.submit(engine_calls.square, 3)  # raises, where it used to wait for ever
        assert time.monotonic() - t0 < 10
        engine.close()


def test_the_dashboard_of_a_local_cluster_listens_on_loopback_only(dask_engine):
    servers = dask_engine._cluster.scheduler.http_server._sockets.values()  # tornado's listening sockets
    hosts = {s.getsockname()[0] for s in servers}
    assert hosts == {"127.0.0.1"}, hosts  # ":0" listened on every interface ("0.0.0.0", "::")
    assert dask_engine._cluster.scheduler_address.startswith("tcp://127.0.0.1:")


def test_every_worker_gets_the_source_once_and_the_parts_only_its_token(dask_engine, tmp_path):
    engine_checks.the_source_goes_to_each_worker_once(dask_engine, tmp_path)


def test_a_worker_restarted_after_a_share_loads_the_source_again(dask_engine, tmp_path):
    import pickle

    import numpy as np

    import nbkit
    from buildsources import Named, check_cache
    from nbkit.cluster.merge import merge
    from nbkit.cluster.part import build_part, parts_dir

    ds = nbkit.CachedDataset(Named(48), str(tmp_path / "cache"))
    assert dask_engine.share(("pickled", "restart-token", pickle.dumps(ds)))
    dask_engine.client.restart_workers(list(dask_engine.client.nthreads()), timeout=60)  # fresh processes
    spec = dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=48, todo=np.arange(48),
                meta=ds.store.meta, source=("shared", "restart-token", None))
    assert dask_engine.submit(build_part, spec).result(timeout=120)["kept"]
    assert merge(ds.store, os.path.join(parts_dir(ds.root), "part-0000000000000-0000000000048")).merged == 48
    ds.close()
    check_cache(ds.root, Named(48))
