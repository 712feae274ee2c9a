#!/usr/bin/env python
"""Execute the tutorial notebooks headless, on offline data, and keep the results under ``out/``.

This is what ``make demo`` runs. Each notebook is executed with papermill, which overrides the
cell tagged ``parameters``: no download is attempted (the offline MNIST-format stand-in files are
used), so the run needs no network. Results:

* ``out/<notebook>.ipynb``: the executed notebooks, with their outputs;
* ``out/benchmark.png``: the raw vs cached plot from ``03_benchmark.ipynb``;
* ``out/work/``: the data, caches and tar files the notebooks made.

Usage::

    python scripts/run_notebooks.py                    # 02 and 03, full size (60,000 samples)
    python scripts/run_notebooks.py --small            # the small CI sizes
    python scripts/run_notebooks.py --only 03 --update-docs-plot   # refresh docs/benchmark.png
    python scripts/run_notebooks.py --check-stripped   # fail if a committed notebook has outputs
    python scripts/run_notebooks.py --strip            # strip outputs in place before committing

The tests (``tests/test_notebooks.py``) import :func:`run` and the parameter sets from here, so
CI and ``make demo`` execute the notebooks the same way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
ALL = ("01_tpu_setup", "02_cache_mnist", "03_benchmark", "04_resume", "05_build_on_a_cluster", "06_jax")
DEMO = ("02_cache_mnist", "03_benchmark")

# Parameters for each notebook: full size for the demo, small for CI. Both are offline. The demo
# trains 02 for 50 steps (the notebook's default is 100): with torch_xla on the CPU (make setup's
# stack) a step costs ~0.5 s on 2 loaded cores, and `make demo` must finish within 5 minutes there.
FULL = {
    "01_tpu_setup": {"install_torch_xla": False},
    "02_cache_mnist": {"download": False, "offline_samples": 60000, "train_steps": 50},
    "03_benchmark": {"download": False, "offline_samples": 60000, "epochs": 3},
    "04_resume": {"download": False, "offline_samples": 60000, "train_steps": 100, "checkpoint_every": 25},
    "05_build_on_a_cluster": {"download": False, "offline_samples": 60000, "engine_name": "dask", "workers": 2},
    "06_jax": {"download": False, "offline_samples": 60000, "train_steps": 200, "epochs": 3},
}
SMALL = {
    "01_tpu_setup": {"install_torch_xla": False},
    "02_cache_mnist": {"download": False, "offline_samples": 3000, "train_steps": 20, "batch_size": 64},
    "03_benchmark": {"download": False, "offline_samples": 6000, "epochs": 2, "batch_size": 256, "train_seconds": 2},
    "04_resume": {"download": False, "offline_samples": 300, "train_steps": 24, "checkpoint_every": 5,
                  "batch_size": 32, "device": "cpu"},
    # A local Dask cluster (2 s to start); Ray's local instance costs ~15 s and 1 GiB.
    "05_build_on_a_cluster": {"download": False, "offline_samples": 3000, "engine_name": "dask", "workers": 2,
                              "part_size": 512},
    # JAX on the CPU: a tiny MLP, so the four feeds' 4 epochs each take seconds.
    "06_jax": {"download": False, "offline_samples": 2000, "train_steps": 40, "batch_size": 64, "epochs": 3},
}


def run(name: str, out_dir, parameters: dict | None = None, *, small: bool = False, timeout: float = 600) -> Path:
    """Execute ``notebooks/<name>.ipynb`` into ``out_dir/<name>.ipynb``; return that path.

    The notebook runs with ``out_dir/work`` as its working directory. ``parameters`` are laid over
    the preset (``SMALL`` or ``FULL``). A failing cell raises ``papermill.PapermillExecutionError``
    and the partly executed notebook is still written, for reading the traceback.
    """
    try:
        import papermill
    except ImportError as e:
        raise ImportError("running the notebooks needs papermill: pip install -e '.[dev]'") from e

    out_dir = Path(out_dir)
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    params = dict((SMALL if small else FULL)[name])
    params.update(parameters or {})
    output = out_dir / f"{name}.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / f"{name}.ipynb"),
        str(output),
        parameters=params,
        cwd=str(work),
        kernel_name="python3",
        progress_bar=False,
        execution_timeout=timeout,
    )
    return output


def _has_outputs(cell) -> bool:
    return cell.cell_type == "code" and bool(cell.get("outputs") or cell.get("execution_count") is not None)


def outputs_left(path) -> list[str]:
    """Cells of a notebook that still carry outputs or execution counts (should be none in git)."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    return [f"{Path(path).name}: cell {i}" for i, cell in enumerate(nb.cells) if _has_outputs(cell)]


def strip(path) -> bool:
    """Remove outputs and execution counts in place; return True if the file changed."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    changed = False
    for cell in nb.cells:
        if _has_outputs(cell):
            cell.outputs, cell.execution_count, changed = [], None, True
    if changed:
        nbformat.write(nb, str(path))
    return changed


def text_output(path) -> str:
    """Everything an executed notebook printed (stdout/stderr streams and text results), joined."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "data" in out and "text/plain" in out["data"]:
                parts.append(out["data"]["text/plain"])
    return "\n".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "out"), help="where executed notebooks go (default: out/)")
    parser.add_argument("--only", nargs="+", metavar="NN", help="notebook numbers or names, e.g. 03 (default: 02 03)")
    parser.add_argument("--small", action="store_true", help="the small CI sizes instead of the full dataset")
    parser.add_argument("--check-stripped", action="store_true", help="only check that notebooks/ has no outputs")
    parser.add_argument("--strip", action="store_true", help="only strip outputs from notebooks/*.ipynb")
    parser.add_argument("--update-docs-plot", action="store_true", help="copy the benchmark plot to docs/benchmark.png")
    args = parser.parse_args(argv)

    committed = sorted(NOTEBOOKS.glob("*.ipynb"))
    if args.strip:
        for path in committed:
            print(f"{path.relative_to(REPO)}: {'stripped' if strip(path) else 'already clean'}")
        return 0
    if args.check_stripped:
        dirty = [cell for path in committed for cell in outputs_left(path)]
        for cell in dirty:
            print(f"has outputs: notebooks/{cell}", file=sys.stderr)
        if dirty:
            print("run `python scripts/run_notebooks.py --strip` before committing", file=sys.stderr)
        return 1 if dirty else 0

    names = DEMO if not args.only else [n for n in ALL if any(n == o or n.startswith(o) for o in args.only)]
    if not names:
        parser.error(f"--only {' '.join(args.only)}: expected some of {', '.join(ALL)}")
    os.environ.setdefault("PJRT_DEVICE", "CPU")  # torch_xla on the CPU when there is no TPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        start = time.perf_counter()
        print(f"executing notebooks/{name}.ipynb ...", flush=True)
        path = run(name, out, small=args.small)
        print(f"  wrote {path} in {time.perf_counter() - start:.0f} s", flush=True)
        if name == "03_benchmark":
            plot = out / "work" / "benchmark.png"
            shutil.copyfile(plot, out / "benchmark.png")
            print(f"  wrote {out / 'benchmark.png'}")
            if args.update_docs_plot:
                shutil.copyfile(plot, REPO / "docs" / "benchmark.png")
                print(f"  updated {REPO / 'docs' / 'benchmark.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
