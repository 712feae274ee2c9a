"""The ``nbkit`` command line (nbkit/cli.py), every command run as a real ``python -m nbkit`` process:
exit codes, ``--json`` output and one-line errors on stderr."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures_gcs import gcs, gcs_server
from torch.utils.data import TensorDataset

import nbkit
from nbkit.cli import parse_duration, parse_size

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def env(tmp_path):
    d = tmp_path / "nbkit-cache-dir"
    d.mkdir()
    environ = {k: v for k, v in os.environ.items() if k != "COLUMNS"}  # output into a pipe: whole lines
    return {**environ, "NBKIT_CACHE_DIR": str(d), "PYTHONPATH": str(REPO), "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def nbkit_cli(env, *args, input=None):
    return subprocess.run([sys.executable, "-m", "nbkit", *map(str, args)], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300, input=input)


def ok(out):
    assert out.returncode == 0, out.stderr
    return out


def failed(out, *needles):
    """Exit 1, one short line on stderr naming the problem, no traceback."""
    assert out.returncode == 1, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nbkit "), out.stderr
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def make_cache(path, n=48) -> str:
    ds = nbkit.CachedDataset(TensorDataset(torch.randn(n, 3, 4), torch.arange(n)), str(path))
    ds.warmup()
    root = ds.root
    del ds
    gc.collect()
    return root


def set_age(root, seconds_ago):
    t = time.time() - seconds_ago
    for name in os.listdir(root):
        os.utime(os.path.join(root, name), (t, t))


# -- usage ----------------------------------------------------------------------------------------


def test_usage_errors_exit_2_and_help_exits_0(env):
    assert nbkit_cli(env).returncode == 2
    assert nbkit_cli(env, "frobnicate").returncode == 2
    assert nbkit_cli(env, "info").returncode == 2  # PATH missing
    out = nbkit_cli(env, "prune")
    assert out.returncode == 2 and "--older-than" in out.stderr
    out = nbkit_cli(env, "prune", "--older-than", "3 fortnights")
    assert out.returncode == 2 and "not a duration" in out.stderr
    out = ok(nbkit_cli(env, "--help"))
    assert "Exit codes" in out.stdout and all(c in out.stdout for c in ("ls", "verify", "prune", "push"))


# Each: a wrong argument, and what its usage error must say. None may create anything (issue 37: a
# --part-size 0 build exited 1 after creating the cache).
WRONG_ARGUMENTS = [
    (["build", "sources:TupleSource", "c", "--part-size", "0"], "argument --part-size: '0' is out of range"),
    (["build", "sources:TupleSource", "c", "--part-size", str(2**70)], "from 1 to 1,099,511,627,776 (samples per part)"),
    (["build", "sources:TupleSource", "c", "--part-size", "2**70"], "'2**70' is not a whole number"),
    (["build", "sources:TupleSource", "c", "--part-size", "9" * 5000], "is out of range"),
    (["build", "sources:TupleSource", "c", "--workers", "-1"], "argument --workers: '-1' is out of range"),
    (["build", "sources:TupleSource", "c", "--workers", "0"], "argument --workers: '0' is out of range"),
    (["build", "sources:TupleSource", "c", "--workers", "1.5"], "e.g. --workers 4"),
    (["build", "sources:TupleSource", "c", "--workers", "257"], "give at most 256 (about one per CPU), or join a cluster"),
    (["build", "sources:TupleSource", "c", "--workers", "300", "--engine", "dask"], "give at most 256"),
    (["build", "sources:TupleSource", "c", "--address", "tcp://x:1"], "argument --address: the processes engine runs on"),
    (["build", "sources:TupleSource", ""], "argument CACHE: the path or URL is empty"),
    (["build", "sources:TupleSource", "gs:/bucket/c"], "write 'gs://bucket/c'"),
    (["ls", "--max-depth", "-1", "."], "argument --max-depth: '-1' is out of range: give a whole number from 0 to 64"),
    (["ls", "--max-depth", "65", "."], "from 0 to 64"),
    (["ls", ""], "argument ROOT: the path or URL is empty"),
    (["info", ""], "argument PATH: the path is empty"),
    (["verify", "nosuch://b/c"], "argument PATH: the path or URL 'nosuch://b/c' has the unknown scheme"),
    (["verify", ""], "argument PATH: the path or URL is empty"),
    (["export", "c", ""], "argument TAR: the path or URL is empty"),
    (["export", "", "c.tar"], "argument PATH: the path is empty"),
    (["import", "gs:/b/c.tar", "c"], "argument TAR: the path or URL 'gs:/b/c.tar' looks like a URL"),
    (["import", "c.tar", ""], "argument PATH: the path is empty"),
    (["push", "c", "gs:bucket"], "argument URL: the path or URL 'gs:bucket' looks like a URL"),
    (["pull", "gs://b/c", ""], "argument PATH: the path is empty"),
    (["pull", "nosuch://b/c", "c"], "unknown scheme"),
    (["rm", "c", ""], "argument PATH: the path or URL is empty"),
    (["prune", "--max-size=-1GB"], "argument --max-size: '-1GB' is not a size"),
    (["prune", "--older-than", "nan"], "argument --older-than: 'nan' is not a duration"),
]


def test_wrong_arguments_are_usage_errors_before_anything_is_created(tmp_path, monkeypatch, capsys):
    from nbkit.cli import USAGE, main

    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "nbkit-cache-dir"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for argv, needle in WRONG_ARGUMENTS:
        assert main(argv) == USAGE, argv
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[0].startswith(f"usage: nbkit {argv[0]}") and lines[-1].startswith(f"nbkit {argv[0]}: error: argument "), lines
        assert needle in lines[-1], (argv, lines[-1])
        assert os.listdir(work) == [] and not os.path.exists(tmp_path / "nbkit-cache-dir"), argv


def test_argument_bounds_are_the_librarys(tmp_path, monkeypatch):
    from nbkit import cli, disk, trust

    assert (cli.MAX_PART_SIZE, cli.MAX_LOCAL_WORKERS, cli.MAX_CLUSTER_WORKERS) == (
        trust.MAX_SAMPLES, trust.MAX_WORKERS, trust.MAX_WORLD_SIZE)
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path))
    disk.caches(tmp_path, max_depth=cli.MAX_LS_DEPTH)
    with pytest.raises(ValueError, match="max_depth"):
        disk.caches(tmp_path, max_depth=cli.MAX_LS_DEPTH + 1)


@pytest.mark.fuzz
def test_fuzz_any_number_text_reads_in_bounds_or_is_a_usage_error():
    import argparse

    from hypothesis import given, strategies as st

    from nbkit.cli import _whole_number

    parse = _whole_number(1, 2**40, "--part-size 4096", "samples per part")

    @given(st.one_of(st.text(max_size=30), st.integers(min_value=-2**80, max_value=2**80).map(str)))
    def check(t):
        try:
            value = parse(t)
        except argparse.ArgumentTypeError as e:
            assert "give a whole number from 1 to 1,099,511,627,776" in str(e)
            return
        assert type(value) is int and 1 <= value <= 2**40, (t, value)

    check()


def test_a_usage_error_imports_no_torch(tmp_path):
    """A wrong number or path is refused while parsing, before a command imports what it uses."""
    code = ("import sys; from nbkit.cli import main; "
            "rcs = [main(['build', 'absent_module:make', 'c', '--part-size', '0']), main(['verify', 'gs:/b/c'])]; "
            "print(rcs, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[2, 2] False", out.stderr
    assert os.listdir(tmp_path) == []


def test_console_script_is_declared_and_import_nbkit_stays_light():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["nbkit"].partition(":")
    assert (module, name) == ("nbkit.cli", "main")
    code = "import sys, nbkit; print([m for m in ('nbkit.cli', 'nbkit.disk') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_sizes_and_durations():
    assert parse_size("10GB") == 10**10 and parse_size("1.5 GiB") == int(1.5 * 2**30) and parse_size("7") == 7
    assert parse_duration("7d") == 7 * 86400 and parse_duration("2w") == 14 * 86400 and parse_duration("1.5h") == 5400
    for bad in ("", "GB", "-1GB", "10XB"):
        with pytest.raises(Exception, match="not a size"):
            parse_size(bad)


# -- ls, info, verify -----------------------------------------------------------------------------


@pytest.mark.fuzz
def test_fuzz_any_size_or_duration_text_reads_or_is_a_usage_error():
    import argparse
    import math

    from hypothesis import given, strategies as st

    number = st.from_regex(r"[0-9]{1,400}(\.[0-9]{0,5})?", fullmatch=True)
    text = st.one_of(st.text(max_size=30), st.builds(lambda n, u: n + u, number, st.sampled_from(
        ["", "b", "KB", "mib", "GB", "TiB", "PB", "s", "m", "h", "d", "w", "x"])))

    @given(text)
    def check(t):
        for parse, limit in ((parse_size, 2**63), (parse_duration, 100 * 365.25 * 86400)):
            try:
                value = parse(t)
            except argparse.ArgumentTypeError as e:
                assert repr(t) in str(e)  # names what it got, and says how to write it
                continue
            assert math.isfinite(value) and 0 <= value < limit, (t, value)

    check()


def test_ls_lists_caches_as_a_table_and_as_json(tmp_path, env):
    root = make_cache(tmp_path / "one")
    broken = tmp_path / "two"
    broken.mkdir()
    (broken / "nbkit.json").write_text("[]")
    out = ok(nbkit_cli(env, "ls", tmp_path))
    title, blank, header = out.stdout.splitlines()[:3]
    assert title == f"caches under {tmp_path}, and working copies of remote caches in {env['NBKIT_CACHE_DIR']} ($NBKIT_CACHE_DIR)"
    assert blank == "" and header.split() == ["samples", "on", "disk", "last", "used", "path"]
    assert root in out.stdout and "48/48" in out.stdout and "broken" in out.stdout
    listed = {c["path"]: c for c in json.loads(ok(nbkit_cli(env, "ls", "--json", tmp_path)).stdout)}
    assert listed[root]["stored"] == 48 and listed[root]["complete"] is True and listed[root]["in_use"] is False
    assert listed[str(broken)]["problem"] and listed[str(broken)]["complete"] is False
    assert json.loads(ok(nbkit_cli(env, "ls", "--json")).stdout) == []  # an empty $NBKIT_CACHE_DIR


def test_ls_says_which_directories_it_listed_and_how_to_list_another(env):
    # With no ROOT, ls lists only the working copies: its help and its output both say so.
    out = ok(nbkit_cli(env, "ls"))
    assert out.stdout.splitlines()[0] == (f"working copies of remote caches in {env['NBKIT_CACHE_DIR']} ($NBKIT_CACHE_DIR); "
                                          "nbkit ls DIR lists the caches under DIR")
    assert "0 caches, 0 B on disk" in out.stdout
    text = " ".join(ok(nbkit_cli(env, "ls", "--help")).stdout.split())
    assert "With no ROOT it lists only those working copies: nbkit ls DIR lists the caches under DIR" in text


def test_ls_max_depth_default_is_the_one_nbkit_caches_uses():
    from nbkit.cli import LS_MAX_DEPTH
    from nbkit.disk import MAX_DEPTH

    assert LS_MAX_DEPTH == MAX_DEPTH


def test_info_describes_schema_fields_fingerprint_and_completeness(tmp_path, env):
    root = make_cache(tmp_path / "c")
    data = json.loads(ok(nbkit_cli(env, "info", "--json", root)).stdout)
    assert (data["stored"], data["length"], data["complete"], data["version"]) == (48, 48, True, 1)
    assert [(f["field"], f["kind"], f["dtype"], f["shape"]) for f in data["fields"]] == [
        ("[0]", "tensor", "float32", [3, 4]), ("[1]", "tensor", "int64", [])]
    assert data["fingerprint"]["type"].endswith("TensorDataset") and data["fingerprint"]["probes"] == 3
    assert data["sample"] == "tuple (Tensor[3, 4] float32, Tensor[] int64)"
    text = ok(nbkit_cli(env, "info", root)).stdout
    assert "48/48 (complete)" in text and "float32" in text and "3×4" in text and "TensorDataset" in text
    assert "sample   tuple (Tensor[3, 4] float32, Tensor[] int64)\n" in text and '["T"' not in text
    assert f"on disk  {nbkit.text.format_bytes(data['bytes'])} (sample data, index and metadata)\n" in text
    failed(nbkit_cli(env, "info", tmp_path), "no nbkit cache")
    debug = nbkit_cli(env, "info", "--debug", tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr


def test_verify_exits_1_on_a_damaged_sample(tmp_path, env):
    root = make_cache(tmp_path / "c")
    data = json.loads(ok(nbkit_cli(env, "verify", "--json", root)).stdout)
    assert data == {"path": root, "ok": True, "verified": 48, "length": 48}
    col = Path(root) / "col-0.bin"
    raw = bytearray(col.read_bytes())
    raw[5 * 48 + 1] ^= 0xFF  # sample 5's row (3×4 float32 = 48 bytes)
    col.write_bytes(bytes(raw))
    out = nbkit_cli(env, "verify", root)
    failed(out, "nbkit verify: error:", "5")
    out = nbkit_cli(env, "verify", "--json", root)
    assert out.returncode == 1 and json.loads(out.stdout)["ok"] is False


def test_progress_line_on_stderr(tmp_path, env):
    root = make_cache(tmp_path / "c")
    out = ok(nbkit_cli(env, "verify", "--progress", root))
    assert "verify" in out.stderr and "48/48" in out.stderr
    assert ok(nbkit_cli(env, "verify", root)).stderr == ""  # not a terminal: no progress


def test_progress_is_on_by_default_in_a_terminal(tmp_path, env):
    import pty

    root = make_cache(tmp_path / "c")
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "nbkit", "export", root, str(tmp_path / "c.tar")], env=env,
                              cwd=REPO, stdout=subprocess.PIPE, stderr=terminal, text=True, timeout=300)
        os.close(terminal)
        terminal = None
        seen = b""
        while True:
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        if terminal is not None:
            os.close(terminal)
        os.close(controller)
    assert proc.returncode == 0
    assert b"export" in seen and b"100.0%" in seen


# -- export, import, push, pull -------------------------------------------------------------------


def test_export_then_import(tmp_path, env):
    root = make_cache(tmp_path / "c")
    tar = tmp_path / "c.tar.gz"
    report = json.loads(ok(nbkit_cli(env, "export", "--json", root, tar)).stdout)
    assert "nbkit.json" in report["transferred"] and report["stopped"] is False
    out = ok(nbkit_cli(env, "import", tar, tmp_path / "copy"))
    assert out.stdout.startswith(f"imported {tar} into")
    copy = nbkit.CachedDataset.open(tmp_path / "copy")
    assert torch.equal(copy[7][0], nbkit.CachedDataset.open(root)[7][0])
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "thesis.tex").write_text("mine")
    failed(nbkit_cli(env, "import", tar, tmp_path / "taken"), "not an nbkit cache")
    failed(nbkit_cli(env, "import", tmp_path / "absent.tar", tmp_path / "x"))


def test_push_then_pull_through_the_gcs_emulator(tmp_path, env, gcs):
    root = make_cache(tmp_path / "c")
    opts = [a for k, v in gcs.storage_options.items() for a in ("-o", f"{k}={v}")]
    url = gcs.url + "/cache"
    report = json.loads(ok(nbkit_cli(env, "push", "--json", root, url, *opts)).stdout)
    assert "nbkit.json" in report["transferred"]
    again = json.loads(ok(nbkit_cli(env, "push", "--json", root, url, *opts)).stdout)
    assert again["transferred"] == [] or again["transferred"] == ["manifest.json"]
    out = ok(nbkit_cli(env, "pull", url, tmp_path / "pulled", *opts))
    assert out.stdout.startswith(f"pulled {url} into")
    assert np.array_equal(np.fromfile(tmp_path / "pulled" / "col-0.bin"), np.fromfile(Path(root) / "col-0.bin"))
    failed(nbkit_cli(env, "pull", gcs.url + "/nothing", tmp_path / "p2", *opts), "nbkit pull: error:")
    assert nbkit_cli(env, "push", root, url, "-o", "no-equals-sign").returncode == 2


# -- rm, prune ------------------------------------------------------------------------------------


def test_rm_removes_a_cache_and_refuses_the_rest(tmp_path, env):
    root = make_cache(tmp_path / "c")
    data = json.loads(ok(nbkit_cli(env, "rm", "--dry-run", "--json", root)).stdout)
    assert data["dry_run"] is True and data["removed"][0]["path"] == root and os.path.isdir(root)
    (tmp_path / "plain").mkdir()
    failed(nbkit_cli(env, "rm", tmp_path / "plain"), "not an nbkit cache")
    os.symlink(root, tmp_path / "link")
    failed(nbkit_cli(env, "rm", tmp_path / "link"), "symbolic link")
    failed(nbkit_cli(env, "rm", "/"), "root directory")
    code = ("import sys, nbkit\nds = nbkit.CachedDataset.open(sys.argv[1]); ds[0]\n"
            "print('ready', flush=True); sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=env)
    try:
        assert holder.stdout.readline().strip() == "ready"
        failed(nbkit_cli(env, "rm", root), "a process has the cache open", "Close it")
        assert json.loads(ok(nbkit_cli(env, "ls", "--json", tmp_path)).stdout)[0]["in_use"] is True
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
    out = ok(nbkit_cli(env, "rm", root))
    assert out.stdout.startswith(f"removed {root}") and not os.path.exists(root)
    assert os.path.islink(tmp_path / "link")


def test_prune_by_age_and_by_size(tmp_path, env):
    base = Path(env["NBKIT_CACHE_DIR"])
    a, b, c = (make_cache(base / name, n=n) for name, n in (("a", 96), ("b", 48), ("c", 24)))
    for root, days in zip((a, b, c), (10, 5, 1)):
        set_age(root, days * 86400)
    data = json.loads(ok(nbkit_cli(env, "prune", "--older-than", "7d", "--dry-run", "--json")).stdout)
    assert [r["path"] for r in data["removed"]] == [a] and os.path.isdir(a)
    out = ok(nbkit_cli(env, "prune", "--older-than", "7d"))
    assert out.stdout.startswith(f"removed {a}") and not os.path.exists(a)
    sizes = {x["path"]: x["bytes"] for x in json.loads(ok(nbkit_cli(env, "ls", "--json")).stdout)}
    data = json.loads(ok(nbkit_cli(env, "prune", "--max-size", str(sizes[c]), "--json")).stdout)
    assert [r["path"] for r in data["removed"]] == [b] and data["bytes"] == sizes[b]
    assert os.path.isdir(c)


def test_info_names_nested_fields_and_free_form_samples(tmp_path, capsys):
    from collections import namedtuple

    from nbkit.cli import main

    Point = namedtuple("Point", ["x", "y"])
    nbkit.register_namedtuple(Point, "tests.test_cli:Point")

    class Nested(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return {"image": torch.ones(2, 2) * i, "meta": (Point(i, 2 * i), "x" * i)}

    class Free(torch.utils.data.Dataset):
        def __len__(self):
            return 6

        def __getitem__(self, i):
            return [1] * i

    nbkit.CachedDataset(Nested(), str(tmp_path / "nested")).warmup()
    nbkit.CachedDataset(Free(), str(tmp_path / "free")).warmup()
    assert main(["info", "--json", str(tmp_path / "nested")]) == 0
    data = json.loads(capsys.readouterr().out)
    fields = data["fields"]
    assert [(f["field"], f["kind"], f["dtype"]) for f in fields] == [
        ("['image']", "tensor", "float32"), ("['meta'][0].x", "int", "int64"), ("['meta'][0].y", "int", "int64"),
        ("['meta'][1]", "str", None)]
    assert data["sample"] == "dict {'image': Tensor[2, 2] float32, 'meta': tuple (Point (x: int, y: int), str)}"
    assert data["structure"][0] == "D"  # the stored form stays in --json
    assert main(["info", str(tmp_path / "free")]) == 0
    assert "free-form samples" in capsys.readouterr().out


def test_info_describes_every_kind_of_stored_value():
    from nbkit.cli import describe_structure
    from nbkit.codec import Schema

    def leaf(kind, store, dtype="", shape=(), column=-1, **extra):
        return {"kind": kind, "store": store, "dtype": dtype, "shape": list(shape), "column": column, **extra}

    schema = Schema.from_json({
        "structure": ["L", ["*", "*", "*", "*", ["N", "m:Pair", ["*", "*"]], ["T", ["*"] * 10]]],
        "leaves": [leaf("tensor", "var", "bfloat16"), leaf("ndarray", "col", "<f4", (3, 4), 0),
                   leaf("pil", "col", "|u1", (28, 32), 1, mode="L"), leaf("npscalar", "col", "<i2", (), 2),
                   leaf("none", "const"), leaf("pickle", "var"), *[leaf("str", "var")] * 10]})
    assert describe_structure(schema.structure, schema.leaves) == (
        "list [Tensor[…] bfloat16, ndarray[3, 4] float32, PIL image L 32x28, numpy int16, Pair (None, pickled object), "
        "tuple (str, str, str, str, str, str, str, str, … 2 more)]")


# -- what reaches the terminal (issue 25) ---------------------------------------------------------

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[H\r\u202e\x9b1A"


def _raw_controls(text):
    """The control and format characters in ``text`` besides the line breaks between its lines."""
    import unicodedata

    return [ch for ch in text.replace("\n", "") if unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def test_ls_and_info_show_escape_sequences_from_a_cache_as_text(tmp_path, env):
    # Every string of nbkit.json the parser accepts free-form, and the directory names, carry
    # sequences that would retitle the terminal, clear it, move the cursor or reverse the text.
    root = make_cache(tmp_path / f"evil{ESCAPES}\nfake row")
    meta_path = Path(root) / "nbkit.json"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"].update(type=f"Data{ESCAPES}", length=f"48{ESCAPES}", transform=f"t={ESCAPES}",
                               samples={k: f"{ESCAPES}"[:64] for k in meta["fingerprint"]["samples"]})
    meta["schema"]["structure"] = ["D", [f"image{ESCAPES}", f"label{ESCAPES}"], meta["schema"]["structure"][1]]
    meta["extra"] = ESCAPES  # a field a newer nbkit might add: kept, never shown raw
    meta_path.write_text(json.dumps(meta))
    broken = tmp_path / f"broken{ESCAPES}"
    broken.mkdir()
    (broken / "nbkit.json").write_text(json.dumps({"format": ESCAPES}))
    copy = Path(env["NBKIT_CACHE_DIR"]) / f"copy{ESCAPES}"
    make_cache(copy)
    Path(f"{copy}.origin.json").write_text(json.dumps({"format": "nbkit-working-copy", "url": f"gs://b/{ESCAPES}"}))

    out = ok(nbkit_cli(env, "ls", tmp_path))
    assert not _raw_controls(out.stdout + out.stderr), out.stdout
    # What was listed, header, one line a cache, a line under the broken one and the working copy, the total.
    assert len(out.stdout.splitlines()) == 2 + 1 + 3 + 2 + 1
    assert "evil\\x1b]0;pwned\\x07\\x1b[2J\\x1b[H\\r\\u202e\\x9b1A\\nfake row" in out.stdout
    assert "gs://b/\\x1b]0;pwned" in out.stdout and "broken\\x1b]0;pwned" in out.stdout

    out = ok(nbkit_cli(env, "info", root))
    assert not _raw_controls(out.stdout + out.stderr), out.stdout
    assert "evil\\x1b]0;pwned" in out.stdout and "Data\\x1b]0;pwned" in out.stdout and "t=\\x1b]0;pwned" in out.stdout
    assert "['image\\x1b]0;pwned\\x07" in out.stdout  # the field table names each dict key, escaped
    assert "dict {'image\\x1b]0;pwned\\x07" in out.stdout  # and so does the sample's description
    assert json.loads(ok(nbkit_cli(env, "info", "--json", root)).stdout)["fingerprint"]["type"] == f"Data{ESCAPES}"

    line = failed(nbkit_cli(env, "info", broken), "broken\\x1b]0;pwned")  # an error quoting the path
    assert not _raw_controls(line)


def test_ls_fits_80_columns_with_ages_people_read_and_counts_in_grammar(tmp_path, env):
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "datasets" / "mnist-train-normalized"
    root = make_cache(deep)
    two_days = time.time() - 240 * 3600 - 60
    for name in os.listdir(root):
        os.utime(os.path.join(root, name), (two_days, two_days))
    out = ok(nbkit_cli({**env, "COLUMNS": "80"}, "ls", tmp_path))
    lines = out.stdout.splitlines()
    # The path is copied from here into the next command: never cut. Too long for the row, it goes
    # whole on the next line; every other line fits.
    assert f"    {root}" in lines and "…" not in out.stdout, out.stdout
    assert all(len(line) <= 80 for line in lines if line != f"    {root}"), [len(line) for line in lines]
    row = lines[lines.index(f"    {root}") - 1]
    assert "48/48" in row and "10 days ago" in row and "240h" not in out.stdout
    assert lines[-1].startswith("1 cache, ")
    whole = ok(nbkit_cli(env, "ls", tmp_path)).stdout  # into a pipe: the whole path, for grep
    assert root in whole


def test_a_file_where_a_cache_directory_is_expected_is_named_with_the_fix(tmp_path, env):
    root = make_cache(tmp_path / "c")
    tar = tmp_path / "c.tar"
    ok(nbkit_cli(env, "export", root, tar))
    line = failed(nbkit_cli(env, "info", tar), "is a tar archive, not a cache directory", f"nbkit import {tar} CACHE_DIR",
                  "nbkit info CACHE_DIR")
    assert "Errno" not in line
    for args in (("verify", tar), ("rm", tar), ("export", tar, tmp_path / "x.tar"), ("push", tar, tmp_path / "bucket")):
        failed(nbkit_cli(env, *args), "is a tar archive, not a cache directory", "nbkit import")
    failed(nbkit_cli(env, "info", Path(root) / "nbkit.json"), "the metadata file of a cache", f"give its directory {root}")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    failed(nbkit_cli(env, "info", other), "is a file, not a cache directory", "nbkit ls")
    failed(nbkit_cli(env, "ls", other), "is a file, not a cache directory")
    failed(nbkit_cli(env, "import", tar, other), "is a file, not a cache directory")


def test_shell_messages_name_shell_fixes(tmp_path, env):
    line = failed(nbkit_cli(env, "rm", tmp_path / "nothing-here"), "nbkit ls")
    assert "nbkit.caches()" not in line
    out = nbkit_cli(env, "pull", tmp_path / "no-bucket", tmp_path / "copy")
    line = failed(out, "holds no complete nbkit cache", "nbkit push CACHE_DIR")
    assert "nbkit.push(" not in line


def test_prune_that_frees_nothing_says_why(tmp_path, env):
    out = ok(nbkit_cli(env, "prune", "--max-size", "1GB"))
    assert "freed 0 B: there are no working copies of remote caches in" in out.stdout
    make_cache(Path(env["NBKIT_CACHE_DIR"]) / "copy")
    out = ok(nbkit_cli(env, "prune", "--max-size", "1GB"))
    assert "freed 0 B: the 1 working copy takes" in out.stdout and "within the limit of 1.0 GB already" in out.stdout
    out = ok(nbkit_cli(env, "prune", "--older-than", "7d"))
    assert "freed 0 B: none was unused for 7 days (the least recently used was last used" in out.stdout
    data = json.loads(ok(nbkit_cli(env, "prune", "--max-size", "1GB", "--json")).stdout)
    assert data["bytes"] == 0 and "within the limit" in data["why_nothing"]


def test_long_commands_print_one_final_line_per_phase_in_its_unit(tmp_path, env):
    root = make_cache(tmp_path / "c", n=600)
    tar = tmp_path / "c.tar"
    runs = {
        "export": (("export", root, tar), [("export hash", "B/s"), ("export", "B/s")]),
        "import": (("import", tar, tmp_path / "imported"), [("import", "B/s"), ("import verify", "samples/s")]),
        "push": (("push", root, tmp_path / "bucket"), [("push hash", "B/s"), ("push", "B/s")]),
        "pull": (("pull", tmp_path / "bucket", tmp_path / "pulled"), [("pull", "B/s"), ("pull verify", "samples/s")]),
        "verify": (("verify", root), [("verify", "samples/s")]),
    }
    for name, (args, phases) in runs.items():
        out = ok(nbkit_cli(env, *args, "--progress"))
        lines = out.stderr.splitlines()  # into a pipe: log lines, each phase's last one at 100%
        finals = [line for line in lines if "100.0%" in line]
        assert [line.split("  ")[0] for line in finals] == [p for p, _ in phases], (name, lines)
        for line, (_, unit) in zip(finals, phases):
            done, total = line.split("  ")[1].split("/")
            assert done == total and unit in line and (unit != "B/s" or "samples/s" not in line), line
        assert len(lines) == len(set(lines)), (name, lines)  # no line printed twice
        percents = [float(p[:-1]) for line in lines for p in line.split() if p.endswith("%")]
        assert all(0 <= p <= 100 for p in percents), (name, lines)


# -- nbkit build -------------------------------------------------------------------------------------

GATED_SOURCE = '''
import os, time
import torch
from torch.utils.data import Dataset

GATE = {gate!r}


class Gated(Dataset):
    """128 samples; sample 70 (in the third part of 32) waits for GATE + ".go" once it exists."""

    def __len__(self):
        return 128

    def __getitem__(self, i):
        if not 0 <= i < 128:
            raise IndexError(i)
        if i == 70 and not os.path.exists(GATE + ".go"):
            open(GATE, "w").close()
            while not os.path.exists(GATE + ".go"):
                time.sleep(0.02)
        return torch.full((3,), float(i)), i % 10


def make():
    return Gated()
'''


def _stored(path) -> int:
    with nbkit.CachedDataset.open(str(path)) as ds:
        return len(ds) - len(ds.missing())


def _same_as(path, source) -> None:
    with nbkit.CachedDataset.open(str(path)) as ds:
        assert len(ds.missing()) == 0 and ds.verify() == len(source)
        for i in range(len(source)):
            a, b = ds[i], source[i]
            assert torch.equal(a[0], b[0]) and int(a[1]) == int(b[1]), i


def test_build_part_size_default_is_the_drivers():
    from nbkit.cluster.plan import DEFAULT_PART_SIZE
    from nbkit.cli import BUILD_PART_SIZE

    assert BUILD_PART_SIZE == DEFAULT_PART_SIZE


def test_build_with_worker_processes_shows_each_worker_and_fills_the_cache(tmp_path, env):
    from sources import TupleSource

    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    cache = tmp_path / "c"
    out = ok(nbkit_cli(env, "build", "sources:TupleSource", cache, "--workers", "2", "--part-size", "25", "--progress"))
    assert out.stdout.startswith(f"{cache}: build done: 100 computed") and "4 parts merged" in out.stdout
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("build  100/100  100.0%") and "parts 4/4 · " in lines[-1], out.stderr
    assert any("parts 1/4 · 1 worker" in ln for ln in lines), out.stderr
    _same_as(cache, TupleSource())
    again = json.loads(ok(nbkit_cli(env, "build", "sources:TupleSource", cache, "--json")).stdout)
    assert (again["computed"], again["skipped"], again["engine"]) == (0, 100, "local processes")


def test_build_refuses_a_source_that_names_no_callable_or_returns_none(tmp_path, monkeypatch, capsys):
    from nbkit.cli import main

    (tmp_path / "mine.py").write_text("NOT_A_FUNCTION = 3\n\ndef never_called():\n    raise AssertionError\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])  # as the console script has it
    monkeypatch.setitem(sys.modules, "mine", None)
    del sys.modules["mine"]  # imported fresh from this directory, and forgotten after the test

    def error(*args):
        assert main(["build", *args, str(tmp_path / "c")]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("nbkit build: error: ")
        return lines[0]

    assert main(["build", "mine", str(tmp_path / "c")]) == 2  # not MODULE:CALLABLE: a usage error
    assert "'mine' is not MODULE:CALLABLE" in capsys.readouterr().err
    assert "mine has no 'make'" in error("mine:make")
    assert "mine:NOT_A_FUNCTION is not callable (it is 3)" in error("mine:NOT_A_FUNCTION")
    assert "no module 'absent_module'" in error("absent_module:make")
    assert main(["build", "mine:never_called", str(tmp_path / "c"), "--address", "tcp://x:1"]) == 2  # before the source runs
    assert "joins no cluster" in capsys.readouterr().err
    (tmp_path / "nothing.py").write_text("def make():\n    pass\n")
    monkeypatch.setitem(sys.modules, "nothing", None)
    del sys.modules["nothing"]
    said = error("nothing:make")  # not "no nbkit cache at …": CachedDataset(None, path) opens an existing cache
    assert "nothing:make returned None: SOURCE must return the dataset to cache" in said and "`return dataset`" in said
    assert not os.path.exists(tmp_path / "c")


def test_ctrl_c_stops_the_build_keeps_finished_parts_and_the_same_command_resumes(tmp_path, env):
    import signal

    gate = tmp_path / "gate"
    (tmp_path / "gated_source.py").write_text(GATED_SOURCE.format(gate=str(gate)))
    cache = tmp_path / "c"
    command = [sys.executable, "-m", "nbkit", "build", "gated_source:make", str(cache), "--workers", "2", "--part-size", "32"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a shell runs a command
    try:
        deadline = time.monotonic() + 120
        while not gate.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert gate.exists(), proc.communicate(timeout=10)
        while time.monotonic() < deadline and _stored(cache) < 96:  # the other worker builds the fourth part meanwhile
            time.sleep(0.1)
        assert _stored(cache) == 96
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group, workers too (they leave it to the driver)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (stdout, stderr)
    assert "stopping: cancelling the parts not yet built" in stderr and "run the same command again to resume" in stderr
    assert "Traceback" not in stderr and "build stopped: 96 computed" in stdout
    assert _stored(cache) == 96  # every finished part kept
    assert not os.path.exists(str(cache) + ".parts")  # the killed build's staging swept; nothing half-built left

    (tmp_path / "gate.go").touch()
    out = subprocess.run(command + ["--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["computed"], report["skipped"], report["stopped"]) == (32, 96, False)  # only the missing part
    import importlib.util

    spec = importlib.util.spec_from_file_location("gated_source", tmp_path / "gated_source.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _same_as(cache, module.make())


def test_build_on_a_dask_cluster_the_test_started(tmp_path, env, dask_engine):
    from sources import TupleSource

    address = dask_engine.client.scheduler.address
    env = {**env, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    cache = tmp_path / "c"
    out = ok(nbkit_cli(env, "build", "sources:TupleSource", cache, "--engine", "dask", "--address", address,
                       "--part-size", "20", "--progress", "--json"))
    report = json.loads(out.stdout)
    assert (report["engine"], report["computed"], report["parts"], report["stopped"]) == ("dask", 100, 5, False)
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("build  100/100  100.0%") and "parts 5/5 · " in last, out.stderr
    worker_pids = set(dask_engine.client.run(os.getpid).values())
    assert any(f":{pid}" in out.stderr for pid in worker_pids), (worker_pids, out.stderr)  # the cluster's workers did it
    _same_as(cache, TupleSource())
    assert dask_engine.client.status == "running"  # joined, not closed: the cluster stays the test's


def test_ls_and_rm_see_the_parts_an_unfinished_build_uploaded(capsys):
    """A bucket URL as ROOT lists the parts prefixes under it (shown as given, not as a local path), and
    `nbkit rm URL.parts` removes them, with -o storage options (issue 37)."""
    import fsspec

    from nbkit.cli import main

    fs = fsspec.filesystem("memory")
    base = "memory://nbkit-cli-parts/caches"
    fs.pipe("/nbkit-cli-parts/caches/c.parts/part-0000000000000-0000000000016/nbkit.json", b"{}")
    fs.pipe("/nbkit-cli-parts/caches/c.parts/part-0000000000000-0000000000016/col-0.bin", b"x" * 100)
    try:
        assert main(["ls", base, "--json", "-o", "skip_instance_cache=true"]) == 0
        listed = [c["path"] for c in json.loads(capsys.readouterr().out)]
        assert f"{base}/c.parts" in listed
        assert main(["ls", base]) == 0
        out = capsys.readouterr().out
        assert f"caches under {base}," in out and os.getcwd() not in out.split("\n")[0]
        assert main(["rm", f"{base}/c.parts", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["bytes"] == 102
        assert not fs.exists("/nbkit-cli-parts/caches/c.parts")
    finally:
        if fs.exists("/nbkit-cli-parts"):
            fs.rm("/nbkit-cli-parts", recursive=True)


def test_info_shows_a_multi_line_transform_on_one_line(tmp_path, env):
    """A torchvision Compose's repr spans lines: `nbkit info` shows it on one line, not with "\\n" escapes."""
    root = make_cache(tmp_path / "c")
    meta_path = Path(root) / "nbkit.json"
    meta = json.loads(meta_path.read_text())
    meta["fingerprint"]["transform"] = "Compose(\n    ToTensor()\n    Normalize(mean=(0.1307,), std=(0.3081,))\n)"
    meta_path.write_text(json.dumps(meta))
    out = ok(nbkit_cli(env, "info", root)).stdout
    assert "Compose(ToTensor(), Normalize(mean=(0.1307,), std=(0.3081,)))" in out, out
    assert "\\n" not in out, out
