"""What non-torch readers get (docs/jax.md, "What comes out"): every codec kind, stored as a column
and as a var payload, read through ``GrainSource[i]``, ``GrainSource._getitems``, ``numpy_tree`` and
``JaxLoader``, comes out in its one numpy form: no PIL image, no torch tensor, no list of values."""

import fractions
import math

import ml_dtypes
import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")

import nbkit
from nbkit.codec.table import BY_NAME
from nbkit.jax import GrainSource, JaxLoader, numpy_tree
from nbkit.jax import feed
from nbkit.jax.trees import tensor_array
import codec_samples  # tests/codec_samples.py: one leaf of every kind

N = 6


def sample(i: int) -> dict:
    """codec_samples' conforming sample, its var-shaped leaves one shape per pair of samples (a batch of
    2 stacks), plus a numpy bfloat16 column."""
    s = codec_samples.conforming(i)
    j = i // 2
    s["sizes"] = codec_samples._image("L", 1 + j % 2, 2, i)
    s["arr"] = np.arange(j + 1, dtype="<f8")
    s["tvar"] = torch.arange(j + 2)
    s["tvarbf"] = torch.ones(j + 1, dtype=torch.bfloat16)
    s["nbf16"] = np.full(2, i / 4, dtype=ml_dtypes.bfloat16)
    return s


COLUMNS = ("t32", "tbf16", "tbool", "be", "u5", "npf", "npi", "int", "float", "bool", "complex", "none", "L", "RGB",
           "nbf16")


class Every:
    def __init__(self, keys=None):
        self.keys = keys

    def __len__(self):
        return N

    def __getitem__(self, i):
        s = sample(i)
        return s if self.keys is None else {k: s[k] for k in self.keys}


@pytest.fixture(scope="module")
def contract_caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    every = nbkit.CachedDataset(Every(), root / "every", allow_pickle=True)
    every.warmup()
    columns = nbkit.CachedDataset(Every(COLUMNS), root / "columns")
    columns.warmup()
    return {"every": every, "columns": columns}


def numpy_form(value):
    """The documented numpy form of a source leaf, written out here apart from nbkit's readers."""
    if isinstance(value, torch.Tensor):
        return tensor_array(value)
    if type(value).__module__.startswith("PIL."):
        return np.asarray(value)  # (H, W) or (H, W, C), the dtype of the mode: uint8 for L, P, RGB
    if isinstance(value, np.ndarray):
        return value.astype(value.dtype.newbyteorder("="))
    return value


def assert_same(got, want, where):
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, f"{where}: {type(got).__name__}, not a numpy array"
        assert (got.dtype, got.shape) == (want.dtype, want.shape) and got.dtype.isnative, where
        if want.dtype.kind == "V" or want.dtype == ml_dtypes.bfloat16:
            got, want = got.view(np.uint16), want.view(np.uint16)
        assert np.array_equal(got, want, equal_nan=want.dtype.kind in "fc"), where
    elif isinstance(want, np.generic):
        assert type(got) is type(want) and got == want, where
    elif isinstance(want, float) and math.isnan(want):
        assert type(got) is float and math.isnan(got), where
    else:
        assert type(got) is type(want) and got == want, f"{where}: {got!r} != {want!r}"


def check_sample(got: dict, want: dict, where: str):
    assert set(got) == set(want), where
    for key, value in want.items():
        if key == "seq":  # [Pair(tensor, int), (int, str)]: the containers kept, their leaves numpy
            pair, rest = got[key]
            assert type(pair) is codec_samples.Pair and type(rest) is tuple, where
            assert_same(pair.image, numpy_form(value[0].image), f"{where}.seq")
            assert (pair.label, rest) == (value[0].label, value[1])
            continue
        assert_same(got[key], numpy_form(value), f"{where}[{key!r}]")


def test_every_codec_kind_is_in_the_sources(contract_caches):
    kinds = {(leaf.kind, leaf.store) for leaf in contract_caches["every"].schema.leaves}
    assert {kind for kind, _ in kinds} == set(BY_NAME)
    assert {("pil", "col"), ("pil", "var"), ("tensor", "col"), ("tensor", "var"), ("ndarray", "col"),
            ("ndarray", "var")} <= kinds
    columns = contract_caches["columns"]
    assert columns.read_columns(np.arange(2)) is not None  # the numpy_rows path: rows of the columns
    assert {leaf.kind for leaf in columns.schema.leaves} >= {"pil", "tensor", "ndarray", "bfloat16", "npscalar"}


@pytest.mark.parametrize("name", ["every", "columns"])
def test_grain_source_and_numpy_tree_give_the_numpy_form(contract_caches, name):
    ds = contract_caches[name]
    source = GrainSource(ds)
    batch = source._getitems(list(range(N)))
    for i in range(N):
        want = Every(None if name == "every" else COLUMNS)[i]
        check_sample(source[i], want, f"GrainSource[{i}]")
        check_sample(batch[i], want, f"GrainSource._getitems[{i}]")
        check_sample(numpy_tree(ds[i]), want, f"numpy_tree(ds[{i}])")


def batch_form(samples: list, key: str):
    """The documented numpy form of a JaxLoader batch's field: the samples' numpy forms stacked;
    strings a numpy str_ array, bytes, None and pickled objects an object array."""
    values = [s[key] for s in samples]
    if all(isinstance(v, str) for v in values):
        return np.array(values, dtype=str)
    if all(isinstance(v, (bytes, type(None), fractions.Fraction)) for v in values):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    return np.stack([numpy_form(v) for v in values])


@pytest.mark.parametrize("name", ["every", "columns"])
def test_jax_loader_batches_stack_the_numpy_form(contract_caches, name, monkeypatch):
    ds = contract_caches[name]
    source = Every(None if name == "every" else COLUMNS)
    # The batches JaxLoader hands to jax.device_put, exactly:
    monkeypatch.setattr(feed, "place", lambda batch, sharding=None: batch)
    host = list(JaxLoader(ds, 2, shuffle=False))
    monkeypatch.undo()
    placed = list(JaxLoader(ds, 2, shuffle=False))
    for b, (batch, on_device) in enumerate(zip(host, placed)):
        samples = [source[i] for i in (2 * b, 2 * b + 1)]
        for key in samples[0]:
            got = batch[key]
            if key == "seq":
                (images, labels), (numbers, strings) = got
                assert_same(images, np.stack([numpy_form(s["seq"][0].image) for s in samples]), "seq")
                assert_same(strings, np.array(["x", "x"]), "seq strings")
                continue
            want = batch_form(samples, key)
            assert_same(got, want, f"batch {b}[{key!r}]")
            if want.dtype.kind in "USO":  # JAX holds no strings nor objects: they stay numpy on the host
                assert type(on_device[key]) is np.ndarray and on_device[key].dtype == want.dtype
            else:
                assert isinstance(on_device[key], jax.Array) and on_device[key].shape == want.shape, key
                assert on_device[key].dtype == jax.dtypes.canonicalize_dtype(want.dtype), key
