"""Sources for tests/jax (importable by spawned Grain workers): the same samples from torch and from numpy."""

import os
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

N = 48
#: The environment of the processes these tests start (workers included): torch >= 2.5 imports every
#: installed device backend on ``import torch`` (torch_tpu in the newest venv: 4 s more a process, and
#: libtpu loaded); these processes read caches on the CPU only.
CPU_ONLY = {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "PJRT_DEVICE": "CPU", "JAX_PLATFORMS": "cpu"}
HERE = Path(__file__).resolve().parent


def child_env() -> dict:
    """The environment of a process a test starts: :data:`CPU_ONLY`, and nbkit, tests/jax and tests/ importable."""
    paths = [str(HERE.parents[1]), str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, **CPU_ONLY, "PYTHONPATH": os.pathsep.join(paths)}


def values(i):
    """Sample ``i``'s values: a float32 image, a bfloat16 vector, an int label."""
    rng = np.random.default_rng(i)
    return rng.standard_normal((2, 4)).astype(np.float32), rng.standard_normal(3).astype(ml_dtypes.bfloat16), i % 7


class NumpySource:
    """What a JAX user's dataset returns: numpy arrays (and numbers)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        image, half, label = values(i)
        return image, half, label


class TorchSource(torch.utils.data.Dataset):
    """The same samples as torch tensors (bfloat16 included)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        image, half, label = values(i)
        return torch.from_numpy(image), torch.from_numpy(half.view(np.int16)).view(torch.bfloat16), label


class Pair:
    """Sample ``i`` of two Grain sources at once: one DataLoader (one start of its workers) reads both caches."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __len__(self):
        return len(self.a)

    def __getitem__(self, i):
        return {"index": i, "torch": self.a[i], "numpy": self.b[i]}

    def __repr__(self):
        return f"Pair({self.a!r}, {self.b!r})"


def expected(indices):
    """The batch of ``indices`` as numpy: stacked image, bfloat16 vector, label."""
    rows = [values(int(i)) for i in indices]
    return [np.stack([r[k] for r in rows]) for k in range(2)] + [np.array([r[2] for r in rows])]


def assert_same_batch(got, indices):
    """``got`` (a batch of (image, half, label), arrays of any kind) holds exactly the samples ``indices``."""
    want = expected(indices)
    assert len(got) == 3
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.dtype == w.dtype or (w.dtype == np.int64 and g.dtype == np.int32), (g.dtype, w.dtype)
        np.testing.assert_array_equal(g.astype(w.dtype), w)
