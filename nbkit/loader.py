"""``DeviceLoader``: batches on the accelerator before the training step asks for them.

A background thread walks this rank's shuffled indices; for each batch it gathers the rows of
every column straight from the memory-mapped cache into reused pinned host buffers (with several
threads when rows are large), starts the host-to-device copy on a side CUDA stream, and keeps
``prefetch`` batches ahead while the caller trains. The caller's stream waits on an event, so the
accelerator never waits for data that is already cached. On an XLA device the thread sends the
batch with torch_xla's own transfer, as ``MpDeviceLoader`` does; on the CPU batches are plain host
tensors, prepared ahead while the step runs.

Batches that cannot be gathered column-wise (samples not cached yet, free-form or variable-size
fields, a ``transform=``, a dataset that is not a ``CachedDataset``) are read through the
dataset's own batch path, so misses are computed and stored as with a ``DataLoader``.

Each pass's iterator counts in ``consumed`` (a :class:`nbkit.stats.Consumed`) the batches it has
handed out and their hits and misses, leaving out those the thread read ahead: a hit-rate meter
tracking the loader counts what the training loop trained on. An error in the thread (a sample
missing from a cache opened without its source, a failing source) is raised by the iteration.

``state_dict()`` / ``load_state_dict()`` (as ``torchdata``'s ``StatefulDataLoader``) save and
restore where the loop is, counting the batches the loop received, not those read ahead: a run
restarted from a checkpoint gets exactly the batches it had not trained on, then the next epochs.

Example:
    >>> import torch, tempfile, nbkit
    >>> src = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp())
    >>> loader = ds.loader(4, shuffle=False)            # device=None: host tensors
    >>> [y.tolist() for x, y in loader]
    [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
"""

from __future__ import annotations

import atexit
import queue
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch.utils.data import default_collate

from . import devices
from .collate import collate, collate_columns, column_tensor, iter_tensors, map_tensors
from .gather import auto_threads, pinned_rows
from .samplers import (MAX_RESUMES, EpochSampler, check_epoch, check_resume_state, dealt, dealt_batches,
                       epoch_sequence, unconsumed)
from .stores.base import store_of
from .trust import MAX_EPOCH, MAX_PREFETCH, MAX_SAMPLES, MAX_WORKERS, MAX_WORLD_SIZE, check_bool, check_int
from .stats import Consumed

__all__ = ["DeviceLoader"]

CHUNK_BYTES = 8 << 20  # batches smaller than this are gathered and copied several at a time
READ_AHEAD = 2  # groups of batches being read at once (their reads overlap: the disk never waits between them)

# DataLoader arguments people carry over, and what DeviceLoader does instead.
_DATALOADER_ARGS = {
    "num_workers": "it gathers in threads of this process (threads=); misses are computed there too",
    "pin_memory": "it always copies through pinned buffers to a CUDA device",
    "collate_fn": "batches come in nbkit.collate's structure; use batch_transform= for work on the device batch",
    "sampler": "it shuffles and shards itself (shuffle=, seed=, rank=, world_size=, set_epoch())",
    "batch_sampler": "it batches itself (batch_size=, drop_last=)",
    "persistent_workers": "it has no worker processes",
    "prefetch_factor": "use prefetch= (batches kept ready on the device)",
    "worker_init_fn": "it has no worker processes",
    "generator": "use seed= (the shuffle depends only on seed and epoch)",
}


class DeviceLoader:
    """Iterate a dataset in batches already on ``device``, prepared in the background.

    Args:
        dataset: a :class:`nbkit.CachedDataset` (fast path), or any map-style dataset.
        batch_size: samples per batch (on this rank).
        shuffle: reshuffle every epoch, from ``seed`` and the epoch number only.
        drop_last: drop the samples that do not divide evenly over the ranks and the last
            incomplete batch (static shapes, e.g. for XLA); otherwise the rank split is padded by
            repeating samples, as ``DistributedSampler`` does, and the last batch may be smaller.
        device: ``"cuda"``, ``"xla"``, ``"auto"``, a ``torch.device``, or ``None``/``"cpu"`` for host
            tensors (resolved by :func:`nbkit.devices.resolve`).
        seed: the shuffle seed: the same seed and epoch give the same order on every host.
        rank, world_size: this process's shard (default: ``torch.distributed`` when initialised,
            else the torch_xla runtime when running under it, else the whole dataset).
        threads: threads gathering one batch (default: from the CPU count and the batch's bytes).
        prefetch: batches kept ready ahead of the training step.
        batch_transform: called on each batch once it is on the device, e.g. to normalise a
            uint8 batch there (cache ``PILToTensor`` output: 4x less to read and copy).

    Resume after a restart with :meth:`state_dict` (save it with your model's checkpoint) and
    :meth:`load_state_dict`: the next pass yields the batches of the saved epoch the loop had not
    received, then passes go on to the next epochs as they would have.

    Example:
        >>> import torch, tempfile, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tempfile.mkdtemp())
        >>> loader = nbkit.DeviceLoader(ds, 2, seed=1, rank=0, world_size=2)   # half of the 8 samples
        >>> len(loader), [tuple(b.shape) for (b,) in loader]
        (2, [(2,), (2,)])
    """

    #: Host batches that :meth:`place` sends elsewhere (JAX's devices) are gathered several at a time too.
    _place_in_chunks = False
    #: Whether every rank is always at the same batch (JaxLoader's processes make one global batch): then
    #: one rank's state is every rank's, on this topology too. A DeviceLoader refuses another rank's state
    #: on its own topology (each rank saves its own: a loop may leave its ranks at different steps).
    _lockstep = False

    def __init__(self, dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = False, device=None,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None, threads: int | None = None,
                 prefetch: int = 3, batch_transform=None, **dataloader_args):
        if dataloader_args:
            name = next(iter(dataloader_args))
            why = _DATALOADER_ARGS.get(name)
            if why is None:
                raise TypeError(f"DeviceLoader() got an unexpected keyword argument {name!r}")
            raise TypeError(f"DeviceLoader does not take {name}= (a DataLoader argument): {why}. "
                            "For a DataLoader with these settings, use torch.utils.data.DataLoader(ds, ...).")
        batch_size = check_int(batch_size, "DeviceLoader: batch_size", min=1, max=MAX_SAMPLES,
                               fix="a batch holds at most as many samples as a cache can (2**40)")
        prefetch = check_int(prefetch, "DeviceLoader: prefetch (batches kept ready)", min=1, max=MAX_PREFETCH,
                             fix="a few batches (the default is 3) keep the device busy")
        if threads is not None:
            threads = check_int(threads, "DeviceLoader: threads (None: automatic)", min=1, max=MAX_WORKERS,
                                fix="pass None to size it from the batch, or a few per core")
        shuffle, drop_last = check_bool(shuffle, "DeviceLoader: shuffle"), check_bool(drop_last, "DeviceLoader: drop_last")
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(f"DeviceLoader needs a map-style dataset (with __len__ and __getitem__), got {type(dataset).__name__}")
        if batch_transform is not None and not callable(batch_transform):
            raise TypeError(f"DeviceLoader: batch_transform must be callable, got {type(batch_transform).__name__}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.drop_last = bool(drop_last)
        self.device = None if device is None else devices.resolve(device, caller="DeviceLoader")
        if self.device is not None and self.device.type == "cpu":
            self.device = None  # host tensors
        self.sampler = EpochSampler(dataset, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size,
                                    drop_last=drop_last)
        self.prefetch = int(prefetch)
        self.batch_transform = batch_transform
        self._columnar = hasattr(dataset, "read_columns") and getattr(dataset, "transform", None) is None
        # Small rows on a GPU: gather and copy several batches at once (one read into reused pinned
        # buffers, one copy, then views), so the per-batch Python work that competes with the
        # training step for the GIL is amortised. Not on XLA (a slice at a new offset is a new
        # graph to compile), nor for host tensors (nothing to amortise a copy against); but for host
        # batches placed elsewhere (JaxLoader: one read, one jax.device_put of several batches).
        cuda = self.device is not None and self.device.type == "cuda"
        chunked = cuda or (self.device is None and self._place_in_chunks)
        self.chunk = int(max(1, min(16, CHUNK_BYTES // max(1, self._batch_bytes())))) if chunked and self._columnar else 1
        self.threads = threads if threads is not None else auto_threads(self._batch_bytes() * self.chunk)
        self.wait_seconds = 0.0  # time the last epoch's caller spent waiting for a batch
        self._resume = None  # (epoch, batches done, rest) the next pass of that epoch starts at, from load_state_dict
        self._progress = None  # [epoch, batches handed out, rest] of the latest pass, counted by its iterator
        self._pass_memo = None  # (epoch, rest, its sequence): _pass_sequence's last answer

    def _batch_bytes(self) -> int:
        if not self._columnar:
            return 0
        schema = self.dataset.schema
        return sum(schema.row_bytes(leaf) for leaf in schema.columns) * self.batch_size

    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use the shuffle of ``epoch`` (each iteration then moves to the next).

        After :meth:`load_state_dict`, setting the restored epoch keeps the restored position, so a
        ``for epoch in range(start, n): loader.set_epoch(epoch)`` loop resumes mid-epoch; any other
        epoch starts from its first batch.
        """
        epoch = check_epoch(epoch)  # before anything changes: a refused epoch keeps a restored position
        if self._resume is None or self._resume[0] != epoch:
            self._resume, self._progress = None, None
        self.sampler.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Where the training loop is: the epoch of the latest pass and how many of its batches the
        loop has received (batches read ahead do not count), with the settings a restore must match.
        Plain ints, bools and strs: ``torch.save`` it, ``torch.load(..., weights_only=True)`` reads it.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
            >>> loader = ds.loader(2, seed=3)
            >>> it = iter(loader); seen = [next(it)[0].tolist() for _ in range(2)]
            >>> state = loader.state_dict()
            >>> state["epoch"], state["position"]
            (0, 2)
            >>> again = ds.loader(2, seed=3); again.load_state_dict(state)
            >>> seen + [x.tolist() for (x,) in again] == [x.tolist() for x in ds.loader(2, seed=3).batches(0)]
            True
        """
        if self._progress is not None:
            epoch, position, rest = self._progress
        else:
            epoch, position, rest = self.sampler.epoch, 0, []
        state = {"kind": "nbkit.DeviceLoader", "version": 1, "epoch": epoch, "position": position, **self._settings()}
        if rest:  # an epoch resumed on another topology: what the ranks before had left of it (version 2)
            state.update(version=2, rest=[dict(level, positions=list(level["positions"])) for level in rest])
        return state

    def load_state_dict(self, state) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, perhaps read back from a file): the next
        pass yields the batches of its epoch that the loop had not received, in the same order; a
        state taken after an epoch's last batch continues with the next epoch.

        ``state`` may be one rank's state or a list of every rank's (the same checkpoint step), and
        may come from another number of processes or batch size (elastic resume): the next pass then
        holds the samples of the interrupted epoch that no rank had trained on, in the epoch's order,
        dealt over this world's ranks (some ranks' last batch shorter, or one batch fewer: every
        sample once); later epochs are this world's. One state stands for every rank at its position
        (ranks in lockstep: a data-parallel loop, a ``JaxLoader``'s global batch); give the list when
        ranks may have saved at different steps. The same topology's own state is the exact path.

        Raises:
            ValueError: the state is damaged (``CorruptCacheError``), or was made for another dataset
                length, rank (on the same topology), seed, shuffle, ``drop_last``, or another cache
                not built from the same source (:class:`~nbkit.errors.ResumeStateError`, naming the
                field). A cache rebuilt from the same source (same fingerprint) is accepted.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(6)), tempfile.mkdtemp())
            >>> state = {**ds.loader(2, shuffle=False).state_dict(), "position": 2}   # 2 batches trained
            >>> again = ds.loader(2, shuffle=False); again.load_state_dict(state)
            >>> [x.tolist() for (x,) in again]
            [[4, 5]]
            >>> two = [{**ds.loader(2, shuffle=False, rank=r, world_size=2).state_dict(), "position": 1} for r in (0, 1)]
            >>> one = ds.loader(3, shuffle=False); one.load_state_dict(two)   # 2 ranks of 2 -> 1 rank of 3
            >>> [x.tolist() for (x,) in one]
            [[4, 5]]
        """
        kind, ours = "nbkit.DeviceLoader", self._settings()
        same = {"rank": self.rank, "world_size": self.world_size, "batch_size": self.batch_size}
        if isinstance(state, (list, tuple)) and state:
            states = list(state)
            if not 1 <= len(states) <= MAX_WORLD_SIZE:
                raise ValueError(f"{kind}.load_state_dict: a list of states holds one state per rank of the checkpointed "
                                 f"run (1 to {MAX_WORLD_SIZE}), got {len(states)}")
        else:
            states = [state]
        # Compared only when plain ints: a hostile value (a tensor or array of several items) has no truth
        # value; the check below names it.
        plain = {k: v for k, v in same.items() if isinstance(state, dict) and type(state.get(k)) is int and state[k] == v}
        if (len(states) == 1 and {"world_size", "batch_size"} <= plain.keys()
                and ("rank" in plain or not self._lockstep)):
            # This topology's own state: the exact path (another rank's state is refused, naming the fix; a
            # JaxLoader's ranks are in lockstep: another rank's state is this rank's position, below).
            state = check_resume_state(state, kind, ours, self._batches_of)
            return self._resume_at(state["epoch"], state["position"], state.get("rest") or [])
        memo = {}
        first = check_resume_state(states[0], kind, ours, self._batches_of, elastic=True, memo=memo)
        if isinstance(state, (list, tuple)) and len(states) != first["world_size"]:  # before checking a million states
            raise ValueError(f"{kind}.load_state_dict: a list of states needs one state of each of the "
                             f"{first['world_size']} ranks of the checkpointed run, got {len(states)} states")
        states = [first] + [check_resume_state(s, kind, ours, self._batches_of, elastic=True, memo=memo)
                            for s in states[1:]]
        for s in states[1:]:
            for name in ("world_size", "batch_size", "epoch", "rest"):
                if s.get(name) != first.get(name):
                    raise ValueError(f"{kind}.load_state_dict: the states disagree on {name} ({first.get(name)!r} and "
                                     f"{s.get(name)!r}): give the states every rank saved at the same checkpoint")
        epoch, rest, world, batch = first["epoch"], first.get("rest") or [], first["world_size"], first["batch_size"]
        if isinstance(state, (list, tuple)):
            ranks = sorted(s["rank"] for s in states)
            if ranks != list(range(world)):
                raise ValueError(f"{kind}.load_state_dict: a list of states needs one state of each of the {world} ranks "
                                 f"of the checkpointed run (ranks 0 to {world - 1}), got ranks {ranks[:8]}")
            by_rank = {s["rank"]: s["position"] for s in states}
            if world == self.world_size and batch == self.batch_size:  # this topology: this rank's own state
                return self._resume_at(epoch, by_rank[self.rank], rest)
            positions = [by_rank[r] for r in range(world)]
        else:  # one state for all ranks (in lockstep): each at that position, or at its pass's end if shorter
            length = len(self._pass_sequence(epoch, rest)) if rest else None
            positions = [min(first["position"], self._batches_of(dict(first, rank=r)) if length is None else
                             dealt_batches(length, world, batch, r)) for r in range(world)]
            if world == self.world_size and batch == self.batch_size:  # another rank's, in lockstep (a JaxLoader's)
                return self._resume_at(epoch, positions[self.rank], rest)
        if any(positions):
            rest = rest + [{"world_size": world, "batch_size": batch, "positions": positions}]
        if len(rest) > MAX_RESUMES:
            raise ValueError(f"{kind}.load_state_dict: this epoch was resumed on another topology {MAX_RESUMES} times "
                             "already; finish it on the topology it has, or start the epoch over (set_epoch)")
        if rest and len(self) and not len(self._pass_sequence(epoch, rest)):
            # Nothing left of that epoch: as if this world finished it. Not when this world's epoch has no
            # batch (drop_last, a batch larger than a rank's share): its position 0 would read "not begun",
            # and a state saved now would train the epoch again elsewhere; the rest says it is done.
            return self._resume_at(epoch, len(self), [])
        return self._resume_at(epoch, 0, rest)

    def _batches_of(self, state: dict) -> int:
        """The batches of a (checked) state's rank in an epoch of its topology (a pass without ``rest``)."""
        s = self.sampler
        w, b = state["world_size"], state["batch_size"]
        per_rank = s.n // w if self.drop_last else -(-s.n // w)
        return per_rank // b if self.drop_last else -(-per_rank // b)

    def _pass_sequence(self, epoch: int, rest: list) -> np.ndarray:
        """The indices ``rest`` leaves of ``epoch``, in the epoch's order (see :func:`nbkit.samplers.unconsumed`).
        Kept for the ``rest`` last asked about (a load, then the pass it resumes, ask for the same one:
        a shuffle of the whole epoch each time otherwise); ``rest`` lists are never changed in place."""
        memo = self._pass_memo
        if memo is not None and memo[0] == epoch and memo[1] is rest:
            return memo[2]
        s = self.sampler
        seq = epoch_sequence(s.n, shuffle=s.shuffle, seed=s.seed, epoch=epoch, world_size=rest[0]["world_size"],
                             batch_size=rest[0]["batch_size"], drop_last=self.drop_last)
        for level in rest:
            seq = unconsumed(seq, level["world_size"], level["batch_size"], level["positions"])
        self._pass_memo = (epoch, rest, seq)
        return seq

    def _resume_at(self, epoch: int, position: int, rest: list) -> None:
        length = dealt_batches(len(self._pass_sequence(epoch, rest)), self.world_size, self.batch_size,
                               self.rank) if rest else len(self)
        # A finished epoch: the next pass is the next epoch (set_epoch(epoch) still gives its empty rest).
        # Checked before anything changes: a refused state (the last epoch there is, finished) leaves
        # the loader as it was.
        following = check_int(epoch + 1 if position == length else epoch, "the state's next epoch", min=0,
                              max=MAX_EPOCH, fix="the state is at the end of the last epoch nbkit counts: start over")
        self.sampler.set_epoch(following)
        self._resume, self._progress = (epoch, position, rest), [epoch, position, rest]

    def _settings(self) -> dict:
        s = self.sampler
        return {"length": s.n, "batch_size": self.batch_size, "drop_last": self.drop_last, "shuffle": s.shuffle,
                "seed": s.seed, "rank": s.rank, "world_size": s.world_size, "cache": s.cache, "content": s.content}

    def place(self, batch):
        """Where a host batch goes before it is handed out (``device=None`` only): called in the
        read-ahead thread on each collated batch, so the work overlaps the training step. Here it
        returns the batch as it is; a loader feeding another framework overrides it
        (:class:`nbkit.jax.JaxLoader` puts the batch on JAX's devices as ``jax.Array`` s).

        Example:
            >>> import torch, tempfile, nbkit
            >>> class Doubled(nbkit.DeviceLoader):
            ...     def place(self, batch):
            ...         return [x * 2 for x in batch]
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
            >>> [x.tolist() for (x,) in Doubled(ds, 2, shuffle=False)]
            [[0, 2], [4, 6]]
        """
        return batch

    def _place_batches(self, batches: list) -> list:
        """:meth:`place` of each of ``batches`` (host batches gathered in one read); a subclass may
        place them at once (:class:`nbkit.jax.JaxLoader`: one ``jax.device_put`` for all)."""
        return [self.place(batch) for batch in batches]

    @property
    def epoch(self) -> int:
        """The epoch the next iteration will use."""
        return self.sampler.epoch

    def batches(self, epoch: int | None = None) -> list:
        """This rank's index arrays, batch by batch, for ``epoch`` (default: the next one)."""
        idx = self.sampler.indices(epoch)
        cut = len(self) * self.batch_size
        return [idx[a:min(a + self.batch_size, cut)] for a in range(0, cut if self.drop_last else len(idx), self.batch_size)]

    def __iter__(self):
        epoch = self.sampler.epoch
        start, rest = 0, []
        if self._resume is not None:
            if self._resume[0] == epoch:
                start, rest = self._resume[1], self._resume[2]
            self._resume = None
        self.sampler.set_epoch(epoch + 1)
        self._progress = [epoch, start, rest]  # shared with the pass, which counts the batches it hands out
        if rest:  # the rest of an epoch begun on another topology
            batches = dealt(self._pass_sequence(epoch, rest), self.world_size, self.batch_size, self.rank)
        else:
            batches = self.batches(epoch)
        return _Epoch(self, batches[start:], self._progress)

    def __repr__(self) -> str:
        where = "host" if self.device is None else str(self.device)
        return (f"DeviceLoader({type(self.dataset).__name__}, batch_size={self.batch_size}, {len(self)} batches on {where}, "
                f"rank {self.rank}/{self.world_size}, threads={self.threads}, prefetch={self.prefetch})")


class _Failure:
    def __init__(self, error: BaseException, batch: int):
        self.error = error
        self.batch = batch


_DONE = object()

# The read-ahead threads still running. A process that exits inside a pass (a script's loop left at a
# `break`) stops them before the interpreter shuts down: a daemon thread caught there in native code
# (a jax.device_put, a CUDA copy) can abort the process.
_RUNNING: "weakref.WeakSet[_Pipeline]" = weakref.WeakSet()


@atexit.register
def _stop_running() -> None:
    for pipeline in list(_RUNNING):
        if pipeline.thread.is_alive():  # not in a forked child, which has the set but not the threads
            pipeline.close()


class _Pipeline:
    """The producer side of one epoch: a thread filling a bounded queue. Holds no reference to
    the iterator, so dropping the iterator (``break``) closes it."""

    def __init__(self, loader: DeviceLoader, batches: list):
        self.loader = loader
        self.batches = batches
        self.device = loader.device
        self.kind = None if self.device is None else self.device.type
        self.queue = queue.Queue(maxsize=max(loader.prefetch, loader.chunk))
        self.stop = threading.Event()
        self.slots = []
        self.slot_lock = threading.Lock()
        self.stream = None
        if self.kind == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)
        self.thread = threading.Thread(target=self._run, name="nbkit-device-loader", daemon=True)
        _RUNNING.add(self)
        self.thread.start()

    # -- producer ------------------------------------------------------------------------------

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        b = -1
        try:
            if self.kind == "cuda":
                torch.cuda.set_device(self.device)
            k = self.loader.chunk
            groups = [self.batches[first:first + k] for first in range(0, len(self.batches), k)]
            # READ_AHEAD groups are read at once, and this one is handed out while the next ones
            # are read: reads of a cache that is not in the page cache never drain between batches.
            cuda = {"initializer": torch.cuda.set_device, "initargs": (self.device,)} if self.kind == "cuda" else {}
            # Only a memory-mapped store is read from several threads at once (a read-through or Redis
            # store is read by this thread alone, as before).
            store = store_of(self.loader.dataset)
            mapped = store is not None and store.memory_mapped
            ahead = (ThreadPoolExecutor(max_workers=READ_AHEAD, thread_name_prefix="nbkit-read-ahead", **cuda)
                     if self.loader._columnar and mapped else None)
            try:
                pending = [self._read_soon(ahead, c, groups[c]) for c in range(min(READ_AHEAD, len(groups)))]
                for c, group in enumerate(groups):
                    b = c * k
                    read = pending.pop(0)
                    read = read.result() if read is not None else None
                    if c + READ_AHEAD < len(groups):
                        pending.append(self._read_soon(ahead, c + READ_AHEAD, groups[c + READ_AHEAD]))
                    for item in self._make(c, group, read):  # a generator: batches go out as they are made
                        if self.stop.is_set() or not self._put(item):
                            return
                        b += 1
            finally:
                if ahead is not None:
                    ahead.shutdown(wait=True, cancel_futures=True)
            self._put(_DONE)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread, which raises it
            self._put(_Failure(e, b))

    def _slot(self, c: int):
        """Pinned host buffers for chunk ``c`` (reused round-robin once their copy has finished)."""
        if self.kind != "cuda":
            return None
        n_slots = min(self.loader.prefetch + 1, 3) + READ_AHEAD - 1  # and those being read ahead
        with self.slot_lock:  # READ_AHEAD threads ask for slots at once
            while len(self.slots) < n_slots:
                schema = self.loader.dataset.schema
                rows = self.loader.batch_size * self.loader.chunk
                arrays, tensors = [], []
                for leaf in schema.columns:
                    dtype = schema.column_dtype(leaf)
                    if dtype.kind in "SU":  # strings stay on the host: no pinned path for this dataset
                        return None
                    buf, array = pinned_rows(rows, leaf.shape, dtype)
                    arrays.append(array)
                    tdtype = column_tensor(leaf, np.empty((0, *leaf.shape), dtype)).dtype
                    tensors.append(buf.view(tdtype).view(rows, *leaf.shape))
                self.slots.append({"arrays": arrays, "tensors": tensors, "event": None})
            slot = self.slots[c % n_slots]
        if slot["event"] is not None:
            slot["event"].synchronize()  # its previous chunk's copy must be done before we overwrite it
        return slot

    def _read_soon(self, ahead, c: int, group: list):
        """The read of group ``c``'s columns started on ``ahead`` (``None``: read in this thread by :meth:`_make`)."""
        return None if ahead is None else ahead.submit(self._read, c, group)

    def _read(self, c: int, group: list):
        """``(slot, columns or None)``: group ``c``'s rows gathered in one read (``None``: the batch
        cannot be served column-wise)."""
        idx = group[0] if len(group) == 1 else np.concatenate(group)
        slot = self._slot(c)
        return slot, self.loader.dataset.read_columns(idx, out=None if slot is None else slot["arrays"],
                                                      threads=self.loader.threads)

    def _make(self, c: int, group: list, read=None):
        """The queue items for a group of consecutive batches: gathered together in one read
        (``read``, from :meth:`_read`) and sent in one copy when they are all stored (small rows:
        per-batch overhead amortised), else batch by batch through the dataset's own batch path."""
        loader, ds = self.loader, self.loader.dataset
        if loader._columnar:
            slot, cols = read if read is not None else self._read(c, group)
            idx = group[0] if len(group) == 1 else np.concatenate(group)
            if cols is not None:
                n = len(idx)
                if slot is not None:
                    tensors = [t[:n] for t in slot["tensors"]]
                else:
                    tensors = [column_tensor(leaf, col) if col.dtype.kind not in "SU" else col
                               for leaf, col in zip(ds.schema.columns, cols)]
                moved, event = self._send(tensors)
                if slot is not None:
                    slot["event"] = event
                bounds = np.cumsum([0] + [len(part) for part in group]).tolist()
                batches = [collate_columns(ds.schema, [t[a:b] for t in moved], None, b - a)
                           for a, b in zip(bounds[:-1], bounds[1:])]
                if self.kind is None:  # host batches: the loader places them (nbkit.jax: on JAX's devices, at once)
                    batches = loader._place_batches(batches)
                for batch, part in zip(batches, group):
                    yield batch, event, (len(part), len(part), 0)  # read_columns served every sample from the cache
                return
        store = store_of(ds)
        is_stored = None if store is None else store.is_stored
        for idx in group:
            # What the batch will take from the cache, decided as the dataset's own read decides it.
            misses = int(np.count_nonzero(~is_stored(idx))) if is_stored is not None else None
            try:
                if hasattr(ds, "__getitems__"):
                    batch = collate(ds.__getitems__(idx.tolist()))
                else:
                    batch = default_collate([ds[int(i)] for i in idx])
            except RuntimeError as e:
                if "equal size" not in str(e) and "same size" not in str(e):
                    raise
                raise RuntimeError(
                    f"{type(loader).__name__}: the samples of a batch have fields of different shapes ({e}): "
                    "they cannot be stacked into one batch. Pad or crop them to one shape in the dataset's "
                    "transform, or batch them yourself: torch.utils.data.DataLoader(ds, batch_size, "
                    "collate_fn=pad_fn) with a collate_fn that pads (docs/migrating.md, ragged fields).") from e
            moved, event = self._send(batch) if self.kind is not None else (loader.place(batch), None)
            yield moved, event, (len(idx), None if misses is None else len(idx) - misses, misses)

    def _send(self, batch):
        """``(batch on the device, copy-done event or None)``."""
        if self.kind is None:
            return batch, None
        if self.kind == "cuda":
            with torch.cuda.stream(self.stream):
                moved = map_tensors(batch, lambda t: t.to(self.device, non_blocking=True))
                event = torch.cuda.Event()
                event.record(self.stream)
            return moved, event
        if self.kind == "xla":
            return devices.send(batch, self.device), None
        return map_tensors(batch, lambda t: t.to(self.device)), None

    # -- consumer ------------------------------------------------------------------------------

    def get(self):
        """The next ``(batch, (samples, hits, misses))``, or ``_DONE``; raises the producer's error."""
        item = self.queue.get()
        if item is _DONE:
            return _DONE
        if isinstance(item, _Failure):
            e = item.error
            if hasattr(e, "add_note"):
                e.add_note(f"(raised in nbkit's DeviceLoader thread while preparing batch {item.batch} of the epoch)")
            raise e
        batch, event, reads = item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in iter_tensors(batch):
                t.record_stream(current)  # allocated on the side stream, used on the caller's
        return batch, reads

    def close(self) -> None:
        _RUNNING.discard(self)
        self.stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout=60)
        if self.stream is not None:
            self.stream.synchronize()
        self.slots = []


class _Epoch:
    """One pass over the loader: yields device batches; ``close()`` (or dropping it) stops the
    background thread and frees its buffers. ``consumed`` counts the batches handed out so far,
    with their hits and misses, apart from those the thread has read ahead."""

    def __init__(self, loader: DeviceLoader, batches: list, progress: list):
        self._loader = loader
        self._progress = progress
        self.consumed = Consumed()
        self._remaining = len(batches)
        self._pipeline = _Pipeline(loader, batches) if batches else None
        self._xla = loader.device is not None and loader.device.type == "xla"
        loader.wait_seconds = 0.0

    def __iter__(self):
        return self

    def __len__(self) -> int:
        return self._remaining

    def __next__(self):
        if self._pipeline is None:
            raise StopIteration
        if self._xla:
            devices.step_done(self._loader.device)  # cut the graph of the step that used the previous batch (as MpDeviceLoader)
        t0 = time.perf_counter()
        try:
            got = self._pipeline.get()
        except BaseException:
            self.close()
            raise
        self._loader.wait_seconds += time.perf_counter() - t0
        if got is _DONE:
            self.close()
            raise StopIteration
        batch, reads = got
        if self._loader.batch_transform is not None:  # before counting: a batch it fails on was not received
            batch = self._loader.batch_transform(batch)
        self.consumed.add(*reads)
        self._remaining -= 1
        self._progress[1] += 1
        return batch

    def close(self) -> None:
        if self._pipeline is not None:
            self._pipeline.close()
            self._pipeline = None

    def __del__(self, _finalizing=sys.is_finalizing):
        # At interpreter exit (a pass left half-read in a script) module globals are already None:
        # nothing to close then: _stop_running stopped the read-ahead thread before the shutdown.
        if not _finalizing():
            self.close()
