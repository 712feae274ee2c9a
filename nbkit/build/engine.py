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

__all__ = ["Engine", "ExecutorEngine"]


class Engine:
    """Runs part builds. Subclasses define :meth:`submit`; the rest have defaults.

    Attributes:
        name: what the progress panel and errors call it (``"local processes"``, ``"ray"``).
        workers: how many calls may run at once (the driver keeps about this many submitted).
    """

    name = "engine"
    workers = 1

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run ``fn(*args)`` on a worker; ``fn`` and ``args`` pickle (module-level functions, plain data)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement Engine.submit(), which every engine must define")

    def cancel(self, futures) -> None:
        """Stop the calls of ``futures`` that have not finished (a Stop, a failure): best effort; a call
        already running may finish, and its part is then kept or ignored like any other copy."""
        for f in futures:
            f.cancel()

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
