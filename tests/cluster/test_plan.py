import numpy as np
import pytest
import torch

import nbkit
from nbkit.cluster.plan import plan


def _cache(tmp_path, n=10):
    return nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(n)), str(tmp_path / "c"))


def test_plan_cuts_missing_into_aligned_parts(tmp_path):
    ds = _cache(tmp_path, 10)
    assert [(p.start, p.stop, p.todo.tolist()) for p in plan(ds.store, 4)] == [(0, 4, [0, 1, 2, 3]), (4, 8, [4, 5, 6, 7]), (8, 10, [8, 9])]
    ds.compute_and_store(np.array([0, 1, 2, 3, 5, 9]))
    assert [(p.start, p.stop, p.todo.tolist()) for p in plan(ds.store, 4)] == [(4, 8, [4, 6, 7]), (8, 10, [8])]
    assert [p.name for p in plan(ds.store, 4)] == ["part-0000000000004-0000000000008", "part-0000000000008-0000000000010"]


def test_plan_of_a_complete_cache_is_empty_and_part_size_is_checked(tmp_path):
    ds = _cache(tmp_path, 5)
    ds.warmup()
    assert plan(ds.store, 2) == []
    with pytest.raises(ValueError, match="part_size"):
        plan(ds.store, 0)


def test_plan_skips_samples_outside_a_byte_budget(tmp_path):
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.zeros(100, 64)), str(tmp_path / "b"), max_bytes=50 * 256)
    planned = np.concatenate([p.todo for p in plan(ds.store, 16)])
    assert len(planned) == ds.store.capacity and ds.store.admitted(planned).all()


def test_plan_around_parts_there_builds_no_index_twice(tmp_path):
    import os

    from nbkit.cluster.plan import held
    from nbkit.cluster.part import part_name
    from nbkit.commit import claim, release, staging_name

    ds = _cache(tmp_path, 20)
    ds.compute_and_store(np.array([0, 1]))
    # Parts of a plan of size 6 are there (or being built); this plan is of size 8.
    planned = plan(ds.store, 8, around=[(6, 12), (18, 20)])
    assert [(p.start, p.stop, p.todo.tolist()) for p in planned] == [
        (0, 6, [2, 3, 4, 5]), (12, 16, [12, 13, 14, 15]), (16, 18, [16, 17])]
    parts = tmp_path / "c.parts"
    parts.mkdir()
    (parts / part_name(6, 12)).mkdir()  # a whole part
    live = parts / staging_name(part_name(12, 18), "build")
    dead = parts / staging_name(part_name(0, 6), "build")
    live.mkdir()
    dead.mkdir()
    claim(str(live))  # a worker writes it now; the other's worker died
    try:
        assert held(str(parts)) == [(6, 12), (12, 18)]
    finally:
        release(str(live))
    assert held(str(parts)) == [(6, 12)] and held(str(tmp_path / "none")) == []
    assert os.path.isdir(dead)
    ds.close()
