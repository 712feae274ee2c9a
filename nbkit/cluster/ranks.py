"""The processes of one SPMD job as a build engine: each rank builds its share of the parts, one merges.

A multi-host TPU job (or any torch.distributed / JAX job) already has what a build needs: ``world``
processes, each knowing its ``rank``, and a barrier. :func:`run_ranks` is called by every rank with
the same cache and runs the build protocol (:mod:`nbkit.cluster`) among them, with no driver besides:

1. barrier ``plan``: every rank has opened the cache; then every rank plans the same parts, from
   what is missing at that moment (nothing writes the cache between this barrier and the next);
2. rank ``r`` builds the parts ``plan[r::world]`` into the shared parts location: ``<cache>.parts``
   beside a local or shared directory, ``<url>.parts/`` beside a ``gs://`` cache (pushed there, part
   manifest last); a part already there whole is reused, never computed again;
3. barrier ``built``; rank 0 merges the parts in place (:func:`nbkit.cluster.merge.merge`) or, on
   ``gs://``, composes them server-side (:func:`nbkit.cluster.compose.compose`);
4. barrier ``merged``; every rank reads the complete cache (a ``gs://`` cache is pulled into each
   host's working copy: use :attr:`RanksReport.dataset`).

A rank that died, raised or was stopped leaves its parts unbuilt: every surviving rank raises
:class:`RanksIncomplete`, naming the ranks and the parts missing, and a rerun of the job builds only
those (finished parts are merged, not recomputed). A rank that raised passes the barriers first, so
its peers never wait on it; a rank that died makes the barrier fail, and the error says so.

Where the ranks come from: :func:`torch_ranks` (an initialised ``torch.distributed`` process group),
:func:`jax_ranks` (``jax.process_index()`` / ``process_count()``, ``sync_global_devices``; tested
with a two-process ``jax.distributed`` job on the CPU, jax 0.7.2 and the newest), or
:func:`nbkit.tpu.run.xla_ranks` (torch_xla's replicas). ``run_ranks(ds)`` with none given uses
:func:`current_ranks`.

Example:
    >>> import torch, tempfile, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(100)), tempfile.mkdtemp())
    >>> report = run_ranks(ds, rank=0, world=1, barrier=lambda name: None, part_size=32)
    >>> report.parts, report.computed, ds.missing().tolist()
    (4, 100, [])
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import format as fmt
from .. import trust
from ..progress import as_callback
from ..transfer.manifest import read_bounded
from .merge import merge
from .part import PART_SPEC, build_part, list_parts, part_name, parts_dir, sweep_builds
from .plan import DEFAULT_PART_SIZE, PlannedPart, plan

__all__ = ["Ranks", "RanksIncomplete", "RanksReport", "current_ranks", "jax_ranks", "run_ranks", "torch_ranks"]

#: The barriers, in order; each is passed by every rank (the name goes to barriers that take one).
BARRIERS = ("nbkit-build-plan", "nbkit-build-built", "nbkit-build-merged")


@dataclass(frozen=True)
class Ranks:
    """This process's place in an SPMD job.

    Attributes:
        rank: this process, ``0 <= rank < world``.
        world: processes in the job.
        barrier: ``barrier(name)`` returns once every rank called it with that name; raises when a
            rank is gone (or blocks until the job's own timeout).
    """

    rank: int
    world: int
    barrier: Callable[[str], None]


class RanksIncomplete(RuntimeError):
    """Parts of a rank build are missing after every rank's turn: a rank died, raised or was stopped.

    Attributes:
        missing: ``{rank: [(start, stop), ...]}`` of the parts not built.
    """

    def __init__(self, message: str, missing: dict):
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class RanksReport:
    """What :func:`run_ranks` did on this rank.

    Attributes:
        rank, world: this rank and the job's size.
        parts: parts planned (all ranks together).
        built: parts this rank built; ``reused``: of its parts, those already there whole.
        computed: samples this rank computed.
        merged: samples merged (rank 0 of a local cache; ``0`` elsewhere).
        composed: rank 0 composed the ``gs://`` cache.
        seconds: wall time of this rank.
        dataset: the ``CachedDataset`` to read from now: the one given for a local cache, a reopened
            handle for a ``gs://`` one (its working copy was pulled, which makes the old handle stale).
    """

    rank: int
    world: int
    parts: int
    built: int
    reused: int
    computed: int
    merged: int
    composed: bool
    seconds: float
    dataset: object

    def __str__(self) -> str:
        return (f"rank {self.rank} of {self.world}: {self.built} of {self.parts} parts built here ({self.reused} reused), "
                f"{self.computed} samples computed, {self.merged} merged; {self.seconds:.1f}s")


# -- where the ranks come from ----------------------------------------------------------------------


def _torch_barrier(name: str) -> None:
    import torch.distributed as dist

    dist.barrier()


def torch_ranks() -> Ranks:
    """This process's rank, the world size and a barrier from an initialised ``torch.distributed``
    process group (any backend: gloo, nccl, xla).

    Raises:
        RuntimeError: no process group is initialised.

    Example:
        >>> torch_ranks()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: torch.distributed is not initialised in this process...
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("torch.distributed is not initialised in this process, so it has no rank and world to build "
                           "with. Call torch.distributed.init_process_group(...) first (torchrun does it from its "
                           "environment), or pass rank=, world= and barrier= to nbkit.cluster.run_ranks")
    return Ranks(dist.get_rank(), dist.get_world_size(), _torch_barrier)


def _jax_barrier(name: str) -> None:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def jax_ranks() -> Ranks:
    """This process's ``jax.process_index()``, ``jax.process_count()`` and a barrier over every
    host's devices (``jax.experimental.multihost_utils.sync_global_devices``).

    Call it after ``jax.distributed.initialize()``; ``run_ranks`` given no ranks calls it itself
    when torch.distributed is not initialised and JAX runs several processes.
    """
    from ..extras import require

    jax = require("jax", extra="jax", feature="nbkit.cluster.jax_ranks", install="pip install 'jax[tpu]'")
    return Ranks(int(jax.process_index()), int(jax.process_count()), _jax_barrier)


def current_ranks() -> Ranks:
    """The ranks of the job this process is in: torch.distributed when it is initialised, else JAX
    when it is imported and runs more than one process.

    Raises:
        RuntimeError: neither, naming how to start one or pass the ranks.
    """
    import sys

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return torch_ranks()
    if "jax" in sys.modules and sys.modules["jax"].process_count() > 1:
        return jax_ranks()
    raise RuntimeError("this process is in no multi-process job nbkit can see: neither torch.distributed is initialised "
                       "nor JAX running several processes. Start the job first (torch.distributed.init_process_group, "
                       "jax.distributed.initialize, or torch_xla: nbkit.tpu.warmup_shared), or pass rank=, world= and "
                       "barrier= to nbkit.cluster.run_ranks")


# -- the build --------------------------------------------------------------------------------------


def run_ranks(cached, *, rank: int | None = None, world: int | None = None, barrier: Callable[[str], None] | None = None,
              part_size: int = DEFAULT_PART_SIZE, callback=None) -> RanksReport:
    """Build the cache ``cached`` with every rank of this job; call it on every rank with the same cache.

    Args:
        cached: a ``CachedDataset`` with its source, on storage every rank reaches: a shared
            directory (the same path on every host) or a ``gs://`` URL.
        rank, world, barrier: this process's place in the job (all three, or none for
            :func:`current_ranks`); ``barrier(name)`` must return once every rank called it.
        part_size: samples per part; every rank must pass the same.
        callback: progress of this rank's parts (:mod:`nbkit.progress`).

    Returns:
        This rank's :class:`RanksReport`; read from its ``dataset``.

    Raises:
        RanksIncomplete: parts of some ranks are missing (a rank died, raised or stopped); names
            them. Rerun the job: finished parts are reused.
    """
    t0 = time.perf_counter()
    ranks = _ranks(rank, world, barrier)
    if cached.source is None:
        raise ValueError(f"cannot build the cache at {cached.path}: it was opened without its source dataset. Open it "
                         "with nbkit.CachedDataset(source, path) on every rank.")
    part_size = trust.check_int(part_size, "part_size", min=1, max=trust.MAX_SAMPLES,
                                fix="a part holds a few thousand samples (the default is 4096); pass the same on every rank")
    cb = as_callback(callback)
    location = cached._location
    # Each rank builds in its own process: the source is this very dataset, never pickled (the
    # factory form of a part spec, a callable returning it).
    source = ("factory", uuid.uuid4().hex, (lambda: cached, type(cached)))
    job = (_RemoteJob if location.is_remote else _LocalJob)(cached, ranks, part_size, source, cb)
    return job.run(t0)


def _ranks(rank, world, barrier) -> Ranks:
    given = [x is not None for x in (rank, world, barrier)]
    if not any(given):
        return current_ranks()
    if not all(given):
        raise TypeError("pass rank=, world= and barrier= together (or none of them, to take them from torch.distributed "
                        "or JAX)")
    world = trust.check_int(world, "world", min=1, max=1 << 20, fix="the number of processes in the job")
    rank = trust.check_int(rank, "rank", min=0, max=world - 1, fix=f"this process's rank, 0 to {world - 1}")
    if not callable(barrier):
        raise TypeError(f"barrier must be a callable barrier(name), got {type(barrier).__name__}")
    return Ranks(rank, world, barrier)


class _Job:
    """What a rank does; the storage-specific steps are :meth:`_plan`, :meth:`_build`, :meth:`_merge`, :meth:`_finish`."""

    def __init__(self, cached, ranks: Ranks, part_size: int, source: tuple, cb):
        self.cached, self.ranks, self.part_size, self.source, self.cb = cached, ranks, part_size, source, cb
        self.built = self.reused = self.computed = self.merged = 0
        self.composed = False

    def run(self, t0: float) -> RanksReport:
        rank, world = self.ranks.rank, self.ranks.world
        self._pass(0)  # every rank has opened the cache; nothing writes it until the next barrier
        self.todo = todo = self._plan()
        mine = todo[rank::world]
        self.cb.set_size(sum(len(p.todo) for p in mine))
        self.cb.set_description(f"rank {rank} of {world}: building {len(mine)} of {len(todo)} parts")
        failure = None
        try:
            for p in mine:
                if self.cb.should_stop():
                    break  # its parts stay missing: named below, built by a rerun
                self._build(p)
                self.cb.relative_update(len(p.todo))
        except BaseException as e:  # noqa: BLE001 - raised below, once the peers no longer wait on this rank
            failure = e
        lost = self._pass(1, todo)
        merge_error = None
        if rank == 0 and todo:
            self.cb.set_description(f"rank 0: merging {len(todo)} parts")
            try:
                self._merge(complete=lost is None)
            except Exception as e:  # noqa: BLE001 - raised below, once the peers passed the last barrier
                merge_error = e
        if lost is None:
            lost = self._pass(2, todo)
        if merge_error is not None:
            raise merge_error
        dataset = self._finish()
        self._check(todo, dataset, lost, failure)
        if failure is not None:
            raise failure
        if len(dataset.missing()):
            raise RuntimeError(f"rank {rank} of {world}: every part of {self.cached.path} was built, but the cache is "
                               f"still missing {len(dataset.missing())} samples: rank 0 failed to merge them (see its "
                               "traceback). Rerun the job: the parts are merged, not computed again")
        self.cb.set_description("done")
        return RanksReport(rank=rank, world=world, parts=len(todo), built=self.built, reused=self.reused,
                           computed=self.computed, merged=self.merged, composed=self.composed,
                           seconds=time.perf_counter() - t0, dataset=dataset)

    def _pass(self, k: int, todo=None) -> Exception | None:
        """Pass barrier ``k``; a failed barrier (a rank gone) is returned once there is a plan to
        name what is missing, and raised before."""
        try:
            self.ranks.barrier(BARRIERS[k])
        except Exception as e:  # the backend's own error, chained into ours
            if todo is None:
                raise RuntimeError(f"rank {self.ranks.rank} of {self.ranks.world}: the barrier {BARRIERS[k]!r} failed "
                                   f"before the build of {self.cached.path} began (a rank is gone?). Nothing was built: "
                                   "rerun the job") from e
            return e
        return None

    def _check(self, todo: list, dataset, lost, failure) -> None:
        """Raise :class:`RanksIncomplete` naming the ranks whose parts are missing, if any are."""
        missing = {}
        for k, p in enumerate(todo):
            if not self._done(p, dataset):
                missing.setdefault(k % self.ranks.world, []).append((p.start, p.stop))
        if not missing:
            return
        ranks = ", ".join(str(r) for r in sorted(missing))
        listed = "; ".join(f"rank {r}: " + ", ".join(f"[{a}, {b})" for a, b in spans[:4]) + (" …" if len(spans) > 4 else "")
                           for r, spans in sorted(missing.items()))
        done = len(todo) - sum(len(s) for s in missing.values())
        if lost is not None:
            why = f"a barrier failed ({type(lost).__name__}: a rank died or lost its connection)"
        elif failure is not None:
            why = f"rank {self.ranks.rank} raised {type(failure).__name__}: {failure}"
        else:
            why = "those ranks raised or were stopped (see their tracebacks)"
        raise RanksIncomplete(
            f"the build of {self.cached.path} is incomplete: the parts of rank{'s' if len(missing) > 1 else ''} {ranks} "
            f"were not built ({listed}); {why}. Rerun the job with the same part_size: the {done} finished parts are "
            "reused, only the missing ones are computed.", missing) from (lost or failure)


class _LocalJob(_Job):
    """A local or shared directory: parts in ``<cache>.parts``, merged in place by rank 0."""

    def __init__(self, *args):
        super().__init__(*args)
        self.cached.check_generation()
        self.store = self.cached.store
        self.parts = parts_dir(self.cached.root)

    def _plan(self) -> list:
        return plan(self.store, self.part_size)

    def _build(self, p: PlannedPart) -> None:
        spec = {"cache": self.cached.root, "parts": self.parts, "start": p.start, "stop": p.stop, "todo": p.todo,
                "meta": self.store.meta, "source": self.source}
        result = build_part(spec)
        if result["kept"]:
            self.built += 1
            self.computed += result["computed"]
        else:
            self.reused += 1

    def _merge(self, complete: bool) -> None:
        sweep_builds(self.parts)  # staging of builds whose rank died (a live one's is claimed)
        for path in list_parts(self.parts):
            self.merged += merge(self.store, path).merged
        if complete:
            with contextlib.suppress(OSError):  # parts left (of another part_size, refused twice…): kept
                os.rmdir(self.parts)

    def _finish(self):
        self.cached.check_generation()
        return self.cached

    def _done(self, p: PlannedPart, dataset) -> bool:
        return not len(self.store.missing(np.arange(p.start, p.stop)))


class _RemoteJob(_Job):
    """A ``gs://`` cache: whole parts pushed to ``<url>.parts/``, composed server-side by rank 0.

    The parts of every rank must name one cache generation, and each host's working copy has its
    own: the parts carry :func:`shared_generation` of the cache (its URL, source fingerprint and
    layout), the same on every rank and every rerun, so finished parts are found again."""

    def __init__(self, *args):
        super().__init__(*args)
        from ..transfer.remote import connect

        self.url = self.cached.path.rstrip("/")
        self.options = dict(self.cached._location.storage_options or {})
        meta = self.cached.store.meta
        if meta.get("capacity") is not None:
            raise ValueError(f"{self.url} has a byte budget (max_bytes): a gs:// cache is built by composing whole columns, "
                             "so it must hold every sample. Build it without max_bytes, or in a shared directory.")
        self.meta = dict(meta, generation=shared_generation(self.url, meta))
        self.fix = "rerun the job: finished parts are reused"
        self.fs, self.rroot = connect(self.url, self.options, doing="building", fix=self.fix, write=True)
        self.proot = self.rroot + ".parts"

    def _published(self) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(f"{self.rroot}/{fmt.META}")

    def _plan(self) -> list:
        if self._published():
            return []
        n, size = int(self.meta["length"]), self.part_size
        # Whole parts of every range: compose concatenates whole columns.
        return [PlannedPart(a, min(a + size, n), np.arange(a, min(a + size, n), dtype=np.int64)) for a in range(0, n, size)]

    def _part_ok(self, p: PlannedPart) -> bool:
        """The part is there, whole (its ``nbkit.json`` uploaded last), and of this build."""
        path = f"{self.proot}/{part_name(p.start, p.stop)}/{fmt.META}"
        try:
            raw = read_bounded(self.fs, path)
        except FileNotFoundError:
            return False
        try:
            info = trust.check_json(fmt.parse_meta(raw, path, "")["part"], PART_SPEC, path, "")
        except (ValueError, KeyError):  # CorruptCacheError is a ValueError; KeyError: no 'part' field
            return False  # damaged or another build's: built and pushed again
        return info["cache_generation"] == self.meta["generation"]

    def _build(self, p: PlannedPart) -> None:
        from ..transfer.sync import push
        from .compose import parts_url

        self.fs.invalidate_cache()
        if self._part_ok(p):
            self.reused += 1
            return
        scratch = tempfile.mkdtemp(prefix="nbkit-rank-part-")
        try:
            spec = {"cache": self.cached.root, "parts": scratch, "start": p.start, "stop": p.stop, "todo": p.todo,
                    "meta": self.meta, "source": self.source}
            result = build_part(spec)
            push(os.path.join(scratch, result["name"]), f"{parts_url(self.url)}/{result['name']}", storage_options=self.options)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.built += 1
        self.computed += result["computed"]

    def _merge(self, complete: bool) -> None:
        from .compose import compose

        if not complete or not all(self._part_ok(p) for p in self.todo):
            return  # named by _check on every rank
        with ThreadPoolExecutor(2) as pool:  # hashes the composed files: reads in this host, not the driver's role here
            compose(self.url, engine=pool, storage_options=self.options, remove_parts=True)
        self.composed = True

    def _finish(self):
        if not self._published():
            return self.cached
        c = self.cached
        return type(c)(c.source, c.path, transform=c.transform, allow_pickle=c.allow_pickle,
                                   storage_options=self.options)

    def _done(self, p: PlannedPart, dataset) -> bool:
        return self._published() or self._part_ok(p)


def shared_generation(url: str, meta: dict) -> str:
    """The generation every rank's parts of the remote cache ``url`` carry: a hash of the URL, the
    source's fingerprint and the layout, so all ranks (and reruns) agree without talking.

    Example:
        >>> len(shared_generation("gs://b/c", {"fingerprint": "f", "length": 3, "schema": {}, "columns": []}))
        32
    """
    ident = json.dumps([url, meta.get("fingerprint"), meta.get("length"), meta.get("schema"), meta.get("columns"),
                        meta.get("allow_pickle"), meta.get("format"), meta.get("version")], sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:32]
