"""Hit/miss counters shared by every process that reads one ``CachedDataset``.

DataLoader workers are separate processes; the hit-rate meter runs in the main one. Counters
therefore live in a small memory-mapped file (in ``/dev/shm`` when available) with one row per
process: a process only ever adds to its own row, so no lock is needed on the hot path, and a
snapshot sums the rows. Rows of processes that ended keep their counts.

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
import uuid
import weakref
from dataclasses import dataclass

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no POSIX record locks; a thread lock and per-process rows still apply
    fcntl = None

__all__ = ["Stats", "SharedCounters"]

FIELDS = ("hits", "misses", "recomputed", "stored", "refused")
_SLOTS = 256
_WIDTH = 1 + len(FIELDS)  # column 0: owner pid


@dataclass(frozen=True)
class Stats:
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
    def reads(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        """Fraction of reads served from the cache (0.0 before any read)."""
        return self.hits / self.reads if self.reads else 0.0

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
            f"{self.bytes / 2**20:.1f} MiB stored"
        )


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
