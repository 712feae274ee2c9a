"""Read-through: train from a cache in a bucket that is larger than the local disk.

``CachedDataset.open("gs://bucket/cache", local_max_bytes=N)`` does not pull the cache whole. It
fetches ``nbkit.json``, ``manifest.json`` and ``index.bin`` once (the index is 24 bytes a sample;
its sha256 is checked against the manifest), then sample data in *pieces*, on demand, into a
local area of at most ``N`` bytes:

* a **column piece** is a run of consecutive rows of every column (``col-<k>.bin``), fetched with
  one ``cat_ranges`` call; a **heap piece** is an aligned byte range of ``heap.bin``. Pieces are
  about ``N / 12`` bytes, at most 8 MiB, and a piece is one local file.
* Before a piece is written, least recently used pieces are deleted until the area's files
  (index and metadata included, each rounded up to 4 KiB) fit in ``N`` with it. A piece is
  written to a temporary file of its full size first, then renamed into place.
* Every stored sample of a fetched column piece is checked against its CRC from the index (the
  engine checks each sample again on its first read in each process). A piece that fails is
  fetched once more; if bytes that once passed fail later, the remote cache was changed while
  being read (pushed again) and :class:`~nbkit.errors.CorruptCacheError` says so.
* **Prefetch**: :meth:`ReadThroughStore.prefetch` queues the pieces that given indices need; a
  background thread fetches them. :class:`PrefetchSampler` uses it: it shuffles *windows* of
  pieces (pieces in random order, samples shuffled within a window of about a third of the
  local area) and asks for the next window while the current one is read, so an epoch fetches
  each piece once. A plain ``shuffle=True`` over a cache four times the local area touches every
  piece in every batch and refetches constantly: use the sampler.

Processes share one local area per URL (``$NBKIT_CACHE_DIR/<name>-<hash>.readthrough``): DataLoader
workers, the main process's prefetch thread and other processes on the host see each other's
pieces. Fetching a piece takes a file lock, so a piece is downloaded once; eviction takes an
area-wide lock; a piece evicted while another process reads it stays readable to that process
until its next read (its memory map is dropped then, and the space freed).

The cache is read-only through read-through. Opened with its source, a sample the remote cache
does not hold is computed from the source on every read and never stored (like a sample outside
a byte budget); a sample whose fetched bytes fail their checksum is recomputed and kept in this
process's memory only. Nothing is ever written to the bucket.

Example:
    >>> import os, tempfile, torch, nbkit
    >>> from unittest import mock
    >>> src = torch.utils.data.TensorDataset(torch.arange(4096.0).reshape(1024, 4))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
    >>> _ = nbkit.push(ds.root, "memory://doctest/readthrough")
    >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):  # where local areas live
    ...     rt = nbkit.CachedDataset.open("memory://doctest/readthrough", local_max_bytes=64 << 10)
    >>> loader = torch.utils.data.DataLoader(rt, batch_size=100, sampler=PrefetchSampler(rt, seed=0),
    ...                                      collate_fn=nbkit.collate)
    >>> sum(float(b[0].sum()) for b in loader) == float(torch.arange(4096.0).sum())
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import mmap
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from . import format as fmt
from .codec import Schema
from .errors import CorruptCacheError
from .stats import process_alive
from .storage import Location, working_copy_dir
from .transfer import (
    MANIFEST,
    _fs,
    is_connection_error,
    manifest_bytes,
    network_errors,
    read_remote_manifest,
)

__all__ = ["ReadThroughLocation", "ReadThroughStore", "PrefetchSampler", "resolve_read_through", "store_of"]

PIECE_MAX = 8 << 20  # largest piece: big enough for object-store throughput, small enough to evict
MIN_PIECES = 12  # pieces shrink until the local area holds at least this many
BLOCK = 4096  # files are accounted rounded up to this, so blocks on disk never exceed the limit
WAIT_SECONDS = 120.0  # how long a fetch waits for room held by other processes' fetches in flight
_STRIPES = 64  # piece fetch locks (a piece's lock is stripe key % 64)
_AREA_SUFFIX = ".readthrough"


def resolve_read_through(url: str, storage_options: dict | None = None, *, local_max_bytes: int,
                         piece_bytes: int | None = None, **unused) -> "ReadThroughLocation":
    """The :class:`ReadThroughLocation` of ``url`` (what ``nbkit.storage.resolve`` returns for
    ``local_max_bytes=``); no network access until ``prepare()``.

    Args:
        url: a pushed cache, e.g. ``"gs://bucket/caches/mnist"``.
        storage_options: passed to fsspec.
        local_max_bytes: the most bytes the local area may hold (index and metadata included).
        piece_bytes: the size of a piece (default: ``local_max_bytes / 12``, at most 8 MiB).

    Example:
        >>> loc = resolve_read_through("gs://bucket/cache", {"token": "anon"}, local_max_bytes=1 << 30)
        >>> loc.root.endswith(".readthrough"), loc.is_remote
        (True, True)
    """
    if unused:
        raise TypeError(f"read-through does not take the option(s) {sorted(unused)}")
    limit = int(local_max_bytes)
    if limit <= 0:
        raise ValueError(f"local_max_bytes must be a positive number of bytes, got {local_max_bytes!r}")
    return ReadThroughLocation(url=os.fspath(url), root=working_copy_dir(url, storage_options) + _AREA_SUFFIX,
                               is_remote=True, storage_options=dict(storage_options or {}),
                               local_max_bytes=limit, piece_bytes=piece_bytes)


# -- the location --------------------------------------------------------------------------------


@dataclass
class ReadThroughLocation(Location):
    """A remote cache read through a bounded local area (see the module docstring).

    Attributes:
        local_max_bytes: the most bytes the local area holds.
        piece_bytes: the piece size asked for (``None``: chosen from ``local_max_bytes``).

    Example:
        >>> loc = resolve_read_through("memory://doctest/location", local_max_bytes=1 << 20)
        >>> isinstance(loc, ReadThroughLocation), loc.local_max_bytes, loc.publish()
        (True, 1048576, False)
    """

    local_max_bytes: int = 0
    piece_bytes: int | None = None
    _meta: dict | None = field(default=None, repr=False)
    _manifest: dict | None = field(default=None, repr=False)

    def prepare(self, callback=None) -> bool:
        """Fetch the metadata, manifest and index into the local area (never the data); return ``False``.

        Raises:
            FileNotFoundError: the bucket or the cache at the URL does not exist.
            CorruptCacheError: the remote metadata, manifest or index is damaged.
            ValueError: ``local_max_bytes`` cannot hold the index and two pieces.
        """
        fs, rroot = _fs(self.url, self.storage_options)
        fix = "then open it again"
        with network_errors(fs, self.url, "opening (read-through)", fix):
            fs.invalidate_cache()
            try:
                meta_raw = fs.cat_file(f"{rroot}/{fmt.META}")
            except FileNotFoundError:
                raise FileNotFoundError(_absent(fs, self.url, rroot)) from None
            manifest = read_remote_manifest(fs, rroot)
            if manifest is None:
                raise CorruptCacheError(f"{self.url} has {fmt.META} but no {MANIFEST}: it was not written by nbkit.push, "
                                        "and read-through needs the manifest. Push the cache with nbkit.push.")
            files = manifest["files"]
            _check_entry(self.url, fmt.META, files, meta_raw)
            meta = fmt.parse_meta(meta_raw, f"{self.url}/{fmt.META}", "Push the cache again with nbkit.push.")
            Geometry.of(  # checks now that the limit can hold the index and two pieces
                meta, manifest, self.local_max_bytes, self.piece_bytes, self.url)
            os.makedirs(self.root, exist_ok=True)
            with _area_lock(self.root):
                if _read_local_manifest(self.root) != manifest or not os.path.exists(os.path.join(self.root, fmt.INDEX)):
                    _replace_area(self.root, fs, rroot, self.url, manifest, meta_raw)
        self._meta, self._manifest = meta, manifest
        return False

    def read_meta(self) -> dict:
        if self._meta is None:
            self.prepare()
        return self._meta

    def publish_meta(self, meta: dict) -> dict:
        raise PermissionError(f"a read-through cache is read-only: no cache can be created at {self.url} through it. "
                              "Warm the cache locally, nbkit.push it there, then open it with local_max_bytes=.")

    def open_store(self, meta: dict, *, writable: bool) -> "ReadThroughStore":
        if self._manifest is None:
            self.prepare()
        return ReadThroughStore(self, meta, self._manifest, writable=writable)

    def remove(self) -> None:
        raise PermissionError(f"a read-through cache is read-only: overwrite=True cannot replace {self.url}. "
                              "Open it without local_max_bytes to rebuild it, or push a new cache there with nbkit.push.")

    def publish(self, callback=None) -> bool:
        return False  # read-only: nothing is ever written to the bucket


def _absent(fs, url: str, rroot: str) -> str:
    bucket = rroot.split("/", 1)[0]
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if any(p in ("gs", "gcs", "s3", "s3a") for p in protocols):
        try:
            exists = fs.exists(bucket)
        except OSError:
            exists = True
        if not exists:
            return (f"the bucket {bucket!r} of {url} does not exist (or these credentials cannot see it). Check the URL "
                    "and storage_options, or create the bucket and nbkit.push a cache there.")
    return (f"{url} holds no complete nbkit cache ({fmt.META} is missing): push one with nbkit.push(cache_dir, {url!r}) "
            "first, check the prefix, or wait until a push in progress has finished.")


def _check_entry(url: str, name: str, files: dict, data: bytes) -> None:
    entry = files.get(name)
    if entry is None:
        raise CorruptCacheError(f"{url}/{MANIFEST} does not list {name}; push the cache again with nbkit.push")
    sha = hashlib.sha256(data).hexdigest()
    if len(data) != entry["size"] or sha != entry["sha256"]:
        raise CorruptCacheError(f"{url}/{name} does not match its manifest entry (size {len(data)} vs {entry['size']}, "
                                f"sha256 {sha[:12]}… vs {entry['sha256'][:12]}…): the remote copy is damaged or being pushed. "
                                "Push the cache again from a good copy with nbkit.push.")


def _read_local_manifest(root: str) -> dict | None:
    try:
        with open(os.path.join(root, MANIFEST), "rb") as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _replace_area(root: str, fs, rroot: str, url: str, manifest: dict, meta_raw: bytes) -> None:
    """Make the local area hold this manifest's index (caller holds the area lock): the manifest
    file goes last, so an area is trusted only once index and metadata are in place."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, MANIFEST))
    tag = _tag(manifest)
    pieces = os.path.join(root, "pieces")
    if os.path.isdir(pieces):
        for e in os.scandir(pieces):
            if not e.name.startswith((".", tag)):  # pieces of another (older) cache at this URL
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
    _bump_generation(root)
    index = fs.cat_file(f"{rroot}/{fmt.INDEX}")
    _check_entry(url, fmt.INDEX, manifest["files"], index)
    _write_atomic(os.path.join(root, fmt.INDEX), index)
    _write_atomic(os.path.join(root, fmt.META), meta_raw)
    _write_atomic(os.path.join(root, MANIFEST), manifest_bytes(manifest))


def _tag(manifest: dict) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]


# -- geometry: how a cache is cut into pieces ----------------------------------------------------


def _rounded(n: int) -> int:
    return -(-int(n) // BLOCK) * BLOCK


@dataclass(frozen=True)
class Geometry:
    """How one cache is cut into pieces for one ``local_max_bytes`` (the same in every process)."""

    rows_per_piece: int  # column piece = this many consecutive rows of every column
    heap_piece: int  # heap piece = this many bytes of heap.bin
    row_bytes: tuple  # bytes of one row of each column
    capacity: int  # rows of each column
    heap_size: int
    fixed: int  # bytes of the local files that are not pieces (rounded)
    usable: int  # local_max_bytes - fixed: room for pieces
    tag: str  # names this cache's pieces (manifest digest and geometry)

    @classmethod
    def of(cls, meta: dict, manifest: dict, limit: int, piece_bytes: int | None, url: str) -> "Geometry":
        schema = Schema.from_json(meta["schema"])
        row_bytes = tuple(int(np.prod(leaf.shape, dtype=np.int64)) * schema.column_dtype(leaf).itemsize for leaf in schema.columns)
        length = int(meta["length"])
        capacity = length if meta.get("capacity") is None else int(meta["capacity"])
        files = manifest["files"]
        for spec, rb in zip(meta["columns"], row_bytes):
            size = files.get(spec["file"], {}).get("size")
            if size != capacity * rb:
                raise CorruptCacheError(f"{url}/{spec['file']} is {size} bytes in the manifest, expected {capacity * rb}: "
                                        "the remote cache is incomplete or damaged. Push it again with nbkit.push.")
        if files.get(fmt.INDEX, {}).get("size") != length * fmt.RECORD.itemsize:
            raise CorruptCacheError(f"{url}/{fmt.INDEX} does not hold {length} records; push the cache again with nbkit.push.")
        heap_size = int(files.get(fmt.HEAP, {}).get("size", 0))
        fixed = sum(_rounded(files[n]["size"]) for n in (fmt.INDEX, fmt.META)) + _rounded(len(manifest_bytes(manifest))) + BLOCK
        usable = limit - fixed
        total_row = sum(row_bytes)
        target = int(piece_bytes) if piece_bytes else min(PIECE_MAX, max(usable // MIN_PIECES, 1))
        rows = max(1, target // total_row) if total_row else 1
        heap_piece = max(BLOCK, _rounded(target)) if heap_size else BLOCK
        largest = max(_rounded(rows * total_row) if total_row else 0, heap_piece if heap_size else 0)
        if usable < 2 * largest:
            raise ValueError(
                f"local_max_bytes={limit} is too small to read {url} through: its index and metadata take {fixed} bytes "
                f"and reading needs room for two pieces of {largest} bytes (one sample's rows are {total_row} bytes). "
                f"Pass local_max_bytes of at least {fixed + 2 * largest}."
            )
        tag = f"{_tag(manifest)}-r{rows}-h{heap_piece}"
        return cls(rows, heap_piece, row_bytes, capacity, heap_size, fixed, usable, tag)

    @property
    def n_column_pieces(self) -> int:
        return -(-self.capacity // self.rows_per_piece) if self.row_bytes else 0

    def rows_of(self, p: int) -> tuple[int, int]:
        a = p * self.rows_per_piece
        return a, min(a + self.rows_per_piece, self.capacity)

    def piece_size(self, key: tuple) -> int:
        kind, p = key
        if kind == "c":
            a, b = self.rows_of(p)
            return (b - a) * sum(self.row_bytes)
        return min(self.heap_piece, self.heap_size - p * self.heap_piece)


# -- the shared local area -----------------------------------------------------------------------


# Lock files open in this process. A forked child (a DataLoader worker) inherits their descriptors,
# and a flock lasts while any copy is open: the child closes its copies at once, or a lock held by
# the prefetch thread at fork time would never be released.
_open_locks: set = set()
_open_locks_guard = threading.Lock()


def _close_inherited_locks() -> None:
    for fd in _open_locks:
        with contextlib.suppress(OSError):
            os.close(fd)
    _open_locks.clear()
    _open_locks_guard.release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_open_locks_guard.acquire, after_in_parent=_open_locks_guard.release,
                        after_in_child=_close_inherited_locks)


@contextlib.contextmanager
def _flock(path: str):
    # flock locks belong to an open file description: they exclude threads of this process too
    # (each acquisition opens the file anew) and have no false deadlock reports across threads.
    with _open_locks_guard:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        _open_locks.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        with _open_locks_guard:
            _open_locks.discard(fd)
            os.close(fd)  # releases the lock


def _area_lock(root: str):
    return _flock(os.path.join(root, "area.lock"))


def _gen_path(root: str) -> str:
    return os.path.join(root, "area.gen")


def _bump_generation(root: str) -> None:
    """Count an eviction (caller holds the area lock): processes then drop maps of deleted pieces."""
    path = _gen_path(root)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        raw = os.pread(fd, 8, 0)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
        os.pwrite(fd, (n + 1).to_bytes(8, "little"), 0)
    finally:
        os.close(fd)


def _top_usage(d: str, seen: set | None = None) -> int:
    # Counted by inode: a piece being renamed into place may show up under both names in one scan.
    seen = set() if seen is None else seen
    total = 0
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            if e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += _rounded(st.st_size)
        except FileNotFoundError:
            continue
    return total


def area_usage(root: str) -> int:
    """Bytes the local area at ``root`` holds (each file rounded up to 4 KiB).

    Example:
        >>> import tempfile
        >>> area_usage(tempfile.mkdtemp())
        0
    """
    seen: set = set()
    return _top_usage(root, seen) + _top_usage(os.path.join(root, "pieces"), seen)


# -- the store -----------------------------------------------------------------------------------


class ReadThroughStore(fmt.Store):
    """The sample store of a read-through cache in one process (the engine's store protocol).

    Also: :meth:`prefetch` (fetch ahead in a background thread), :meth:`local_bytes`, and
    ``counters`` (this process's ``fetched``, ``fetched_bytes``, ``prefetched``, ``on_demand``,
    ``refetched``, ``evicted``, ``retried``, ``max_local_bytes``).

    Example:
        >>> ReadThroughStore.row_crc([b"abc"]) == __import__("zlib").crc32(b"abc")
        True
    """

    def __init__(self, location: ReadThroughLocation, meta: dict, manifest: dict, *, writable: bool):
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
        self._generation = self._read_generation()
        self._good: set = set()  # pieces whose fetched bytes passed every sample's checksum here
        self._ever: set = set()
        self._lock = threading.Lock()
        self.counters = dict(fetched=0, fetched_bytes=0, prefetched=0, on_demand=0, refetched=0, evicted=0,
                             retried=0, max_local_bytes=0)
        self._queue: deque = deque()
        self._queued: set = set()
        self._cv = threading.Condition()
        self._thread = None
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

    def missing(self, idx: np.ndarray | None = None) -> np.ndarray:
        idx = np.arange(self.length) if idx is None else np.asarray(idx, dtype=np.int64)
        return idx[self.admitted(idx) & ~self.is_stored(idx)]

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
            _stamp(self._path(("c", int(sorted_pieces[s]))))
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
            _stamp(self._path(("h", q)))
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
        gen = self._read_generation()
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

    def _read_generation(self) -> int:
        try:
            with open(_gen_path(self.root), "rb") as f:
                return int.from_bytes(f.read(8), "little")
        except FileNotFoundError:
            return 0

    def _path(self, key: tuple) -> str:
        return os.path.join(self.root, "pieces", f"{self.geometry.tag}-{key[0]}{key[1]:07d}.bin")

    # -- fetching --------------------------------------------------------------------------------

    def _fs(self):
        if self._fs_obj is None:
            self._fs_obj, self._rroot = _fs(*self._fs_args)
        return self._fs_obj

    def _ensure(self, key: tuple, *, prefetch: bool) -> str:
        """The local path of piece ``key``, fetching it unless some process already has."""
        path = self._path(key)
        if os.path.exists(path):
            return path
        stripe = (2 * key[1] + (key[0] == "h")) % _STRIPES  # the same in every process (no str hash)
        with _flock(os.path.join(self.root, "locks", f"{stripe}.lock")):
            if os.path.exists(path):
                return path  # another process or thread fetched it while we waited
            data = self._fetch_verified(key)
            tmp = self._reserve(key, len(data))
            try:
                with open(tmp, "r+b") as f:
                    f.write(data)
                _stamp(tmp)
                # Under the area lock, like every change to the pieces directory: a directory scan
                # racing a rename can miss the file under both names and count too little.
                with _area_lock(self.root):
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
        crc = fmt.batch_crc([v[pos] for v in views], len(pos))
        return bool((crc == self._crc[samples[pos]]).all())

    def _reserve(self, key: tuple, nbytes: int) -> str:
        """Make room for ``nbytes`` (evicting least recently used pieces); return a temporary file of that size."""
        pieces = os.path.join(self.root, "pieces")
        tmp = os.path.join(pieces, f".{os.path.basename(self._path(key))}.{os.getpid()}.{threading.get_ident()}.tmp")
        need = _rounded(nbytes)
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            with _area_lock(self.root):
                used = _top_usage(self.root)
                evictable = []
                for e in os.scandir(pieces):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    if e.name.endswith(".tmp"):
                        pid = _tmp_pid(e.name)
                        if pid is not None and not process_alive(pid):
                            os.unlink(e.path)  # left by a process that died mid-fetch
                            continue
                    else:
                        evictable.append((st.st_mtime_ns, _rounded(st.st_size), e.path))
                    used += _rounded(st.st_size)
                evicted = 0
                for _, size, path in sorted(evictable):  # least recently used first
                    if used + need <= self.limit:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    used -= size
                    evicted += 1
                if evicted:
                    _bump_generation(self.root)
                    with self._lock:
                        self.counters["evicted"] += evicted
                if used + need <= self.limit:
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                    try:
                        os.ftruncate(fd, nbytes)  # counted at its full size from now on
                    finally:
                        os.close(fd)
                    with self._lock:
                        self.counters["max_local_bytes"] = max(self.counters["max_local_bytes"], used + need)
                    return tmp
            if time.monotonic() > deadline:
                raise OSError(f"the local area {self.root} (local_max_bytes={self.limit}) stayed full of pieces being "
                              f"fetched by other processes for {WAIT_SECONDS:.0f} s; give it more room (local_max_bytes) "
                              "or read with fewer processes.")
            time.sleep(0.05)

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
                size = _rounded(self.geometry.piece_size(key))
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
            self._cv.notify()
        return queued

    def _prefetch_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    if not self._cv.wait(timeout=30):
                        return  # idle: the next prefetch() starts a new thread
                if self._closed:
                    return
                key = self._queue.popleft()
            try:
                self._ensure(key, prefetch=True)
            except Exception as e:  # noqa: BLE001 - kept for the caller; the read that needs the piece raises
                self.prefetch_error = e
            finally:
                with self._cv:
                    self._queued.discard(key)

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


def _stamp(path: str) -> None:
    """Mark a piece used now: its mtime orders eviction across processes (least recently used first).

    The time is given explicitly: the kernel stamps files with a coarse clock (one tick is several
    milliseconds), which would make the pieces of consecutive batches look equally old.
    """
    now = time.time_ns()
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, ns=(now, now))


def _tmp_pid(name: str) -> int | None:
    parts = name.split(".")
    try:
        return int(parts[-3])
    except (IndexError, ValueError):
        return None


def store_of(dataset) -> ReadThroughStore:
    """The read-through store of ``dataset`` in this process (opened on first use).

    Raises:
        TypeError: ``dataset`` is not a ``CachedDataset`` opened with ``local_max_bytes=``.

    Example:
        >>> import pytest
        >>> with pytest.raises(TypeError):
        ...     store_of([1, 2, 3])
    """
    from .dataset import CachedDataset

    store = dataset._files if isinstance(dataset, CachedDataset) else None  # noqa: SLF001 - the engine's per-process store
    if not isinstance(store, ReadThroughStore):
        raise TypeError(f"{dataset!r} is not a read-through cache: open it with nbkit.CachedDataset.open(url, "
                        "local_max_bytes=N) (or CachedDataset(source, url, local_max_bytes=N)).")
    return store


# -- the sampler ---------------------------------------------------------------------------------


class PrefetchSampler(torch.utils.data.Sampler):
    """Sample a read-through cache in windows of pieces, fetching the next window while one is read.

    Each epoch puts the cache's pieces in random order and cuts that order into windows of about
    ``window_bytes`` (default: a third of the local area); samples are shuffled within a window.
    So every piece is fetched about once an epoch, and the mixing is over a window's samples
    rather than the whole dataset (as with webdataset's shard shuffle). Halfway through a window,
    the next window's pieces are queued for the store's prefetch thread (in the main process; with
    DataLoader workers the pieces land in the shared local area, where the workers find them).

    Args:
        dataset: a ``CachedDataset`` opened with ``local_max_bytes=``.
        shuffle: ``False`` reads in index order (still prefetching ahead).
        seed: the order is a function of ``(seed, epoch)``; ``None`` picks a random seed once. Each
            iteration moves to the next epoch; :meth:`set_epoch` sets it explicitly.
        window_bytes: bytes of pieces per window.

    Example:
        >>> import os, tempfile, torch, nbkit
        >>> from unittest import mock
        >>> src = torch.utils.data.TensorDataset(torch.randn(2000, 64))     # 512 KB of rows
        >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
        >>> _ = nbkit.push(ds.root, "memory://doctest/sampler")
        >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):
        ...     rt = nbkit.CachedDataset.open("memory://doctest/sampler", local_max_bytes=256 << 10)
        >>> sampler = PrefetchSampler(rt, seed=0)
        >>> sorted(sampler) == list(range(2000)), len(sampler.windows()) > 1
        (True, True)
    """

    def __init__(self, dataset, *, shuffle: bool = True, seed: int | None = None, window_bytes: int | None = None):
        self.dataset = dataset
        store = store_of(dataset)
        self.shuffle = shuffle
        self.seed = int(np.random.SeedSequence().entropy % (2**32)) if seed is None else int(seed)
        self.window_bytes = int(window_bytes) if window_bytes else max(1, store.geometry.usable // 3)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of epoch ``epoch`` next (call it each epoch, as with ``DistributedSampler``)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def windows(self) -> list:
        """This epoch's windows: a list of index arrays, in the order they are read."""
        store = store_of(self.dataset)
        return plan_windows(store, np.random.default_rng([self.seed, self.epoch]), self.window_bytes, self.shuffle)

    def __iter__(self):
        store = store_of(self.dataset)
        windows = self.windows()
        self.epoch += 1
        for w, win in enumerate(windows):
            order = win.tolist()
            half = len(order) // 2
            if w == 0:
                store.prefetch(win)
            yield from order[:half]
            if w + 1 < len(windows):
                store.prefetch(windows[w + 1])  # halfway through this window
            yield from order[half:]


def plan_windows(store: ReadThroughStore, rng, window_bytes: int, shuffle: bool = True) -> list:
    """Group every index by the piece it lives in, order the pieces, cut them into windows of about
    ``window_bytes``, shuffle within each window (see :class:`PrefetchSampler`)."""
    n = store.length
    if n == 0:
        return []
    g = store.geometry
    idx = np.arange(n)
    key = np.full(n, -1, dtype=np.int64)  # -1: no piece (not stored, or outside a byte budget)
    stored = store._stored  # noqa: SLF001 - same module
    flags = store._flags  # noqa: SLF001
    if store.n_columns:
        rows = idx if store.slot_of is None else store.slot_of
        col = stored & ((flags & fmt.FLAG_FREEFORM) == 0) & (rows >= 0)
        key[col] = rows[col] // g.rows_per_piece
    base = g.n_column_pieces
    free = stored & ((flags & fmt.FLAG_FREEFORM) != 0)
    key[free] = base + store._off[free].astype(np.int64) // g.heap_piece  # noqa: SLF001
    order = np.argsort(key, kind="stable")
    sorted_keys = key[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    groups = np.split(order, starts[1:])
    loose = np.zeros(0, np.int64)
    if sorted_keys[0] == -1:
        loose, groups = groups[0], groups[1:]
    keys = [int(key[grp[0]]) for grp in groups]
    heap_bytes = np.zeros(n, np.int64)
    var = stored & ((flags & fmt.FLAG_VAR) != 0)
    heap_bytes[var] = store._len[var].astype(np.int64)  # noqa: SLF001
    cost = [_rounded(g.piece_size(("c", k))) + int(heap_bytes[grp].sum()) if k < base else g.heap_piece
            for k, grp in zip(keys, groups)]
    perm = rng.permutation(len(groups)) if shuffle else np.arange(len(groups))
    windows, current, size = [], [], 0
    for j in perm:
        if current and size + cost[j] > window_bytes:
            windows.append(np.concatenate(current))
            current, size = [], 0
        current.append(groups[j])
        size += cost[j]
    if current:
        windows.append(np.concatenate(current))
    if len(loose):
        if not windows:
            windows = [np.zeros(0, np.int64)]
        loose = rng.permutation(loose) if shuffle else loose
        parts = np.array_split(loose, len(windows))
        windows = [np.concatenate([w, p]) for w, p in zip(windows, parts)]
    if shuffle:
        windows = [rng.permutation(w) for w in windows]
    else:
        windows = [np.sort(w) for w in windows]
    return windows
