"""Build benchmark (issue 29): one cache built by many workers with ``nbkit.cluster.run``, against
today's ``warmup(num_workers=N)`` on the same source in the same run.

Five tables, written to ``results/build.md``:

0. **warmup(num_workers=2) against a raw epoch** (issue 40) on the MNIST and JPEG workloads of
   ``bench_engine.py``: parts placed in the cache's files (now), placed with large rows stacked first
   (before ``format.Rows``) and copied in by the merge (before, ``driver.PLACED = False``), interleaved; targets ≤ 0.6× (MNIST) and ≤ 0.65× (JPEG). Alone:
   ``--epochs-only`` (``--results DIR``: ``DIR/build-epochs.md``).

1. **Throughput**: an MNIST-shaped source (1x28x28 float32 and a label) with ``--cost`` µs of
   pure-Python work a sample (a decode-and-resize stand-in, ``tests/cluster/measure_build.Costly``),
   built with 1 and 2 workers by ``warmup(num_workers=N)``, ``LocalEngine(N)``, a Dask
   ``LocalCluster`` of N workers and (full run, when installed) a local Ray instance of N CPUs.
   Rounds are interleaved; the median of each is reported, and its ratio to ``warmup`` with as many
   workers (target: at most 1.15). A cluster's start is timed apart (it is paid once per session).
2. **Per-part costs**: one part built by ``build_part`` (a worker's cost) and merged by ``merge``
   (the driver's cost), serially, so each is measured alone; placed and copied.
3. **Projection**: build time against worker count from those per-part costs. The driver merges
   parts one at a time while the workers build, so the time is about
   ``max(parts / W × build, parts × merge) + build + merge``; past ``W = build / merge`` workers the
   local merge bounds the build (a gs:// merge composes server-side, with no per-sample driver cost).
4. **Merge against cache size**: local (placed: records linked; copied: rows written in place
   through the driver) and gs:// (GCS compose on the emulator: only the index and metadata through
   the driver, counted on the wire).

Usage::

    .venv/bin/python benchmarks/bench_build.py            # full; writes benchmarks/results/build.md
    .venv/bin/python benchmarks/bench_build.py --quick    # small, no Ray: a smoke test (tests/test_benchmarks.py)
    .venv/bin/python benchmarks/bench_build.py --no-ray   # skip Ray (~15 s and ~1 GiB to start)

Example:
    >>> projected(parts=16, build=0.5, merge=0.05, workers=2)  # 8 rounds of 0.5 s, plus the tail
    4.55
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PATHS = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "cluster")]
sys.path[:0] = [p for p in PATHS if p not in sys.path]
# Workers of a Dask or Ray cluster import the source's class (measure_build.Costly) by name.
os.environ["PYTHONPATH"] = os.pathsep.join([*PATHS, *filter(None, [os.environ.get("PYTHONPATH")])])
os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"  # before gcsfs is imported (the emulator)

MiB = 1 << 20
#: The protocol may cost at most this much over today's warmup with as many workers (issue 29).
TARGET_RATIO = 1.15
WORKER_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: The projection's large build: ImageNet-1k's training split.
BIG = 1_281_167


def projected(parts: int, build: float, merge: float, workers: int) -> float:
    """Seconds to build ``parts`` parts with ``workers`` workers and one merging driver: the larger
    of the workers' rounds and the driver's merges, plus one part's build and merge (the pipeline's
    fill and drain)."""
    return round(max(math.ceil(parts / workers) * build, parts * merge) + build + merge, 2)


# -- 1. throughput --------------------------------------------------------------------------------


def _builds(n_workers, engines):
    """label -> fn(ds) for every way of filling a cache with ``n_workers`` workers."""
    from nbkit.cluster import LocalEngine, run

    def local(ds, part_size):
        with LocalEngine(n_workers, multiprocessing_context="fork") as engine:
            return run(ds, engine, part_size=part_size)

    out = {f"`warmup(num_workers={n_workers})`": lambda ds, part_size: ds.warmup(num_workers=n_workers,
                                                                                multiprocessing_context="fork"),
           f"`LocalEngine({n_workers})`": local}
    for name, engine in engines.items():
        out[f"{name} ({n_workers} worker{'s' if n_workers > 1 else ''})"] = \
            lambda ds, part_size, engine=engine: run(ds, engine, part_size=part_size)
    return out


def _ready() -> int:
    """A cluster's warm-up task (pickled by value by Dask's and Ray's cloudpickle)."""
    import importlib

    for module in ("nbkit.cluster.part", "nbkit.dataset"):  # torch, and what unpickling the source's CachedDataset imports
        importlib.import_module(module)

    time.sleep(0.1)  # long enough that the tasks spread over every worker
    return os.getpid()


def start_clusters(names, n_workers) -> tuple[dict, dict]:
    """{label: engine} of the clusters asked for and installed, and {label: seconds to start}."""
    from nbkit.cluster.engine import engine_for

    engines, started = {}, {}
    for name in names:
        t0 = time.perf_counter()
        engines[name.capitalize()] = engine_for(name, workers=n_workers)
        # The workers are up and have imported torch and nbkit (a spawned worker's first part would
        # pay ~2 s of imports that a forked warmup worker inherits): part of a session's start.
        for future in [engines[name.capitalize()].submit(_ready) for _ in range(4 * n_workers)]:
            future.result()
        started[name.capitalize()] = time.perf_counter() - t0
    return engines, started


def throughput(work, n, cost, part_size, rounds, clusters) -> tuple[list[str], dict, dict]:
    """Table rows, {label: ratio to warmup} and {label: median seconds} of every build of ``n`` samples."""
    import nbkit
    from measure_build import Costly

    src = Costly(n, cost)
    times: dict = {}
    starts: dict = {}
    order = []
    count = 0
    for n_workers in (1, 2):
        engines, started = start_clusters(clusters, n_workers)
        starts.update({f"{k} ({n_workers} worker{'s' if n_workers > 1 else ''})": v for k, v in started.items()})
        try:
            builds = _builds(n_workers, engines)
            order += list(builds)
            for r in range(rounds):
                for label, fn in builds.items():
                    count += 1
                    path = os.path.join(work, f"throughput-{count}")
                    ds = nbkit.CachedDataset(src, path, fingerprint_samples=0)
                    t0 = time.perf_counter()
                    fn(ds, part_size)
                    dt = time.perf_counter() - t0
                    assert len(ds.missing()) == 0, label
                    ds.close()
                    shutil.rmtree(path)
                    times.setdefault(label, []).append(dt)
                    print(f"  {label:38s} round {r}: {dt:6.2f} s ({n / dt:,.0f} samples/s)", flush=True)
        finally:
            for engine in engines.values():
                engine.close()
    rows, ratios = [], {}
    medians = {label: statistics.median(times[label]) for label in order}
    for label in order:
        t = medians[label]
        n_workers = 1 if "(1" in label or "=1)" in label else 2
        base = medians[f"`warmup(num_workers={n_workers})`"]
        ratio = t / base
        verdict = "reference" if label.startswith("`warmup") else ("PASS" if ratio <= TARGET_RATIO else "MISS")
        if verdict != "reference":
            ratios[label] = ratio
        start = f"{starts[label]:.1f} s" if label in starts else "–"
        rows.append(f"| {label} | {n_workers} | {t:.2f} s | {n / t:,.0f} | {ratio:.2f} | {verdict} | {times[label][0]:.2f} s "
                    f"| {start} |")
    return rows, ratios, medians


# -- 0. warmup(num_workers=2) against a raw epoch: placed parts (now) and copied parts (before) ------


def warmup_vs_raw(data_dir, names, rounds: int, quick: bool) -> tuple[list[str], dict]:
    """Table rows and {label: ratio} of ``warmup(num_workers=2)`` against one raw epoch of the same
    source (``DataLoader(batch_size=256, shuffle=True, num_workers=0)``, as ``bench_engine.py``), with
    parts placed in the cache's files (``driver.PLACED``, today) and copied in by the merge (before),
    interleaved in one run; the best of ``rounds`` each, a fresh cache every time."""
    import torch

    import nbkit
    import nbkit.cluster.driver as driver
    import workloads
    from nbkit.cachedir import CacheFiles
    from nbkit.cluster.part import PlacedStore

    torch.set_num_threads(1)  # as bench_engine's measuring processes (and every DataLoader or warmup worker)
    rows, ratios = [], {}
    for name in names:
        spec = workloads.build(name, data_dir, quick=quick)
        src = workloads.source(spec)
        times: dict = {}
        runs = [("raw", None), ("placed", True), ("stacked", True), ("copied", False)]
        for r in range(rounds):
            # Each round in another order: on a VM the first run after a large free pays for the memory
            # the host reclaimed meanwhile (a 2.4 GB JPEG cache's page cache: up to 1.5x its time).
            for label, placed in runs[r % len(runs):] + runs[:r % len(runs)]:
                if placed is None:
                    t0 = time.perf_counter()
                    for _ in torch.utils.data.DataLoader(src, batch_size=256, shuffle=True, num_workers=0):
                        pass
                    times.setdefault("raw", []).append(time.perf_counter() - t0)
                    continue
                path = tempfile.mkdtemp(prefix=f"nbkit-bench-epoch-{name}-")
                driver.PLACED = placed
                # "stacked": placed, but a column of large rows stacked into one batch array before
                # its write (the code before format.Rows); "copied" stacks too, as it did.
                CacheFiles.takes_rows = PlacedStore.takes_rows = label == "placed"
                try:
                    t0 = time.perf_counter()
                    ds = nbkit.CachedDataset(src, path)
                    ds.warmup(num_workers=2, multiprocessing_context="fork")
                    times.setdefault(label, []).append(time.perf_counter() - t0)
                    assert len(ds.missing()) == 0
                    ds.close()
                finally:
                    driver.PLACED = True
                    CacheFiles.takes_rows = PlacedStore.takes_rows = True
                    shutil.rmtree(path, ignore_errors=True)
            print(f"  {name} round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
        raw = min(times["raw"])
        target = EPOCH_TARGETS[name]
        for label, what in (("placed", "placed in the cache's files, large rows written from the samples' own arrays (now)"),
                            ("stacked", "placed, large rows stacked into a batch array first (before `format.Rows`)"),
                            ("copied", "copied in by the merge (before parts were placed)")):
            ratio = min(times[label]) / raw
            ratios[f"{name} {label}"] = ratio
            verdict = ("PASS" if ratio <= target else "MISS") if label == "placed" else "–"
            rows.append(f"| {name} ({spec.n:,} samples) | parts {what} | {min(times[label]):.2f} s | {raw:.2f} s | "
                        f"{ratio:.2f}× | ≤ {target}× | {verdict} |")
    return rows, ratios


#: ``warmup(num_workers=2)`` at most this many raw epochs (issue 40).
EPOCH_TARGETS = {"mnist": 0.6, "jpeg": 0.65}


# -- 2. per-part costs, 3. projection -----------------------------------------------------------


def part_costs(work, n, cost, part_size) -> dict:
    """Median seconds of one part's build (a worker's work) and merge (the driver's), measured serially."""
    import nbkit
    from measure_build import Costly
    from nbkit.cluster.driver import _source, _spec
    from nbkit.cluster.merge import merge
    from nbkit.cluster.part import build_part, parts_dir
    from nbkit.cluster.plan import plan

    out = {"samples": part_size}
    for placed in (False, True):
        ds = nbkit.CachedDataset(Costly(n, cost), os.path.join(work, f"costs-{placed}"), fingerprint_samples=0)
        store, parts = ds.store, parts_dir(ds.root)
        source = _source(ds, None)
        builds, merges, sizes = [], [], []
        for p in plan(store, part_size):
            t0 = time.perf_counter()
            # A cluster worker's part: hashed (placed: its records only).
            done = build_part(_spec(p, ds, store.meta, {"parts": parts, "hashes": True, "placed": placed}, source))
            builds.append(time.perf_counter() - t0)
            path = os.path.join(parts, done["name"])
            sizes.append(sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)))
            t0 = time.perf_counter()
            merge(store, path)
            merges.append(time.perf_counter() - t0)
        assert len(ds.missing()) == 0
        ds.close()
        key = "" if placed else "copy_"
        out.update({f"{key}parts": len(builds), f"{key}build": statistics.median(builds),
                    f"{key}merge": statistics.median(merges), f"{key}part_bytes": statistics.median(sizes)})
    return out


def projection_rows(costs, measured: dict, n: int, big: int, part_size: int) -> list[str]:
    """Projected seconds against workers: this run's ``n`` (next to what was measured), and ``big``
    samples with a local merge (the driver merges each part) and on gs:// (compose: no driver merge)."""
    build, merge = costs["build"], costs["merge"]
    parts, big_parts = math.ceil(n / part_size), math.ceil(big / part_size)
    rows = []
    for w in WORKER_COUNTS:
        seen = f"{measured[w]:.2f} s" if w in measured else "–"
        local, remote = projected(big_parts, build, merge, w), projected(big_parts, build, 0.0, w)
        rows.append(f"| {w} | {projected(parts, build, merge, w):.2f} s | {seen} | {_duration(local)} | "
                    f"{_duration(remote)} |")
    return rows


def _duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


# -- 4. merge against cache size ---------------------------------------------------------------


class Rows4K:
    """Fixed-shape samples of 4 KiB (1,024 float32) and a short string in the heap (as bench_compose had)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        return torch.full((1024,), float(i)), f"sample-{i}"


def local_merge(work, mib, nparts, placed: bool = True) -> tuple[float, int]:
    """Seconds the driver spends merging ``nparts`` parts of a ``mib`` MiB cache, and the bytes it reads
    (``placed``: the parts' records only, their rows are in the cache's files already)."""
    import nbkit
    from nbkit.cluster.driver import _source, _spec
    from nbkit.cluster.merge import merge
    from nbkit.cluster.part import build_part, parts_dir
    from nbkit.cluster.plan import plan

    n = mib * MiB // 4096
    ds = nbkit.CachedDataset(Rows4K(n), os.path.join(work, f"merge-{mib}-{nparts}"), fingerprint_samples=0)
    shutil.rmtree(os.path.join(work, f"merge-{mib}-{nparts}.parts"), ignore_errors=True)
    store, parts = ds.store, parts_dir(ds.root)
    source = _source(ds, None)
    paths = [os.path.join(parts, build_part(_spec(p, ds, store.meta, {"parts": parts, "hashes": True, "placed": placed},
                                                  source))["name"])
             for p in plan(store, math.ceil(n / nparts))]
    read = sum(os.path.getsize(os.path.join(p, f)) for p in paths for f in os.listdir(p))
    t0 = time.perf_counter()
    for path in paths:
        merge(store, path)
    seconds = time.perf_counter() - t0
    assert len(ds.missing()) == 0
    ds.close()
    shutil.rmtree(os.path.join(work, f"merge-{mib}-{nparts}"))
    return seconds, read


def gs_compose(emu, work, mib, nparts) -> dict:
    """Parts of a ``mib`` MiB cache pushed beside it on the emulator (the workers' work), then composed;
    the driver's requests counted on the wire."""
    import nbkit
    from engine_calls import make_part
    from nbkit import format as fmt
    from nbkit.cluster import compose as composing

    n = mib * MiB // 4096
    src = Rows4K(n)
    bucket = emu.make_bucket()
    url = f"{bucket.url}/cache"
    whole = nbkit.CachedDataset(src, os.path.join(work, f"whole-{mib}-{nparts}"))
    whole.warmup()
    fingerprint = fmt.read_meta(whole.root)["fingerprint"]
    cuts = [n * k // nparts for k in range(nparts + 1)]
    t0 = time.perf_counter()
    for a, b in zip(cuts, cuts[1:]):
        root = make_part(src, a, b, os.path.join(work, f"p-{mib}-{nparts}-{a}"), fingerprint)
        nbkit.push(root, f"{composing.parts_url(url)}/{composing.part_name(a, b)}", storage_options=emu.storage_options)
    push_parts = time.perf_counter() - t0
    counts, undo = _count_wire()
    try:
        report = composing.compose(url, storage_options=emu.storage_options, engine="processes")
    finally:
        undo()
    t0 = time.perf_counter()
    nbkit.push(whole.root, f"{bucket.url}/pushed", storage_options=emu.storage_options)
    push_whole = time.perf_counter() - t0
    whole.close()
    return {"push_parts": push_parts, "report": report, "push_whole": push_whole, **counts}


def _count_wire():
    """Count what the driver's gcsfs sends and receives, per request; returns (counts, undo)."""
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


def merge_rows(work, sizes, gs: bool) -> list[str]:
    emu = None
    if gs:
        from fixtures_gcs import GCSEmulator

        emu = GCSEmulator(Path(work) / "emu", backend="memory").start()
    rows = []
    try:
        for mib, nparts in sizes:
            local_s, read = local_merge(work, mib, nparts)
            copy_s, copy_read = local_merge(work, mib, nparts, placed=False)
            cell = "| – | – | – | – |"
            if emu is not None:
                g = gs_compose(emu, work, mib, nparts)
                r = g["report"]
                cell = (f"| {r.seconds:.2f} s ({r.compose_requests} composes; workers' check {r.check_seconds:.2f} s) | "
                        f"{g['sent'] / 1024:,.0f} KiB / {g['received'] / 1024:,.0f} KiB ({g['requests']}) | "
                        f"{g['push_parts']:.2f} s | {g['push_whole']:.2f} s |")
            rows.append(f"| {mib} MiB ({mib * MiB // 4096:,} samples) | {nparts} | {local_s * 1e3:,.1f} ms | {read / 1024:,.1f} KiB "
                        f"| {copy_s:.2f} s ({mib / copy_s:,.0f} MiB/s) | {copy_read / MiB:,.1f} MiB {cell}")
    finally:
        if emu is not None:
            emu.kill()
    return rows


# -- the report ---------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one round, no Ray: a smoke test")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray rows (a local instance: ~15 s, ~1 GiB)")
    ap.add_argument("--results", help="where build.md goes (default: benchmarks/results; --quick: printed only)")
    ap.add_argument("--samples", type=int, help="samples of the throughput source (default 16,000; quick 1,536)")
    ap.add_argument("--cost", type=float, default=200.0, help="µs of work a sample (default 200)")
    ap.add_argument("--epochs-only", action="store_true",
                    help="only warmup(num_workers=2) against a raw epoch (MNIST and JPEG; placed and copied parts)")
    ap.add_argument("--data-dir", default=None, help="where the MNIST and JPEG workloads are built (default: bench-data/)")
    args = ap.parse_args(argv)
    import workloads

    data_dir = args.data_dir or workloads.DEFAULT_DATA_DIR
    epoch_names = ("mnist",) if args.quick else ("mnist", "jpeg")
    print(f"warmup(num_workers=2) against a raw epoch: {', '.join(epoch_names)}", flush=True)
    epoch_rows, _ = warmup_vs_raw(data_dir, epoch_names, 1 if args.quick else 3, args.quick)
    epochs = [
        "### `warmup(num_workers=2)` against one raw epoch (issue 40)",
        "",
        "The benchmark workloads (`benchmarks/workloads.py`, as `bench_engine.py` measures them): one raw epoch is "
        "`DataLoader(source, batch_size=256, shuffle=True, num_workers=0)`; a warmup is a fresh cache built by "
        "`warmup(num_workers=2)` (fork), construction included; one thread per process; best of "
        f"{1 if args.quick else 3} interleaved round(s), each in another order (raw, placed, stacked, copied; then rotated). "
        "Parts placed in the cache's files (a worker writes each sample once, a column of rows of 64 KiB or more "
        "from the samples' own arrays; the merge links records) against the same with every column stacked into one "
        "batch array first (the code before `format.Rows`: `CacheFiles.takes_rows = False`) and parts copied in by the "
        "merge (the code before parts were placed, `driver.PLACED = False`).",
        "",
        "| workload | warmup(num_workers=2) | time | raw epoch | × raw epoch | target | |",
        "|---|---|---|---|---|---|---|",
        *epoch_rows,
        "",
    ]
    if args.epochs_only:
        table = "\n".join(epochs)
        print(table)
        if args.results:
            Path(args.results).mkdir(parents=True, exist_ok=True)
            # A section of its own in BENCHMARKS.md (in build.md it is a subsection).
            Path(args.results, "build-epochs.md").write_text(table.replace("### ", "## ", 1))
        return 0

    n = args.samples or (1536 if args.quick else 16_000)
    part_size = 256 if args.quick else 1024
    rounds = 1 if args.quick else 3
    have = {name: importlib.util.find_spec(module) is not None for name, module in (("dask", "distributed"), ("ray", "ray"))}
    clusters = [c for c in ("dask", "ray") if have[c] and not (c == "ray" and (args.quick or args.no_ray))]
    gs = importlib.util.find_spec("gcsfs") is not None
    sizes = [(4, 8)] if args.quick else [(16, 8), (64, 8), (256, 8), (64, 64)]

    work = tempfile.mkdtemp(prefix="nbkit-bench-build-")
    try:
        print(f"throughput: {n:,} samples, {args.cost:g} µs each, parts of {part_size}; {rounds} rounds", flush=True)
        rows, ratios, medians = throughput(work, n, args.cost, part_size, rounds, clusters)
        print("per-part costs", flush=True)
        costs = part_costs(work, n, args.cost, part_size)
        measured = {w: medians[f"`LocalEngine({w})`"] for w in (1, 2)}
        print("merge against cache size", flush=True)
        merges = merge_rows(work, sizes, gs)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    install = {"dask": "pip install 'dask[distributed]'", "ray": "pip install ray"}
    skipped = [f"{c} (not installed: {install[c]})" for c in ("dask", "ray") if not have[c]]
    if "ray" not in clusters and have["ray"]:
        skipped.append("ray (--quick or --no-ray)")
    lines = [
        "## Build on many workers (issue 29)",
        "",
        *(["Quick mode (a smoke test): small sizes, one round; not for quoting.", ""] if args.quick else []),
        f"`benchmarks/bench_build.py`: {n:,} MNIST-shaped samples (1×28×28 float32 and a label) with {args.cost:g} µs of "
        f"pure-Python work each, parts of {part_size}, fork; median of {rounds} interleaved round(s). The ratio is to "
        f"`warmup(num_workers=N)` with as many workers, measured in the same run; target ≤ {TARGET_RATIO}. A cluster's "
        "start (paid once per session, not per build) is timed apart; its workers' first build also loads the source "
        "(unpickled once per worker process): the first round shows it."
        + (f" Not run: {', '.join(skipped)}." if skipped else ""),
        "",
        "| build | workers | time | samples/s | ratio to warmup | target | first round | cluster start |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *epochs,
        "### Per-part costs and a projection against worker count",
        "",
        f"One part of {costs['samples']:,} samples, measured serially: built by "
        f"a worker in {costs['build'] * 1e3:,.0f} ms ({costs['build'] / costs['samples'] * 1e6:,.0f} µs a sample), "
        f"verified and merged by the driver in {costs['merge'] * 1e3:,.1f} ms "
        f"({costs['merge'] / costs['samples'] * 1e6:,.1f} µs a sample; its rows placed in the cache's files by the "
        f"worker, the part holds {costs['part_bytes'] / 1024:,.0f} KiB of records). Before (parts copied in by the merge): "
        f"built in {costs['copy_build'] * 1e3:,.0f} ms, a part of {costs['copy_part_bytes'] / 1024:,.0f} KiB verified "
        f"and merged in {costs['copy_merge'] * 1e3:,.0f} ms. With the driver merging one part at a time while "
        f"the workers build, a build of P parts takes about `max(ceil(P / W) × build, P × merge) + "
        f"build + merge`: the local merge bounds it past W ≈ {costs['build'] / costs['merge']:.0f} workers "
        f"(≈ {costs['copy_build'] / costs['copy_merge']:.0f} before). A gs:// "
        "cache is merged by server-side compose instead (no per-sample driver work: the table below), so there the "
        "workers and the storage bound it. Measured: `LocalEngine` with 1 and 2 workers above (2 shared cores here: "
        "more workers than cores cannot be measured on this machine).",
        "",
        f"| workers | {n:,} samples, projected | measured (`LocalEngine`) | {BIG:,} samples (ImageNet-1k's size), "
        "local merge | the same on gs:// (compose: no per-part driver merge) |",
        "|---|---|---|---|---|",
        *projection_rows(costs, measured, n, BIG, part_size),
        "",
        "### Merge against cache size",
        "",
        "4 KiB rows and a short string in the heap a sample. Local: the workers placed each part's rows and blobs in "
        "the cache's files; the driver checks each part's records (sha256 of its index, every record) and links them "
        "into the cache's index: no sample byte passes through it. Before (copied): the driver verified each part "
        "(sha256 and every sample's CRC) and wrote its rows in place, every sample byte through it. gs:// (GCS emulator, in "
        "memory): the parts are pushed beside the cache (the workers' work, serial here) and composed server-side; the "
        "driver sends and receives only the index and the metadata (counted per request on the wire), and workers read "
        "each composed file once against the parts' sha256s. For scale, `nbkit.push` of the same cache built whole.",
        "",
        "| cache | parts | local merge | bytes through the driver, local | local merge, copied (before) | bytes through "
        "the driver, copied | gs:// compose | driver sent / received, gs:// (requests) | push parts (workers) | "
        "`nbkit.push` of the whole cache |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *merges,
        "",
    ]
    table = "\n".join(lines)
    print(table)
    results = args.results or (None if args.quick else str(HERE / "results"))
    if results:  # a quick run never replaces the full results
        Path(results).mkdir(parents=True, exist_ok=True)
        Path(results, "build.md").write_text(table)
    misses = [label for label, r in ratios.items() if r > TARGET_RATIO]
    if misses and not args.quick:
        print(f"above the {TARGET_RATIO} target: {', '.join(misses)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
