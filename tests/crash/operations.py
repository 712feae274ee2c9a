"""The operations the crash harness kills at every file-system call: one :class:`Operation` each.

**Every new operation that changes files on disk gets an entry in :data:`OPERATIONS`** (name, setup,
run, target, the states allowed before and after); ``tests/crash/test_crash.py`` runs every entry,
in CI within a fixed budget and with ``NBKIT_CRASH=all`` at every crash point (``docs/CRASH.md``).

An operation works inside one directory, ``work``, laid out as::

    work/parent/<target>       the cache, tar or key-value cache the operation changes
    work/parent/bystander/     a sibling with files and a second cache: never touched
    work/src/cache             the cache an export or push reads (an input: never touched)
    work/remote/cache          a pushed copy (pull's input; push's target)
    work/scratch/              setup's own use

``setup(work)`` builds the state before the operation and ``run(work)`` is the operation itself,
run in a fresh process; both take absolute paths from ``work`` only, so the harness may run them on
any copy of the directory. Transfers use one worker thread (``max_workers=1``), so that the k-th call
is the same call in every run. Samples come from :class:`Source` (same shape for every seed, different
values), so which source a stored sample belongs to is always known.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

#: Samples in each cache: small, so an operation makes a few hundred file-system calls.
N = 32
#: Warmups store this many samples per chunk, so a warmup has several chunks to be killed between.
CHUNK = 4


class Source(torch.utils.data.Dataset):
    """``(tensor 3×4, label, name)``; ``seed`` changes every value, never the shape (the name goes to the heap)."""

    def __init__(self, seed: int, n: int = N):
        self.seed, self.n = seed, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randn(3, 4, generator=g), (i * 7 + self.seed) % 10, f"s{self.seed}-{i}" + "x" * (i % 3)


def same_sample(a, b) -> bool:
    """Whether a sample read from a cache equals a source's sample."""
    return len(a) == len(b) and torch.equal(a[0], b[0]) and int(a[1]) == int(b[1]) and str(a[2]) == str(b[2])


def value(seed: int, key: int):
    """The value a CacheLoader stores under ``key`` (``seed`` tells versions apart)."""
    return torch.arange(6, dtype=torch.float32) * key + seed, f"v{seed}-{key}"


def same_value(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


@dataclass(frozen=True)
class Expect:
    """A state of the target: built from ``Source(seed)``; ``whole``: every sample stored (an import,
    pull or push leaves nothing else), else any subset of correct samples (a warmup in progress)."""

    seed: int
    whole: bool = True


@dataclass(frozen=True)
class Operation:
    """One operation under test.

    Attributes:
        name: its id in test names and reports.
        setup: ``setup(work)`` builds the state before it.
        run: ``run(work)`` does it (in a fresh process).
        target: what it changes, relative to ``work``; its parent directory is checked for leftovers.
        kind: how the target is read back: ``"cache"`` (``CachedDataset.open``), ``"tar"`` (bytes,
            then ``import_tar``), ``"remote"`` (a pushed prefix: ``nbkit.pull``), ``"keyed"``
            (``CacheLoader``).
        old, new: the target before and after (``None``: no target).
        absent_ok: a crash may leave no target at all (a rebuild or removal in progress).
        inputs: what it reads, relative to ``work``: must stay byte-identical (``parent/bystander`` always).
        entries: the names its parent directory may hold besides the target and the bystander.
        power_loss: also run the simulated power cut at every crash point.
        env: environment variables for the operation (``work`` substituted for ``{work}``).
        removable: the target is a cache ``nbkit.remove`` takes (after a crash it must leave nothing).
    """

    name: str
    setup: Callable[[str], None]
    run: Callable[[str], None]
    target: str
    kind: str
    old: Expect | None
    new: Expect | None
    absent_ok: bool = False
    inputs: tuple = ()
    entries: tuple = ()
    power_loss: bool = False
    env: dict = field(default_factory=dict)
    removable: bool = True


# -- building blocks ------------------------------------------------------------------------------


def _p(work: str, *parts) -> str:
    return os.path.join(work, *parts)


def build_cache(path: str, seed: int, stored: int | None = None) -> None:
    """A cache of ``Source(seed)`` at ``path``: whole, or with its first ``stored`` samples."""
    import nbkit

    ds = nbkit.CachedDataset(Source(seed), path)
    if stored is None:
        ds.warmup()
    else:
        for i in range(stored):
            ds[i]
    ds.store.close()


def bystander(work: str) -> None:
    """``parent/bystander``: plain files and a second cache, beside the target."""
    d = _p(work, "parent", "bystander")
    os.makedirs(d)
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("not nbkit's\n")
    with open(os.path.join(d, "data.bin"), "wb") as f:
        f.write(bytes(range(256)) * 4)
    build_cache(os.path.join(d, "cache2"), seed=7)


def _url(path: str) -> str:
    return "file://" + path


def _warmup(seed: int, overwrite: bool = False):
    def run(work):
        import nbkit

        ds = nbkit.CachedDataset(Source(seed), _p(work, "parent", "cache"), overwrite=overwrite)
        ds.warmup(num_workers=0, chunk_size=CHUNK)
        ds.store.close()
    return run


def _run_warmup_rows(work):
    import nbkit
    from nbkit import format as fmt
    from nbkit.cachedir import CacheFiles

    # Every array column goes to the files as format.Rows, one pwrite a row (the path of large rows:
    # decoded images), so that each row's write is a crash point of its own.
    fmt.ROWS_MIN_BYTES = 0
    real, seen = CacheFiles.write_rows, []
    CacheFiles.write_rows = lambda self, k, idx, rows: seen.append((k, type(rows))) or real(self, k, idx, rows)
    _warmup(1)(work)
    assert all(kind is fmt.Rows for k, kind in seen if k == 0), "the tensor column went to the files stacked"


# -- the operations -------------------------------------------------------------------------------


def _setup_warmup_new(work):
    bystander(work)


def _setup_warmup_resume(work):
    bystander(work)
    build_cache(_p(work, "parent", "cache"), 1, stored=N // 2)


def _setup_whole_cache(work):
    bystander(work)
    build_cache(_p(work, "parent", "cache"), 1)


def _run_remove(work):
    import nbkit

    nbkit.remove(_p(work, "parent", "cache"))


OLD_COPY = "data-0123456789abcdef"
YOUNG_COPY = "young-fedcba9876543210"


def _origin(path: str, url: str) -> None:
    with open(path + ".origin.json", "w") as f:
        json.dump({"format": "nbkit-working-copy", "url": url, "endpoint": None}, f)


def _setup_prune(work):
    bystander(work)
    parent = _p(work, "parent")
    old = os.path.join(parent, OLD_COPY)
    build_cache(old, 1)
    _origin(old, "gs://bucket/data")
    past = time.time() - 2 * 86400
    for name in os.listdir(old):
        os.utime(os.path.join(old, name), (past, past))
    os.utime(old + ".origin.json", (past, past))
    young = os.path.join(parent, YOUNG_COPY)
    build_cache(young, 7)
    _origin(young, "gs://bucket/young")


def _run_prune(work):
    import nbkit

    nbkit.prune(older_than=3600)


def _setup_export(work):
    import nbkit

    bystander(work)
    build_cache(_p(work, "scratch", "old"), 1)
    nbkit.export_tar(_p(work, "scratch", "old"), _p(work, "parent", "cache.tar"))
    build_cache(_p(work, "src", "cache"), 2)
    nbkit.remove(_p(work, "scratch", "old"))


def _run_export(work):
    import nbkit

    nbkit.export_tar(_p(work, "src", "cache"), _p(work, "parent", "cache.tar"))


def _setup_import(work):
    import nbkit

    bystander(work)
    build_cache(_p(work, "scratch", "new"), 2)
    nbkit.export_tar(_p(work, "scratch", "new"), _p(work, "parent", "in.tar"))
    nbkit.remove(_p(work, "scratch", "new"))
    build_cache(_p(work, "parent", "cache"), 1)


def _run_import(work):
    import nbkit

    nbkit.import_tar(_p(work, "parent", "in.tar"), _p(work, "parent", "cache"))


def _setup_pull(work):
    import nbkit

    bystander(work)
    build_cache(_p(work, "scratch", "new"), 2)
    nbkit.push(_p(work, "scratch", "new"), _url(_p(work, "remote", "cache")))
    nbkit.remove(_p(work, "scratch", "new"))
    build_cache(_p(work, "parent", "cache"), 1)


def _run_pull(work):
    import nbkit

    nbkit.pull(_url(_p(work, "remote", "cache")), _p(work, "parent", "cache"), max_workers=1)


def _setup_push(work):
    import nbkit

    os.makedirs(_p(work, "parent"))
    d = _p(work, "remote", "bystander")
    os.makedirs(d)
    with open(os.path.join(d, "notes.txt"), "w") as f:
        f.write("not nbkit's\n")
    build_cache(_p(work, "scratch", "old"), 1)
    nbkit.push(_p(work, "scratch", "old"), _url(_p(work, "remote", "cache")))
    nbkit.remove(_p(work, "scratch", "old"))
    build_cache(_p(work, "src", "cache"), 2)


def _run_push(work):
    import nbkit

    nbkit.push(_p(work, "src", "cache"), _url(_p(work, "remote", "cache")), max_workers=1)


KEYS_BEFORE = 8
KEYS_AFTER = 24


def _setup_keyed(work):
    import nbkit

    bystander(work)
    loader = nbkit.CacheLoader(_p(work, "parent", "keys"))
    for k in range(KEYS_BEFORE):
        loader.get(k, lambda key: value(1, key))
    loader.store.close()


def _run_keyed(work):
    import nbkit

    loader = nbkit.CacheLoader(_p(work, "parent", "keys"))
    for k in range(KEYS_AFTER):
        loader.get(k, lambda key: value(1, key))
    loader.store.close()


def _setup_checkpoint(work):
    from crash.toys import content

    bystander(work)
    with open(_p(work, "parent", "checkpoint.pt"), "wb") as f:
        f.write(content(1))


def _run_checkpoint(work):
    import nbkit
    from crash.toys import content

    # What notebook 04 does every checkpoint_every steps: the training state, saved over the last one.
    nbkit.transfer.remote.write_url(_p(work, "parent", "checkpoint.pt"), content(2))


#: Where set_aside moves the checkpoint (its stamp is fixed, so every run uses the same name).
ASIDE = "checkpoint.started-over-T.pt"


def _run_set_aside(work):
    import nbkit.checkpoint

    # What notebook 04's start_over does with a checkpoint that does not fit: moved, never deleted.
    nbkit.checkpoint.set_aside(_p(work, "parent", "checkpoint.pt"), label="started-over", stamp="T")


def _part_spec(ds, todo, placed=False, **extra):
    import pickle

    import numpy as np
    from nbkit.cluster.part import parts_dir

    return dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=N, todo=np.asarray(todo, dtype=np.int64),
                meta=ds.store.meta, source=("pickled", "crash", pickle.dumps(ds)), placed=placed, **extra)


#: The part the build operations write: the whole range, so that it reads back as a cache of N samples.
PART = "part-0000000000000-0000000000032"


def _setup_part_build(work):
    bystander(work)
    build_cache(_p(work, "parent", "cache"), 1, stored=N // 4)
    os.makedirs(_p(work, "parent", "cache.parts"))


def _run_part_build(work):
    import nbkit
    from nbkit.cluster.part import build_part

    # What a worker of nbkit.cluster does: one part written beside the cache, the cache itself untouched.
    ds = nbkit.CachedDataset(Source(1), _p(work, "parent", "cache"))
    build_part(_part_spec(ds, range(N)))
    ds.close()


def _setup_part_merge_copy(work):
    _setup_part_merge(work, placed=False)


def _setup_part_merge(work, placed=True, **extra):
    import nbkit
    from nbkit.cluster.part import build_part

    bystander(work)
    build_cache(_p(work, "parent", "cache"), 1, stored=N // 4)
    ds = nbkit.CachedDataset(Source(1), _p(work, "parent", "cache"))
    build_part(_part_spec(ds, ds.missing(), placed=placed, **extra))
    ds.close()


def _setup_part_merge_unsynced(work):
    _setup_part_merge(work, placed=True, hashes=False, sync_rows=False)


def _run_part_merge(work):
    import nbkit
    from nbkit.cluster.merge import merge

    # What the driver of nbkit.cluster does with each finished part: verify, merge in place, remove.
    ds = nbkit.CachedDataset(Source(1), _p(work, "parent", "cache"))
    merge(ds.store, _p(work, "parent", "cache.parts", PART))
    ds.close()


def _run_part_merge_local(work):
    import nbkit
    from nbkit.cluster.merge import merge

    # A driver merging a part an earlier run of this machine's workers left (rows unsynced): checked, synced, linked.
    ds = nbkit.CachedDataset(Source(1), _p(work, "parent", "cache"))
    merge(ds.store, _p(work, "parent", "cache.parts", PART), hashes=False)
    ds.close()


def _run_part_build_placed(work):
    import nbkit
    from nbkit.cluster.merge import merge
    from nbkit.cluster.part import build_part

    # A local build's part, both halves: a worker places the rows and blobs in the cache's own files
    # (records in the part), then the driver links the records into the cache's index. A part a crash
    # leaves must merge whole on the rerun (a refused one would leave the cache short: a violation).
    ds = nbkit.CachedDataset(Source(1), _p(work, "parent", "cache"))
    build_part(_part_spec(ds, range(N), placed=True))
    merge(ds.store, _p(work, "parent", "cache.parts", PART))
    ds.close()


def _run_part_build_local(work):
    import nbkit
    from nbkit.cluster.merge import merge
    from nbkit.cluster.part import build_part

    # What warmup(num_workers=N) does: its workers place the rows and leave their sync to the driver,
    # whose merge syncs them before linking a part its own build wrote (fresh), and checks every CRC of
    # a part left by an earlier run (a power cut may have lost its rows: refused, then built again,
    # as the driver's end plans what is still missing once more).
    ds = nbkit.CachedDataset(Source(1), _p(work, "parent", "cache"))
    for _ in range(2):
        todo = ds.missing()
        if not len(todo):
            break
        out = build_part(_part_spec(ds, todo, placed=True, hashes=False, sync_rows=False))
        merge(ds.store, _p(work, "parent", "cache.parts", PART), hashes=False, fresh=out["kept"])
    ds.close()


_BY = ("parent/bystander",)

OPERATIONS: dict[str, Operation] = {op.name: op for op in [
    Operation("warmup_new", _setup_warmup_new, _warmup(1), "parent/cache", "cache", None, Expect(1, whole=False),
              absent_ok=True, inputs=_BY, power_loss=True),
    Operation("warmup_resume", _setup_warmup_resume, _warmup(1), "parent/cache", "cache", Expect(1, whole=False),
              Expect(1, whole=False), inputs=_BY, power_loss=True),
    Operation("warmup_rows", _setup_warmup_resume, _run_warmup_rows, "parent/cache", "cache", Expect(1, whole=False),
              Expect(1, whole=False), inputs=_BY, power_loss=True),
    Operation("overwrite", _setup_whole_cache, _warmup(2, overwrite=True), "parent/cache", "cache", Expect(1),
              Expect(2, whole=False), absent_ok=True, inputs=_BY, power_loss=True),
    Operation("remove", _setup_whole_cache, _run_remove, "parent/cache", "cache", Expect(1), None, absent_ok=True,
              inputs=_BY),
    # A cache with the parts of its unfinished build beside it: nbkit rm removes both (issue 37).
    Operation("remove_with_parts", _setup_part_merge, _run_remove, "parent/cache", "cache", Expect(1, whole=False), None,
              absent_ok=True, inputs=_BY, entries=("cache.parts",)),
    Operation("prune", _setup_prune, _run_prune, f"parent/{OLD_COPY}", "cache", Expect(1), None, absent_ok=True,
              inputs=_BY + (f"parent/{YOUNG_COPY}", f"parent/{YOUNG_COPY}.origin.json"),
              entries=(f"{OLD_COPY}.origin.json", f"{OLD_COPY}.lock", YOUNG_COPY, f"{YOUNG_COPY}.origin.json"),
              env={"NBKIT_CACHE_DIR": "{work}/parent"}),
    Operation("export", _setup_export, _run_export, "parent/cache.tar", "tar", Expect(1), Expect(2),
              inputs=_BY + ("src/cache",), power_loss=True, removable=False),
    Operation("import", _setup_import, _run_import, "parent/cache", "cache", Expect(1), Expect(2),
              inputs=_BY + ("parent/in.tar",), entries=("in.tar",), power_loss=True),
    Operation("pull", _setup_pull, _run_pull, "parent/cache", "cache", Expect(1), Expect(2),
              inputs=_BY + ("remote/cache",), power_loss=True),
    Operation("push", _setup_push, _run_push, "remote/cache", "remote", Expect(1), Expect(2),
              inputs=("src/cache", "remote/bystander"), entries=("bystander",), removable=False),
    Operation("cacheloader_put", _setup_keyed, _run_keyed, "parent/keys", "keyed", Expect(1), Expect(1),
              inputs=_BY, removable=False),
    Operation("checkpoint", _setup_checkpoint, _run_checkpoint, "parent/checkpoint.pt", "file", Expect(1), Expect(2),
              inputs=_BY, power_loss=True, removable=False),
    # A local build (warmup with workers, LocalEngine, engines on a shared file system): placed parts.
    Operation("part_build", _setup_part_build, _run_part_build_placed, "parent/cache", "cache", Expect(1, whole=False),
              Expect(1), inputs=_BY, entries=("cache.parts",), power_loss=True),
    Operation("part_merge", _setup_part_merge, _run_part_merge, "parent/cache", "cache", Expect(1, whole=False),
              Expect(1), inputs=_BY, entries=("cache.parts",), power_loss=True),
    # warmup(num_workers=N)'s parts: rows left unsynced by this machine's workers, synced (and, left by
    # an earlier run, checked) by the merge.
    Operation("part_build_local", _setup_part_build, _run_part_build_local, "parent/cache", "cache", Expect(1, whole=False),
              Expect(1), inputs=_BY, entries=("cache.parts",), power_loss=True),
    Operation("part_merge_local", _setup_part_merge_unsynced, _run_part_merge_local, "parent/cache", "cache", Expect(1, whole=False),
              Expect(1), inputs=_BY, entries=("cache.parts",), power_loss=True),
    # Parts holding their own files (a store without files of its own: Redis; the gs:// upload's local build).
    Operation("part_build_copy", _setup_part_build, _run_part_build, f"parent/cache.parts/{PART}", "cache", None, Expect(1),
              absent_ok=True, inputs=_BY + ("parent/cache",), power_loss=True),
    Operation("part_merge_copy", _setup_part_merge_copy, _run_part_merge, "parent/cache", "cache", Expect(1, whole=False),
              Expect(1), inputs=_BY, entries=("cache.parts",), power_loss=True),
    Operation("set_aside", _setup_checkpoint, _run_set_aside, "parent/checkpoint.pt", "aside", Expect(1), None,
              absent_ok=True, inputs=_BY, entries=(ASIDE,), power_loss=True, removable=False),
]}
