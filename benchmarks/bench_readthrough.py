"""Read-through benchmark: an epoch of the 60,000-sample MNIST cache read from the GCS emulator
through a local area of 25% of the cache, against the same cache pulled whole, and the raw source.

All in one run, against one emulator (fake-gcs-server, in-memory) on 127.0.0.1 with real gcsfs:

* **raw**: torchvision MNIST + ToTensor + Normalize, shuffled batches of 256, default collate;
* **pulled**: ``nbkit.pull`` then a local cache, shuffled, ``collate_fn=nbkit.collate`` (the pull
  time is shown apart);
* **read-through**: ``CachedDataset.open(url, local_max_bytes=25% of the cache)`` with
  ``nbkit.PrefetchSampler``; epoch 1 starts with an empty local area, epoch 2 refetches
  (the area holds a quarter of the cache);
* **read-through, plain shuffle**: the same with a ``RandomSampler`` (no locality): a few batches,
  scaled to an epoch.

Usage::

    .venv/bin/python benchmarks/bench_readthrough.py           # writes benchmarks/results/readthrough.md
    .venv/bin/python benchmarks/bench_readthrough.py --quick   # 2,048 samples, a smoke test

Example:
    >>> import subprocess, sys, tempfile
    >>> out = tempfile.mkdtemp()
    >>> r = subprocess.run([sys.executable, "benchmarks/bench_readthrough.py", "--quick", "--data-dir", out,
    ...                     "--results", out], capture_output=True, text=True)
    >>> r.returncode, "| read-through" in r.stdout
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
from fixtures_gcs import GCSEmulator

MiB = 1 << 20


def epoch(loader, limit=None):
    t = time.perf_counter()
    n = 0
    for k, batch in enumerate(loader):
        n += len(batch[1])
        if limit is not None and k + 1 >= limit:
            break
    return time.perf_counter() - t, n


def run(args):
    import torch
    from torch.utils.data import DataLoader, RandomSampler

    import nbkit
    from nbkit.samplers import PrefetchSampler
    from nbkit.stores.readthrough.area import area_usage
    from nbkit.stores.readthrough.store import store_of

    work = Path(tempfile.mkdtemp(prefix="nbkit-bench-readthrough-"))
    os.environ["NBKIT_CACHE_DIR"] = str(work / "areas")
    rows = []
    try:
        spec = workloads.build("mnist", args.data_dir, quick=args.quick)
        src = workloads.source(spec)
        n = len(src)
        local = nbkit.CachedDataset(src, work / "cache")
        local.warmup()
        size = workloads.cache_size(local.root)
        emu = GCSEmulator(work / "gcs", backend="memory").start()
        try:
            bucket = emu.make_bucket("bench")
            so = emu.storage_options
            url = f"{bucket.url}/mnist"
            nbkit.push(local.root, url, storage_options=so)
            torch.manual_seed(0)

            raw_t, _ = epoch(DataLoader(src, batch_size=256, shuffle=True))
            rows.append(("raw (torchvision MNIST)", raw_t, "", ""))

            pull_t = time.perf_counter()
            nbkit.pull(url, work / "pulled", storage_options=so)
            pull_t = time.perf_counter() - pull_t
            pulled = nbkit.CachedDataset.open(work / "pulled")
            pl = DataLoader(pulled, batch_size=256, shuffle=True, collate_fn=nbkit.collate)
            pulled_t = min(epoch(pl)[0] for _ in range(2))
            rows.append(("pulled whole, then local", pulled_t, f"pull {pull_t:.2f} s", f"{size / MiB:.0f} MiB"))

            limit = size // 4
            rt = nbkit.CachedDataset.open(url, storage_options=so, local_max_bytes=limit)
            store = store_of(rt)
            loader = DataLoader(rt, batch_size=256, sampler=PrefetchSampler(rt, seed=0), collate_fn=nbkit.collate)
            for e in (1, 2):
                before = dict(store.counters)
                t, count = epoch(loader)
                assert count == n, (count, n)
                fetched = (store.counters["fetched_bytes"] - before["fetched_bytes"]) / MiB
                note = f"{fetched:.0f} MiB fetched, {store.counters['prefetched'] - before['prefetched']} of " \
                       f"{store.counters['fetched'] - before['fetched']} pieces prefetched"
                rows.append((f"read-through, 25% local, PrefetchSampler, epoch {e}", t, note,
                             f"peak {store.counters['max_local_bytes'] / MiB:.1f} MiB"))
            batches = args.random_batches
            rl = DataLoader(rt, batch_size=256, sampler=RandomSampler(range(n)), collate_fn=nbkit.collate)
            before = dict(store.counters)
            t, count = epoch(rl, limit=batches)
            scaled = t * n / count
            fetched = (store.counters["fetched_bytes"] - before["fetched_bytes"]) / MiB
            rows.append((f"read-through, 25% local, plain shuffle (scaled from {batches} batches)", scaled,
                         f"{fetched * n / count:.0f} MiB fetched an epoch", ""))
            assert area_usage(rt.root) <= limit
            pieces = store.geometry.n_column_pieces
            piece_mib = store.geometry.piece_size(("c", 0)) / MiB
        finally:
            emu.kill()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [
        "## Read-through (issue 7)",
        "",
        f"MNIST cache of {n:,} samples (torchvision MNIST + ToTensor + Normalize), {size / MiB:.0f} MiB; GCS emulator "
        f"(fake-gcs-server, in-memory) on 127.0.0.1, real gcsfs. Read-through local area: 25% of the cache "
        f"({limit / MiB:.1f} MiB), {pieces} column pieces of {piece_mib:.2f} MiB. Batches of 256, `num_workers=0`."
        + (" **Quick mode** (2,048 samples): a smoke test, not a measurement." if args.quick else ""),
        "",
        "| epoch | seconds | vs pulled | notes | local disk |",
        "|---|---|---|---|---|",
    ]
    for name, t, note, disk in rows:
        lines.append(f"| {name} | {t:.2f} | {t / pulled_t:.1f}× | {note} | {disk} |")
    table = "\n".join(lines) + "\n"
    print(table)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "readthrough.md").write_text(table)
    return table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2,048 samples, a smoke test")
    ap.add_argument("--data-dir", default=str(workloads.DEFAULT_DATA_DIR))
    ap.add_argument("--results", default=str(HERE / "results"))
    ap.add_argument("--random-batches", type=int, default=8, help="batches measured with a plain shuffle")
    run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
