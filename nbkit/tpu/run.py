"""Run a cached dataset on every TPU process of a host: :func:`spawn` starts ``fn(index, *args)``
once per device; inside it, :func:`warmup_shared` fills one shared cache (each process computing
only its shard) and :func:`device_loader` feeds the process's device from its own sampler shard.
torch_xla is imported when one of these is called, never before.

Example:
    >>> from nbkit.tpu.run import spawn
    >>> spawn(print, nprocs=3)
    Traceback (most recent call last):
    ...
    ValueError: nprocs=3: torch_xla runs one replica per device, so nprocs must be None (all devices of the host) or 1; to use fewer devices set TPU_PROCESS_BOUNDS/TPU_VISIBLE_CHIPS on a TPU, or CPU_NUM_DEVICES with PJRT_DEVICE=CPU
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import time
from typing import Callable, Optional

import torch

from nbkit.extras import require

from .runtime import describe, pip_display, xla_requirements

__all__ = ["spawn", "warmup_shared", "device_loader"]


def _require_xla():
    """Import torch_xla and the parts nbkit uses, or raise an ImportError that names the pip command."""
    feature = (f"nbkit.tpu (torch_xla matching torch {torch.__version__}: "
               f"{pip_display(xla_requirements(torch.__version__, True))}; without a TPU, drop [tpu])")
    modules = ("torch_xla", "torch_xla.core.xla_model", "torch_xla.runtime",
               "torch_xla.distributed.xla_multiprocessing", "torch_xla.distributed.parallel_loader")
    return tuple(require(m, extra="tpu", feature=feature) for m in modules)


def _default_start_method() -> str:
    # fork lets a function defined in a notebook (module __main__, no file to re-import) reach the
    # children, and is safe as long as this process has not started the XLA runtime (checked).
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def spawn(fn: Callable, args: tuple = (), *, nprocs: Optional[int] = None, start_method: Optional[str] = None) -> None:
    """Run ``fn(index, *args)`` once per TPU device of this host, each in its own replica.

    Wraps ``torch_xla.distributed.xla_multiprocessing.spawn``. The default start method is
    ``fork`` (where the platform has it), so a function defined in a notebook works; the XLA
    runtime must not be started in this process before (call :func:`setup`, which verifies in a
    subprocess, instead of touching the device here).

    On a TPU each chip gets its own process. With ``PJRT_DEVICE=CPU`` torch_xla runs the
    ``CPU_NUM_DEVICES`` replicas as threads of one process, and XLA:CPU has no collectives
    (pytorch/xla#5005): there, step each replica with ``optimizer.step()``, not
    ``xm.optimizer_step`` or ``xm.all_reduce``, unless ``CPU_NUM_DEVICES`` is 1.

    Args:
        fn: a function defined with ``def`` at the top level of a module or notebook.
        args: extra arguments, after the process index. They are pickled.
        nprocs: ``None`` for every device of the host, or ``1`` to run in this process.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; default as above.

    Example:
        >>> def train(index, ds):
        ...     warmup_shared(ds)
        ...     for x, y in device_loader(ds, batch_size=64):
        ...         ...
        >>> spawn(train, args=(ds,))  # doctest: +SKIP
    """
    if nprocs not in (None, 1):
        raise ValueError(
            f"nprocs={nprocs!r}: torch_xla runs one replica per device, so nprocs must be None (all devices "
            "of the host) or 1; to use fewer devices set TPU_PROCESS_BOUNDS/TPU_VISIBLE_CHIPS on a TPU, "
            "or CPU_NUM_DEVICES with PJRT_DEVICE=CPU"
        )
    method = start_method or _default_start_method()
    if method != "fork" and getattr(fn, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ValueError(
            f"{getattr(fn, '__qualname__', fn)!r} is defined in a notebook, which start_method={method!r} cannot "
            "re-import in a new process; use start_method='fork' (the default on Linux) or move the function "
            "into a .py module and import it"
        )
    try:
        pickle.dumps((fn, args))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"spawn() sends fn and args to each process by pickling, and this failed: {e}. Define fn with "
            "'def' at the top level of the notebook or a module (not a lambda or a nested function), and pass "
            "objects that pickle (a CachedDataset does)"
        ) from e

    torch_xla, xm, xr, xmp, pl = _require_xla()
    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise RuntimeError(
            "the XLA runtime is already initialised in this process (something used the XLA device, e.g. "
            "torch_xla.device() or tensor.to(device)), so torch_xla cannot start one process per device. "
            "Restart the runtime and call nbkit.tpu.spawn before touching the device in the notebook; "
            "nbkit.tpu.setup() checks the device in a subprocess and is safe to call first"
        )
    if not os.environ.get("PJRT_DEVICE"):
        os.environ["PJRT_DEVICE"] = "TPU" if describe().is_tpu else "CPU"
    return xmp.spawn(fn, args=args, nprocs=nprocs, start_method=method)


def _local_shard() -> tuple:
    """(this replica's index, number of replicas) on this host, from the torch_xla runtime."""
    _, _, xr, _, _ = _require_xla()
    # The cache is a directory on this host, so its warmup is split among this host's replicas.
    return xr.local_ordinal(), xr.local_device_count()


def warmup_shared(ds, *, callback=None, stall_timeout: float = 600.0, poll_interval: float = 0.05):
    """Fill a cache shared by all replicas of this host, each computing only its shard.

    Call it inside the function given to :func:`spawn`. Replica ``r`` of ``w`` warms the indices
    ``i % w == r`` (``ds.warmup(shard=(r, w))``), so no sample is computed twice, then waits until
    the whole cache is stored. The barrier is the cache itself, not an XLA collective: XLA:CPU has
    no collectives, and a peer that stops making progress is reported instead of waited on forever.

    The cache is a directory on this host, so the shards are split among this host's replicas
    (``xr.local_ordinal()`` of ``xr.local_device_count()``); on one host that is the whole world.

    Args:
        ds: an :class:`nbkit.CachedDataset` (with its source).
        callback: progress for this replica's shard (see :mod:`nbkit.progress`).
        stall_timeout: seconds without any newly stored sample after which waiting fails.
        poll_interval: first delay between checks of the other replicas' progress.

    Returns:
        This replica's ``WarmupReport``.

    Raises:
        TimeoutError: other replicas stopped storing samples for ``stall_timeout`` seconds.

    Example:
        >>> def train(index, ds):
        ...     warmup_shared(ds)        # afterwards, every sample is cached
        >>> spawn(train, args=(ds,))     # doctest: +SKIP
    """
    rank, world = _local_shard()
    report = ds.warmup(shard=(rank, world), callback=callback)
    if getattr(report, "stopped", False):
        return report
    _wait_until_complete(ds, stall_timeout, poll_interval, f"replica {rank} of {world}")
    return report


def _wait_until_complete(ds, stall_timeout: float, poll_interval: float, who: str) -> None:
    left = len(ds.missing())
    last_progress = time.monotonic()
    delay = poll_interval
    while left:
        time.sleep(delay)
        now_left = len(ds.missing())
        if now_left < left:
            left, last_progress, delay = now_left, time.monotonic(), poll_interval
        elif time.monotonic() - last_progress > stall_timeout:
            raise TimeoutError(
                f"{who}: {left} samples of {ds.path} are still missing and no replica stored one for "
                f"{stall_timeout:.0f}s; another replica probably failed or was stopped (see its traceback). "
                "Run warmup_shared again to resume"
            )
        else:
            delay = min(delay * 1.5, 1.0)


def device_loader(ds, *, batch_size: int, shuffle: bool = True, drop_last: bool = True, num_workers: int = 0, **kw):
    """Batches of this replica's shard of ``ds``, already on its XLA device: a
    :class:`nbkit.DeviceLoader` with the replica's device, rank and world size from the torch_xla
    runtime.

    Every replica gets the same number of batches, and each pass over the loader is a new shuffle
    (the same on every host for the same ``seed``); ``loader.set_epoch(e)`` picks one.

    Args:
        ds: the dataset, usually an :class:`nbkit.CachedDataset`.
        batch_size: samples per batch on each replica.
        shuffle: shuffle (differently each epoch).
        drop_last: drop the last incomplete batch (keeps shapes static, so XLA compiles once).
        num_workers: ignored (kept for old calls): the loader gathers in threads of this process.
        **kw: more :class:`nbkit.DeviceLoader` arguments (``seed``, ``prefetch``, ``batch_transform`` …).

    Example:
        >>> def train(index, ds):
        ...     for images, labels in device_loader(ds, batch_size=128):
        ...         ...
        >>> spawn(train, args=(ds,))  # doctest: +SKIP
    """
    torch_xla, xm, xr, xmp, pl = _require_xla()
    from nbkit.loader import DeviceLoader

    return DeviceLoader(ds, batch_size, shuffle=shuffle, drop_last=drop_last, device=torch_xla.device(),
                        rank=xr.global_ordinal(), world_size=xr.world_size(), **kw)
