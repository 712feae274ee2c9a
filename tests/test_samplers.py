"""nbkit.samplers: PrefetchSampler uses only the dataset's public store (``ds.store``)."""

import numpy as np
import pytest
import torch

import nbkit
from nbkit.samplers import PrefetchSampler, plan_windows


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
