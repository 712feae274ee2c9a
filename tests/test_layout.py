"""The package layout (docs/DESIGN.md, "Layers"): imports among nbkit's modules run one way, and no
module imports another module's ``_private`` name.

Every import statement counts, at module level or inside a function (a lazy import is still a
dependency). Importing a submodule runs its package's ``__init__`` first, so an import of
``nbkit.a.b`` counts as an import of the package ``nbkit.a`` too (from outside that package).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "nbkit"

# The layers below the engine (nbkit.dataset): none of them may import it, directly or through others.
BELOW_DATASET = ("nbkit.errors", "nbkit.devices", "nbkit.extras", "nbkit.progress", "nbkit.stats", "nbkit.commit", "nbkit.codec",
                 "nbkit.fingerprint", "nbkit.collate", "nbkit.transfer", "nbkit.transforms", "nbkit.format",
                 "nbkit.cachedir", "nbkit.stores", "nbkit.disk", "nbkit.cluster")
# The layers of docs/DESIGN.md ("Layers"): a module imports only its own layer or lower ones.
# Modules not listed (notebook front ends: widgets, tpu, bench, …) are the top layer.
LAYERS = {
    # nbkit.devices, the device resolver and torch_xla adapter, imports only torch (torch_xla when asked for XLA).
    0: ("nbkit.errors", "nbkit.trust", "nbkit.devices", "nbkit.extras", "nbkit.text", "nbkit.progress", "nbkit.stats", "nbkit.commit", "nbkit.gather"),
    # nbkit.transfer straddles layers 1-5: each module is named; its __init__ imports nothing (lazy names).
    1: ("nbkit.codec", "nbkit.fingerprint", "nbkit.collate", "nbkit.transfer.remote", "nbkit.transforms"),
    # nbkit.stores.base declares the Store and Location contracts (no backend): cachedir's CacheFiles derives from it.
    2: ("nbkit.format", "nbkit.stores.base"),
    3: ("nbkit.cachedir",),
    4: ("nbkit.transfer.manifest",),
    5: ("nbkit.transfer.sync", "nbkit.transfer.archive"),
    6: ("nbkit.stores", "nbkit.disk"),
    7: ("nbkit.cluster", "nbkit.dataset", "nbkit.samplers", "nbkit.loader", "nbkit.cacheloader"),
}
TOP = max(LAYERS) + 1
# Packages whose __init__ imports no nbkit module when it runs (its names load on first use):
# importing one of their low modules (nbkit.stores.base, nbkit.transfer.remote) runs nothing above it.
LIGHT_PACKAGES = ("nbkit.stores", "nbkit.transfer", "nbkit.jax")


def layer_of(module: str) -> int:
    for layer, names in LAYERS.items():
        if any(module == n or module.startswith(n + ".") for n in names):
            return layer
    return TOP


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict:
    """``name -> (path, is_package)`` of every module under ``nbkit/``."""
    return {module_name(p): (p, p.name == "__init__.py") for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, is_package: bool, known) -> list:
    """``(target module, imported name or None, line)`` for every import of an nbkit module in ``path``."""
    return imports_of_tree(name, ast.parse(path.read_text(), str(path)), is_package, known)


def imports_of_tree(name: str, tree: ast.AST, is_package: bool, known) -> list:
    """:func:`imports_of` for a parsed module."""
    package = name if is_package else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "nbkit" or alias.name.startswith("nbkit."):
                    found.append((alias.name, None, node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != "nbkit" and not source.startswith("nbkit."):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    found.append((sub, None, node.lineno))  # from package import submodule
                else:
                    found.append((source, alias.name, node.lineno))
    return found


@pytest.fixture(scope="module")
def graph():
    known = modules()
    edges = {}
    for name, (path, is_package) in known.items():
        edges[name] = imports_of(name, path, is_package, known)
    return known, edges


def test_every_import_names_an_existing_module(graph):
    known, edges = graph
    missing = [(src, dst, line) for src, targets in edges.items() for dst, _, line in targets if dst not in known]
    assert not missing, f"imports of modules that do not exist: {missing}"


def test_no_cross_module_private_import(graph):
    _, edges = graph
    bad = [f"{src}:{line} imports {name} from {dst}" for src, targets in edges.items() for dst, name, line in targets
           if name is not None and name.startswith("_") and not name.startswith("__") and dst != src]
    bad += [f"{src}:{line} imports the private module {dst}" for src, targets in edges.items() for dst, _, line in targets
            if dst.rpartition(".")[2].startswith("_") and not dst.endswith("__init__")]
    assert not bad, "a helper used elsewhere drops its underscore:\n" + "\n".join(bad)


def _cycles(edges) -> list:
    """Every strongly connected set of more than one module (Tarjan), plus self-imports."""
    adj = {src: sorted({dst for dst, _, _ in targets if dst in edges and dst != src}) for src, targets in edges.items()}
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(adj):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle(graph):
    _, edges = graph
    cycles = _cycles(edges)
    assert not cycles, f"import cycles among nbkit modules (lazy imports count too): {cycles}"


def test_cycle_finder_finds_a_cycle():
    edges = {"a": [("b", None, 1)], "b": [("c", None, 1)], "c": [("a", None, 1)], "d": [("a", None, 1)]}
    assert _cycles(edges) == [["a", "b", "c"]]


def _reach(edges, start) -> set:
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        for dst, _, _ in edges.get(v, ()):
            if dst not in seen:
                seen.add(dst)
                todo.append(dst)
    return seen


def test_nothing_below_the_engine_imports_it(graph):
    _, edges = graph
    lower = [m for m in edges if m.startswith(BELOW_DATASET)]
    assert "nbkit.format" in lower and "nbkit.stores.registry" in lower
    bad = {m: sorted(_reach(edges, m) & {"nbkit.dataset", "nbkit"}) for m in lower}
    bad = {m: r for m, r in bad.items() if r}
    assert not bad, f"modules below nbkit.dataset that import it (or the package, which imports it): {bad}"


def test_imports_run_down_the_layers(graph):
    _, edges = graph
    bad = [f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
           for src, targets in edges.items()
           for dst, _, _ in targets if layer_of(dst) > layer_of(src)]
    assert not bad, "imports against the layers of docs/DESIGN.md:\n" + "\n".join(bad)


def _packages_run(src: str, dst: str) -> list:
    """The packages whose ``__init__`` importing ``dst`` runs, besides ``nbkit``'s own and those ``src`` is in."""
    parts = dst.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(2, len(parts)))
            if not (src == p or src.startswith(p + "."))]


def test_no_import_runs_a_package_above(graph):
    """``from .tpu import xla`` in the engine ran nbkit/tpu/__init__ (the notebook front end, which
    imports the engine back): a low module in a high package is an upward import all the same."""
    known, edges = graph
    bad = [f"{src} (layer {layer_of(src)}) imports {dst}, which runs {pkg} (layer {layer_of(pkg)})"
           for src, targets in edges.items() for dst, _, _ in targets
           for pkg in _packages_run(src, dst)
           if pkg in known and pkg not in LIGHT_PACKAGES and layer_of(pkg) > layer_of(src)]
    assert not bad, "imports against the layers of docs/DESIGN.md:\n" + "\n".join(bad)


def test_the_package_check_sees_the_old_adapter():
    assert _packages_run("nbkit.loader", "nbkit.tpu.xla") == ["nbkit.tpu"]
    assert _packages_run("nbkit.tpu.run", "nbkit.tpu.runtime") == []
    assert layer_of("nbkit.tpu") > layer_of("nbkit.loader")


def test_torch_xla_is_called_only_behind_nbkit_tpu():
    """torch_xla stopped at 2.9 and TorchTPU replaces it: every torch_xla import lives in nbkit/tpu/
    or in nbkit.devices (the engine's one adapter), so the successor changes those alone (issue 18)."""
    outside = []
    for name, (path, _) in modules().items():
        if name in ("nbkit.tpu", "nbkit.devices") or name.startswith("nbkit.tpu."):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            outside += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "torch_xla"]
    assert not outside, "\n".join(outside)


@pytest.mark.parametrize("package", LIGHT_PACKAGES)
def test_a_light_package_runs_nothing_above_the_vocabulary(graph, package):
    """nbkit.transfer straddles layers 1-5 and nbkit.stores layers 2-6: importing nbkit.transfer.remote
    (layer 1) or nbkit.stores.base (layer 2) runs the package's __init__ first, so that imports only
    layer 0 (nbkit.extras.lazy_names) when it runs and resolves its public names on first use."""
    known, _ = graph
    path, is_package = known[package]
    tree = ast.parse(path.read_text())
    top = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))], type_ignores=[])
    eager = [(dst, line) for dst, _, line in imports_of_tree(package, top, is_package, known) if layer_of(dst) > 0]
    assert not eager, f"{package}/__init__.py imports above layer 0 when it runs: {eager}; resolve them lazily"


#: The entries at the top of nbkit/ (modules and packages). It was 36 before the subsystems became
#: packages (issue 28): a new module goes into the package of its subsystem (codec/, stores/,
#: transfer/, widgets/, tpu/), and a new top-level entry raises this number with a reason.
#: 33: jax/ (issue 30), the JAX front end (Grain source, device feed), a subsystem of its own beside
#: tpu/ (torch on TPUs) and widgets/; it belongs in none of the packages there were.
MAX_TOP_LEVEL = 33


def test_the_top_level_stays_small():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__" and (p.suffix == ".py" or p.is_dir()))
    assert len(entries) <= MAX_TOP_LEVEL, (
        f"nbkit/ has {len(entries)} top-level entries (at most {MAX_TOP_LEVEL}): {entries}. Put the new module "
        "in its subsystem's package, or raise MAX_TOP_LEVEL in tests/test_layout.py and say why.")
