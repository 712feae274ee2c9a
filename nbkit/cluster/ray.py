"""The Ray engine: part builds run as Ray tasks, on a local instance or on a running cluster.

``RayEngine()`` starts a local Ray instance with ``num_workers`` CPUs (and shuts down only what it
started; every process of it ends within seconds of a ``kill -9`` of the driver, :mod:`~nbkit.cluster.reaper`); ``RayEngine("auto")`` or ``RayEngine("ray://head:10001")`` joins a running cluster. Each
call is a ``ray.remote`` task with ``max_retries``: a task whose worker process or node dies is run
again (a part build may therefore run twice; the part protocol keeps the first whole copy).
:meth:`RayEngine.cancel` cancels queued tasks and kills running ones (``ray.cancel(force=True)``).

On a real cluster the workers must import nbkit and the code of your source. Either install them on
every node (the image), or let Ray ship them::

    import nbkit
    engine = RayEngine("auto", runtime_env={"py_modules": [nbkit, my_data_module], "pip": ["gcsfs"]})

(``{"pip": ["nbkit-cache[gcs]"]}`` once published; ``working_dir`` ships a project directory).
A local instance shares this machine's environment, so nothing needs shipping.

Example (skipped by the doctest run: it starts a local Ray instance, ~15 s; tests/cluster/ runs it for real):
    >>> engine = RayEngine(num_workers=1)      # doctest: +SKIP
    >>> engine.submit(pow, 2, 10).result()     # doctest: +SKIP
    1024
    >>> engine.close()                         # doctest: +SKIP
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading

from ..extras import require
from ..text import quiet_loggers
from .engine import Engine, chain, not_picklable

__all__ = ["RayEngine", "worker_memory"]

FEATURE = "nbkit.cluster.RayEngine"


def _call(fn, *args, shared=None):
    """What every task runs: the call itself (one remote function for all calls, registered once),
    after loading the build's source once in this worker process (:meth:`RayEngine.share`):
    ``shared`` is ``(token, [ref])``, the reference nested in a list so that Ray passes it as it is,
    fetched only by a process that has not loaded that source yet."""
    if shared is not None:
        from .part import has_source, preload_source

        token, (ref,) = shared
        if not has_source(token):
            import ray

            preload_source(("pickled", token, ray.get(ref)))
    return fn(*args)


def _descendants() -> set:
    """The pids of this process's descendants (psutil comes with Ray)."""
    import psutil
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _reap_with_this_process(pids: list):
    """Start :mod:`nbkit.cluster.reaper` for ``pids``: it ends them once this process has ended. Ray's
    own reaper ends the instance's process group when its driver is killed, but not the agents the
    raylet starts in groups of their own (they outlive a SIGKILLed driver, stuck reporting to a dead
    GCS). In a session of its own: Ray's reaper signals the driver's process group."""
    import os
    import subprocess
    import sys

    from . import reaper

    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-I", reaper.__file__, str(os.getpid()), *map(str, pids)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def worker_memory(engine: "RayEngine") -> dict:
    """The resident memory in bytes of the processes of the local Ray instance ``engine`` started
    (its raylet, GCS, workers…), by process (``"name:pid"``), measured now: what it costs this
    machine. Empty for a cluster joined (its processes are on other machines).

    Example (skipped by the doctest run: it starts a local Ray instance):
        >>> engine = RayEngine(num_workers=1)                    # doctest: +SKIP
        >>> sum(worker_memory(engine).values()) > 100_000_000    # doctest: +SKIP
        True
    """
    import psutil

    out = {}
    for pid in engine.pids:
        try:
            p = psutil.Process(pid)
            out[f"{p.name()}:{pid}"] = p.memory_info().rss
        except psutil.Error:  # ended meanwhile
            continue
    return out


class RayEngine(Engine):
    """An :class:`~nbkit.cluster.engine.Engine` over Ray tasks.

    Args:
        address: ``None`` starts a local instance (or uses the one this process already joined);
            ``"auto"`` joins the cluster this machine belongs to; ``"ray://host:10001"`` a remote one.
        num_workers: CPUs of the local instance started, and calls run at once (default: every CPU
            of the cluster).
        max_retries: how many times a call whose worker died is run again.
        runtime_env: Ray's ``runtime_env`` for the workers (what ships nbkit and your code to a cluster).
        init_options: more keyword arguments for ``ray.init``.
    """

    name = "ray"

    def __init__(self, address: str | None = None, *, num_workers: int | None = None, max_retries: int = 3,
                 runtime_env: dict | None = None, init_options: dict | None = None):
        ray = require("ray", extra="ray", feature=FEATURE)
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ValueError(f"num_workers must be a positive int, not {num_workers!r}")
        self._ray = ray
        self._reaper = None  # the process that ends a local instance's processes if this one is killed
        self.started = False  # True: close() shuts down the Ray connection this engine made
        self.pids: list = []  # the processes of the local instance this engine started (none for a cluster joined)
        if not ray.is_initialized():
            options = dict(init_options or {})
            options.setdefault("include_dashboard", False)
            options.setdefault("dashboard_host", "127.0.0.1")  # a dashboard asked for serves this machine only
            options.setdefault("log_to_driver", False)
            if runtime_env is not None:
                options["runtime_env"] = runtime_env
            if address is None:
                options["num_cpus"] = num_workers  # a local instance of exactly these CPUs
            else:
                options["address"] = address
            # Ray's start-up lines ("Started a local Ray instance", token authentication's advice) are
            # not this build's news: quiet during the start only (its errors still show).
            options.setdefault("logging_level", logging.ERROR)
            before = _descendants()
            try:
                with quiet_loggers("ray"):
                    ray.init(**options)
            except ConnectionError as e:
                raise ConnectionError(f"RayEngine could not join the Ray cluster at {address!r} ({e}). Start one "
                                      "(`ray start --head`), check the address, or pass address=None for a local instance.") from e
            self.started = True
            if address is None:  # a local instance of ours: it ends with this process, even a kill -9 of it
                self.pids = sorted(_descendants() - before)
                self._reaper = _reap_with_this_process(self.pids)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.workers = num_workers or max(1, cpus)
        self._task = ray.remote(_call).options(max_retries=max_retries, retry_exceptions=False, num_cpus=1)
        self._refs: dict = {}  # our future -> its ObjectRef, until it completes
        self._lock = threading.Lock()
        self._shared = None  # (token, [ObjectRef]) of the source share() put in the object store

    def share(self, source: tuple) -> bool:
        """The build's pickled source goes into Ray's object store once; each worker process fetches
        and unpickles it on its first call after this (Ray has no hook at a worker's start), and the
        parts carry only its token (a 47 MB torchvision MNIST went with every part before)."""
        if self._ray is None or source[0] != "pickled":
            return False
        self._shared = (source[1], [self._ray.put(source[2])])  # held here: the object lives while the engine shares it
        return True

    def submit(self, fn, *args) -> concurrent.futures.Future:
        if self._ray is None:
            raise RuntimeError("this RayEngine is closed: make a new one")
        try:
            ref = self._task.remote(fn, *args, shared=self._shared)
        except TypeError as e:  # Ray's "Could not serialize the argument ..." (and cloudpickle's own)
            raise not_picklable(fn, args, "Ray", e) from e
        fut = chain(ref.future())
        with self._lock:
            self._refs[fut] = ref
        fut.add_done_callback(self._forget)
        return fut

    def _forget(self, fut):
        with self._lock:
            self._refs.pop(fut, None)

    def cancel(self, futures) -> None:
        """Cancel queued calls and kill running ones (their worker process is killed; never retried)."""
        for fut in futures:
            with self._lock:
                ref = self._refs.get(fut)
            fut.cancel()  # first: Ray then completes its own future with TaskCancelledError, which ours ignores
            if ref is not None:
                try:
                    self._ray.cancel(ref, force=True)
                except (ValueError, TypeError, RuntimeError):  # already finished, or not a task of ours
                    pass

    def worker_lost(self, error: BaseException) -> bool:
        """Whether ``error`` says the call's worker or node was lost after its ``max_retries`` (the
        driver then submits the part again) rather than that the call itself failed."""
        import ray.exceptions as rex
        return isinstance(error, (rex.WorkerCrashedError, rex.NodeDiedError, rex.LocalRayletDiedError,
                                  rex.ObjectLostError, rex.OwnerDiedError))

    def close(self) -> None:
        if self._ray is None:
            return
        with quiet_loggers("ray"):  # the shutdown's own lines: closing is what was asked
            self.cancel(list(self._refs))
            if self.started:
                self._ray.shutdown()  # a local instance stops; a joined cluster is only disconnected from
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
        self._ray = self._reaper = self._shared = None
