"""Smoke tests of the benchmark harness (benchmarks/): it runs end to end and reports a table.

No timing is asserted here: speed targets are checked by the benchmark itself, on a full run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_engine
import run as bench_run
import workloads

# The benchmark scripts run end to end on one stack (make test); their figures come from make bench.
pytestmark = [pytest.mark.one_stack, pytest.mark.bench]


def _env():
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def _quick(script, tmp_path):
    """Run ``benchmarks/<script> --quick --only mnist``; return (its results folder, its stdout)."""
    results = tmp_path / "results"
    cmd = [sys.executable, str(BENCH / script), "--quick", "--only", "mnist",
           "--data-dir", str(tmp_path / "data"), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results, proc.stdout


@pytest.mark.slow
def test_bench_engine_quick_writes_a_table(tmp_path):
    results, stdout = _quick("bench_engine.py", tmp_path)

    table = (results / "engine.md").read_text()
    assert table.strip() in stdout  # printed and written
    assert "Quick mode" in table
    for row in ("in-RAM limit", "raw (torchvision MNIST)", "per-file", "nbkit, `collate_fn=nbkit.collate`",
                "nbkit, default collate", "nbkit, `num_workers=2`", "### Targets"):
        assert row in table, row
    # Every cache served the same first batch as the in-RAM copy of the source.
    assert "WRONG DATA" not in table
    assert table.count("| ok |") == 3
    target_rows = [ln for ln in table.splitlines() if ln.startswith("| MNIST")]
    assert len(target_rows) == len([t for t in bench_engine.TARGETS if t[0] == "mnist"])
    assert all(("| PASS |" in ln) or ("| MISS |" in ln) for ln in target_rows)

    data = json.loads((results / "engine.json").read_text())["workloads"]["mnist"]
    assert data["errors"] == []
    assert data["baseline"]["n"] == 2048
    assert data["baseline"]["raw_bytes"] == 2048 * (28 * 28 * 4 + 8)
    assert data["perfile_warm"]["footprint"]["files"] == 2048
    assert len(data["nbkit_nbkit"]["epochs"]) == 3
    # The caches were removed after measuring; only the workload remains.
    assert not (tmp_path / "data" / "work" / "mnist").exists()

    # The table can be re-rendered from the JSON alone, identically.
    cmd = [sys.executable, str(BENCH / "bench_engine.py"), "--render-only", "--results", str(results)]
    again = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (results / "engine.md").read_text() == table


def test_jpeg_workload_is_an_imagefolder_of_224px_samples(tmp_path):
    spec = workloads.build("jpeg", tmp_path, quick=True)
    ds = workloads.source(spec)
    assert len(ds) == spec.n == 320
    assert len(ds.classes) == 10
    img, label = ds[100]  # ImageFolder sorts by class: 32 images per class here
    assert tuple(img.shape) == (3, 224, 224) and label == 3
    # Structured images: JPEG compresses them well below what noise would take (~150 KB).
    sizes = [p.stat().st_size for p in (tmp_path / "jpeg-quick" / "images").rglob("*.jpg")]
    assert len(sizes) == 320 and max(sizes) < 60_000
    # A second build reuses the files instead of rewriting them.
    mtime = (tmp_path / "jpeg-quick" / "workload.json").stat().st_mtime_ns
    assert workloads.build("jpeg", tmp_path, quick=True) == spec
    assert (tmp_path / "jpeg-quick" / "workload.json").stat().st_mtime_ns == mtime


def test_assemble_keeps_the_intro_and_includes_every_result(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "engine.md").write_text("## Engine\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    (results / "transfer.md").write_text("## Transfer\n\nnumbers\n")
    out = tmp_path / "BENCHMARKS.md"

    first = bench_run.assemble(results, out)
    assert first.startswith("# nbkit benchmarks")
    assert "## Machine" in first and f"{os.cpu_count()} ×" in first
    assert first.index("## Engine") < first.index("## Transfer")

    # Hand-edit the intro, then regenerate: the edit survives, the results are refreshed.
    edited = out.read_text().replace("# nbkit benchmarks", "# nbkit benchmarks\n\nWhy JPEG misses its target.")
    out.write_text(edited)
    (results / "engine.md").write_text("## Engine\n\nnew numbers\n")
    second = bench_run.assemble(results, out, failures=["`bench_x.py` exited with status 1"])
    assert "Why JPEG misses its target." in second
    assert "new numbers" in second and "| 1 | 2 |" not in second
    assert second.count(bench_run.MARKER) == 1
    assert "bench_x.py" in second


def test_run_lists_every_bench_script():
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "--list"], capture_output=True, text=True, env=_env(),
                          check=False)
    assert proc.returncode == 0
    assert "bench_engine.py" in proc.stdout.split()


def test_assemble_rewrites_relative_links_to_resolve_from_the_output(tmp_path):
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    (results / "plot.png").write_bytes(b"png")
    (results / "budget.md").write_text("![a](plot.png) ![b](results/plot.png) [c](https://x.org/a.png) [d](gone.png)\n")
    out = tmp_path / "BENCHMARKS.md"
    text = bench_run.assemble(results, out)
    assert "![a](bench/results/plot.png)" in text
    assert "[c](https://x.org/a.png)" in text and "[d](gone.png)" in text


def test_assemble_titles_each_section_with_its_machine_and_shows_each_machine_once(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "device-cuda.md").write_text("## Device\n\nMachine: one NVIDIA H100 80GB HBM3, 16 CPU cores, torch 2.11.0, "
                                            "Python 3.12.3. Batch 256.\n\n### mnist\n\ngpu numbers\n")
    (results / "device-cpu.md").write_text("## Device\n\ncpu numbers\n")
    (results / "device-cpu-recheck.md").write_text("## Device\n\n### mnist\n\nrecheck numbers\n")
    (results / "transfer.md").write_text("## Transfer\n\nnumbers\n")
    for stem in ("device-cpu", "device-cpu-recheck"):
        bench_run.stamp(results / f"{stem}.md", "2 × CPU (8.0 GiB RAM, no GPU)", "2026-11-23")
    bench_run.stamp(results / "device-cpu.md", "2 × CPU (8.0 GiB RAM, no GPU)", "2026-11-24")  # a rerun replaces the stamp
    text = bench_run.assemble(results, tmp_path / "BENCHMARKS.md")

    titles = [ln for ln in text.splitlines() if ln.startswith("## ") and not ln.startswith("## Machine")]
    assert titles == ["## Device — one NVIDIA H100 80GB HBM3, 16 CPU cores, date not recorded",  # from its Machine: line
                      "## Device — 2 × CPU (8.0 GiB RAM, no GPU), 2026-11-24",
                      "## Transfer — machine not recorded, date not recorded"]
    # The same machine's second file follows its first, one heading level down.
    assert text.index("cpu numbers") < text.index("### Also measured on this machine, 2026-11-23") < text.index("#### mnist")
    assert "<!--" not in text.split(bench_run.MARKER, 1)[1]


def test_data_check_tells_a_wrong_batch_from_a_right_one():
    import torch

    x, y = torch.arange(12.0).reshape(3, 4), torch.tensor([1, 2, 3])
    ref = bench_engine._checksum((x, y))
    assert bench_engine._consistent(bench_engine._checksum([x.clone(), y.clone()]), ref)
    assert not bench_engine._consistent(bench_engine._checksum((x.flip(0)[:2], y[:2])), ref)  # other samples
    assert not bench_engine._consistent(bench_engine._checksum((x + 1e-3, y)), ref)  # other values
    assert not bench_engine._consistent(bench_engine._checksum((x,)), ref)  # a field missing


@pytest.mark.slow
def test_bench_device_quick_runs_on_the_cpu(tmp_path):
    """benchmarks/bench_device.py --quick: the CPU path (simulated step) writes its table and targets."""
    results, stdout = _quick("bench_device.py", tmp_path)
    stem = "device-cuda" if "one NVIDIA" in stdout else "device-cpu"
    table = (results / f"{stem}.md").read_text()
    for row in ("raw torchvision, `num_workers=0`", "nbkit, default collate, `num_workers=2`",
                "nbkit, `collate_fn=nbkit.collate`", "nbkit `ds.loader(256", "### Targets"):
        assert row in table, row
    target_rows = [ln for ln in table.splitlines() if ln.startswith("| mnist:")]
    assert len(target_rows) >= 3 and all(("| PASS |" in ln) or ("| MISS |" in ln) for ln in target_rows)
    data = json.loads((results / f"{stem}.json").read_text())
    assert data["results"]["mnist"]["n"] == 2048


@pytest.mark.slow
def test_bench_cacheloader_quick_writes_a_table(tmp_path):
    """benchmarks/bench_cacheloader.py --quick: CacheLoader.get against CachedDataset reads, right data everywhere."""
    results, stdout = _quick("bench_cacheloader.py", tmp_path)
    table = (results / "cacheloader.md").read_text()
    assert table.strip() in stdout and "Quick mode" in table
    for row in ("raw source `src[i]`", "`CachedDataset` `ds[i]`", "`CachedDataset` batch of 256",
                "`CacheLoader.get(i)`, local", "`CacheLoader` in a Bagua-style dataset"):
        assert row in table, row
    assert "WRONG DATA" not in table
    assert table.count("| ok |") == len([ln for ln in table.splitlines() if ln.startswith("| ") and "µs" not in ln])


@pytest.mark.slow
def test_bench_scale_quick_writes_a_table(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, str(BENCH / "bench_scale.py"), "--quick", "--scratch", str(tmp_path), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (results / "scale-small.md").read_text()
    for row in ("sequential", "1 thread", "8 threads", "32 threads", "`ds.loader(256, device=None)`",
                "collate_fn=nbkit.collate", "num_workers=2", "first epoch, cold", "### Targets (issue 20)"):
        assert row in table, row
    assert table.count("| not judged (the cache fits in RAM) |") == 3 and "MISS" not in table  # targets are past RAM
    data = json.loads((results / "scale-small.json").read_text())
    assert data["samples"] == 1024 and data["best_random"] > 0
    for r in data["figures"].values():
        assert r["samples"] > 0 and r["peak_rss"] > 0 and r["evict"]
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # the caches are gone


@pytest.mark.slow
def test_bench_durability_quick_compares_before_and_after(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, str(BENCH / "bench_durability.py"), "--quick", "--samples", "512", "--repeat", "1",
           "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (results / "durability.md").read_text()
    if "Skipped:" in text:
        pytest.skip(text.strip().splitlines()[-1])  # a shallow clone without the commit compared against
    for op in ("warmup", "export_tar", "import_tar", "push", "pull"):
        assert f"| {op} |" in text


@pytest.mark.slow
def test_bench_cli_quick_times_every_command(tmp_path):
    results = tmp_path / "results"
    cmd = [sys.executable, str(BENCH / "bench_cli.py"), "--quick", "--repeat", "1", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (results / "cli.md").read_text()
    for command in ("--help", "ls", "info", "verify", "rm", "prune"):
        row = next(line for line in text.splitlines() if line.startswith(f"| `nbkit {command}` |"))
        assert row.split(" | ")[4] == "no", row  # torch not imported now
    assert "| `python -c 'import torch'` |" in text


@pytest.mark.slow
def test_bench_build_quick_writes_its_tables(tmp_path):
    """benchmarks/bench_build.py --quick: throughput against warmup, per-part costs and the projection,
    merge against cache size (local, and gs:// on the emulator when gcsfs is installed)."""
    results = tmp_path / "results"
    cmd = [sys.executable, str(BENCH / "bench_build.py"), "--quick", "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (results / "build.md").read_text()
    assert table.strip() in proc.stdout and "Quick mode" in table
    for row in ("| `warmup(num_workers=1)` | 1 |", "| `LocalEngine(2)` | 2 |", "### Per-part costs",
                "| 256 |", "### Merge against cache size", "| 4 MiB (1,024 samples) | 8 |",
                "| parts placed in the cache's files, large rows written from the samples' own arrays (now) |",
                "| parts placed, large rows stacked into a batch array first (before `format.Rows`) |",
                "| parts copied in by the merge (before parts were placed) |"):
        assert row in table, row
    # Every build row is judged against warmup with as many workers; the references are not.
    builds = [ln for ln in table.splitlines() if ln.startswith("| `LocalEngine") or ln.startswith("| Dask")]
    assert builds and all(("| PASS |" in ln) or ("| MISS |" in ln) for ln in builds)
    assert table.count("| reference |") == 2



@pytest.mark.slow
def test_bench_hf_quick_compares_nbkit_with_hugging_face_datasets(tmp_path):
    """benchmarks/bench_hf.py --quick: every build and reader measured, every reader served the right data,
    with the stack's own datasets (a quick run never installs), and the caches removed."""
    import datasets

    results, scratch = tmp_path / "results", tmp_path / "scratch"
    scratch.mkdir()
    cmd = [sys.executable, str(BENCH / "bench_hf.py"), "--quick", "--only", "mnist", "--data-dir", str(tmp_path / "data"),
           "--scratch", str(scratch), "--results", str(results)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (results / "hf.md").read_text()
    assert table.strip() in proc.stdout and "Quick mode" in table
    for row in ("in-RAM limit", "nbkit `ds.loader(256)`", "nbkit `DataLoader(ds, 256, shuffle=True)`",
                "HF default: `with_format(\"torch\")`", "`hf[indices]` per batch", "`to_iterable_dataset(64)`",
                "`Dataset.from_generator`, features inferred", "`Dataset.from_generator(features=Array3D…)`",
                "`CachedDataset(source, path)` + `warmup()`"):
        assert row in table, row
    assert "WRONG DATA" not in table and table.count("| ok |") == 6
    data = json.loads((results / "hf.json").read_text())
    assert data["datasets"] == datasets.__version__ and not data["note"]
    w = data["workloads"]["mnist"]
    assert w["n"] == 2048 and set(w["builds"]) == {"in-RAM", "nbkit", "HF default", "HF Array3D"}
    assert all(len(times) == w["repeat"] for times in w["epochs"].values())
    assert list(scratch.iterdir()) == []


def test_run_finds_bench_hf():
    assert "bench_hf.py" in [s.name for s in bench_run.discover()]
