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


def test_a_seed_that_would_overflow_after_an_epoch_fails_at_construction(tmp_path):
    # Issue 25: a seed of 2**64 - 1 passed the check, then torch.Generator.manual_seed(seed + 1)
    # overflowed at the second epoch. seed + epoch must stay a signed 64-bit integer for every epoch.
    from nbkit.trust import MAX_EPOCH, MAX_SEED

    assert MAX_SEED + MAX_EPOCH == 2**63 - 1
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tmp_path / "c")
    for seed in (2**63 - 1, 2**64 - 1, 2**64, MAX_SEED + 1):
        for make in (lambda: EpochSampler(10, seed=seed), lambda: ds.loader(4, seed=seed),
                     lambda: nbkit.DeviceLoader(ds, 4, seed=seed)):
            with pytest.raises(ValueError) as e:
                make()
            assert f"seed must be an int in [0, 2**62 - 1], got {seed}" in str(e.value)
            assert "signed 64-bit" in str(e.value) and "seed % 2**62" in str(e.value)  # why, and the fix
    # The largest allowed seed runs two epochs, and gives the order of any epoch up to the last.
    loader = ds.loader(4, seed=MAX_SEED)
    epochs = [sorted(int(v) for (x,) in loader for v in x) for _ in range(2)]
    assert epochs == [list(range(10))] * 2 and loader.epoch == 2
    sampler = EpochSampler(10, seed=MAX_SEED)
    assert sorted(sampler.indices(MAX_EPOCH).tolist()) == list(range(10))
    for epoch in (-1, MAX_EPOCH + 1):
        with pytest.raises(ValueError, match=r"epoch must be an int in \[0, 2\*\*62\]"):
            sampler.set_epoch(epoch)
        with pytest.raises(ValueError, match="epoch must be"):
            sampler.indices(epoch)


def test_world_size_and_length_are_bounded(tmp_path):
    # A world size far above the samples padded the order to that many indices (a MemoryError, or
    # minutes, at the first epoch); a length beyond any cache failed in torch.randperm.
    with pytest.raises(ValueError, match=r"world_size must be an int in \[1, 2\*\*20\], got 1099511627776"):
        EpochSampler(10, rank=0, world_size=2**40)
    with pytest.raises(ValueError, match=r"data \(a length\) must be an int in \[0, 2\*\*40\]"):
        EpochSampler(2**62)
    assert len(EpochSampler(10, rank=5, world_size=2**20)) == 1
