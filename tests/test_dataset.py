"""The engine: round trips, reopen without source, stale / non-deterministic / corrupt caches, pickle policy."""

import os
import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, default_collate

import nbkit
from nbkit.dataset import Opened
from sources import (BareTensorSource, flip_byte, CollatableDictSource, DictSource, DtypeSource, IrregularSource, NamedSource, PickleSource,
                     PilSource, TupleSource, VarShapeSource, assert_equal, Opaque)

SOURCES = [TupleSource, DictSource, VarShapeSource, IrregularSource, BareTensorSource]


@pytest.mark.parametrize("make", SOURCES, ids=lambda c: c.__name__)
def test_round_trip_equals_source(tmp_path, make):
    src = make()
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    first = [ds[i] for i in range(len(src))]  # misses: computed and stored
    assert ds.stats.misses == len(src) and ds.stats.hits == 0
    again = nbkit.CachedDataset.open(tmp_path / "c")
    for i in range(len(src)):
        assert_equal(first[i], src[i], f"miss path, sample {i}")
        assert_equal(again[i], src[i], f"reopened, sample {i}")
    batch = again.__getitems__(list(range(len(src)))[::-1])
    for j, i in enumerate(range(len(src) - 1, -1, -1)):
        assert_equal(batch[j], src[i], f"batched, sample {i}")


@pytest.mark.parametrize("make", [TupleSource, CollatableDictSource, BareTensorSource], ids=lambda c: c.__name__)
def test_nbkit_collate_matches_default_collate(tmp_path, make):
    src = make()
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    idx = [5, 1, 7, 3]
    fast = nbkit.collate(ds.__getitems__(idx))
    slow = default_collate(list(ds.__getitems__(idx)))
    reference = default_collate([src[i] for i in idx])
    assert_equal(fast, reference)
    assert_equal(slow, reference)


def test_fixed_shape_fields_are_columns(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(60), tmp_path)
    ds.warmup()
    names = sorted(os.listdir(tmp_path))
    assert names == ["col-0.bin", "col-1.bin", "heap.lock", "index.bin", "nbkit.json"]  # heap.lock: the cache's lock, no data
    assert os.path.getsize(tmp_path / "col-0.bin") == 60 * 8 * 8 * 4


def test_dataloader_epoch_with_both_collates(tmp_path):
    src = TupleSource(300)
    ds = nbkit.CachedDataset(src, tmp_path)
    for collate_fn in (nbkit.collate, None):
        seen = []
        for x, y in DataLoader(ds, batch_size=64, shuffle=True, collate_fn=collate_fn):
            assert x.shape[1:] == (1, 8, 8) and y.dtype == torch.int64
            seen.extend(y.tolist())
        assert len(seen) == 300
    assert ds.stats.misses == 300 and ds.stats.hits == 300


def test_transform_runs_after_the_cache(tmp_path):
    calls = []

    def flip(sample):
        calls.append(1)
        x, y = sample
        return -x, y

    ds = nbkit.CachedDataset(TupleSource(20), tmp_path, transform=flip)
    ds.warmup()
    x, y = ds[3]
    assert torch.equal(x, -TupleSource(20)[3][0])
    xs, ys = nbkit.collate(ds.__getitems__([1, 2]))
    assert torch.equal(xs[0], -TupleSource(20)[1][0])
    assert len(calls) == 3
    # The cache itself holds the untransformed sample.
    assert torch.equal(nbkit.CachedDataset.open(tmp_path)[3][0], TupleSource(20)[3][0])


def test_open_without_source(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(10), tmp_path)
    ds[0], ds[1]
    opened = nbkit.CachedDataset.open(tmp_path)
    seed_spelling = nbkit.CachedDataset(None, tmp_path)
    assert len(opened) == len(seed_spelling) == 10
    assert_equal(seed_spelling[1], TupleSource(10)[1])
    with pytest.raises(nbkit.MissingSampleError, match=r"sample 5 .*holds 2 of 10") as e:
        opened[5]
    assert isinstance(e.value, LookupError) and str(tmp_path) in str(e.value)
    with pytest.raises(nbkit.MissingSampleError):
        opened.__getitems__([0, 7])
    with pytest.raises(ValueError, match="without its source"):
        opened.warmup()


def test_missing_sample_is_caught_by_torch_xla_style_except_runtime_error(tmp_path):
    nbkit.CachedDataset(TupleSource(10), tmp_path)[0]
    opened = nbkit.CachedDataset(None, tmp_path)
    try:
        opened[3]
    except RuntimeError as e:  # what torch_xla's CachedDataset raised for a sample it never stored
        assert isinstance(e, nbkit.MissingSampleError) and isinstance(e, LookupError)
    else:
        pytest.fail("a missing sample must raise")


def test_torch_xla_options_are_accepted_with_a_future_warning(tmp_path):
    with pytest.warns(FutureWarning) as record:
        ds = nbkit.CachedDataset(TupleSource(10), tmp_path, max_files_per_folder=1000, compress=True)
    folders, compress = (str(w.message) for w in record)
    assert folders.startswith("CachedDataset(max_files_per_folder=1000) is an option of torch_xla's CachedDataset; "
                              "nbkit ignores it: nbkit writes no file per sample")
    assert folders.endswith("Remove max_files_per_folder= (it will raise TypeError in a future release).")
    assert compress.startswith("CachedDataset(compress=True)")
    assert "export_tar(path, 'cache.tar.zst', compression='zst')" in compress
    assert all(w.filename == __file__ for w in record if w.category is FutureWarning)  # points at the caller's line
    assert ds.warmup().computed == 10 and not any(p.is_dir() for p in tmp_path.iterdir())  # no folders
    with pytest.warns(FutureWarning, match="compress=False"):
        nbkit.CachedDataset(None, tmp_path, compress=False)
    with pytest.raises(TypeError, match="max_files_per_folders"):
        nbkit.CachedDataset(TupleSource(10), tmp_path, max_files_per_folders=10)


def test_open_missing_cache_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no nbkit cache .*CachedDataset\(source"):
        nbkit.CachedDataset.open(tmp_path / "nothing")


def test_indexing_rules(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(10), tmp_path)
    assert_equal(ds[-1], TupleSource(10)[9])
    assert_equal(ds[torch.tensor(2)], TupleSource(10)[2])
    assert len(ds[2:5]) == 3
    with pytest.raises(IndexError, match="out of range"):
        ds[10]


def test_overwrite_left_on_keeps_a_cache_of_the_same_source_complete_or_partial(tmp_path):
    """A form's overwrite box left ticked, run again: the cache is this source's work, kept every time."""
    src = TupleSource(10)
    first = nbkit.CachedDataset(src, tmp_path / "full", overwrite=True)
    assert first.opened is Opened.CREATED and first.replaced_reason == ""
    first.warmup()
    generation = nbkit.format.read_meta(tmp_path / "full")["generation"]
    for _ in range(2):
        again = nbkit.CachedDataset(src, tmp_path / "full", overwrite=True)
        assert again.opened is Opened.REOPENED and again.stats.complete and again.warmup().computed == 0
        assert nbkit.format.read_meta(tmp_path / "full")["generation"] == generation  # the same build
    partial = nbkit.CachedDataset(src, tmp_path / "part")
    partial[:4]
    kept = nbkit.CachedDataset(src, tmp_path / "part", overwrite=True)
    assert kept.opened is Opened.REOPENED and kept.stats.cached == 4
    assert kept.warmup().computed == 6
    assert first[3] is not None  # the first handle was never made stale


def test_overwrite_replaces_a_cache_whose_metadata_cannot_be_read(tmp_path):
    nbkit.CachedDataset(TupleSource(10), tmp_path).warmup()
    (tmp_path / "nbkit.json").write_text("{damaged")
    with pytest.raises(nbkit.CorruptCacheError):
        nbkit.CachedDataset(TupleSource(10), tmp_path)
    ds = nbkit.CachedDataset(TupleSource(10), tmp_path, overwrite=True)
    assert ds.opened is Opened.REPLACED and "could not be read" in ds.replaced_reason
    assert ds.warmup().computed == 10


def test_starting_a_matching_cache_over_is_nbkit_remove(tmp_path):
    src = TupleSource(10)
    with nbkit.CachedDataset(src, tmp_path / "c") as ds:
        ds.warmup()
    nbkit.remove(tmp_path / "c")
    fresh = nbkit.CachedDataset(src, tmp_path / "c", overwrite=True)
    assert fresh.opened is Opened.CREATED and fresh.stats.cached == 0
    assert nbkit.CachedDataset.open(tmp_path / "c").opened is Opened.REOPENED


def test_corrupt_sample_recomputed_with_source_and_refused_without(tmp_path):
    src = TupleSource(20)
    nbkit.CachedDataset(src, tmp_path).warmup()
    flip_byte(tmp_path / "col-0.bin", 7 * 8 * 8 * 4 + 5)  # a byte inside sample 7's image
    without = nbkit.CachedDataset.open(tmp_path)
    assert_equal(without[6], src[6])
    with pytest.raises(nbkit.CorruptCacheError, match=r"sample 7 .*checksum"):
        without[7]
    with pytest.raises(nbkit.CorruptCacheError):
        without.__getitems__([1, 7])
    with pytest.raises(nbkit.CorruptCacheError, match=r"1 sample\(s\).*indices 7"):
        without.verify()
    with_source = nbkit.CachedDataset(src, tmp_path)
    assert_equal(nbkit.collate(with_source.__getitems__([7, 8])), default_collate([src[7], src[8]]))
    assert with_source.stats.recomputed == 1
    assert (with_source.stats.hits, with_source.stats.misses) == (2, 0)  # a repair is not counted twice
    assert nbkit.CachedDataset.open(tmp_path).verify() == 20


def test_corrupt_heap_blob_detected(tmp_path):
    src = DictSource(10)
    nbkit.CachedDataset(src, tmp_path).warmup()
    flip_byte(tmp_path / "heap.bin", os.path.getsize(tmp_path / "heap.bin") - 3)
    with pytest.raises(nbkit.CorruptCacheError):
        nbkit.CachedDataset.open(tmp_path).verify()


def test_damaged_metadata_is_a_clear_error(tmp_path):
    nbkit.CachedDataset(TupleSource(5), tmp_path)
    (tmp_path / "nbkit.json").write_text("{not json")
    with pytest.raises(nbkit.CorruptCacheError, match="nbkit.json is not valid JSON"):
        nbkit.CachedDataset.open(tmp_path)


def test_truncated_column_file_is_a_clear_error(tmp_path):
    nbkit.CachedDataset(TupleSource(5), tmp_path).warmup()
    with open(tmp_path / "col-0.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(nbkit.CorruptCacheError, match="truncated"):
        nbkit.CachedDataset.open(tmp_path)[0]


def test_pickle_refused_by_default_and_opt_in_both_sides(tmp_path):
    with pytest.raises(TypeError, match="allow_pickle=True"):
        nbkit.CachedDataset(PickleSource(), tmp_path / "a")
    ds = nbkit.CachedDataset(PickleSource(), tmp_path / "b", allow_pickle=True)
    ds.warmup()
    assert ds[3][1] == Opaque(3)
    opened = nbkit.CachedDataset.open(tmp_path / "b")
    with pytest.raises(PermissionError, match="allow_pickle=True"):
        opened[3]
    assert nbkit.CachedDataset.open(tmp_path / "b", allow_pickle=True)[3][1] == Opaque(3)


def _pil_folder(root, sizes=((6, 5),), per_class=3):
    """An ImageFolder tree of small PNGs written with PIL."""
    from PIL import Image

    for c, name in enumerate(["cat", "dog"]):
        os.makedirs(root / name)
        for k in range(per_class):
            w, h = sizes[k % len(sizes)]
            pixels = np.random.default_rng(10 * c + k).integers(0, 256, (h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels, "RGB").save(root / name / f"{k}.png")
    return root


def test_imagefolder_as_is_round_trips_pil_images_on_the_column_path(tmp_path):
    from torchvision import datasets, transforms as T

    src = datasets.ImageFolder(_pil_folder(tmp_path / "images"))
    ds = nbkit.CachedDataset(src, tmp_path / "c")  # no ToTensor, no allow_pickle
    ds.warmup()
    assert sorted(os.listdir(tmp_path / "c")) == ["col-0.bin", "col-1.bin", "heap.lock", "index.bin", "nbkit.json"]  # no heap.bin
    opened = nbkit.CachedDataset.open(tmp_path / "c")
    for i in range(len(src)):
        assert_equal(opened[i], src[i], f"sample {i}")
    batch = opened.__getitems__([4, 0, 2])
    assert_equal(list(batch), [src[4], src[0], src[2]])
    reference = default_collate([(T.PILToTensor()(img), y) for img, y in (src[4], src[0], src[2])])
    for collated in (nbkit.collate(batch), default_collate(batch)):
        assert collated[0].dtype == torch.uint8 and collated[0].shape == (3, 3, 5, 6)
        assert_equal(collated, reference)
    x, y = next(iter(DataLoader(opened, batch_size=4)))
    assert x.shape == (4, 3, 5, 6) and y.tolist() == [0, 0, 0, 1]
    assert nbkit.CachedDataset(datasets.ImageFolder(tmp_path / "images"), tmp_path / "c").is_complete  # not stale


@pytest.mark.parametrize("sizes", [((6, 5), (4, 7), (5, 5)), ((6, 5), (4, 7))], ids=["var", "free-form"])
def test_pil_images_of_several_sizes_round_trip_and_refuse_to_stack(tmp_path, sizes):
    from torchvision import datasets

    # var: the probes (0, 3, 5) differ in size; free-form: they agree, and the other size does not fit
    src = datasets.ImageFolder(_pil_folder(tmp_path / "images", sizes=sizes))
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    opened = nbkit.CachedDataset.open(tmp_path / "c")
    for i in range(len(src)):
        assert_equal(opened[i], src[i], f"sample {i}")
    collates = [nbkit.collate] + ([default_collate] if len(sizes) == 3 else [])
    for fn in collates:
        with pytest.raises(TypeError, match=r"nbkit cannot stack the PIL images.*PILToTensor"):
            fn(opened.__getitems__([0, 1]))
        x, y = fn(opened.__getitems__([0, 3]))  # one size: stacked
        assert x.shape == (2, 3, 5, 6) and x.dtype == torch.uint8


@pytest.mark.parametrize("mode", ["L", "P", "RGBA", "1", "I;16", "F"])
def test_pil_modes_round_trip_through_the_cache(tmp_path, mode):
    src = PilSource(9, mode)
    nbkit.CachedDataset(src, tmp_path).warmup()
    opened = nbkit.CachedDataset.open(tmp_path)
    for i in range(len(src)):
        assert_equal(opened[i], src[i], f"sample {i}")
    assert_equal(list(opened.__getitems__([3, 1])), [src[3], src[1]])


def test_pil_and_namedtuple_sources_under_a_byte_budget_and_warmup_workers(tmp_path):
    from torchvision.transforms import PILToTensor

    for src in (PilSource(40, "RGB"), NamedSource(40)):
        full = nbkit.CachedDataset(src, tmp_path / f"w-{type(src).__name__}")
        assert full.warmup(num_workers=2).computed == 40
        row = sum(full.schema.row_bytes(leaf) for leaf in full.schema.columns)
        budget = nbkit.CachedDataset(src, tmp_path / f"b-{type(src).__name__}", max_bytes=40 * 24 + 20 * row)
        budget.warmup()
        assert 0 < budget.stats.cached < 40  # the rest are read from the source, laid into the same columns
        for ds in (full, budget):
            idx = list(range(0, 40, 3))
            want = [src[i] for i in idx]
            assert_equal(list(ds.__getitems__(idx)), want)
            if isinstance(src, PilSource):
                want = [(PILToTensor()(img), y) for img, y in want]
            assert_equal(nbkit.collate(ds.__getitems__(idx)), default_collate(want))


def test_mnist_without_totensor(tmp_path, mnist_root):
    from torchvision import datasets, transforms as T

    src = datasets.MNIST(mnist_root, download=False)
    ds = nbkit.CachedDataset(src, tmp_path)
    ds.warmup()
    opened = nbkit.CachedDataset.open(tmp_path)
    for i in (0, 777, 1999):
        assert_equal(opened[i], src[i], f"sample {i}")
    assert opened.schema.columns[0].mode == "L"
    x, y = nbkit.collate(opened.__getitems__([0, 1, 2]))
    assert torch.equal(x, torch.stack([T.PILToTensor()(src[i][0]) for i in range(3)]))
    xs, _ = next(iter(opened.loader(16, shuffle=False)))
    assert xs.dtype == torch.uint8 and xs.shape == (16, 1, 28, 28)
    assert torch.equal(xs[:3], x)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _every_dtype():
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return sorted((d for d in found if "qint" not in str(d) and "quint" not in str(d)), key=str)


REQUIRED_DTYPES = [torch.bool, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16,
                   torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64,
                   torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("vary", [False, True], ids=["column", "variable-shape"])
@pytest.mark.parametrize("dtype", _every_dtype(), ids=str)
def test_every_tensor_dtype_written_is_read_back(tmp_path, dtype, vary):
    src = DtypeSource(dtype, vary=vary)
    ds = nbkit.CachedDataset(src, tmp_path)
    ds.warmup()
    opened = nbkit.CachedDataset.open(tmp_path)
    for i in range(len(src)):
        for got in (opened[i][0], opened.__getitems__([i])[0][0]):
            assert got.dtype == dtype and got.shape == src[i][0].shape
            assert torch.equal(_bits(got), _bits(src[i][0])), f"sample {i}"
    if not vary:
        x, _ = nbkit.collate(opened.__getitems__([2, 0]))
        assert x.dtype == dtype and torch.equal(_bits(x), _bits(torch.stack([src[2][0], src[0][0]])))


def test_the_required_dtypes_are_all_covered():
    assert set(REQUIRED_DTYPES) <= set(_every_dtype())


def test_quantized_tensors_are_refused_at_construction(tmp_path):
    class Quantized(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), i

    with pytest.raises(TypeError, match=r"sample 0.*quantized tensor.*dequantize\(\)"):
        nbkit.CachedDataset(Quantized(), tmp_path)
    assert not os.path.exists(tmp_path / "nbkit.json")


@pytest.mark.parametrize("with_name", [False, True])
def test_namedtuples_keep_their_type(tmp_path, with_name):
    src = NamedSource(with_name=with_name)
    ds = nbkit.CachedDataset(src, tmp_path)
    first = ds[3]
    assert type(first) is type(src[3]) and torch.equal(first.image, src[3].image)
    ds.warmup()
    opened = nbkit.CachedDataset.open(tmp_path)
    assert_equal(opened[5], src[5])
    assert opened[5].label == 5
    batch = opened.__getitems__([5, 1, 7])
    assert_equal(list(batch), [src[5], src[1], src[7]])
    assert batch[0].label == 5 and isinstance(batch[0], type(src[5]))
    reference = default_collate([src[5], src[1], src[7]])
    assert type(reference) is type(src[5])
    assert_equal(nbkit.collate(batch), reference)
    assert_equal(default_collate(batch), reference)
    assert_equal(default_collate(list(batch)), reference)
    back = pickle.loads(pickle.dumps(batch[0]))  # a row pickles as the namedtuple itself
    assert type(back) is type(src[5])
    assert_equal(back, src[5])
    for kw in ({}, {"num_workers": 2}, {"collate_fn": nbkit.collate}):
        got = list(DataLoader(opened, batch_size=6, **kw))
        assert type(got[0]) is type(src[0]) and torch.equal(got[0].image, reference_images(src, range(6)))
    if not with_name:
        loaded = next(iter(opened.loader(6, shuffle=False)))
        assert type(loaded) is type(src[0]) and torch.equal(loaded.image, reference_images(src, range(6)))


def reference_images(src, idx):
    return torch.stack([src[i].image for i in idx])


def test_namedtuples_that_cannot_be_found_again_are_refused_at_construction(tmp_path):
    from collections import namedtuple

    Local = namedtuple("Local", "x y")

    class LocalSource(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return Local(torch.zeros(2), i)

    with pytest.raises(TypeError, match=r"sample.*namedtuple .*Local.*top level"):
        nbkit.CachedDataset(LocalSource(), tmp_path)


def test_namedtuple_whose_module_is_gone_names_it_on_read(tmp_path, monkeypatch):
    import sys

    (tmp_path / "gone_types.py").write_text("from collections import namedtuple\nPair = namedtuple('Pair', 'a b')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gone_types

    class PairSource(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return gone_types.Pair(torch.full((2,), i), i)

    nbkit.CachedDataset(PairSource(), tmp_path / "c").warmup()
    monkeypatch.delitem(sys.modules, "gone_types")  # still importable from sys.path: nbkit must not import it
    with pytest.warns(UserWarning, match=r"gone_types\.Pair.*not imported.*import gone_types"):
        got = nbkit.CachedDataset.open(tmp_path / "c")[1]
    assert "gone_types" not in sys.modules
    assert got._fields == ("a", "b") and got.b == 1 and torch.equal(got.a, torch.full((2,), 1))


def test_a_cache_written_before_namedtuples_were_kept_still_opens(tmp_path):
    import json

    src = NamedSource()
    nbkit.CachedDataset(src, tmp_path).warmup()
    meta = json.loads((tmp_path / "nbkit.json").read_text())
    meta["schema"]["structure"] = ["T", meta["schema"]["structure"][2]]  # what older nbkit wrote
    (tmp_path / "nbkit.json").write_text(json.dumps(meta))
    ds = nbkit.CachedDataset(src, tmp_path)  # same fingerprint: not stale
    assert ds.is_complete and type(ds[2]) is tuple
    assert_equal(ds[2], tuple(src[2]))


def test_torchvision_mnist_round_trip(tmp_path, mnist_root):
    from torchvision import datasets, transforms as T

    src = datasets.MNIST(mnist_root, download=False, transform=T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))]))
    ds = nbkit.CachedDataset(src, tmp_path)
    report = ds.warmup()
    assert report.computed == len(src) == 2000
    opened = nbkit.CachedDataset.open(tmp_path)
    for i in (0, 1234, 1999):
        assert_equal(opened[i], src[i])
    # Reopening with an equal source is not stale.
    src2 = datasets.MNIST(mnist_root, download=False, transform=T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))]))
    assert nbkit.CachedDataset(src2, tmp_path).is_complete
    with pytest.raises(nbkit.StaleCacheError, match="transform"):
        nbkit.CachedDataset(datasets.MNIST(mnist_root, download=False, transform=T.ToTensor()), tmp_path)


def test_opening_maps_files_without_reading_them(tmp_path):
    big = TupleSource(5000, shape=(64, 64))
    nbkit.CachedDataset(big, tmp_path).warmup(chunk_size=1000)
    ds = nbkit.CachedDataset.open(tmp_path)
    col = ds.store.columns[0]
    assert not col.flags.owndata  # a view of the mapped file, not a copy in RAM
    assert ds.stats.cached == 5000


def test_dataset_pickles_without_open_files(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(10), tmp_path)
    ds[0]
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._files_obj is None
    assert_equal(clone[0], ds[0])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_warmup_and_verify_take_a_plain_fsspec_callback(tmp_path, num_workers):
    import fsspec.callbacks

    ds = nbkit.CachedDataset(TupleSource(100), tmp_path)
    cb = fsspec.callbacks.Callback()
    assert ds.warmup(num_workers=num_workers, callback=cb, chunk_size=30).computed == 100
    assert (cb.size, cb.value) == (100, 100)
    cb = fsspec.callbacks.Callback()
    assert ds.verify(callback=cb) == 100 and cb.value == 100


# -- arguments are checked at the door, naming the argument -----------------------------------------

_BAD_ARGUMENTS = [
    # (call on a fresh source, a warmed dataset and a tmp path) -> (error type, text the message holds)
    ("path bytes", lambda src, ds, p: nbkit.CachedDataset(src, os.fsencode(p / "x")), TypeError, "path must be a str"),
    ("path int", lambda src, ds, p: nbkit.CachedDataset(src, 3), TypeError, "path must be a path or URL"),
    ("path empty", lambda src, ds, p: nbkit.CachedDataset(src, ""), ValueError, "path is empty"),
    ("url one slash", lambda src, ds, p: nbkit.CachedDataset(src, "gs:/bucket/c"), ValueError, "gs://bucket/c"),
    ("url unknown scheme", lambda src, ds, p: nbkit.CachedDataset(src, "gcs2://b/c"), ValueError, "unknown scheme"),
    ("open path bytes", lambda src, ds, p: nbkit.CachedDataset.open(b"/tmp/c"), TypeError, "path must be a str"),
    ("max_bytes nan", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", max_bytes=float("nan")), TypeError,
     "max_bytes must be a number of bytes"),
    ("max_bytes inf", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", max_bytes=float("inf")), TypeError,
     "max_bytes must be a number of bytes"),
    ("max_bytes str", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", max_bytes="1GB"), TypeError,
     "max_bytes must be a number of bytes"),
    ("max_bytes negative", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", max_bytes=-1), ValueError,
     "max_bytes must be a number of bytes >= 0"),
    ("fingerprint_samples", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", fingerprint_samples=2.5), TypeError,
     "fingerprint_samples must be an int"),
    ("overwrite", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", overwrite="yes"), TypeError,
     "overwrite must be True or False"),
    ("allow_pickle", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", allow_pickle=1), TypeError,
     "allow_pickle must be True or False"),
    ("transform", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", transform=3), TypeError, "transform must be callable"),
    ("overwrite without source", lambda src, ds, p: nbkit.CachedDataset(None, ds.path, overwrite=True), ValueError,
     "needs the source"),
    ("num_workers float", lambda src, ds, p: ds.warmup(num_workers=1.5), TypeError, "num_workers must be an int in [0, 256], got 1.5"),
    ("num_workers str", lambda src, ds, p: ds.warmup(num_workers="2"), TypeError, "num_workers must be an int in [0, 256], got '2'"),
    ("num_workers negative", lambda src, ds, p: ds.warmup(num_workers=-1), ValueError, "num_workers must be an int in [0, 256]"),
    ("chunk_size", lambda src, ds, p: ds.warmup(chunk_size=0), ValueError, "chunk_size must be an int in [1, 2**40]"),
    ("chunk_size float", lambda src, ds, p: ds.warmup(chunk_size=8.0), TypeError, "chunk_size must be an int"),
    ("shard shape", lambda src, ds, p: ds.warmup(shard=3), TypeError, "shard must be a (rank, world) pair"),
    ("shard rank", lambda src, ds, p: ds.warmup(shard=(2, 2)), ValueError, "0 <= rank < world"),
    ("shard float", lambda src, ds, p: ds.warmup(shard=(0.0, 2)), TypeError, "shard rank must be an int"),
    ("start method", lambda src, ds, p: ds.warmup(num_workers=1, multiprocessing_context="thread"), ValueError,
     "multiprocessing_context must be one of"),
    ("batch_size float", lambda src, ds, p: ds.loader(2.0), TypeError, "batch_size must be an int in [1, 2**40], got 2.0"),
    ("batch_size bool", lambda src, ds, p: ds.loader(True), TypeError, "batch_size must be an int"),
    ("prefetch", lambda src, ds, p: ds.loader(4, prefetch="3"), TypeError, "prefetch"),
    ("threads", lambda src, ds, p: ds.loader(4, threads=0), ValueError, "threads"),
    ("seed", lambda src, ds, p: ds.loader(4, seed=1.5), TypeError, "seed must be an int"),
    ("rank float", lambda src, ds, p: ds.loader(4, rank=0.0, world_size=2), TypeError, "rank must be an int"),
    ("world_size zero", lambda src, ds, p: ds.loader(4, rank=0, world_size=0), ValueError, "world_size must be an int in [1, 2**20]"),
    ("shuffle", lambda src, ds, p: ds.loader(4, shuffle="no"), TypeError, "shuffle must be True or False"),
    ("sampler rank", lambda src, ds, p: nbkit.samplers.EpochSampler(10, rank=2, world_size=2), ValueError,
     "rank must be an int in [0, 1], got 2"),
    ("sampler data", lambda src, ds, p: nbkit.samplers.EpochSampler(object()), TypeError, "needs a dataset"),
    ("sampler seed", lambda src, ds, p: nbkit.samplers.EpochSampler(10, seed="0"), TypeError, "seed must be an int"),
    # Issue 25: integers are bounded where they are checked, so one that passes works all the way.
    ("num_workers huge", lambda src, ds, p: ds.warmup(num_workers=10**6), ValueError,
     "num_workers must be an int in [0, 256], got 1000000: each is a process"),
    ("chunk_size huge", lambda src, ds, p: ds.warmup(chunk_size=2**64), ValueError, "chunk_size must be an int in [1, 2**40]"),
    ("shard world huge", lambda src, ds, p: ds.warmup(shard=(0, 2**64)), ValueError, "shard world must be an int in [1, 2**20]"),
    ("fingerprint_samples huge", lambda src, ds, p: nbkit.CachedDataset(src, p / "m", fingerprint_samples=10**12),
     ValueError, "fingerprint_samples must be an int in [0, 2**16]"),
    ("seed huge", lambda src, ds, p: ds.loader(4, seed=2**64), ValueError, "seed must be an int in [0, 2**62 - 1]"),
]


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    path = tmp_path_factory.mktemp("args") / "c"
    ds = nbkit.CachedDataset(TupleSource(12), path)
    ds.warmup()
    return ds


@pytest.mark.parametrize("call, error, text", [case[1:] for case in _BAD_ARGUMENTS], ids=[c[0] for c in _BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(tmp_path, warmed, call, error, text):
    with pytest.raises(error) as got:
        call(TupleSource(12), warmed, tmp_path)
    assert text in str(got.value)
    assert not (tmp_path / "m").exists()  # refused before anything was created


def test_a_path_like_and_a_numpy_int_still_work(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(12), tmp_path / "c", max_bytes=2e9, fingerprint_samples=np.int64(2))
    assert ds.warmup(num_workers=np.int32(0), chunk_size=np.int64(5)).computed == 12
    assert len(ds.loader(np.int64(4), seed=np.uint8(3))) == 3
