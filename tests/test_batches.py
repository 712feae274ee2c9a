"""A CachedDataset's batches equal the batches the same DataLoader gives over its source.

One matrix: every common sample structure (``sources.STRUCTURES``: a bare tensor, a numpy array,
a PIL image, an image and label, tuple, list, dict, namedtuple, nested containers, a bare label, a
string) × collate (the DataLoader's default, ``nbkit.collate``, and ``samples``, which keeps the
samples as they are) × workers (none; two, started by fork, spawn or forkserver) × pin_memory × a
warmed cache or a cold one (its misses computed, and stored, in the workers).

Equal: the same types (a namedtuple stays itself, a PIL image a PIL image), the same structure and
the same values (tensor dtypes and shapes included). With ``samples``, a sample may be the row
subclass nbkit documents (``TupleRow`` for a tuple …): it is compared as the plain type it stands for.

PIL images and the default collate: torch's refuses them (the raw loader raises ``TypeError``),
nbkit's stacks them as ``PILToTensor`` would (README, "Samples"), in a tuple or bare. There the
test checks that the raw loader raises, and compares the cache's batches with the ones
``nbkit.collate`` gives over the source (it stacks the same way).

pin_memory: without an accelerator the DataLoader ignores ``pin_memory=True`` (with a warning), so
on a CPU-only machine the ``pinning`` fixture stands in for one: torch's pin-memory thread runs
(with workers it receives their batch handles, so nbkit gathers there), its walk rebuilds every
batch, and ``Tensor.pin_memory`` copies instead of pinning. With CUDA, pinning is real.

Runtime: a spawn or forkserver worker imports torch (seconds), so those columns run a
representative subset of structures and collates (``SLOW``), without pin_memory, and compare with
the raw batches of the fork loader: the source's batches do not depend on how its workers start.
296 cases, about 4 minutes on 2 busy cores (fork and no workers: 264 cases, under a minute).
"""

import gc
import multiprocessing as mp
import warnings

import numpy as np
import pytest
import torch
from sources import STRUCTURES, StructureSource, is_pil, same_image
from torch.utils.data import DataLoader

import nbkit
from nbkit.collate import plain_sample

N, BATCH = 20, 5
METHODS = [m for m in ("fork", "spawn", "forkserver") if m in mp.get_all_start_methods()]


def samples(batch):
    """A collate_fn that keeps the samples as they are (importable by spawned workers)."""
    return list(batch)


COLLATES = {"default": None, "nbkit": nbkit.collate, "samples": samples}
# spawn and forkserver: the bug's bare tensor, PIL (rows made lazily in the worker), a namedtuple
# (its class found again in a fresh process) and nested containers; the collates that send handles;
# no pin_memory (its thread is the main process's, whatever starts the workers).
SLOW = {"structures": ("tensor", "pil", "namedtuple", "nested"), "collates": ("default", "nbkit")}
# A worker stuck on a batch must fail its case, not the whole run (the DataLoader has no timeout).
pytestmark = pytest.mark.timeout(120)


def _cases():
    for structure in STRUCTURES:
        for collate in COLLATES:
            for workers in ["none", *METHODS]:
                slow = workers in ("spawn", "forkserver")
                if slow and (structure not in SLOW["structures"] or collate not in SLOW["collates"]):
                    continue
                for pin in (False,) if slow else (False, True):
                    for cache in ("warm", "cold"):
                        yield pytest.param(structure, collate, workers, pin, cache,
                                           id=f"{structure}-{collate}-{workers}-{'pin' if pin else 'nopin'}-{cache}")


class Raised:
    def __init__(self, error):
        self.type, self.message = type(error), str(error)

    def __repr__(self):
        return f"Raised({self.type.__name__}: {self.message[:200]})"


def _load(ds, collate, workers, pin):
    kw = {"batch_size": BATCH, "pin_memory": pin}
    if COLLATES[collate] is not None:
        kw["collate_fn"] = COLLATES[collate]
    if workers != "none":
        kw.update(num_workers=2, multiprocessing_context=workers)
    try:
        return list(DataLoader(ds, **kw))
    except Exception as e:  # noqa: BLE001 - the raw loader refusing PIL images: compared below
        return Raised(e)
    finally:
        gc.collect()  # a finished iterator in a cycle, collected here and not in a later loader's pin thread


@pytest.fixture
def pinning(request, monkeypatch):
    """For ``pin_memory=True`` without CUDA: an accelerator whose pinning copies (see the module doc)."""
    if not request.node.callspec.params["pin"] or torch.cuda.is_available():
        yield None
        return
    pinned = []

    def pin_memory(self, device=None):
        pinned.append(self.shape)
        return self.clone()

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda i: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    yield pinned


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """Warmed caches, one per structure, shared by every case."""
    caches = {}

    def get(structure):
        if structure not in caches:
            ds = nbkit.CachedDataset(StructureSource(structure, N), tmp_path_factory.mktemp(structure))
            ds.warmup()
            caches[structure] = ds
        return caches[structure]

    return get


@pytest.fixture(scope="module")
def raw():
    """The raw source's batches per (structure, collate, workers, pin), each loaded once."""
    loaded = {}

    def get(structure, collate, workers, pin):
        if workers in ("spawn", "forkserver"):
            workers = "fork"
        key = structure, collate, workers, pin
        if key not in loaded:
            loaded[key] = _load(StructureSource(structure, N), collate, workers, pin)
        return loaded[key]

    return get


@pytest.mark.parametrize("structure, collate, workers, pin, cache", list(_cases()))
def test_cached_batches_equal_the_sources(structure, collate, workers, pin, cache, warm, raw, pinning, tmp_path):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'pin_memory' argument is set as true but no accelerator")
        want = raw(structure, collate, workers, pin)
        if cache == "warm":
            ds = warm(structure)
        else:
            ds = nbkit.CachedDataset(StructureSource(structure, N), tmp_path / "c")
        got = _load(ds, collate, workers, pin)
        if isinstance(want, Raised):
            # torch's default collate refuses PIL images, nbkit's stacks them: see the module doc
            assert collate == "default" and "pil" in structure and want.type is TypeError, want
            want = raw(structure, "nbkit", workers, pin)
    assert not isinstance(got, Raised), got
    assert not isinstance(want, Raised), want
    assert len(got) == len(want) == N // BATCH
    for k, (a, b) in enumerate(zip(got, want)):
        if collate == "samples":
            assert type(a) is list and type(b) is list and len(a) == len(b), f"batch {k}"
            for j, (x, y) in enumerate(zip(a, b)):
                assert_same(plain_sample(x), y, f"batch {k}[{j}]")
        else:
            assert_same(a, b, f"batch {k}")
    if cache == "cold":
        assert len(ds.missing()) == 0, "the cold epoch stored every sample (in the workers, if any)"
    if pinning is not None and collate != "samples" and structure not in ("string",):
        assert pinning, "the pin-memory walk ran"


def assert_same(a, b, where):
    """Equal batches: same types at every level, same structure, same values."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if is_pil(a):
        assert same_image(a, b), f"{where}: PIL images differ"
    elif isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ"
    elif isinstance(a, np.ndarray):
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and np.array_equal(a, b), f"{where}: arrays differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys differ"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for j, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{j}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"
