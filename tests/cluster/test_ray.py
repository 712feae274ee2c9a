"""nbkit.cluster.ray: RayEngine on a real local Ray instance with 2 workers (one per session: fixtures_clusters)."""

import engine_checks
import pytest


def test_results_come_back(ray_engine):
    engine_checks.results_come_back(ray_engine)
    engine_checks.calls_run_in_other_processes(ray_engine)


def test_a_worker_killed_mid_call_is_retried(ray_engine, tmp_path):
    engine_checks.killed_worker_call_completes(ray_engine, tmp_path)


def test_cancel_stops_queued_and_running_calls(ray_engine):
    engine_checks.cancel_stops_outstanding_calls(ray_engine)


def test_a_call_that_does_not_pickle_names_the_factory_form(ray_engine):
    engine_checks.unpicklable_call_names_the_factory_form(ray_engine)


def test_an_engine_joining_a_running_instance_leaves_it_running(ray_engine):
    import ray

    from nbkit.cluster import engine as build_engine
    joined = build_engine.engine_for("ray")  # this process already joined: nothing is started
    assert not joined.started and joined.workers == 2
    assert joined.submit(abs, -2).result(timeout=60) == 2
    joined.close()
    assert ray.is_initialized()
    assert ray_engine.submit(abs, -3).result(timeout=60) == 3


def test_a_missing_ray_names_the_extra(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "ray", None)
    from nbkit.cluster.ray import RayEngine
    with pytest.raises(ImportError, match=r"'ray' extra\): pip install ray"):
        RayEngine()


def test_worker_lost_tells_a_lost_worker_from_a_failed_call():
    pytest.importorskip("ray")
    import ray.exceptions as rex

    from nbkit.cluster.ray import RayEngine
    engine = RayEngine.__new__(RayEngine)  # the method reads no state: no instance needs starting
    assert engine.worker_lost(rex.WorkerCrashedError())
    assert not engine.worker_lost(ValueError("the source raised"))


def test_a_dashboard_asked_of_a_local_instance_listens_on_loopback_only(monkeypatch):
    ray = pytest.importorskip("ray")
    from nbkit.cluster.ray import RayEngine

    seen = {}

    class Started(Exception):
        pass

    def init(**options):
        seen.update(options)
        raise Started  # what ray.init was given is the news: no instance is started

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(Started):
        RayEngine(num_workers=1, init_options={"include_dashboard": True})
    assert seen["include_dashboard"] and seen["dashboard_host"] == "127.0.0.1"
    with pytest.raises(Started):
        RayEngine(num_workers=1, init_options={"include_dashboard": True, "dashboard_host": "0.0.0.0"})
    assert seen["dashboard_host"] == "0.0.0.0"  # the user's own choice stands


def test_the_source_goes_into_the_object_store_once_and_the_parts_carry_only_its_token(ray_engine, tmp_path):
    engine_checks.the_source_goes_to_each_worker_once(ray_engine, tmp_path)
