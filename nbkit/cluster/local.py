"""The local engine: part builds run by worker processes on this machine.

A :class:`concurrent.futures.ProcessPoolExecutor` with the chosen start method (``fork``, ``spawn``,
``forkserver``), its workers set up as warmup's are (one torch thread each, Ctrl-C left to the main
process; each ends within seconds of the driver's death, :func:`~nbkit.cluster.engine.watch_driver`:
a ``kill -9`` of the driver or a notebook's kernel restart leaves no idle worker behind). A worker
that dies (killed, out of memory) breaks the pool: the driver sees
:meth:`LocalEngine.worker_lost` and submits its part again, and the next submit starts a fresh pool.
:meth:`LocalEngine.cancel` of futures still running ends the worker processes at once (a Stop while
every worker is stuck in the source), as ``warmup(num_workers=N)`` does.

Example:
    >>> with LocalEngine(workers=1, multiprocessing_context="spawn") as engine:
    ...     engine.submit(pow, 2, 10).result()
    1024
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import random
import signal
import time
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..trust import MAX_WORKERS, check_int
from .engine import Engine, watch_driver

#: How long :meth:`LocalEngine.worker_lost` waits, in all, for a broken pool's workers to be gone
#: (a dead worker's pipe closes a moment before its exit status can be read).
LOST_WAIT_SECONDS = 5.0

__all__ = ["LocalEngine", "processes"]


def _context(multiprocessing_context):
    if multiprocessing_context is None:
        return multiprocessing.get_context()
    if isinstance(multiprocessing_context, str):
        methods = multiprocessing.get_all_start_methods()
        if multiprocessing_context not in methods:
            raise ValueError(f"multiprocessing_context must be one of {methods} (or a multiprocessing context), "
                             f"got {multiprocessing_context!r}")
        return multiprocessing.get_context(multiprocessing_context)
    if not hasattr(multiprocessing_context, "Process"):
        raise TypeError("multiprocessing_context must be a start method name ('fork', 'spawn', 'forkserver') or a "
                        f"multiprocessing context, got {type(multiprocessing_context).__name__}")
    return multiprocessing_context


def _alive(pool) -> list:
    procs = getattr(pool, "_processes", None) or {}  # CPython's pool keeps its processes there (since 3.2)
    return [p for p in list(procs.values()) if p.is_alive()]


def _init_worker(seed: int, source: tuple | None = None, driver: int | None = None) -> None:
    # SIGTERM ends a worker (the pool ends the rest so once one died): never a handler inherited through
    # a fork from the driver (ray.init installs one that exits with status 15, which reads as a crash).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import torch

    if driver is not None:  # first: a driver killed while this worker loads the source ends it too
        watch_driver(driver)
    if source is not None:  # the build's source, once a process (Engine.share), not with every part
        from .part import preload_source
        preload_source(source)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's: it ends the workers
    torch.set_num_threads(1)  # as DataLoader and warmup workers: several processes, one thread each
    seed = (seed + os.getpid()) % 2**48  # as DataLoader workers: each its own random stream
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


class LocalEngine(Engine):
    """Part builds in ``workers`` local processes.

    Args:
        workers: how many processes (about as many as the machine has cores).
        multiprocessing_context: ``"fork"``, ``"spawn"``, ``"forkserver"`` or a context (default:
            multiprocessing's default). With ``spawn`` and ``forkserver`` the source must be importable.
    """

    name = "local processes"

    def __init__(self, workers: int = 2, *, multiprocessing_context=None):
        self.workers = check_int(workers, "workers", min=1, max=MAX_WORKERS,
                                 fix="each is a process: use about as many as the machine has cores (os.cpu_count())")
        self.context = _context(multiprocessing_context)
        #: ``(pid, exit code)`` of each worker process that died under a part (killed, crashed).
        self.lost: list = []
        self._pool = None
        self._source = None  # what share() gave: each new worker process loads it at its start

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=self.context, initializer=_init_worker,
                                                                initargs=(random.getrandbits(48), self._source, os.getpid()))
        return self._pool

    @property
    def inherits(self) -> bool:
        """Its processes are forked (``fork``): a shared source reaches them with the fork, unpickled."""
        return self.context.get_start_method() == "fork"

    def share(self, source: tuple) -> bool:
        if self._pool is not None and self._source is None:
            return False  # its processes run already: the parts carry the source
        self._source = source
        if self._pool is not None:  # processes of an earlier build's source: the next ones get this one
            self._drop(kill=False)
        return True

    def submit(self, fn, *args) -> concurrent.futures.Future:
        try:
            return self._executor().submit(fn, *args)
        except BrokenProcessPool:  # a worker died since the last submit: a fresh pool
            self._record_lost()  # before the pool and its processes' exit codes are gone
            self._drop(kill=True)
            return self._executor().submit(fn, *args)

    def cancel(self, futures) -> None:
        """Cancel what has not started; if any of ``futures`` is running, end the worker processes
        at once (a stuck source too); the next submit starts fresh ones."""
        running = [f for f in futures if not f.cancel() and not f.done()]
        if running:
            self._drop(kill=True)

    def worker_lost(self, error: BaseException) -> bool:
        if isinstance(error, BrokenProcessPool):
            self._record_lost()
        return isinstance(error, (BrokenProcessPool, concurrent.futures.CancelledError))

    def _record_lost(self) -> None:
        """Note the workers of the broken pool that died on their own: ``(pid, exit code)`` in :attr:`lost`."""
        pool = self._pool
        if pool is None or not getattr(pool, "_broken", True):  # the failure was an earlier pool's: this one is sound
            return
        procs = getattr(pool, "_processes", None) or {}
        deadline = time.monotonic() + LOST_WAIT_SECONDS
        for p in list(procs.values()):
            # The pool broke because a worker's pipe closed, a moment before the kernel gives its exit
            # status (and the pool ends the others); the pool's own thread reaps them too, and between
            # its waitpid and its note of the status ours finds nothing. Look until the status is there.
            while (code := p.exitcode) is None and time.monotonic() < deadline:
                time.sleep(0.005)
            # The pool ends the other workers with SIGTERM once one died: those are not the news.
            if code not in (None, 0, -signal.SIGTERM) and (p.pid, code) not in self.lost:
                self.lost.append((p.pid, code))

    def processes(self) -> list:
        """The worker processes alive now (for tests and the panel's per-worker view)."""
        return _alive(self._pool)

    def _drop(self, *, kill: bool) -> None:
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for p in _alive(pool) if kill else []:
            p.kill()
        pool.shutdown(wait=bool(kill), cancel_futures=True)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def processes(num_workers=None) -> LocalEngine:
    """``engine_for("processes")``: a :class:`LocalEngine` of ``num_workers`` processes (default: one per CPU).

    Example:
        >>> with processes(1) as engine:
        ...     engine.workers, engine.name
        (1, 'local processes')
    """
    import os

    return LocalEngine(num_workers or os.cpu_count() or 1)
