"""CacheLoader benchmark: the per-sample cost of ``CacheLoader.get(key)`` (Bagua's pattern) against
``CachedDataset`` reads, one sample (``ds[i]``) and one batch at a time, on MNIST 60,000.

Every setup reads the same shuffled order of all samples in this process. The source is torchvision
MNIST + ``ToTensor`` + ``Normalize``; "fill" is the first pass, which computes every sample and stores
it; "read" is the best of the passes after it (every read a hit, its checksum checked). The Redis row
uses a real ``redis-server`` on 127.0.0.1 (skipped without one). Each setup's first 256 reads are
compared with the source.

Usage::

    .venv/bin/python benchmarks/bench_cacheloader.py            # writes benchmarks/results/cacheloader.md
    .venv/bin/python benchmarks/bench_cacheloader.py --quick    # 2,048 samples, a smoke test

Example:
    >>> import subprocess, sys, tempfile
    >>> out = tempfile.mkdtemp()
    >>> r = subprocess.run([sys.executable, "benchmarks/bench_cacheloader.py", "--quick", "--data-dir", out,
    ...                     "--results", out], capture_output=True, text=True)
    >>> r.returncode, "| `CacheLoader.get(i)`, local" in r.stdout
    (0, True)
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

import workloads

BATCH = 256
CHECK = 256


def shuffled(n: int) -> list:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()


def same(sample, ref) -> bool:
    import torch

    return torch.equal(sample[0], ref[0]) and int(sample[1]) == int(ref[1])


def per_sample(read, order, passes):
    """Seconds of each pass of ``read(i)`` over ``order``, and the first ``CHECK`` samples of the first."""
    times, first = [], []
    for p in range(passes):
        t = time.perf_counter()
        if p == 0:
            for i in order[:CHECK]:
                first.append(read(i))
            for i in order[CHECK:]:
                read(i)
        else:
            for i in order:
                read(i)
        times.append(time.perf_counter() - t)
    return times, first


def per_batch(ds, order, passes):
    """Seconds of each pass of ``nbkit.collate(ds.__getitems__(batch))``, and the first batch as samples."""
    import nbkit

    times, first = [], []
    for _ in range(passes):
        t = time.perf_counter()
        for start in range(0, len(order), BATCH):
            x, y = nbkit.collate(ds.__getitems__(order[start:start + BATCH]))
            if not first:
                first = list(zip(x, y))
        times.append(time.perf_counter() - t)
    return times, first


class Keyed:
    """Bagua's pattern: ``__getitem__`` reads the sample through ``loader.get(index, load_fn)``."""

    def __init__(self, loader, src):
        self.loader, self.src = loader, src

    def __len__(self):
        return len(self.src)

    def __getitem__(self, i):
        return self.loader.get(i, self.src.__getitem__)


def loader_passes(ds, order, passes):
    """Seconds of each epoch of a ``DataLoader`` (batch ``BATCH``, ``order``, no workers), and its first batch."""
    from torch.utils.data import DataLoader

    times, first = [], []
    for _ in range(passes - 1):
        t = time.perf_counter()
        for x, y in DataLoader(ds, batch_size=BATCH, sampler=order):
            if not first:
                first = list(zip(x, y))
        times.append(time.perf_counter() - t)
    return times, first


def run(args):
    import nbkit

    spec = workloads.build("mnist", args.data_dir, quick=args.quick)
    src = workloads.source(spec)
    n = len(src)
    order = shuffled(n)
    refs = [src[i] for i in order[:CHECK]]
    work = Path(tempfile.mkdtemp(prefix="nbkit-bench-cacheloader-"))
    rows = []
    server = None

    def row(label, times, first, note, *, fills=True):
        fill = times[0] / n * 1e6 if fills else None
        best = min(times[1:] if fills else times)
        ok = len(first) >= CHECK and all(same(a, b) for a, b in zip(first, refs))
        rows.append((label, fill, best / n * 1e6, n / best, ok, note))

    try:
        times, first = per_sample(src.__getitem__, order, 1)
        row("raw source `src[i]` (torchvision MNIST)", times, first, "every read computes", fills=False)

        ds = nbkit.CachedDataset(src, work / "dataset")
        times, first = per_sample(ds.__getitem__, order, args.passes)
        row("`CachedDataset` `ds[i]`", times, first, "fill: the first pass computes and stores")

        batched = nbkit.CachedDataset.open(work / "dataset")
        times, first = per_batch(batched, order, args.passes)
        row(f"`CachedDataset` batch of {BATCH} (`__getitems__` + `nbkit.collate`)", times, first,
            "the cache filled above: every pass reads", fills=False)

        loader = nbkit.CacheLoader(work / "keyed")
        times, first = per_sample(lambda i: loader.get(i, src.__getitem__), order, args.passes)
        row("`CacheLoader.get(i)`, local", times, first, "fill: the first pass calls load_fn and stores")

        bagua = Keyed(loader, src)
        times, first = loader_passes(bagua, order, args.passes)
        row(f"`CacheLoader` in a Bagua-style dataset, `DataLoader` batch {BATCH}", times, first,
            "the keys stored above: every pass reads; default collate", fills=False)

        if shutil.which("redis-server") is not None:
            from fixtures_redis import RedisServer

            server = RedisServer(work / "redis").start()
            remote = nbkit.CacheLoader(server.url("mnist"))
            times, first = per_sample(lambda i: remote.get(i, src.__getitem__), order, args.passes)
            row("`CacheLoader.get(i)`, Redis on 127.0.0.1", times, first, "one `HGET` a read")
    finally:
        if server is not None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)

    raw = rows[0][2]
    head = (
        "## CacheLoader: caching by key inside `__getitem__` (issue 12)\n\n"
        f"MNIST {n:,} samples (torchvision MNIST + ToTensor + Normalize), read in one shuffled order in this process; "
        f"fill is the first pass (compute and store), read the best of {args.passes - 1} later pass(es), all hits with "
        "their checksums checked. Costs are per sample."
        + (" **Quick mode: small sizes, not comparable.**" if args.quick else "")
        + "\n\n| setup | fill µs/sample | read µs/sample | samples/s | vs raw | data | note |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    body = "\n".join(
        f"| {label} | {'' if fill is None else f'{fill:.1f}'} | {read:.1f} | {rate:,.0f} | {raw / read:.1f}× | "
        f"{'ok' if ok else '**WRONG DATA**'} | {note} |"
        for label, fill, read, rate, ok, note in rows
    )
    note = (
        "\n\n`CacheLoader` stores each value as one free-form blob (a JSON header, then the raw bytes) and decodes it "
        "on every read: its cost is per sample, like `ds[i]`, whatever the batch size. `CachedDataset` knows its "
        "samples share one schema and serves a batch with one gather per field, so a `DataLoader` over it pays far "
        "less per sample. Use `CacheLoader` when your own `__getitem__` decides what to cache under which key; use "
        "`CachedDataset` when the samples are a dataset's indices.\n"
    )
    return head + body + note


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2,048 samples, a smoke test")
    p.add_argument("--only", choices=["mnist"], action="append", help="workloads to run (only mnist)")
    p.add_argument("--data-dir", default=str(workloads.DEFAULT_DATA_DIR), help="where the MNIST files are built")
    p.add_argument("--results", default=str(HERE / "results"), help="directory for cacheloader.md")
    p.add_argument("--passes", type=int, default=3, help="passes per setup: one fill, then reads (best is kept)")
    args = p.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    table = run(args)
    print(table)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cacheloader.md").write_text(table)


if __name__ == "__main__":
    main()
