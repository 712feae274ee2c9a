"""The nbkit cache format (version 1): file names, index records, flags, CRCs, metadata, and the one
checksum check every sample store (:class:`nbkit.stores.base.Store`) goes through.

A cache is ``nbkit.json``, ``index.bin``, ``col-<k>.bin`` and ``heap.bin`` (``docs/DESIGN.md``,
"On-disk format"); its memory-mapped files are :class:`nbkit.cachedir.CacheFiles`, and a store
elsewhere (Redis, a bucket read through) keeps the same records, so :func:`verify` checks every
backend's samples the same way.

Example:
    >>> from nbkit.format import META, RECORD, row_crc
    >>> META, RECORD.itemsize, row_crc([b"abc"]) == __import__("zlib").crc32(b"abc")
    ('nbkit.json', 24, True)
"""

from __future__ import annotations

import errno
import json
import os
import zlib

import numpy as np

from . import trust
from .codec import Schema, storage_dtype
from .gather import crc_rows, pool, spans
from .errors import CorruptCacheError, StaleCacheError
from .commit import atomic_write
from .progress import as_callback
from .text import fix, format_list

__all__ = ["META", "INDEX", "HEAP", "LOCK", "RECORD", "VERSION", "list_cache_files", "read_meta",
           "parse_meta", "publish_meta", "row_crc", "batch_crc", "sample_crcs", "verify", "verify_store", "read_blob_or_none",
           "META_SPEC", "consistent_flags", "Rows", "ROWS_MIN_BYTES"]

FORMAT_NAME = "nbkit-cache"
VERSION = 1
META = "nbkit.json"
INDEX = "index.bin"
HEAP = "heap.bin"
LOCK = "heap.lock"

EMPTY, STORED = 0, 1
FLAG_VAR = 1  # conforming sample with var leaves in the heap
FLAG_FREEFORM = 2  # whole sample is a free-form blob in the heap
#: Never written: a store sets it in ``flags_of`` for a record it cannot trust (an unknown state),
#: and :func:`verify` fails every record with it or any other unknown bit, like a bad checksum.
FLAG_DAMAGED = 0x80

RECORD = np.dtype([("state", "u1"), ("flags", "u1"), ("pad", "<u2"), ("crc", "<u4"), ("off", "<u8"), ("len", "<u8")])


def column_file(k: int) -> str:
    return f"col-{k}.bin"


def list_cache_files(root: str, meta: dict | None = None) -> list[str]:
    """Names of the data files of the cache at ``root``, metadata last (the order to copy them in).

    Every name comes from the fixed pattern (:data:`nbkit.trust.CACHE_FILE`), never from the
    metadata's text, and a file that is a symbolic link is refused (:func:`nbkit.trust.cache_file_path`).
    """
    meta = read_meta(root) if meta is None else meta
    names = [INDEX] + [column_file(k) for k in range(len(meta["columns"]))]
    if os.path.lexists(os.path.join(root, HEAP)):
        names.append(HEAP)
    for name in names:
        trust.cache_file_path(root, name, os.path.join(root, META))
    return names + [META]


def read_meta(root: str) -> dict:
    """Parse and check ``root/nbkit.json``; ``FileNotFoundError`` if ``root`` holds no cache."""
    path = trust.cache_file_path(root, META, root)
    try:
        raw = trust.read_small(path)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no nbkit cache at {root} (it has no {META}). Create one with nbkit.CachedDataset(source, "
            f"{root!r}), or {fix('bring in a cache')}."
        ) from None
    return parse_meta(raw, path, f"To repair it, {fix('get a cache again')}.")


#: The most samples a cache may hold (its index is 24 bytes a sample).
MAX_LENGTH = 1 << 40
#: The most bytes a cache's columns may take (capacity x row bytes), far below int64's limit.
MAX_CACHE_BYTES = 1 << 56

_COLUMN_SPEC = trust.Obj({"file": trust.Str(max_len=64), "dtype": trust.Str(max_len=16),
                          "shape": trust.List(trust.Int(min=0, max=1 << 48), max_len=32)})
#: What ``nbkit.json`` holds. Fields a newer nbkit adds are kept as they are.
META_SPEC = trust.Obj({
    "format": trust.Str(choices=(FORMAT_NAME,)),
    "version": trust.Int(min=1, max=VERSION),
    "length": trust.Int(min=1, max=MAX_LENGTH),
    "schema": trust.AnyJSON(),  # checked by Schema.from_json
    "columns": trust.List(_COLUMN_SPEC, max_len=trust.MAX_COLUMNS),
    "fingerprint": trust.Obj({"type": trust.AnyJSON(), "length": trust.AnyJSON(), "transform": trust.AnyJSON(),
                              "samples": trust.Map(trust.Str(max_len=64), key=trust.Str(pattern="(?:0|[1-9][0-9]{0,15})"))},
                             required=()),
    "allow_pickle": trust.Bool(),
    "max_bytes": trust.Optional(trust.Int(min=0)),
    "capacity": trust.Optional(trust.Int(min=0, max=MAX_LENGTH)),
    "admit_seed": trust.Int(min=0, max=2**63 - 1),
    "generation": trust.Str(pattern="[0-9a-f]{32}", max_len=32),
}, required=("format", "version", "length", "schema", "columns", "fingerprint"))


def parse_meta(raw: bytes, where: str, fix: str) -> dict:
    """Parse and check cache metadata read from ``where``, all of it, in one place: every field
    against :data:`META_SPEC`, the schema (:meth:`nbkit.codec.Schema.from_json`), and the fields
    against each other (one column entry per column leaf, named ``col-<k>.bin``, of its dtype and
    shape; ``capacity <= length``; sizes that cannot overflow). Damage raises
    :class:`CorruptCacheError` naming ``where``, the field, and ending with ``fix``.

    Example:
        >>> parse_meta(b'{"format": "nbkit-cache", "version": 1, "length": 3, "schema": null,'
        ...            b' "columns": [], "fingerprint": {}}', "nbkit.json", "")["length"]
        3
        >>> parse_meta(b'{"format": "nbkit-cache", "version": 1, "length": "3", "schema": null,'
        ...            b' "columns": [], "fingerprint": {}}', "nbkit.json", "Re-create it.")
        Traceback (most recent call last):
        ...
        nbkit.errors.CorruptCacheError: nbkit.json is damaged: the field 'length' must be an integer >= 1 and <= 1099511627776, but holds '3'. Re-create it.
    """
    meta = trust.load_json(raw, where, fix, format_name=FORMAT_NAME, what="nbkit cache metadata", version=VERSION)
    meta = trust.check_json(meta, META_SPEC, where, fix)
    schema = Schema.from_json(meta["schema"], where, fix)

    def bad(field, what, got):
        raise CorruptCacheError(f"{where} is damaged: the field {field!r} must be {what}, but holds {trust.shown(got)}. {fix}")

    length, capacity = meta["length"], meta.get("capacity")
    if capacity is not None and capacity > length:
        bad("capacity", f"at most the length ({length})", capacity)
    columns = meta["columns"]
    if len(columns) != len(schema.columns):
        bad("columns", f"a list of {len(schema.columns)} entries (one per fixed-shape field of the schema)", columns)
    row_bytes = 0
    for k, (entry, leaf) in enumerate(zip(columns, schema.columns)):
        if entry["file"] != column_file(k):
            bad(f"columns[{k}].file", repr(column_file(k)), entry["file"])
        dtype = schema.column_dtype(leaf)
        try:
            same = storage_dtype("ndarray", entry["dtype"]) == dtype
        except CorruptCacheError:
            same = False
        if not same:
            bad(f"columns[{k}].dtype", f"{dtype.str!r} (the schema's dtype of that column)", entry["dtype"])
        if tuple(entry["shape"]) != leaf.shape:
            bad(f"columns[{k}].shape", f"{list(leaf.shape)} (the schema's shape of that column)", entry["shape"])
        row_bytes += schema.row_bytes(leaf)
    if (length if capacity is None else capacity) * row_bytes > MAX_CACHE_BYTES:
        bad("columns", f"columns of at most {MAX_CACHE_BYTES} bytes in all", "rows of " + str(row_bytes) + " bytes")
    return meta



def publish_meta(root: str, meta: dict, *, sync: bool = True) -> dict:
    """Create ``root/nbkit.json`` if absent (atomically); return whichever metadata won.

    Several processes may race to create the same cache: each writes a private temporary file and
    hard-links it into place, which fails if another got there first; the loser adopts the
    winner's metadata (the caller then compares fingerprints). ``sync=False`` (atomic, not durable)
    only for what is checked on use and made again when a power cut lost it (a local build's part).
    """
    atomic_write(os.path.join(root, META), json.dumps(meta, indent=1, sort_keys=True).encode(), exclusive=True, sync=sync)
    return read_meta(root)


def row_crc(rows, blob: bytes = b"") -> int:
    """CRC-32 of one sample: its column rows in order, then its heap blob (see :func:`batch_crc`)."""
    c = 0
    for r in rows:
        c = zlib.crc32(r, c)
    if blob:
        c = zlib.crc32(blob, c)
    return c


#: A heap blob longer than this is checked in pieces of this size before any memory is taken for
#: it: a record's length is a claim from the input (a sparse heap is as long as it says and holds nothing).
BLOB_PIECE = 16 << 20


def _crc_zeros(crc: int, n: int) -> int:
    """``zlib.crc32(bytes(n), crc)`` in ``O(log n)``: a hole of a sparse file reads as zeros, and
    appending zeros is a linear map of the CRC's register (the square-and-multiply of zlib's
    ``crc32_combine``)."""
    def times(mat, vec):
        out, k = 0, 0
        while vec:
            if vec & 1:
                out ^= mat[k]
            vec >>= 1
            k += 1
        return out

    def square(mat):
        return [times(mat, m) for m in mat]

    one_bit = [0xEDB88320] + [1 << k for k in range(31)]  # the register after one zero bit
    reg = crc ^ 0xFFFFFFFF
    bits = 8 * n
    mat = one_bit
    while bits:
        if bits & 1:
            reg = times(mat, reg)
        bits >>= 1
        if bits:
            mat = square(mat)
    return reg ^ 0xFFFFFFFF


def range_crc(fd: int, off: int, n: int, crc: int = 0) -> int | None:
    """CRC-32 (continuing ``crc``) of bytes ``off .. off + n`` of the file ``fd``, read in pieces of
    :data:`BLOB_PIECE` (holes of a sparse file computed, not read); ``None`` when the file ends first.

    Example:
        >>> import tempfile
        >>> f = tempfile.TemporaryFile(); _ = f.write(b"abc"); _ = f.truncate(1 << 20); f.flush()  # a hole after "abc"
        >>> range_crc(f.fileno(), 1, 1 << 19) == zlib.crc32(b"bc" + bytes((1 << 19) - 2))
        True
        >>> range_crc(f.fileno(), 1 << 19, 1 << 20) is None   # past the file's end
        True
    """
    pos, end = off, off + n
    if end > os.fstat(fd).st_size:
        return None
    seek = hasattr(os, "SEEK_DATA")
    while pos < end:
        data, data_end = pos, end
        if seek:
            try:
                data = min(os.lseek(fd, pos, os.SEEK_DATA), end)
                data_end = min(os.lseek(fd, data, os.SEEK_HOLE), end) if data < end else end
            except OSError as e:
                if e.errno != errno.ENXIO:  # EINVAL: this file system cannot tell; read every byte
                    seek = False
                    continue
                data = end  # ENXIO: nothing but a hole up to the file's end
        if data > pos:
            crc = _crc_zeros(crc, data - pos)
            pos = data
        while pos < data_end:
            piece = os.pread(fd, min(BLOB_PIECE, data_end - pos), pos)
            if not piece:
                return None
            crc = zlib.crc32(piece, crc)
            pos += len(piece)
    return crc


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


#: A column whose rows are at least this many bytes reaches a store that takes them
#: (:attr:`nbkit.stores.base.Store.takes_rows`) as :class:`Rows`, not stacked.
ROWS_MIN_BYTES = 64 << 10


class Rows:
    """The rows of one column as the samples' own arrays, not stacked into one batch array: what
    :meth:`~nbkit.stores.base.Store.put` gets for a column of large rows (at least
    :data:`ROWS_MIN_BYTES`) when the store takes them (``takes_rows``). The store writes each row
    from the sample's own memory; a stacked copy first costs a fresh batch-sized buffer (154 MB for
    256 decoded 224-px images), whose page faults cost a worker about as much as writing the rows
    into the page cache. Anything else (``np.asarray``) gets them stacked.

    Example:
        >>> rows = Rows([np.zeros(3, np.uint8), np.ones(3, np.uint8)])
        >>> len(rows), rows.nbytes, np.asarray(rows[np.array([1])]).tolist()
        (2, 6, [[1, 1, 1]])
        >>> batch_crc([rows], 2).tolist() == batch_crc([np.asarray(rows)], 2).tolist()
        True
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays):
        self.arrays = [np.ascontiguousarray(a) for a in arrays]

    def __len__(self) -> int:
        return len(self.arrays)

    def __getitem__(self, which) -> Rows:
        """The rows at ``which`` (indices, or a bool mask), as ``Rows``."""
        if isinstance(which, (int, np.integer)):
            return self.arrays[which]
        if isinstance(which, slice):
            return Rows(self.arrays[which])
        which = np.asarray(which)
        if which.dtype == bool:
            which = np.flatnonzero(which)
        arrays = self.arrays
        return Rows([arrays[int(i)] for i in which])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def __array__(self, dtype=None, copy=None):
        out = np.stack(self.arrays)
        return out if dtype is None else out.astype(dtype, copy=False)

    def crcs(self, start: np.ndarray | None = None) -> np.ndarray:
        """Each row's CRC-32, continued from ``start`` (one value per row)."""
        out = np.zeros(len(self.arrays), np.uint32) if start is None else np.array(start, dtype=np.uint32)
        for j, a in enumerate(self.arrays):
            out[j] = crc_rows(a.reshape(1, -1).view(np.uint8), out[j:j + 1])[0]
        return out

    def flat(self) -> list:
        """Each row as a 1-D ``uint8`` array on the sample's own memory (what a store writes)."""
        return [a.reshape(-1).view(np.uint8) for a in self.arrays]


def batch_crc(columns: list, n: int, blobs: dict | None = None, threads: int = 1) -> np.ndarray:
    """Per-sample CRC-32s of ``n`` samples given their gathered column rows (equal to ``row_crc``).

    The rows of all columns are laid side by side so each sample is one ``zlib.crc32`` call.
    ``blobs`` maps a position to the heap blob that follows that sample's rows. ``threads > 1``
    splits the rows over the gather pool (``zlib.crc32`` releases the GIL on large rows).
    """
    parts = spans(n, min(threads, n)) if threads > 1 and n else []
    if len(parts) > 1:
        with pool() as p:
            out = np.concatenate(list(p.map(lambda s: batch_crc([c[s[0]:s[1]] for c in columns], s[1] - s[0]), parts)))
        for j, blob in (blobs or {}).items():
            out[j] = zlib.crc32(blob, int(out[j]))
        return out.astype(np.uint32, copy=False)
    def flat(c):  # one row of bytes per sample
        return np.ascontiguousarray(c).reshape(n, c.size // n if n else 0).view(np.uint8)

    if any(isinstance(c, Rows) for c in columns):
        out = np.zeros(n, np.uint32)
        for c in columns:
            out = c.crcs(out) if isinstance(c, Rows) else crc_rows(flat(c), out)
    elif columns:
        parts = [flat(c) for c in columns]
        if len(parts) > 1 and sum(p.shape[1] for p in parts) <= 16384:
            # Small rows: lay them side by side, one call per sample. (Large rows: chain per column
            # rather than copy them.)
            parts = [np.concatenate(parts, axis=1)]
        out = crc_rows(parts[0])
        for p in parts[1:]:
            out = crc_rows(p, out)
    else:
        out = np.zeros(n, np.uint32)
    for j, blob in (blobs or {}).items():
        out[j] = zlib.crc32(blob, int(out[j]))
    return out


def incompatibilities(existing: dict, wanted: dict) -> list[str]:
    """How the cache metadata ``existing`` differs from ``wanted`` (a different source, another
    byte budget), one phrase each; empty when the cache was built from this source."""
    from .fingerprint import differences

    diffs = differences(existing["fingerprint"], wanted["fingerprint"])
    if existing.get("max_bytes") != wanted.get("max_bytes") and wanted.get("max_bytes") is not None:
        diffs.append(f"byte budget: cached max_bytes={existing.get('max_bytes')}, asked max_bytes={wanted.get('max_bytes')}")
    return diffs


def check_compatible(root: str, existing: dict, wanted: dict) -> None:
    """Raise :class:`StaleCacheError` if the cache metadata at ``root`` does not fit ``wanted``."""
    diffs = incompatibilities(existing, wanted)
    if diffs:
        raise StaleCacheError(
            f"the cache at {root} was built from a different source: " + "; ".join(diffs) + ". "
            "Use a new path for this source, or pass overwrite=True to replace the old cache with one of this source."
        )


def sample_crcs(columns: list, flags: np.ndarray, blobs: dict | None = None, threads: int = 1,
                column_crcs: np.ndarray | None = None) -> np.ndarray:
    """CRC-32 of each sample as stored: its column rows, then its variable-length blob; a free-form
    sample (``FLAG_FREEFORM``) is its blob alone. ``blobs`` maps a position to that sample's heap blob.
    ``column_crcs``: the CRC-32s of the samples' column rows when the read already took them.

    Example:
        >>> rows = np.arange(6, dtype=np.uint8).reshape(2, 3)
        >>> list(sample_crcs([rows], np.zeros(2, np.uint8))) == [row_crc([r]) for r in rows]
        True
    """
    blobs = blobs or {}
    n = len(flags)
    free = {m for m in blobs if flags[m] & FLAG_FREEFORM}
    chained = {m: b for m, b in blobs.items() if m not in free}
    if column_crcs is None:
        crc = batch_crc(columns, n, chained, threads=threads)
    else:
        crc = np.array(column_crcs, dtype=np.uint32)
        for m, b in chained.items():
            crc[m] = zlib.crc32(b, int(crc[m]))
    for m in free:
        crc[m] = row_crc([], blobs[m])
    return crc


def verify(store, idx: np.ndarray, *, columns: list | None = None, blobs: dict | None = None, threads: int = 1,
           column_crcs: np.ndarray | None = None) -> np.ndarray:
    """Which of the stored samples ``idx`` of ``store`` match their checksum (a bool per sample).

    Args:
        store: any :class:`nbkit.stores.base.Store` (local files, Redis, read-through).
        idx: stored sample indices (int64).
        columns: their column rows if already gathered (``store.gather(idx)``); read otherwise.
        blobs: ``position -> heap blob`` if already read; read otherwise (an unreadable blob fails).
        threads: split the checksums of large rows over the gather pool.
        column_crcs: the CRC-32s of the column rows, taken by the read on the bytes it read.
    """
    flags = store.flags_of(idx)
    if columns is None:
        columns = store.gather(idx)
    if blobs is None:
        blobs = {m: read_blob_or_none(store, int(idx[m])) for m in np.flatnonzero(flags & (FLAG_FREEFORM | FLAG_VAR)).tolist()}
    unreadable = [m for m, b in blobs.items() if b is None]
    if unreadable:
        blobs = {m: (b"" if b is None else b) for m, b in blobs.items()}
    ok = sample_crcs(columns, flags, blobs, threads=threads, column_crcs=column_crcs) == store.crc_of(idx)
    ok &= consistent_flags(flags, store.schema)
    ok[unreadable] = False
    return ok


def consistent_flags(flags: np.ndarray, schema) -> np.ndarray:
    """Which records' flags are what a writer of ``schema`` sets: free-form alone, or (for a sample
    that fits the schema) ``FLAG_VAR`` exactly when the schema has variable-length fields; anything
    else (unknown bits, ``FLAG_DAMAGED``) is a damaged record.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> consistent_flags(np.array([0, FLAG_FREEFORM, FLAG_DAMAGED], dtype=np.uint8), ds.store.schema).tolist()
        [True, True, False]
    """
    if schema.structure is None:
        return flags == FLAG_FREEFORM
    return (flags == FLAG_FREEFORM) | (flags == (FLAG_VAR if schema.has_var else 0))


def read_blob_or_none(store, i: int) -> bytes | None:
    """The heap blob of stored sample ``i``, or ``None`` when its record is damaged (it points past the
    heap, or the heap is missing): the sample then fails :func:`verify` like a bad checksum, and is
    recomputed from the source or reported."""
    try:
        return store.read_blob(i)
    except CorruptCacheError:
        return None


def verify_store(store, *, where: str, callback=None, verified: np.ndarray | None = None, chunk: int = 1024,
                 threads: int = 1, fix: str | None = None) -> int:
    """Check every stored sample of ``store`` against its checksum; return how many were checked.

    Args:
        store: the store to check.
        where: the cache's path or URL, for the error message.
        callback: progress in samples (any fsspec-style callback).
        verified: a bool array over all samples; those that pass are set ``True``.
        chunk: samples read at a time.
        threads: split the checksums of large rows over the gather pool.
        fix: what the error tells the user to do (default: recompute with the source, or copy again).

    Raises:
        CorruptCacheError: listing the first damaged samples.
    """
    cb = as_callback(callback)
    stored = np.flatnonzero(store.is_stored(np.arange(store.length)))
    cb.set_size(len(stored))
    cb.absolute_update(0)  # a callback may come from an earlier phase counted in other units (bytes)
    bad = []
    for start in range(0, len(stored), chunk):
        part = stored[start : start + chunk]
        # A run of consecutive rows of a memory-mapped store (every chunk of a complete cache) is
        # checked where it lies; otherwise gathered here and held until the next chunk's gather
        # (freeing the buffers first makes the allocator fault fresh pages in for every chunk: 1.5x slower).
        columns = _rows_in_place(store, part)
        if columns is None:
            columns = store.gather(part)
        ok = verify(store, part, columns=columns, threads=threads)
        if verified is not None:
            verified[part[ok]] = True
        bad.extend(int(i) for i in part[~ok])
        cb.relative_update(len(part))
    if bad:
        if fix is None:
            fix = "Re-create them by opening the cache with its source, or pull / import the cache again."
        raise CorruptCacheError(
            f"{len(bad)} sample(s) in the cache at {where} fail their checksum (indices {format_list(bad)}). {fix}".rstrip()
        )
    return len(stored)


def _rows_in_place(store, idx: np.ndarray) -> list | None:
    """Views of the column rows of ``idx`` in a memory-mapped store when they are one run of
    consecutive rows (no copy), else ``None``."""
    columns = store.columns
    if not store.memory_mapped or columns is None or not len(idx):
        return None
    rows = idx if store.slot_of is None else store.slot_of[idx]
    first, last = int(rows[0]), int(rows[-1])
    if last - first != len(rows) - 1 or not np.all(np.diff(rows) == 1):
        return None
    return [c[first:last + 1] for c in columns]
