"""The benchmark workloads, built offline under a data directory and reused when present.

* ``mnist``: MNIST-format IDX files (60,000 × 28×28, written by :func:`nbkit.offline.write_mnist`)
  loaded by torchvision's ``MNIST(root, download=False)`` with ``ToTensor()`` and
  ``Normalize((0.1307,), (0.3081,))`` — the light workload, where per-sample overhead dominates.
* ``jpeg``: 4,000 JPEGs of 320×320 px in an ``ImageFolder`` tree of 10 classes, loaded with
  ``Resize(256)``, ``CenterCrop(224)``, ``ToTensor()`` and ImageNet ``Normalize`` — the heavy
  workload, where decoding dominates and samples are large (602 KB each once decoded).

The images are not noise: each class has its own palette and shapes, drawn over a gradient,
so JPEG compresses them like photographs rather than like static.

Example:
    >>> import tempfile
    >>> from workloads import build, source
    >>> root = tempfile.mkdtemp()
    >>> spec = build("mnist", root, quick=True)
    >>> ds = source(spec)
    >>> tuple(ds[0][0].shape), spec.n
    ((1, 28, 28), 2048)
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The benchmarks run from a checkout: nbkit need not be installed, and the server fixtures in tests/
# (GCS emulator, redis-server) are importable by every benchmark that imports this module first.
for _p in (str(ROOT), str(ROOT / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["DEFAULT_DATA_DIR", "WORKLOADS", "Workload", "build", "describe", "source"]

DEFAULT_DATA_DIR = ROOT / "bench-data"
WORKLOADS = ("mnist", "jpeg")

# (full, quick) sizes. Quick sizes keep at least one full batch of 256.
_SIZES = {"mnist": (60000, 2048), "jpeg": (4000, 320)}
_JPEG_PX = 320
_JPEG_CLASSES = 10
_MARKER = "workload.json"


@dataclass(frozen=True)
class Workload:
    """A built workload: what :func:`source` needs to construct the dataset.

    Attributes:
        name: ``"mnist"`` or ``"jpeg"``.
        root: the directory holding the files.
        n: number of samples in the source dataset.
    """

    name: str
    root: str
    n: int


def build(name: str, data_dir=DEFAULT_DATA_DIR, *, quick: bool = False, seed: int = 0, n: int | None = None) -> Workload:
    """Write the files of workload ``name`` under ``data_dir`` unless an identical build is there.

    Args:
        name: ``"mnist"`` or ``"jpeg"``.
        data_dir: the parent directory; each workload gets ``<data_dir>/<name>[-quick]``.
        quick: small sizes, for smoke tests.
        seed: the files are a pure function of ``(name, quick, seed, n)``.
        n: another number of samples than the workload's own size.

    Returns:
        The :class:`Workload` to pass to :func:`source`.
    """
    if name not in _SIZES:
        raise ValueError(f"unknown workload {name!r}; choose one of {list(_SIZES)}")
    size = _SIZES[name][1 if quick else 0]
    n = size if n is None else int(n)
    root = Path(data_dir) / ((f"{name}-quick" if quick else name) + ("" if n == size else f"-{n}"))
    params = {"name": name, "n": n, "seed": seed, "version": 1}
    marker = root / _MARKER
    if marker.exists() and json.loads(marker.read_text()) == params:
        return Workload(name, str(root), n)
    root.mkdir(parents=True, exist_ok=True)
    if name == "mnist":
        from nbkit.offline import write_mnist

        write_mnist(root, n_train=n, n_test=min(n, 10000) // 6, seed=seed)
    else:
        _write_jpegs(root / "images", n, seed)
    # The marker goes last: an interrupted build is redone, never reused half-written.
    tmp = marker.with_name(marker.name + f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(params))
    os.replace(tmp, marker)
    return Workload(name, str(root), n)


def source(workload: Workload):
    """The torchvision dataset the benchmark caches (the "raw" source)."""
    from torchvision import datasets, transforms

    if workload.name == "mnist":
        tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
        return datasets.MNIST(workload.root, train=True, download=False, transform=tf)
    tf = transforms.Compose(
        [
            transforms.Resize(256),
            transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    return datasets.ImageFolder(str(Path(workload.root) / "images"), transform=tf)


def _write_jpegs(folder: Path, n: int, seed: int) -> None:
    from concurrent.futures import ProcessPoolExecutor

    for c in range(_JPEG_CLASSES):
        (folder / f"class{c:02d}").mkdir(parents=True, exist_ok=True)
    procs = max(1, min(16, os.cpu_count() or 1))
    bounds = [n * k // procs for k in range(procs + 1)]
    with ProcessPoolExecutor(procs) as pool:
        for f in [pool.submit(_write_jpeg_range, folder, a, b, seed) for a, b in zip(bounds[:-1], bounds[1:])]:
            f.result()


def _write_jpeg_range(folder: Path, start: int, stop: int, seed: int) -> None:
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    palettes = rng.integers(0, 256, size=(_JPEG_CLASSES, 4, 3))
    yy, xx = np.mgrid[0:_JPEG_PX, 0:_JPEG_PX].astype(np.float32) / _JPEG_PX
    for i in range(start, stop):
        c = i % _JPEG_CLASSES
        pal = palettes[c]
        r = np.random.default_rng([seed, i])
        # A tilted two-colour gradient as the background, then class-coloured shapes, a light
        # blur and sensor-like noise: compresses like a photo (~20-30 KB), not like static.
        angle = r.uniform(0, 2 * np.pi)
        t = np.clip((np.cos(angle) * xx + np.sin(angle) * yy + 1) / 2, 0, 1)[..., None]
        bg = (1 - t) * pal[0] + t * pal[1]
        img = Image.fromarray(bg.astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(int(r.integers(4, 9))):
            x0, y0 = r.integers(0, _JPEG_PX, size=2)
            w, h = r.integers(20, 140, size=2)
            colour = tuple(int(v) for v in np.clip(pal[2 + int(r.integers(0, 2))] + r.normal(0, 25, 3), 0, 255))
            box = [int(x0), int(y0), int(x0 + w), int(y0 + h)]
            if (c + int(r.integers(0, 3))) % 3 == 0:
                draw.rectangle(box, fill=colour)
            elif c % 2 == 0:
                draw.ellipse(box, fill=colour)
            else:
                draw.line(box, fill=colour, width=int(r.integers(3, 12)))
        img = img.filter(ImageFilter.GaussianBlur(radius=1.2))
        arr = np.asarray(img, np.float32) + r.normal(0, 6, size=(_JPEG_PX, _JPEG_PX, 3))
        img = Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8))
        path = folder / f"class{c:02d}" / f"img{i:05d}.jpg"
        tmp = path.with_name(path.name + ".tmp")
        img.save(tmp, format="JPEG", quality=90)
        os.replace(tmp, path)


def cache_size(root) -> int:
    """Bytes of the files of the nbkit cache at ``root`` (what a copy of it moves)."""
    from nbkit import format as fmt

    return sum(os.path.getsize(os.path.join(root, n)) for n in fmt.list_cache_files(root))


def describe(workload: Workload) -> dict:
    """A JSON-friendly summary, for the results table."""
    return asdict(workload)
