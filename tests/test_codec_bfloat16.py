"""numpy arrays of ml_dtypes.bfloat16 (nbkit/codec/bfloat16.py): the kind added in one file."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import nbkit
from nbkit.cachedir import verify
from nbkit.codec import decode_freeform, encode_freeform, infer_schema

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def same(a, b) -> bool:
    return isinstance(b, np.ndarray) and b.dtype == BF16 and a.shape == b.shape and np.array_equal(bits(a), bits(b))


class Source:
    """bfloat16 arrays, fixed-shape (``x``, a column) and varying (``v``, heap), with NaN, ±inf, -0."""

    def __init__(self, n: int = 12):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = (np.arange(6, dtype=np.float32).reshape(2, 3) * 0.1 + i).astype(BF16)
        x[0, 0] = [np.nan, np.inf, -np.inf, -0.0][i % 4]
        return {"x": x, "v": np.full(1 + i % 3, i / 3, dtype=BF16), "y": i}


def test_the_kind_round_trips_dtype_and_bits():
    a = Source()[1]["x"]
    back = decode_freeform(encode_freeform(a, allow_pickle=False), allow_pickle=False)
    assert same(a, back)
    schema = infer_schema([Source()[0], Source()[1]], allow_pickle=False)
    kinds = [(leaf.kind, leaf.store, leaf.dtype) for leaf in schema.leaves]
    assert kinds == [("bfloat16", "col", "bfloat16"), ("bfloat16", "var", "bfloat16"), ("int", "col", "<i8")]
    assert schema.column_dtype(schema.leaves[0]).str == "<i2"  # the bits, as a bfloat16 tensor's


def test_legacy_encoding_pickles_them_as_before():
    # source fingerprints hash the legacy encoding: caches that pickled bfloat16 arrays still match
    blob = encode_freeform(np.zeros(2, dtype=BF16), allow_pickle=True, legacy=True)
    assert b'"k":"pickle"' in blob


def test_cached_dataset_round_trip_reopened_without_source(tmp_path):
    src = Source()
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    assert ds.verify() == len(src)
    ds.close()
    reopened = nbkit.CachedDataset.open(tmp_path / "c")
    for i in range(len(src)):
        got = reopened[i]
        assert same(src[i]["x"], got["x"]) and same(src[i]["v"], got["v"]) and got["y"] == i
    assert verify(str(tmp_path / "c")) == len(src)
    reopened.close()


def test_nbkit_info_names_the_kind(tmp_path):
    ds = nbkit.CachedDataset(Source(), tmp_path / "c")
    ds.warmup()
    ds.close()
    out = subprocess.run([sys.executable, "-m", "nbkit", "info", str(tmp_path / "c")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(nbkit.__file__))})
    assert out.returncode == 0, out.stderr
    assert "bfloat16" in out.stdout and "ndarray[" in out.stdout, out.stdout


@pytest.mark.parametrize("collate_fn", [nbkit.collate, None])
def test_batches_are_bfloat16_tensors(tmp_path, collate_fn):
    src = Source(12)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    idx = [0, 3, 6, 9]  # v has 1 element in each
    batch = next(iter(DataLoader(ds, batch_size=4, sampler=idx, collate_fn=collate_fn)))
    x = batch["x"]
    assert x.dtype == torch.bfloat16 and x.shape == (4, 2, 3)
    want = np.stack([bits(src[i]["x"]) for i in idx])
    assert np.array_equal(x.view(torch.int16).numpy().view(np.uint16), want)
    assert batch["v"].dtype == torch.bfloat16 and batch["v"].shape == (4, 1)
    assert batch["y"].tolist() == idx
    ds.close()


def test_varying_shapes_batch_as_tensors_would(tmp_path):
    src = Source(6)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    batch = nbkit.collate(ds.__getitems__([0, 3]))  # v has 1 element in both
    assert batch["v"].dtype == torch.bfloat16 and batch["v"].shape == (2, 1)
    with pytest.raises(RuntimeError):
        nbkit.collate(ds.__getitems__([0, 1]))  # 1 and 2 elements: torch cannot stack them
    ds.close()


def run_without_ml_dtypes(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter where ``import ml_dtypes`` fails."""
    prelude = "import sys; sys.modules['ml_dtypes'] = None\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(nbkit.__file__)),
                                                                     os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=300)


def test_import_nbkit_does_not_import_ml_dtypes():
    out = subprocess.run([sys.executable, "-c", "import sys, nbkit, nbkit.codec, nbkit.collate; "
                          "print('ml_dtypes' in sys.modules)"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(nbkit.__file__))})
    assert out.stdout.strip() == "False", out.stderr


def test_without_ml_dtypes_the_rest_works_and_the_error_names_the_package(tmp_path):
    src = Source(4)
    ds = nbkit.CachedDataset(src, tmp_path / "bf16")
    ds.warmup()
    ds.close()
    out = run_without_ml_dtypes(f"""
        import torch, nbkit
        from torch.utils.data import TensorDataset, DataLoader
        ds = nbkit.CachedDataset(TensorDataset(torch.arange(6.0), torch.arange(6)), {str(tmp_path / "t")!r})
        ds.warmup()
        x, y = next(iter(DataLoader(ds, batch_size=3, collate_fn=nbkit.collate)))
        assert x.tolist() == [0.0, 1.0, 2.0] and ds.verify() == 6
        bf = nbkit.CachedDataset.open({str(tmp_path / "bf16")!r})
        assert bf.verify() == 4  # checking checksums needs no ml_dtypes
        try:
            bf[0]
        except ImportError as e:
            print("ERROR", e)
    """)
    assert out.returncode == 0, out.stderr
    assert "ERROR" in out.stdout and "pip install ml_dtypes" in out.stdout, out.stdout
