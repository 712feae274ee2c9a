"""Command-line benchmark (issue 26): how long ``nbkit`` takes to answer, and whether it imports torch.

Each of ``nbkit --help``, ``ls``, ``info``, ``verify``, ``rm`` and ``prune`` runs as a fresh
``python -m nbkit`` process (what the console script does), on a small cache built here offline
(MNIST-shaped: 1×28×28 float32 images and int labels), median of ``--repeat`` runs. nbkit as it was
before issue 26 (commit :data:`BEFORE`, taken with ``git archive``) runs alternately in the same
loop, and ``python -c "import torch"`` (with ``python -c pass``, the interpreter's own start, and
``import numpy``) is timed in the same run for reference. Bytecode is cached, as in an installed
package: one untimed run of each command comes first. ``rm`` removes a fresh copy of the cache each
run; ``prune --max-size 0`` removes a fresh working copy in ``$NBKIT_CACHE_DIR``.

Usage::

    .venv/bin/python benchmarks/bench_cli.py            # writes benchmarks/results/cli.md
    .venv/bin/python benchmarks/bench_cli.py --quick    # 3 runs each, a smoke test

Example:
    >>> import subprocess, sys, tempfile
    >>> r = subprocess.run([sys.executable, "benchmarks/bench_cli.py", "--quick", "--repeat", "1",
    ...                     "--results", tempfile.mkdtemp()], capture_output=True, text=True)
    >>> r.returncode, "| `nbkit --help` |" in r.stdout
    (0, True)
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
#: nbkit before issue 26: ``import nbkit.cli`` imported torch.
BEFORE = "8bb1863"
#: Samples in the cache the commands work on.
SAMPLES = 1000
#: (command, target in seconds): issue 26's "a newcomer's first hour".
TARGETS = {"--help": 0.3, "ls": 1.0, "info": 1.0, "verify": 1.0, "rm": 1.0, "prune": 1.0}

# Runs one command as the console script does, then says on stderr whether torch was imported.
CHILD = """
import sys
import nbkit
from nbkit.cli import main
rc = main(sys.argv[1:])
sys.stdout.flush()
print("TORCH", "torch" in sys.modules, nbkit.__file__, file=sys.stderr)
sys.exit(rc)
"""


class Setup:
    """The cache, the directories and the fresh copies each command works on."""

    def __init__(self, work: Path):
        self.work = work
        self.caches = work / "caches"
        self.cache = self.caches / "mnist"
        self.victims = work / "victims"
        self.copies = work / "nbkit-cache-dir"
        for d in (self.caches, self.victims, self.copies):
            d.mkdir(parents=True)
        code = ("import sys, torch, nbkit\n"
                "g = torch.Generator().manual_seed(0)\n"
                "n = int(sys.argv[2])\n"
                "src = torch.utils.data.TensorDataset(torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))\n"
                "nbkit.CachedDataset(src, sys.argv[1]).warmup()\n")
        subprocess.run([sys.executable, "-c", code, str(self.cache), str(SAMPLES)], env=self.env(ROOT), check=True)
        self.count = 0

    def env(self, tree: Path) -> dict:
        env = dict(os.environ, PYTHONPATH=str(tree), NBKIT_CACHE_DIR=str(self.copies))
        env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: bytecode cached after the first run
        return env

    def fresh(self, where: Path) -> str:
        self.count += 1
        path = where / f"copy-{self.count}"
        shutil.copytree(self.cache, path)
        return str(path)

    def args(self, name: str) -> list[str]:
        """The command line of ``name``, after making what it removes."""
        if name == "--help":
            return ["--help"]
        if name in ("ls", "info", "verify"):
            return [name, str(self.caches if name == "ls" else self.cache)]
        if name == "rm":
            return ["rm", self.fresh(self.victims)]
        self.fresh(self.copies)
        return ["prune", "--max-size", "0"]


def timed(cmd: list[str], env: dict, cwd: Path) -> float:
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=str(cwd), capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}: {out.stderr[-2000:]}")
    return seconds


def imports_torch(setup: Setup, name: str, tree: Path) -> bool:
    out = subprocess.run([sys.executable, "-c", CHILD, *setup.args(name)], env=setup.env(tree), cwd=str(setup.work),
                         capture_output=True, text=True)
    line = [ln.split(" ", 2) for ln in out.stderr.splitlines() if ln.startswith("TORCH ")]
    if out.returncode != 0 or not line:
        raise RuntimeError(f"nbkit {name} failed: {out.stderr[-2000:]}")
    _, torch, where = line[-1]
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise RuntimeError(f"nbkit came from {where}, not from {tree}: set PYTHONPATH, or uninstall the other copy")
    return torch == "True"


def measure(repeat: int, work: Path) -> dict:
    setup = Setup(work / "data")
    trees = {"now": ROOT}
    before = work / "before"
    before.mkdir()
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BEFORE, "nbkit"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "x", "-C", str(before)], input=archive, check=True)
        trees["before"] = before
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"nbkit at {BEFORE} is not in this checkout ({e}): no before column", file=sys.stderr)
    nbkit = [sys.executable, "-m", "nbkit"]
    python = {"python -c pass": "pass", "python -c 'import numpy'": "import numpy",
              "python -c 'import torch'": "import torch"}
    result = {"repeat": repeat, "samples": SAMPLES, "commands": {}, "reference": {}, "torch": {}}
    for name in TARGETS:
        for who, tree in trees.items():
            result["torch"].setdefault(name, {})[who] = imports_torch(setup, name, tree)  # also the untimed first run
    for label, code in python.items():
        timed([sys.executable, "-c", code], setup.env(ROOT), setup.work)
    for _ in range(repeat):  # round-robin: every row sees the same machine
        for name in TARGETS:
            for who, tree in trees.items():
                seconds = timed(nbkit + setup.args(name), setup.env(tree), setup.work)
                result["commands"].setdefault(name, {}).setdefault(who, []).append(seconds)
        for label, code in python.items():
            result["reference"].setdefault(label, []).append(timed([sys.executable, "-c", code], setup.env(ROOT), setup.work))
    return result


def table(result: dict, quick: bool) -> str:
    med = statistics.median
    has_before = any("before" in v for v in result["commands"].values())
    rows = []
    for name, target in TARGETS.items():
        runs = result["commands"][name]
        now = med(runs["now"])
        was = f"{med(runs['before']):.2f} s" if "before" in runs else "–"
        torch = {True: "yes", False: "no", None: "–"}
        imported = result["torch"][name]
        rows.append(f"| `nbkit {name}` | {was} | {torch[imported.get('before')]} | {now:.2f} s | {torch[imported['now']]} | "
                    f"< {target:g} s | {'PASS' if now < target else 'MISS'} |")
    ref = [f"| `{label}` | {med(runs):.2f} s |" for label, runs in result["reference"].items()]
    note = "" if has_before else f" (nbkit at {BEFORE} was not in this checkout: no before column)"
    return (
        "## Command line: time to answer (issue 26)\n\n"
        f"Each command is a fresh `python -m nbkit` process on a cache of {result['samples']:,} MNIST-shaped samples "
        f"(1×28×28 float32 + int), median of {result['repeat']} runs, before issue 26 (commit {BEFORE}, whose "
        f"`import nbkit.cli` imported torch) and now, alternating in one run{note}. `rm` removes a fresh copy of the "
        "cache, `prune --max-size 0` a fresh working copy. Bytecode is cached, as in an installed package."
        + (" **Quick mode: few runs.**" if quick else "")
        + "\n\n| command | before | imports torch | now | imports torch | target | |\n|---|---|---|---|---|---|---|\n" + "\n".join(rows)
        + "\n\nFor reference, in the same run:\n\n| process | median |\n|---|---|\n" + "\n".join(ref) + "\n" + NOTES
    )


NOTES = """
What the five commands still load is Python's own start, numpy, fsspec (progress callbacks and
storage URLs) and nbkit's own modules; `--help` imports neither numpy nor anything of the engine.
Every command imports what it uses when it runs (tests/test_cli_imports.py checks that these six
never import torch). The build machine has 2 shared cores: compare rows of the same run.
"""


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 runs each, a smoke test")
    p.add_argument("--repeat", type=int, default=None, help="runs of each command (default 7, --quick 3)")
    p.add_argument("--results", default=str(HERE / "results"))
    args = p.parse_args(argv)
    repeat = args.repeat or (3 if args.quick else 7)
    work = Path(tempfile.mkdtemp(prefix="nbkit-bench-cli-", dir=os.environ.get("NBKIT_BENCH_DIR")))
    try:
        result = measure(repeat, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = table(result, args.quick)
    print(text)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cli.md").write_text(text)
    if not args.quick:
        (out / "cli.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
