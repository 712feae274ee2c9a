"""The terminal demo: ``python -m nbkit.demo`` (what ``make demo`` runs first).

Builds offline MNIST-format files (synthetic stand-ins for MNIST, and it says so first), wraps
torchvision's ``MNIST`` (``ToTensor`` + ``Normalize``) in a :class:`nbkit.CachedDataset`, warms it
up with a progress line, reopens it without the source as a new session would, and prints raw vs
cached epoch times.

Example:
    >>> from nbkit.demo import main
    >>> import tempfile
    >>> main(["--samples", "512", "--epochs", "1", "--workdir", tempfile.mkdtemp()])  # doctest: +ELLIPSIS
    nbkit demo...
    0
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch
from torch.utils.data import DataLoader, Subset

import nbkit
from nbkit.offline import has_mnist, stand_in_notice, write_mnist
from nbkit.progress import TextProgress
from nbkit.text import format_bytes


def _epoch_seconds(dataset, batch_size: int, collate_fn=None) -> float:
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=0, collate_fn=collate_fn)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nbkit.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=60000, help="MNIST training images to use (default 60000)")
    parser.add_argument("--epochs", type=int, default=3, help="cached epochs to time (default 3)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workdir", default="out/demo", help="where data and cache go (default out/demo)")
    parser.add_argument("--num-workers", type=int, default=0, help="warmup worker processes (default 0)")
    args = parser.parse_args(argv)

    try:
        from torchvision import datasets, transforms as T
    except ImportError as e:
        raise ImportError("the demo needs torchvision: pip install torchvision") from e

    print(f"nbkit demo: torch {torch.__version__}, {args.samples} MNIST-format samples, workdir {args.workdir}")
    data_root = os.path.join(args.workdir, "data")
    cache_path = os.path.join(args.workdir, "cache")
    if not has_mnist(data_root):
        print(stand_in_notice(args.samples, "the demo writes its own files and never downloads"))
        print("writing offline MNIST-format files (no download needed) ...")
        write_mnist(data_root, n_train=max(args.samples, 1000), n_test=1000)
    else:
        print(f"Using the MNIST-format files already in {data_root}: the synthetic stand-ins an earlier demo run "
              "wrote there, unless you put the real MNIST there.")
    transform = T.Compose([T.ToTensor(), T.Normalize((0.1307,), (0.3081,))])
    source = datasets.MNIST(data_root, train=True, download=False, transform=transform)
    if args.samples < len(source):
        source = Subset(source, range(args.samples))
    if os.path.exists(cache_path):
        shutil.rmtree(cache_path)  # the demo shows a cold start every time

    cached = nbkit.CachedDataset(source, cache_path)
    progress = TextProgress("warmup", unit="samples")
    report = cached.warmup(num_workers=args.num_workers, callback=progress)
    progress.close()
    print(report)
    print(cached.stats)

    print("\nreopening the cache without its source, as a new session would ...")
    reopened = nbkit.CachedDataset.open(cache_path)
    raw = _epoch_seconds(source, args.batch_size)
    first = _epoch_seconds(reopened, args.batch_size, nbkit.collate)
    later = [_epoch_seconds(reopened, args.batch_size, nbkit.collate) for _ in range(args.epochs)]
    default = _epoch_seconds(reopened, args.batch_size)
    best = min(later)
    rows = [
        ("raw source (decode + ToTensor + Normalize)", raw),
        ("cached, first epoch after reopening", first),
        ("cached, nbkit.collate (best)", best),
        ("cached, default collate", default),
        ("warmup (stores every sample)", report.seconds),
    ]
    print(f"\n{'epoch of ' + str(len(source)) + ' samples':45s} {'seconds':>8s} {'vs raw':>8s}")
    for name, seconds in rows:
        print(f"{name:45s} {seconds:8.3f} {raw / seconds:7.1f}x")
    print(f"\ncache: {format_bytes(cached.stats.disk_bytes)} on disk (sample data, index and metadata) in "
          f"{len(os.listdir(cache_path))} files at {cache_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
