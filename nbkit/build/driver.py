"""The build driver: plan the parts, have an engine build them, verify and merge each as it arrives.

:func:`run` is the one loop every engine shares. It first merges the parts a failed or stopped run
left (a part that verifies is never computed again), then plans the missing samples into parts and
keeps about ``engine.workers`` of them submitted. Each finished part is verified (:func:`nbkit.build.part.read_part`)
and merged in place (:func:`nbkit.build.merge.merge`); a refused part is removed and planned again,
a part whose worker was lost is submitted again, and a source's error ends the build (what was
merged stays; finished parts stay for the next run). ``callback.request_stop()`` cancels the
outstanding parts and keeps every finished one. A rerun after any failure computes only the parts
still missing.

Example:
    >>> import torch, tempfile, nbkit
    >>> from nbkit.build.engine import ExecutorEngine
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(100)), tempfile.mkdtemp())
    >>> with ExecutorEngine(ThreadPoolExecutor(2), workers=2) as engine:
    ...     report = run(ds, engine, part_size=32)
    >>> report.computed, report.parts, ds.missing().tolist()
    (100, 4, [])
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import time
import uuid
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..progress import Workers, as_callback
from .merge import merge
from .part import build_part, list_parts, parts_dir, sweep_builds
from .plan import DEFAULT_PART_SIZE, PlannedPart, plan

__all__ = ["BuildReport", "run"]

#: How often (seconds) the driver looks at the stop flag while it waits for parts.
POLL_SECONDS = 0.1
#: How many times one part is submitted again after its worker was lost or its copy was refused.
RETRIES = 3


@dataclass(frozen=True)
class BuildReport:
    """What one :func:`run` did.

    Attributes:
        computed: samples computed by the workers and merged by this run.
        reused: samples merged from parts an earlier run left (not computed again).
        skipped: samples already stored when it started.
        total: admitted samples of the cache.
        parts: parts merged (built now or left before).
        refused: parts refused (damaged, another schema…) and planned again.
        retried: part builds submitted again after a lost worker.
        seconds: wall time.
        stopped: it stopped early because the callback asked it to.
    """

    computed: int
    reused: int
    skipped: int
    total: int
    parts: int
    refused: int
    retried: int
    seconds: float
    stopped: bool

    @property
    def rate(self) -> float:
        return self.computed / self.seconds if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        state = "stopped" if self.stopped else "done"
        return (f"build {state}: {self.computed} computed, {self.reused} merged from earlier parts, {self.skipped} already "
                f"cached, {self.total} in all; {self.parts} parts merged, {self.refused} refused, {self.retried} retried; "
                f"{self.seconds:.1f}s ({self.rate:,.0f} samples/s)")


def _source(cached, factory) -> tuple:
    """What travels to every worker: the pickled ``CachedDataset`` (the user's own source, trusted),
    or the factory that makes it there; pickled once, unpickled once per worker process."""
    token = uuid.uuid4().hex
    if factory is not None:
        if not callable(factory):
            raise TypeError(f"factory must be a callable returning the source dataset, got {type(factory).__name__}")
        try:
            pickle.dumps(factory)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"the factory {factory!r} does not pickle ({e}); define it at module level "
                            "(a def in an importable module, not a lambda or a local function)") from e
        return ("factory", token, factory)
    try:
        return ("pickled", token, pickle.dumps(cached))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        source = type(cached.source).__name__
        raise TypeError(
            f"the source dataset {source} does not pickle ({e}), so it cannot be sent to the build's workers. Pass a "
            f"factory that makes it in each worker instead: define `def make_source(): return {source}(...)` at module "
            "level and call nbkit.build.run(ds, engine, factory=make_source)") from e


def run(cached, engine, *, part_size: int = DEFAULT_PART_SIZE, callback=None, factory=None) -> BuildReport:
    """Fill every missing sample of the local cache ``cached`` with the part builds of ``engine``.

    Args:
        cached: a ``CachedDataset`` opened with its source, on a local directory.
        engine: an :class:`nbkit.build.engine.Engine` (:class:`nbkit.build.local.LocalEngine`, a
            cluster's); the caller closes it.
        part_size: samples per part (ranges aligned to it).
        callback: an :class:`nbkit.progress.Callback`: progress in samples (its description says the
            parts); ``request_stop()`` cancels outstanding parts and keeps finished ones.
        factory: a module-level callable returning the source dataset in each worker, for a source
            that does not pickle.

    Returns:
        A :class:`BuildReport`.
    """
    if cached.source is None and factory is None:
        raise ValueError(f"cannot build the cache at {cached.path}: it was opened without its source dataset. Open it "
                         "with nbkit.CachedDataset(source, path), or pass factory= to make the source in each worker.")
    if getattr(cached, "_location", None) is not None and cached._location.is_remote:
        raise NotImplementedError(f"{cached.path} is a remote cache: nbkit.build.run merges into a local directory "
                                  "(gs:// parts are merged by composition, nbkit.build.compose)")
    t0 = time.perf_counter()
    cb = as_callback(callback)
    cached.check_generation()
    store = cached.store
    meta = store.meta
    parts = parts_dir(cached.root)
    source = _source(cached, factory)
    state = _State(cb)
    all_idx = np.arange(store.length)
    state.total = int(store.admitted(all_idx).sum())
    cb.set_size(state.total)
    try:
        sweep_builds(parts)
        left = list_parts(parts)
        if left:
            cb.set_description(f"merging {len(left)} parts left by an earlier build")
        for path in left:  # built before: verified and merged, never computed again
            state.merged(merge(store, path), reused=True)
        todo = plan(store, part_size)
        state.skipped = state.total - sum(len(p.todo) for p in todo) - state.reused
        cb.absolute_update(state.total - sum(len(p.todo) for p in todo))
        state.planned = len(todo)
        if todo:  # parts done of all, and who builds them: the front ends' per-worker view
            state.workers = Workers(parts_done=state.parts, parts_total=state.parts + len(todo))
            cb.set_workers(state.workers)
        state.stopped = _build(store, meta, engine, todo, parts, source, cached, state)
    finally:
        sweep_builds(parts)
        _remove_if_empty(parts)
    cb.set_description("stopped" if state.stopped else "done")
    return BuildReport(computed=state.computed, reused=state.reused, skipped=state.skipped, total=state.total,
                       parts=state.parts, refused=state.refused, retried=state.retried,
                       seconds=time.perf_counter() - t0, stopped=state.stopped)


class _State:
    def __init__(self, cb):
        self.cb = cb
        self.computed = self.reused = self.skipped = self.total = 0
        self.parts = self.refused = self.retried = self.planned = 0
        self.stopped = False
        self.workers = None  # the Workers snapshot the callback shows, once the parts are planned

    def merged(self, result, *, reused: bool = False, built: dict | None = None) -> None:
        """Count a merge; ``built``: what :func:`build_part` returned for it (who built it, how fast)."""
        if result.refused:
            self.refused += 1
            return
        if built is not None and self.workers is not None:
            worker = f"{built['host']}:{built['pid']}"  # a process on a machine: the same key on every engine
            self.workers = self.workers.record(worker, built["computed"], built["seconds"])
            self.cb.set_workers(self.workers)
        if result.gone:
            return
        self.parts += 1
        if reused:
            self.reused += result.merged
        else:
            self.computed += result.merged
        self.cb.relative_update(result.merged)
        if self.planned:
            self.cb.set_description(f"building: {self.parts} of {self.planned} parts merged")


def _spec(p: PlannedPart, cached, meta: dict, parts: str, source: tuple) -> dict:
    return {"cache": cached.root, "parts": parts, "start": p.start, "stop": p.stop, "todo": p.todo, "meta": meta,
            "source": source}


def _build(store, meta, engine, todo, parts, source, cached, state) -> bool:
    """Submit, wait, merge; return whether it stopped early."""
    queue = deque(todo)
    tries: dict = {}
    inflight: dict = {}
    try:
        while queue or inflight:
            if state.cb.should_stop():
                engine.cancel(list(inflight))
                return True
            while queue and len(inflight) < max(1, engine.workers):
                p = queue.popleft()
                inflight[engine.submit(build_part, _spec(p, cached, meta, parts, source))] = p
            done, _ = concurrent.futures.wait(inflight, timeout=POLL_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)
            for f in done:
                p = inflight.pop(f)
                error = f.exception() if not f.cancelled() else concurrent.futures.CancelledError()
                if error is not None:
                    if engine.worker_lost(error) and tries.get(p.start, 0) < RETRIES:
                        tries[p.start] = tries.get(p.start, 0) + 1
                        state.retried += 1
                        queue.appendleft(p)
                        continue
                    if hasattr(error, "add_note"):
                        error.add_note(f"(raised while {engine.name} built the part [{p.start}, {p.stop}) of {cached.path}; "
                                       "parts merged so far are kept: run the build again to resume)")
                    raise error
                built = f.result()
                result = merge(store, os.path.join(parts, built["name"]))
                state.merged(result, built=built)
                if result.refused:
                    if tries.get(p.start, 0) >= RETRIES:
                        raise RuntimeError(f"the part [{p.start}, {p.stop}) of {cached.path} was refused {RETRIES + 1} times; "
                                           f"the last time: {result.refused}")
                    tries[p.start] = tries.get(p.start, 0) + 1
                    missing = store.missing(np.arange(p.start, p.stop))
                    if len(missing):
                        queue.appendleft(PlannedPart(p.start, p.stop, missing))
    except BaseException:
        if inflight:
            engine.cancel(list(inflight))
        raise
    return False


def _remove_if_empty(parts: str) -> None:
    try:
        os.rmdir(parts)
    except OSError:
        pass  # parts left (a stop, a failure), or never made
