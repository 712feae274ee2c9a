"""Merging a verified part into a local cache, then removing it. A placed part (a local build's:
its rows and blobs already in the cache's files, :class:`nbkit.cluster.part.PlacedStore`) has its
records linked into the cache's index (:func:`link_records`: O(records), no sample byte read or
written). A part holding its own files has its rows put into place in the column files, its blobs
appended to the heap, index records last (:func:`merge_rows`).

For a part holding its own files, every write goes through the cache's own :meth:`nbkit.cachedir.CacheFiles.put`: rows with ``pwrite``
at their offsets (a part is one contiguous slice of each column: one write per column per chunk,
read straight from the part's memory maps), heap blobs appended under the cache's lock with their
new offsets, and each record's ``state`` last, so a reader never trusts a half-merged sample. The
cache is synced (data, then index) before the part is removed. A kill at any point leaves every
sample stored and correct, or missing; the part stays until it is merged whole, and merging it again
skips what is already stored (idempotent). Two drivers never merge one part twice: each merge holds
the part's lock (:func:`nbkit.cluster.part.part_lock`) and finds it gone once the other removed it.

Example:
    >>> import os, torch, tempfile, pickle, nbkit
    >>> from nbkit.cluster.part import build_part, parts_dir
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
    >>> spec = dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=10, todo=np.arange(10), meta=ds.store.meta,
    ...             source=("pickled", "t", pickle.dumps(ds)))
    >>> name = build_part(spec)["name"]
    >>> merge(ds.store, os.path.join(parts_dir(ds.root), name)).merged, ds.missing().tolist()
    (10, [])
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from ..cachedir import CacheFiles
from ..commit import lock_or_raise
from .part import PartRefused, PlacedStore, flock_within, part_lock, placed_identity, read_part, remove_part

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

__all__ = ["MergeResult", "link_records", "merge", "merge_rows"]

#: Bytes of rows merged per ``put`` (bounds the memory a merge holds when rows must be gathered).
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class MergeResult:
    """What :func:`merge` did with one part.

    Attributes:
        merged: samples written into the cache.
        skipped: samples of the part the cache already held (an earlier, interrupted merge; a reader).
        refused: why the part was refused (it was removed), or ``""``.
        gone: the part was no longer there (another driver merged it).
    """

    merged: int = 0
    skipped: int = 0
    refused: str = ""
    gone: bool = False


def merge(cache, path: str, *, hashes: bool = True, fresh: bool = False) -> MergeResult:
    """Verify the part at ``path`` and merge it into ``cache`` (a writable
    :class:`nbkit.cachedir.CacheFiles`), then remove it; a part that does not verify is removed
    and reported (``refused``), never merged: so is a link under a part's name, another user's part,
    and a part whose lock another process holds past :data:`nbkit.commit.LOCK_SECONDS` (the
    wait is bounded). ``hashes=False``: the part's files are checked by size and every sample's CRC,
    not SHA-256 (parts of this machine's own workers: see :func:`read_part`). ``fresh``: the part was
    written by a worker of this process's build, since it started (its result just came back): a
    placed part's rows then need no second CRC pass here even if its worker left them unsynced (no power
    cut can have come between; the rows are made durable before any record); any other part's are
    checked (:func:`link_records`)."""
    try:
        with part_lock(path) as present:
            if not present:
                return MergeResult(gone=True)
            try:
                part = read_part(path, cache.meta, hashes=hashes)
            except PartRefused as e:
                return _refused(path, e)  # removed while the lock is held: no driver merges it meanwhile
            try:
                with _merging(os.path.dirname(os.path.abspath(path))):
                    merged, skipped = merge_rows(cache, part) if part.records is None else link_records(cache, part, fresh=fresh)
            finally:
                part.close()
            cache.sync()  # durable before the part goes: a power cut never loses both
            remove_part(path)
    except PartRefused as e:  # the lock's: a link, or held for good by another process
        return _refused(path, e)
    return MergeResult(merged=merged, skipped=skipped)


@contextlib.contextmanager
def _merging(parts: str):
    """One merge at a time into a cache, across drivers: an exclusive ``flock`` on its parts directory
    (``parts``), so two drivers merging overlapping parts (of two part sizes) never both find a sample
    missing and both append its blobs to the heap. The wait is bounded (:data:`nbkit.commit.LOCK_SECONDS`): past
    it the merge goes ahead unserialized, still exact (a sample is stored once; at worst its blob
    bytes are appended twice)."""
    try:
        fd = os.open(parts, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        yield  # no parts directory of ours to lock (a part merged from elsewhere)
        return
    try:
        flock_within(fd)
        yield
    finally:
        os.close(fd)  # releases the lock


def _refused(path: str, error: PartRefused) -> MergeResult:
    """Remove the refused part at ``path``; the reason, with the command that removes it if this user cannot."""
    try:
        remove_part(path)
    except OSError as e:
        return MergeResult(refused=f"{error} {e.strerror}")
    return MergeResult(refused=str(error))


def merge_rows(cache, part) -> tuple[int, int]:
    """Write the stored samples of the verified ``part`` that ``cache`` lacks into it; return
    ``(merged, skipped)``. Does not sync."""
    src = part.files
    local = np.flatnonzero(src.state == fmt.STORED)
    idx = local + part.start
    keep = cache.admitted(idx) & ~cache.is_stored(idx)
    skipped = int(len(idx) - keep.sum())
    local, idx = local[keep], idx[keep]
    row_bytes = max(1, sum(c.strides[0] for c in src.columns if c.ndim))
    step = max(1, CHUNK_BYTES // row_bytes)
    for s in range(0, len(idx), step):
        _merge_chunk(cache, src, local[s : s + step], idx[s : s + step])
    return int(len(idx)), skipped


def _merge_chunk(cache, src, local: np.ndarray, idx: np.ndarray) -> None:
    flags = src.flags[local].copy()
    crc = src.crc[local].copy()
    cpos = np.flatnonzero((flags & fmt.FLAG_FREEFORM) == 0)
    rows = local[cpos]
    if len(rows) and int(rows[-1]) - int(rows[0]) == len(rows) - 1:
        stacked = [c[int(rows[0]) : int(rows[-1]) + 1] for c in src.columns]  # views of the part's maps: no copy
    else:
        stacked = [c[rows] for c in src.columns]
    bpos = np.flatnonzero(flags & (fmt.FLAG_FREEFORM | fmt.FLAG_VAR))
    blobs = [src.read_blob(int(local[m])) for m in bpos]
    cache.put(idx, flags, crc, cpos, stacked if len(cpos) else [], bpos, blobs)


def link_records(cache, part, *, fresh: bool = False) -> tuple[int, int]:
    """Make the samples of the verified placed ``part`` (:class:`nbkit.cluster.part.PlacedStore`:
    its rows and blobs in ``cache``'s files already) visible: copy its records into ``cache``'s index,
    ``state`` last, for the samples the cache lacks; return ``(merged, skipped)``. O(records): no
    sample byte is read or written (its worker checked every CRC where the rows lie), unless its
    worker left the rows unsynced (``rows_synced``: this machine's workers) and the part is not
    ``fresh`` (see :func:`merge`: left by a build that ended, maybe before a power cut lost them):
    then one CRC pass over its rows here. Rows left unsynced are made durable before any record is
    written. Does not sync the index.

    Example:
        >>> import os, pickle, tempfile, torch, nbkit
        >>> from nbkit.cluster.part import build_part, parts_dir, read_part
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(6)), tempfile.mkdtemp())
        >>> spec = dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=6, todo=np.arange(6), meta=ds.store.meta,
        ...             source=("pickled", "t", pickle.dumps(ds)), placed=True, sync_rows=False)
        >>> part = read_part(os.path.join(parts_dir(ds.root), build_part(spec)["name"]), ds.store.meta, hashes=False)
        >>> link_records(ds.store, part), ds.missing().tolist()
        ((6, 0), [])

    Raises:
        PartRefused: its rows are in other files than ``cache``'s (the cache was replaced since the
            worker wrote them), or a record points past ``heap.bin``.
    """
    rec = part.records
    local = np.flatnonzero(rec["state"] == fmt.STORED)
    bounds = (part.start, part.stop)
    if not isinstance(cache, CacheFiles):
        raise PartRefused(f"the part {part.path} is refused: its rows were placed in a cache directory's files, and this "
                          "cache is not one. It is removed and its samples computed again.", bounds=bounds)
    used_heap = bool((rec["flags"][local] & (fmt.FLAG_FREEFORM | fmt.FLAG_VAR)).any())
    idx = local + part.start
    keep = cache.admitted(idx) & ~cache.is_stored(idx)
    skipped = int(len(idx) - keep.sum())
    local, idx = local[keep], idx[keep]
    if not len(idx):
        return 0, skipped
    r = rec[local]
    heapy = (r["flags"] & (fmt.FLAG_FREEFORM | fmt.FLAG_VAR)) != 0
    if heapy.any():
        heap = os.fstat(cache.data_fds()[fmt.HEAP]).st_size if fmt.HEAP in cache.data_fds() else 0
        if int((r["off"][heapy] + r["len"][heapy]).max()) > heap:
            raise PartRefused(f"the part {part.path} is refused: a record points past the {heap} bytes of the cache's "
                              f"{fmt.HEAP}. It is removed and its samples computed again.", bounds=bounds)
    moved = placed_identity(cache, used_heap) != part.placed
    if moved or not (part.rows_synced or fresh):
        # Not the files the worker wrote into and checked (the cache directory was copied, or a copy
        # swapped in by a pull or an import), or rows a worker of an earlier build left unsynced (a
        # power cut since may have lost them): the rows are checked here, where they are now, once.
        check = PlacedStore(cache, part.start, part.stop)
        check.records["state"][local] = fmt.STORED
        for f in ("flags", "crc", "off", "len"):
            check.records[f][local] = r[f]
        try:
            check.verify()
        except PartRefused as e:
            why = (f"its rows were placed in other files than the cache's at {cache.root} now (the cache was replaced "
                   "since) and" if moved else "its rows, left unsynced by a build that ended (a power cut?),")
            raise PartRefused(f"the part {part.path} is refused: {why} do not check there: {e}", bounds=bounds) from e
    if not part.rows_synced:
        cache.sync_data()  # rows durable before any record of them (the kernel writes index pages back at will)
    fd = cache.data_fds()[fmt.INDEX]
    # As CacheFiles.put: a push (frozen) sees all of this or none.
    lock_or_raise(fd, os.path.join(cache.root, fmt.INDEX), shared=True,
                  why="nbkit holds it exclusively while it pushes or exports the cache")
    try:
        cache.off[idx] = r["off"]
        cache.len[idx] = r["len"]
        cache.flags[idx] = r["flags"]
        cache.crc[idx] = r["crc"]
        cache.state[idx] = fmt.STORED  # last: a reader trusts a record only once it says stored
    finally:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
    return int(len(idx)), skipped
