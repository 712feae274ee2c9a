"""The cache directory as untrusted input: nbkit.json checked once (nbkit.format.parse_meta), file names
from the fixed pattern only, index records bounded by the heap, and fuzzing of all three."""

import copy
import json
import os
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import nbkit
from nbkit import format as fmt
from nbkit.codec import Schema, flatten
from nbkit.errors import CorruptCacheError, MissingSampleError, StaleCacheError, UnsafeArchiveError
from sources import DictSource, IrregularSource, assert_equal

NBKIT_ERRORS = (CorruptCacheError, MissingSampleError, StaleCacheError, UnsafeArchiveError, FileNotFoundError)


def tensor_source(n=20):
    return TensorDataset(torch.arange(2 * n, dtype=torch.float32).reshape(n, 2), torch.arange(n))


def build(root, src):
    nbkit.CachedDataset(src, root).warmup()
    return root


def read_meta(root):
    return json.loads((root / "nbkit.json").read_text())


def write_meta(root, meta):
    (root / "nbkit.json").write_text(json.dumps(meta))


def listing(path):
    """Every file under ``path`` with its size and content hash (to see that nothing changed)."""
    out = {}
    for dirpath, _, files in os.walk(path):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, path)] = hash(fh.read())
    return out


# -- nbkit.json: every field checked, in one place -------------------------------------------------

def _set(meta, path, value):
    obj = meta
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


DAMAGE = [
    (("length",), "20", "length"),
    (("length",), -1, "length"),
    (("length",), 2**60, "length"),
    (("columns",), {"file": "col-0.bin"}, "columns"),
    (("columns",), [], "columns"),
    (("capacity",), -1, "capacity"),
    (("capacity",), 21, "capacity"),
    (("admit_seed",), -3, "admit_seed"),
    (("allow_pickle",), "no", "allow_pickle"),
    (("version",), "1", "version"),
    (("fingerprint",), [], "fingerprint"),
    (("fingerprint", "samples"), ["x"], "fingerprint.samples"),
    (("fingerprint", "samples"), {"x": "0" * 32}, "fingerprint.samples key"),
    (("generation",), "not-hex", "generation"),
    (("columns", 0, "file"), "/etc/passwd", "columns[0].file"),
    (("columns", 0, "file"), "../victim", "columns[0].file"),
    (("columns", 0, "file"), "x/../../y", "columns[0].file"),
    (("columns", 0, "file"), "col-1.bin", "columns[0].file"),
    (("columns", 0, "dtype"), "|O8", "columns[0].dtype"),
    (("columns", 0, "dtype"), "<i8", "columns[0].dtype"),
    (("columns", 0, "shape"), [3], "columns[0].shape"),
    (("columns", 0, "shape"), [2**40, 2**40], "columns[0].shape"),
    (("schema",), "garbage", "schema"),
    (("schema",), {"structure": "*"}, "schema.leaves"),
    (("schema", "leaves"), [{"kind": "int"}], "schema.leaves[0].store"),
    (("schema", "leaves", 0, "kind"), "object", "schema.leaves[0].kind"),
    (("schema", "leaves", 0, "store"), "const", "schema.leaves[0]"),
    (("schema", "leaves", 0, "shape"), [-1], "schema.leaves[0].shape"),
    (("schema", "leaves", 0, "shape"), [2**31] * 5, "schema.leaves[0].shape"),
    (("schema", "leaves", 0, "dtype"), "int1024", "schema.leaves[0].dtype"),
    (("schema", "leaves", 0, "column"), 3, "schema.leaves[0].column"),
    (("schema", "leaves", 1, "dtype"), "<f8", "schema.leaves[1]"),
    (("schema", "structure"), ["T", ["*"]], "schema.leaves"),
    (("schema", "structure"), ["T", "*"], "structure"),
    (("schema", "structure"), ["N", "os:path", ["*", "*"], ["a", "_b"]], "field names"),
    (("schema", "structure"), ["N", "os; import x:P", ["*", "*"]], "module:qualname"),
    (("schema", "structure"), ["D", ["a"], ["*", "*"]], "one child per key"),
    (("schema", "structure"), ["T", [["T", ["*"]]] * 3], "schema.leaves"),
]


@pytest.fixture(scope="module")
def tensor_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("tensor") / "c"
    return build(root, tensor_source())


@pytest.mark.parametrize("path,value,field", DAMAGE, ids=[f"{'.'.join(map(str, p))}={v!r}"[:60] for p, v, _ in DAMAGE])
def test_damaged_metadata_is_refused_naming_the_file_the_field_and_the_fix(tensor_cache, tmp_path, path, value, field):
    root = tmp_path / "c"
    shutil.copytree(tensor_cache, root)
    meta = read_meta(root)
    meta.setdefault("capacity", None)
    meta.setdefault("admit_seed", 0)
    _set(meta, path, value)
    write_meta(root, meta)
    with pytest.raises(CorruptCacheError) as info:
        nbkit.CachedDataset.open(root)[0]
    message = str(info.value)
    assert str(root / "nbkit.json") in message and field in message, message
    assert "Re-create" in message or "get it again" in message or "newer nbkit" in message, message


def test_deeply_nested_metadata_is_corrupt_not_a_recursion_error(tensor_cache, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(tensor_cache, root)
    meta = read_meta(root)
    text = json.dumps(meta).replace('"fingerprint": {', '"fingerprint": {"deep": ' + "[" * 100000 + "]" * 100000 + ", ")
    (root / "nbkit.json").write_text(text)
    with pytest.raises(CorruptCacheError, match="nbkit.json"):
        nbkit.CachedDataset.open(root)
    nested = ["T", ["*"]]
    for _ in range(200):
        nested = ["T", [nested]]
    meta["schema"]["structure"] = nested
    write_meta(root, meta)
    with pytest.raises(CorruptCacheError, match="nested more than"):
        nbkit.CachedDataset.open(root)


def test_metadata_a_newer_nbkit_adds_is_kept_and_generation_accepted(tensor_cache, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(tensor_cache, root)
    meta = read_meta(root)
    meta.update(generation="0123456789abcdef0123456789abcdef", later_field={"x": 1})
    write_meta(root, meta)
    ds = nbkit.CachedDataset.open(root)
    assert ds._meta["generation"] == "0123456789abcdef0123456789abcdef" and ds._meta["later_field"] == {"x": 1}
    assert_equal(ds[3], tensor_source()[3])


def test_a_newer_format_version_says_upgrade(tensor_cache, tmp_path):
    root = tmp_path / "c"
    shutil.copytree(tensor_cache, root)
    meta = read_meta(root)
    meta["version"] = 2
    write_meta(root, meta)
    with pytest.raises(CorruptCacheError, match=r"a newer nbkit \(the nbkit-cache distribution"):
        nbkit.CachedDataset.open(root)


# -- only the cache's own files ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["/ABS", "../victim", "x/../../victim"])
def test_a_column_file_name_from_data_never_touches_a_file_outside(tmp_path, name):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious" * 100)
    src = tensor_source()
    root = build(tmp_path / "cache" / "c", src)
    meta = read_meta(root)
    target = str(victim) if name == "/ABS" else name
    if name == "x/../../victim":
        (root / "x").mkdir()
    meta["columns"][0]["file"] = target
    write_meta(root, meta)
    outside = listing(tmp_path)
    del outside[os.path.relpath(root / "nbkit.json", tmp_path)]

    def unchanged():
        now = listing(tmp_path)
        assert victim.read_bytes() == b"precious" * 100
        return all(now.get(k) == v for k, v in outside.items() if not k.startswith("cache"))

    with pytest.raises(CorruptCacheError, match=r"columns\[0\]\.file"):
        nbkit.export_tar(root, tmp_path / "out.tar")
    assert not (tmp_path / "out.tar").exists() and unchanged()
    with pytest.raises(CorruptCacheError, match=r"columns\[0\]\.file"):
        nbkit.push(root, "memory://nbkit-tests/meta-outside")
    import fsspec

    assert not fsspec.filesystem("memory").exists("nbkit-tests/meta-outside/victim") and unchanged()
    with pytest.raises(CorruptCacheError, match=r"columns\[0\]\.file"):
        ds = nbkit.CachedDataset(src, root)  # a writable open
        ds.warmup()
    assert unchanged()
    ds = nbkit.CachedDataset(src, root, overwrite=True)  # deletes the cache's own files only
    ds.warmup()
    assert unchanged() and len(ds) == 20
    assert_equal(ds[5], src[5])


def test_cache_files_that_are_symbolic_links_are_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 24 * 20)
    src = tensor_source()
    root = build(tmp_path / "c", src)
    os.unlink(root / "index.bin")
    os.symlink(victim, root / "index.bin")
    with pytest.raises(UnsafeArchiveError, match="symbolic link"):
        nbkit.CachedDataset(src, root).warmup()
    with pytest.raises(UnsafeArchiveError, match="symbolic link"):
        nbkit.export_tar(root, tmp_path / "out.tar")
    assert victim.read_bytes() == b"\0" * 24 * 20
    # overwrite=True keeps a cache of this very source (damaged or not): starting over is nbkit.remove.
    nbkit.remove(root)  # removes the link, not its target
    nbkit.CachedDataset(src, root).warmup()
    assert victim.read_bytes() == b"\0" * 24 * 20 and not os.path.islink(root / "index.bin")


def test_remove_with_damaged_metadata_removes_only_cache_files(tmp_path):
    root = build(tmp_path / "c", tensor_source())
    (root / "notes.txt").write_text("mine")
    (root / "nbkit.json").write_text("{damaged")
    nbkit.CachedDataset(tensor_source(), root, overwrite=True)
    assert (root / "notes.txt").read_text() == "mine"


# -- index records: a damaged record is a damaged sample ---------------------------------------------

def _records(root):
    return np.memmap(root / "index.bin", dtype=fmt.RECORD, mode="r+")


@pytest.mark.parametrize("field,value", [("off", 2**64 - 1), ("len", 2**63), ("off", 2**40), ("len", 10**12),
                                         ("state", 7), ("flags", 0x40)])
def test_a_damaged_index_record_is_recomputed_or_reported_naming_the_index(tmp_path, field, value):
    src = DictSource(12)
    root = build(tmp_path / "c", src)
    rec = _records(root)
    rec[field][5] = value
    rec.flush()
    del rec
    with pytest.raises(CorruptCacheError, match=r"sample 5 .*index\.bin"):
        nbkit.CachedDataset.open(root)[5]
    with pytest.raises(CorruptCacheError, match=r"sample 5 .*index\.bin|indices 5"):
        nbkit.CachedDataset.open(root).__getitems__([4, 5, 6])
    with pytest.raises(CorruptCacheError, match="indices 5"):
        nbkit.CachedDataset.open(root).verify()
    ds = nbkit.CachedDataset(src, root)
    assert_equal(ds[5], src[5])
    assert ds.stats.recomputed == 1
    assert nbkit.CachedDataset.open(root).verify() == 12


def test_a_damaged_free_form_record_is_recomputed(tmp_path):
    src = IrregularSource(9)
    root = build(tmp_path / "c", src)
    rec = _records(root)
    rec["len"][4] = 2**63
    rec.flush()
    del rec
    with pytest.raises(CorruptCacheError, match=r"sample 4 .*index\.bin"):
        nbkit.CachedDataset.open(root)[4]
    ds = nbkit.CachedDataset(src, root)
    assert_equal(ds.__getitems__([3, 4, 5]), [src[3], src[4], src[5]])
    assert ds.stats.recomputed == 1


def test_read_blob_checks_the_heap_size_before_reading(tmp_path):
    from nbkit.cachedir import open_files

    root = build(tmp_path / "c", DictSource(6))
    files = open_files(root, writable=True)
    files.len[2] = os.path.getsize(root / "heap.bin") + 1
    with pytest.raises(CorruptCacheError, match=r"sample 2: its record in .*index\.bin points at .*heap\.bin"):
        files.read_blob(2)
    files.close()


# -- fuzzing ---------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st

FUZZ_SOURCE = DictSource(10)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
    | st.sampled_from(["", "col-0.bin", "col-1.bin", "../x", "/etc/passwd", "<f4", "|O8", "float32", "*", "T", "N",
                       "D", "os:system", "nbkit-cache", "0" * 32]) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=8,
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@pytest.fixture(scope="module")
def fuzz_cache(tmp_path_factory):
    return build(tmp_path_factory.mktemp("fuzz") / "template", FUZZ_SOURCE)


def same_content(got, want):
    """``got`` equals ``want``, or holds the same stored values under a structure the mutated metadata
    presents differently (metadata is not checksummed: a renamed dict key or a var tensor's dtype
    changes how the stored bytes are presented, never which bytes)."""
    try:
        assert_equal(got, want)
        return True
    except AssertionError:
        pass
    a, b = [], []
    flatten(got, a, named=False)
    flatten(want, b, named=False)
    raw = [x.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(x, torch.Tensor) and x.numel() else
           x.tobytes() if isinstance(x, (np.ndarray, np.generic)) else x for x in a]
    ref = [x.contiguous().view(torch.uint8).numpy().tobytes() if isinstance(x, torch.Tensor) and x.numel() else
           x.tobytes() if isinstance(x, (np.ndarray, np.generic)) else x for x in b]
    return len(raw) == len(ref) and all(type(x) is type(y) and (x == y) is True or x == y for x, y in zip(raw, ref))


def open_and_read_all(root, src=None):
    """Open the cache (with or without its source) and read every sample, one by one and as one batch,
    then verify; an nbkit error is an allowed outcome, and its message must name the cache."""
    ds = None
    try:
        ds = nbkit.CachedDataset(src, root) if src is not None else nbkit.CachedDataset.open(root)
        for i in range(len(ds)):
            assert same_content(ds[i], FUZZ_SOURCE[i]), i
        assert all(same_content(a, FUZZ_SOURCE[i]) for i, a in enumerate(ds.__getitems__(list(range(len(ds))))))
        ds.verify()
    except NBKIT_ERRORS as e:
        assert str(root) in str(e) or "nbkit.json" in str(e) or "sample" in str(e), e
        return e
    finally:
        if ds is not None and ds._files_obj is not None:
            ds._files_obj.close()  # thousands of examples in a long run: release the files now
    return None


def fuzz_copy(fuzz_cache, tmp_path_factory):
    base = tmp_path_factory.mktemp("case")
    root = base / "c"
    shutil.copytree(fuzz_cache, root)
    return base, root


@pytest.mark.fuzz
@given(data=st.data())
def test_fuzz_metadata_values(fuzz_cache, tmp_path_factory, data):
    base, root = fuzz_copy(fuzz_cache, tmp_path_factory)
    meta = read_meta(root)
    path = data.draw(st.sampled_from(list(_paths(meta))[1:]))
    mutated = copy.deepcopy(meta)
    if data.draw(st.booleans()) and isinstance(path[-1], str):
        parent = mutated
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
    else:
        _set(mutated, path, data.draw(json_values))
    write_meta(root, mutated)
    before = listing(base)
    with_source = data.draw(st.booleans())
    with _quiet():
        open_and_read_all(root, FUZZ_SOURCE if with_source else None)
    after = listing(base)
    if with_source:  # a writable open may fill or repair the cache's own files, nothing else
        assert {k for k in after if not k.startswith("c" + os.sep)} == set()
    else:
        assert after == before


class _quiet:
    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        return self._w.__exit__(*exc)


@pytest.mark.fuzz
@given(edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_metadata_bytes(fuzz_cache, tmp_path_factory, edits):
    base, root = fuzz_copy(fuzz_cache, tmp_path_factory)
    raw = bytearray((root / "nbkit.json").read_bytes())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    (root / "nbkit.json").write_bytes(bytes(raw))
    before = listing(base)
    with _quiet():
        open_and_read_all(root)
    assert listing(base) == before


@pytest.mark.fuzz
@given(file=st.sampled_from(["index.bin", "heap.bin"]), with_source=st.booleans(),
       edits=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), min_size=1, max_size=8))
def test_fuzz_index_and_heap_bytes(fuzz_cache, tmp_path_factory, file, with_source, edits):
    base, root = fuzz_copy(fuzz_cache, tmp_path_factory)
    raw = bytearray((root / file).read_bytes())
    for pos, byte in edits:
        raw[pos % len(raw)] = byte
    (root / file).write_bytes(bytes(raw))
    error = open_and_read_all(root, FUZZ_SOURCE if with_source else None)
    if with_source:
        assert error is None, error  # every damaged sample was recomputed from the source
    outside = {k for k in listing(base) if not k.startswith("c" + os.sep)}
    assert outside == set()


@pytest.mark.fuzz
@given(sample=st.integers(0, 9), field=st.sampled_from(["state", "flags", "off", "len"]),
       value=st.integers(0, 2**64 - 1) | st.sampled_from([0, 1, 2, 3, 2**63, 2**64 - 1]))
def test_fuzz_index_records(fuzz_cache, tmp_path_factory, sample, field, value):
    base, root = fuzz_copy(fuzz_cache, tmp_path_factory)
    rec = _records(root)
    bits = {"state": 8, "flags": 8}.get(field, 64)
    rec[field][sample] = value % (1 << bits)
    rec.flush()
    del rec
    open_and_read_all(root)
    assert open_and_read_all(root, FUZZ_SOURCE) is None


@pytest.mark.fuzz
@given(sample=st.integers(0, 9), sparse=st.sampled_from([1 << 30, 1 << 40]),
       off=st.integers(0, 2**41) | st.sampled_from([0, 1 << 20, 1 << 39]),
       length=st.integers(0, 2**41) | st.sampled_from([fmt.BLOB_PIECE + 1, 8 << 30, 1 << 39]))
def test_fuzz_index_records_in_a_sparse_heap(fuzz_cache, tmp_path_factory, sample, sparse, off, length):
    # A copied cache or a planted part: the heap is a sparse file as long as it claims, holding
    # nothing, so a record's claim passes every size check; it must never size a read or a buffer.
    base, root = fuzz_copy(fuzz_cache, tmp_path_factory)
    with open(root / "heap.bin", "r+b") as f:
        f.truncate(sparse)
    rec = _records(root)
    rec["off"][sample], rec["len"][sample] = off, length
    rec.flush()
    del rec
    open_and_read_all(root)
    assert open_and_read_all(root, FUZZ_SOURCE) is None


@pytest.mark.fuzz
@given(schema=json_values | st.fixed_dictionaries({"structure": json_values, "leaves": st.lists(
    st.fixed_dictionaries({"kind": st.sampled_from(["int", "tensor", "ndarray", "str", "pil", "none", "x"]),
                           "store": st.sampled_from(["col", "var", "const", "?"])},
                          optional={"dtype": st.sampled_from(["<i8", "float32", "|O8", "<U3", "(2,)i4", "S0", ""]),
                                    "shape": json_values, "column": st.integers(-2, 3), "mode": st.text(max_size=4)}),
    max_size=3)}))
def test_fuzz_schema_from_json(schema):
    try:
        Schema.from_json(schema, "nbkit.json")
    except CorruptCacheError as e:
        assert "nbkit.json" in str(e) or "cache metadata" in str(e), e


@pytest.mark.parametrize("threads", [1, 3])
def test_the_crc_of_rows_equals_the_crc_of_the_same_rows_stacked(threads):
    rng = np.random.default_rng(0)
    big = [rng.standard_normal((3, 40, 50)).astype(np.float32) for _ in range(7)]
    big[2] = np.asfortranarray(big[2])  # not C-contiguous: taken as its values
    small = rng.integers(0, 9, (7, 2))
    blobs = {1: b"abc", 6: b"x" * 100}
    rows = fmt.Rows(big)
    want = fmt.batch_crc([np.stack(big), small], 7, blobs, threads=threads)
    assert fmt.batch_crc([rows, small], 7, blobs, threads=threads).tolist() == want.tolist()
    assert [fmt.row_crc([np.ascontiguousarray(b), s], blobs.get(j, b"")) for j, (b, s) in enumerate(zip(big, small))] == want.tolist()
    keep = np.array([True, False, True, True, False, False, True])
    assert np.array_equal(np.asarray(rows[keep]), np.stack(big)[keep])
    assert np.array_equal(rows[3], big[3]) and np.array_equal(np.asarray(rows[1:3]), np.stack(big[1:3]))
