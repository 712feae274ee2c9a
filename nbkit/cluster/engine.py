"""The contract of a build engine: what runs part builds, on this machine or on a cluster.

An engine takes picklable calls (``engine.submit(fn, *args)``) and returns a
:class:`concurrent.futures.Future` for each, so the driver waits on them all the same way, whatever
runs them: :class:`concurrent.futures.Executor`-like pools (local processes, Dask's ``Client``) and
Ray's tasks. The driver keeps the plan and the merge; an engine only runs calls, may run one twice
(a retry after a lost worker), and may lose one (``Future.exception()`` says so).

Example:
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> engine = ExecutorEngine(ThreadPoolExecutor(2), workers=2, name="threads")
    >>> engine.submit(pow, 2, 10).result()
    1024
    >>> engine.close()
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["Engine", "ExecutorEngine", "ENGINES", "engine_for", "not_picklable", "chain", "watch_driver"]


class Engine:
    """Runs part builds. Subclasses define :meth:`submit`; the rest have defaults.

    Attributes:
        name: what the progress panel and errors call it (``"local processes"``, ``"ray"``).
        workers: how many calls may run at once (the driver keeps twice this many submitted: one
            running and one queued a worker, :data:`nbkit.cluster.driver.AHEAD`).
        inherits: its worker processes are forked from this process after :meth:`share` (a local
            engine with ``fork``): a source shared as ``("object", token, dataset)`` reaches them
            with the fork, never pickled (a source that does not pickle works too).
    """

    name = "engine"
    workers = 1
    inherits = False

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on a worker; ``fn`` and ``args`` pickle (module-level functions, plain data)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement Engine.submit(), which every engine must define")

    def cancel(self, futures) -> None:
        """Stop the calls of ``futures`` that have not finished (a Stop, a failure): best effort; a call
        already running may finish, and its part is then kept or ignored like any other copy."""
        for f in futures:
            f.cancel()

    def share(self, source: tuple) -> bool:
        """Give every worker process ``source`` (the build's ``(kind, token, payload)``, what
        :func:`nbkit.cluster.part.build_part` reads from a part's spec) once, at its start or its
        first call, instead of with every part; return whether it will (then the parts carry only
        the token). Default: ``False``, every part carries the source. A local engine whose
        processes are already running returns ``False`` too.

        Example:
            >>> from nbkit.cluster.local import LocalEngine
            >>> with LocalEngine(1) as engine:
            ...     engine.share(("pickled", "token", b"..."))   # its processes start with it
            True
        """
        return False

    def worker_lost(self, error: BaseException) -> bool:
        """Whether ``error`` (a future's exception) says the call's worker was lost (killed, out of
        memory, its machine gone) rather than that the call itself failed: the driver then submits
        the part again instead of raising. Default: a broken executor (a pool whose process died)."""
        return isinstance(error, concurrent.futures.BrokenExecutor)

    def close(self) -> None:
        """Release what the engine started (its processes, its cluster connection). Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ExecutorEngine(Engine):
    """An engine over any :class:`concurrent.futures.Executor` (or an object with its ``submit``
    returning futures, such as ``dask.distributed.Client``)."""

    def __init__(self, executor, *, workers: int, name: str = "executor", owned: bool = True):
        self.executor, self.workers, self.name, self.owned = executor, int(workers), name, owned

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self.executor.submit(fn, *args)

    def close(self) -> None:
        if self.owned and self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        self.executor = None


# -- shared by the engines -------------------------------------------------------------------------


def not_picklable(fn, args, engine: str, exc: BaseException) -> TypeError:
    """The error for a call ``engine`` could not send to a worker: says what did not pickle and shows
    the factory form (a module-level function that returns the dataset, called on the worker)."""
    what = getattr(fn, "__qualname__", type(fn).__name__)
    kinds = ", ".join(type(a).__name__ for a in args) or "no arguments"
    # The engines wrap pickle's own error ("cannot pickle '_thread.lock' object") in their own: say the root.
    root, seen = exc, set()
    while root.__cause__ or root.__context__:
        nxt = root.__cause__ or root.__context__
        if id(nxt) in seen:
            break
        seen.add(id(nxt))
        root = nxt
    reason = (str(root).strip().splitlines() or [repr(root)])[0][:200]
    return TypeError(
        f"{engine} could not send the call {what}({kinds}) to a worker: it does not pickle "
        f"({type(root).__name__}: {reason}).\n"
        "A source that holds an open file, a lock, a database connection or a generator cannot travel to "
        "another process. Give the build a factory instead: a module-level function that makes the source "
        "where it runs, e.g.\n"
        "    def make_source():            # in a module the workers can import\n"
        "        return MyDataset('/data/train')\n"
        "and pass make_source (not MyDataset(...)) as the source."
    )


def chain(source, *, value=None) -> concurrent.futures.Future:
    """A new :class:`concurrent.futures.Future` completed from ``source`` (any future with
    ``add_done_callback``): ``value(source)`` gives its result (default ``source.result()``), an
    exception becomes the new future's, and nothing is set twice (a cancel may come first)."""
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(src):
        if out.done():
            return
        try:
            result = value(src) if value is not None else src.result()
        except concurrent.futures.CancelledError:
            out.cancel()
            return
        except BaseException as e:  # noqa: BLE001 - any failure of the call belongs to its future
            try:
                out.set_exception(e)
            except concurrent.futures.InvalidStateError:
                pass  # cancelled meanwhile
            return
        try:
            out.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass

    source.add_done_callback(done)
    return out


#: The exit status of a worker process that ended because its driver died (:func:`watch_driver`).
DRIVER_GONE_EXIT = 75
_watched: set = set()  # the driver pids this process watches already (a second call adds no thread)


def watch_driver(driver_pid: int) -> None:
    """End this process within seconds of the death of the process ``driver_pid`` (a ``kill -9`` of the
    driver, a notebook's kernel restart), which would otherwise leave it idle for good, holding its
    memory. Called at the start of every worker process of the local pool; a no-op in the driver.

    A daemon thread waits for the driver (:func:`nbkit.cluster.reaper.wait_for_exit`: a pidfd, else
    a poll), then ends the process. It watches the driver's own pid, not the parent's, so it holds
    under ``fork``, ``spawn`` and ``forkserver`` (whose workers are the fork server's children).
    ``PR_SET_PDEATHSIG`` is not used: it fires when the *thread* that started the process ends (a
    build run from a background thread), and names the fork server under ``forkserver``.

    Example:
        >>> watch_driver(os.getpid())   # the driver itself: nothing to watch
    """
    if driver_pid == os.getpid() or driver_pid in _watched:
        return
    _watched.add(driver_pid)
    from .reaper import wait_for_exit

    def watch():
        wait_for_exit(driver_pid)
        os._exit(DRIVER_GONE_EXIT)  # the driver is gone: nothing would ever collect this process's work

    threading.Thread(target=watch, name="nbkit-driver-watch", daemon=True).start()


# -- the table of engines: engine_for("ray") -----------------------------------------------------------


#: name -> ``"module:factory"`` of an :class:`Engine` made as ``factory(num_workers=workers)``, imported
#: by name on first use (like the stores' registry: the optional engines load only when asked for).
#: A new engine is one entry here.
ENGINES = {
    "processes": "nbkit.cluster.local:processes",
    "ray": "nbkit.cluster.ray:RayEngine",
    "dask": "nbkit.cluster.dask:DaskEngine",
}


def _factory(name: str):
    import importlib
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_for(spec="processes", *, workers: int | None = None, address: str | None = None) -> Engine:
    """The :class:`Engine` for ``spec``: a name of :data:`ENGINES` (``"processes"``, ``"ray"``,
    ``"dask"``), an Engine (returned as is), or an executor (anything with ``submit`` returning futures:
    a ``ProcessPoolExecutor``, a ``dask.distributed.Client``), which stays the caller's to close.
    ``address``: the running cluster a named cluster engine joins (Ray's ``"ray://host:10001"`` or
    ``"auto"``, a Dask scheduler's ``"tcp://host:8786"``); without it, it starts a local one.

    Example:
        >>> from concurrent.futures import ThreadPoolExecutor
        >>> with ThreadPoolExecutor(2) as pool:
        ...     engine_for(pool, workers=2).submit(abs, -3).result()
        3
    """
    if isinstance(spec, Engine):
        return spec
    if isinstance(spec, str):
        if spec not in ENGINES:
            raise ValueError(f"unknown engine {spec!r}: use one of {', '.join(map(repr, ENGINES))}, an Engine, or an executor "
                             "(an object with submit(fn, *args) returning futures)")
        if address is None:
            return _factory(spec)(num_workers=workers)
        if spec == "processes":
            raise ValueError(f"the processes engine runs on this machine and joins no cluster (address={address!r}): "
                             "leave the address out, or name a cluster engine ('ray', 'dask')")
        return _factory(spec)(address, num_workers=workers)
    if type(spec).__module__.split(".")[0] == "distributed":  # a dask Client: its futures are not concurrent ones
        return _factory("dask")(spec)
    if callable(getattr(spec, "submit", None)):
        n = workers or getattr(spec, "_max_workers", None) or 1
        return ExecutorEngine(spec, workers=n, name=type(spec).__name__, owned=False)
    raise TypeError(f"engine must be a name ({', '.join(map(repr, ENGINES))}), an Engine or an executor, not {type(spec).__name__}")
