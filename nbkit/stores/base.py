"""The storage contracts: :class:`Store` (one cache's samples, in one process) and :class:`Location`
(where one cache lives), every member the engine calls declared here.

A backend is one :class:`Location` subclass (``open_store`` returns its store) and one :class:`Store`
subclass, then one entry in ``tests/stores/test_contract.py``. Members marked *required* raise
``NotImplementedError`` naming the subclass until it defines them; the others have defaults that
suit a store without files on this host (no memory maps, nothing to fetch ahead, nothing to sync).
The engine calls every member directly, never probing for one. This module holds no backend: a
local directory is :mod:`nbkit.stores.local` (its store :class:`nbkit.cachedir.CacheFiles`).

Example:
    >>> import numpy as np
    >>> class Empty(Store):
    ...     def is_stored(self, idx):
    ...         return np.zeros(len(idx), dtype=bool)
    >>> s = Empty({"length": 3, "schema": None}, writable=False)
    >>> s.missing().tolist(), s.memory_mapped, s.prefetch(np.arange(3))
    ([0, 1, 2], False, 0)
    >>> s.stored_count()
    Traceback (most recent call last):
    ...
    NotImplementedError: Empty does not implement Store.stored_count(), which every store must define (see nbkit.stores.base.Store).
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .. import format as fmt
from ..codec import Schema
from ..errors import StaleCacheError

__all__ = ["Store", "KeyedStore", "Location", "Generation", "new_generation", "store_of"]


_NOUNS = {"Store": "store", "KeyedStore": "keyed store", "Location": "location"}


def _required(obj, member: str, base: str) -> NotImplementedError:
    return NotImplementedError(f"{type(obj).__name__} does not implement {base}.{member}, which every "
                               f"{_NOUNS[base]} must define (see nbkit.stores.base.{base}).")


class Store:
    """The samples of one cache, opened in one process: what the engine reads and writes.

    All index arguments are int64 numpy arrays of sample indices. The facts (``meta``, ``length``,
    ``schema``, ``writable``, ``capacity``, ``n_columns``, ``slot_of``) come from the cache metadata.
    Required: :meth:`is_stored`, :meth:`flags_of`, :meth:`crc_of`, :meth:`gather`, :meth:`read_blob`,
    :meth:`put`, :meth:`stored_count`, :meth:`data_bytes`, :meth:`stored_bytes`. Optional, with
    defaults: :meth:`admitted`, :meth:`stored_mask`, :meth:`missing`, :attr:`memory_mapped`,
    :meth:`gather_checked`, :meth:`will_need`, :meth:`prefetch`, :meth:`sync`, :meth:`close`.
    Checksums are checked in one place, :func:`nbkit.format.verify`, for every store alike.

    Example:
        >>> int(Store({"length": 4, "schema": None, "capacity": 2}, writable=False).admitted(np.arange(4)).sum())
        2
    """

    #: CRC-32 of one sample: its column rows, then its heap blob (:func:`nbkit.format.row_crc`).
    row_crc = staticmethod(fmt.row_crc)

    #: Whether :meth:`gather` reads memory maps of this host's files (local pages): the engine then
    #: gathers with :meth:`gather_checked`, reads batches from several threads and serves column
    #: batches anywhere on the host. ``False`` (a server, a bucket read through): one thread reads.
    memory_mapped = False
    #: Whether :meth:`put` takes a column of large rows as :class:`nbkit.format.Rows` (the samples'
    #: own arrays, written one by one) rather than stacked into one array: a store that writes rows
    #: into files sets it, and is spared a batch-sized copy. ``False``: every column comes stacked.
    takes_rows = False
    #: The column arrays themselves (one per column, rows by slot) where :attr:`memory_mapped`, so a
    #: run of consecutive rows is read in place; ``None`` for a store without them.
    columns: list | None = None

    def __init__(self, meta: dict, *, writable: bool):
        self.meta = meta
        self.writable = writable  # whether the engine may put() computed samples here
        self.length = int(meta["length"])
        self.schema = Schema.from_json(meta["schema"])
        # A byte budget (``max_bytes``) gives the columns fewer rows than samples: only the admitted
        # samples have a row (their slot); the others are always computed from the source.
        self.capacity = self.length if meta.get("capacity") is None else int(meta["capacity"])

    @cached_property
    def slot_of(self) -> np.ndarray | None:
        """Each index's row (``-1``: not admitted), or ``None`` when every sample has one. Made on
        first use, so a store checks its files against the metadata before allocating anything."""
        if self.capacity >= self.length:
            return None
        return fmt.admission_slots(self.length, self.capacity, int(self.meta.get("admit_seed", 0)))

    @property
    def n_columns(self) -> int:
        """How many fixed-shape columns a sample's rows span (one array each in :meth:`gather`)."""
        return len(self.schema.columns)

    # -- required -------------------------------------------------------------------------------

    def is_stored(self, idx: np.ndarray) -> np.ndarray:
        """Required: which of ``idx`` are stored and whole (a bool per index). A record the store
        cannot trust counts as stored: its :meth:`flags_of` marks it damaged, so its check fails."""
        raise _required(self, "is_stored()", "Store")

    def flags_of(self, idx: np.ndarray) -> np.ndarray:
        """Required: the record flags (``uint8``: ``FLAG_VAR``, ``FLAG_FREEFORM``, ``FLAG_DAMAGED``
        for a record in an unknown state) of stored samples ``idx``."""
        raise _required(self, "flags_of()", "Store")

    def crc_of(self, idx: np.ndarray) -> np.ndarray:
        """Required: the recorded CRC-32 (``uint32``) of stored samples ``idx``."""
        raise _required(self, "crc_of()", "Store")

    def gather(self, idx: np.ndarray) -> list:
        """Required: the column rows of stored samples ``idx``, one array per column (``len(idx)`` rows each)."""
        raise _required(self, "gather()", "Store")

    def read_blob(self, i: int) -> bytes:
        """Required: the heap blob of stored sample ``i`` (a free-form sample, or its variable-length
        leaves); ``CorruptCacheError`` when its record points outside what is stored."""
        raise _required(self, "read_blob()", "Store")

    def put(self, idx: np.ndarray, flags: np.ndarray, crc: np.ndarray, cpos: np.ndarray, stacked: list,
            bpos: np.ndarray, blobs: list):
        """Required: store samples ``idx`` with their record ``flags`` and ``crc``; ``stacked`` holds
        one array per column with the rows of the conforming samples (positions ``cpos`` of ``idx``; a
        :class:`nbkit.format.Rows` for a column of large rows where :attr:`takes_rows`),
        ``blobs`` the heap blobs of positions ``bpos``. A sample is visible only once whole.

        Returns ``None`` (every sample kept) or a bool mask of the samples kept (a full server refuses
        some: the engine serves those from the source).
        """
        raise _required(self, "put()", "Store")

    def stored_count(self) -> int:
        """Required: how many samples are stored (for stats)."""
        raise _required(self, "stored_count()", "Store")

    def data_bytes(self) -> int:
        """Required: the bytes of sample data stored (rows and blobs; for stats)."""
        raise _required(self, "data_bytes()", "Store")

    def stored_bytes(self) -> int:
        """Required: the bytes the store takes where it lives (on disk, in the server; for stats)."""
        raise _required(self, "stored_bytes()", "Store")

    # -- optional, with defaults ----------------------------------------------------------------

    def admitted(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` may be stored (all, unless a byte budget limits the cache)."""
        if self.slot_of is None:
            return np.ones(len(idx), dtype=bool)
        return self.slot_of[idx] >= 0

    def stored_mask(self, idx: np.ndarray) -> np.ndarray:
        """Which of ``idx`` are stored, as cheaply as the store can tell (Redis: its bitmap).
        Default: :meth:`is_stored`."""
        return self.is_stored(idx)

    def missing(self, idx: np.ndarray | None = None) -> np.ndarray:
        """The admitted indices (of ``idx``, or of all) that are not stored yet."""
        idx = np.arange(self.length) if idx is None else np.asarray(idx, dtype=np.int64)
        return idx[self.admitted(idx) & ~self.stored_mask(idx)]

    def gather_checked(self, idx: np.ndarray, out: list | None = None, threads: int | None = None, *,
                       crc: bool = False, mode: str | None = None):
        """``(column rows, CRC-32s of each sample's rows or None)`` of stored samples ``idx``, into
        ``out`` when given; the engine calls it on a :attr:`memory_mapped` store, whose read takes
        the checksums on the bytes it read. Default: :meth:`gather`, then the checksums."""
        columns = self.gather(idx)
        if out is not None:
            for d, c in zip(out, columns):
                np.copyto(d, c)
            columns = list(out)
        return columns, (fmt.batch_crc(columns, len(idx)) if crc else None)

    def row(self, i: int) -> list | None:
        """Stored sample ``i``'s row of each column when they are the whole sample, as arrays the
        caller copies (views of a map), else ``None``: the engine's one-sample fast path; ``None``
        sends the read down the batch path. Default: ``None``.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(6).view(3, 2)), tempfile.mkdtemp())
            >>> ds.store.row(1) is None                 # not stored yet
            True
            >>> _ = ds.warmup(); ds.store.row(1)[0].tolist()
            [2, 3]
        """
        return None

    def will_need(self, idx: np.ndarray) -> None:
        """Start reading the stored ones of samples ``idx`` into memory in the background (a batch
        gathered later). Default: nothing (a store without local pages to warm)."""

    def prefetch(self, idx: np.ndarray) -> int:
        """Fetch what samples ``idx`` need ahead of reading them, in the background; return how many
        pieces were queued. Default: ``0`` (the store holds what it serves)."""
        return 0

    def sync(self) -> None:
        """Make what was stored durable (a power loss keeps it); called at the end of a warmup.
        Default: nothing to do (a server keeps what it acknowledged)."""

    def close(self) -> None:
        """Release what the store holds in this process (files, maps, threads, buffers); called
        once, by ``CachedDataset.close()``. Default: nothing to release."""


class KeyedStore:
    """The values of one keyed cache (:class:`nbkit.CacheLoader`), opened in one process: what the
    loader reads and writes. Keys are in their stored form (:func:`nbkit.stores.keyed.key_bytes`).

    Required: :meth:`get`, :meth:`put`, :meth:`contains`, :meth:`count`, :meth:`keys`; optional:
    :meth:`close`. The loader checks each value's CRC-32 itself. Backends:
    :class:`nbkit.stores.keyed.LocalKeyed` (a directory), :class:`nbkit.stores.keyed_redis.RedisKeyed`.

    Example:
        >>> class Nothing(KeyedStore):
        ...     def get(self, kb, *, fresh=False):
        ...         return None
        >>> Nothing().get(b"k"), Nothing().is_remote
        (None, False)
    """

    #: Whether the values live elsewhere than this host (a server).
    is_remote = False

    def get(self, kb: bytes, *, fresh: bool = False):
        """Required: ``(crc, value)`` of a stored key, or ``None``; ``fresh``: look for a newer record
        of it first (another process may have replaced a damaged value)."""
        raise _required(self, "get()", "KeyedStore")

    def put(self, kb: bytes, crc: int, value: bytes, *, replace: bool = False) -> bool:
        """Required: store ``value`` under ``kb`` unless another process stored the key first (or
        ``replace``); return whether this call stored it."""
        raise _required(self, "put()", "KeyedStore")

    def contains(self, kb: bytes) -> bool:
        """Required: whether ``kb`` is stored."""
        raise _required(self, "contains()", "KeyedStore")

    def count(self) -> int:
        """Required: how many keys are stored."""
        raise _required(self, "count()", "KeyedStore")

    def keys(self) -> list:
        """Required: every stored key, in stored form."""
        raise _required(self, "keys()", "KeyedStore")

    def close(self) -> None:
        """Release what the store holds in this process. Default: nothing to release."""


def new_generation() -> str:
    """A fresh generation id for the metadata of a cache being created: 32 lowercase hex characters."""
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Generation:
    """Which build of a cache a handle opened.

    Attributes:
        id: the ``generation`` field of its ``nbkit.json`` (``None`` for caches made before nbkit
            wrote one: their file's identity stands in for it).
        stamp: ``(device, inode, mtime_ns, size)`` of ``nbkit.json`` when it was read (``None`` where
            the metadata is not a local file): unchanged means unchanged, at the cost of one ``stat``.
    """

    id: str | None
    stamp: tuple | None


@dataclass
class Location:
    """A resolved cache location: the hooks the engine calls on it.

    ``CachedDataset`` resolves its path once (:func:`nbkit.stores.registry.resolve`), then calls
    only: :meth:`prepare`, :meth:`read_meta`, :meth:`existing_meta` / :meth:`not_found`,
    :meth:`publish_meta`, :meth:`open_store`, :meth:`check_generation` / :meth:`generation_of`,
    :meth:`remove`, :meth:`publish` (when :attr:`publishes`, or ``is_remote``), :meth:`close`.
    Required: :meth:`read_meta`, :meth:`publish_meta`, :meth:`open_store`, :meth:`remove`.

    Attributes:
        url: the path or URL as given.
        root: the local directory the engine reads and writes (or, for a store without one, a
            normalized form of the URL).
        is_remote: ``True`` when the cache lives elsewhere than ``root`` alone.
        storage_options: passed to fsspec (or the backend's client) for ``url``.

    Example:
        >>> loc = Location(url="mine://x", root="mine://x")
        >>> loc.prepare(), loc.publish(), loc.meta_stamp()
        (False, False, None)
        >>> loc.read_meta()
        Traceback (most recent call last):
        ...
        NotImplementedError: Location does not implement Location.read_meta(), which every location must define (see nbkit.stores.base.Location).
    """

    url: str
    root: str
    is_remote: bool = False
    storage_options: dict = field(default_factory=dict)

    #: Whether :meth:`publish` sends anything: the engine then calls it once the store becomes complete.
    publishes = False
    #: Whether the metadata is the local file ``root/nbkit.json`` (so a ``stat`` tells whether it
    #: changed: :meth:`meta_stamp`). ``False``: it is read again only when a store opens.
    meta_is_local_file = False

    # -- required -------------------------------------------------------------------------------

    def read_meta(self) -> dict | None:
        """Required: the cache metadata, or ``None`` when no cache exists here yet."""
        raise _required(self, "read_meta()", "Location")

    def publish_meta(self, meta: dict) -> dict:
        """Required: create the store's files (keys) for ``meta``, then publish ``meta`` once; return
        whichever metadata won (another process may have created the cache first)."""
        raise _required(self, "publish_meta()", "Location")

    def open_store(self, meta: dict, *, writable: bool) -> Store:
        """Required: the :class:`Store` of the cache ``meta`` here, for this process."""
        raise _required(self, "open_store()", "Location")

    def remove(self) -> None:
        """Required: delete the cache here (metadata first), for ``overwrite=True``."""
        raise _required(self, "remove()", "Location")

    # -- optional, with defaults ----------------------------------------------------------------

    def prepare(self, callback=None) -> bool:
        """Bring the cache within reach before the engine opens it; return whether anything was fetched."""
        return False

    def publish(self, callback=None) -> bool:
        """Make what was stored here visible at the URL; return whether anything was sent."""
        return False

    def close(self) -> None:
        """Release what this location holds in this process (connections); called by
        ``CachedDataset.close()`` after its store is closed. Default: nothing to release."""

    def not_found(self) -> Exception:
        """The error for opening a cache that does not exist here (naming how to make one)."""
        try:
            fmt.read_meta(self.root)
        except FileNotFoundError as e:
            return e
        return FileNotFoundError(f"no nbkit cache at {self.url}")

    def existing_meta(self) -> dict:
        """The metadata of the cache that must exist here (opening without a source); else :meth:`not_found`.

        Example:
            >>> import tempfile
            >>> from nbkit.stores import registry
            >>> registry.resolve(tempfile.mkdtemp(), None).existing_meta()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            FileNotFoundError: ...
        """
        meta = self.read_meta()
        if meta is None:
            raise self.not_found()
        return meta

    def meta_stamp(self) -> tuple | None:
        """``(device, inode, mtime_ns, size)`` of ``root/nbkit.json``, or ``None`` when it is absent
        (or, by default, when the metadata is not a local file)."""
        if not self.meta_is_local_file:
            return None
        try:
            st = os.stat(os.path.join(self.root, fmt.META))
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def generation_of(self, meta: dict) -> Generation:
        """The :class:`Generation` of ``meta``, just read from here."""
        return Generation(meta.get("generation"), self.meta_stamp() if self.meta_is_local_file else None)

    def check_generation(self, opened: Generation, *, reread: bool = False) -> tuple[Generation, bool]:
        """Raise :class:`StaleCacheError` if the cache here is no longer the build ``opened``.

        Cheap when nothing changed: one ``stat`` of ``nbkit.json`` (``reread`` reads it anyway, as a
        store does when it opens). Returns ``(current, replaced)``: ``replaced`` when the files were
        replaced by a copy of the same build (an import or pull of this cache), so the caller
        reopens its store. Metadata that is not a local file (Redis) is read only when ``reread``.
        """
        if not self.meta_is_local_file and not reread:
            return opened, False
        stamp = self.meta_stamp() if self.meta_is_local_file else None
        if self.meta_is_local_file and stamp is not None and stamp == opened.stamp and not reread:
            return opened, False
        if self.meta_is_local_file and stamp is None:
            raise self._stale("its nbkit.json is gone (overwrite=True removes a cache before rebuilding it)")
        try:
            meta = self.read_meta()
        except FileNotFoundError:
            meta = None
        if meta is None:
            if self.meta_is_local_file:
                raise self._stale("its nbkit.json is gone (overwrite=True removes a cache before rebuilding it)")
            # A server that lost its memory (restarted, flushed): its store publishes the metadata
            # again and the samples are recomputed; that is not a rebuild.
            return opened, False
        current = Generation(meta.get("generation"), stamp)
        if opened.id is not None or current.id is not None:
            same = current.id == opened.id
        else:  # caches made before generation ids: the metadata file's identity is the generation
            same = not self.meta_is_local_file or stamp == opened.stamp
        if not same:
            raise self._stale("it was rebuilt (overwrite=True) by another handle or process after this one opened it")
        return current, current.stamp != opened.stamp

    def _stale(self, what: str) -> StaleCacheError:
        return StaleCacheError(
            f"the cache at {self.url} is not the one this dataset opened: {what}. This handle no longer reads or "
            f"writes there, so the rebuilt cache never receives samples of the old source. Open it again: "
            f"nbkit.CachedDataset(source, {self.url!r}) (or CachedDataset.open for a cache without its source)."
        )


def store_of(dataset) -> Store | None:
    """The nbkit store behind ``dataset`` (a ``CachedDataset``'s ``store``), or ``None`` for any other
    dataset: the loaders and samplers take any map-style dataset, and only nbkit's have a store.

    Example:
        >>> store_of([1, 2, 3]) is None
        True
    """
    store = getattr(dataset, "store", None)
    return store if isinstance(store, Store) else None
