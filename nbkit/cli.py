"""The ``nbkit`` command line (also ``python -m nbkit``): the caches on this machine and the
operations on one cache, over the same functions a notebook calls.

Commands: ``ls``, ``info``, ``verify``, ``export``, ``import``, ``push``, ``pull``, ``rm``, ``prune``,
and ``build`` (fill a cache with the workers of an engine: local processes, a Ray or Dask cluster).
Each takes ``--json`` (one JSON document on stdout) and ``--debug`` (a traceback on failure).
Exit codes: 0 done; 1 the operation failed or found a problem (a damaged cache, a refusal, a
network error: one line on stderr says what and the fix); 2 the command line is wrong; 130
interrupted (a build stopped by Ctrl-C keeps every finished part: the same command resumes it).
Long operations show a progress line on stderr when it is a terminal (``--progress`` forces it).
A wrong argument (a number out of range, an empty path, a URL typo) is a usage error, exit 2, before
anything is created. Parsing the command line imports nothing of nbkit's engine (a path or URL given is
checked by ``nbkit.trust``, as the command would check it): each command imports what it uses, and
none but ``build`` (which computes samples) imports torch (``tests/test_cli_imports.py``): a cache is
listed, checked, copied and removed without reading a sample into a tensor.

Example:
    >>> import tempfile
    >>> from unittest import mock
    >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):
    ...     main(["ls", "--json", tempfile.mkdtemp()])
    []
    0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .text import Table, fill, format_bytes, format_count, format_seconds, plural, printable, speaking_to

__all__ = ["main", "parse_size", "parse_duration", "parse_source", "OK", "FAILED", "USAGE", "INTERRUPTED"]

OK, FAILED, USAGE, INTERRUPTED = 0, 1, 2, 130

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgtp]?)(i?)b?\s*\Z", re.I)
_DURATION = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(s|m|h|d|w)?\s*\Z", re.I)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_MAX_SIZE = float(2**63)  # bytes: above any disk, and what an int64 offset holds
_MAX_SECONDS = 100 * 365.25 * 86400
#: ``nbkit ls --max-depth``'s default: :data:`nbkit.disk.MAX_DEPTH`, written here so that parsing the
#: command line imports nothing (tests/test_cli.py checks that they agree).
LS_MAX_DEPTH = 6
#: ``nbkit build --part-size``'s default: :data:`nbkit.cluster.plan.DEFAULT_PART_SIZE`, written here for the same reason.
BUILD_PART_SIZE = 4096
# The bounds the library checks these numbers against, written here (for the same reason) so that a wrong
# number is a usage error (exit 2) before anything is created: tests/test_cli.py checks that they agree.
#: ``--max-depth``: what :func:`nbkit.disk.caches` takes.
MAX_LS_DEPTH = 64
#: ``--part-size``: :data:`nbkit.trust.MAX_SAMPLES`.
MAX_PART_SIZE = 1 << 40
#: ``--workers`` started on this machine: :data:`nbkit.trust.MAX_WORKERS`.
MAX_LOCAL_WORKERS = 256
#: ``--workers`` with ``--address`` (parts run at once on a cluster): :data:`nbkit.trust.MAX_WORLD_SIZE`.
MAX_CLUSTER_WORKERS = 1 << 20


def parse_size(text: str) -> int:
    """``"10GB"`` → ``10_000_000_000``; ``"1.5GiB"``, ``"500M"``, ``"4096"`` (bytes) also read.

    Example:
        >>> parse_size("10GB"), parse_size("2KiB"), parse_size("512")
        (10000000000, 2048, 512)
    """
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write it like 10GB, 500MB or 2GiB")
    number, prefix, binary = float(m.group(1)), m.group(2).lower(), m.group(3)
    power = "kmgtp".find(prefix) + 1 if prefix else 0
    size = number * (1024 if binary else 1000) ** power
    if not size < _MAX_SIZE:  # also inf, from a number too long for a float
        raise argparse.ArgumentTypeError(f"{text!r} is larger than any disk: write it like 10GB, 500MB or 2GiB")
    return int(size)


def parse_duration(text: str) -> float:
    """``"7d"`` → seconds; ``s``, ``m``, ``h``, ``d``, ``w`` (a bare number is seconds).

    Example:
        >>> parse_duration("7d"), parse_duration("90m"), parse_duration("30")
        (604800.0, 5400.0, 30.0)
    """
    m = _DURATION.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: write it like 7d, 12h, 30m or 45s")
    seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    if not seconds < _MAX_SECONDS:  # also inf, from a number too long for a float
        raise argparse.ArgumentTypeError(f"{text!r} is longer than a century: write it like 7d, 12h, 30m or 45s")
    return seconds


_SOURCE = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*):([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\s*\Z")


def parse_source(text: str) -> tuple:
    """``"my_data:make_train"`` → ``("my_data", "make_train")``: a module and a callable in it, as
    ``python -m``, uvicorn and gunicorn name one (``pkg.mod:Class.method`` also reads).

    Example:
        >>> parse_source("my_data:make_train"), parse_source("torchvision.datasets:MNIST")
        (('my_data', 'make_train'), ('torchvision.datasets', 'MNIST'))
    """
    m = _SOURCE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not MODULE:CALLABLE: name the function that returns your dataset, "
                                         "e.g. my_data:make_train for `def make_train(): ...` in my_data.py")
    return m.group(1), m.group(2)


def _whole_number(low: int, high: int, example: str, why: str):
    """An argparse ``type`` reading a whole number in ``[low, high]``: anything else is a usage error
    (exit 2) that says what the argument takes, before any command runs."""

    def parse(text: str) -> int:
        try:
            value = int(text)  # "12", " 12", "1_000"; not "2**70", "1e3", "1.5"
        except ValueError:  # not a number, or one of more digits than int() reads: out of range too
            value = None
        if value is None or not low <= value <= high:
            number = value is not None or text.strip().lstrip("+-").isdigit()
            raise argparse.ArgumentTypeError(f"{printable(repr(text))[:40]} is {'out of range' if number else 'not a whole number'}: "
                                             f"give a whole number from {low} to {high:,} ({why}), e.g. {example}")
        return value

    return parse


def _checked(module: str, check: str, name: str):
    """An argparse ``type`` that checks a path or URL with the library's own check (``check`` of
    ``module``, imported only when the argument is given: the command imports it anyway), a refusal
    being a usage error."""

    def parse(text: str) -> str:
        import importlib

        try:
            return getattr(importlib.import_module(module, __package__), check)(text, name)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from e

    return parse


#: A local directory or file: not empty, no NUL (what ``nbkit.disk`` and the transfers check).
_path = _checked(".trust", "check_path", "the path")
#: A cache directory or a cache's URL (``gs://…``): as ``CachedDataset`` and the stores check it.
_cache_location = _checked(".stores.registry", "check_cache_url", "the path or URL")
#: A tar file or a bucket's URL: as the transfers check it (no ``gs:/`` typo, a scheme fsspec knows).
_url = _checked(".trust", "check_url", "the path or URL")


def _option(text: str) -> tuple:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (a storage option, e.g. endpoint_url=http://...)")
    try:
        return key, json.loads(value)  # numbers, true/false, JSON objects
    except ValueError:
        return key, value


# -- output ------------------------------------------------------------------------------------


def _progress(args, label: str, unit: str = "samples"):
    """A :class:`nbkit.progress.TextProgress` on stderr in a terminal (or with ``--progress``), else ``None``."""
    show = args.progress if args.progress is not None else sys.stderr.isatty()
    if not show:
        return None
    from .progress import TextProgress

    return TextProgress(label, file=sys.stderr, unit=unit)


def _done(cb) -> None:
    if cb is not None:
        cb.close()


def _emit(args, data, text: str) -> None:
    """Print ``data`` as JSON (which escapes every control character) or ``text``, whose lines quote
    paths, URLs and metadata: each made :func:`nbkit.text.printable`, so none reaches the terminal raw."""
    print(json.dumps(data, indent=2, default=str) if args.json else "\n".join(map(printable, text.split("\n"))))


def _report(args, what: str, report) -> int:
    import dataclasses

    data = dataclasses.asdict(report)
    text = (f"{what}: {plural(len(report.transferred), 'file')} copied ({format_bytes(report.bytes)}), {len(report.skipped)} "
            f"already there, in {format_seconds(report.seconds)}" + (" (stopped)" if report.stopped else ""))
    _emit(args, data, text)
    return FAILED if report.stopped else OK


# -- commands ----------------------------------------------------------------------------------


def _ls(args) -> int:
    import shutil

    from . import disk
    from .stores.mirror import cache_dir

    found = disk.caches(*args.roots, max_depth=args.max_depth, storage_options=args.options or None)
    copies = f"working copies of remote caches in {cache_dir()} ($NBKIT_CACHE_DIR)"
    if args.roots:
        shown = (r if "://" in r else os.path.abspath(os.path.expanduser(r)) for r in args.roots)  # a URL as given
        where = f"caches under {', '.join(shown)}, and {copies}"
    else:
        where = f"{copies}; nbkit ls DIR lists the caches under DIR"
    # Fitted to a terminal ($COLUMNS, else its width); whole lines into a pipe or a file, for grep.
    width = shutil.get_terminal_size().columns if "COLUMNS" in os.environ or sys.stdout.isatty() else None
    listed = found.text(width)
    _emit(args, [c.to_json() for c in found], f"{where if width is None else fill(where, width)}\n\n{listed}")
    return OK


def _local_cache(path: str, doing: str) -> None:
    """Refuse a file where a cache directory is expected (``nbkit info some.tar``), naming what to do instead."""
    from . import disk

    why = disk.not_a_directory(path, doing)
    if why is not None:
        raise NotADirectoryError(why)


def _leaf_names(node, prefix: str = "") -> list[str]:
    """How to reach each leaf of a sample of structure ``node``: ``[0]``, ``['image']``, ``label``."""
    if node == "*":
        return [prefix or "sample"]
    if node[0] in ("T", "L"):
        return [n for k, c in enumerate(node[1]) for n in _leaf_names(c, f"{prefix}[{k}]")]
    if node[0] == "D":
        return [n for key, c in zip(node[1], node[2]) for n in _leaf_names(c, f"{prefix}[{key!r}]")]
    fields = node[3] or [f"[{k}]" for k in range(len(node[2]))]  # a namedtuple
    return [n for f, c in zip(fields, node[2])
            for n in _leaf_names(c, prefix + (f if f.startswith("[") or not prefix else "." + f))]


_CONTAINERS = {"T": ("tuple", "()"), "L": ("list", "[]"), "D": ("dict", "{}")}
#: Children of one container shown by :func:`describe_structure` (the field table lists them all).
_SHOWN = 8


def describe_structure(structure, leaves) -> str:
    """A cache's sample as Python types, from its schema (``structure``, ``leaves``).

    Example:
        >>> from nbkit.codec import Schema
        >>> s = Schema.from_json({"structure": ["T", ["*", "*"]], "leaves": [
        ...     {"kind": "tensor", "store": "col", "dtype": "float32", "shape": [1, 28, 28], "column": 0},
        ...     {"kind": "int", "store": "col", "dtype": "<i8", "shape": [], "column": 1}]})
        >>> describe_structure(s.structure, s.leaves)
        'tuple (Tensor[1, 28, 28] float32, int)'
    """
    from .codec.table import kind_named

    it = iter(leaves)

    def node(n) -> str:
        if n == "*":
            leaf = next(it)
            return kind_named(leaf.kind).describe(leaf)
        children = n[1] if n[0] in ("T", "L") else n[2]
        parts = [node(c) for c in children]  # every child: the leaves are consumed in order
        if n[0] == "D":
            parts = [f"{k!r}: {p}" for k, p in zip(n[1], parts)]
        elif n[0] == "N" and n[3] is not None:
            parts = [f"{f}: {p}" for f, p in zip(n[3], parts)]
        if len(parts) > _SHOWN:
            parts = parts[:_SHOWN] + [f"… {len(parts) - _SHOWN} more"]
        name, brackets = _CONTAINERS.get(n[0]) or (n[1].rpartition(":")[2].rpartition(".")[2], "()")
        return f"{name} {brackets[0]}{', '.join(parts)}{brackets[1]}"

    return node(structure)


def _one_line(text: str) -> str:
    r"""A multi-line repr on one line: its lines stripped and joined with ", " (none after an opening
    or before a closing bracket).

    Example:
        >>> _one_line("Compose(\n    ToTensor()\n    Normalize(mean=(0.1307,), std=(0.3081,))\n)")
        'Compose(ToTensor(), Normalize(mean=(0.1307,), std=(0.3081,)))'
    """
    out = ""
    for part in (p.strip() for p in text.splitlines()):
        if not part:
            continue
        if out and not out.endswith(("(", "[", "{")) and not part.startswith((")", "]", "}")):
            out += ", "
        out += part
    return out


def _info(args) -> int:
    from . import disk
    from . import format as fmt
    from .cachedir import cache_root
    from .codec import Schema
    from .codec.kind import dtype_name

    _local_cache(args.path, "show it")
    root = cache_root(args.path)
    meta = fmt.read_meta(root)
    about = disk.describe(root)
    if about.problem:
        raise ValueError(f"{root} does not read as a cache: {about.problem}")
    schema = Schema.from_json(meta["schema"], os.path.join(root, fmt.META)) if meta.get("schema") else None
    names = [] if schema is None else _leaf_names(schema.structure)
    if schema is not None and len(names) != len(schema.leaves):
        names = [str(k) for k in range(len(schema.leaves))]
    leaves = [] if schema is None else [
        {"field": names[k], "kind": leaf.kind, "stored": {"col": "column", "var": "heap", "const": "constant"}[leaf.store],
         "dtype": dtype_name(leaf.dtype), "shape": list(leaf.shape) if leaf.store == "col" else None}
        for k, leaf in enumerate(schema.leaves)]
    fp = meta.get("fingerprint") or {}
    transforms = fp.get("transform") or fp.get("transforms") or None  # "transforms": what older caches may hold
    if isinstance(transforms, str):  # a multi-line repr (torchvision's Compose): one line, not "\n" escapes
        transforms = _one_line(transforms)
    length = fp.get("length") or 0  # any JSON value in a cache from elsewhere: shown, never computed with
    length = format_count(length) if isinstance(length, int) and not isinstance(length, bool) else repr(length)
    data = {
        "path": root, "version": meta["version"], "length": about.length, "stored": about.stored,
        "complete": about.complete, "bytes": about.bytes, "in_use": about.in_use,
        "structure": None if schema is None else meta["schema"]["structure"],
        "sample": None if schema is None else describe_structure(schema.structure, schema.leaves), "fields": leaves,
        "fingerprint": {"type": fp.get("type"), "length": fp.get("length"), "transforms": transforms,
                        "probes": len(fp.get("samples") or {})},
        "max_bytes": meta.get("max_bytes"), "allow_pickle": meta.get("allow_pickle", False),
    }
    lines = [
        ("path", root),
        ("samples", f"{format_count(about.stored)}/{format_count(about.length)}" + (" (complete)" if about.complete else "")),
        ("on disk", format_bytes(about.bytes) + " (sample data, index and metadata)" + (", in use" if about.in_use else "")),
        ("format", f"version {meta['version']}"),
        ("sample", "free-form samples (each stored with its own structure)" if schema is None else data["sample"]),
        ("source", f"{fp.get('type')} of {length}, {len(fp.get('samples') or {})} samples hashed"
         + (f", {transforms}" if transforms else "")),
    ]
    if meta.get("max_bytes") is not None:
        lines.append(("budget", format_bytes(meta["max_bytes"])))
    fields = Table([(f["field"], f["kind"], f["stored"], f["dtype"] or "", "" if f["shape"] is None else
                     "×".join(map(str, f["shape"])) or "scalar") for f in leaves],
                   header=("field", "kind", "stored", "dtype", "shape"))
    _emit(args, data, Table(lines).text() + ("\n\n" + fields.text() if leaves else ""))
    return OK


def _verify(args) -> int:
    # CachedDataset.open(path).verify(), without the dataset (and so without torch): the same store, the same check.
    from . import format as fmt
    from .errors import CorruptCacheError
    from .stores import registry

    _local_cache(args.path, "verify it")
    location = registry.resolve(args.path, args.options)
    location.prepare()
    meta = location.existing_meta()
    store = location.open_store(meta, writable=False)
    cb = _progress(args, "verify")
    try:
        n = fmt.verify_store(store, where=location.url, callback=cb)
    except CorruptCacheError as e:
        _done(cb)
        if args.json:
            _emit(args, {"path": args.path, "ok": False, "error": str(e)}, "")
        raise
    _done(cb)
    total = int(meta["length"])
    _emit(args, {"path": args.path, "ok": True, "verified": n, "length": total},
          f"{args.path}: {format_count(n)} stored samples of {format_count(total)} verified, all intact")
    return OK


def _copy(args, verb: str, source: str, target: str) -> int:
    """export, import, push or pull ``source`` to ``target`` with a progress bar, then report."""
    from .transfer.archive import export_tar, import_tar
    from .transfer.sync import pull, push

    run = {"export": export_tar, "import": import_tar, "push": push, "pull": pull}[verb]
    if verb in ("export", "push"):
        _local_cache(source, f"{verb} it")
    else:
        _local_cache(target, f"{verb} into it")
    cb = _progress(args, verb, "bytes")
    try:
        report = run(source, target, callback=cb, storage_options=args.options)
    finally:
        _done(cb)
    done = {"export": "exported", "import": "imported", "push": "pushed", "pull": "pulled"}[verb]
    return _report(args, f"{done} {source} {'to' if verb in ('export', 'push') else 'into'} {target}", report)


def _export(args) -> int:
    return _copy(args, "export", args.path, args.tar)


def _import(args) -> int:
    return _copy(args, "import", args.tar, args.path)


def _push(args) -> int:
    return _copy(args, "push", args.path, args.url)


def _pull(args) -> int:
    return _copy(args, "pull", args.url, args.path)


def _load_source(spec: tuple):
    """The callable ``module:name`` names: imported as ``python -m`` would (this directory first), so
    the user's own module runs here (and, imported again, in every worker)."""
    import importlib

    module_name, attr = spec
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # the console script lacks what `python -m` gives: modules beside you
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise  # the user's module imports something missing: its own error says what
        raise ModuleNotFoundError(f"no module {module_name!r} to take the source from (looked in {os.getcwd()} and "
                                  "on PYTHONPATH): run nbkit build where the module is, or add its folder to PYTHONPATH",
                                  name=e.name) from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as e:
            raise LookupError(f"{module_name} has no {attr!r}: SOURCE names a callable in the module that returns "
                              f"your dataset, e.g. {module_name}:make_train") from e
    if not callable(obj):
        raise TypeError(f"{module_name}:{attr} is not callable (it is {printable(repr(obj))[:60]}): SOURCE names a function "
                        "(or class) that returns your dataset, e.g. `def make_train(): return MyDataset(...)`")
    return obj


def _build(args) -> int:
    import dataclasses
    import signal

    from .cluster import run
    from .cluster.engine import engine_for
    from .dataset import CachedDataset
    from .progress import NoOpCallback

    # What no argument's type can see alone: usage errors (exit 2), before the source runs or the cache is made.
    if args.address is not None and args.engine == "processes":
        args.parser.error("argument --address: the processes engine runs on this machine and joins no cluster: leave "
                          "--address out, or name a cluster engine (--engine ray, --engine dask)")
    if args.address is None and args.workers is not None and args.workers > MAX_LOCAL_WORKERS:
        args.parser.error(f"argument --workers: {args.workers:,} is more processes than nbkit starts on one machine: without --address "
                          f"each worker is a process here; give at most {MAX_LOCAL_WORKERS} (about one per CPU), or join "
                          "a cluster with --address")
    make = _load_source(args.source)
    engine = engine_for(args.engine, workers=args.workers, address=args.address)  # before the source: a bad engine fails fast
    try:
        dataset = make()
        if dataset is None:  # else CachedDataset(None, path) would look for an existing cache there
            name = ":".join(args.source)
            raise TypeError(f"{name} returned None: SOURCE must return the dataset to cache (a map-style dataset, with "
                            f"__len__ and __getitem__, such as a torch Dataset): make {args.source[1]}() end with `return dataset`")
        cached = CachedDataset(dataset, args.cache)
    except BaseException:
        engine.close()
        raise
    cb = _progress(args, "build") or NoOpCallback()

    def stop(signum, frame):
        if cb.should_stop():
            raise KeyboardInterrupt  # a second Ctrl-C: quit now (finished parts are still kept)
        cb.request_stop()
        print(("\n" if sys.stderr.isatty() else "") + "nbkit build: stopping: cancelling the parts not yet built, keeping "
              "every finished one (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, stop)
    try:
        # The callable, not the dataset, travels: each worker makes its own source (nothing to pickle).
        report = run(cached, engine, part_size=args.part_size, callback=cb, factory=make)
    finally:
        signal.signal(signal.SIGINT, previous)
        engine.close()
        _done(cb)
        cached.close()
    data = {"path": args.cache, "engine": engine.name, **dataclasses.asdict(report)}
    _emit(args, data, f"{args.cache}: {report}")
    if report.stopped:
        print("nbkit build: stopped; every finished part is kept: run the same command again to resume", file=sys.stderr)
        return INTERRUPTED
    return OK


def _removals(args, removed: list, verb: str, why_nothing: str | None = None) -> int:
    freed = sum(r.bytes for r in removed)
    lines = [f"{'would remove' if args.dry_run else verb} {r.path} ({format_bytes(r.bytes)} on disk)"
             + (f"; left in place (not cache files): {', '.join(r.left)}" if r.left else "") for r in removed]
    lines.append(f"{'would free' if args.dry_run else 'freed'} {format_bytes(freed)}" + (f": {why_nothing}" if why_nothing else ""))
    data = {"removed": [r.to_json() for r in removed], "bytes": freed, "dry_run": args.dry_run}
    if why_nothing:
        data["why_nothing"] = why_nothing
    _emit(args, data, "\n".join(lines))
    return OK


def _rm(args) -> int:
    from . import disk

    removed = []
    for path in args.paths:
        try:
            removed.append(disk.remove(path, dry_run=args.dry_run, storage_options=args.options or None))
        except (OSError, ValueError):
            if removed:  # say what went before the one that failed
                _removals(args, removed, "removed")
            raise
    return _removals(args, removed, "removed")


def _prune(args) -> int:
    if args.older_than is None and args.max_size is None:
        args.parser.error("say what to prune: --older-than 7d, --max-size 10GB, or both")
    from . import disk

    removed = disk.prune(older_than=args.older_than, max_bytes=args.max_size, dry_run=args.dry_run)
    return _removals(args, removed, "removed", why_nothing=removed.why_nothing)


# -- the parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``nbkit`` argument parser (one sub-command per operation)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    common.add_argument("--debug", action="store_true", help="show the traceback when the command fails")
    common.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress line on stderr (default: when stderr is a terminal)")
    remote = argparse.ArgumentParser(add_help=False)
    remote.add_argument("-o", "--option", dest="options", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="a storage option for fsspec (repeat), e.g. -o endpoint_url=http://127.0.0.1:4443")
    parser = argparse.ArgumentParser(
        prog="nbkit", description="Build, see, check, copy and tidy nbkit caches.",
        epilog="Exit codes: 0 done, 1 the operation failed (message on stderr), 2 bad command line. "
               "Working copies of remote caches live in $NBKIT_CACHE_DIR (default ~/.cache/nbkit).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, fn, help, parents=(common,), description=None):
        p = sub.add_parser(name, parents=list(parents), help=help, description=description or help)
        p.set_defaults(fn=fn, parser=p, options=[])
        return p

    p = command("ls", _ls, "list the caches under ROOTs and the working copies in $NBKIT_CACHE_DIR",
                description="List the caches under each ROOT, and the working copies of remote caches in $NBKIT_CACHE_DIR "
                            "(default ~/.cache/nbkit). With no ROOT it lists only those working copies: nbkit ls DIR lists "
                            "the caches under DIR, nbkit ls . those under this directory. A ROOT that is a URL "
                            "(gs://bucket/caches) lists the parts an unfinished build uploaded there.", parents=(common, remote))
    p.add_argument("roots", nargs="*", type=_url, metavar="ROOT",
                   help="a directory to look for caches in (and below it), or a bucket URL")
    p.add_argument("--max-depth", type=_whole_number(0, MAX_LS_DEPTH, "--max-depth 3", "directories to look down"),
                   default=LS_MAX_DEPTH, metavar="N", help="directories to look down (default %(default)s)")
    p = command("info", _info, "schema, fields, source fingerprint and completeness of one cache")
    p.add_argument("path", type=_path, metavar="PATH")
    p = command("verify", _verify, "check every stored sample's checksum (exit 1 if any is damaged)", (common, remote))
    p.add_argument("path", type=_cache_location, metavar="PATH", help="a cache directory or URL")
    p = command("export", _export, "write a cache into one tar file", (common, remote))
    p.add_argument("path", type=_path, metavar="PATH")
    p.add_argument("tar", type=_url, metavar="TAR", help="the tar file to write (.tar, .tar.gz, .tar.zst; any fsspec URL)")
    p = command("import", _import, "unpack a tar made by export into a cache directory", (common, remote))
    p.add_argument("tar", type=_url, metavar="TAR")
    p.add_argument("path", type=_path, metavar="PATH")
    p = command("push", _push, "copy a cache to a URL (gs://...); resumable, published last", (common, remote))
    p.add_argument("path", type=_path, metavar="PATH")
    p.add_argument("url", type=_url, metavar="URL")
    p = command("pull", _pull, "copy a cache from a URL into a local directory, every file checked", (common, remote))
    p.add_argument("url", type=_url, metavar="URL")
    p.add_argument("path", type=_path, metavar="PATH")
    p = command("rm", _rm, "remove cache directories (never one in use, never through a link), and parts of unfinished builds",
                parents=(common, remote))
    p.add_argument("paths", nargs="+", type=_url, metavar="PATH",
                   help="a cache directory, a leftover, or the parts of an unfinished build (CACHE.parts, or gs://…/CACHE.parts)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p = command("build", _build, "fill a cache with the workers of an engine (processes, ray, dask); resumable",
                description="Fill the cache at CACHE with every sample of the dataset SOURCE returns, computed in parts by "
                            "the workers of an engine: local processes, or a Ray or Dask cluster (--address). SOURCE is "
                            "MODULE:CALLABLE, your own code: nbkit imports MODULE (from this directory or PYTHONPATH) and "
                            "calls CALLABLE() here and in every worker, which must import it too. Ctrl-C stops: every "
                            "finished part is kept, and the same command resumes.")
    p.add_argument("source", type=parse_source, metavar="SOURCE",
                   help="MODULE:CALLABLE returning the dataset, e.g. my_data:make_train (runs your code)")
    p.add_argument("cache", type=_cache_location, metavar="CACHE", help="the cache directory to fill")
    p.add_argument("--engine", choices=("processes", "ray", "dask"), default="processes",
                   help="what runs the parts (default %(default)s; ray needs: pip install ray; dask needs: pip install 'dask[distributed]')")
    p.add_argument("--workers", type=_whole_number(1, MAX_CLUSTER_WORKERS, "--workers 4", "worker processes"), default=None,
                   metavar="N", help="worker processes (default: one per CPU; on a cluster: parts run at once)")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="join this cluster instead of starting a local one (ray: auto or ray://host:10001; dask: tcp://host:8786)")
    p.add_argument("--part-size", type=_whole_number(1, MAX_PART_SIZE, "--part-size 4096", "samples per part"),
                   default=BUILD_PART_SIZE, metavar="N", help="samples per part (default %(default)s)")
    p = command("prune", _prune, "remove working copies in $NBKIT_CACHE_DIR unused for a while or beyond a size")
    p.add_argument("--older-than", type=parse_duration, metavar="AGE", help="unused for AGE (7d, 12h, 30m)")
    p.add_argument("--max-size", type=parse_size, metavar="SIZE", help="keep at most SIZE (10GB), least recently used go first")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    return parser


def main(argv=None) -> int:
    """Run the command line; return its exit code (:data:`OK`, :data:`FAILED`, :data:`USAGE`)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a usage error (2), already printed
        return int(e.code or 0)
    args.options = dict(args.options)
    try:
        with speaking_to("shell"):  # every fix a message names is worded for the shell: -o token=..., nbkit ls
            return args.fn(args)
    except SystemExit as e:  # parser.error() inside a command
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("nbkit: interrupted", file=sys.stderr)
        return 130
    except (OSError, ValueError, LookupError, RuntimeError, TypeError, ImportError) as e:
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        if isinstance(e, OSError) and e.strerror and e.filename is None:
            message = " ".join(e.strerror.split())  # OSError(errno, text): the text without "[Errno n]"
        print(f"nbkit {args.command}: error: {printable(message)}", file=sys.stderr)  # it may quote a path or metadata
        return FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
