"""The on-disk format did not change when the codec became a table of kinds (issue 28).

``tests/data/codec_v1`` was written by the nbkit before the table (``codec_samples.make_fixture``):
a cache holding a leaf of every kind (columns, heap payloads, free-form samples), and the exact bytes
that codec wrote for each sample. Today's codec must write the same bytes and read that cache back.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

import nbkit
from nbkit.cachedir import verify
from codec_samples import FIXTURE, Source, conforming, golden

pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def expected():
    return json.loads((FIXTURE / "golden.json").read_text())


def test_same_bytes_as_before(expected):
    assert golden() == expected


def same(a, b) -> bool:
    """Deep equality for samples (tensors, arrays, images, NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bfloat16 else a, b.view(torch.uint8) if b.dtype == torch.bfloat16 else b)
    if isinstance(a, np.ndarray) or isinstance(a, np.generic):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if type(a).__module__.startswith("PIL"):
        return (a.mode, a.size, a.tobytes(), a.getpalette()) == (b.mode, b.size, b.tobytes(), b.getpalette())
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_cache_written_before_reads_the_same(tmp_path):
    path = tmp_path / "cache"
    shutil.copytree(FIXTURE / "cache", path)
    ds = nbkit.CachedDataset.open(path, allow_pickle=True)
    src = Source()
    assert len(ds) == len(src)
    for i in range(len(src)):
        assert same(ds[i], src[i]), i
    batch = ds.__getitems__([0, 4, 5]).samples()
    assert all(same(a, src[i]) for a, i in zip(batch, [0, 4, 5]))
    ds.close()
    assert verify(str(path)) == len(src)


def test_kinds_in_the_fixture_cover_the_table(expected):
    from nbkit.codec.table import KINDS

    written = {leaf["kind"] for leaf in expected["schema"]["leaves"]}
    assert written | {"bfloat16"} == {k.name for k in KINDS}
    assert conforming(0)["none"] is None
