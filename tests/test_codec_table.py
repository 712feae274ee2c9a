"""The table of kinds (nbkit/codec/table.py) is the codec's single dispatch point: a kind added to it,
and nowhere else, is stored, read, checked and batched everywhere."""

from __future__ import annotations

import fractions

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import nbkit
from nbkit.codec import Schema, decode_freeform, encode_freeform, infer_schema, table
from nbkit.codec.kind import Kind, Leaf


class FractionKind(Kind):
    """A test kind: a ``fractions.Fraction`` stored as its numerator and denominator (int64)."""

    name = "fraction"

    def claims(self, value) -> bool:
        return isinstance(value, fractions.Fraction)

    def dtype_shape(self, value) -> tuple:
        return "<i8", (2,)

    def to_array(self, value) -> np.ndarray:
        return np.array([value.numerator, value.denominator], dtype="<i8")

    def from_array(self, dtype_name: str, arr: np.ndarray):
        return fractions.Fraction(*arr.tolist())

    def column_values(self, leaf: Leaf, col: np.ndarray) -> list:
        return [self.from_array(leaf.dtype, row) for row in col]


class Source:
    def __len__(self):
        return 10

    def __getitem__(self, i):
        if not 0 <= i < 10:
            raise IndexError(i)
        return fractions.Fraction(i, 7), i


@pytest.fixture
def with_fraction(monkeypatch):
    kind = FractionKind()
    monkeypatch.setattr(table, "KINDS", (*table.KINDS[:-1], kind, table.KINDS[-1]))  # before pickle, the fallback
    monkeypatch.setitem(table.BY_NAME, kind.name, kind)
    return kind


def test_every_kind_has_a_distinct_name_and_pickle_comes_last():
    names = [k.name for k in table.KINDS]
    assert len(set(names)) == len(names) and names[-1] == "pickle"
    assert {"tensor", "ndarray", "npscalar", "int", "float", "bool", "complex", "str", "bytes", "none", "pil",
            "pickle", "bfloat16"} == set(names)


def test_without_the_kind_a_fraction_needs_pickle():
    with pytest.raises(TypeError, match="allow_pickle=True"):
        encode_freeform(fractions.Fraction(1, 3), allow_pickle=False)


def test_a_kind_added_to_the_table_is_stored_read_and_batched(with_fraction, tmp_path):
    f = fractions.Fraction(2, 3)
    assert decode_freeform(encode_freeform((f, 1), allow_pickle=False), allow_pickle=False) == (f, 1)
    schema = infer_schema([Source()[0], Source()[1]], allow_pickle=False)
    assert [(leaf.kind, leaf.store, leaf.shape) for leaf in schema.leaves] == [("fraction", "col", (2,)), ("int", "col", ())]
    assert Schema.from_json(schema.to_json()) == schema

    ds = nbkit.CachedDataset(Source(), tmp_path / "c")
    ds.warmup()
    assert ds.verify() == 10
    ds.close()
    ds = nbkit.CachedDataset.open(tmp_path / "c")
    assert [ds[i] for i in range(10)] == [Source()[i] for i in range(10)]
    x, y = next(iter(DataLoader(ds, batch_size=4, collate_fn=nbkit.collate)))
    want = [[f.numerator, f.denominator] for f, _ in (Source()[i] for i in range(4))]  # 0/7 is 0/1
    assert torch.equal(x, torch.tensor(want)) and y.tolist() == [0, 1, 2, 3]
    ds.close()


def test_an_unknown_kind_in_a_cache_is_refused():
    from nbkit.errors import CorruptCacheError

    with pytest.raises(CorruptCacheError, match="fraction"):
        Schema.from_json({"structure": "*", "leaves": [{"kind": "fraction", "store": "col", "dtype": "<i8", "shape": [2],
                                                         "column": 0}]})
