"""The build driver: plan the parts, have an engine build them, verify and merge each as it arrives.

:func:`run` is the one loop every engine shares. It first merges the parts a failed or stopped run
left (a part that verifies is never computed again), then plans the missing samples into parts and
keeps :data:`AHEAD` times ``engine.workers`` of them submitted (two a worker: one running, one queued). Each finished part is verified (:func:`nbkit.cluster.part.read_part`)
and merged in place (:func:`nbkit.cluster.merge.merge`); a refused part is removed and planned again,
a part whose worker was lost is submitted again, and a source's error ends the build (what was
merged stays; finished parts stay for the next run). ``callback.request_stop()`` cancels the
outstanding parts and keeps every finished one; so does Ctrl-C (a notebook's interrupt), which then
raises ``KeyboardInterrupt``. A rerun after any failure computes only the parts still missing.

Example:
    >>> import torch, tempfile, nbkit
    >>> from nbkit.cluster.engine import ExecutorEngine
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
import signal
import threading
import time
import uuid
from collections import deque

import numpy as np

from ..cachedir import CacheFiles
from ..progress import Workers, as_callback
from .engine import Engine, engine_for
from .merge import MergeResult, merge
from .part import build_part, list_parts, parts_dir, sweep_builds
from .plan import DEFAULT_PART_SIZE, PlannedPart, cover, gaps, held, plan, plan_around
from .report import BuildReport

__all__ = ["run"]

#: How often (seconds) the driver looks at the stop flag while it waits for parts.
POLL_SECONDS = 0.1
#: How many times one part is submitted again after its worker was lost, its copy was refused or
#: the storage failed under it (then the build stops with that error; finished parts are kept).
RETRIES = 3
#: Parts kept submitted per worker: one running, one queued behind it, so a worker starts its next
#: part while the driver verifies and merges the last one (the merge overlaps the compute).
AHEAD = 2
#: How often (seconds) the parts out and the age of the oldest are shown (a stuck worker shows).
SHOW_SECONDS = 1.0
#: Whether a local build places each part's rows in the cache's own files (a worker writes every
#: sample once; the merge links index records: O(index), no sample byte through the driver). ``False``:
#: each part holds its own files and the merge copies them in (the benchmark's "before" row).
PLACED = True
#: Seconds before a part whose storage failed is submitted again (doubled each time): a dropped
#: connection or a restarting endpoint gets a moment, a full disk fails within a second or two.
RETRY_SECONDS = 0.2


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
        return ("factory", token, (factory, type(cached)))
    try:
        return ("pickled", token, pickle.dumps(cached))
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        source = type(cached.source).__name__
        raise TypeError(
            f"the source dataset {source} does not pickle ({e}), so it cannot be sent to the build's workers. Pass a "
            f"factory that makes it in each worker instead: define `def make_source(): return {source}(...)` at module "
            "level and call nbkit.cluster.run(ds, engine, factory=make_source)") from e


def run(cached, engine, *, part_size: int = DEFAULT_PART_SIZE, callback=None, factory=None, shard=None,
        strategy=None) -> BuildReport:
    """Fill every missing sample of the cache ``cached`` with the part builds of ``engine``.

    Where the parts go and how they join the cache is one entry of :data:`STRATEGIES`, chosen by
    where the cache lives (:func:`strategy_for`): a local directory (or the working copy of a remote
    cache being warmed) merges each part in place as it arrives; a ``gs://`` cache has its parts
    uploaded under ``<url>.parts/`` by the workers and composed server-side at the end
    (:func:`nbkit.cluster.compose.compose`: no sample byte through the driver).

    Args:
        cached: a ``CachedDataset`` opened with its source.
        engine: an :class:`nbkit.cluster.engine.Engine` (:class:`nbkit.cluster.local.LocalEngine`, a
            cluster's) or an executor, which the caller closes; or the name of one of
            :data:`nbkit.cluster.engine.ENGINES` (``"processes"``, ``"dask"``, ``"ray"``), started
            with every CPU (:func:`~nbkit.cluster.engine.engine_for`) and closed when the build ends.
        part_size: samples per part (ranges aligned to it).
        callback: an :class:`nbkit.progress.Callback`: progress in samples (its description says the
            parts); ``request_stop()`` cancels outstanding parts and keeps finished ones.
        factory: a module-level callable returning the source dataset in each worker, for a source
            that does not pickle.
        shard: ``(rank, world)``: build only the parts ``k`` (``k * part_size`` their first index)
            with ``k % world == rank``, for several drivers sharing one cache (each merges its own).
        strategy: a key of :data:`STRATEGIES` to use instead of :func:`strategy_for`'s choice
            (``warmup(num_workers=N)`` fills the working copy of a remote cache: ``"local"``).

    Returns:
        A :class:`BuildReport`.

    The driver keeps :data:`AHEAD` parts a worker submitted (``2 * engine.workers``): each worker
    starts its next part while the driver merges its last. The callback counts the samples merged
    into the cache: on ``gs://`` an uploaded part counts once it is composed (the parts uploaded
    show in the description and the per-worker view meanwhile), so the count never goes back.
    """
    if isinstance(engine, str):  # a name: an engine of this build's own
        with engine_for(engine) as made:
            return run(cached, made, part_size=part_size, callback=callback, factory=factory, shard=shard,
                       strategy=strategy)
    if not isinstance(engine, Engine):
        engine = engine_for(engine)  # an executor; anything else is a TypeError saying what run() takes
    if cached.source is None and factory is None:
        raise ValueError(f"cannot build the cache at {cached.path}: it was opened without its source dataset. Open it "
                         "with nbkit.CachedDataset(source, path), or pass factory= to make the source in each worker.")
    t0 = time.perf_counter()
    cb = as_callback(callback)
    cached.check_generation()
    store = cached.store
    how = STRATEGIES[strategy or strategy_for(cached)](cached, store, engine, cb)
    token = uuid.uuid4().hex
    if factory is None and engine.inherits and engine.share(("object", token, cached)):
        source = ("shared", token, None)  # forked workers start with it: nothing pickled (47 MB for torchvision's MNIST)
    else:
        source = _source(cached, factory)
        if source[0] == "pickled" and engine.share(source):  # each worker unpickles it once, not with every part
            source = ("shared", source[1], None)
    state = _State(cb, live=how.merges_on_arrival, done=how.done)
    owned = np.arange(store.length)
    if shard is not None:
        rank, world = shard
        owned = owned[(owned // part_size) % world == rank]
    state.total = int(store.admitted(owned).sum())
    cb.set_size(state.total)
    try:
        how.start(state)
        todo = how.plan(part_size, owned if shard is not None else None)
        state.skipped = state.total - sum(len(p.todo) for p in todo) - state.reused
        cb.absolute_update(state.total - sum(len(p.todo) for p in todo) - state.pending)
        state.planned = len(todo)
        if todo:  # parts done of all, and who builds them: the front ends' per-worker view
            state.workers = Workers(parts_done=state.parts, parts_total=state.parts + len(todo))
            cb.set_workers(state.workers)
        state.stopped = _build(how, engine, todo, source, cached, state)
        while not state.stopped:
            again = how.finish(state)  # parts refused at the end (compose): built again, then finished again
            if not again:
                break
            state.planned += len(again)
            state.stopped = _build(how, engine, again, source, cached, state)
    finally:
        how.close(state)
    cb.set_description("stopped" if state.stopped else "done")
    return BuildReport(computed=state.computed, reused=state.reused, skipped=state.skipped, total=state.total,
                       parts=state.parts, refused=state.refused, retried=state.retried,
                       seconds=time.perf_counter() - t0, stopped=state.stopped)


class _State:
    """The build's counts. The callback's count is the samples in the cache: with ``live`` (a strategy
    that merges each part as it arrives) a part counts when it arrives; otherwise (compose) its
    samples wait in :attr:`pending` until :meth:`published`, so a part refused at the end is taken
    out of ``pending``, never out of the count shown. ``done``: what a finished part is called."""

    def __init__(self, cb, *, live: bool = True, done: str = "merged"):
        self.cb, self.live, self.done = cb, live, done
        self.pending = 0  # samples of parts finished but not yet in the cache (uploaded, not composed)
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
        if self.live:
            self.cb.relative_update(result.merged)
        else:
            self.pending += result.merged
        if self.planned:
            self.cb.set_description(f"building: {self.parts} of {self.planned} parts {self.done}")

    def out(self, sent: list) -> None:
        """Show the parts out (``sent``: when each was submitted): a part out far longer than parts
        take shows a stuck or lost worker before its part ends (:attr:`nbkit.progress.Workers.overdue`)."""
        if self.workers is not None:
            oldest = time.monotonic() - min(sent) if sent else 0.0
            self.workers = self.workers.out(len(sent), oldest)
            self.cb.set_workers(self.workers)

    def unmerged(self, samples: int, *, reused: bool) -> None:
        """Take back a part counted as merged that was refused after all (it is built again)."""
        self.refused += 1
        self.parts -= 1
        if reused:
            self.reused -= samples
        else:
            self.computed -= samples
        if self.live:
            self.cb.relative_update(-samples)
        else:
            self.pending -= samples

    def published(self) -> None:
        """The parts counted in :attr:`pending` are in the cache now (composed): count them."""
        self.cb.relative_update(self.pending)
        self.pending = 0


# -- where the parts go: one strategy per kind of storage --------------------------------------------


class LocalMerge:
    """Parts in a local directory beside the cache (``<cache>.parts``), each verified and merged in
    place as it arrives (:func:`nbkit.cluster.merge.merge`); what a stop or a failure leaves finished
    is merged before the build returns. For a store without a directory of its own (Redis), the
    parts live in a directory of this machine named after the cache."""

    name = "local"
    merges_on_arrival = True  # each part is in the cache once it arrives: the count moves with it
    done = "merged"

    def __init__(self, cached, store, engine, cb):
        from .local import LocalEngine

        self.store, self.cb = store, cb
        # This machine's own worker processes need no SHA-256 of their parts (it guards parts that
        # travelled); sizes and every sample's CRC are still checked. Any other engine's are hashed.
        self.hashes = not isinstance(engine, LocalEngine)
        root = cached.root
        if "://" in root:  # no directory of its own: a stable one here, so a rerun finds its parts
            import hashlib
            import tempfile

            root = os.path.join(tempfile.gettempdir(), "nbkit-builds", hashlib.sha256(root.encode()).hexdigest()[:16])
        self.parts = parts_dir(root)
        # Workers write rows straight into a local cache directory's files (placed parts): the merge
        # then links index records only. A store without files of its own (Redis) gets whole parts.
        self.placed = PLACED and isinstance(store, CacheFiles) and "://" not in cached.root and store.writable
        self.replan = False  # the plan left ranges to another driver: look once more at the end
        self.checked = False  # the end's look for samples still missing has been taken

    def start(self, state) -> None:
        sweep_builds(self.parts)
        left = list_parts(self.parts)
        if left:
            self.cb.set_description(f"merging {len(left)} parts left by an earlier build")
        for path in left:  # built before: verified and merged, never computed again
            state.merged(merge(self.store, path, hashes=self.hashes), reused=True)

    def plan(self, part_size: int, indices) -> list:
        # Around the parts another driver (maybe of another part size) has built or is building.
        around = held(self.parts)
        self.part_size, self.indices, self.replan = part_size, indices, bool(around)
        return plan(self.store, part_size, indices, around=around)

    def spec(self) -> dict:
        # This machine's workers leave syncing a placed part's rows to the merge (the same
        # page cache; the driver waits for the disk while they compute); remote workers sync them.
        return {"parts": self.parts, "hashes": self.hashes, "placed": self.placed, "sync_rows": self.hashes}

    def arrived(self, result: dict) -> MergeResult:
        # Kept: the copy its worker wrote during this build (fresh); else another's copy, checked as a leftover.
        return merge(self.store, os.path.join(self.parts, result["name"]), hashes=self.hashes, fresh=bool(result.get("kept")))

    def missing(self, p: PlannedPart) -> np.ndarray:
        return self.store.missing(np.arange(p.start, p.stop))

    def salvage(self, state, finished: dict | None = None) -> None:
        """After a stop or a failure: merge the parts that were finished (not yet merged);
        ``finished``: what :func:`build_part` returned for those whose calls ended, by part name
        (who built them: the workers table counts them)."""
        finished = finished or {}
        for path in list_parts(self.parts):
            built = finished.get(os.path.basename(path))
            state.merged(merge(self.store, path, hashes=self.hashes, fresh=bool(built and built.get("kept"))), built=built)

    def finish(self, state) -> list:
        # Each part was merged as it arrived; what the plan left to another driver is merged now if
        # it is there, and built here once if it is still missing (that driver stopped or is slow).
        # Whatever else is still missing (a part another driver refused and removed after this one
        # built it) is planned once more: a build that ends says done only when its samples are in.
        if self.replan:
            self.replan = False
            self.salvage(state)
        elif self.checked:
            return []
        self.checked = True
        return plan(self.store, self.part_size, self.indices)

    def close(self, state) -> None:
        sweep_builds(self.parts)
        try:
            os.rmdir(self.parts)
        except OSError:
            pass  # parts left (a failure before they merged), or never made


class ComposeParts:
    """Parts of a ``gs://`` cache: each worker uploads its part under ``<url>.parts/`` (data files
    first, ``nbkit.json`` last: a part exists once that does, and the first whole copy wins); once
    every part is there, :func:`nbkit.cluster.compose.compose` builds the cache from them server-side.
    A part already uploaded (an earlier run) is never computed again; a stop leaves the uploaded parts
    for the next run. Parts are whole ranges (compose concatenates columns), so a byte-budgeted cache
    (``max_bytes``) cannot be composed."""

    name = "compose"
    merges_on_arrival = False  # an uploaded part is in the cache once composed, at the end
    done = "uploaded"

    def __init__(self, cached, store, engine, cb):
        from .compose import parts_url

        if store.capacity is not None and store.capacity < store.length:
            raise ValueError(f"{cached.path} has a byte budget (max_bytes): only some samples are admitted, and a "
                             "gs:// build composes whole columns. Build it without max_bytes, or build a local "
                             "cache and push it (nbkit.push).")
        self.url, self.cb, self.store, self.engine = cached.path.rstrip("/"), cb, store, engine
        self.storage_options = dict(cached._location.storage_options or {})
        self.parts = parts_url(self.url)
        self.present: dict = {}  # (start, stop) of each part uploaded: True if an earlier run left it
        self.refusals: dict = {}  # (start, stop): times compose refused it

    def start(self, state) -> None:
        from ..transfer.remote import connect, remote_errors
        from .compose import check_uploaded, remove_part
        from .part import PartRefused, remote_parts

        fix = "run the build again once the storage answers: finished parts are kept"
        self.fs, self.root = connect(self.parts, self.storage_options or None, doing="checking the parts at", fix=fix,
                                     write=True)
        # Parts of an earlier plan, maybe of another part size: those overlapping the ones kept go
        # (composing both would store an index twice); the plan is then cut around the kept ones.
        found, foreign = plan_around(remote_parts(self.parts, self.storage_options), self.store.length)
        for bounds in foreign:
            with remote_errors(self.fs, self.parts, "checking the parts at", fix):
                remove_part(self.fs, self.root, bounds)
        if found:
            self.cb.set_description(f"checking {len(found)} parts uploaded by an earlier build")
        kept = 0
        for bounds in found:  # what compose will check (not the sample bytes): a damaged part is built again
            with remote_errors(self.fs, self.parts, "checking the parts at", fix):
                try:
                    check_uploaded(self.fs, self.root, bounds, self.store.meta)
                except PartRefused:
                    remove_part(self.fs, self.root, bounds)
                    state.refused += 1
                    continue
            self.present[bounds] = True
            kept += 1
            state.merged(MergeResult(merged=bounds[1] - bounds[0]), reused=True)
        if kept:
            self.cb.set_description(f"{kept} parts uploaded by an earlier build are kept")

    def plan(self, part_size: int, indices) -> list:
        from .. import trust

        part_size = trust.check_int(part_size, "part_size", min=1, max=trust.MAX_SAMPLES,
                                    fix="a part holds a few thousand samples (the default is 4096)")
        self.part_size, self.sharded = part_size, indices is not None
        keys = None if indices is None else np.unique(np.asarray(indices) // part_size) * part_size
        # Whole ranges aligned to part_size, cut around the parts kept (an earlier plan's may differ).
        return [PlannedPart(a, b, np.arange(a, b, dtype=np.int64)) for a, b in gaps(self.store.length, part_size, self.present, keys)]

    def spec(self) -> dict:
        return {"parts": None, "upload": {"url": self.parts, "storage_options": self.storage_options}}

    def arrived(self, result: dict) -> MergeResult:
        from .part import parse_part_name

        start, stop = parse_part_name(result["name"])
        self.present[(start, stop)] = False
        return MergeResult(merged=stop - start)

    def missing(self, p: PlannedPart) -> np.ndarray:
        return p.todo

    def salvage(self, state, finished: dict | None = None) -> None:
        pass  # uploaded parts stay under the parts prefix: the next run composes them

    def finish(self, state) -> list:
        from .compose import compose, remove_part
        from .part import PartRefused, remote_parts

        if self.sharded and cover(remote_parts(self.parts, self.storage_options), self.store.length) is None:
            # Other shards' parts are still missing: the driver that uploads the last one composes.
            self.cb.set_description("this shard's parts are uploaded; the last shard to finish composes")
            return []
        self.cb.set_description("composing the parts (server-side)")
        try:
            compose(self.url, engine=self.engine, storage_options=self.storage_options or None, remove_parts=True,
                    callback=self.cb)
        except PartRefused as e:
            if e.bounds is None:
                raise
            # A part damaged after it was uploaded (or two copies uploaded at once): removed, built
            # again, then composed again; a part refused every time stops the build with the reason.
            tries = self.refusals[e.bounds] = self.refusals.get(e.bounds, 0) + 1
            if tries > RETRIES:
                _note(e, f"(refused {tries} times: the build stops; finished parts are kept)")
                raise
            remove_part(self.fs, self.root, e.bounds)
            reused = self.present.pop(e.bounds, False)
            state.unmerged(e.bounds[1] - e.bounds[0], reused=reused)
            start, stop = e.bounds
            return [PlannedPart(start, stop, np.arange(start, stop, dtype=np.int64))]
        state.published()  # composed: the uploaded parts' samples are the cache's now
        return []

    def close(self, state) -> None:
        pass


#: How parts join a cache, by where it lives (:func:`strategy_for`): one class per kind of storage.
STRATEGIES = {"local": LocalMerge, "compose": ComposeParts}


def strategy_for(cached) -> str:
    """The :data:`STRATEGIES` key for ``cached``: ``"compose"`` for a cache at a ``gs://`` URL (its
    workers cannot reach the driver's disk, and compose moves no sample byte through the driver),
    ``"local"`` for everything else (a directory, a shared mount, a Redis server)."""
    return "compose" if str(cached.path).startswith(("gs://", "gcs://")) else "local"


def _spec(p: PlannedPart, cached, meta: dict, extra: dict, source: tuple) -> dict:
    return {"cache": cached.root, "start": p.start, "stop": p.stop, "todo": p.todo, "meta": meta, "source": source,
            **extra}


def _build(how, engine, todo, source, cached, state) -> bool:
    """Submit, wait, merge; return whether it stopped early."""
    meta = how.store.meta
    queue = deque(todo)
    later: list = []  # (when, part): parts whose storage failed, submitted again after a pause
    tries: dict = {}
    inflight: dict = {}
    sent: dict = {}  # future: when it was submitted
    shown = 0.0  # when the parts out were last shown

    def again(p, error) -> bool:
        if tries.get(p.start, 0) >= RETRIES:
            return False
        tries[p.start] = tries.get(p.start, 0) + 1
        state.retried += 1
        if error is None:
            queue.appendleft(p)
        else:
            later.append((time.monotonic() + RETRY_SECONDS * 2 ** (tries[p.start] - 1), p))
        return True

    with _Interrupt() as interrupt:  # Ctrl-C: noted here, acted on in the loop
        try:
            while queue or inflight or later:
                if state.cb.should_stop() or interrupt.hit:
                    finished = _finished(inflight)  # calls that ended: who built those parts
                    engine.cancel(list(inflight))
                    inflight.clear()
                    how.salvage(state, finished)
                    if interrupt.hit:
                        raise KeyboardInterrupt
                    return True
                now = time.monotonic()
                for item in [x for x in later if x[0] <= now]:
                    later.remove(item)
                    queue.append(item[1])
                while queue and len(inflight) < AHEAD * max(1, engine.workers):
                    p = queue.popleft()
                    future = engine.submit(build_part, _spec(p, cached, meta, how.spec(), source))
                    inflight[future], sent[future] = p, time.monotonic()
                if not inflight:
                    time.sleep(POLL_SECONDS)
                    continue
                done, _ = concurrent.futures.wait(inflight, timeout=POLL_SECONDS, return_when=concurrent.futures.FIRST_COMPLETED)
                if time.monotonic() - shown >= SHOW_SECONDS:
                    state.out([sent[f] for f in inflight if f not in done])
                    shown = time.monotonic()
                for f in done:
                    p = inflight.pop(f)
                    sent.pop(f, None)
                    error = f.exception() if not f.cancelled() else concurrent.futures.CancelledError()
                    if error is not None:
                        if engine.worker_lost(error) and again(p, None):
                            continue
                        _note(error, f"(raised while {engine.name} built the part [{p.start}, {p.stop}) of {cached.path}; "
                                     "parts merged so far are kept: run the build again to resume)")
                        raise error
                    result = f.result()
                    storage = result.get("storage_error")
                    if storage is not None:  # the storage failed under the part, not the source
                        if again(p, storage):
                            continue
                        _note(storage, f"(the storage failed while {engine.name} wrote the part [{p.start}, {p.stop}) of "
                                       f"{cached.path}, {RETRIES + 1} times: run the build again once it is back; finished "
                                       "parts are kept)")
                        raise storage
                    merged = how.arrived(result)
                    state.merged(merged, built=result)
                    if merged.refused or merged.gone:  # gone: merged by another driver, or removed before it was
                        missing = how.missing(p)
                        if merged.refused or len(missing):
                            if tries.get(p.start, 0) >= RETRIES:
                                why = merged.refused or "its part was gone before it could be merged"
                                raise RuntimeError(f"the part [{p.start}, {p.stop}) of {cached.path} was refused {RETRIES + 1} "
                                                   f"times; the last time: {why}")
                            tries[p.start] = tries.get(p.start, 0) + 1
                        if len(missing):
                            queue.appendleft(PlannedPart(p.start, p.stop, missing))
        except BaseException as e:
            finished = _finished(inflight)
            if inflight:
                engine.cancel(list(inflight))
            if isinstance(e, Exception):
                try:
                    how.salvage(state, finished)  # what finished before the failure joins the cache
                except Exception as salvage_error:  # noqa: BLE001 - the first failure is the news
                    _note(e, f"(merging the finished parts after it failed too: {salvage_error})")
            raise
        return False


class _Interrupt:
    """Ctrl-C while parts are out (SIGINT: a terminal's, or a notebook's interrupt button) is noted,
    not raised wherever it lands (inside a lock of the executor's, where it can leave a future's lock
    held): the loop then cancels the parts out, merges the finished ones and raises
    ``KeyboardInterrupt``. A second Ctrl-C raises at once. Only in the main thread, and only where
    SIGINT has Python's own handler (a command line's handler of its own stays in charge)."""

    def __init__(self):
        self.hit = False
        self._previous = None

    def __enter__(self) -> "_Interrupt":
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._noted)
        return self

    def _noted(self, signum, frame) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _finished(inflight) -> dict:
    """What :func:`build_part` returned for the calls among ``inflight`` that have ended well, by part name."""
    out = {}
    for f in list(inflight):
        if f.done() and not f.cancelled() and f.exception() is None:
            result = f.result()
            if isinstance(result, dict) and "name" in result and result.get("storage_error") is None:
                out[result["name"]] = result
    return out


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(text)
