"""Sources for the build tests, importable by spawned workers: ``Named`` puts a string in the heap."""

import os
import time

import torch
from torch.utils.data import Dataset


class Named(Dataset):
    """``(tensor 3x4, label, name)``: fixed-shape columns and a heap blob per sample."""

    def __init__(self, n=200, seed=1, delay=0.0):
        self.n, self.seed, self.delay = n, seed, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.delay:
            time.sleep(self.delay)
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randn(3, 4, generator=g), (i * 7 + self.seed) % 10, f"s{self.seed}-{i}" + "x" * (i % 3)


class Flagged(Named):
    """``Named`` whose ``__getitem__`` of ``at`` waits until the file ``flag`` exists (a worker to kill mid-part)."""

    def __init__(self, n, flag, at):
        super().__init__(n)
        self.flag, self.at = flag, at

    def __getitem__(self, i):
        if i == self.at and not os.path.exists(self.flag + ".go"):
            with open(self.flag + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.flag + ".tmp", self.flag)
            while not os.path.exists(self.flag + ".go"):
                time.sleep(0.02)
        return super().__getitem__(i)


class Unpicklable(Named):
    def __init__(self, n=20):
        super().__init__(n)
        self.fn = lambda: 1


def make_named():
    return Named(64)


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and int(a[1]) == int(b[1]) and str(a[2]) == str(b[2])


def check_cache(path, src):
    """Every sample of the cache at ``path`` equals ``src``'s; ``verify()`` passes."""
    import nbkit

    with nbkit.CachedDataset.open(path) as ds:
        assert len(ds.missing()) == 0
        assert ds.verify() == len(src)
        for i in range(len(src)):
            assert same(ds[i], src[i]), i


class Costly(Dataset):
    """MNIST-shaped (1x28x28 float32, a label) with ``cost_us`` microseconds of pure-Python work a
    sample (a decode and resize stand-in): what the throughput measurements build."""

    def __init__(self, n, cost_us):
        self.n, self.cost = n, cost_us / 1e6

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        g = torch.Generator().manual_seed(i)
        return torch.rand(1, 28, 28, generator=g), i % 10


def part_spec(ds, start, stop, todo=None, **extra) -> dict:
    """What the driver hands :func:`nbkit.cluster.part.build_part` for the part ``[start, stop)`` of the
    cache ``ds`` (its source pickled into the spec, under a token of its own: a process keeps the
    source it unpickled per token, and another test's cache may be gone); ``extra`` adds or replaces fields."""
    import pickle

    import numpy as np

    from nbkit.cluster.part import parts_dir

    return dict(cache=ds.root, parts=parts_dir(ds.root), start=start, stop=stop,
                todo=np.arange(start, stop) if todo is None else np.asarray(todo), meta=ds.store.meta,
                source=("pickled", f"tok:{ds.root}", pickle.dumps(ds)), **extra)


#: The samples of the shared ``cache`` fixture (tests/cluster/conftest.py).
PART_N = 40
