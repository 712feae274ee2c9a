"""The Dask engine: part builds run on a ``distributed`` cluster, local or remote.

``DaskEngine()`` starts a ``LocalCluster`` of ``num_workers`` worker processes with one thread each
(a part build holds the GIL: threads would not run in parallel); ``DaskEngine("tcp://host:8786")``
joins a scheduler; ``DaskEngine(client)`` uses your ``Client`` and leaves it open. Calls are
submitted with ``pure=False`` (every call runs, none is deduplicated by its arguments). A worker
process that dies mid-call is restarted by its nanny and the scheduler runs the call again on a
live worker (at most ``distributed.scheduler.allowed-failures`` times, then the future fails with
``KilledWorker``). A Stop restarts the workers running stopped parts and checks that they are back
within :data:`RESTART_SECONDS` (a local cluster of the engine's that lost them is replaced; a joined
one left with none makes the engine say so, :attr:`DaskEngine.unusable`, and its next call raise it).
A local cluster's scheduler and dashboard listen on 127.0.0.1 only, and its workers end with the driver
(their nannies run in it), even a ``kill -9`` of it. On a remote cluster the workers must import nbkit and your source's code: install
them in the workers' image, or ``client.upload_file(...)`` a module.

Example (skipped by the doctest run: it starts a local cluster, ~2 s; tests/cluster/ runs it for real):
    >>> engine = DaskEngine(num_workers=1)     # doctest: +SKIP
    >>> engine.submit(pow, 2, 10).result()     # doctest: +SKIP
    1024
    >>> engine.close()                         # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
import warnings

from ..extras import require
from ..text import quiet_loggers
from .engine import Engine, not_picklable

__all__ = ["DaskEngine", "worker_memory"]

FEATURE = "nbkit.cluster.DaskEngine"
#: Seconds a Stop waits for the workers it restarts to be back, in all (a nanny restarts one in about a second).
RESTART_SECONDS = 30
#: Seconds a submit waits for a worker when a Stop left the cluster with none (then it raises why).
WORKERS_SECONDS = 30
#: Seconds closing a broken local cluster may take before it is dropped.
CLOSE_SECONDS = 10
#: The name of the worker plugin that gives every worker the build's source (:meth:`DaskEngine.share`).
PLUGIN = "nbkit-build-source"

try:  # the plugin's base class: DaskEngine() itself says which extra to install when it is missing
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:
    _WorkerPlugin = object


class SourcePlugin(_WorkerPlugin):
    """Loads a build's source into each worker once (:meth:`DaskEngine.share`): on the workers there
    when it is registered, and on every worker that joins or restarts later (a Stop's restart, a
    nanny's after a crash). Removed when the engine closes, with the source it holds."""

    name = PLUGIN

    def __init__(self, source: tuple):
        self.source = source

    def setup(self, worker=None):
        from .part import preload_source

        preload_source(self.source)

    def teardown(self, worker=None):
        from .part import forget_source

        forget_source(self.source[1])


class DaskEngine(Engine):
    """An :class:`~nbkit.cluster.engine.Engine` over a ``dask.distributed.Client``.

    Args:
        client_or_address: ``None`` starts a local cluster; a scheduler address joins it; a
            ``Client`` is used as is (and not closed by :meth:`close`).
        num_workers: worker processes of the local cluster (default: the CPUs), and calls run at once.
    """

    name = "dask"

    def __init__(self, client_or_address=None, *, num_workers: int | None = None):
        distributed = require("distributed", extra="dask", feature=FEATURE, install="pip install 'dask[distributed]'")
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ValueError(f"num_workers must be a positive int, not {num_workers!r}")
        self._cluster = None
        #: Why this engine cannot run calls now (a Stop left its joined cluster without workers), or None.
        self.unusable: str | None = None
        if isinstance(client_or_address, distributed.Client):
            self.client, self._owns_client = client_or_address, False
        elif client_or_address is None:
            self._local = num_workers or os.cpu_count() or 1
            self._start_local()
        else:
            try:
                self.client, self._owns_client = distributed.Client(client_or_address), True
            except OSError as e:
                raise OSError(f"DaskEngine could not reach the Dask scheduler at {client_or_address!r} ({e}). Start one "
                              "(`dask scheduler`), check the address, or pass None for a local cluster.") from e
        self.workers = num_workers or max(1, sum(self.client.nthreads().values()))
        self._futures: dict = {}  # our future -> the distributed future it follows (holding it keeps the task alive)
        self._lock = threading.Lock()
        self._shared: tuple | None = None  # the source every worker loads (share), re-given to a fresh local cluster

    def share(self, source: tuple) -> bool:
        """Every worker loads ``source`` once, through a worker plugin (:class:`SourcePlugin`): the
        workers there now and any that join or restart later; the parts then carry only its token
        (a 47 MB torchvision MNIST pickled into every part before). ``False`` (the parts carry it) when
        a worker cannot load it."""
        if self.client is None:
            return False
        try:
            with _quiet():
                self.client.register_plugin(SourcePlugin(source), name=PLUGIN)
        except Exception:  # noqa: BLE001 - a worker that cannot load it: each part carries it, and says why if it fails
            self._unshare()
            return False
        self._shared = source
        return True

    def _unshare(self) -> None:
        self._shared = None
        with contextlib.suppress(Exception), _quiet():  # a closed or broken cluster: nothing left to remove
            self.client.unregister_worker_plugin(PLUGIN)

    def _start_local(self) -> None:
        import distributed

        # Any free port (never a clash with 8787), on loopback only: the dashboard shows the tasks and
        # the workers' state to whoever reaches it, and a notebook runtime's other interfaces are not ours.
        with _quiet():
            # silence_logs: the workers' (and their nannies') warnings about calls the Stop cancelled
            # ("Async instruction ... ended with CancelledError") are not news; their errors still show.
            self._cluster = distributed.LocalCluster(n_workers=self._local, threads_per_worker=1, processes=True,
                                                     host="127.0.0.1", dashboard_address="127.0.0.1:0",
                                                     silence_logs=logging.ERROR)
            self.client, self._owns_client = distributed.Client(self._cluster), True

    def submit(self, fn, *args) -> concurrent.futures.Future:
        if self.client is None:
            raise RuntimeError("this DaskEngine is closed: make a new one")
        if self.unusable is not None:  # a Stop left no worker: one back (the cluster's own restart) clears it
            try:
                self.client.wait_for_workers(1, timeout=WORKERS_SECONDS)
            except TimeoutError:
                raise RuntimeError(self.unusable) from None
            self.unusable = None
        try:
            with _quiet():
                dfut = self.client.submit(fn, *args, pure=False)
        except Exception as e:  # distributed raises several types for a call it cannot serialize
            if _is_pickling_error(e):
                raise not_picklable(fn, args, "Dask", e) from e
            raise
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._futures[out] = dfut

        def done(d):  # on a thread of the client's: fetching the result here blocks nobody else
            with self._lock:
                self._futures.pop(out, None)
            if out.done():
                return
            try:
                if d.status == "cancelled":
                    out.cancel()
                    return
                result = d.result()
            except BaseException as e:  # noqa: BLE001 - the call's failure (or KilledWorker) is its future's
                _settle(out, exception=_describe_pickling(e, fn, args))
                return
            _settle(out, result=result)

        dfut.add_done_callback(done)
        return out

    def cancel(self, futures) -> None:
        """Cancel queued calls, and stop running ones by restarting the worker processes running them
        (Dask cannot interrupt a running Python call; its nanny starts a fresh worker in ~1 s). A
        worker without a nanny cannot be restarted: its call then runs to its end and is dropped."""
        futures = list(futures)
        with self._lock:
            dfuts = [self._futures[f] for f in futures if f in self._futures]
        for f in futures:
            f.cancel()
        if not dfuts or self.client is None:
            return
        keys = {d.key for d in dfuts}
        with _quiet():  # the nannies report the restarts they were asked for: not news
            busy = [w for w, running in self.client.processing().items() if keys & set(running)]
            self.client.cancel(dfuts, force=True)
            if busy:
                self._restart(busy)

    def _restart(self, busy: list) -> None:
        """Restart the workers ``busy`` and check that the cluster has its workers back, within
        :data:`RESTART_SECONDS`. A local cluster of this engine's that lost them is replaced by a fresh
        one (the engine stays usable); a joined cluster left with none makes the engine say so
        (:attr:`unusable`, and the next :meth:`submit` raises it unless a worker came back)."""
        before, deadline = len(self.client.nthreads()), time.monotonic() + RESTART_SECONDS
        try:
            outcome = self.client.restart_workers(busy, timeout=RESTART_SECONDS, raise_for_error=False) or {}
        except (ValueError, TypeError, OSError) as e:  # no nanny (a plain `dask worker --no-nanny`), or gone
            warnings.warn(f"DaskEngine.cancel could not restart the workers running cancelled calls ({e}): "
                          "those calls run to their end and their results are dropped.", RuntimeWarning, stacklevel=3)
            return
        try:
            self.client.wait_for_workers(before, timeout=max(1.0, deadline - time.monotonic()))
            return
        except TimeoutError:
            pass
        now = len(self.client.nthreads())
        failed = ", ".join(f"{w}: {s}" for w, s in outcome.items() if s != "OK") or "none reported a failure"
        what = (f"the Stop restarted the Dask workers running the stopped parts, and {now} of the {before} workers came "
                f"back within {RESTART_SECONDS} s ({failed})")
        if self._cluster is not None:  # the engine's own local cluster: a fresh one, and the engine goes on
            warnings.warn(f"{what}: DaskEngine starts a fresh local cluster.", RuntimeWarning, stacklevel=3)
            self._close_local()
            self._start_local()
            if self._shared is not None and not self.share(self._shared):  # the parts after this carry only its token
                self.unusable = "DaskEngine's fresh local cluster could not load the build's source: run the build again."
        elif now == 0:
            self.unusable = (f"this DaskEngine's cluster has no workers: {what}. Restart its workers (or the cluster) "
                             "and run again, or make a DaskEngine on another cluster.")
            warnings.warn(self.unusable, RuntimeWarning, stacklevel=3)
        else:
            warnings.warn(f"{what}: the build goes on with fewer workers.", RuntimeWarning, stacklevel=3)

    def _close_local(self) -> None:
        client, cluster, self.client, self._cluster = self.client, self._cluster, None, None
        pids = _worker_pids(cluster)
        try:
            client.close(timeout=CLOSE_SECONDS)
            cluster.close(timeout=CLOSE_SECONDS)
        except (TimeoutError, OSError, RuntimeError) as e:  # a broken cluster may not close cleanly: it is dropped
            warnings.warn(f"DaskEngine could not close its old local cluster cleanly ({e})", RuntimeWarning, stacklevel=4)
        finally:
            _end(pids)  # a close that gave up leaves its worker processes running for good otherwise

    def worker_lost(self, error: BaseException) -> bool:
        """Whether ``error`` says the call's workers kept dying (``KilledWorker``: the scheduler gave up
        after ``allowed-failures``): the driver then submits the part again."""
        import distributed
        return isinstance(error, distributed.KilledWorker)

    def close(self) -> None:
        if self.client is None:
            return
        with _quiet():  # "Worker process still alive after 4 s, killing": closing is what was asked
            self._close()

    def _close(self) -> None:
        if self._shared is not None and self._cluster is None:  # a joined cluster keeps running: no source left on it
            self._unshare()
        if self._cluster is not None:  # its own cluster ends now: nothing to restart
            with self._lock:
                ours, dfuts = list(self._futures), list(self._futures.values())
            for f in ours:
                f.cancel()
            self.client.cancel(dfuts, force=True)
        else:  # a joined cluster's workers stay: a part still running there is stopped (restarted)
            self.cancel(list(self._futures))
        if self._owns_client:
            self.client.close()
        if self._cluster is not None:
            pids = _worker_pids(self._cluster)
            try:
                self._cluster.close(timeout=CLOSE_SECONDS)
            finally:
                _end(pids)
        self.client = self._cluster = None


def worker_memory(engine: DaskEngine) -> dict:
    """Each worker's resident memory in bytes (its process's RSS, measured now), by worker address:
    what the cluster costs this machine, measured rather than guessed.

    Example (skipped by the doctest run: it starts a local cluster):
        >>> engine = DaskEngine(num_workers=2)            # doctest: +SKIP
        >>> sorted(worker_memory(engine).values())        # doctest: +SKIP
        [121634816, 122818560]
    """
    if engine.client is None:
        raise RuntimeError("this DaskEngine is closed: make a new one")
    with _quiet():
        return {w: int(m) for w, m in engine.client.run(_rss).items()}


def _rss() -> int:
    """This process's resident memory in bytes (run in each worker; psutil comes with distributed)."""
    import psutil
    return psutil.Process().memory_info().rss


@contextlib.contextmanager
def _quiet():
    """nbkit's calls into Dask without Dask's chatter on stderr: its loggers' warnings (nannies
    restarting or killing the workers a Stop or a close asked them to) and the warning that a call's
    arguments are large (the source goes to each worker once, in the plugin of :meth:`DaskEngine.share`;
    where that failed, every part carries it: expected). Only for the block; Dask's errors still show."""
    import dask

    with quiet_loggers("distributed"), dask.config.set({"distributed.admin.large-graph-warning-threshold": "100 GiB"}):
        yield


def _worker_pids(cluster) -> list:
    """The pids of a local cluster's worker processes (children of this process: their nannies run here)."""
    pids = []
    for nanny in list(getattr(cluster, "workers", {}).values()):
        try:
            pid = nanny.pid
        except AttributeError:  # a worker without a nanny runs in this process
            continue
        if isinstance(pid, int) and pid > 0:
            pids.append(pid)
    return pids


def _end(pids: list) -> None:
    """SIGKILL what is left of the worker processes ``pids`` once their cluster closed (or gave up closing):
    only processes that are still this process's children, so a reused pid is never signalled."""
    import signal

    from .reaper import proc_stat

    for pid in pids:
        fields = proc_stat(pid)  # None: gone already, or no /proc (macOS): nothing to end
        if fields is not None and fields[1] == str(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _settle(out, *, result=None, exception=None):
    try:
        if exception is not None:
            out.set_exception(exception)
        else:
            out.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled meanwhile


def _is_pickling_error(e: BaseException) -> bool:
    import pickle
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, (pickle.PicklingError, TypeError)) and ("pickle" in text or "serializ" in text)


def _describe_pickling(e: BaseException, fn, args):
    return not_picklable(fn, args, "Dask", e) if _is_pickling_error(e) else e
