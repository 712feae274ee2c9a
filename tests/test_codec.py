"""Sample ⇄ bytes: schemas, conforming and free-form samples, and what decoding refuses."""

import hashlib
import json
import pickle
import struct

import numpy as np
import pytest
import torch

from nbkit.codec import Schema, batch_leaf_values, decode_freeform, encode_freeform, infer_schema, stack_pil, storage_dtype
from nbkit.errors import CorruptCacheError
from nbkit.fingerprint import sample_hash
from sources import DictSource, IrregularSource, Point, VarShapeSource, assert_equal, same_image


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


PIL_MODES = ["1", "L", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "HSV", "LA", "RGBX", "I", "I;16", "I;16B", "F"]


@pytest.mark.parametrize("mode", PIL_MODES)
def test_pil_images_round_trip_without_pickle(mode):
    Image = pytest.importorskip("PIL.Image")
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8), "RGB")
    img = rgb.convert(mode)
    back = decode_freeform(encode_freeform((img, 1), allow_pickle=False), allow_pickle=False)[0]
    assert same_image(back, img) and back == img
    schema = infer_schema([(img, 1), (img, 2)], allow_pickle=False)
    leaf = schema.leaves[0]
    if mode in ("P", "PA"):  # the palette is per image: var blob
        assert leaf.store == "var"
    else:
        assert (leaf.kind, leaf.store, leaf.mode, leaf.shape) == ("pil", "col", mode, np.asarray(img).shape)
    cols, blob = schema.split((img, 3), "s", False)
    if leaf.store == "var":
        assert same_image(schema.var_values(blob, "s", False)[0], img)
    else:
        assert blob == b"" and same_image(batch_leaf_values("pil", leaf.dtype, cols[0][None], mode)[0], img)


def test_pil_images_of_other_modes_or_sizes_leave_the_column():
    Image = pytest.importorskip("PIL.Image")
    small, big = Image.new("RGB", (4, 3)), Image.new("RGB", (5, 3))
    schema = infer_schema([(small, 0), (small, 1)], allow_pickle=False)
    assert schema.split((big, 0), "s", False) is None and schema.split((small.convert("L"), 0), "s", False) is None
    assert infer_schema([(small, 0), (big, 1)], allow_pickle=False).leaves[0].store == "var"
    with pytest.raises(TypeError, match="differ in size.*PILToTensor"):
        stack_pil([small, big])
    assert stack_pil([small, small]).shape == (2, 3, 3, 4)


def test_damaged_pil_blob_is_corrupt_not_a_crash():
    Image = pytest.importorskip("PIL.Image")
    blob = encode_freeform(Image.new("RGB", (4, 3)), allow_pickle=False)
    with pytest.raises(CorruptCacheError):
        decode_freeform(blob.replace(b'"m":"RGB"', b'"m":"XYZ"'), allow_pickle=False)
    with pytest.raises(CorruptCacheError, match="truncated"):
        decode_freeform(blob[:-5], allow_pickle=False)


def test_namedtuples_round_trip_by_name():
    sample = {"p": Point(torch.arange(2), 3), "t": (1, 2)}
    back = decode_freeform(encode_freeform(sample, allow_pickle=False), allow_pickle=False)
    assert type(back["p"]) is Point and type(back["t"]) is tuple
    assert_equal(back, sample)
    schema = infer_schema([Point(torch.zeros(2), 1)], allow_pickle=False)
    assert schema.structure == ("N", "sources:Point", ("*", "*"), ("image", "label"))
    assert Schema.from_json(schema.to_json()) == schema
    assert schema.split((torch.zeros(2), 1), "s", False) is None  # a plain tuple does not fit


def test_unknown_structure_says_it_may_come_from_a_newer_nbkit():
    blob = encode_freeform((1, 2), allow_pickle=False).replace(b'["T"', b'["Q"')
    with pytest.raises(CorruptCacheError, match="newer nbkit"):
        decode_freeform(blob, allow_pickle=False)


def test_fingerprints_hash_namedtuples_and_pil_as_before():
    # Caches built before nbkit kept these types hashed them as a tuple and (where allowed) a pickle.
    Image = pytest.importorskip("PIL.Image")
    img = Image.new("L", (3, 2), 7)
    assert sample_hash(Point(torch.ones(2), 1), False, "s") == sample_hash((torch.ones(2), 1), False, "s")
    data = pickle.dumps(img, protocol=pickle.HIGHEST_PROTOCOL)
    header = json.dumps({"s": ["T", ["*"]], "l": [{"k": "pickle", "n": len(data)}]}, separators=(",", ":")).encode()
    before = b"NBKF" + struct.pack("<I", len(header)) + header + data  # what nbkit wrote before it knew PIL
    assert sample_hash((img,), True, "s") == hashlib.sha256(before).hexdigest()[:32]
    assert b"pickle" not in encode_freeform((img,), allow_pickle=True)  # stored natively all the same


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e4m3fn, torch.bfloat16, torch.complex32],
                         ids=str)
def test_dtypes_numpy_lacks_travel_as_bits_and_come_back(dtype):
    t = torch.randint(0, 256, (4 * dtype.itemsize,), dtype=torch.uint8).view(dtype)
    back = decode_freeform(encode_freeform(t, allow_pickle=False), allow_pickle=False)
    assert back.dtype == dtype and torch.equal(back.view(torch.uint8), t.view(torch.uint8))
    assert storage_dtype("tensor", str(dtype).removeprefix("torch.")).itemsize == dtype.itemsize


def test_a_dtype_this_torch_lacks_is_named():
    with pytest.raises(CorruptCacheError, match="float99.*torch"):
        storage_dtype("tensor", "float99")


def test_the_table_of_tensor_storage_dtypes_agrees_with_torch():
    # Metadata is checked without importing torch (nbkit ls, info, verify) through this table: each
    # dtype torch has is stored as its numpy twin, or as its bit pattern in an integer of its size.
    from nbkit.codec.tensor import TENSOR_STORAGE as _TENSOR_STORAGE
    from nbkit.codec.tensor import torch_dtypes as _torch_dtypes
    from nbkit.codec.tensor import torch_storage_dtype as _torch_storage_dtype

    for name, dtype in _torch_dtypes().items():
        if name in _TENSOR_STORAGE:
            assert _TENSOR_STORAGE[name] == _torch_storage_dtype(dtype), name
    missing = set(_torch_dtypes()) - set(_TENSOR_STORAGE)
    assert not missing, f"add these (a newer torch's dtypes) to nbkit.codec.tensor.TENSOR_STORAGE: {sorted(missing)}"
    assert {"float32", "bfloat16", "float8_e4m3fn", "complex32", "bool"} <= set(_torch_dtypes())  # what the table is for


# -- no code from data: a namedtuple named by a cache is never imported ---------------------------------

def _named_blob(path, fields=None, n=2):
    header = {"s": ["N", path, ["*"] * n] + ([fields] if fields is not None else []),
              "l": [{"k": "int", "v": k} for k in range(n)]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    return b"NBKF" + struct.pack("<I", len(raw)) + raw


def test_reading_never_imports_the_module_a_cache_names(tmp_path, monkeypatch):
    import sys
    import warnings

    marker = tmp_path / "ran"
    (tmp_path / "nbkit_evil_mod.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nfrom collections import namedtuple\nP = namedtuple('P', 'a b')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match=r"nbkit_evil_mod\.P.*not imported.*import nbkit_evil_mod.*register_namedtuple"):
        back = decode_freeform(_named_blob("nbkit_evil_mod:P", ["a", "b"]), allow_pickle=False)
    assert not marker.exists() and "nbkit_evil_mod" not in sys.modules
    assert back == (0, 1) and back._fields == ("a", "b") and back.b == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per name
        assert decode_freeform(_named_blob("nbkit_evil_mod:P", ["a", "b"]), allow_pickle=False).a == 0
    # Any installed module, not only a planted one: never imported either.
    with pytest.warns(UserWarning):
        decode_freeform(_named_blob("antigravity:P"), allow_pickle=False)
    assert "antigravity" not in sys.modules


def test_a_module_getattr_hook_is_never_called(monkeypatch):
    import sys
    import types

    calls = []
    mod = types.ModuleType("nbkit_hooked_mod")
    mod.__getattr__ = lambda name: calls.append(name)
    monkeypatch.setitem(sys.modules, "nbkit_hooked_mod", mod)
    with pytest.warns(UserWarning, match="not a namedtuple"):
        back = decode_freeform(_named_blob("nbkit_hooked_mod:Missing.Deeper", ["x", "y"]), allow_pickle=False)
    assert calls == [] and back._fields == ("x", "y")


def test_the_class_comes_back_when_loaded_or_registered_and_equivalents_pickle():
    from collections import namedtuple

    import nbkit
    from sources import Point

    assert type(decode_freeform(_named_blob("sources:Point", ["image", "label"]), allow_pickle=False)) is Point
    # a loaded class of other fields is not taken for it
    with pytest.warns(UserWarning, match="not a namedtuple with the fields"):
        other = decode_freeform(_named_blob("sources:Point", ["x", "y"]), allow_pickle=False)
    assert type(other) is not Point and other._fields == ("x", "y")
    assert pickle.loads(pickle.dumps(other)) == other and type(pickle.loads(pickle.dumps(other))) is type(other)

    Local = namedtuple("Local", "u v")
    nbkit.register_namedtuple(Local, "nbkit_tests.somewhere:Local")
    back = decode_freeform(encode_freeform(Local(1, 2), allow_pickle=False), allow_pickle=False)
    assert type(back) is Local and back == (1, 2)
    with pytest.raises(TypeError, match="namedtuple class"):
        nbkit.register_namedtuple(tuple)


def test_caches_written_before_field_names_were_stored_still_read():
    import warnings

    from sources import Point

    assert type(decode_freeform(_named_blob("sources:Point"), allow_pickle=False)) is Point  # by its number of fields
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back = decode_freeform(_named_blob("nbkit_not_loaded_mod:Old", n=3), allow_pickle=False)
    assert back._fields == ("f0", "f1", "f2") and tuple(back) == (0, 1, 2)


@pytest.mark.parametrize("fields", [["a", "_b"], ["a", "a"], ["a", "class"], ["a"], ["a", "b c"], ["a", 3], ["a", "x" * 600]])
def test_malformed_field_names_are_corrupt(fields):
    with pytest.raises(CorruptCacheError, match="field names"):
        decode_freeform(_named_blob("m:P", fields), allow_pickle=False)


@pytest.mark.parametrize("path", ["os", "os:", ":P", "os:path.join()", "a b:P", "m:P" + "x" * 600, 7])
def test_malformed_namedtuple_names_are_corrupt(path):
    with pytest.raises(CorruptCacheError, match="module:qualname"):
        decode_freeform(_named_blob(path), allow_pickle=False)


def test_a_pickle_leaf_is_never_unpickled_without_allow_pickle(monkeypatch):
    from sources import Opaque

    blob = encode_freeform({"o": Opaque(3)}, allow_pickle=True)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled"))
    with pytest.raises(PermissionError, match="allow_pickle=True"):
        decode_freeform(blob, allow_pickle=False)


@pytest.mark.parametrize("header", [
    {"s": "*", "l": []}, {"s": ["T", ["*", "*"]], "l": [{"k": "int", "v": 1}]}, {"s": "*", "l": [{"k": "int", "v": "1"}]},
    {"s": "*", "l": [{"k": "int", "v": True}]}, {"s": "*", "l": [{"k": "float", "v": "x"}]},
    {"s": "*", "l": [{"k": "complex", "v": [1]}]}, {"s": "*", "l": [{"k": "none", "v": 1}]},
    {"s": "*", "l": [{"k": "str", "n": -1}]}, {"s": "*", "l": [{"k": "str", "n": 2**70}]},
    {"s": "*", "l": [{"k": "ndarray", "d": "<i8", "s": [2**32, 2**32], "n": 0}]},
    {"s": "*", "l": [{"k": "ndarray", "d": "<i8", "s": [-1], "n": 0}]},
    {"s": "*", "l": [{"k": "ndarray", "d": "(2,)i4", "s": [1], "n": 8}]},
    {"s": "*", "l": [{"k": "npscalar", "d": "<i8", "s": [1], "n": 8}]},
    {"s": "*", "l": [7]}, {"s": "*", "l": {}}, [], {"s": ["D", ["a", "a"], ["*", "*"]], "l": [{"k": "none", "v": None}] * 2},
])
def test_malformed_free_form_headers_are_corrupt(header):
    raw = json.dumps(header).encode()
    with pytest.raises(CorruptCacheError):
        decode_freeform(b"NBKF" + struct.pack("<I", len(raw)) + raw + b"\0" * 16, allow_pickle=False)


def test_var_blob_shapes_cannot_overflow():
    from sources import VarShapeSource

    src = VarShapeSource()
    schema = infer_schema([src[0], src[1]], allow_pickle=False)
    _, blob = schema.split(src[0], "s", False)
    header = struct.pack("<IQ", 1, 4 + 16)
    for ndim, dims in ((2, (2**32, 2**32)), (2**31, ()), (1, (-4,))):
        body = struct.pack(f"<I{len(dims)}q", ndim, *dims)
        with pytest.raises(CorruptCacheError):
            schema.var_values(struct.pack("<IQ", 1, len(body)) + body, "s", False)
    assert header  # the intact blob decodes
    assert len(schema.var_values(blob, "s", False)) == 1


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st

FUZZ_SAMPLES = [
    {"a": torch.arange(6).reshape(2, 3), "s": "text", "b": b"\x00\x01", "n": None, "f": 1.5, "c": 1 + 2j, "t": True},
    (np.arange(4, dtype=np.float32), [1, 2, ("x", np.int16(3))]),
    Point(torch.zeros(2, dtype=torch.bfloat16), 7),
]


@pytest.mark.fuzz
@given(which=st.integers(0, len(FUZZ_SAMPLES) - 1),
       edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.none() | st.integers(min_value=0))
def test_fuzz_free_form_blobs(which, edits, cut):
    import warnings

    blob = bytearray(encode_freeform(FUZZ_SAMPLES[which], allow_pickle=False))
    for pos, byte in edits:
        blob[pos % len(blob)] = byte
    if cut is not None:
        del blob[cut % len(blob):]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            decode_freeform(bytes(blob), allow_pickle=False, where="sample 3 of /c")
        except CorruptCacheError as e:
            assert "sample 3 of /c" in str(e) or "cache metadata" in str(e), e
        except PermissionError as e:  # a leaf turned into "pickle": refused, never unpickled
            assert "allow_pickle=True" in str(e)


@pytest.mark.fuzz
@given(structure=st.recursive(
    st.sampled_from(["*", "T", "N", 0, None]),
    lambda c: st.lists(c, max_size=4) | st.tuples(st.sampled_from(["T", "L", "D", "N"]), st.lists(c, max_size=3)).map(list)
    | st.tuples(st.just("N"), st.sampled_from(["m:P", "os:path", "x"]), st.lists(c, max_size=3), st.lists(
        st.sampled_from(["a", "b", "_c", "if"]), max_size=3)).map(list), max_leaves=12))
def test_fuzz_structures(structure):
    from nbkit.cli import describe_structure
    from nbkit.codec import structure_from_json

    try:
        parsed = structure_from_json(structure, "nbkit.json")
    except CorruptCacheError as e:
        assert "nbkit.json" in str(e), e
        return
    # What parses is what `nbkit info` shows: every leaf once, in order, whatever the nesting.
    n = json.dumps(structure).count('"*"')
    leaves = [{"kind": "int", "store": "col", "dtype": "<i8", "shape": [], "column": i} for i in range(n)]
    try:
        schema = Schema.from_json({"structure": structure, "leaves": leaves})
    except CorruptCacheError:
        return  # a structure the schema refuses (e.g. its leaf count)
    assert schema.structure == parsed
    assert describe_structure(schema.structure, schema.leaves).count("int") == n


@pytest.mark.fuzz
@given(edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.none() | st.integers(min_value=0), which=st.integers(0, 9))
def test_fuzz_var_blobs(edits, cut, which):
    from sources import DictSource, VarShapeSource

    src = DictSource(10) if which % 2 else VarShapeSource(10)
    schema = infer_schema([src[0], src[1], src[2]], allow_pickle=False)
    blob = bytearray(schema.split(src[which], "s", False)[1])
    for pos, byte in edits:
        blob[pos % len(blob)] = byte
    if cut is not None:
        del blob[cut % len(blob):]
    try:
        schema.var_values(bytes(blob), "sample 4 of /c", False)
    except CorruptCacheError as e:
        assert "sample 4 of /c" in str(e), e


def _odd_tensors():
    """Tensors that are not plain contiguous CPU tensors, each with its plain twin."""
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    z = torch.complex(torch.arange(6.0).reshape(2, 3), torch.ones(2, 3))
    return {
        "requires_grad": (base.clone().requires_grad_(True), base),
        "transposed": (base.t(), base.t().contiguous()),
        "offset_view": (torch.arange(20.0)[8:20].reshape(3, 4), torch.arange(8.0, 20.0).reshape(3, 4)),
        "conj_bit": (z.conj(), z.conj().resolve_conj()),
        "neg_bit": (z.conj().imag, z.conj().imag.resolve_neg()),
    }


@pytest.mark.parametrize("name", list(_odd_tensors()))
def test_a_column_takes_tensors_numpy_cannot_view_as_they_are(name):
    odd, plain = _odd_tensors()[name]
    schema = infer_schema([(plain, 0)], allow_pickle=False)
    cols, blob = schema.split((odd, 1), "s", False)
    assert blob == b"" and cols[0].flags["C_CONTIGUOUS"]
    assert np.array_equal(cols[0], plain.detach().numpy()) and cols[0].dtype == plain.detach().numpy().dtype
    stacked = schema.stack(0, [cols[0], schema.split((plain, 1), "s", False)[0][0]])
    assert np.array_equal(stacked[0], stacked[1])


def test_a_sparse_tensor_in_a_column_is_refused_with_the_fix():
    schema = infer_schema([(torch.zeros(2, 2), 0)], allow_pickle=False)
    with pytest.raises(TypeError, match="to_dense"):
        schema.split((torch.eye(2).to_sparse(), 1), "s", False)
