"""One part of a cache build: a contiguous index range ``[start, stop)`` written as a small nbkit
cache of that slice, checked before anything of it is merged.

A part lives at ``<parts>/part-<start>-<stop>`` (13-digit zero-padded bounds: a retried build of the
same range is a copy of the same part). It is an ordinary cache directory (``nbkit.json``,
``index.bin``, ``col-<k>.bin``, ``heap.bin``) of length ``stop - start`` with the cache's schema and
columns (slot = index - start), so ``nbkit ls``, ``nbkit info``, ``nbkit verify`` and ``nbkit rm``
work on it unchanged. Its ``nbkit.json`` carries one more field, ``part``: the cache it belongs to
(generation, length), its range, and the size and SHA-256 of every data file (the part manifest).

A local build's part is **placed** (:class:`PlacedStore`): its worker writes the rows and blobs
straight into the cache's own files, at their final places, and the part holds only its records
(``index.bin``; ``part.placed`` in its ``nbkit.json``), which the merge links into the cache's index:
each sample is written once, and no sample byte passes through the driver.

A worker builds a part in a claimed staging sibling (``.part-….nbkit-build-<hex>``: listed by
``nbkit ls`` and removed by ``nbkit rm`` if the worker dies), through the cache's own compute path
(:meth:`nbkit.CachedDataset.compute_and_store` into a :class:`PartStore`), so samples are encoded
exactly as a warmup encodes them; ``nbkit.json`` is published last, then the directory is renamed
into place. The first whole copy wins: a rename onto a part already there fails, and the copy is
discarded. Everything about a part is read as untrusted input: :func:`read_part` parses its metadata
with :data:`PART_SPEC`, checks it against the cache, hashes every file and checks every sample's CRC.

A part is taken only from a parts directory of the user who runs the build (made ``0700``, owned by
this process's user: :func:`open_parts_dir`), and only when the part and every file in it are that
user's too: a part another user planted in a shared directory is refused, however well it is made.
A part that is a link, holds a link, a subdirectory or anything but its files, or whose lock another
process holds past :data:`LOCK_SECONDS`, is refused, removed (renamed aside, then removed without
recursion) and built again: never followed, never waited for without end.

Example:
    >>> part_name(0, 4096), parse_part_name("part-0000000004096-0000000008192")
    ('part-0000000000000-0000000004096', (4096, 8192))
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import os
import pickle
import re
import shlex
import socket
import stat
import tempfile
import time
from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from .. import trust
from ..cachedir import PART_DIGITS, PART_NAME, CacheFiles
from ..commit import (CHUNK, LOCK_SECONDS, Dir, claim, flock_within, is_claimed, leftover_of, makedirs, release,
                      staging_name, write_all)
from ..errors import CorruptCacheError
from ..stores.base import Store

try:
    import fcntl
except ImportError:  # Windows: no flock; merges are still idempotent
    fcntl = None

__all__ = ["LOCK_SECONDS", "PART_SPEC", "PartRefused", "PartStore", "PlacedStore", "VerifiedPart", "build_part", "list_parts",
           "open_parts_dir", "open_target", "part_generation", "part_name", "parse_part_name", "parts_dir", "part_lock",
           "placed_identity", "read_part", "remote_parts", "remove_part", "sweep_builds"]

#: Where a local cache's parts live: beside it, ``<cache>.parts`` (see :func:`parts_dir`).
PARTS_SUFFIX = ".parts"
#: Samples a worker computes and stores at a time inside one part.
CHUNK_SAMPLES = 256
#: The names a part directory holds: its files (manifest-checked) and the lock its heap appends took.
_PART_ENTRY = re.compile(r"(?:nbkit\.json|index\.bin|heap\.bin|heap\.lock|col-(?:0|[1-9][0-9]{0,3})\.bin)\Z")

# sha256 is left out by local workers (see build_part's ``hashes``); a driver that wants it refuses a part without it.
_FILE_SPEC = trust.Obj({"size": trust.Int(min=0, max=fmt.MAX_CACHE_BYTES), "sha256": trust.Str(pattern="[0-9a-f]{64}", max_len=64)},
                       required=("size",))
#: The ``part`` field of a part's ``nbkit.json``: which cache, which range, and its files.
PART_SPEC = trust.Obj({
    "cache_generation": trust.Str(pattern="[0-9a-f]{32}", max_len=32),
    "cache_length": trust.Int(min=1, max=fmt.MAX_LENGTH),
    "start": trust.Int(min=0, max=fmt.MAX_LENGTH),
    "stop": trust.Int(min=1, max=fmt.MAX_LENGTH),
    "files": trust.Map(_FILE_SPEC, key=trust.Str(pattern=r"(?:index\.bin|heap\.bin|col-(?:0|[1-9][0-9]{0,3})\.bin)", max_len=16),
                       max_len=trust.MAX_COLUMNS + 2),
    # A placed part (its rows already in the cache's files): which files, by identity (placed_identity).
    "placed": trust.Str(pattern="[0-9a-f]{32}", max_len=32),
    # Whether its worker synced the rows before publishing (a worker of another machine); if not (this
    # machine's workers), the merge syncs them before linking, and checks them again if the part is
    # not its own build's (a power cut may have come between).
    "rows_synced": trust.Bool(),
}, required=("cache_generation", "cache_length", "start", "stop", "files"))


class PartRefused(CorruptCacheError):
    """A part that does not verify (damaged, of another cache, another schema or range): it is
    removed and its range computed again.

    Attributes:
        bounds: ``(start, stop)`` of the part refused, when the check knew it (it travels with the
            error from a worker to the driver).
    """

    def __init__(self, message: str, bounds: tuple | None = None):
        super().__init__(message)
        self.bounds = None if bounds is None else (int(bounds[0]), int(bounds[1]))

    def __reduce__(self):
        return (type(self), (str(self), self.bounds))


def part_name(start: int, stop: int) -> str:
    """The directory name of the part ``[start, stop)``."""
    return f"part-{int(start):0{PART_DIGITS}d}-{int(stop):0{PART_DIGITS}d}"


def parse_part_name(name: str) -> tuple[int, int] | None:
    """``(start, stop)`` of a part's directory name, or ``None`` for any other name (or an empty range)."""
    m = PART_NAME.match(name)  # the one pattern, nbkit.cachedir's (nbkit ls lists parts by it)
    if m is None:
        return None
    start, stop = int(m["start"]), int(m["stop"])
    return (start, stop) if start < stop else None


def parts_dir(cache_root: str) -> str:
    """The directory of a local cache's parts: ``<cache>.parts``, beside the cache.

    Beside, not inside: the cache directory stays exactly the nbkit format (readers, tars and pushes
    see nothing new), and ``nbkit ls`` lists each part and each interrupted build there (a search
    never looks inside a cache).

    Example:
        >>> parts_dir("/data/mnist")
        '/data/mnist.parts'
    """
    return os.path.abspath(cache_root).rstrip(os.sep) + PARTS_SUFFIX


def _uid() -> int | None:
    """The user parts must belong to: this process's (``None`` where the system has no users)."""
    return os.geteuid() if hasattr(os, "geteuid") else None


def open_parts_dir(parts: str, *, create: bool = False) -> Dir | None:
    """The parts directory ``parts`` held open (:class:`nbkit.commit.Dir`), once it is checked to
    be a directory (not a link) of this process's user; ``None`` if absent and not ``create``.
    ``create`` makes it ``0700``: in a shared place (``/tmp``, a team mount) no other user can list,
    plant, lock or replace what is inside.

    Raises:
        PermissionError: it belongs to another user (made by someone else before this build): no
            part in it is taken. The message gives the command that removes it.
        nbkit.UnsafeArchiveError: it is a symbolic link (never followed).

    Example:
        >>> import tempfile
        >>> with open_parts_dir(tempfile.mkdtemp() + "/c.parts", create=True) as d:
        ...     oct(os.fstat(d.fd).st_mode & 0o777)
        '0o700'
    """
    for attempt in range(3 if create else 1):
        if create:
            makedirs(os.path.dirname(os.path.abspath(parts)))
            with contextlib.suppress(FileExistsError):
                os.mkdir(parts, 0o700)
        try:
            d = Dir(parts)
            break
        except FileNotFoundError:
            if not create:
                return None
            if attempt == 2:  # removed again and again meanwhile (nbkit rm of the parts)
                raise
    owner, me = os.fstat(d.fd).st_uid, _uid()
    if me is not None and owner != me:
        d.close()
        raise PermissionError(errno.EPERM, (
            f"the parts directory {parts} belongs to another user (uid {owner}; this process runs as uid {me}): nbkit "
            "takes parts only from a directory of the user who runs the build, so none of it is merged or written. Ask "
            f"its owner to remove it (rm -r {shlex.quote(parts)}), or build the cache in a directory of your own"), parts)
    return d


def list_parts(parts: str) -> list[str]:
    """Paths of the whole parts in the directory ``parts`` (names of the part pattern), in index order.

    Raises:
        PermissionError: ``parts`` belongs to another user (:func:`open_parts_dir`).
    """
    try:
        d = open_parts_dir(parts)
    except NotADirectoryError:  # something else in the way: it fails the builds, which say what
        return []
    if d is None:
        return []
    with d:
        names = d.names()
    found = sorted((parse_part_name(n), n) for n in names if parse_part_name(n) is not None)
    return [os.path.join(parts, n) for _, n in found]


class PartStore(CacheFiles):
    """The files of one part, addressed by the cache's indices: ``put(idx, …)`` stores sample ``i``
    at slot ``i - start``. The engine's own compute path writes into it as into the cache.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
        >>> meta = part_meta(ds.store.meta, 4, 8)
        >>> store = PartStore(tempfile.mkdtemp(), meta, 4, writable=True, create=True)
        >>> with ds.writing_into(store):
        ...     _ = ds.compute_and_store(np.array([5, 6]))
        >>> store.state.tolist()
        [0, 1, 1, 0]
        >>> store.close()
    """

    def __init__(self, root: str, meta: dict, start: int, *, writable: bool, create: bool = False):
        super().__init__(root, meta, writable=writable, create=create)
        self.start = int(start)

    #: The ``OSError`` a write into the part met (the storage's, not the source's), if any.
    failed = None

    def put(self, idx, flags, crc, cpos, stacked, bpos, blobs):
        try:
            return super().put(np.asarray(idx, dtype=np.int64) - self.start, flags, crc, cpos, stacked, bpos, blobs)
        except OSError as e:
            self.failed = e
            raise


def part_meta(cache_meta: dict, start: int, stop: int) -> dict:
    """The metadata of a part of the cache ``cache_meta`` (without its ``part`` field, which names its files)."""
    meta = {k: v for k, v in cache_meta.items() if k not in ("capacity", "max_bytes", "admit_seed", "part")}
    meta.update(length=int(stop) - int(start), generation=part_generation(cache_meta.get("generation"), start, stop))
    return meta


def part_generation(cache_generation, start: int, stop: int) -> str:
    """The generation of the part ``[start, stop)`` of the cache generation ``cache_generation``:
    derived, so every copy of one part is the same build of it, and a part renamed to another range
    (its range fields edited to match) no longer matches it (:func:`read_part` checks it).

    Example:
        >>> part_generation("0" * 32, 0, 8) == part_generation("0" * 32, 8, 16)
        False
    """
    return hashlib.sha256(f"{cache_generation}:{int(start)}:{int(stop)}".encode()).hexdigest()[:32]


# -- building (the worker's side) -------------------------------------------------------------------

#: Sources already unpickled in this worker process, by token: a part build unpickles its source once.
_SOURCES: dict = {}


def preload_source(source: tuple) -> None:
    """Load the build's source in this worker process before any part asks for it
    (:meth:`nbkit.cluster.engine.Engine.share`): the parts then carry only its token.

    Example:
        >>> import pickle
        >>> preload_source(("pickled", "doc-token", pickle.dumps([1, 2, 3])))
        >>> _dataset({"source": ("shared", "doc-token", None)})
        [1, 2, 3]
    """
    _dataset({"source": source, "cache": None, "meta": {}})


def has_source(token: str) -> bool:
    """Whether this worker process has loaded the source of ``token`` (:func:`preload_source`).

    Example:
        >>> preload_source(("pickled", "here-token", pickle.dumps([1]))); has_source("here-token")
        True
    """
    return token in _SOURCES


def forget_source(token: str) -> None:
    """Drop the source loaded under ``token`` from this worker process (an engine's cleanup).

    Example:
        >>> preload_source(("pickled", "gone-token", pickle.dumps([1])))
        >>> forget_source("gone-token"); "gone-token" in _SOURCES
        False
    """
    _SOURCES.pop(token, None)


def _dataset(spec: dict):
    kind, token, payload = spec["source"]
    cached = _SOURCES.get(token)
    if cached is None:
        if kind == "shared":
            raise RuntimeError("this worker process has not loaded the build's source (Engine.share): a worker started "
                               "without it; run the build again")
        if kind == "object":  # inherited through a fork (Engine.inherits): the driver's own handle, no copy
            cached = payload
        elif kind == "pickled":
            cached = pickle.loads(payload)
        else:
            factory, dataset_class = payload  # the class travels by reference: no import of the engine here
            made = factory()
            cached = made if isinstance(made, dataset_class) else dataset_class(
                made, spec["cache"], allow_pickle=bool(spec["meta"].get("allow_pickle", False)),
                max_bytes=spec["meta"].get("max_bytes"))
        _SOURCES.clear()  # one build's source at a time
        _SOURCES[token] = cached
    return cached


def build_part(spec: dict) -> dict:
    """Compute and write the part ``spec`` describes; run by an engine's worker.

    Args:
        spec: plain data made by the driver: ``cache`` (its path), ``parts`` (the parts directory;
            ``None`` with ``upload``), ``start``, ``stop``, ``todo`` (the indices to compute, int64),
            ``meta`` (the cache's metadata), ``source`` (the pickled ``CachedDataset`` or a factory)
            and optionally ``upload`` (``{"url", "storage_options"}``: build in a local temporary
            directory, then upload the part under that URL, data files first, ``nbkit.json`` last),
            ``placed`` (write the rows into the cache's own files: :class:`PlacedStore`), ``sync_rows``
            (default true; false leaves syncing the placed rows to the merge: a worker of the driver's
            own machine) and ``hashes``.

    Returns:
        ``{"name", "computed", "seconds", "host", "pid", "kept"}``: ``kept`` is ``False`` when another whole copy
        of the part was there first (this one was discarded); ``host`` and ``pid`` say which worker built it.
        When the storage failed under the part (an ``OSError`` writing or uploading it, not one of the
        source's), ``storage_error`` holds that error and nothing of the part is kept: the driver decides
        whether to try again.
    """
    t0 = time.perf_counter()
    start, stop = int(spec["start"]), int(spec["stop"])
    name = part_name(start, stop)
    upload = spec.get("upload")
    out = {"name": name, "computed": 0, "seconds": 0.0, "host": socket.gethostname(), "pid": os.getpid(), "kept": False}
    try:
        if upload is not None:
            with tempfile.TemporaryDirectory(prefix="nbkit-part-") as local:
                out["kept"] = _build_here(spec, local, name, start, stop) and _upload(
                    os.path.join(local, name), upload["url"], name, upload.get("storage_options"))
        else:
            out["kept"] = _build_here(spec, spec["parts"], name, start, stop)
    except _FromSource as e:
        raise e.error from None  # the source's own error, as the source raised it
    except OSError as e:  # the storage under the part: reported, not raised (the driver retries it)
        out["storage_error"] = _portable(e)
        return out
    out.update(computed=int(len(spec["todo"])) if out["kept"] else 0, seconds=time.perf_counter() - t0)
    return out


class _FromSource(Exception):
    """Carries an ``OSError`` the source raised past the storage handler of :func:`build_part`."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _portable(e: OSError) -> OSError:
    """``e`` if it survives pickling (it travels back to the driver), else an ``OSError`` with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to travel means: send the text
        return OSError(e.errno, str(e))


def _build_here(spec: dict, parts: str, name: str, start: int, stop: int) -> bool:
    """Build the part into the local directory ``parts``; return whether this copy is the one kept."""
    with open_parts_dir(parts, create=True) as p:
        if _copy_there(p, name):
            return False
        cached = copy.copy(_dataset(spec))  # its own handle: builds in threads of one process never share a store
        todo = np.asarray(spec["todo"], dtype=np.int64)
        stage = staging_name(name, "build")
        p.mkdir(stage, 0o700)
        claim(p.join(stage))
        try:
            if spec.get("placed"):
                return _write_placed(p, stage, name, cached, spec["cache"], spec["meta"], start, stop, todo,
                                     hashes=spec.get("hashes", True), sync_rows=spec.get("sync_rows", True))
            return _write(p, stage, name, cached, spec["meta"], start, stop, todo, hashes=spec.get("hashes", True))
        finally:
            release(p.join(stage))
            p.remove_tree(stage)  # nothing once renamed; else a failed or losing copy


def _copy_there(p: Dir, name: str) -> bool:
    """Whether a whole copy of the part ``name`` is in the parts directory ``p`` already: a directory
    (not a link: never looked through) of this user holding ``nbkit.json``. Anything else under that
    name is never a part: removed, so that this copy takes its place (the merge would refuse it)."""
    st, me = p.lstat(name), _uid()
    if st is None:
        return False
    if stat.S_ISDIR(st.st_mode) and (me is None or st.st_uid == me):
        try:
            with Dir(name, parent=p) as d:
                if d.exists(fmt.META):
                    return True
        except (OSError, ValueError):  # swapped for something else meanwhile: removed below
            pass
    with contextlib.suppress(OSError):  # what cannot be removed fails this copy's rename, and the merge says why
        _remove_entry(p, name)
    return False


def _upload(local: str, url: str, name: str, storage_options) -> bool:
    """Upload the part directory ``local`` to ``<url>/<name>/``: data files first, ``nbkit.json`` last
    (a part exists once that does); return ``False`` if a whole copy was there first."""
    from ..transfer.remote import connect, remote_errors

    fix = "run the build again once the storage answers: finished parts are kept"
    doing = "uploading a part to"
    fs, root = connect(url, storage_options, doing=doing, fix=fix, write=True)
    dest = f"{root}/{name}"
    with remote_errors(fs, url, doing, fix):
        if fs.exists(f"{dest}/{fmt.META}"):
            return False
        names = sorted(fmt.read_meta(local)["part"]["files"])  # the part's files (not its lock files)
        for n in names + [fmt.META]:
            fs.put_file(os.path.join(local, n), f"{dest}/{n}")
    return True


def remote_parts(url: str, storage_options=None) -> list[tuple[int, int]]:
    """``(start, stop)`` of every part uploaded whole (its ``nbkit.json`` there) under the parts URL
    ``url``, in index order. What they hold is checked when they are composed."""
    from ..transfer.remote import connect, remote_errors

    fix = "run the build again once the storage answers"
    doing = "listing the parts at"
    fs, root = connect(url, storage_options, doing=doing, fix=fix)
    with remote_errors(fs, url, doing, fix):
        fs.invalidate_cache()
        found = fs.glob(f"{root}/part-*/{fmt.META}")
    bounds = (parse_part_name(f.rstrip("/").split("/")[-2]) for f in found)
    return sorted(b for b in bounds if b is not None)


def _write(p: Dir, stage: str, name: str, cached, cache_meta: dict, start: int, stop: int, todo: np.ndarray, *,
           hashes: bool = True) -> bool:
    root = p.join(stage)
    meta = part_meta(cache_meta, start, stop)
    # heap.bin made now: CacheFiles only makes it once nbkit.json is published, which a part does last.
    with Dir(root) as d:
        os.close(d.open(fmt.HEAP, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
    store = PartStore(root, meta, start, writable=True, create=True)
    try:
        _compute(cached, store, todo)
        store.sync()
        files = {n: _digest(fd) if hashes else {"size": os.fstat(fd).st_size} for n, fd in store.data_fds().items()}
    finally:
        store.close()
    meta["part"] = {"cache_generation": cache_meta["generation"], "cache_length": int(cache_meta["length"]),
                    "start": start, "stop": stop, "files": files}
    _publish(root, meta)
    return _rename_in(p, stage, name)


def _compute(cached, store, todo: np.ndarray) -> None:
    """Compute ``todo`` through ``cached``'s own compute path into ``store`` (a part's), a chunk at a time."""
    with cached.writing_into(store):
        for s in range(0, len(todo), CHUNK_SAMPLES):
            try:
                cached.compute_and_store(todo[s : s + CHUNK_SAMPLES])
            except OSError as e:
                if e is store.failed:
                    raise
                raise _FromSource(e) from None  # the source's (a missing file of its own): not the part's storage


# -- placed parts: rows written where they belong -----------------------------------------------------


class PlacedStore(Store):
    """A part whose samples go straight into the cache's own files, at their final places: rows into
    the column files at ``slot × row size`` and blobs appended to ``heap.bin`` (under the cache's
    lock), while the records stay here, in the part (``records``, slot = index - start). No cache
    record changes, so no reader sees these rows or blobs until a merge copies the records into the
    cache's index (:func:`nbkit.cluster.merge.merge`): a row slot not yet indexed is never served.

    A sample the cache already stores (a reader, another build, an earlier copy of this part) is never
    written over: :meth:`put` skips it, and the part records it as not stored.

    It also reads back what it placed (:meth:`flags_of`, :meth:`gather`, :meth:`read_blob` of its own
    records), so :func:`nbkit.format.verify` checks every placed sample's CRC before the part is published.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
        >>> store = PlacedStore(open_target(ds.root, ds.store.meta), 4, 8)
        >>> with ds.writing_into(store):
        ...     _ = ds.compute_and_store(np.array([5, 6]))
        >>> store.records["state"].tolist(), len(ds.missing()), store.verify()
        ([0, 1, 1, 0], 10, 2)
        >>> store.close()
    """

    memory_mapped = True
    takes_rows = True  # written by the cache's own write_rows

    def __init__(self, target: CacheFiles, start: int, stop: int):
        super().__init__(target.meta, writable=True)
        self.target, self.start, self.stop = target, int(start), int(stop)
        self.records = np.zeros(self.stop - self.start, dtype=fmt.RECORD)
        self.columns = target.columns
        self.used_heap = False

    @property
    def slot_of(self):
        return self.target.slot_of

    #: The ``OSError`` a write into the cache met (the storage's, not the source's), if any.
    failed = None

    def put(self, idx, flags, crc, cpos, stacked, bpos, blobs):
        try:
            return self._put(np.asarray(idx, dtype=np.int64), flags, crc, np.asarray(cpos, dtype=np.int64), stacked,
                             np.asarray(bpos, dtype=np.int64), blobs)
        except OSError as e:
            self.failed = e
            raise

    def _put(self, idx, flags, crc, cpos, stacked, bpos, blobs):
        t = self.target
        # Stored meanwhile (a reader, another build): never written over, a reader may be reading it.
        free = (t.state[idx] == fmt.EMPTY) & t.admitted(idx)
        if not free.all():
            keep_c, keep_b = free[cpos], free[bpos]
            cpos, stacked = cpos[keep_c], [rows[keep_c] for rows in stacked]
            bpos, blobs = bpos[keep_b], [b for b, k in zip(blobs, keep_b) if k]
        if len(cpos):
            slots = idx[cpos] if t.slot_of is None else t.slot_of[idx[cpos]]
            if len(slots) > 1 and not (np.diff(slots) > 0).all():
                order = np.argsort(slots, kind="stable")
                slots, stacked = slots[order], [rows[order] for rows in stacked]
            for k, rows in enumerate(stacked):
                t.write_rows(k, slots, rows)
        local = idx - self.start
        rec = self.records
        if len(bpos):
            self.used_heap = True
            rec["off"][local[bpos]] = t.append_blobs(blobs)
            rec["len"][local[bpos]] = [len(b) for b in blobs]
        rec["flags"][local[free]] = flags[free]
        rec["crc"][local[free]] = crc[free]
        rec["state"][local[free]] = fmt.STORED
        return free

    def is_stored(self, idx):
        return self.records["state"][np.asarray(idx) - self.start] == fmt.STORED

    def flags_of(self, idx):
        return self.records["flags"][np.asarray(idx) - self.start]

    def crc_of(self, idx):
        return self.records["crc"][np.asarray(idx) - self.start]

    def gather(self, idx, out=None, threads=None):
        return self.target.gather(np.asarray(idx, dtype=np.int64), out, threads)

    def read_blob(self, i: int) -> bytes:
        r = self.records[int(i) - self.start]
        off, n = int(r["off"]), int(r["len"])
        fd = self.target.data_fds().get(fmt.HEAP)
        data = b"" if fd is None or n == 0 else os.pread(fd, n, off)
        if len(data) != n:
            raise CorruptCacheError(f"sample {i}: heap.bin of {self.target.root} is shorter than this part's record says")
        return data

    def stored_count(self) -> int:
        return int(np.count_nonzero(self.records["state"] == fmt.STORED))

    def data_bytes(self) -> int:
        return 0

    def stored_bytes(self) -> int:
        return 0

    def sync(self) -> None:
        """The cache's column files and heap made durable (before the part's records are)."""
        self.target.sync()

    def verify(self) -> int:
        """Check every placed sample's CRC on the bytes as they lie in the cache's files; return how many.

        Raises:
            PartRefused: a sample does not match (its bytes changed under the build): nothing is published.
        """
        where = f"the cache {self.target.root} (rows of the part [{self.start}, {self.stop}))"
        try:
            view = _Shifted(self)
            return fmt.verify_store(view, where=where, fix="The part is built again.", chunk=view.chunk)
        except CorruptCacheError as e:
            raise PartRefused(str(e), bounds=(self.start, self.stop)) from e

    def close(self) -> None:
        self.target.close()


class _Shifted:
    """A :class:`PlacedStore` seen with slots ``0 .. stop - start`` (what :func:`nbkit.format.verify_store` walks)."""

    memory_mapped = True

    def __init__(self, placed: PlacedStore):
        self.p, self.length, self.schema, self.slot_of = placed, placed.stop - placed.start, placed.schema, None
        t = placed.target
        # Checked where the rows lie (views of the cache's maps, no copy); a budgeted cache's rows are
        # scattered over its slots: gathered, a bounded chunk at a time.
        self.columns = None if t.slot_of is not None else [c[placed.start : placed.stop] for c in t.columns]
        row = sum(c.strides[0] for c in t.columns if c.ndim) or 1
        self.chunk = int(min(1024, max(1, (16 << 20) // row)))

    def is_stored(self, idx):
        return self.p.records["state"][idx] == fmt.STORED

    def flags_of(self, idx):
        return self.p.flags_of(idx + self.p.start)

    def crc_of(self, idx):
        return self.p.crc_of(idx + self.p.start)

    def gather(self, idx):
        return self.p.gather(idx + self.p.start)

    def read_blob(self, i):
        return self.p.read_blob(int(i) + self.p.start)


def open_target(root: str, cache_meta: dict) -> CacheFiles:
    """The cache at ``root`` opened for placing a part's rows, once it is checked to be the build
    ``cache_meta`` names (its generation, read again after its files are open: a cache rebuilt or
    replaced meanwhile is never written into). The files stay held open: a cache removed or
    replaced later takes its old files with it, and ``nbkit rm`` and ``prune`` see it in use.

    Raises:
        nbkit.StaleCacheError: the cache was rebuilt since the build planned this part.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> target = open_target(ds.root, ds.store.meta); len(target.columns); target.close()
        1
    """
    from ..errors import StaleCacheError

    def check(meta):
        if meta.get("generation") != cache_meta.get("generation"):
            raise StaleCacheError(f"the cache at {root} was rebuilt (generation {trust.shown(meta.get('generation'))}) since this "
                                  f"build planned its parts (generation {cache_meta.get('generation')}): nothing is written "
                                  "into it. Run the build again.")

    meta = fmt.read_meta(root)
    check(meta)
    target = CacheFiles(root, meta, writable=True)
    try:
        check(fmt.read_meta(root))
    except BaseException:
        target.close()
        raise
    return target


def placed_identity(cache: CacheFiles, heap: bool) -> str:
    """Which files a placed part's rows are in: a digest of the device and inode of the cache's index
    and column files (and ``heap.bin`` with ``heap``), as held open by ``cache``. The merge compares
    the worker's with its own: a cache replaced between the two (a pull or import of a copy swapped
    in) never gets records for rows written into the files it replaced.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> a, b = open_target(ds.root, ds.store.meta), open_target(ds.root, ds.store.meta)
        >>> placed_identity(a, heap=False) == placed_identity(b, heap=False), len(placed_identity(a, heap=False))
        (True, 32)
        >>> a.close(); b.close()
    """
    fds = cache.data_fds()
    names = [fmt.INDEX] + [fmt.column_file(k) for k in range(len(cache.columns))] + ([fmt.HEAP] if heap else [])
    ids = []
    for n in names:
        if n not in fds:
            return "missing " + n
        st = os.fstat(fds[n])
        ids.append(f"{n}:{st.st_dev}:{st.st_ino}")
    return hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]


def _write_placed(p: Dir, stage: str, name: str, cached, cache_root: str, cache_meta: dict, start: int, stop: int,
                  todo: np.ndarray, *, hashes: bool = True, sync_rows: bool = True) -> bool:
    """A placed part: rows and blobs into the cache's files, the part's records into ``index.bin`` of
    the staging directory, ``nbkit.json`` last, then renamed. Every CRC is checked where the rows
    lie before the part is published. With ``sync_rows`` the rows are synced first; without (this
    machine's workers: the driver shares their page cache), the merge syncs them before it links any
    record, and the worker is spared the wait for the disk (``rows_synced`` in the manifest says which)."""
    root = p.join(stage)
    store = PlacedStore(open_target(cache_root, cache_meta), start, stop)
    try:
        _compute(cached, store, todo)
        if sync_rows:
            store.sync()  # rows and blobs durable before any record of them is
        store.verify()
        identity = placed_identity(store.target, store.used_heap)
        records = store.records
    finally:
        store.close()
    with Dir(root) as d:
        fd = d.open(fmt.INDEX, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        try:
            write_all(fd, records.view(np.uint8), 0, path=os.path.join(root, fmt.INDEX))
            if sync_rows:
                os.fsync(fd)
            files = {fmt.INDEX: _digest(fd) if hashes else {"size": os.fstat(fd).st_size}}
        finally:
            os.close(fd)
    meta = part_meta(cache_meta, start, stop)
    meta["part"] = {"cache_generation": cache_meta["generation"], "cache_length": int(cache_meta["length"]),
                    "start": start, "stop": stop, "files": files, "placed": identity,
                    "rows_synced": bool(sync_rows)}
    # Rows left unsynced make the part worth no more than they are: it is committed atomically (a
    # process sees it whole or not at all) but not made durable. A power cut loses it, or leaves it
    # torn (refused and removed by the merge, or its rows checked: merge.link_records), and it is
    # built again; the driver makes the rows durable before it links any record.
    _publish(root, meta, sync=sync_rows)
    return _rename_in(p, stage, name, sync=sync_rows)


def _publish(root: str, meta: dict, *, sync: bool = True) -> None:
    """The part's ``nbkit.json``, last and durably (``sync``): a directory without it is no part. The
    staging directory is synced once more: the commit's temporary name, unlinked after the link, must
    not come back after a power cut (a part holding anything but its files is refused)."""
    fmt.publish_meta(root, meta, sync=sync)
    if sync:
        with Dir(root) as d:
            d.sync()


def _rename_in(p: Dir, stage: str, name: str, *, sync: bool = True) -> bool:
    """Rename the staged part into place (durably with ``sync``); ``False`` when another whole copy
    was there first."""
    try:
        os.rename(stage, name, src_dir_fd=p.fd, dst_dir_fd=p.fd)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False  # another whole copy was there first: it wins
        if e.errno == errno.ENOTDIR:
            return False  # a link or a file put under its name meanwhile: the merge refuses and removes it
        raise
    if sync:
        p.sync()
    return True


def _digest(fd: int) -> dict:
    """``{"size", "sha256"}`` of the open file ``fd``."""
    h, pos = hashlib.sha256(), 0
    while True:
        block = os.pread(fd, CHUNK, pos)
        if not block:
            break
        h.update(block)
        pos += len(block)
    return {"size": pos, "sha256": h.hexdigest()}


# -- reading (the driver's side) --------------------------------------------------------------------


@dataclass
class VerifiedPart:
    """A part that passed every check of :func:`read_part`; ``files`` are its open, read-only files
    (merge from these very descriptors, then :meth:`close`).

    Attributes:
        path: its directory.
        start, stop: its index range in the cache.
        meta: its parsed metadata (with the ``part`` field).
        files: its :class:`nbkit.cachedir.CacheFiles` (``None`` for a placed part).
        stored: how many samples it holds.
        records: a placed part's index records (slot = index - start): its rows and blobs are in
            the cache's files already (:class:`PlacedStore`); ``None`` for a part holding its own.
        placed: a placed part's :func:`placed_identity` (the cache files its rows are in).
        rows_synced: a placed part's rows were synced by its worker before it published the part;
            if not, the merge syncs them before it links any record, and checks them again unless
            the part is its own build's (:func:`nbkit.cluster.merge.link_records`).
    """

    path: str
    start: int
    stop: int
    meta: dict
    files: CacheFiles | None
    stored: int
    records: np.ndarray | None = None
    placed: str = ""
    rows_synced: bool = False

    def close(self) -> None:
        if self.files is not None:
            self.files.close()


_SAME_FIELDS = ("schema", "columns", "fingerprint", "allow_pickle", "format", "version")


def read_part(path: str, cache_meta: dict, *, hashes: bool = True) -> VerifiedPart:
    """Check the part at ``path`` against the cache ``cache_meta``, once and completely: its name,
    that it is a directory (not a link) of this process's user holding only its files, each a regular
    file of that user, its metadata (:func:`nbkit.format.parse_meta`, then :data:`PART_SPEC`), the
    cache it belongs to (generation, length, schema, columns, fingerprint), its range and the
    generation derived from it (:func:`part_generation`), the size and SHA-256 of every data file
    (``hashes=False``: the size; for the parts of this machine's own worker processes, where the
    hash guards nothing the CRCs do not), and every sample's CRC (:func:`nbkit.format.verify_store`).

    Raises:
        PartRefused: naming the part and what is wrong; the caller removes it and computes the range again.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
        >>> spec = dict(cache=ds.root, parts=parts_dir(ds.root), start=0, stop=8, todo=np.arange(8), meta=ds.store.meta,
        ...             source=("pickled", "t", pickle.dumps(ds)))
        >>> name = build_part(spec)["name"]
        >>> part = read_part(os.path.join(parts_dir(ds.root), name), ds.store.meta); part.stored
        8
        >>> part.close()
    """
    where = os.path.join(path, fmt.META)
    fix = "It is removed and its samples computed again."
    bounds = parse_part_name(os.path.basename(path))
    if bounds is None:
        raise PartRefused(f"{path} is not named like a part (part-<start>-<stop>, {PART_DIGITS} digits each). {fix}")

    def refuse(what):
        raise PartRefused(f"the part {path} is refused: {what}. {fix}", bounds=bounds)

    try:
        d = Dir(path)  # never through a link
    except (OSError, ValueError) as e:
        raise PartRefused(f"the part {path} is refused: it is not a directory nbkit can open as a part "
                          f"({str(e).splitlines()[0]}). {fix}", bounds=bounds) from e
    with d:
        _check_owned(os.fstat(d.fd), "it belongs to", refuse)
        for n in d.names():  # one level: a part is flat, and a tree below it is never walked
            st = d.lstat(n)
            if st is None:
                continue
            if _PART_ENTRY.match(n) is None or not stat.S_ISREG(st.st_mode):
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode) else \
                    "a file" if stat.S_ISREG(st.st_mode) else "a special file"
                refuse(f"it holds {trust.shown(n)}, {kind}, where a part holds only its regular files")
            _check_owned(st, f"{n} belongs to", refuse)
        try:
            fd = d.open(fmt.META)
        except (OSError, ValueError) as e:
            raise PartRefused(f"the part {path} has no readable metadata ({str(e).splitlines()[0]}). {fix}", bounds=bounds) from e
        try:
            # Shared, as every reader of a cache holds it: a process holding it exclusively (never
            # nbkit's for a part) makes the part refused after LOCK_SECONDS, never a wait without end.
            if not flock_within(fd, shared=True):
                refuse(f"another process has held its {fmt.META} locked for {LOCK_SECONDS:g} s")
            try:
                meta = fmt.parse_meta(_read_bounded(fd, where), where, fix)
            except CorruptCacheError as e:
                raise PartRefused(f"the part {path} has no readable metadata ({str(e).splitlines()[0]}). {fix}",
                                  bounds=bounds) from e
            return _check_part(path, where, bounds, meta, cache_meta, hashes, fix, refuse)
        finally:
            os.close(fd)


def _check_owned(st: os.stat_result, what: str, refuse) -> None:
    me = _uid()
    if me is not None and st.st_uid != me:
        refuse(f"{what} another user (uid {st.st_uid}; this process runs as uid {me}), and nbkit merges only parts of "
               "the user who runs the build")


def _read_bounded(fd: int, where: str) -> bytes:
    """``nbkit.json`` from ``fd``: at most :data:`nbkit.trust.MAX_JSON_BYTES`, read in chunks."""
    out, pos = [], 0
    while pos <= trust.MAX_JSON_BYTES:
        block = os.pread(fd, min(CHUNK, trust.MAX_JSON_BYTES + 1 - pos), pos)
        if not block:
            return b"".join(out)
        out.append(block)
        pos += len(block)
    raise CorruptCacheError(f"{where} is larger than {trust.MAX_JSON_BYTES:,} bytes, far more than any part's metadata")


def _check_part(path, where, bounds, meta, cache_meta, hashes, fix, refuse) -> VerifiedPart:
    """:func:`read_part`'s checks of the parsed metadata ``meta``, then of the files it names."""
    if meta.get("part") is None:
        raise PartRefused(f"{where} has no 'part' field: it is a cache, not a part of one. {fix}", bounds=bounds)
    try:
        info = trust.check_json(meta["part"], PART_SPEC, where, fix)
    except CorruptCacheError as e:
        raise PartRefused(str(e), bounds=bounds) from e
    if (info["start"], info["stop"]) != bounds:
        refuse(f"its metadata says the range [{info['start']}, {info['stop']}), its name [{bounds[0]}, {bounds[1]})")
    if info["cache_generation"] != cache_meta.get("generation"):
        refuse(f"it was built for the cache generation {info['cache_generation']}, and the cache is now "
               f"{cache_meta.get('generation')} (rebuilt since)")
    if meta.get("generation") != part_generation(info["cache_generation"], *bounds):
        # The CRCs cover the bytes, not the indices: the derived generation ties the part to its range.
        refuse(f"its generation {trust.shown(meta.get('generation'))} is not the one of the range [{bounds[0]}, {bounds[1]}) "
               f"({part_generation(info['cache_generation'], *bounds)}): it was built for another range and renamed")
    if info["cache_length"] != int(cache_meta["length"]) or bounds[1] > int(cache_meta["length"]):
        refuse(f"its range [{bounds[0]}, {bounds[1]}) or cache length {info['cache_length']} does not fit the cache of "
               f"{cache_meta['length']} samples")
    if meta["length"] != bounds[1] - bounds[0] or meta.get("capacity") is not None:
        refuse(f"it holds {meta['length']} slots for a range of {bounds[1] - bounds[0]}")
    for f in _SAME_FIELDS:
        if meta.get(f) != cache_meta.get(f):
            refuse(f"its {f!r} differs from the cache's (another source, schema or nbkit version)")
    if "placed" in info:
        return _check_placed(path, bounds, meta, info, hashes, refuse)
    try:
        files = CacheFiles(path, meta, writable=False)
    except (CorruptCacheError, OSError, ValueError) as e:  # ValueError: UnsafeArchiveError, a file swapped for a link
        raise PartRefused(f"the part {path} is refused: {str(e).splitlines()[0]}. {fix}", bounds=bounds) from e
    try:
        fds = files.data_fds()
        if set(fds) != set(info["files"]):
            refuse(f"its files are {sorted(fds)}, its manifest lists {sorted(info['files'])}")
        for n, fd in fds.items():
            entry = info["files"][n]
            _check_owned(os.fstat(fd), f"{n} belongs to", refuse)  # the very file merged, not a name seen before
            if not hashes:  # the driver's own local workers: sizes here, every sample's CRC below
                if os.fstat(fd).st_size != entry["size"]:
                    refuse(f"{n} holds {os.fstat(fd).st_size} bytes, its manifest records {entry['size']} (damaged)")
            elif "sha256" not in entry:
                refuse(f"its manifest records no SHA-256 for {n} (a part of local workers, read here as untrusted)")
            elif _digest(fd) != entry:
                refuse(f"{n} does not match the size and SHA-256 its manifest records (damaged or modified)")
        try:
            stored = fmt.verify_store(files, where=path, fix="")
        except CorruptCacheError as e:
            refuse(str(e).rstrip(". "))
    except BaseException:
        files.close()
        raise
    return VerifiedPart(path, bounds[0], bounds[1], meta, files, stored)


def _check_placed(path, bounds, meta, info, hashes, refuse) -> VerifiedPart:
    """:func:`read_part`'s checks of a placed part: its one file, ``index.bin``, by size (and SHA-256
    with ``hashes``), and every record (a state nbkit writes, flags a writer of this schema sets).
    O(records): the rows are in the cache's files, CRC-checked there by the worker before it published
    the part (and again by the merge when they were not synced and the part is not its own build's);
    the merge checks the records' heap ranges and the files' identity against the cache."""
    n = bounds[1] - bounds[0]
    if set(info["files"]) != {fmt.INDEX}:
        refuse(f"it is a placed part (its rows in the cache's files) and lists {sorted(info['files'])}, where it holds only {fmt.INDEX}")
    with Dir(path) as d:
        try:
            fd = d.open(fmt.INDEX)
        except (OSError, ValueError) as e:
            refuse(f"its {fmt.INDEX} cannot be opened ({str(e).splitlines()[0]})")
        try:
            st = os.fstat(fd)
            _check_owned(st, f"{fmt.INDEX} belongs to", refuse)
            entry = info["files"][fmt.INDEX]
            if st.st_size != n * fmt.RECORD.itemsize or entry["size"] != st.st_size:
                refuse(f"{fmt.INDEX} holds {st.st_size} bytes, {n} records take {n * fmt.RECORD.itemsize} and its manifest "
                       f"records {entry['size']} (damaged)")
            if hashes and "sha256" not in entry:
                refuse(f"its manifest records no SHA-256 for {fmt.INDEX} (a part of local workers, read here as untrusted)")
            if hashes and _digest(fd) != entry:
                refuse(f"{fmt.INDEX} does not match the size and SHA-256 its manifest records (damaged or modified)")
            raw = os.pread(fd, st.st_size, 0)
        finally:
            os.close(fd)
    if len(raw) != n * fmt.RECORD.itemsize:
        refuse(f"{fmt.INDEX} changed while it was read")
    records = np.frombuffer(raw, dtype=fmt.RECORD).copy()
    state = records["state"]
    if not np.isin(state, (fmt.EMPTY, fmt.STORED)).all():
        refuse(f"{fmt.INDEX} holds records in states nbkit never writes (damaged)")
    stored = state == fmt.STORED
    schema = Store(meta, writable=False).schema
    if not fmt.consistent_flags(records["flags"][stored], schema).all():
        refuse(f"{fmt.INDEX} holds records with flags no writer of this schema sets (damaged)")
    return VerifiedPart(path, bounds[0], bounds[1], meta, None, int(stored.sum()), records=records, placed=info["placed"],
                        rows_synced=bool(info.get("rows_synced", False)))


@contextlib.contextmanager
def part_lock(path: str):
    """Hold the part directory ``path`` exclusively (``flock`` on it) for the block; yields whether
    the part is still there (a second driver finds it gone once the first merged it).

    Raises:
        PartRefused: ``path`` is a link or a file (never followed, never taken for a part merged
            elsewhere), or another process held its lock for :data:`LOCK_SECONDS` (a stuck process,
            or not nbkit's): the caller removes it and builds it again.
    """
    bounds = parse_part_name(os.path.basename(path))
    fix = "It is removed and its samples computed again."
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        yield False
        return
    except OSError as e:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        if st is None:
            yield False
            return
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise PartRefused(f"the part {path} is refused: it is {kind}, and nbkit never follows a link out of the parts "
                          f"directory nor takes one for a part. {fix}", bounds=bounds) from e
    try:
        if not flock_within(fd):
            raise PartRefused(f"the part {path} is refused: another process has held its lock for {LOCK_SECONDS:g} s (a "
                              f"stuck driver, or a process that is not nbkit's). {fix}", bounds=bounds)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        mine = os.fstat(fd)
        yield st is not None and stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
    finally:
        os.close(fd)


def remove_part(path: str) -> None:
    """Remove the part at ``path`` (or whatever is under its name: a link is removed itself): renamed
    aside first (``nbkit.json`` gone from the part name in one step; a crash after leaves a leftover
    ``nbkit ls`` lists), then removed without recursion (a tree of any depth below it).

    Raises:
        OSError: it could not be removed (another user's files where this user may not remove them);
            the message gives the command that removes it.
    """
    parent, name = os.path.split(os.path.abspath(path))
    try:
        p = Dir(parent)
    except FileNotFoundError:
        return
    with p:
        _remove_entry(p, name)


def _remove_entry(p: Dir, name: str) -> None:
    """:func:`remove_part` of the entry ``name`` of the parts directory ``p``."""
    if p.lstat(name) is None:
        return
    trash = staging_name(name, "trash")
    try:
        p.rename(name, trash)
    except FileNotFoundError:
        return
    except OSError as e:
        raise OSError(e.errno, f"{p.join(name)} could not be removed ({e.strerror}): remove it with "
                               f"rm -rf {shlex.quote(p.join(name))}", p.join(name)) from e
    p.sync()
    try:
        p.remove_tree(trash)  # no recursion: a tree of any depth below it (Dir.remove_tree)
    except OSError as e:
        raise OSError(e.errno, f"{p.join(trash)} (a part set aside for removal) could not be removed ({e.strerror}): "
                               f"remove it with rm -rf {shlex.quote(p.join(trash))}", p.join(trash)) from e
    p.sync()


def sweep_builds(parts: str) -> list[str]:
    """Remove what killed part builds and removals left in ``parts`` (no live process claims them);
    a leftover this user may not remove stays (``nbkit ls`` lists it)."""
    swept = []
    try:
        d = open_parts_dir(parts)
    except NotADirectoryError:
        return swept
    if d is None:
        return swept
    with d as p:
        for n in p.names():
            left = leftover_of(n)
            if left is None or parse_part_name(left[0]) is None or is_claimed(p.join(n)):
                continue
            try:
                p.remove_tree(n)
            except OSError:
                continue
            swept.append(p.join(n))
        if swept:
            p.sync()
    return swept
