"""Redis store benchmark: epoch time of MNIST 60,000 served from Redis (1 and 3 servers) against the raw
torchvision source and a local nbkit cache.

Every setup reads the same shuffled epochs (batch 256, ``collate_fn=nbkit.collate`` for the caches,
the default collate for the raw source) in this process (``num_workers=0``), plus one Redis row with
``num_workers=2``. The Redis servers are real ``redis-server`` processes on 127.0.0.1 (persistence
off), started by this script. Epoch 1 of a cache also checks every sample's CRC once per process;
"later epochs" is the best of the following ones. Each cache's first batch is compared with the source.

Usage::

    .venv/bin/python benchmarks/bench_redis.py            # writes benchmarks/results/redis.md
    .venv/bin/python benchmarks/bench_redis.py --quick    # 2,048 samples, a smoke test

Example:
    >>> import subprocess, sys, tempfile
    >>> out = tempfile.mkdtemp()
    >>> r = subprocess.run([sys.executable, "benchmarks/bench_redis.py", "--quick", "--data-dir", out,
    ...                     "--results", out], capture_output=True, text=True)
    >>> r.returncode, "| Redis, 3 servers" in r.stdout
    (0, True)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

import workloads
from fixtures_redis import RedisServer, sharded_url

MiB = 1 << 20
BATCH = 256


def order(n, epoch):
    """The shuffled order of epoch ``epoch`` (the same for every setup)."""
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()


def epochs(ds, n_epochs, collate_fn, num_workers=0):
    """Seconds of each shuffled epoch over ``ds``, and the first batch of the first epoch."""
    from torch.utils.data import DataLoader

    times, first = [], None
    for e in range(n_epochs):
        loader = DataLoader(ds, batch_size=BATCH, sampler=order(len(ds), e), collate_fn=collate_fn,
                            num_workers=num_workers)
        t = time.perf_counter()
        for batch in loader:
            if first is None:
                first = batch
        times.append(time.perf_counter() - t)
    return times, first


def first_batch_ok(batch, src):
    """The first batch of epoch 0 equals the source's samples at those indices."""
    import torch

    idx = order(len(src), 0)[:BATCH]
    x, y = batch
    return torch.equal(x, torch.stack([src[i][0] for i in idx])) and y.tolist() == [int(src[i][1]) for i in idx]


def used_memory(servers) -> int:
    """Bytes of memory the Redis ``servers`` use together."""
    return sum(int(s.client().info("memory")["used_memory"]) for s in servers)


def run(args):
    import nbkit

    spec = workloads.build("mnist", args.data_dir, quick=args.quick)
    src = workloads.source(spec)
    n = len(src)
    work = Path(tempfile.mkdtemp(prefix="nbkit-bench-redis-"))
    servers = []
    rows = []
    try:
        raw_times, raw_first = epochs(src, 2, None)
        raw = min(raw_times)
        rows.append(("raw (torchvision MNIST, default collate)", "", f"{raw_times[0]:.2f}", f"{raw:.2f}", n / raw, 1.0,
                     "ok" if first_batch_ok(raw_first, src) else "**WRONG DATA**", ""))

        local = nbkit.CachedDataset(src, work / "local")
        t = time.perf_counter()
        local.warmup()
        warm = time.perf_counter() - t
        times, first = epochs(local, args.epochs, nbkit.collate)
        best = min(times[1:] or times)
        rows.append(("local nbkit cache", f"{warm:.2f}", f"{times[0]:.2f}", f"{best:.2f}", n / best, raw / best,
                     "ok" if first_batch_ok(first, src) else "**WRONG DATA**",
                     f"{local.stats.bytes / MiB:.0f} MiB on disk"))

        servers = [RedisServer(work / f"redis-{k}").start() for k in range(3)]
        setups = [("Redis, 1 server", servers[:1], 0), ("Redis, 3 servers", servers, 0),
                  ("Redis, 1 server, `num_workers=2`", servers[:1], 2)]
        for label, group, workers in setups:
            url = sharded_url(group, f"mnist-{len(group)}")
            before = used_memory(group)
            ds = nbkit.CachedDataset(src, url)
            t = time.perf_counter()
            report = ds.warmup()
            warm = time.perf_counter() - t
            used = used_memory(group) - before
            ds.reset_stats()
            times, first = epochs(ds, args.epochs, nbkit.collate, num_workers=workers)
            best = min(times[1:] or times)
            hit = ds.stats.hit_rate
            ok = first_batch_ok(first, src) and hit == 1.0
            rows.append((label, f"{warm:.2f}" if report.computed else "(warm)", f"{times[0]:.2f}", f"{best:.2f}", n / best,
                         raw / best, "ok" if ok else "**WRONG DATA**",
                         f"{used / MiB:.0f} MiB of Redis memory" if report.computed else "same cache"))
    finally:
        for s in servers:
            s.kill()
        shutil.rmtree(work, ignore_errors=True)

    import redis  # imported by the servers' clients above
    from redis.utils import HIREDIS_AVAILABLE

    head = (
        "## Redis store (issue 7)\n\n"
        f"MNIST {n:,} samples (torchvision MNIST + ToTensor + Normalize), batch {BATCH}, shuffled, "
        f"`collate_fn=nbkit.collate` for the caches; {args.epochs} epochs each (raw: 2), `num_workers=0` unless stated. "
        "Redis: real redis-server processes on 127.0.0.1 (`--save '' --appendonly no`), redis-py "
        f"{redis.__version__} {'with' if HIREDIS_AVAILABLE else 'without'} hiredis; one `MGET` per server per batch."
        + (" **Quick mode: small sizes, not comparable.**" if args.quick else "")
        + "\n\n| setup | warmup s | epoch 1 s | later epochs s (best) | samples/s | vs raw | first batch | size |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    body = "\n".join(f"| {a} | {b} | {c} | {d} | {e:,.0f} | {f:.1f}× | {g} | {h} |" for a, b, c, d, e, f, g, h in rows)
    note = (
        "\n\nRedis serves an epoch from memory over the network at several times the raw source's speed, but "
        "slower than a local cache (which is memory-mapped: no copy, no protocol). On one host the client decodes "
        "every reply, so three servers add capacity (each holds a third of the samples) rather than speed. "
        "`num_workers=2` pays the DataLoader's inter-process copy on top, as for a local cache.\n"
    )
    return head + body + note


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="2,048 samples, a smoke test")
    p.add_argument("--data-dir", default=str(workloads.DEFAULT_DATA_DIR), help="where the MNIST files are built")
    p.add_argument("--results", default=str(HERE / "results"), help="directory for redis.md")
    p.add_argument("--epochs", type=int, default=5, help="epochs per setup (the machine may be shared: best of the later ones)")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        sys.exit("bench_redis: redis-server is not installed (sh scripts/install-system-deps.sh installs it)")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    table = run(args)
    print(table)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "redis.md").write_text(table)


if __name__ == "__main__":
    main()
