"""Sample ⇄ bytes: schemas, conforming and free-form samples, and what decoding refuses."""

import numpy as np
import pytest
import torch

from nbkit.codec import decode_freeform, encode_freeform, infer_schema
from nbkit.errors import CorruptCacheError
from sources import DictSource, IrregularSource, VarShapeSource, assert_equal


def test_schema_makes_columns_of_fixed_fields_and_var_of_the_rest():
    src = DictSource(10)
    schema = infer_schema([src[0], src[5], src[9]], allow_pickle=False)
    stores = {leaf.kind: leaf.store for leaf in schema.leaves}
    assert stores["str"] == "var" and stores["bytes"] == "var" and stores["none"] == "const"
    assert stores["int"] == "col" and stores["tensor"] == "col"
    assert [leaf.column for leaf in schema.columns] == list(range(len(schema.columns)))


def test_varying_shapes_become_var_leaves():
    src = VarShapeSource()
    schema = infer_schema([src[0], src[1]], allow_pickle=False)
    assert [leaf.store for leaf in schema.leaves] == ["var", "col"]


def test_irregular_probes_mean_freeform():
    src = IrregularSource()
    assert infer_schema([src[0], src[1], src[2]], allow_pickle=False).structure is None


def test_split_rejects_samples_that_do_not_fit():
    src = DictSource(10)
    schema = infer_schema([src[0], src[1]], allow_pickle=False)
    assert schema.split(src[3], "s", False) is not None
    other = dict(src[3])
    other["x"] = other["x"].double()
    assert schema.split(other, "s", False) is None
    del other["x"]
    assert schema.split(other, "s", False) is None


@pytest.mark.parametrize("sample", [
    (torch.arange(3), {"a": 1.5, "b": [None, "é", b"\x00\xff"]}),
    torch.zeros(0, 4),
    {"x": np.float16(2.5), "y": np.array([[1, 2]], dtype=np.uint64), "z": 1 + 2j, "big": 2**70 - 1},
    torch.tensor([1.0, -2.0], dtype=torch.bfloat16),
    [],
    float("nan"),
])
def test_freeform_round_trip(sample):
    back = decode_freeform(encode_freeform(sample, allow_pickle=True), allow_pickle=True)
    if isinstance(sample, float):
        assert back != back
    else:
        assert_equal(back, sample)


def test_freeform_refuses_garbage_and_objects():
    with pytest.raises(CorruptCacheError):
        decode_freeform(b"garbage!", allow_pickle=False)
    blob = encode_freeform(np.array([1, 2]), allow_pickle=False)
    object_dtype = blob.replace(b'"d":"<i8"', b'"d":"|O8"')
    with pytest.raises(CorruptCacheError, match="refusing"):
        decode_freeform(object_dtype, allow_pickle=False)
    with pytest.raises(CorruptCacheError, match="truncated"):
        decode_freeform(blob[:-3], allow_pickle=False)


def test_non_string_dict_keys_are_refused_with_a_fix():
    with pytest.raises(TypeError, match="string keys"):
        encode_freeform({1: torch.zeros(1)}, allow_pickle=False)
