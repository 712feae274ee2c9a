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
import time
import uuid
import weakref
from dataclasses import dataclass

import numpy as np

from .text import format_bytes

try:
    import fcntl
except ImportError:  # Windows: no POSIX record locks; a thread lock and per-process rows still apply
    fcntl = None

__all__ = ["Stats", "SharedCounters", "EpochStats", "EpochCounter", "HitRate"]

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
        budget = f" (budget: {self.capacity} samples)" if self.budgeted else ""
        return (
            f"cached {self.cached}/{self.total}{budget} ({100.0 * self.cached / max(self.total, 1):.1f}%), "
            f"hits {self.hits}, misses {self.misses}, hit rate {100.0 * self.hit_rate:.1f}%, "
            f"{format_bytes(self.bytes)} stored"
        )


@dataclass
class EpochStats(HitRate):
    """Reads in one epoch (or, with ``epoch=0``, over several), as counted by ``ds.stats``.

    Its ``reads`` and ``hit_rate`` are those of :class:`Stats` (:class:`HitRate`: 0.0 before the first read).

    Attributes:
        epoch: 1 for the first epoch.
        hits: samples served from the cache.
        misses: samples computed from the source (and stored).
        seconds: wall time of the epoch so far.

    Example:
        >>> e = EpochStats(epoch=2, hits=90, misses=10, seconds=0.5)
        >>> e.reads, e.hit_rate, e.rate, e.filling
        (100, 0.9, 200.0, True)
        >>> EpochStats(epoch=1).hit_rate
        0.0
    """

    epoch: int
    hits: int = 0
    misses: int = 0
    seconds: float = 0.0

    @property
    def rate(self) -> float:
        """Samples read per second."""
        return self.reads / self.seconds if self.seconds > 0 else 0.0

    @property
    def filling(self) -> bool:
        """True when this epoch computed samples (typically the first), False when all were hits."""
        return self.misses > 0


class EpochCounter:
    """Per-epoch hits and misses of one dataset, from successive ``ds.stats`` snapshots.

    Counting starts at construction. :meth:`count` brings the current epoch up to date;
    :meth:`new_epoch` closes it and starts the next. A ``ds.reset_stats()`` in between is noticed
    (the counters go down) and counting goes on from zero instead of showing negative reads.

    Args:
        ds: anything with a ``stats`` attribute (an :class:`nbkit.CachedDataset`).
        clock: a function returning seconds (default :func:`time.perf_counter`).

    Attributes:
        epochs: one :class:`EpochStats` per epoch; the last one is the current epoch.
        last: the latest :class:`Stats` snapshot read.

    Example:
        >>> import torch, tempfile, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(4, 2)), tempfile.mkdtemp())
        >>> counter = EpochCounter(ds)
        >>> for epoch in range(2):
        ...     _ = counter.new_epoch()
        ...     _ = [ds[i] for i in range(4)]
        >>> _ = counter.count()
        >>> [(e.epoch, e.hits, e.misses) for e in counter.epochs]
        [(1, 0, 4), (2, 4, 0)]
    """

    def __init__(self, ds, *, clock=time.perf_counter):
        self.ds = ds
        self.clock = clock
        self.last = ds.stats
        self._counts = (int(self.last.hits), int(self.last.misses))
        self._base = self._counts  # counters at construction: "overall" starts here
        self._epoch_base = self._counts
        self._start = self._epoch_start = self._time = clock()
        self.epochs = [EpochStats(epoch=1)]

    @property
    def current(self) -> EpochStats:
        """The epoch being counted now."""
        return self.epochs[-1]

    def count(self) -> EpochStats:
        """Read ``ds.stats`` and update the current epoch; returns it."""
        self._time = self.clock()
        stats = self.last = self.ds.stats
        counts = (int(stats.hits), int(stats.misses))
        if counts[0] < self._epoch_base[0] or counts[1] < self._epoch_base[1]:
            # Someone called ds.reset_stats(): count on from zero.
            done = self.epochs[:-1]
            self._base = (-sum(e.hits for e in done), -sum(e.misses for e in done))
            self._epoch_base = (0, 0)
        self._counts = counts
        cur = self.current
        cur.hits = counts[0] - self._epoch_base[0]
        cur.misses = counts[1] - self._epoch_base[1]
        cur.seconds = self._time - self._epoch_start
        return cur

    def new_epoch(self) -> EpochStats | None:
        """Close the current epoch and start the next; returns the closed one.

        When the current epoch has read nothing yet it only restarts its clock (and returns
        ``None``), so calling it before the first epoch is harmless.
        """
        cur = self.count()
        self._epoch_start = self._time
        if cur.reads == 0:
            cur.seconds = 0.0
            return None
        self._epoch_base = self._counts
        self.epochs.append(EpochStats(epoch=cur.epoch + 1))
        return cur

    def overall(self) -> EpochStats:
        """All reads counted so far as one :class:`EpochStats` (``epoch=0``)."""
        hits, misses = (c - b for c, b in zip(self._counts, self._base))
        return EpochStats(epoch=0, hits=hits, misses=misses, seconds=self._time - self._start)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (owned by us or not)."""
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
        if owner:
            weakref.finalize(self, _unlink, path)

    @classmethod
    def create(cls) -> "SharedCounters":
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
        fd = os.open(self.path, os.O_RDWR) if os.path.exists(self.path) else None
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


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
