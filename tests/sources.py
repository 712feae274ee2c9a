"""Small picklable source datasets for the engine tests (importable by spawned workers)."""

import os
import time
from collections import namedtuple

import numpy as np
import torch

from nbkit.collate import plain_sample
from torch.utils.data import Dataset


def image(i, shape=(1, 8, 8)):
    g = torch.Generator().manual_seed(i)
    return torch.randn(shape, generator=g)


class TupleSource(Dataset):
    """(float tensor, int label): the MNIST shape of sample."""

    def __init__(self, n=100, shape=(1, 8, 8), transform=None):
        self.n, self.shape, self.transform = n, shape, transform

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return image(i, self.shape), i % 10


class DictSource(Dataset):
    """Every supported leaf kind, nested."""

    def __init__(self, n=50, with_none=True):
        self.n, self.with_none = n, with_none

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        sample = {
            "x": image(i, (3, 4)),
            "arr": np.arange(6, dtype=np.int16).reshape(2, 3) + i,
            "scalar": np.float32(i / 2),
            "label": i,
            "weight": i * 0.25,
            "flag": i % 2 == 0,
            "name": f"sample-{i}-é",
            "raw": bytes([i % 256]) * (i % 7),
            "none": None,
            "pair": [image(i, (2,)).to(torch.float64), (i, "x" * (i % 3))],
            "half": torch.full((2,), float(i), dtype=torch.bfloat16),
        }
        if not self.with_none:
            del sample["none"]
        return sample


class CollatableDictSource(DictSource):
    """DictSource without None (which default_collate refuses)."""

    def __init__(self, n=50):
        super().__init__(n, with_none=False)


class VarShapeSource(Dataset):
    """Tensors whose first dimension varies with the index (token sequences, boxes …)."""

    def __init__(self, n=40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.arange((i % 5 + 1) * 3, dtype=torch.float32).reshape(-1, 3) + i, i


class IrregularSource(Dataset):
    """Samples whose structure changes with the index: stored free-form."""

    def __init__(self, n=30):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % 3 == 0:
            return {"a": torch.tensor([i])}
        if i % 3 == 1:
            return (torch.ones(i), "text", [1, 2, i])
        return torch.tensor(float(i))


class BareTensorSource(Dataset):
    def __init__(self, n=20):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return image(i, (2, 3))


class RandomSource(Dataset):
    """A random augmentation inside the source: non-deterministic."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.rand(3)


class Opaque:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Opaque) and other.v == self.v


class PickleSource(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return torch.zeros(2), Opaque(i)


class CountingSource(TupleSource):
    """Logs every computed index to ``log_dir/<pid>.log`` (to count computations across processes)."""

    def __init__(self, n, log_dir, delay=0.0, shape=(1, 8, 8)):
        super().__init__(n, shape)
        self.log_dir, self.delay = log_dir, delay

    def __getitem__(self, i):
        if self.delay:
            time.sleep(self.delay)
        with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a") as f:
            f.write(f"{i}\n")
        return super().__getitem__(i)


def computed_counts(log_dir):
    counts = {}
    for name in os.listdir(log_dir):
        if name.endswith(".log"):
            with open(os.path.join(log_dir, name)) as f:
                for line in f:
                    counts[int(line)] = counts.get(int(line), 0) + 1
    return counts


def assert_equal(a, b, where="sample"):
    """Deep equality for samples: same types, same values, same tensor dtypes."""
    # a batch's samples are tuple/list/dict subclasses that default_collate recognises (nbkit.collate.TupleRow …)
    plain = type(plain_sample(a))
    if hasattr(type(b), "_fields"):  # a namedtuple comes back as itself
        assert plain is type(b), f"{where}: {type(a)} != {type(b)}"
    assert plain is type(b) or (isinstance(a, tuple) and isinstance(b, tuple)), f"{where}: {type(a)} != {type(b)}"
    if is_pil(a) or is_pil(b):
        assert is_pil(a) and is_pil(b) and same_image(a, b), f"{where}: PIL images differ"
        return
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: tensor values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b), f"{where}: arrays differ"
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}[{k}]")
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys differ"
        for k in a:
            assert_equal(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def is_pil(x):
    return type(x).__module__.startswith("PIL.")


def same_image(a, b):
    """Equal PIL images: mode, size, pixels and palette (``info`` is not cached)."""
    return (a.mode, a.size, a.tobytes(), a.getpalette()) == (b.mode, b.size, b.tobytes(), b.getpalette())


Point = namedtuple("Point", "image label")
Labeled = namedtuple("Labeled", ["image", "label", "name"])


class NamedSource(Dataset):
    """namedtuple samples; ``with_name`` adds a string field (a var leaf)."""

    def __init__(self, n=24, with_name=False):
        self.n, self.with_name = n, with_name

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.with_name:
            return Labeled(image(i, (2, 3)), i % 10, f"n{i}")
        return Point(image(i, (2, 3)), i % 10)


class LargeRowSource(TupleSource):
    """``(image 3x80x80 float32, label, name)``: a column of 76,800-byte rows (past
    ``nbkit.format.ROWS_MIN_BYTES``: stores that take them get them as ``Rows``, not stacked), every
    third image a non-contiguous view, a small column and a heap blob."""

    def __init__(self, n=24):
        super().__init__(n, (3, 80, 80))

    def __getitem__(self, i):
        x, label = super().__getitem__(i)
        if i % 3 == 0:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, strided
        return x, label, "n" * (i % 4)


class PilSource(Dataset):
    """(PIL image, label), as torchvision datasets give without ToTensor; ``sizes`` cycles image sizes."""

    def __init__(self, n=12, mode="RGB", sizes=((6, 5),)):
        self.n, self.mode, self.sizes = n, mode, sizes

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from PIL import Image

        w, h = self.sizes[i % len(self.sizes)]
        pixels = np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8)
        return Image.fromarray(pixels, "RGB").convert(self.mode), i % 3


class DtypeSource(Dataset):
    """Tensors of one dtype with random bit patterns; ``vary`` changes the shape per index."""

    def __init__(self, dtype, n=8, vary=False):
        self.dtype, self.n, self.vary = dtype, n, vary

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rows = 2 + (i % 3 if self.vary else 0)
        g = torch.Generator().manual_seed(i)
        nbytes = rows * 3 * self.dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        if self.dtype == torch.bool:
            raw = raw % 2
        return raw.view(self.dtype).reshape(rows, 3), i


def flip_byte(path, offset):
    """Damage one byte of a file (as a bad disk or a tampered copy would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def _pil(i, size=(6, 5)):
    from PIL import Image

    pixels = np.random.default_rng(i).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels, "RGB")


# One sample of each structure a source commonly returns (tests/test_batches.py runs them all).
STRUCTURES = {
    "tensor": lambda i: image(i, (2, 3)),  # unlabelled images, an autoencoder
    "ndarray": lambda i: np.arange(6, dtype=np.float32).reshape(2, 3) * i,
    "pil": lambda i: _pil(i),
    "pil_label": lambda i: (_pil(i), i % 3),
    "tuple": lambda i: (image(i, (2, 3)), i % 10),
    "list": lambda i: [image(i, (3,)), i * 0.5, np.full(2, i, dtype=np.int16)],
    "dict": lambda i: {"x": image(i, (2, 2)), "y": i % 4, "name": f"s{i}"},
    "namedtuple": lambda i: Point(image(i, (2, 3)), i % 10),
    "nested": lambda i: {"a": (image(i, (2,)), [i, {"b": np.full(3, i, dtype=np.int64)}]),
                         "t": (i * 0.25, i % 2 == 0), "s": f"n{i}"},
    "label": lambda i: i % 10,  # a bare scalar
    "string": lambda i: f"text-{i}",
}


class StructureSource(Dataset):
    """``n`` samples of one structure of :data:`STRUCTURES` (picklable by name, so spawn works)."""

    def __init__(self, structure, n=20):
        self.structure, self.n = structure, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return STRUCTURES[self.structure](i)

    def __repr__(self):
        return f"StructureSource({self.structure!r})"


def check_complete_and_equal(path, n):
    """The cache at ``path`` holds all ``n`` samples of ``TupleSource(n)``, whole and equal."""
    import nbkit

    ds = nbkit.CachedDataset.open(path)
    assert ds.is_complete, f"{len(ds.missing())} samples missing"
    assert ds.verify() == n
    src = TupleSource(n)
    batch = ds.__getitems__(list(range(n)))
    for i in range(n):
        assert_equal(batch[i], src[i], f"sample {i}")
