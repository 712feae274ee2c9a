"""Offline stand-ins for datasets that are normally downloaded.

Tests, the demo and the notebooks (when the real download is impossible) use
:func:`write_mnist` to create MNIST-format IDX files that torchvision's ``MNIST``,
``FashionMNIST``, ``KMNIST`` and ``EMNIST`` classes load with ``download=False``. The images are
not real digits, but each class has its own pattern plus noise and a random shift, so a small
model can learn them and a loss curve goes down. :func:`mnist_like` (the notebooks' data) loads
the real torchvision dataset when it can be had, and these files otherwise.

Example:
    >>> import tempfile
    >>> from nbkit.offline import write_mnist
    >>> root = tempfile.mkdtemp()
    >>> raw = write_mnist(root, n_train=100, n_test=20)
    >>> sorted(p.name for p in raw.iterdir())[:2]
    ['t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte']
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import numpy as np

from .commit import atomic_write
from .text import say

__all__ = ["mnist_like", "MNIST_LIKE", "write_mnist", "mnist_raw_folder", "has_mnist", "stand_in_notice"]

#: The dataset names :func:`mnist_like` accepts (the tutorials' form field).
MNIST_LIKE = ("MNIST", "FashionMNIST", "KMNIST", "EMNIST")

#: The IDX files torchvision's MNIST-style classes read from ``<root>/<folder>/raw``.
FILES = tuple(f"{split}-{kind}" for split in ("train", "t10k") for kind in ("images-idx3-ubyte", "labels-idx1-ubyte"))

# torchvision looks for raw files under root/<folder>/raw; EMNIST uses a split-specific naming
# scheme of its own, which we do not emulate.
_FOLDERS = {"MNIST": "MNIST", "FashionMNIST": "FashionMNIST", "KMNIST": "KMNIST"}


def mnist_raw_folder(root, name: str = "MNIST") -> Path:
    """Where torchvision's ``name`` class expects its raw IDX files under ``root``."""
    if name not in _FOLDERS:
        raise ValueError(f"no offline layout for {name!r}; choose one of {sorted(_FOLDERS)}")
    return Path(root) / _FOLDERS[name] / "raw"


def has_mnist(root, name: str = "MNIST") -> bool:
    """Whether ``root`` already holds the raw files of ``name`` (written by :func:`write_mnist` or torchvision).

    Example:
        >>> import tempfile
        >>> root = tempfile.mkdtemp()
        >>> has_mnist(root), (write_mnist(root, n_train=10, n_test=2) and has_mnist(root))
        (False, True)
    """
    raw = mnist_raw_folder(root, name)
    return all((raw / f).exists() for f in FILES)


def stand_in_notice(samples: int, why: str, *, layout: str = "MNIST", name: str | None = None, note: str = "") -> str:
    """The sentence that says the data is an offline stand-in, and why: the demo, the notebooks
    (through :func:`mnist_like`) and the benchmark all say it in these words.

    Example:
        >>> stand_in_notice(3000, "the demo never downloads")
        'Using offline MNIST-format stand-in data (3,000 samples): the demo never downloads. The images are synthetic, learnable patterns, not real MNIST.'
    """
    return (f"Using offline {layout}-format stand-in data ({samples:,} samples): {why}. "
            f"The images are synthetic, learnable patterns, not real {name or layout}{note}.")


def _class_templates(rng: np.random.Generator, n_classes: int = 10) -> np.ndarray:
    # A few random strokes per class, blurred a little: distinct, learnable, digit-sized.
    templates = np.zeros((n_classes, 28, 28), np.float32)
    yy, xx = np.mgrid[0:28, 0:28]
    for c in range(n_classes):
        for _ in range(3):
            x0, y0, x1, y1 = rng.uniform(6, 22, size=4)
            for t in np.linspace(0, 1, 24):
                cx, cy = x0 + t * (x1 - x0), y0 + t * (y1 - y0)
                templates[c] += np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 3.0)
        templates[c] /= templates[c].max()
    return templates


def _images(rng, templates, labels) -> np.ndarray:
    n = len(labels)
    out = np.empty((n, 28, 28), np.uint8)
    step = 8192
    for s in range(0, n, step):
        lab = labels[s : s + step]
        img = templates[lab] * rng.uniform(0.7, 1.0, size=(len(lab), 1, 1)).astype(np.float32)
        img += rng.normal(0, 0.08, size=img.shape).astype(np.float32)
        shift = rng.integers(-2, 3, size=2)
        img = np.roll(img, tuple(int(v) for v in shift), axis=(1, 2))
        out[s : s + step] = np.clip(img * 255, 0, 255).astype(np.uint8)
    return out


def _write_idx(path: Path, array: np.ndarray) -> None:
    magic = 0x0800 | array.ndim  # 0x08 = unsigned byte, then the number of dimensions
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    atomic_write(str(path), header + np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def write_mnist(root, *, name: str = "MNIST", n_train: int = 60000, n_test: int = 10000, seed: int = 0) -> Path:
    """Write MNIST-format IDX files that ``torchvision.datasets.<name>(root, download=False)`` loads.

    Args:
        root: the ``root`` you will pass to torchvision.
        name: ``"MNIST"``, ``"FashionMNIST"`` or ``"KMNIST"`` (decides the folder name).
        n_train, n_test: number of images in each split.
        seed: the files are a pure function of the arguments.

    Returns:
        The raw folder the files were written to.
    """
    raw = mnist_raw_folder(root, name)
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    templates = _class_templates(rng)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        _write_idx(raw / f"{prefix}-images-idx3-ubyte", _images(rng, templates, labels))
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels)
    return raw


def mnist_like(name: str = "MNIST", root="data", *, train: bool = True, transform=None,
               download: bool = True, offline_samples: int = 60000, timeout: float = 5.0):
    """An MNIST-style torchvision dataset: the real one if it can be had, else offline files.

    The real data is used when it is already under ``root`` or (with ``download=True``) can be
    downloaded. Without a network the download fails within ``timeout`` seconds and the
    dataset falls back to MNIST-format files written by :func:`nbkit.offline.write_mnist` under
    ``root/nbkit-offline-<n>`` (kept apart so they are never taken for the real data). EMNIST
    (``split="digits"``) has no offline layout of its own, so its fallback is MNIST-format
    data. A message says which data was used.

    Args:
        name: one of ``MNIST_LIKE``: ``"MNIST"``, ``"FashionMNIST"``, ``"KMNIST"``, ``"EMNIST"``.
        root: torchvision's ``root`` folder.
        train: the training split (else the test split).
        transform: passed to the torchvision dataset.
        download: try to download the real data when it is not under ``root``.
        offline_samples: size of the offline training split (the test split is a sixth of it).
        timeout: socket timeout of the download attempt, in seconds.

    Returns:
        The torchvision dataset. Its ``nbkit_source`` attribute says ``"real"`` or ``"offline"``.

    Example:
        >>> import tempfile
        >>> ds = mnist_like("KMNIST", tempfile.mkdtemp(), download=False, offline_samples=120)  # doctest: +ELLIPSIS
        Using offline KMNIST-format stand-in data (120 samples): ...
        >>> len(ds), ds.nbkit_source
        (120, 'offline')
    """
    try:
        from torchvision import datasets
    except ImportError as e:
        raise ImportError("nbkit.offline.mnist_like needs torchvision: pip install torchvision") from e
    if name not in MNIST_LIKE:
        raise ValueError(f"mnist_like(name={name!r}): expected one of {', '.join(MNIST_LIKE)}")

    cls = getattr(datasets, name)
    kwargs = dict(train=train, transform=transform)
    if name == "EMNIST":
        kwargs["split"] = "digits"  # ten classes, like the others, so the same model fits
    reason = "download=False and the data is not under root"
    try:
        ds = cls(root, download=False, **kwargs)
        ds.nbkit_source = "real"
        return ds
    except RuntimeError:
        pass  # not there yet (torchvision raises RuntimeError("Dataset not found ..."))
    if download:
        previous = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            ds = cls(root, download=True, **kwargs)
            ds.nbkit_source = "real"
            return ds
        except (RuntimeError, OSError) as e:  # URLError and socket timeouts are OSErrors
            reason = f"the download failed ({_first_line(e)})"
        finally:
            socket.setdefaulttimeout(previous)

    layout = "MNIST" if name == "EMNIST" else name
    offline_root = Path(root) / f"nbkit-offline-{offline_samples}"
    if not has_mnist(offline_root, layout):
        write_mnist(offline_root, name=layout, n_train=offline_samples,
                    n_test=max(1, offline_samples // 6))
    ds = getattr(datasets, layout)(offline_root, download=False, train=train, transform=transform)
    ds.nbkit_source = "offline"
    note = " (EMNIST has no offline layout; using MNIST-format data instead)" if name == "EMNIST" else ""
    say(stand_in_notice(len(ds), reason, layout=layout, name=name, note=note))  # fits 400 px in a notebook
    return ds


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    # torchvision's message starts with "Error downloading X:" and names the cause further down.
    return " / ".join(line.strip() for line in text[:3] if line.strip()) or type(error).__name__
