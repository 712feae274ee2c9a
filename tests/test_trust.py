"""The trust boundary's building blocks (nbkit.trust): argument checks, cache file names, JSON specs."""

import math
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

from nbkit.errors import CorruptCacheError, UnsafeArchiveError
from nbkit.trust import (AnyJSON, Bool, Int, List, Map, Obj, Optional, Str, cache_file_path, check_bool, check_int,
                         check_json, check_path, check_size, check_url, is_cache_file)


@pytest.mark.parametrize("value, error, text", [
    (1.5, TypeError, r"num_workers must be an int >= 0, got 1.5 \(float\)"),
    ("2", TypeError, r"got '2' \(str\)"),
    (True, TypeError, r"got True \(bool\)"),
    (-1, ValueError, r"must be an int >= 0, got -1"),
])
def test_check_int_names_the_argument(value, error, text):
    with pytest.raises(error, match=text):
        check_int(value, "num_workers", min=0)


def test_check_int_takes_numpy_integers():
    assert check_int(np.int64(3), "n", min=0, max=3) == 3 and type(check_int(np.int64(3), "n")) is int


@pytest.mark.parametrize("value", [math.nan, math.inf, "1GB", 1.5, True, None])
def test_check_size_refuses_what_is_not_a_byte_count(value):
    with pytest.raises((TypeError, ValueError), match="max_bytes must be a number of bytes"):
        check_size(value, "max_bytes")


def test_check_size_and_bool():
    assert check_size(2e9, "max_bytes") == 2_000_000_000 and check_size(np.int32(5), "m") == 5
    with pytest.raises(ValueError, match=">= 0, got -1"):
        check_size(-1, "max_bytes")
    assert check_bool(np.bool_(True), "overwrite") is True
    with pytest.raises(TypeError, match=r"overwrite must be True or False, got 'yes' \(str\)"):
        check_bool("yes", "overwrite")


def test_check_path(tmp_path):
    assert check_path(tmp_path, "path") == str(tmp_path)
    with pytest.raises(TypeError, match=r"path must be a str path or URL, got bytes .*os.fsdecode"):
        check_path(b"/tmp/x", "path")
    with pytest.raises(ValueError, match="path is empty"):
        check_path("", "path")
    with pytest.raises(ValueError, match="NUL"):
        check_path("a\x00b", "path")


@pytest.mark.parametrize("url, fix", [("gs:/b/c", "gs://b/c"), ("s3:b/c", "s3://b/c"), ("gcs:///b", None)])
def test_check_url_typos(url, fix):
    if fix is None:
        assert check_url(url, "url") == url  # three slashes is fsspec's business
    else:
        with pytest.raises(ValueError, match=f"write '{fix}'"):
            check_url(url, "url")


def test_check_url_keeps_local_paths_and_windows_drives():
    for path in ("/tmp/x", "cache", "./gs:/x", "C:\\data\\cache", "c:/data"):
        assert check_url(path, "path") == path
    with pytest.raises(ValueError, match="unknown scheme 'nope://'"):
        check_url("nope://x", "url")


def test_cache_file_names():
    for ok in ("nbkit.json", "index.bin", "heap.bin", "manifest.json", "col-0.bin", "col-4095.bin"):
        assert is_cache_file(ok)
    for bad in ("col-01.bin", "col-4096.bin", "col--1.bin", "../index.bin", "/etc/passwd", "evil.py", "index.bin/",
                "col-1.bin\x00", "heap.lock", "", None, 3, "NBKIT.JSON", "col-1.bin\n"):
        assert not is_cache_file(bad), bad


def test_cache_file_path_refuses_links_out(tmp_path):
    (tmp_path / "outside").write_text("secret")
    root = tmp_path / "cache"
    root.mkdir()
    os.symlink(tmp_path / "outside", root / "index.bin")
    with pytest.raises(UnsafeArchiveError, match="symbolic link"):
        cache_file_path(str(root), "index.bin", "nbkit.json")
    with pytest.raises(CorruptCacheError, match="'../outside'"):
        cache_file_path(str(root), "../outside", "nbkit.json")
    assert cache_file_path(str(root), "heap.bin", "x") == str(root / "heap.bin")


SPEC = Obj({"n": Int(min=0, max=10), "name": Str(r"[a-z]+", max_len=8), "flag": Bool(),
            "items": List(Obj({"k": Optional(Int())}), max_len=3), "more": Map(AnyJSON())}, required=("n",))


def test_check_json_names_the_field():
    good = {"n": 3, "name": "ab", "flag": True, "items": [{"k": None}, {"k": 2}], "more": {"x": [1]}, "extra": 1}
    assert check_json(good, SPEC, "f.json", "fix") == good
    for bad, field in [({}, "'n'"), ({"n": "3"}, "'n'"), ({"n": 11}, "'n'"), ({"n": True}, "'n'"),
                       ({"n": 1, "name": "A"}, "'name'"), ({"n": 1, "items": [{"k": 1.5}]}, r"'items\[0\].k'"),
                       ({"n": 1, "items": [{}] * 4}, "'items'"), ({"n": 1, "more": []}, "'more'")]:
        with pytest.raises(CorruptCacheError, match=rf"f.json is damaged: the field {field} must be .* fix"):
            check_json(bad, SPEC, "f.json", "fix")
    with pytest.raises(CorruptCacheError, match="its content must be an object"):
        check_json([], SPEC, "f.json", "fix")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
                           max_leaves=20)


@pytest.mark.fuzz
@given(json_values)
def test_check_json_accepts_or_raises_corrupt_cache_error(value):
    try:
        out = check_json(value, SPEC, "f.json", "fix")
    except CorruptCacheError as e:
        assert str(e).startswith("f.json is damaged")
    else:
        assert isinstance(out["n"], int) and 0 <= out["n"] <= 10


def _var_cache(path):
    """A warmed cache with a column, a heap (variable-length strings) and metadata."""
    import torch
    import nbkit

    class Source(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.full((3,), float(i)), "x" * i

    ds = nbkit.CachedDataset(Source(), path)
    ds.warmup()
    return ds


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["nbkit.json", "index.bin", "col-0.bin", "heap.bin"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_cache_file_that_is_not_a_regular_file_is_refused_never_waited_on(tmp_path, name, kind):
    """A copied cache directory holding a named pipe under a cache file's name must not hang open,
    read, export or push (opening a fifo for reading blocks until a writer comes): it is refused."""
    import nbkit

    path = tmp_path / "c"
    _var_cache(path)
    os.unlink(path / name)
    os.mkfifo(path / name) if kind == "fifo" else os.mkdir(path / name)
    what = "a named pipe" if kind == "fifo" else "a directory"
    with pytest.raises(CorruptCacheError, match=f"{name} is {what}.*, not a regular file"):
        ds = nbkit.CachedDataset.open(path)
        [ds[i] for i in range(len(ds))]
    if name != "nbkit.json":
        with pytest.raises(CorruptCacheError, match=f"{name} is {what}"):
            nbkit.export_tar(path, tmp_path / "c.tar")
        with pytest.raises(CorruptCacheError, match=f"{name} is {what}"):
            nbkit.push(path, "memory://trust-fifo/c")
    assert not (tmp_path / "c.tar").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["nbkit-keys.json", "keys.bin", "values.bin"])
def test_a_cache_loader_file_that_is_a_fifo_is_refused(tmp_path, name):
    import nbkit

    loader = nbkit.CacheLoader(tmp_path / "kv")
    loader.get(1, lambda k: k * 2)
    loader.close()
    os.unlink(tmp_path / "kv" / name)
    os.mkfifo(tmp_path / "kv" / name)
    with pytest.raises(CorruptCacheError, match=f"{name} is a named pipe"):
        nbkit.CacheLoader(tmp_path / "kv").get(1)


def test_read_small_refuses_large_files(tmp_path):
    from nbkit.trust import read_small

    (tmp_path / "nbkit.json").write_bytes(b" " * 101)
    with pytest.raises(CorruptCacheError, match="larger than 100 bytes"):
        read_small(str(tmp_path / "nbkit.json"), limit=100)
    assert read_small(str(tmp_path / "nbkit.json"), limit=101) == b" " * 101


_VERSIONS = st.from_regex(r"[0-9]{1,2}\.[0-9]{1,2}(\.[0-9]{1,2})?", fullmatch=True)


@pytest.mark.fuzz
@given(st.lists(st.one_of(st.text(max_size=80), st.none(), st.integers()), max_size=6))
def test_requirement_specifier_takes_any_metadata_and_returns_a_plain_range_or_none(lines):
    from nbkit.trust import _specifiers, requirement_specifier

    out = requirement_specifier(lines, "torch")
    assert out is None or (isinstance(out, str) and _specifiers(out) == out.split(",") and ";" not in out and " " not in out)


@pytest.mark.fuzz
@given(_VERSIONS, _VERSIONS, st.sampled_from(["torch", "Torch", "torch "]), st.booleans())
def test_requirement_specifier_reads_a_range_whichever_order_it_is_written_in(low, high, name, upper_first):
    from nbkit.tpu.torchtpu import torch_range
    from nbkit.trust import requirement_specifier

    parts = [f"<={high}", f">={low}"] if upper_first else [f">={low}", f"<={high}"]
    spec = requirement_specifier(["numpy>=2", f"{name}{','.join(parts)}", "libtpu>=0.0.50"], "torch")
    assert spec == f">={low},<={high}"
    assert torch_range(spec) == f"torch {low} to {high}"
    assert requirement_specifier([f"torch{','.join(parts)}; python_version<'3.13'"], "torch") is None  # a marker: not read


@pytest.mark.fuzz
@given(st.lists(st.sampled_from(["==0", ">=1", "<", "!=", "~=", " ", ",", "0", ".", "*", "(", ")", "a", "-", "\n"]),
                max_size=200))
def test_requirement_specifier_is_linear_on_adversarial_lines(pieces):
    # The regex it replaced backtracked exponentially: "torch " + "==0 " * 24 + "!" took 5.6 s,
    # a 196-character line never returned. Every line within the 200-character limit takes microseconds.
    import time

    from nbkit.trust import MAX_REQUIREMENT_CHARS, requirement_specifier

    line = ("torch " + "".join(pieces))[:MAX_REQUIREMENT_CHARS]
    start = time.perf_counter()
    requirement_specifier([line, "torch " + "==0 " * 48 + "!", "torch" + ">=0" * 65 + ",x"], "torch")
    assert time.perf_counter() - start < 0.05


def test_requirement_specifier_refuses_what_the_regex_refused():
    from nbkit.trust import requirement_specifier

    assert requirement_specifier(["torch (>= 2.1 , < 3 ,)"], "torch") == ">=2.1,<3"
    assert requirement_specifier(["torch >=2.1 <3"], "torch") is None  # no comma: not a plain range
    assert requirement_specifier(["torch >=2.1,,<3"], "torch") is None
    assert requirement_specifier(["torch =2"], "torch") is None
    assert requirement_specifier(["torch"], "torch") is None
