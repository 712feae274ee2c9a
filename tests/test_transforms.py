"""transform= and nbkit.fields: whole-sample transforms that fail on the sample's structure say so and
name the fix; per-field transforms work in the engine, in DataLoader workers and through ds.loader."""

import pickle
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import nbkit
from nbkit.transforms import describe_sample

datasets = pytest.importorskip("torchvision.datasets")
T = pytest.importorskip("torchvision.transforms")
Image = pytest.importorskip("PIL.Image")

Pair = namedtuple("Pair", ["image", "label"])


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """An ImageFolder root: 2 classes of 4 RGB 32×32 PNGs each."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for k in range(4):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / c / f"{k}.png")
    return root


def test_a_torchvision_transform_given_the_whole_sample_names_nbkit_the_structure_and_the_fix(tmp_path, image_folder):
    src = datasets.ImageFolder(image_folder, transform=T.PILToTensor())
    ds = nbkit.CachedDataset(src, tmp_path, transform=T.RandomCrop(24))
    with pytest.raises(TypeError) as err:
        ds[0]
    text = str(err.value)
    assert text.startswith("nbkit: transform=RandomCrop(size=(24, 24), padding=None) failed on a sample of ")
    assert "(TypeError: Unexpected type <class 'tuple'>)" in text  # torchvision's own words
    assert "receives the whole sample, here a tuple (Tensor[3, 32, 32] uint8, int)," in text
    assert "transform=nbkit.fields(RandomCrop(size=(24, 24), padding=None), None)" in text
    assert "Unexpected type" in str(err.value.__cause__)
    with pytest.raises(TypeError, match="receives the whole sample"):
        ds.__getitems__([1, 2])


def test_per_field_transform_in_the_engine_workers_and_the_device_loader(tmp_path, image_folder):
    src = datasets.ImageFolder(image_folder, transform=T.PILToTensor())
    crop = nbkit.fields(T.RandomCrop(24), None)
    assert repr(crop) == "nbkit.fields(RandomCrop(size=(24, 24), padding=None), None)"
    ds = nbkit.CachedDataset(src, tmp_path, transform=crop)
    x, y = ds[5]
    assert x.shape == (3, 24, 24) and x.dtype == torch.uint8 and y == src[5][1]
    # The cache holds the uncropped sample: the crop is augmentation, redrawn at every read.
    assert nbkit.CachedDataset.open(tmp_path)[5][0].shape == (3, 32, 32)
    crops = {tuple(ds[5][0].flatten()[:8].tolist()) for _ in range(8)}
    assert len(crops) > 1

    loader = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2, multiprocessing_context="fork")
    assert [tuple(x.shape) for x, y in loader] == [(4, 3, 24, 24)] * 2
    assert pickle.loads(pickle.dumps(crop)).positional[0].size == (24, 24)

    batches = list(ds.loader(4, shuffle=False))  # a transform sends the device loader through the engine
    assert [tuple(x.shape) for x, y in batches] == [(4, 3, 24, 24)] * 2
    assert torch.equal(torch.cat([y for _, y in batches]), torch.tensor(src.targets))


def test_fields_by_key_by_position_and_namedtuples():
    sample = {"image": torch.ones(2), "label": 3, "name": "a"}
    out = nbkit.fields(image=torch.neg)(sample)
    assert torch.equal(out["image"], -torch.ones(2)) and (out["label"], out["name"]) == (3, "a")
    assert nbkit.fields({"label": str})(sample)["label"] == "3" and sample["label"] == 3  # the sample is not modified
    out = nbkit.fields(None, lambda y: y * 10)(Pair(torch.zeros(1), 2))
    assert isinstance(out, Pair) and out.label == 20
    assert nbkit.fields(None, str)([1, 2]) == [1, "2"]
    assert repr(nbkit.fields(image=None)) == "nbkit.fields(image=None)"


def test_fields_mismatches_are_clear():
    with pytest.raises(TypeError, match=r"has 1 callables for a sample of 2 fields, "
                                        r"a tuple \(Tensor\[2\] float32, int\)"):
        nbkit.fields(torch.neg)((torch.ones(2), 1))
    with pytest.raises(TypeError, match=r"the sample has no field 'img'; "
                                        r"it is a dict \{'image': Tensor\[2\] float32\}"):
        nbkit.fields(img=torch.neg)({"image": torch.ones(2)})
    with pytest.raises(TypeError, match="names fields by key, but the sample is a tuple"):
        nbkit.fields(image=torch.neg)((torch.ones(2),))
    with pytest.raises(TypeError, match=r"the sample is Tensor\[2\] float32; "
                                        r"for a sample that is one value, pass transform=f"):
        nbkit.fields(torch.neg)(torch.ones(2))
    with pytest.raises(TypeError, match="must be callable or None, got int"):
        nbkit.fields(3, None)
    with pytest.raises(TypeError, match="needs one callable per field"):
        nbkit.fields()
    with pytest.raises(ValueError, match="bad label") as err:  # an error inside a field's callable says which field
        nbkit.fields(None, _bad_label)((torch.ones(2), 1))
    assert any("the nbkit.fields transform of field 1" in n and "on int" in n for n in err.value.__notes__)


def _bad_label(y):
    raise ValueError("bad label")


def test_errors_unrelated_to_the_structure_pass_unchanged(tmp_path):
    ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(4, 2)), tmp_path, transform=_bad_label)
    with pytest.raises(ValueError, match="^bad label$"):
        ds[0]


def test_describe_sample():
    assert describe_sample({"x": np.zeros((2, 3), np.int16), "y": [1, "a"]}) == \
        "a dict {'x': ndarray[2, 3] int16, 'y': list [int, str]}"
    assert describe_sample(Pair(torch.zeros(1), 1)) == "a Pair (Tensor[1] float32, int)"
    assert describe_sample(tuple(range(8))) == "a tuple (int, int, int, int, int, int, …)"
