"""Hit/miss counters shared by every process that reads one ``CachedDataset``.

DataLoader workers are separate processes; the hit-rate meter runs in the main one. Counters
therefore live in a small memory-mapped file (in ``/dev/shm`` when available) with one row per
process: a process only ever adds to its own row, so no lock is needed on the hot path, and a
snapshot sums the rows. Rows of processes that ended keep their counts. :class:`Stats` is one
snapshot; :class:`EpochCounter` turns successive snapshots into per-epoch :class:`EpochStats`
(what the hit-rate meter and the benchmark report).

Example:
    >>> from nbkit.stats import SharedCounters
    >>> c = SharedCounters.create()
    >>> c.add(hits=3, misses=1)
    >>> c.totals()["hits"], c.totals()["misses"]
    (3, 1)
"""

from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .extras import is_tensor
from .text import format_bytes

try:
    import fcntl
except ImportError:  # Windows: no POSIX record locks; a thread lock and per-process rows still apply
    fcntl = None

_add_lock = threading.Lock()


def _new_add_lock() -> None:
    global _add_lock
    _add_lock = threading.Lock()  # a child forked while another thread held it starts with it free


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_add_lock)

__all__ = ["Stats", "SharedCounters", "EpochStats", "EpochCounter", "HitRate", "Consumed", "batch_size_of"]

FIELDS = ("hits", "misses", "recomputed", "stored", "refused")
_SLOTS = 256
_WIDTH = 1 + len(FIELDS)  # column 0: owner pid


class HitRate:
    """``reads`` and ``hit_rate`` of anything with ``hits`` and ``misses``: the one hit-rate model of
    :class:`Stats` and :class:`EpochStats`. The hit rate is 0.0 before the first read; ``reads == 0``
    tells the two apart.

    Example:
        >>> EpochStats(epoch=1).hit_rate, EpochStats(epoch=1, hits=3, misses=1).hit_rate
        (0.0, 0.75)
    """

    @property
    def reads(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Fraction of reads served from the cache (0.0 before any read)."""
        return self.hits / self.reads if self.reads else 0.0


@dataclass(frozen=True)
class Stats(HitRate):
    """A snapshot of one cache's counters.

    Attributes:
        hits: reads served from the cache.
        misses: reads that computed the sample from the source (and stored it).
        recomputed: reads whose stored bytes failed their checksum and were recomputed.
        stored: samples written by warmup or by misses since the counters were reset.
        cached: samples present in the cache now.
        total: samples in the dataset.
        bytes: bytes of sample data stored (grows as the cache fills).
        disk_bytes: bytes the cache occupies on disk (its files are preallocated, so this is about
            the full size from the start).
        refused: samples the store declined to keep (a full Redis server); they were served from the source.
        capacity: samples the cache may hold (``total`` unless a byte budget, ``max_bytes``, limits it).
    """

    hits: int
    misses: int
    recomputed: int
    stored: int
    cached: int
    total: int
    bytes: int
    capacity: int | None = None
    disk_bytes: int | None = None
    refused: int = 0

    @property
    def complete(self) -> bool:
        """Every sample the cache may hold is stored."""
        return self.cached >= (self.total if self.capacity is None else self.capacity)

    @property
    def budgeted(self) -> bool:
        return self.capacity is not None and self.capacity < self.total

    def __str__(self) -> str:
        """One line; before the first read it says so rather than showing a 0.0% hit rate.

        Example:
            >>> print(Stats(hits=0, misses=0, recomputed=0, stored=8, cached=8, total=8, bytes=256))
            cached 8/8 (100.0%), no samples read yet, 256 B of sample data
            >>> print(Stats(hits=3, misses=1, recomputed=0, stored=1, cached=8, total=8, bytes=256))
            cached 8/8 (100.0%), hits 3, misses 1, hit rate 75.0%, 256 B of sample data
        """
        budget = f" (budget: {self.capacity} samples)" if self.budgeted else ""
        reads = (f"hits {self.hits}, misses {self.misses}, hit rate {100.0 * self.hit_rate:.1f}%" if self.reads
                 else "no samples read yet")
        return (f"cached {self.cached}/{self.total}{budget} ({100.0 * self.cached / max(self.total, 1):.1f}%), {reads}, "
                f"{format_bytes(self.bytes)} of sample data")


@dataclass
class EpochStats(HitRate):
    """One epoch of a training loop (or, with ``epoch=0``, several), as the hit-rate meter counts it.

    Its ``reads`` and ``hit_rate`` are those of :class:`Stats` (:class:`HitRate`: 0.0 before the first read).

    Attributes:
        epoch: 1 for the first epoch.
        hits: samples served from the cache.
        misses: samples computed from the source (and stored).
        seconds: wall time of the epoch so far.
        consumed: samples the training loop received, for an epoch counted by
            :meth:`EpochCounter.track`; ``None`` for an epoch counted from ``ds.stats`` alone.
        batches: batches the training loop received (tracked epochs).
        planned: batches in a full pass (``len(loader)``), when the loader knows it.
        cut_short: the pass ended before its last batch (``break``, ``steps=``, an error).
        read_ahead: samples the cache served in the pass that the loop never received (a loader's
            read-ahead, left over when the pass was cut short).

    Example:
        >>> e = EpochStats(epoch=2, hits=90, misses=10, seconds=0.5)
        >>> e.reads, e.hit_rate, e.rate, e.filling, e.samples
        (100, 0.9, 200.0, True, 100)
        >>> EpochStats(epoch=1).hit_rate
        0.0
    """

    epoch: int
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0
    consumed: int | None = None
    batches: int = 0
    planned: int | None = None
    cut_short: bool = False
    read_ahead: int = 0

    @property
    def samples(self) -> int:
        """Samples of the epoch: those the loop received when tracked, else the cache's reads."""
        return self.reads if self.consumed is None else self.consumed

    @property
    def rate(self) -> float:
        """Samples per second."""
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def filling(self) -> bool:
        """True when this epoch computed samples (typically the first), False when all were hits."""
        return self.misses > 0


@dataclass
class Consumed:
    """What a loader's iterator handed to its caller so far in one pass; ``hits`` and ``misses``
    are those of these samples, ``None`` when the loader cannot tell.

    An iterator with a ``consumed`` attribute (``iter(nbkit.DeviceLoader(...))``) lets
    :meth:`EpochCounter.track` count what the training loop received rather than what the loader
    read ahead.

    Example:
        >>> c = Consumed()
        >>> c.add(4, hits=3, misses=1); c.add(4, hits=4, misses=0)
        >>> c.batches, c.samples, c.hits, c.misses
        (2, 8, 7, 1)
    """

    batches: int = 0
    samples: int = 0
    hits: int | None = 0
    misses: int | None = 0

    def add(self, samples: int, hits: int | None = None, misses: int | None = None) -> None:
        """Count one batch of ``samples``, of which ``hits`` were served from the cache."""
        self.batches += 1
        self.samples += int(samples)
        if hits is None or misses is None or self.hits is None or self.misses is None:
            self.hits = self.misses = None
        else:
            self.hits += int(hits)
            self.misses += int(misses)


def batch_size_of(batch) -> int | None:
    """Samples in a collated batch: the first dimension of its first tensor or array (``None`` if it has none).

    Example:
        >>> import torch
        >>> batch_size_of((torch.zeros(5, 3), torch.arange(5))), batch_size_of({"x": [1, 2]})
        (5, None)
    """
    if isinstance(batch, np.ndarray) or is_tensor(batch):
        return int(batch.shape[0]) if batch.ndim else None
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = batch_size_of(v)
        if n is not None:
            return n
    return None


def _len_or_none(obj) -> int | None:
    try:
        return len(obj)
    except TypeError:  # an iterable without a length (a generator, an IterableDataset's loader)
        return None


def _describe(loader) -> str:
    """``loader``, its length, its dataset's length and batch size, as far as it has them."""
    parts = [f"len(loader) = {_len_or_none(loader)}"]
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        parts.append(f"len(dataset) = {_len_or_none(dataset)}")
    for name in ("batch_size", "drop_last"):
        if hasattr(loader, name):
            parts.append(f"{name} = {getattr(loader, name)!r}")
    return f"{loader!r} ({', '.join(parts)})"


class _Pass:
    """One tracked pass: what the loop received so far."""

    def __init__(self, planned: int | None):
        self.planned = planned
        self.consumed = Consumed()
        self.known_sizes = True  # every batch's size was known (else the epoch counts reads)


class EpochCounter:
    """Per-epoch accounting of one dataset's reads while a training loop runs.

    Two ways to count. :meth:`track` wraps a loader: each pass over it is one epoch, and the epoch
    counts the samples the loop received (``consumed``, ``batches``), with their hits and misses
    when the loader reports them per batch (:class:`nbkit.DeviceLoader`), so batches it read ahead
    and the loop never used are left out (``read_ahead``). A ``DataLoader`` cannot say which batch
    hit: its epoch takes its hits and misses from ``ds.stats`` over the pass, so on a pass cut
    short they include the batches its workers had read ahead (``num_workers * prefetch_factor``
    at most), shown as ``read_ahead``; ``samples`` is still what the loop received. Or count by
    hand: :meth:`count` brings the current epoch up to date from ``ds.stats``, :meth:`new_epoch`
    closes it. A ``ds.reset_stats()`` in between is noticed (the counters go down) and counting
    goes on from zero instead of showing negative reads.

    Args:
        ds: anything with a ``stats`` attribute (an :class:`nbkit.CachedDataset`).
        clock: a function returning seconds (default :func:`time.perf_counter`).

    Attributes:
        epochs: one :class:`EpochStats` per epoch; the last one is the current epoch.
        last: the latest :class:`Stats` snapshot read.

    Example:
        >>> import torch, tempfile, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(12, 2)), tempfile.mkdtemp())
        >>> counter = EpochCounter(ds)
        >>> for batch in counter.track(ds.loader(4), steps=4):   # 3 batches a pass
        ...     pass
        >>> [(e.epoch, e.samples, e.hits, e.misses, e.batches, e.cut_short) for e in counter.epochs]
        [(1, 12, 0, 12, 3, False), (2, 4, 4, 0, 1, True)]
    """

    def __init__(self, ds, *, clock=time.perf_counter):
        self.ds = ds
        self.clock = clock
        self.last = ds.stats
        self._counts = (int(self.last.hits), int(self.last.misses))
        self._epoch_base = self._counts
        self._start = self._epoch_start = self._time = clock()
        self._pass = None  # the tracked pass counting the current epoch, while it runs
        self._ended = False  # the current epoch was a tracked pass and is over: its counts are final
        self.epochs = [EpochStats(epoch=1)]

    @property
    def current(self) -> EpochStats:
        """The epoch being counted now (or the last one, once a tracked pass ended)."""
        return self.epochs[-1]

    @property
    def running(self) -> bool:
        """A tracked pass is under way."""
        return self._pass is not None

    def count(self) -> EpochStats:
        """Read ``ds.stats`` and update the current epoch; returns it."""
        self._time = self.clock()
        stats = self.last = self.ds.stats
        counts = (int(stats.hits), int(stats.misses))
        if counts[0] < self._epoch_base[0] or counts[1] < self._epoch_base[1]:
            self._epoch_base = (0, 0)  # someone called ds.reset_stats(): count on from zero
        self._counts = counts
        cur = self.current
        if self._ended:
            return cur
        hits, misses = counts[0] - self._epoch_base[0], counts[1] - self._epoch_base[1]
        p = self._pass
        if p is not None:
            c = p.consumed
            cur.batches = c.batches
            cur.consumed = c.samples if p.known_sizes else None
            if c.hits is not None:
                hits, misses = c.hits, c.misses
        cur.hits, cur.misses = hits, misses
        cur.seconds = self._time - self._epoch_start
        return cur

    def new_epoch(self) -> EpochStats | None:
        """Close the current epoch and start the next; returns the closed one.

        When the current epoch has read nothing yet it only restarts its clock (and returns
        ``None``), so calling it before the first epoch is harmless.
        """
        cur = self.count()
        self._epoch_start = self._time
        self._epoch_base = self._counts
        if cur.reads == 0 and cur.batches == 0:
            self.epochs[-1] = EpochStats(epoch=cur.epoch)
            self._ended = False
            return None
        self._ended = False
        self.epochs.append(EpochStats(epoch=cur.epoch + 1))
        return cur

    def overall(self) -> EpochStats:
        """Every epoch so far as one :class:`EpochStats` (``epoch=0``): their samples, hits and
        misses added up, and the seconds since the counter was created."""
        self.count()
        eps = self.epochs
        consumed = sum(e.samples for e in eps) if any(e.consumed is not None for e in eps) else None
        return EpochStats(epoch=0, hits=sum(e.hits for e in eps), misses=sum(e.misses for e in eps),
                          seconds=self._time - self._start, consumed=consumed,
                          batches=sum(e.batches for e in eps), read_ahead=sum(e.read_ahead for e in eps))

    # -- tracked passes ------------------------------------------------------------------------

    def track(self, loader, *, steps: int | None = None, on_batch=None, on_pass_end=None):
        """Yield the batches of ``loader``, one epoch per pass, counting what the loop receives.

        Args:
            loader: a ``DataLoader``, an :class:`nbkit.DeviceLoader`, or any re-iterable of batches.
            steps: ``None``: one pass. ``N``: as many passes as it takes to yield ``N`` batches
                (the last one cut short); a pass that yields nothing raises ``RuntimeError``.
            on_batch: called after each batch is counted, before it is yielded.
            on_pass_end: called when a pass has ended and its epoch is final.
        """
        if steps is not None and (not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or steps < 0):
            raise ValueError(f"track(steps=...) takes None (one pass) or a number of batches >= 0, got {steps!r}")
        done = 0
        passes = 0
        while steps is None or done < steps:
            passes += 1
            got, exhausted = 0, False
            planned = _len_or_none(loader)
            self.new_epoch()
            p = self._pass = _Pass(planned)
            self.current.planned = planned
            it = iter(loader)
            counted = isinstance(getattr(it, "consumed", None), Consumed)
            if counted:
                p.consumed = it.consumed  # the loader counts what it hands out; read-ahead left out
            # Items of a loader without batches (DataLoader(batch_size=None)) are single samples.
            single = hasattr(loader, "batch_size") and loader.batch_size is None
            try:
                while steps is None or done < steps:
                    try:
                        batch = next(it)
                    except StopIteration:
                        exhausted = True
                        break
                    got += 1
                    done += 1
                    if not counted:
                        n = 1 if single else batch_size_of(batch)
                        p.known_sizes = p.known_sizes and n is not None
                        p.consumed.add(n or 0)
                    if on_batch is not None:
                        on_batch()
                    yield batch
            finally:
                if it is not loader and hasattr(it, "close"):
                    it.close()  # stop the loader's read-ahead now, before the pass is counted
                del it
                self._end_pass(cut_short=not exhausted and (planned is None or got < planned))
                if on_pass_end is not None:
                    on_pass_end()
            if got == 0 and steps is not None:
                raise RuntimeError(
                    f"track(steps={steps}): pass {passes} over the loader yielded no batch after {done} of "
                    f"{steps} steps, so the steps can never be reached. Loader: {_describe(loader)}. Likely "
                    "causes: drop_last=True with a batch_size larger than the dataset (or than this rank's "
                    "share of it); an empty dataset or cache; an iterator that is used up after one pass "
                    "(pass the loader itself, not iter(loader) or a generator)."
                )
            if steps is None:
                return

    def _end_pass(self, cut_short: bool) -> None:
        cur = self.count()
        read = (self._counts[0] - self._epoch_base[0]) + (self._counts[1] - self._epoch_base[1])
        cur.read_ahead = max(0, read - cur.samples)
        cur.cut_short = cut_short
        self._pass = None
        self._ended = True


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


_swept: set = set()


def _sweep_dead(directory: str) -> None:
    """Once per process: remove the counter files of processes that died without removing theirs
    (a kernel killed mid-epoch), so they do not pile up in ``/dev/shm``."""
    if directory in _swept:
        return
    _swept.add(directory)
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        parts = name.split("-")
        if len(parts) == 4 and parts[:2] == ["nbkit", "stats"] and parts[2].isdigit() and not process_alive(int(parts[2])):
            _unlink(os.path.join(directory, name))


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (owned by us or not). A number that no process id
    can be (read from a file name someone else chose) is no live process, never an ``OverflowError``."""
    if not 0 < pid < 2**31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedCounters:
    """Per-process rows of counters in a shared file; pickles as its path."""

    def __init__(self, path: str, *, owner: bool = False):
        self.path = path
        self._owner = owner
        self._mm = None
        self._array = None
        self._row = None
        self._pid = None
        self._base = np.zeros(len(FIELDS), np.int64)
        self._finalizer = weakref.finalize(self, _unlink, path) if owner else None

    @classmethod
    def create(cls) -> "SharedCounters":
        _sweep_dead(_shm_dir())
        path = os.path.join(_shm_dir(), f"nbkit-stats-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        with open(path, "wb") as f:
            f.truncate(_SLOTS * _WIDTH * 8)
        return cls(path, owner=True)

    def __getstate__(self):
        return {"path": self.path, "base": self._base}

    def __setstate__(self, state):
        self.__init__(state["path"])
        self._base = state["base"]

    def _arr(self):
        if self._array is None:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                # The owning process is gone (or cleaned up): count into private memory instead.
                self._array = np.zeros((_SLOTS, _WIDTH), np.int64)
                return self._array
            try:
                self._mm = mmap.mmap(fd, _SLOTS * _WIDTH * 8)
            finally:
                os.close(fd)
            self._array = np.frombuffer(self._mm, dtype=np.int64).reshape(_SLOTS, _WIDTH)
        return self._array

    def _my_row(self):
        pid = os.getpid()
        if self._row is not None and self._pid == pid:
            return self._row
        arr = self._arr()
        slot = _SLOTS - 1  # shared overflow row if every row is taken by a live process
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:  # removed by its owner meanwhile (closed, or gone): the row is private
            fd = None
        try:
            if fd is not None and fcntl is not None:
                fcntl.lockf(fd, fcntl.LOCK_EX)
            for s in range(_SLOTS - 1):
                owner = int(arr[s, 0])
                if owner == 0 or owner == pid or not process_alive(owner):
                    slot = s
                    break
            arr[slot, 0] = pid
        finally:
            if fd is not None:
                if fcntl is not None:
                    fcntl.lockf(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._row = arr[slot]
        self._pid = pid
        return self._row

    def add(self, hits: int = 0, misses: int = 0, recomputed: int = 0, stored: int = 0, refused: int = 0) -> None:
        with _add_lock:  # threads of one process share its row (DeviceLoader reads two groups at once)
            self._add(hits, misses, recomputed, stored, refused)

    def _add(self, hits, misses, recomputed, stored, refused) -> None:
        row = self._my_row()
        if hits:
            row[1] += hits
        if misses:
            row[2] += misses
        if recomputed:
            row[3] += recomputed
        if stored:
            row[4] += stored
        if refused:
            row[5] += refused

    def _raw_totals(self) -> np.ndarray:
        return self._arr()[:, 1:].sum(axis=0)

    def totals(self) -> dict:
        t = self._raw_totals() - self._base
        return dict(zip(FIELDS, (int(x) for x in t)))

    def reset(self) -> None:
        """Start counting from zero (in this process's view; workers started later inherit it)."""
        self._base = self._raw_totals().copy()

    def close(self) -> None:
        """Let go of the shared file: unmapped once no array made from it is left, and removed if this
        handle created it. Processes that mapped it keep counting into their map; a later count in
        this process, or in a process that had not mapped it yet, goes to private memory.

        Example:
            >>> c = SharedCounters.create(); c.add(hits=1); c.close()
            >>> os.path.exists(c.path)
            False
        """
        self._array = self._row = self._mm = self._pid = None
        if self._finalizer is not None:
            self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
