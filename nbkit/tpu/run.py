"""Run a cached dataset on every TPU process of a host: :func:`spawn` starts ``fn(index, *args)``
once per device (what each prints comes back as whole lines, prefixed with its index); inside it, :func:`warmup_shared` fills one shared cache (each process computing
only its shard; on a pod slice, every host's processes as the ranks of :func:`nbkit.cluster.run_ranks`) and :func:`device_loader` feeds the process's device from its own sampler shard.

Two stacks run them: TorchTPU (``torch_tpu``, where its ``"tpu"`` device is registered: processes
started by ``torch.multiprocessing`` after ``torch.tpu.distributed.set_tpu_launch_env``, joined in
a ``torch.distributed`` group on its ``"tpu_dist"`` backend; untested on real TPU hardware), else
torch_xla (``xmp.spawn``, XLA rendezvous). Neither is imported before one of these is called.

Example:
    >>> from nbkit.tpu.run import spawn
    >>> spawn(print, nprocs=0)
    Traceback (most recent call last):
    ...
    ValueError: spawn(nprocs=0): give None (one process per TPU chip of this host) or a number of processes >= 1
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import socket
import pickle
import shutil
import sys
import tempfile
import threading
import time
from typing import Callable, Optional

import torch

from nbkit.extras import require

from . import torchtpu
from .runtime import describe, past_xla, pip_display, xla_requirements

__all__ = ["spawn", "warmup_shared", "device_loader", "xla_ranks"]


def _require_xla(feature: str = "nbkit.tpu"):
    """Import torch_xla and the parts nbkit uses, or raise an error that names what is missing and the fix:
    with TorchTPU installed but no ``"tpu"`` device here, a RuntimeError saying so (never torch_xla's
    ImportError); else an ImportError that names the pip command."""
    version = torchtpu.version()
    if version and importlib.util.find_spec("torch_xla") is None:
        raise RuntimeError(
            f"{feature} runs one process per TPU chip on TorchTPU's 'tpu' device or on torch_xla, and has neither "
            f"here: {torchtpu.no_device_reason(version, describe().is_tpu, os.environ)}. For several processes "
            "without a TPU, start a torch.distributed job (gloo or nccl) and build with nbkit.cluster.run_ranks(ds)")
    install = (f"{pip_display(xla_requirements(torch.__version__, True))} (torch_xla matching torch "
               f"{torch.__version__}; without a TPU, drop [tpu])")
    if past_xla(torch.__version__):
        install += (", or TorchTPU on this torch (on a TPU): nbkit.tpu.setup(stack='torch_tpu', install=True) or "
                    + " && ".join(pip_display(c[4:]) for c in torchtpu.install_commands(torch.__version__)))
    modules = ("torch_xla", "torch_xla.core.xla_model", "torch_xla.runtime",
               "torch_xla.distributed.xla_multiprocessing", "torch_xla.distributed.parallel_loader")
    return tuple(require(m, extra="tpu", feature=feature, install=install) for m in modules)


def _default_start_method() -> str:
    # fork lets a function defined in a notebook (module __main__, no file to re-import) reach the
    # children, and is safe as long as this process has not started the XLA runtime (checked).
    return "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"


def spawn(fn: Callable, args: tuple = (), *, nprocs: Optional[int] = None, start_method: Optional[str] = None,
          lines: bool = True) -> None:
    """Run ``fn(index, *args)`` once per TPU device of this host, each in its own replica.

    On TorchTPU (its ``"tpu"`` device registered in this process): sets the launch environment
    (``torch.tpu.distributed.set_tpu_launch_env``), starts the processes with
    ``torch.multiprocessing``, and in each one joins a ``torch.distributed`` group on TorchTPU's
    ``"tpu_dist"`` backend before ``fn`` runs (rank ``NODE_RANK * nprocs + index`` on a pod slice);
    untested on real TPU hardware. Otherwise it wraps
    ``torch_xla.distributed.xla_multiprocessing.spawn``. The default start method is
    ``fork`` (where the platform has it), so a function defined in a notebook works; the XLA
    runtime must not be started in this process before (call :func:`setup`, which verifies in a
    subprocess, instead of touching the device here).

    What the replicas print reaches this process's ``sys.stdout`` / ``sys.stderr`` (the notebook
    cell) as whole lines, each prefixed with the replica's index: ``[1] loss 0.42``. Replicas run
    at the same time, so without this their ``print`` calls interleave mid-line.

    On a TPU each chip gets its own process. With ``PJRT_DEVICE=CPU`` torch_xla runs the
    ``CPU_NUM_DEVICES`` replicas as threads of one process, and XLA:CPU has no collectives
    (pytorch/xla#5005): there, step each replica with ``optimizer.step()``, not
    ``xm.optimizer_step`` or ``xm.all_reduce``, unless ``CPU_NUM_DEVICES`` is 1.

    Args:
        fn: a function defined with ``def`` at the top level of a module or notebook.
        args: extra arguments, after the process index. They are pickled.
        nprocs: ``None`` for every device of the host; on torch_xla also ``1`` (this process), on
            TorchTPU any number of processes up to the chips.
        start_method: ``"fork"``, ``"spawn"`` or ``"forkserver"``; default as above.
        lines: deliver the replicas' output as prefixed whole lines (``False``: leave their
            ``sys.stdout`` and ``sys.stderr`` alone, e.g. for ``\\r`` progress bars).

    Example:
        >>> def train(index, ds):
        ...     warmup_shared(ds)
        ...     for x, y in device_loader(ds, batch_size=64):
        ...         ...
        >>> spawn(train, args=(ds,))  # doctest: +SKIP
    """
    if nprocs is not None and (not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1):
        raise ValueError(f"spawn(nprocs={nprocs!r}): give None (one process per TPU chip of this host) or a number "
                         "of processes >= 1")
    _check_picklable(fn, args, start_method)
    if torchtpu.registered():
        return _spawn_torch_tpu(fn, args, nprocs, start_method or _default_start_method(), lines)
    if nprocs not in (None, 1):
        raise ValueError(
            f"nprocs={nprocs!r}: torch_xla runs one replica per device, so nprocs must be None (all devices "
            "of the host) or 1; to use fewer devices set TPU_PROCESS_BOUNDS/TPU_VISIBLE_CHIPS on a TPU, "
            "or CPU_NUM_DEVICES with PJRT_DEVICE=CPU"
        )
    torch_xla, xm, xr, xmp, pl = _require_xla("nbkit.tpu.spawn")
    if torch_xla._XLAC._xla_runtime_is_initialized():
        raise RuntimeError(
            "the XLA runtime is already initialised in this process (something used the XLA device, e.g. "
            "torch_xla.device() or tensor.to(device)), so torch_xla cannot start one process per device. "
            "Restart the runtime and call nbkit.tpu.spawn before touching the device in the notebook; "
            "nbkit.tpu.setup() checks the device in a subprocess and is safe to call first"
        )
    if not os.environ.get("PJRT_DEVICE"):
        os.environ["PJRT_DEVICE"] = "TPU" if describe().is_tpu else "CPU"
    method = start_method or _default_start_method()
    if not lines or not hasattr(os, "mkfifo"):
        return xmp.spawn(fn, args=args, nprocs=nprocs, start_method=method)
    relay = _LineRelay(sys.stdout, sys.stderr)
    try:
        return xmp.spawn(_Prefixed(fn, relay.path), args=args, nprocs=nprocs, start_method=method)
    finally:
        relay.close()


def _check_picklable(fn, args, start_method) -> None:
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


# --- TorchTPU: processes in a torch.distributed group ---------------------------------------------


class _Replica:
    """Where this process stands in a job :func:`spawn` started on a ``torch.distributed`` backend."""

    def __init__(self, rank: int, world: int, local_rank: int, local_world: int, device: torch.device):
        self.rank, self.world, self.local_rank, self.local_world, self.device = rank, world, local_rank, local_world, device


_REPLICA: Optional[_Replica] = None  # set in each process _DistReplica starts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _DistReplica:
    """Runs ``fn(index, *args)`` as rank ``node_rank * nprocs + index`` of a torch.distributed group."""

    def __init__(self, fn, backend: str, device_type: str, nprocs: int, nnodes: int, node_rank: int,
                 address: str, port: int, relay: Optional[str]):
        self.fn, self.backend, self.device_type = fn, backend, device_type
        self.nprocs, self.nnodes, self.node_rank, self.address, self.port, self.relay = nprocs, nnodes, node_rank, address, port, relay

    def __call__(self, index, *args):
        global _REPLICA
        import torch.distributed as dist

        if self.relay:
            _ReplicaOutput.enter(self.relay, index)
        rank, world = self.node_rank * self.nprocs + index, self.nnodes * self.nprocs
        try:
            dist.init_process_group(self.backend, init_method=f"tcp://{self.address}:{self.port}", rank=rank, world_size=world)
            _REPLICA = _Replica(rank, world, index, self.nprocs, torch.device(self.device_type))
            try:
                return self.fn(index, *args)
            finally:
                _REPLICA = None
                dist.destroy_process_group()
        finally:
            if self.relay:
                _ReplicaOutput.leave()


def _spawn_torch_tpu(fn, args, nprocs, method, lines):
    chips = describe().accelerator_count  # from the PCI bus: touches no TPU runtime in this process
    n = nprocs or chips or 1
    torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=n)  # what every process must agree on, set here
    return _spawn_dist(fn, args, n, method, lines, backend=torchtpu.BACKEND, device_type=torchtpu.DEVICE)


def _spawn_dist(fn, args, nprocs: int, method: str, lines: bool, *, backend: str, device_type: str):
    """Start ``nprocs`` processes of this host in one torch.distributed group on ``backend``; a pod
    slice's hosts from ``NNODES``/``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT`` (which TorchTPU's
    launch environment sets there), one host otherwise."""
    import torch.multiprocessing as tmp

    nnodes, node_rank = int(os.environ.get("NNODES", "1")), int(os.environ.get("NODE_RANK", "0"))
    address = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else _free_port()
    relay = _LineRelay(sys.stdout, sys.stderr) if lines and hasattr(os, "mkfifo") else None
    worker = _DistReplica(fn, backend, device_type, nprocs, nnodes, node_rank, address, port, relay and relay.path)
    try:
        tmp.start_processes(worker, args=args, nprocs=nprocs, start_method=method)
    finally:
        if relay:
            relay.close()


def _current_replica() -> Optional[_Replica]:
    """This process's place in a torch.distributed job on TorchTPU: started by :func:`spawn`, or by
    ``torchrun`` (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``) after ``init_process_group("tpu_dist")``."""
    if _REPLICA is not None:
        return _REPLICA
    import torch.distributed as dist

    if torchtpu.registered() and dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return _Replica(rank, world, local_rank, int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.device(torchtpu.DEVICE))
    if torchtpu.registered():
        raise RuntimeError("TorchTPU's 'tpu' device is here, but this process is in no job: call this inside the "
                           "function given to nbkit.tpu.spawn, or after torch.distributed.init_process_group('tpu_dist') "
                           "(torchrun sets rank and world)")
    return None


# --- the replicas' output, as whole lines ---------------------------------------------------------
# Replicas write records to a named pipe (a path pickles, so this works for every start method, and
# the replicas of a CPU run, which are threads of one process, as well): one os.write per record,
# each at most PIPE_BUF bytes, so records from different writers never mix. A thread of the calling
# process reads them and writes each line, prefixed, to the stream the caller had.

_RECORD_CHARS = 1000  # at most 4 UTF-8 bytes each: a record stays under PIPE_BUF (4096 on Linux)
_END = b"0\x1f\n"  # the record that ends the relay


class _LineRelay:
    """Reads the replicas' records from a named pipe and prints them as ``[index] line``."""

    def __init__(self, stdout, stderr):
        self._dir = tempfile.mkdtemp(prefix="nbkit-spawn-")
        self.path = os.path.join(self._dir, "lines")
        os.mkfifo(self.path, 0o600)
        # Read-write: opening never blocks, and the pipe never reports end-of-file between writers.
        self._fd = os.open(self.path, os.O_RDWR)
        self._streams = {b"1": stdout, b"2": stderr}
        self._thread = threading.Thread(target=self._pump, name="nbkit-spawn-lines", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self._fd, 65536)
            pending += chunk
            *records, pending = pending.split(b"\n")
            for record in records:
                if record + b"\n" == _END:
                    return
                self._print(record)

    def _print(self, record: bytes) -> None:
        head, _, text = record.partition(b"\x1f")
        stream = self._streams.get(head[:1], self._streams[b"1"])
        index = head[1:].decode()
        line = (f"[{index}] " if index else "") + text.decode("utf-8", "replace") + "\n"
        try:
            stream.write(line)
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream must not stop the replicas' writes
            pass

    def close(self) -> None:
        os.write(self._fd, _END)  # after every replica's records: they have all returned by now
        self._thread.join(timeout=30)
        os.close(self._fd)
        shutil.rmtree(self._dir, ignore_errors=True)


class _Prefixed:
    """Calls ``fn(index, *args)`` in a replica with its output going to the relay at ``path``."""

    def __init__(self, fn, path: str):
        self.fn, self.path = fn, path

    def __call__(self, index, *args, **kwargs):
        _ReplicaOutput.enter(self.path, index)
        try:
            return self.fn(index, *args, **kwargs)
        finally:
            _ReplicaOutput.leave()


class _ReplicaOutput:
    """``sys.stdout`` / ``sys.stderr`` of a process running replicas: whole lines, as records.

    Each thread's text is kept until its line is complete, then written as one record tagged with
    the stream and the index of the replica the thread runs (threads a replica starts itself carry
    no index unless the process runs one replica only)."""

    _lock = threading.Lock()
    _fd = None
    _saved = None
    _replicas: dict = {}  # thread id -> replica index
    _pending: dict = {}  # (stream, thread id) -> text without its newline yet

    def __init__(self, tag: bytes, original):
        self._tag, self._original = tag, original

    @classmethod
    def enter(cls, path: str, index) -> None:
        with cls._lock:
            if cls._fd is None:
                cls._fd = os.open(path, os.O_WRONLY)
                cls._saved = (sys.stdout, sys.stderr)
                sys.stdout, sys.stderr = cls(b"1", sys.stdout), cls(b"2", sys.stderr)
            cls._replicas[threading.get_ident()] = index

    @classmethod
    def leave(cls) -> None:
        me = threading.get_ident()
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, cls):
                stream._flush_thread(me)
        with cls._lock:
            cls._replicas.pop(me, None)
            if cls._replicas or cls._fd is None:
                return
            for stream in (sys.stdout, sys.stderr):  # threads the replicas left behind
                if isinstance(stream, cls):
                    for key in [k for k in cls._pending if k[0] == stream._tag]:
                        stream._emit(cls._pending.pop(key), None)
            sys.stdout, sys.stderr = cls._saved
            os.close(cls._fd)
            cls._fd = cls._saved = None

    def _index(self, thread):
        index = self._replicas.get(thread)
        if index is None and len(set(self._replicas.values())) == 1:
            index = next(iter(self._replicas.values()))
        return index

    def _emit(self, line: str, index) -> None:
        head = self._tag + ("" if index is None else str(index)).encode() + b"\x1f"
        for start in range(0, max(len(line), 1), _RECORD_CHARS):
            record = head + line[start:start + _RECORD_CHARS].encode("utf-8", "replace") + b"\n"
            fd = self._fd
            if fd is not None:
                os.write(fd, record)

    def write(self, text: str) -> int:
        me = threading.get_ident()
        key = (self._tag, me)
        with self._lock:
            parts = (self._pending.pop(key, "") + text).split("\n")
            if parts[-1]:
                self._pending[key] = parts[-1]
            index = self._index(me)
        for line in parts[:-1]:
            self._emit(line, index)
        return len(text)

    def _flush_thread(self, thread) -> None:
        with self._lock:
            rest = self._pending.pop((self._tag, thread), None)
            index = self._index(thread)
        if rest:
            self._emit(rest, index)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        pass  # a line is written when it is complete; a partial one when its replica returns

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"

    def __getattr__(self, name):  # fileno, errors, ...: those of the stream it replaced
        return getattr(self._original, name)


def _local_shard() -> tuple:
    """(this replica's index, number of replicas) on this host, from the torch_xla runtime."""
    _, _, xr, _, _ = _require_xla("nbkit.tpu.warmup_shared")
    # The cache is a directory on this host, so its warmup is split among this host's replicas.
    return xr.local_ordinal(), xr.local_device_count()


def _rendezvous(name: str) -> None:
    _, xm, _, _, _ = _require_xla()
    xm.rendezvous(name)


def xla_ranks():
    """This replica's place among every replica of the job, on every host: ``xr.global_ordinal()``
    of ``xr.world_size()``, with ``xm.rendezvous`` as the barrier (an :class:`nbkit.cluster.ranks.Ranks`).

    On a TPU pod slice the rendezvous is a collective over every chip of every host; it has no
    timeout of its own, so a host that died makes the others wait until the job is torn down.
    Untested on a real pod slice here (XLA:CPU has no collectives and runs one host).
    """
    from nbkit.cluster.ranks import Ranks

    _, _, xr, _, _ = _require_xla()
    return Ranks(int(xr.global_ordinal()), int(xr.world_size()), _rendezvous)


def warmup_shared(ds, *, callback=None, stall_timeout: float = 600.0, poll_interval: float = 0.05,
                  part_size: Optional[int] = None):
    """Fill a cache shared by all replicas of the job, each computing only its share.

    Call it inside the function given to :func:`spawn`, on every host of the job.

    **One host** (every replica of the job on this machine): replica ``r`` of ``w`` warms the
    indices ``i % w == r`` (``ds.warmup(shard=(r, w))``), so no sample is computed twice, then waits
    until the whole cache is stored. The barrier is the cache itself, not an XLA collective: XLA:CPU
    has no collectives, and a peer that stops making progress is reported instead of waited on forever.

    **Several hosts** (a TPU pod slice: ``xr.world_size()`` replicas, more than this host's): the
    cache must be on storage every host reaches, a ``gs://`` URL or a directory mounted at the same
    path on every host. Every replica is one rank of :func:`nbkit.cluster.run_ranks`: all plan the same
    parts at a rendezvous, replica ``g`` of ``n`` (global ordinals) builds the parts ``g::n``, replica 0
    merges them (or composes them server-side on ``gs://``), and after a last rendezvous every
    replica reads the complete cache. A host lost mid-build leaves its parts missing, and rerunning
    the job computes only those (see ``docs/tpu.md``, "A pod slice").

    Args:
        ds: an :class:`nbkit.CachedDataset` (with its source).
        callback: progress for this replica's share (see :mod:`nbkit.progress`).
        stall_timeout: one host: seconds without any newly stored sample after which waiting fails.
        poll_interval: one host: first delay between checks of the other replicas' progress.
        part_size: several hosts: samples per part (default
            :data:`nbkit.cluster.plan.DEFAULT_PART_SIZE`); a few parts per replica balance the work.

    Returns:
        One host: this replica's ``WarmupReport``. Several hosts: its
        :class:`nbkit.cluster.ranks.RanksReport`, whose ``dataset`` is the handle to read from (for a
        ``gs://`` cache, reopened on the pulled working copy).

    Raises:
        TimeoutError: one host: other replicas stopped storing samples for ``stall_timeout`` seconds.
        nbkit.cluster.ranks.RanksIncomplete: several hosts: the parts of some replicas are missing.

    Example:
        >>> def train(index, ds):
        ...     warmup_shared(ds)        # afterwards, every sample is cached
        >>> spawn(train, args=(ds,))     # doctest: +SKIP
    """
    replica = _current_replica()
    if replica is not None:
        from nbkit.cluster.ranks import torch_ranks

        rank, world = replica.local_rank, replica.local_world
        ranks = torch_ranks()  # the group the replica joined: its rank and world, dist.barrier()
    else:
        rank, world = _local_shard()
        ranks = xla_ranks()
    if ranks.world > world:  # replicas on more than one host
        from nbkit.cluster.plan import DEFAULT_PART_SIZE
        from nbkit.cluster.ranks import run_ranks

        return run_ranks(ds, rank=ranks.rank, world=ranks.world, barrier=ranks.barrier, callback=callback,
                         part_size=DEFAULT_PART_SIZE if part_size is None else part_size)
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
    """Batches of this replica's shard of ``ds``, already on its device: a :class:`nbkit.DeviceLoader`
    with the replica's device, rank and world size (TorchTPU: ``"tpu"`` and the torch.distributed
    group; else the torch_xla runtime's).

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
    from nbkit.loader import DeviceLoader

    replica = _current_replica()
    if replica is not None:
        device, rank, world_size = replica.device, replica.rank, replica.world
    else:
        _require_xla("nbkit.tpu.device_loader")  # or an error that names what is missing and the fix
        from nbkit import devices

        device = devices.resolve("xla")  # starts the runtime, which rank_world then reads
        rank, world_size = devices.rank_world()
    return DeviceLoader(ds, batch_size, shuffle=shuffle, drop_last=drop_last, device=device,
                        rank=rank, world_size=world_size, **kw)
