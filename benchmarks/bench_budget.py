"""Byte budget: epoch time vs cached fraction (0, 25, 50, 75, 100 %) on the JPEG workload.

With ``max_bytes`` a cache holds a fixed, evenly spread subset of the samples; the rest are
computed from the source on every read. A shuffled epoch should then cost
``(1 - f) × raw + f × cached``: the speedup grows with the fraction ``f`` as stocaching reports.

Run: ``.venv/bin/python benchmarks/bench_budget.py [--quick]``; writes
``benchmarks/results/budget.md`` and ``benchmarks/results/budget.png``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import nbkit
import workloads

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)


def epoch(ds, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=0, collate_fn=nbkit.collate, generator=g)
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small workload, for a smoke test")
    parser.add_argument("--data-dir", default=str(workloads.DEFAULT_DATA_DIR))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    work = workloads.build("jpeg", args.data_dir, quick=args.quick)
    source = workloads.source(work)
    n = len(source)
    sample = source[0]
    row = sample[0].numel() * sample[0].element_size() + 8
    scratch = Path(tempfile.mkdtemp(prefix="nbkit-budget-"))
    rows = []
    try:
        raw = min(epoch(source, 0), epoch(source, 3))  # and once more at the end
        for f in FRACTIONS:
            path = scratch / f"f{int(f * 100)}"
            budget = n * 24 + int(f * n) * row
            ds = nbkit.CachedDataset(source, path, max_bytes=budget)
            warm = ds.warmup()
            ds.reset_stats()
            seconds = min(epoch(ds, 1), epoch(ds, 2))
            s = ds.stats
            rows.append({"fraction": f, "cached": s.cached, "warmup": warm.seconds, "epoch": seconds,
                         "hit_rate": s.hit_rate, "speedup": raw / seconds})
            print(f"fraction {f:4.0%}: cached {s.cached}/{n}, epoch {seconds:.2f}s, hit rate {s.hit_rate:.1%}, "
                  f"speedup {raw / seconds:.2f}x", flush=True)
            shutil.rmtree(path)
        raw = min(raw, epoch(source, 4))  # once more at the end: the machine's noise cuts both ways
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    # Linearity check: interpolate between the measured endpoints (all from the source, all cached).
    source_epoch, cached_epoch = rows[0]["epoch"], rows[-1]["epoch"]
    lines = [
        "## Byte budget: epoch time vs cached fraction (JPEG workload)",
        "",
        f"{n:,} JPEGs, 320 px → `Resize(256)`, `CenterCrop(224)`, `ToTensor`, `Normalize`; batch 256, shuffled, "
        "`num_workers=0`, `collate_fn=nbkit.collate`; best of 2 epochs after warmup, in one process. "
        f"Raw epoch (the source itself, best of 3): {raw:.2f} s. Expected epoch at fraction f: "
        "(1 − f) × (epoch at 0 %) + f × (epoch at 100 %), the straight line between the measured endpoints.",
        "",
        "| cached fraction | samples cached | hit rate | epoch | expected | speedup vs raw | warmup |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        expected = (1 - r["fraction"]) * source_epoch + r["fraction"] * cached_epoch
        lines.append(f"| {r['fraction']:.0%} | {r['cached']:,} | {r['hit_rate']:.1%} | {r['epoch']:.2f} s | "
                     f"{expected:.2f} s | {r['speedup']:.2f}× | {r['warmup']:.2f} s |")
    lines += ["", "![epoch time vs cached fraction](results/budget.png)", ""]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget.md").write_text("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot (pip install matplotlib)")
    else:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
        xs = [100 * r["fraction"] for r in rows]
        a.plot(xs, [r["epoch"] for r in rows], "o-", label="measured")
        a.plot(xs, [(1 - r["fraction"]) * source_epoch + r["fraction"] * cached_epoch for r in rows], "--",
               color="gray", label="straight line between 0 % and 100 %")
        a.axhline(raw, color="tab:red", lw=1, ls=":", label=f"raw source, no cache ({raw:.1f} s)")
        a.set_xlabel("cached fraction (%)")
        a.set_ylabel("epoch time (s)")
        a.set_title("Epoch time")
        a.legend(loc="lower left", fontsize=8)
        b.plot(xs, [r["speedup"] for r in rows], "o-", color="tab:green")
        b.set_xlabel("cached fraction (%)")
        b.set_ylabel("speedup vs raw (×)")
        b.set_title("Speedup")
        for ax in (a, b):
            ax.grid(alpha=0.3)
            ax.set_xticks(xs)
        fig.suptitle(f"nbkit byte budget (max_bytes), {n:,} JPEG samples")
        fig.tight_layout()
        fig.savefig(out / "budget.png", dpi=110)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
