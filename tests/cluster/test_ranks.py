"""nbkit.cluster.run_ranks: the ranks of a real torch.distributed job (2 processes, gloo, a TCP store on
127.0.0.1) build one cache in a shared directory and on gs:// (the GCS emulator); a rank lost
before its parts finish is named, and the rerun completes."""

import json
import os
import subprocess
import sys

import pytest
import torch

import nbkit
from buildsources import Named, check_cache
from fixtures_gcs import gcs, gcs_server
from nbkit.cluster.part import parts_dir
from nbkit.cluster.ranks import RanksIncomplete, run_ranks, shared_generation, torch_ranks
from servers import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "ranks_script.py")
N = 100  # part_size 16: 7 parts, the last one short; rank 0 builds 4, rank 1 builds 3


def run_job(tmp_path, cache, *, world=2, options=None, env_of=lambda rank: {}, timeout=120):
    """Start ``world`` ranks of ranks_script.py; return each one's (exit code, result)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
                   NBKIT_CACHE_DIR=str(tmp_path / f"host-{rank}"), RANKS_STORAGE_OPTIONS=json.dumps(options), **env_of(rank))
        out = tmp_path / f"rank-{rank}.json"
        if out.exists():
            out.unlink()
        procs.append((subprocess.Popen([sys.executable, SCRIPT, str(rank), str(world), str(port), cache, str(N), str(out)],
                                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out))
    results = []
    for p, out in procs:
        log = p.communicate(timeout=timeout)[0].decode(errors="replace")
        results.append((p.returncode, json.loads(out.read_text()) if out.exists() else None, log))
    return results


def assert_built(results):
    for rank, (code, result, log) in enumerate(results):
        assert code == 0 and result is not None and "report" in result, f"rank {rank}: {code}\n{log}"
    return [r["report"] for _, r, _ in results]


def test_two_ranks_build_a_shared_directory(tmp_path):
    cache = str(tmp_path / "shared" / "named")
    reports = assert_built(run_job(tmp_path, cache))
    assert [r["parts"] for r in reports] == [7, 7]
    assert [r["built"] for r in reports] == [4, 3]  # parts[rank::world]
    assert sum(r["computed"] for r in reports) == N  # no sample computed twice
    assert reports[0]["merged"] == N and reports[1]["merged"] == 0  # one merges
    assert not os.path.exists(parts_dir(cache))
    check_cache(cache, Named(N))
    again = assert_built(run_job(tmp_path, cache))  # a complete cache: nothing planned
    assert [r["parts"] for r in again] == [0, 0]


def test_two_ranks_build_one_gs_cache(tmp_path, gcs):
    url = f"{gcs.url}/caches/named"
    results = run_job(tmp_path, url, options=gcs.storage_options)
    reports = assert_built(results)
    assert [r["built"] for r in reports] == [4, 3] and sum(r["computed"] for r in reports) == N
    assert reports[0]["composed"] and not reports[1]["composed"]
    # each "host" read the composed cache from its own working copy
    roots = [r["root"] for _, r, _ in results]
    assert roots[0] != roots[1] and all(str(tmp_path) in r for r in roots)
    assert not gcs.fs.exists(f"{url}.parts")  # removed once composed
    copy = str(tmp_path / "pulled")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    check_cache(copy, Named(N))


@pytest.mark.parametrize("where", ["shared", "gs"])
def test_a_rank_lost_mid_build_is_named_and_the_rerun_completes(tmp_path, gcs, where):
    cache, options = ((str(tmp_path / "shared" / "named"), None) if where == "shared"
                      else (f"{gcs.url}/caches/lost", gcs.storage_options))
    # rank 1 builds [16, 32), [48, 64), [80, 96): it dies inside its second part
    results = run_job(tmp_path, cache, options=options, env_of=lambda r: {"RANKS_DIE_AT": "53"} if r == 1 else {})
    (code0, res0, log0), (code1, res1, _) = results
    assert code1 == 137 and res1 is None
    assert res0 is not None and res0["error"] == "RanksIncomplete", log0
    msg = res0["message"]
    assert "rank 1" in msg and "[48, 64)" in msg and "[80, 96)" in msg and "Rerun the job" in msg, msg
    assert "[16, 32)" not in msg  # its first part was finished: reused by the rerun
    assert res0["missing"] == {"1": [[48, 64], [80, 96]]}
    if where == "shared":
        # rank 0 merged every finished part before it raised: the rerun plans only the lost two
        with nbkit.CachedDataset.open(cache) as ds:
            assert ds.missing().tolist() == list(range(48, 64)) + list(range(80, 96))
        reports = assert_built(run_job(tmp_path, cache, options=options))
        assert [r["parts"] for r in reports] == [2, 2] and sum(r["computed"] for r in reports) == 32
        check_cache(cache, Named(N))
    else:
        # the finished parts wait under <url>.parts (nothing is composed with a gap): found whole and reused
        reports = assert_built(run_job(tmp_path, cache, options=options))
        assert [r["reused"] for r in reports] == [4, 1] and [r["built"] for r in reports] == [0, 2]
        assert sum(r["computed"] for r in reports) == 32
        copy = str(tmp_path / "pulled")
        nbkit.pull(cache, copy, storage_options=options)
        check_cache(copy, Named(N))


def test_a_rank_that_raises_releases_its_peers(tmp_path):
    """In one process, world 2 with a barrier that returns: rank 1's part raises, and the error names
    its parts (the peers were not left waiting: the barrier was passed)."""
    class Bad(Named):
        def __getitem__(self, i):
            if i == 20:
                raise ValueError("bad sample 20")
            return super().__getitem__(i)

    ds = nbkit.CachedDataset(Bad(N), str(tmp_path / "c"))
    passed = []
    with pytest.raises(RanksIncomplete, match=r"rank 1 raised ValueError: bad sample 20") as e:
        run_ranks(ds, rank=1, world=2, barrier=passed.append, part_size=16)
    assert passed == ["nbkit-build-plan", "nbkit-build-built", "nbkit-build-merged"]
    assert e.value.missing == {0: [(0, 16), (32, 48), (64, 80), (96, 100)], 1: [(16, 32), (48, 64), (80, 96)]}


def test_arguments_are_checked(tmp_path):
    ds = nbkit.CachedDataset(Named(8), str(tmp_path / "c"))
    with pytest.raises(TypeError, match="together"):
        run_ranks(ds, rank=0, world=2)
    with pytest.raises(ValueError, match="rank"):
        run_ranks(ds, rank=2, world=2, barrier=lambda name: None)
    with pytest.raises(RuntimeError, match="init_process_group"):
        torch_ranks()
    with pytest.raises(RuntimeError, match="no multi-process job"):
        run_ranks(ds)


def test_the_shared_generation_is_the_same_for_every_rank_and_rerun():
    meta = {"fingerprint": "f", "length": 3, "schema": {"a": 1}, "columns": [], "allow_pickle": False}
    assert shared_generation("gs://b/c", meta) == shared_generation("gs://b/c", dict(meta, generation="other"))
    assert shared_generation("gs://b/c", meta) != shared_generation("gs://b/c", dict(meta, fingerprint="g"))


def test_torch_ranks_in_a_single_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(40)), str(tmp_path / "c"))
        report = run_ranks(ds, part_size=16)
        assert (report.rank, report.world, report.parts, report.computed) == (0, 1, 3, 40)
    finally:
        dist.destroy_process_group()


def test_warmup_shared_on_several_hosts_builds_with_the_ranks(tmp_path, gcs):
    """nbkit.tpu.warmup_shared where the job's world is larger than this host's replicas (a pod slice
    of two one-chip hosts): the ranks build the gs:// cache; only torch_xla's runtime queries are
    answered by torch.distributed here."""
    url = f"{gcs.url}/caches/pod"
    reports = assert_built(run_job(tmp_path, url, options=gcs.storage_options, env_of=lambda r: {"RANKS_VIA": "warmup_shared"}))
    assert [r["built"] for r in reports] == [4, 3] and reports[0]["composed"]


def test_a_damaged_or_foreign_part_on_gs_is_built_again(tmp_path, gcs, monkeypatch):
    """A part whose nbkit.json does not parse, or names another build's generation, is never
    reused: its rank builds and pushes it again (one process, world 1)."""
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "host"))
    url = f"{gcs.url}/caches/stale"
    gcs.fs.pipe(f"{url}.parts/part-0000000000000-0000000000016/nbkit.json", b"{not json")
    foreign = {"part": {"cache_generation": "0" * 32, "cache_length": 40, "start": 16, "stop": 32, "files": {}}}
    gcs.fs.pipe(f"{url}.parts/part-0000000000016-0000000000032/nbkit.json", json.dumps(foreign).encode())
    ds = nbkit.CachedDataset(Named(40), url, storage_options=gcs.storage_options)
    report = run_ranks(ds, rank=0, world=1, barrier=lambda name: None, part_size=16)
    assert (report.built, report.reused, report.composed) == (3, 0, True)
    check_cache(report.dataset.root, Named(40))
    assert report.dataset.root == ds.root  # the same working copy, now the composed cache


def test_a_stopped_rank_keeps_its_finished_parts_and_names_the_rest(tmp_path):
    from nbkit.progress import Callback

    class StopAfterOne(Callback):
        def relative_update(self, inc=1):
            super().relative_update(inc)
            self.request_stop()  # after the first part

    ds = nbkit.CachedDataset(Named(N), str(tmp_path / "c"))
    with pytest.raises(RanksIncomplete, match=r"rank 0: \[16, 32\), \[32, 48\)") as e:
        run_ranks(ds, rank=0, world=1, barrier=lambda name: None, part_size=16, callback=StopAfterOne())
    assert e.value.missing == {0: [(16, 32), (32, 48), (48, 64), (64, 80), (80, 96), (96, 100)]}
    assert ds.missing().tolist() == list(range(16, N))  # the finished part was merged
    report = run_ranks(ds, rank=0, world=1, barrier=lambda name: None, part_size=16)
    assert (report.parts, report.computed) == (6, N - 16)
    check_cache(ds.root, Named(N))


def test_a_merge_error_on_rank_0_is_raised_after_the_last_barrier(tmp_path, monkeypatch):
    import nbkit.cluster.ranks as ranks

    def broken(store, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ranks, "merge", broken)
    ds = nbkit.CachedDataset(Named(40), str(tmp_path / "c"))
    passed = []
    with pytest.raises(OSError, match="No space left"):
        run_ranks(ds, rank=0, world=2, barrier=passed.append, part_size=16)
    assert len(passed) == 3  # the peers were released before it raised
