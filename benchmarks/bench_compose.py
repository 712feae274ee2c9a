"""Compose benchmark: the gs:// merge of a cache's parts (nbkit.build.compose) against the cache's
size, on the GCS emulator, with the bytes that travel through the driver counted on the wire.

For each size: 8 parts (and one run with 64 parts: a tree of composes) of a fixed-shape source
(4 KiB float32 rows plus a short string in the heap) are built locally and pushed beside the cache
(what the workers of a build do; timed as "push parts"), then composed. Reported: compose time
(checking the parts and the server-side composes), the workers' check time (reading each composed
file once against the parts' sha256s, here local processes), the driver's bytes sent and received,
and, for scale, an nbkit.push of the same cache built whole (what a driver that merged locally would
pay at least to publish it).

Usage::

    .venv/bin/python benchmarks/bench_compose.py            # 16, 64, 256 MiB; writes results/compose.md
    .venv/bin/python benchmarks/bench_compose.py --quick    # 4 MiB, a smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "build")]
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"

import torch
from fixtures_gcs import GCSEmulator

import nbkit
from nbkit import format as fmt
from nbkit.build import compose as composing

MiB = 1 << 20
ROW = 1024  # float32s a sample: 4 KiB


class Source(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((ROW,), float(i)), f"sample-{i}"


def count_wire():
    import gcsfs
    counts = {"sent": 0, "received": 0, "requests": 0}
    original = gcsfs.GCSFileSystem._request

    async def counted(fs, method, path, *args, **kwargs):
        out = await original(fs, method, path, *args, **kwargs)
        data = kwargs.get("data")
        counts["sent"] += len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
        counts["received"] += len(out[3] or b"")
        counts["requests"] += 1
        return out

    gcsfs.GCSFileSystem._request = counted
    return counts, lambda: setattr(gcsfs.GCSFileSystem, "_request", original)


def one(emu, work, mib, nparts):
    from engine_calls import make_part
    n = mib * MiB // (ROW * 4)
    src = Source(n)
    bucket = emu.make_bucket()
    url = f"{bucket.url}/cache"
    whole = nbkit.CachedDataset(src, os.path.join(work, f"whole-{mib}-{nparts}"))
    whole.warmup()
    fingerprint = fmt.read_meta(whole.root)["fingerprint"]
    cuts = [n * k // nparts for k in range(nparts + 1)]
    t = time.perf_counter()
    for a, b in zip(cuts, cuts[1:]):
        root = make_part(src, a, b, os.path.join(work, f"p-{mib}-{nparts}-{a}"), fingerprint)
        nbkit.push(root, f"{composing.parts_url(url)}/{composing.part_name(a, b)}", storage_options=emu.storage_options)
    push_parts = time.perf_counter() - t
    counts, undo = count_wire()
    try:
        report = composing.compose(url, storage_options=emu.storage_options, engine="processes")
    finally:
        undo()
    t = time.perf_counter()
    nbkit.push(whole.root, f"{bucket.url}/pushed", storage_options=emu.storage_options)
    push_whole = time.perf_counter() - t
    whole.close()
    return (f"| {mib} MiB ({n:,} samples) | {nparts} | {report.compose_requests} | {push_parts:.2f} s | "
            f"{report.compose_seconds:.2f} s | {report.check_seconds:.2f} s | {report.seconds:.2f} s | "
            f"{counts['sent'] / 1024:.0f} KiB / {counts['received'] / 1024:.0f} KiB ({counts['requests']}) | "
            f"{report.written / 1024:.0f} KiB | {push_whole:.2f} s |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args()
    runs = [(4, 8)] if args.quick else [(16, 8), (64, 8), (256, 8), (64, 64)]
    work = tempfile.mkdtemp(prefix="nbkit-bench-compose-")
    emu = GCSEmulator(Path(work) / "emu", backend="memory").start()
    try:
        rows = [one(emu, work, mib, nparts) for mib, nparts in runs]
    finally:
        emu.kill()
    table = "\n".join([
        "## Compose: the gs:// merge of a cache's parts (GCS emulator, in memory)",
        "",
        "| cache | parts | compose requests | push parts (workers' work, serial here) | check parts + compose | "
        "workers' check | compose total | driver sent / received (requests) | driver wrote | nbkit.push of the whole cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows, ""])
    print(table)
    if not args.quick:
        Path(args.results).mkdir(parents=True, exist_ok=True)
        Path(args.results, "compose.md").write_text(table)


if __name__ == "__main__":
    main()
