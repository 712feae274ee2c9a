"""The on-disk layout of one cache directory (format version 1).

* ``nbkit.json`` — metadata, created once and atomically; its presence makes a directory a cache.
* ``index.bin`` — one 24-byte record per sample: ``state, flags, crc32, heap offset, heap length``.
  ``state`` is written last, so a reader never trusts a half-written sample; the crc catches
  anything else (a torn page after a power cut, a flipped bit, a tampered file).
* ``col-<k>.bin`` — one fixed-size row per sample for each fixed-shape leaf, preallocated so a
  full disk fails at creation with a clear error rather than mid-epoch.
* ``heap.bin`` — variable-length blobs, appended under an exclusive lock (``heap.lock``).

Files are memory-mapped: opening a cache loads nothing into RAM, and a cache larger than RAM is
served through the OS page cache.

Example:
    >>> from nbkit.format import META, RECORD
    >>> META, RECORD.itemsize
    ('nbkit.json', 24)
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import uuid
import zlib

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no POSIX record locks; a thread lock and per-process rows still apply
    fcntl = None

from .codec import Schema
from .gather import pool, spans, take_rows
from .errors import CorruptCacheError, StaleCacheError

__all__ = ["META", "INDEX", "HEAP", "LOCK", "RECORD", "VERSION", "Store", "CacheFiles", "list_cache_files", "read_meta"]

FORMAT_NAME = "nbkit-cache"
VERSION = 1
META = "nbkit.json"
INDEX = "index.bin"
HEAP = "heap.bin"
LOCK = "heap.lock"

EMPTY, STORED = 0, 1
FLAG_VAR = 1  # conforming sample with var leaves in the heap
FLAG_FREEFORM = 2  # whole sample is a free-form blob in the heap

RECORD = np.dtype([("state", "u1"), ("flags", "u1"), ("pad", "<u2"), ("crc", "<u4"), ("off", "<u8"), ("len", "<u8")])


def column_file(k: int) -> str:
    return f"col-{k}.bin"


def list_cache_files(root: str, meta: dict | None = None) -> list[str]:
    """Names of the data files of the cache at ``root``, metadata last (the order to copy them in)."""
    meta = read_meta(root) if meta is None else meta
    names = [INDEX] + [c["file"] for c in meta["columns"]]
    if os.path.exists(os.path.join(root, HEAP)):
        names.append(HEAP)
    return names + [META]


def read_meta(root: str) -> dict:
    """Parse and check ``root/nbkit.json``; ``FileNotFoundError`` if ``root`` holds no cache."""
    path = os.path.join(root, META)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no nbkit cache at {root} (it has no {META}). Create one with nbkit.CachedDataset(source, "
            f"{root!r}), or bring one in with nbkit.pull(...) or nbkit.import_tar(...)."
        ) from None
    return parse_meta(raw, path, "Re-create or re-import the cache.")


def parse_meta(raw: bytes, where: str, fix: str) -> dict:
    """Parse and check cache metadata read from ``where``; damage raises
    :class:`CorruptCacheError` ending with ``fix`` (what to do, which depends on where it lives).

    Example:
        >>> parse_meta(b'{"format": "nbkit-cache", "version": 1, "length": 3, "schema": null,'
        ...            b' "columns": [], "fingerprint": {}}', "nbkit.json", "")["length"]
        3
    """
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise CorruptCacheError(f"{where} is not valid JSON ({e}); the cache metadata is damaged. {fix}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CorruptCacheError(f"{where} is not nbkit cache metadata (format field is {found!r}). {fix}")
    version = meta.get("version")
    if not isinstance(version, int) or version > VERSION:
        raise CorruptCacheError(
            f"{where} has format version {version!r}; this nbkit reads version {VERSION}. Upgrade nbkit "
            "(pip install -U nbkit) to open it."
        )
    for key in ("length", "schema", "columns", "fingerprint"):
        if key not in meta:
            raise CorruptCacheError(f"{where} lacks the field {key!r}; the cache metadata is damaged. {fix}")
    return meta


def publish_meta(root: str, meta: dict) -> dict:
    """Create ``root/nbkit.json`` if absent (atomically); return whichever metadata won.

    Several processes may race to create the same cache: each writes a private temporary file and
    hard-links it into place, which fails if another got there first; the loser adopts the
    winner's metadata (the caller then compares fingerprints).
    """
    path = os.path.join(root, META)
    tmp = os.path.join(root, f".{META}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(json.dumps(meta, indent=1, sort_keys=True).encode())
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
            raise
        # A filesystem without hard links (some FUSE mounts): fall back to rename-if-absent.
        if not os.path.exists(path):
            os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return read_meta(root)


def _map(path: str, size: int, writable: bool):
    """``(mmap, fd)`` of ``path`` holding exactly ``size`` bytes, creating/extending it if writable."""
    if writable:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    else:
        fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < size:
            if not writable:
                raise CorruptCacheError(f"{path} is {actual} bytes, expected {size}: the cache is truncated. Re-import or re-create it.")
            _preallocate(fd, path, actual, size)
        elif actual > size:
            raise CorruptCacheError(f"{path} is {actual} bytes, expected {size}: it does not belong to this cache's metadata.")
        if size == 0:
            return None, fd
        return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ), fd
    except BaseException:
        os.close(fd)
        raise


def _preallocate(fd: int, path: str, actual: int, size: int) -> None:
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, actual, size - actual)
        else:
            os.ftruncate(fd, size)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            free = os.statvfs(os.path.dirname(path) or ".")
            raise OSError(
                errno.ENOSPC,
                f"not enough disk space for the cache file {path}: it needs {size / 2**20:.1f} MiB, "
                f"{free.f_bavail * free.f_frsize / 2**20:.1f} MiB are free. Choose a path on a larger disk or free some space.",
            ) from e
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            os.ftruncate(fd, size)
        else:
            raise


def row_crc(rows, blob: bytes = b"") -> int:
    """CRC-32 of one sample: its column rows in order, then its heap blob (see :func:`batch_crc`)."""
    c = 0
    for r in rows:
        c = zlib.crc32(r, c)
    if blob:
        c = zlib.crc32(blob, c)
    return c


class Store:
    """What every sample store (local files, Redis, read-through) derives from the cache metadata:
    its length and schema, and, under a byte budget, which samples have a row (their slot).

    Example:
        >>> int(Store({"length": 4, "schema": None, "capacity": 2}, writable=False).admitted(np.arange(4)).sum())
        2
    """

    row_crc = staticmethod(row_crc)

    def __init__(self, meta: dict, *, writable: bool):
        self.meta = meta
        self.writable = writable
        self.length = int(meta["length"])
        self.schema = Schema.from_json(meta["schema"])
        # A byte budget (``max_bytes``) gives the columns fewer rows than samples: only the admitted
        # samples have a row (their slot); the others are always computed from the source.
        self.capacity = self.length if meta.get("capacity") is None else int(meta["capacity"])
        self.slot_of = None
        if self.capacity < self.length:
            self.slot_of = admission_slots(self.length, self.capacity, int(meta.get("admit_seed", 0)))

    @property
    def n_columns(self) -> int:
        return len(self.schema.columns)

    def admitted(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` may be stored (all, unless a byte budget limits the cache)."""
        if self.slot_of is None:
            return np.ones(len(idx), dtype=bool)
        return self.slot_of[idx] >= 0


class CacheFiles(Store):
    """The memory-mapped files of one cache directory, opened in one process.

    Not shared between processes: each process (DataLoader worker, TPU process) opens its own.
    """

    def __init__(self, root: str, meta: dict, *, writable: bool):
        super().__init__(meta, writable=writable)
        self.root = root
        self._fds = []
        mm, fd = _map(os.path.join(root, INDEX), self.length * RECORD.itemsize, writable)
        self._fds.append(fd)
        self._index_mmap = mm
        if mm is None:
            self.records = np.zeros(0, RECORD)
        else:
            self.records = np.frombuffer(mm, dtype=RECORD, count=self.length)
        self.state = self.records["state"]
        self.flags = self.records["flags"]
        self.crc = self.records["crc"]
        self.off = self.records["off"]
        self.len = self.records["len"]
        self.columns = []
        self.column_fds = []
        for leaf, spec in zip(self.schema.columns, meta["columns"]):
            dtype = self.schema.column_dtype(leaf)
            shape = (self.capacity, *leaf.shape)
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            cm, cfd = _map(os.path.join(root, spec["file"]), nbytes, writable)
            self._fds.append(cfd)
            self.column_fds.append(cfd)
            if cm is None:
                self.columns.append(np.zeros(shape, dtype))
            else:
                self.columns.append(np.frombuffer(cm, dtype=dtype, count=int(np.prod(shape, dtype=np.int64))).reshape(shape))
        self._heap_fd = None
        self._heap_lock = threading.Lock()

    # -- the store interface the engine uses --------------------------------------------------

    def is_stored(self, idx: np.ndarray) -> np.ndarray:
        return self.state[idx] == STORED

    def flags_of(self, idx: np.ndarray) -> np.ndarray:
        return self.flags[idx]

    def crc_of(self, idx: np.ndarray) -> np.ndarray:
        return self.crc[idx]

    def stored_count(self) -> int:
        return int(np.count_nonzero(self.state == STORED))

    def missing(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The admitted indices (of ``idx``, or of all) that are not stored yet."""
        idx = np.arange(self.length) if idx is None else idx
        keep = self.state[idx] != STORED
        if self.slot_of is not None:
            keep &= self.slot_of[idx] >= 0
        return idx[keep]

    memory_mapped = True  # gather reads this host's page cache: batches can be gathered anywhere on it

    def gather(self, idx: np.ndarray, out: list | None = None, threads: int | None = None) -> list:
        """The column rows of stored samples ``idx``: one vectorised read per column, split over
        several threads for large batches (into ``out`` when given)."""
        rows = idx if self.slot_of is None else self.slot_of[idx]
        return take_rows(self.columns, rows, out, threads)

    def put(self, idx: np.ndarray, flags: np.ndarray, crc: np.ndarray, cpos: np.ndarray, stacked: list,
            bpos: np.ndarray, blobs: list):
        """Store samples ``idx``: rows of the conforming ones (positions ``cpos``), blobs (positions
        ``bpos``), then their records, ``state`` last so no reader trusts a half-written sample.

        Returns ``None`` (everything kept); a store that can refuse (a full server) returns a bool
        mask of the samples it kept."""
        was = self.state[idx] != EMPTY
        if was.any():
            self.state[idx[was]] = EMPTY  # a sample being replaced must not look stored meanwhile
        if len(cpos):
            rows_idx = idx[cpos] if self.slot_of is None else self.slot_of[idx[cpos]]
            if len(rows_idx) > 1 and not (np.diff(rows_idx) > 0).all():
                order = np.argsort(rows_idx, kind="stable")  # runs of consecutive rows → one write each
                rows_idx, stacked = rows_idx[order], [rows[order] for rows in stacked]
            for k, rows in enumerate(stacked):
                self.write_rows(k, rows_idx, rows)
        if len(bpos):
            offsets = self.append_blobs(blobs)
            self.off[idx[bpos]] = offsets
            self.len[idx[bpos]] = [len(b) for b in blobs]
        self.flags[idx] = flags
        self.crc[idx] = crc
        self.state[idx] = STORED

    # -- heap ---------------------------------------------------------------------------------

    def _heap(self) -> int:
        if self._heap_fd is None:
            path = os.path.join(self.root, HEAP)
            if self.writable:
                self._heap_fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            else:
                try:
                    self._heap_fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise CorruptCacheError(f"{path} is missing but the index points into it: the cache is incomplete. Re-import or re-create it.") from None
            self._fds.append(self._heap_fd)
        return self._heap_fd

    def append_blobs(self, blobs: list[bytes]) -> list[int]:
        """Append ``blobs`` to the heap under an exclusive lock; return their offsets."""
        fd = self._heap()
        data = b"".join(blobs)
        # fcntl.lockf locks are per process, so they also exclude forked children that share our
        # file descriptors; the thread lock covers threads of this process.
        lock_fd = os.open(os.path.join(self.root, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with self._heap_lock:
                if fcntl is not None:
                    fcntl.lockf(lock_fd, fcntl.LOCK_EX)
                try:
                    start = os.fstat(fd).st_size
                    written = 0
                    while written < len(data):
                        written += os.pwrite(fd, data[written:], start + written)
                finally:
                    if fcntl is not None:
                        fcntl.lockf(lock_fd, fcntl.LOCK_UN)
        finally:
            os.close(lock_fd)
        offsets, pos = [], start
        for b in blobs:
            offsets.append(pos)
            pos += len(b)
        return offsets

    def read_blob(self, i: int) -> bytes:
        off, n = int(self.off[i]), int(self.len[i])
        data = os.pread(self._heap(), n, off)
        if len(data) != n:
            raise CorruptCacheError(f"sample {i}: {os.path.join(self.root, HEAP)} is shorter than the index says; the cache is damaged.")
        return data

    def write_rows(self, k: int, indices: np.ndarray, rows: np.ndarray) -> None:
        """Write ``rows`` of column ``k`` at ``indices``.

        Uses ``pwrite`` on runs of consecutive indices rather than stores through the mapping:
        the kernel copies into the page cache without a page fault per 4 KiB, about 5× faster,
        and readers' mappings see the same pages.
        """
        rows = np.ascontiguousarray(rows)
        fd = self.column_fds[k]
        if rows.nbytes == 0:
            return
        flat = rows.reshape(len(indices), -1).view(np.uint8)
        row_bytes = flat.shape[1]
        breaks = np.flatnonzero(np.diff(indices) != 1) + 1
        for run in np.split(np.arange(len(indices)), breaks):
            start, stop = int(run[0]), int(run[-1]) + 1
            data = memoryview(flat[start:stop]).cast("B")
            offset = int(indices[start]) * row_bytes
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], offset + written)

    def data_bytes(self) -> int:
        """Bytes of sample data stored so far (column rows of stored samples, plus the heap)."""
        rows = sum(int(np.prod(c.shape[1:], dtype=np.int64)) * c.itemsize for c in self.columns)
        heap = os.path.join(self.root, HEAP)
        return self.stored_count() * rows + (os.path.getsize(heap) if os.path.exists(heap) else 0)

    def stored_bytes(self) -> int:
        """Bytes the cache occupies on disk (allocated blocks, preallocated columns included)."""
        total = 0
        for name in os.listdir(self.root):
            try:
                st = os.stat(os.path.join(self.root, name))
            except FileNotFoundError:
                continue
            total += getattr(st, "st_blocks", 0) * 512 or st.st_size
        return total

    def close(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []


def admission_slots(length: int, capacity: int, seed: int) -> np.ndarray:
    """Slot of each index under a byte budget (``-1``: not admitted).

    The admitted set is the first ``capacity`` entries of a seeded permutation: spread uniformly
    over the dataset (so a shuffled epoch hits it in proportion to its size) and the same in every
    session and process.
    """
    perm = np.random.default_rng(seed).permutation(length)
    slots = np.full(length, -1, dtype=np.int64)
    slots[perm[:capacity]] = np.arange(capacity)
    return slots


def batch_crc(columns: list, n: int, blobs: dict | None = None, threads: int = 1) -> np.ndarray:
    """Per-sample CRC-32s of ``n`` samples given their gathered column rows (equal to ``row_crc``).

    The rows of all columns are laid side by side so each sample is one ``zlib.crc32`` call.
    ``blobs`` maps a position to the heap blob that follows that sample's rows. ``threads > 1``
    splits the rows over the gather pool (``zlib.crc32`` releases the GIL on large rows).
    """
    parts = spans(n, min(threads, n)) if threads > 1 and n else []
    if len(parts) > 1:
        out = np.concatenate(list(pool().map(lambda s: batch_crc([c[s[0]:s[1]] for c in columns], s[1] - s[0]), parts)))
        for j, blob in (blobs or {}).items():
            out[j] = zlib.crc32(blob, int(out[j]))
        return out.astype(np.uint32, copy=False)
    if columns:
        parts = [np.ascontiguousarray(c).reshape(n, c.size // n if n else 0).view(np.uint8) for c in columns]
        if len(parts) > 1 and sum(p.shape[1] for p in parts) <= 16384:
            # Small rows: lay them side by side, one call per sample. (Large rows: chain per column
            # rather than copy them.)
            parts = [np.concatenate(parts, axis=1)]
        out = np.fromiter(map(zlib.crc32, parts[0]), dtype=np.uint32, count=n)
        for p in parts[1:]:
            out = np.fromiter(map(zlib.crc32, p, out.tolist()), dtype=np.uint32, count=n)
    else:
        out = np.zeros(n, np.uint32)
    for j, blob in (blobs or {}).items():
        out[j] = zlib.crc32(blob, int(out[j]))
    return out


def remove_cache(root: str) -> None:
    """Delete the cache files in ``root`` (metadata first, so nobody sees a cache with half its data)."""
    if not os.path.isdir(root):
        return
    try:
        names = list_cache_files(root)
    except (CorruptCacheError, FileNotFoundError):
        names = [n for n in os.listdir(root) if n in (INDEX, HEAP) or (n.startswith("col-") and n.endswith(".bin"))]
    meta_path = os.path.join(root, META)
    if os.path.exists(meta_path):
        os.unlink(meta_path)
    for name in names + [LOCK]:
        p = os.path.join(root, name)
        if os.path.isfile(p):
            os.unlink(p)


def check_compatible(root: str, existing: dict, wanted: dict) -> None:
    """Raise :class:`StaleCacheError` if the cache metadata at ``root`` does not fit ``wanted``."""
    from .fingerprint import differences

    diffs = differences(existing["fingerprint"], wanted["fingerprint"])
    if existing.get("max_bytes") != wanted.get("max_bytes") and wanted.get("max_bytes") is not None:
        diffs.append(f"byte budget: cached max_bytes={existing.get('max_bytes')}, asked max_bytes={wanted.get('max_bytes')}")
    if diffs:
        raise StaleCacheError(
            f"the cache at {root} was built from a different source: " + "; ".join(diffs) + ". "
            "Use a new path for this source, or pass overwrite=True to discard the old cache and rebuild it."
        )
