"""nbkit.samplers: EpochSampler keeps DistributedSampler's contract, deterministic from seed and
epoch; PrefetchSampler uses only the dataset's public store (``ds.store``)."""

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

import nbkit
from nbkit.samplers import EpochSampler, PrefetchSampler, default_rank_world, plan_windows


@pytest.mark.parametrize("n,world,drop_last", [(10, 3, False), (10, 3, True), (12, 4, False), (5, 8, False), (7, 1, True)])
def test_matches_distributed_sampler(n, world, drop_last):
    data = list(range(n))
    for epoch in (0, 3):
        for rank in range(world):
            ours = EpochSampler(n, seed=7, rank=rank, world_size=world, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=7, drop_last=drop_last)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_shards_partition_each_epoch():
    n, world = 103, 4
    shards = [EpochSampler(n, seed=1, rank=r, world_size=world, drop_last=True).indices(5) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    got = np.concatenate(shards)
    assert len(set(got.tolist())) == len(got) == (n // world) * world


def test_same_seed_and_epoch_same_order_new_epoch_new_order():
    a, b = EpochSampler(50, seed=3), EpochSampler(50, seed=3)
    assert a.indices(2).tolist() == b.indices(2).tolist()
    assert a.indices(2).tolist() != a.indices(3).tolist()
    assert sorted(a.indices(2).tolist()) == list(range(50))
    assert EpochSampler(50, shuffle=False).indices(9).tolist() == list(range(50))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank must be"):
        EpochSampler(10, rank=2, world_size=2)
    with pytest.raises(ValueError, match="both rank and world_size"):
        EpochSampler(10, rank=0)
    with pytest.raises(ValueError, match="world_size must be"):
        EpochSampler(10, rank=0, world_size=0)


def test_default_rank_world_without_a_distributed_runtime():
    assert not torch.distributed.is_initialized()
    assert default_rank_world() == (0, 1)


@pytest.fixture
def readthrough(tmp_path, monkeypatch):
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "areas"))
    src = torch.utils.data.TensorDataset(torch.arange(4000.0).reshape(1000, 4))
    ds = nbkit.CachedDataset(src, tmp_path / "local")
    ds[list(range(0, 1000, 2))]  # half stored: the other half is in no piece
    url = f"memory://nbkit-samplers/{tmp_path.name}"
    nbkit.push(ds.root, url)
    return nbkit.CachedDataset(src, url, local_max_bytes=64 << 10)


def test_windows_cover_every_index_once(readthrough):
    sampler = PrefetchSampler(readthrough, seed=1)
    windows = sampler.windows()
    assert len(windows) > 1 and sorted(np.concatenate(windows).tolist()) == list(range(1000))
    assert sorted(sampler) == list(range(1000)) and sampler.epoch == 1
    ordered = plan_windows(readthrough.store, np.random.default_rng(0), 1 << 20, shuffle=False)
    assert [w.tolist() == sorted(w.tolist()) for w in ordered] == [True] * len(ordered)


def test_any_dataset_with_a_read_through_store_will_do(readthrough):
    class View:  # no CachedDataset, no private attribute: only .store and len()
        store = readthrough.store

        def __len__(self):
            return 1000

    assert sorted(PrefetchSampler(View(), seed=0)) == list(range(1000))


def test_other_stores_are_refused(tmp_path):
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tmp_path)
    with pytest.raises(TypeError, match="not a read-through cache"):
        PrefetchSampler(ds)
