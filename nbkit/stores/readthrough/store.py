"""The sample store of a read-through cache in one process: pieces fetched on demand into the shared local area.

Every stored sample of a fetched column piece is checked against its CRC from the index before the
piece is kept (the engine checks each sample again on its first read in each process); a piece that
fails is fetched once more. :meth:`ReadThroughStore.prefetch` fetches pieces ahead in a background
thread. Samples recomputed after a failed checksum stay in this process's memory: nothing is ever
written to the bucket.

Example:
    >>> ReadThroughStore.row_crc([b"abc"]) == __import__("zlib").crc32(b"abc")
    True
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
import weakref
from collections import OrderedDict, deque

import numpy as np

from ... import format as fmt
from ...errors import CorruptCacheError
from ...commit import temp_name
from ...transfer.remote import is_connection_error, url_to_fs
from .. import base
from ..base import Store
from .area import area_lock, area_usage, piece_lock, read_generation, reserve, stamp
from .geometry import Geometry, rounded

__all__ = ["ReadThroughStore", "store_of"]

#: How long a prefetch thread with nothing to fetch waits for more before it ends.
PREFETCH_IDLE_SECONDS = 30.0

_prefetching = weakref.WeakSet()  # stores of this process that started a prefetch thread


def _end_idle_prefetchers() -> None:
    """Before a fork: end the prefetch threads that wait for work, so that the process forks (a
    DataLoader's workers) without them; one fetching a piece is left to finish it."""
    idle = [t for t in (store._end_if_idle() for store in list(_prefetching)) if t is not None]
    for t in idle:
        t.join(timeout=1.0)


def _forget_prefetchers() -> None:
    global _prefetching
    _prefetching = weakref.WeakSet()  # the parent's: their threads (and perhaps their locks' holders) did not fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_end_idle_prefetchers, after_in_child=_forget_prefetchers)


class ReadThroughStore(Store):
    """The sample store of a read-through cache in one process (the engine's store protocol).

    Also: :meth:`prefetch` (fetch ahead in a background thread), :meth:`local_bytes`, and
    ``counters`` (this process's ``fetched``, ``fetched_bytes``, ``prefetched``, ``on_demand``,
    ``refetched``, ``evicted``, ``retried``, ``max_local_bytes``).

    Example:
        >>> ReadThroughStore.row_crc([b"abc"]) == __import__("zlib").crc32(b"abc")
        True
    """

    def __init__(self, location, meta: dict, manifest: dict, *, writable: bool):
        super().__init__(meta, writable=writable)
        self.url = location.url
        self.root = location.root
        self.limit = location.local_max_bytes
        self.geometry = Geometry.of(meta, manifest, self.limit, location.piece_bytes, self.url)
        self._fs_args = (location.url, location.storage_options)
        self._fs_obj = None
        self._rroot = None
        g = self.geometry
        fd = os.open(os.path.join(self.root, fmt.INDEX), os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.length * fmt.RECORD.itemsize:
                raise CorruptCacheError(f"{self.root}/{fmt.INDEX} is {size} bytes, expected {self.length * fmt.RECORD.itemsize}; "
                                        "delete that directory and open the cache again.")
            self._index_map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else None
        finally:
            os.close(fd)
        records = np.frombuffer(self._index_map, dtype=fmt.RECORD) if size else np.zeros(0, fmt.RECORD)
        self._stored = records["state"] == fmt.STORED
        self._flags, self._crc, self._off, self._len = records["flags"], records["crc"], records["off"], records["len"]
        self._sample_of_slot = None
        if self.slot_of is not None:
            self._sample_of_slot = np.empty(self.capacity, np.int64)
            admitted = np.flatnonzero(self.slot_of >= 0)
            self._sample_of_slot[self.slot_of[admitted]] = admitted
        self._leaves = [(self.schema.column_dtype(leaf), tuple(leaf.shape)) for leaf in self.schema.columns]
        self._overlay: dict[int, tuple] = {}  # samples recomputed after a failed checksum: (flags, crc, rows, blob)
        self._maps: OrderedDict = OrderedDict()  # key -> (mmap, views, inode) of pieces mapped in this process
        self._max_maps = max(2, g.usable // max(g.piece_size(("c", 0)) if g.row_bytes else 0, g.heap_piece))
        self._generation = read_generation(self.root)
        self._good: set = set()  # pieces whose fetched bytes passed every sample's checksum here
        self._ever: set = set()
        self._lock = threading.Lock()
        self.counters = dict(fetched=0, fetched_bytes=0, prefetched=0, on_demand=0, refetched=0, evicted=0,
                             retried=0, max_local_bytes=0)
        self._queue: deque = deque()
        self._queued: set = set()
        self._cv = threading.Condition()
        self._thread = None  # the prefetch thread while it runs (it clears this when it ends)
        self._fetching = False  # it is fetching a piece now
        self._end_idle = False  # asked to end once it has nothing to fetch
        self._closed = False
        self.prefetch_error = None
        os.makedirs(os.path.join(self.root, "pieces"), exist_ok=True)
        os.makedirs(os.path.join(self.root, "locks"), exist_ok=True)

    # -- facts -----------------------------------------------------------------------------------

    def _in_overlay(self, idx: np.ndarray) -> np.ndarray:
        if not self._overlay:
            return np.zeros(len(idx), dtype=bool)
        return np.fromiter((int(i) in self._overlay for i in idx), dtype=bool, count=len(idx))

    def admitted(self, idx: np.ndarray) -> np.ndarray:
        """With a source, only samples the remote cache holds: the others are computed on every read."""
        ok = super().admitted(idx)
        if self.writable:
            ok &= self._stored[idx] | self._in_overlay(idx)
        return ok

    def is_stored(self, idx: np.ndarray) -> np.ndarray:
        out = self._stored[idx]
        return out | self._in_overlay(idx) if self._overlay else out

    def flags_of(self, idx: np.ndarray) -> np.ndarray:
        return self._patched(idx, self._flags, 0)

    def crc_of(self, idx: np.ndarray) -> np.ndarray:
        return self._patched(idx, self._crc, 1)

    def _patched(self, idx, base, field_no):
        out = base[idx]
        if self._overlay:
            out = out.copy()
            for j, i in enumerate(idx):
                entry = self._overlay.get(int(i))
                if entry is not None:
                    out[j] = entry[field_no]
        return out

    def stored_count(self) -> int:
        extra = sum(1 for i in self._overlay if not self._stored[i])
        return int(np.count_nonzero(self._stored)) + extra

    def data_bytes(self) -> int:
        return self.stored_count() * sum(self.geometry.row_bytes) + self.geometry.heap_size

    def stored_bytes(self) -> int:
        """Bytes on the local disk (the local area), not in the bucket."""
        return area_usage(self.root)

    def local_bytes(self) -> int:
        """Bytes the local area holds now (all processes' pieces, index and metadata)."""
        return area_usage(self.root)

    # -- reads -----------------------------------------------------------------------------------

    def gather(self, idx: np.ndarray) -> list:
        """The column rows of samples ``idx``, fetching the pieces they lie in as needed."""
        idx = np.asarray(idx, dtype=np.int64)
        n = len(idx)
        out = [np.empty((n, *shape), dtype) for dtype, shape in self._leaves]
        if not self._leaves or n == 0:
            return out
        rows = idx if self.slot_of is None else self.slot_of[idx]
        pieces = rows // self.geometry.rows_per_piece
        order = np.argsort(pieces, kind="stable")
        sorted_pieces = pieces[order]
        starts = np.flatnonzero(np.r_[True, sorted_pieces[1:] != sorted_pieces[:-1]])
        ends = np.r_[starts[1:], n]
        self._forget_evicted()
        for s in starts:
            # Mark every piece of the batch used first: fetching one of them must not evict another.
            stamp(self._path(("c", int(sorted_pieces[s]))))
        for s, e in zip(starts, ends):
            p = int(sorted_pieces[s])
            pos = order[s:e]
            views = self._views(("c", p))
            local = rows[pos] - p * self.geometry.rows_per_piece
            for k, view in enumerate(views):
                out[k][pos] = view[local]
        if self._overlay:
            for j, i in enumerate(idx):
                entry = self._overlay.get(int(i))
                if entry is not None and entry[2] is not None:
                    for k, row in enumerate(entry[2]):
                        out[k][j] = row
        return out

    def read_blob(self, i: int) -> bytes:
        entry = self._overlay.get(int(i))
        if entry is not None:
            return entry[3]
        off, n = int(self._off[i]), int(self._len[i])
        if n == 0:
            return b""
        if off + n > self.geometry.heap_size:
            raise CorruptCacheError(f"sample {i} of {self.url}: the index points past the end of {fmt.HEAP}; the cache is damaged.")
        h = self.geometry.heap_piece
        parts = []
        self._forget_evicted()
        for q in range(off // h, (off + n - 1) // h + 1):
            stamp(self._path(("h", q)))
            buf = self._views(("h", q))[0]
            a, b = max(off, q * h) - q * h, min(off + n, (q + 1) * h) - q * h
            parts.append(bytes(buf[a:b]))
        return b"".join(parts)

    def _views(self, key: tuple) -> list:
        """The arrays of a piece mapped in this process (fetching it if no process has it)."""
        entry = self._maps.get(key)
        if entry is not None:
            self._maps.move_to_end(key)
            return entry[1]
        while True:
            path = self._ensure(key, prefetch=False)
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue  # evicted by another process between the fetch and now: fetch again
            try:
                mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                ino = os.fstat(fd).st_ino
            finally:
                os.close(fd)
            break
        raw = np.frombuffer(mm, dtype=np.uint8)
        views = self._split(key, raw)
        self._maps[key] = (mm, views, ino)
        while len(self._maps) > self._max_maps:
            self._maps.popitem(last=False)
        return views

    def _split(self, key: tuple, raw: np.ndarray) -> list:
        if key[0] == "h":
            return [raw]
        a, b = self.geometry.rows_of(key[1])
        views, pos = [], 0
        for (dtype, shape), rb in zip(self._leaves, self.geometry.row_bytes):
            nbytes = (b - a) * rb
            views.append(raw[pos:pos + nbytes].view(dtype).reshape(b - a, *shape))
            pos += nbytes
        return views

    def _forget_evicted(self) -> None:
        """Drop this process's maps of pieces evicted since the last read (checked once a read, not once a piece)."""
        gen = read_generation(self.root)
        if gen == self._generation:
            return
        self._generation = gen
        for key in list(self._maps):
            try:
                alive = os.stat(self._path(key)).st_ino == self._maps[key][2]
            except FileNotFoundError:
                alive = False
            if not alive:
                del self._maps[key]  # the space of an evicted piece is freed once nothing maps it

    def _path(self, key: tuple) -> str:
        return os.path.join(self.root, "pieces", f"{self.geometry.tag}-{key[0]}{key[1]:07d}.bin")

    # -- fetching --------------------------------------------------------------------------------

    def _fs(self):
        if self._fs_obj is None:
            self._fs_obj, self._rroot = url_to_fs(*self._fs_args)
        return self._fs_obj

    def _ensure(self, key: tuple, *, prefetch: bool) -> str:
        """The local path of piece ``key``, fetching it unless some process already has."""
        path = self._path(key)
        if os.path.exists(path):
            return path
        with piece_lock(self.root, 2 * key[1] + (key[0] == "h")):  # the same stripe in every process (no str hash)
            if os.path.exists(path):
                return path  # another process or thread fetched it while we waited
            data = self._fetch_verified(key)
            tmp = self._reserve(key, len(data))
            try:
                with open(tmp, "r+b") as f:
                    f.write(data)
                stamp(tmp)
                # Under the area lock, like every change to the pieces directory: a directory scan
                # racing a rename can miss the file under both names and count too little.
                with area_lock(self.root):
                    os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                raise
        with self._lock:
            c = self.counters
            c["fetched"] += 1
            c["fetched_bytes"] += len(data)
            c["prefetched" if prefetch else "on_demand"] += 1
            if key in self._ever:
                c["refetched"] += 1
            self._ever.add(key)
        return path

    def _fetch(self, key: tuple) -> bytes:
        fs = self._fs()
        g = self.geometry
        try:
            if key[0] == "h":
                start = key[1] * g.heap_piece
                data = fs.cat_file(f"{self._rroot}/{fmt.HEAP}", start, start + g.piece_size(key))
            else:
                a, b = g.rows_of(key[1])
                paths = [f"{self._rroot}/{spec['file']}" for spec in self.meta["columns"]]
                parts = fs.cat_ranges(paths, [a * rb for rb in g.row_bytes], [b * rb for rb in g.row_bytes])
                for part in parts:
                    if isinstance(part, BaseException):
                        raise part
                data = b"".join(parts)
        except FileNotFoundError as e:
            raise CorruptCacheError(f"a data file of {self.url} is gone ({e}): the remote cache was deleted or is being "
                                    "pushed again. Open it again once the push has finished.") from e
        except Exception as e:
            if is_connection_error(e):
                raise OSError(f"could not fetch a piece of {self.url} ({type(e).__name__}: {e}). Check the network, the "
                              "endpoint and the credentials, then read again: nothing local was damaged.") from e
            raise
        if len(data) != g.piece_size(key):
            raise CorruptCacheError(f"{self.url}: a ranged read returned {len(data)} bytes, expected {g.piece_size(key)}; "
                                    "the remote cache is shorter than its manifest says. Push it again with nbkit.push.")
        return data

    def _fetch_verified(self, key: tuple) -> bytes:
        data = self._fetch(key)
        if key[0] != "c" or self._piece_ok(key, data):
            self._good.add(key)
            return data
        with self._lock:
            self.counters["retried"] += 1
        data = self._fetch(key)  # once more: a transient error, or a remote cache pushed again meanwhile
        if self._piece_ok(key, data):
            self._good.add(key)
        elif key in self._good:
            raise CorruptCacheError(f"samples of {self.url} fetched again no longer match the checksums of the index read "
                                    "when the cache was opened: the remote cache was changed (pushed again?) while being "
                                    "read. Open it again.")
        # Otherwise the engine's checksum on first read finds the damaged samples: it recomputes them
        # from the source, or raises CorruptCacheError naming them.
        return data

    def _piece_ok(self, key: tuple, data: bytes) -> bool:
        """Whether every stored, column-only sample in a column piece matches its index CRC."""
        a, b = self.geometry.rows_of(key[1])
        samples = np.arange(a, b) if self._sample_of_slot is None else self._sample_of_slot[a:b]
        check = self._stored[samples] & (self._flags[samples] == 0)
        if not check.any():
            return True
        views = self._split(key, np.frombuffer(data, dtype=np.uint8))
        pos = np.flatnonzero(check)
        crc = fmt.sample_crcs([v[pos] for v in views], self._flags[samples[pos]])
        return bool((crc == self._crc[samples[pos]]).all())

    def _reserve(self, key: tuple, nbytes: int) -> str:
        """Make room for ``nbytes`` in the area; return a temporary file of that size for piece ``key``."""
        tmp = temp_name(os.path.join(self.root, "pieces", os.path.basename(self._path(key))))
        evicted, used = reserve(self.root, self.limit, tmp, nbytes)
        with self._lock:
            self.counters["evicted"] += evicted
            self.counters["max_local_bytes"] = max(self.counters["max_local_bytes"], used)
        return tmp

    # -- prefetch --------------------------------------------------------------------------------

    def pieces_of(self, indices) -> list:
        """The pieces samples ``indices`` need, in the order they are first needed.

        Example: see :class:`PrefetchSampler`, which is how pieces are usually asked for.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        idx = idx[self._stored[idx]]
        keys = []
        flags = self._flags[idx]
        g = self.geometry
        if self._leaves:
            col = idx[(flags & fmt.FLAG_FREEFORM) == 0]
            rows = col if self.slot_of is None else self.slot_of[col]
            rows = rows[rows >= 0]
            p = rows // g.rows_per_piece
            _, first = np.unique(p, return_index=True)
            keys += [(int(p[j]), ("c", int(p[j]))) for j in first]
        heap = idx[(flags & (fmt.FLAG_FREEFORM | fmt.FLAG_VAR)) != 0]
        heap = heap[self._len[heap] > 0]
        if len(heap):
            lo = (self._off[heap] // g.heap_piece).astype(np.int64)
            hi = ((self._off[heap] + self._len[heap] - 1) // g.heap_piece).astype(np.int64)
            seen = set()
            for j, (a, b) in enumerate(zip(lo.tolist(), hi.tolist())):
                for q in range(a, b + 1):
                    if q not in seen:
                        seen.add(q)
                        keys.append((j, ("h", q)))
        # order by first use (column pieces are ranked by row, heap pieces by sample position)
        return [k for _, k in sorted(keys, key=lambda t: t[0])]

    def piece_groups(self) -> tuple[list, list, np.ndarray]:
        """Every sample grouped by the piece it lives in: ``(groups, cost, loose)``.

        ``groups`` are index arrays (one per column or heap piece), ``cost`` the bytes of local area
        each group needs, ``loose`` the indices in no piece (not stored, or outside a byte budget).
        """
        n = self.length
        g = self.geometry
        idx = np.arange(n)
        key = np.full(n, -1, dtype=np.int64)  # -1: no piece
        stored, flags = self._stored, self._flags
        if self.n_columns:
            rows = idx if self.slot_of is None else self.slot_of
            col = stored & ((flags & fmt.FLAG_FREEFORM) == 0) & (rows >= 0)
            key[col] = rows[col] // g.rows_per_piece
        base = g.n_column_pieces
        free = stored & ((flags & fmt.FLAG_FREEFORM) != 0)
        key[free] = base + self._off[free].astype(np.int64) // g.heap_piece
        order = np.argsort(key, kind="stable")
        sorted_keys = key[order]
        starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
        groups = np.split(order, starts[1:])
        loose = np.zeros(0, np.int64)
        if n and sorted_keys[0] == -1:
            loose, groups = groups[0], groups[1:]
        if not n:
            groups = []
        keys = [int(key[grp[0]]) for grp in groups]
        heap_bytes = np.zeros(n, np.int64)
        var = stored & ((flags & fmt.FLAG_VAR) != 0)
        heap_bytes[var] = self._len[var].astype(np.int64)
        cost = [rounded(g.piece_size(("c", k))) + int(heap_bytes[grp].sum()) if k < base else g.heap_piece
                for k, grp in zip(keys, groups)]
        return groups, cost, loose

    def prefetch(self, indices) -> int:
        """Fetch the pieces samples ``indices`` need in a background thread; return how many were queued.

        Pieces are queued in the order first needed, up to half the local area; already local pieces
        are skipped when their turn comes. Errors of the background fetch are kept in
        ``prefetch_error`` (the read that needs the piece then fetches it and raises).
        """
        budget = self.geometry.usable // 2
        queued = 0
        with self._cv:
            for key in self.pieces_of(indices):
                size = rounded(self.geometry.piece_size(key))
                if budget < size:
                    break
                budget -= size
                if key not in self._queued and not os.path.exists(self._path(key)):
                    self._queue.append(key)
                    self._queued.add(key)
                    queued += 1
            if queued and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._prefetch_loop, name="nbkit-readthrough-prefetch", daemon=True)
                self._thread.start()
                _prefetching.add(self)
            self._cv.notify()
        return queued

    def _prefetch_loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    if self._end_idle or not self._cv.wait(timeout=PREFETCH_IDLE_SECONDS):
                        # Idle: the next prefetch() starts a new thread (decided under the lock, so
                        # no work is queued for a thread that is ending).
                        self._end_idle = False
                        if self._thread is me:
                            self._thread = None
                        return
                if self._closed:
                    return
                key = self._queue.popleft()
                self._fetching = True
            try:
                self._ensure(key, prefetch=True)
            except Exception as e:  # noqa: BLE001 - kept for the caller; the read that needs the piece raises
                self.prefetch_error = e
            finally:
                with self._cv:
                    self._queued.discard(key)
                    self._fetching = False

    def _end_if_idle(self):
        """Ask the prefetch thread to end if it has nothing to fetch; return it (to wait for), or ``None``."""
        with self._cv:
            thread = self._thread
            if thread is None or not thread.is_alive() or self._queue or self._fetching:
                return None
            self._end_idle = True
            self._cv.notify_all()
            return thread

    def wait_prefetched(self, timeout: float = 60.0) -> bool:
        """Block until the prefetch queue is empty (for tests and benchmarks); return whether it emptied."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._cv:
                if not self._queued:
                    return True
            time.sleep(0.01)
        return False

    # -- writes (repairs only) ---------------------------------------------------------------------

    def put(self, idx, flags, crc, cpos, stacked, bpos, blobs) -> None:
        """Keep recomputed samples in this process's memory: a read-through cache never writes the bucket."""
        if not self.writable:
            raise PermissionError(f"the read-through cache at {self.url} is open read-only")
        rows_of = {int(j): [np.array(s[m]) for s in stacked] for m, j in enumerate(cpos)}
        blob_of = {int(j): bytes(b) for j, b in zip(bpos, blobs)}
        for j, i in enumerate(np.asarray(idx).tolist()):
            self._overlay[int(i)] = (int(flags[j]), int(crc[j]), rows_of.get(j), blob_of.get(j, b""))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self._maps.clear()


def store_of(dataset) -> ReadThroughStore:
    """The read-through store of ``dataset`` in this process (opened on first use).

    Raises:
        TypeError: ``dataset`` is not a ``CachedDataset`` opened with ``local_max_bytes=``.

    Example:
        >>> import pytest
        >>> with pytest.raises(TypeError):
        ...     store_of([1, 2, 3])
    """
    store = base.store_of(dataset)  # CachedDataset.store: the engine's store in this process
    if not isinstance(store, ReadThroughStore):
        raise TypeError(f"{dataset!r} is not a read-through cache: open it with nbkit.CachedDataset.open(url, "
                        "local_max_bytes=N) (or CachedDataset(source, url, local_max_bytes=N)).")
    return store
