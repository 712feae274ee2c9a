"""Hugging Face ``datasets`` as a measured peer: build time and shuffled epochs of nbkit, HF's default
path, HF's fast paths and the in-RAM limit, on the same workloads, in one run.

Colab keeps preprocessed samples in HF ``datasets`` as often as anywhere: ``Dataset.from_generator``
writes an Arrow cache, ``with_format("torch")`` reads it. For each workload of
``benchmarks/workloads.py`` (MNIST-format 60,000 × 1×28×28; JPEG 4,000 × 3×224×224) this builds, from
the same torchvision source and in turn:

* **in-RAM limit**: one pass over the source into one tensor; an epoch gathers ``X[idx]``;
* **nbkit**: ``CachedDataset(source, path)`` + ``warmup()``; epochs through ``ds.loader(256)`` (its
  documented fast read) and through ``DataLoader(ds, 256, shuffle=True)``;
* **HF default**: ``Dataset.from_generator`` over the source's samples (features inferred: nested
  lists), ``with_format("torch")``, ``DataLoader(hf, 256, shuffle=True)``;
* **HF ``Array3D``**: the same with explicit ``Array3D`` features, which HF's "Use with PyTorch" guide
  asks for to avoid "slow shape comparisons and data copies"; read two ways: exact shuffle, one
  ``hf[indices]`` batch read per shuffled batch of 256; and HF's advice for fast shuffled training
  ("Differences between Dataset and IterableDataset"): ``to_iterable_dataset(num_shards=64)``,
  ``.shuffle(seed=epoch, buffer_size=1000)``, ``.iter(batch_size=256)`` — an *approximate* shuffle
  (shard order plus a 1,000-sample buffer).

Batches of 256, ``num_workers=0``, one thread, every reader's first epoch (untimed) checks that it
served every sample once with the right values; then the timed epochs, the readers interleaved.

HF ``datasets`` is never a dependency of nbkit. A full run measures Colab's version (4.8.5, which caps
fsspec at 2026.2.0) in an environment of its own: ``.venvs/hf-datasets-4.8.5``, installed here with
``pip --no-deps --target`` on first use and put first on the path of a second process; the rest of its
needs come from the stack's venv (the ``dev`` extra holds ``datasets``). ``--quick`` (the tests) and
``--datasets installed`` use the stack's own ``datasets`` and never install.

Run: ``.venv/bin/python benchmarks/bench_hf.py [--quick] [--only mnist]``; writes
``benchmarks/results/hf.md`` and ``hf.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import workloads

HF_VERSION = "4.8.5"
# Colab's TPU runtime's datasets and, at the versions pip resolves for it beside torch 2.9 on Python
# 3.13, what it needs that may be missing or newer in the stack's venv. --no-deps: everything else
# (numpy, requests, httpx, tqdm, pyyaml, ...) stays the stack's own.
HF_PINS = ("datasets==4.8.5", "fsspec==2026.2.0", "huggingface_hub==1.33.0", "hf-xet==1.8.0", "dill==0.4.1",
           "multiprocess==0.70.19", "pyarrow==26.0.1", "pandas==3.1.1", "xxhash==4.1.0")
HF_ENV = ROOT / ".venvs" / f"hf-datasets-{HF_VERSION}"
_IN_ENV = "NBKIT_BENCH_HF_ENV"  # set in the second process: do not build or re-run again

BATCH = 256
SHARDS, BUFFER = 64, 1000

BUILDS = ("in-RAM", "nbkit", "HF default", "HF Array3D")
# reader -> (its build, its label in the table, its shuffle)
READERS = {
    "ram": ("in-RAM", "in-RAM limit: one tensor, `X[idx]`", "exact"),
    "nbkit_loader": ("nbkit", "nbkit `ds.loader(256)`", "exact"),
    "nbkit_dataloader": ("nbkit", "nbkit `DataLoader(ds, 256, shuffle=True)`", "exact"),
    "hf_default": ("HF default", "HF default: `with_format(\"torch\")`, `DataLoader(hf, 256, shuffle=True)`", "exact"),
    "hf_take": ("HF Array3D", "HF `Array3D`, `with_format(\"torch\")`, `hf[indices]` per batch", "exact"),
    "hf_iterable": ("HF Array3D", f"HF `Array3D`, `to_iterable_dataset({SHARDS})`, `.shuffle(buffer_size={BUFFER})`, "
                                  f"`.iter(256)`", f"approximate ({SHARDS} shards, {BUFFER:,}-sample buffer)"),
}


# -- the environment (a full run measures Colab's datasets) -----------------------------------------


def hf_env() -> Path:
    """``.venvs/hf-datasets-4.8.5``, installed once (``pip --no-deps --target``); raises on failure."""
    marker = HF_ENV / ".complete"
    if marker.exists() and marker.read_text() == "\n".join(HF_PINS):
        return HF_ENV
    shutil.rmtree(HF_ENV, ignore_errors=True)
    HF_ENV.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-deps",
                    "--target", str(HF_ENV), *HF_PINS], check=True)
    marker.write_text("\n".join(HF_PINS))
    return HF_ENV


def rerun_in_env(argv) -> int | None:
    """Run this script again with Colab's datasets first on the path; None when it cannot be installed."""
    try:
        env_dir = hf_env()
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"bench_hf: could not install datasets {HF_VERSION} into {HF_ENV} ({e}); measuring the installed "
              "datasets instead", file=sys.stderr, flush=True)
        return None
    env = dict(os.environ, **{_IN_ENV: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(env_dir), str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, __file__, *argv], env=env, check=False).returncode


# -- building -------------------------------------------------------------------------------------


def _samples(source):
    """HF generators yield dicts; ``from_generator`` hashes this closure (the source with it) for its cache key."""
    def gen():
        for i in range(len(source)):
            x, y = source[i]
            yield {"image": x, "label": y}
    return gen


def _samples_numpy(source):
    def gen():
        for i in range(len(source)):
            x, y = source[i]
            yield {"image": x.numpy(), "label": y}
    return gen


def build(kind: str, source, scratch: Path):
    """Build ``kind`` from ``source`` under ``scratch``; return (the built object, seconds)."""
    import torch

    start = time.perf_counter()
    if kind == "in-RAM":
        xs, ys = zip(*(source[i] for i in range(len(source))))
        built = (torch.stack(xs), torch.tensor(ys))
    elif kind == "nbkit":
        import nbkit

        built = nbkit.CachedDataset(source, scratch / "nbkit")
        built.warmup()
    else:
        from datasets import Array3D, Dataset, Features, Value

        if kind == "HF default":
            built = Dataset.from_generator(_samples(source), cache_dir=str(scratch / "hf-default"))
        else:
            shape = tuple(source[0][0].shape)
            features = Features({"image": Array3D(shape=shape, dtype="float32"), "label": Value("int64")})
            built = Dataset.from_generator(_samples_numpy(source), features=features, cache_dir=str(scratch / "hf-array3d"))
    return built, time.perf_counter() - start


def footprint(path: Path) -> int:
    return sum(f.stat().st_blocks * 512 for f in path.rglob("*") if f.is_file()) if path.exists() else 0


# -- reading --------------------------------------------------------------------------------------


def reader(name: str, built, n: int):
    """A function of the epoch number that yields (images, labels) batches for one shuffled epoch."""
    import torch
    from torch.utils.data import DataLoader

    if name == "ram":
        X, Y = built

        def epoch(e):
            g = torch.Generator().manual_seed(e)
            for idx in torch.randperm(n, generator=g).split(BATCH):
                yield X[idx], Y[idx]
    elif name == "nbkit_loader":
        loader = built.loader(BATCH, seed=0)

        def epoch(e):
            yield from loader
    elif name == "nbkit_dataloader":
        def epoch(e):
            yield from DataLoader(built, BATCH, shuffle=True, generator=torch.Generator().manual_seed(e))
    elif name == "hf_default":
        hf = built.with_format("torch")

        def epoch(e):
            for b in DataLoader(hf, BATCH, shuffle=True, generator=torch.Generator().manual_seed(e)):
                yield b["image"], b["label"]
    elif name == "hf_take":
        hf = built.with_format("torch")

        def epoch(e):
            g = torch.Generator().manual_seed(e)
            for idx in torch.randperm(n, generator=g).split(BATCH):
                b = hf[idx]
                yield b["image"], b["label"]
    elif name == "hf_iterable":
        it = built.to_iterable_dataset(num_shards=SHARDS).with_format("torch")

        def epoch(e):
            for b in it.shuffle(seed=e, buffer_size=BUFFER).iter(batch_size=BATCH):
                yield b["image"], b["label"]
    else:
        raise ValueError(f"unknown reader {name!r}")
    return epoch


def timed(epoch, e: int) -> float:
    start = time.perf_counter()
    for _ in epoch(e):
        pass
    return time.perf_counter() - start


def check(epoch, reference) -> str:
    """One untimed epoch: every sample once, with the source's values (sums of labels and of images)."""
    count, labels, pixels = 0, 0, 0.0
    for x, y in epoch(10_000):
        count += len(y)
        labels += int(y.sum())
        pixels += float(x.double().sum())
    n, label_sum, pixel_sum = reference
    ok = count == n and labels == label_sum and abs(pixels - pixel_sum) <= 1e-6 * max(1.0, abs(pixel_sum)) + 1e-3 * n
    return "ok" if ok else f"WRONG DATA ({count} samples, label sum {labels}, pixel sum {pixels:.6g})"


# -- one workload ---------------------------------------------------------------------------------


def run_workload(name: str, args) -> dict:
    import torch

    spec = workloads.build(name, args.data_dir, quick=args.quick)
    source = workloads.source(spec)
    n = len(source)
    repeat = args.repeat or (3 if args.quick or name == "jpeg" else 5)
    scratch = Path(tempfile.mkdtemp(prefix=f"nbkit-bench-hf-{name}-", dir=args.scratch))
    result = {"workload": workloads.describe(spec), "n": n, "repeat": repeat, "builds": {}, "epochs": {}, "checks": {},
              "footprint": {}}
    load = [os.getloadavg()[0]]
    try:
        built = {}
        for kind in BUILDS:
            built[kind], seconds = build(kind, source, scratch)
            result["builds"][kind] = seconds
            print(f"{name}: built {kind} in {seconds:.2f} s", flush=True)
        X, Y = built["in-RAM"]
        reference = (n, int(Y.sum()), float(X.double().sum()))
        result["footprint"] = {"nbkit": footprint(scratch / "nbkit"), "HF default": footprint(scratch / "hf-default"),
                               "HF Array3D": footprint(scratch / "hf-array3d"), "in-RAM": X.nbytes + Y.nbytes}
        epochs = {r: reader(r, built[READERS[r][0]], n) for r in READERS}
        for r, epoch in epochs.items():
            result["checks"][r] = check(epoch, reference)
            result["epochs"][r] = []
        for e in range(repeat):  # interleaved: each reader once per round
            for r, epoch in epochs.items():
                result["epochs"][r].append(timed(epoch, e))
            load.append(os.getloadavg()[0])
            print(f"{name}: round {e + 1}/{repeat}: " + ", ".join(f"{r} {result['epochs'][r][-1]:.3f} s" for r in epochs),
                  flush=True)
        del built, epochs
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result["load"] = load
    result["threads"] = torch.get_num_threads()
    return result


# -- the table ------------------------------------------------------------------------------------


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _median_range(xs) -> str:
    return f"{_s(statistics.median(xs))} ({_s(min(xs))}–{_s(max(xs))})"


def render(data: dict) -> str:
    quick = data["quick"]
    lines = [
        "## Hugging Face `datasets`: build and shuffled epochs against nbkit (issue 40)",
        "",
        f"`datasets` {data['datasets']}, pyarrow {data['pyarrow']}, torch {data['torch']}, Python {data['python']}. "
        "Batches of 256, `num_workers=0`, one thread; builds one at a time, then every reader's first epoch "
        "(untimed) checks that it served each sample once with the source's values; then the timed epochs, the "
        "readers interleaved (one epoch each per round): medians with the fastest and slowest. "
        f"Load average (1 min) during the run: {min(data['load']):.1f}–{max(data['load']):.1f} on "
        f"{data['cpus']} CPUs, shared with other work."
        + (" **Quick mode**: a smoke test, not a measurement." if quick else ""),
        "",
    ]
    if data.get("note"):
        lines += [data["note"], ""]
    for name, w in data["workloads"].items():
        n, b, ep = w["n"], w["builds"], w["epochs"]
        sample = "1×28×28 float32" if name == "mnist" else "3×224×224 float32"
        ram, nb = statistics.median(ep["ram"]), statistics.median(ep["nbkit_loader"])
        lines += [
            f"### {name}: {n:,} samples of ({sample}, int), {w['repeat']} timed epochs each",
            "",
            "| build | seconds | × one pass over the source | on disk |",
            "|---|---|---|---|",
        ]
        one_pass = b["in-RAM"]
        what = {"in-RAM": "in-RAM: one pass over the source, `torch.stack`",
                "nbkit": "nbkit: `CachedDataset(source, path)` + `warmup()`",
                "HF default": "HF default: `Dataset.from_generator`, features inferred",
                "HF Array3D": "HF: `Dataset.from_generator(features=Array3D…)`"}
        for kind in BUILDS:
            disk = w["footprint"].get(kind, 0)
            where = "in RAM" if kind == "in-RAM" else "on disk"
            lines.append(f"| {what[kind]} | {_s(b[kind])} | {b[kind] / one_pass:.2f}× | {disk / 2**20:,.1f} MiB {where} |")
        lines += [
            "",
            "| epoch | median (range) | × in-RAM limit | × nbkit `ds.loader` | shuffle | data |",
            "|---|---|---|---|---|---|",
        ]
        for r, (_, label, shuffle) in READERS.items():
            m = statistics.median(ep[r])
            lines.append(f"| {label} | {_median_range(ep[r])} | {m / ram:.1f}× | {m / nb:.1f}× | {shuffle} | "
                         f"{w['checks'][r]} |")
        lines.append("")
    return "\n".join(lines)


def versions() -> dict:
    import platform

    import pyarrow
    import torch

    import datasets

    return {"datasets": datasets.__version__, "pyarrow": pyarrow.__version__, "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count()}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small workloads, for a smoke test")
    p.add_argument("--only", action="append", choices=workloads.WORKLOADS, help="one workload (repeatable)")
    p.add_argument("--repeat", type=int, default=0, help="timed epochs per reader (default 5 for MNIST, 3 for JPEG)")
    p.add_argument("--datasets", choices=("colab", "installed"), default=None,
                   help=f"colab: datasets {HF_VERSION} in {HF_ENV.relative_to(ROOT)} (the default of a full run); "
                        "installed: the stack's own (the default with --quick)")
    p.add_argument("--data-dir", default=str(workloads.DEFAULT_DATA_DIR))
    p.add_argument("--scratch", default=None, help="where the caches are built (default: the system's temp dir)")
    p.add_argument("--results", default=str(HERE / "results"))
    args = p.parse_args(argv)

    wanted = args.datasets or ("installed" if args.quick else "colab")
    note = ""
    if wanted == "colab" and not os.environ.get(_IN_ENV):
        rc = rerun_in_env(argv)
        if rc is not None:
            return rc
        note = f"**Not Colab's `datasets` {HF_VERSION}**: installing it into `{HF_ENV.relative_to(ROOT)}` failed."

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the Hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    import datasets

    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    info = versions()
    if wanted == "colab" and not note and info["datasets"] != HF_VERSION:
        note = f"**Not Colab's `datasets` {HF_VERSION}**: {info['datasets']} was imported."
    data = {**info, "quick": args.quick, "note": note, "workloads": {}, "load": []}
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only or workloads.WORKLOADS:
        w = run_workload(name, args)
        data["workloads"][name] = w
        data["load"] += w["load"]
        table = render(data)  # after each workload: a run stopped later keeps what it measured
        (out / "hf.json").write_text(json.dumps(data, indent=1))
        (out / "hf.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
