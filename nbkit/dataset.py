"""``CachedDataset``: a persistent sample cache around any map-style PyTorch dataset.

The first read of a sample computes it from the source and stores it; every later read, in this
session or the next, on this host or another, comes from the cache. Fixed-shape fields live in
memory-mapped column files, so a batch is one vectorised gather at close to memory speed.

Example:
    >>> import torch, tempfile
    >>> from torch.utils.data import TensorDataset
    >>> import nbkit
    >>> path = tempfile.mkdtemp()
    >>> ds = nbkit.CachedDataset(TensorDataset(torch.randn(100, 8), torch.arange(100)), path)
    >>> report = ds.warmup()
    >>> ds.stats.cached, len(ds)
    (100, 100)
    >>> again = nbkit.CachedDataset.open(path)      # no source needed any more
    >>> int(again[42][1])
    42
"""

from __future__ import annotations

import contextlib
import copy
import enum
import os
import time
import uuid
import warnings

import numpy as np
from torch.utils.data import Dataset, get_worker_info

from . import format as fmt
from .stores import registry
from .stores.base import Store, new_generation
from .trust import MAX_FINGERPRINT_SAMPLES, check_bool, check_index, check_indices, check_int, check_size
from .codec import array_to_leaf, decode_freeform, encode_freeform, infer_schema
from .collate import BatchHandle, DeferredBatch, SampleBatch, TensorBatch, collate, register_gatherer
from .errors import CorruptCacheError, MissingSampleError
from .fingerprint import fingerprint
from .gather import auto_threads
from .stats import SharedCounters, Stats
from .transforms import apply_transform

__all__ = ["CachedDataset", "Opened"]


class Opened(str, enum.Enum):
    """How a :class:`CachedDataset` found its cache when it was made (``ds.opened``).

    Example:
        >>> import torch, tempfile, nbkit
        >>> path, src = tempfile.mkdtemp(), torch.utils.data.TensorDataset(torch.arange(4))
        >>> nbkit.CachedDataset(src, path).opened.value, nbkit.CachedDataset(src, path, overwrite=True).opened.value
        ('created', 'reopened')
        >>> nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(5)), path, overwrite=True).opened.value
        'replaced'
    """

    #: No cache was there: this handle made it (empty).
    CREATED = "created"
    #: A cache of this source was there (complete or partial) and is kept.
    REOPENED = "reopened"
    #: A cache of another source (or with unreadable metadata) was there; ``overwrite=True`` replaced it.
    REPLACED = "replaced"

class CachedDataset(Dataset):
    """A map-style dataset whose samples are computed once and then read from a persistent cache.

    Args:
        dataset: the source (any object with ``__len__`` and ``__getitem__``), or ``None`` to open an
            existing cache without it (same as :meth:`open`).
        path: where the cache lives: a local directory or an fsspec URL (``gs://bucket/prefix`` …); a
            remote cache is published there once complete, whether ``warmup()`` or training filled it.
        transform: applied to each whole sample *after* it is read from the cache, e.g. random
            augmentation on top of cached deterministic preprocessing; ``nbkit.fields(RandomCrop(24), None)``
            runs one callable per field instead.
        overwrite: replace a cache at ``path`` that was built from a different source (another
            dataset, transform or byte budget) or whose metadata cannot be read, instead of raising
            :class:`StaleCacheError`. A cache built from this source, complete or partial, is kept
            either way; ``ds.opened`` says which happened (:class:`Opened`). To start a matching cache
            over, remove it first: ``nbkit.remove(path)``.
        allow_pickle: store leaves of types nbkit does not know by pickling them, and allow reading
            such leaves back. Off by default: a cache received from someone else must not run code.
        fingerprint_samples: how many probe samples identify the source (content hash, determinism
            check); ``0`` skips both.
        max_bytes: a byte budget: cache only as many samples as fit (a fixed, evenly spread subset,
            the same in every session); the others are computed from the source on every read, so a
            shuffled epoch's hit rate equals the cached fraction.
        storage_options: passed to fsspec for remote URLs (e.g. ``{"token": ...}`` for gcsfs).
        local_max_bytes: for a remote cache (``gs://…``) larger than the local disk: read it through
            a local area of at most this many bytes, fetching pieces on demand, instead of pulling it whole.
        max_files_per_folder, compress: torch_xla's ``CachedDataset`` options, accepted with a
            ``FutureWarning`` and ignored (nbkit writes no per-sample files, and compresses copies
            with ``nbkit.export_tar(..., compression="zst")``).

    Raises:
        StaleCacheError: the cache at ``path`` was built from a different source (and ``overwrite``
            is off); or, from reads and
            writes, it was rebuilt (``overwrite=True``) by another handle or process after this one
            opened it (each ``nbkit.json`` carries a generation id: writes check it every time with
            one ``stat``, reads at most once a second, and every process when its store opens).
        NondeterministicSourceError: the source returns different data for the same index.
        TypeError: a sample holds a type that needs pickle and ``allow_pickle`` is off.
    """

    def __init__(self, dataset, path, *, transform=None, overwrite: bool = False, allow_pickle: bool = False,
                 fingerprint_samples: int = 3, max_bytes: int | None = None, storage_options: dict | None = None,
                 local_max_bytes: int | None = None, max_files_per_folder: int | None = None,
                 compress: bool | None = None):
        _warn_torch_xla_options(max_files_per_folder=max_files_per_folder, compress=compress)
        overwrite, allow_pickle = check_bool(overwrite, "overwrite"), check_bool(allow_pickle, "allow_pickle")
        fingerprint_samples = check_int(fingerprint_samples, "fingerprint_samples", min=0, max=MAX_FINGERPRINT_SAMPLES,
                                        fix="a few samples (the default is 3) tell a changed source")
        if max_bytes is not None:
            max_bytes = check_size(max_bytes, "max_bytes")
        if local_max_bytes is not None:
            local_max_bytes = check_size(local_max_bytes, "local_max_bytes", min=1)
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable (or None), got {type(transform).__name__}; for one callable "
                            "per field use nbkit.fields(...)")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict (or None), got {type(storage_options).__name__}")
        if overwrite and dataset is None:
            raise ValueError("overwrite=True needs the source dataset: a cache opened without it cannot be rebuilt")
        #: How this handle found the cache (:class:`Opened`); ``replaced_reason`` says why an old one went.
        self.opened, self.replaced_reason = Opened.REOPENED, ""
        self._source = dataset
        self.transform = transform
        self.allow_pickle = allow_pickle
        options = {} if local_max_bytes is None else {"local_max_bytes": local_max_bytes}
        self._location = registry.resolve(path, storage_options, **options)
        self.path = self._location.url
        self.root = self._location.root
        self._location.prepare()
        if dataset is None:
            self._meta = self._location.existing_meta()
        else:
            self._meta = self._create_or_check(dataset, overwrite, fingerprint_samples, max_bytes)
        # Which build of the cache this handle opened: a rebuild elsewhere (overwrite=True) makes it stale.
        self._generation = self._location.generation_of(self._meta)
        self._generation_checked = time.monotonic()
        self._length = int(self._meta["length"])
        self._files_obj = None
        self._files_pid = None
        self._into = None  # a part's store while writing_into() holds it
        self._counters = SharedCounters.create()
        self._verified = None
        # A remote cache filled by reads is published once it is complete (see _publish_if_complete).
        self._publish_pending = self._location.publishes and dataset is not None
        self._unfilled_from = 0  # no index below this one is missing (a hint: it only grows)
        self._token = uuid.uuid4().hex  # names this dataset to batch handles sent by DataLoader workers
        register_gatherer(self._token, self._collate_stored)
        self._closed = False

    @classmethod
    def open(cls, path, *, transform=None, allow_pickle: bool = False, storage_options: dict | None = None,
             local_max_bytes: int | None = None) -> "CachedDataset":
        """Open an existing cache without its source; samples never stored raise :class:`MissingSampleError`.

        Example:
            >>> import nbkit, pytest
            >>> with pytest.raises(FileNotFoundError):
            ...     nbkit.CachedDataset.open("/nonexistent/cache")
        """
        return cls(None, path, transform=transform, allow_pickle=allow_pickle, storage_options=storage_options,
                   local_max_bytes=local_max_bytes)

    # -- creation --------------------------------------------------------------------------------

    def _create_or_check(self, dataset, overwrite: bool, n_probes: int, max_bytes: int | None) -> dict:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise TypeError(
                f"CachedDataset needs a map-style dataset (with __len__ and __getitem__), got {type(dataset).__name__}. "
                "Iterable datasets cannot be cached by index."
            )
        length = len(dataset)
        if length == 0:
            raise ValueError(f"the source dataset {type(dataset).__name__} is empty; there is nothing to cache")
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise NotADirectoryError(f"cache path {self.root} exists and is not a directory; choose a directory path")
        fp, probes = fingerprint(dataset, n_probes=n_probes, allow_pickle=self.allow_pickle)
        probe_samples = list(probes.values()) or [dataset[0]]
        schema = infer_schema(probe_samples, allow_pickle=self.allow_pickle)
        columns = [{"file": fmt.column_file(leaf.column), "dtype": schema.column_dtype(leaf).str, "shape": list(leaf.shape)}
                   for leaf in schema.columns]
        wanted = {
            "format": fmt.FORMAT_NAME,
            "version": fmt.VERSION,
            "length": length,
            "schema": schema.to_json(),
            "columns": columns,
            "fingerprint": fp,
            "allow_pickle": self.allow_pickle,
            "generation": new_generation(),  # kept only if this call creates the cache
        }
        if max_bytes is not None:
            wanted.update(max_bytes=int(max_bytes), admit_seed=0,
                          capacity=_capacity(int(max_bytes), length, schema, probe_samples, self.allow_pickle))
        try:
            existing = self._location.read_meta()
        except CorruptCacheError as e:
            if not overwrite:
                raise
            existing, reason = None, f"its metadata could not be read ({e})"
            self._location.remove()
        else:
            reason = "; ".join(fmt.incompatibilities(existing, wanted)) if existing is not None else ""
            if reason and overwrite:
                # Only a cache of another source is replaced: a matching one, complete or partial,
                # is this source's work already (a box left ticked must not discard hours of it).
                self._location.remove()
                existing = None
        if reason and existing is None:
            self.opened, self.replaced_reason = Opened.REPLACED, reason
            existing = self._location.read_meta()  # another process may have published since
        elif existing is None:
            self.opened = Opened.CREATED
        if existing is not None:
            fmt.check_compatible(self.path, existing, wanted)
            return existing
        meta = self._location.publish_meta(wanted)
        fmt.check_compatible(self.path, meta, wanted)
        return meta

    # -- per-process state -------------------------------------------------------------------------

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_files_obj"] = None
        state["_files_pid"] = None
        state["_verified"] = None
        state["_into"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        register_gatherer(self._token, self._collate_stored)

    def without_source(self) -> "CachedDataset":
        """A copy of this handle that reads the cache without the source, as :meth:`open` would: what
        goes to worker processes that must not carry the source (Grain's, through
        :class:`nbkit.jax.GrainSource`). Pickled, it holds the cache's location, not its files: each
        process reopens them on first use. It counts into this handle's ``stats`` (the hit-rate meter
        sees its reads); a sample never stored raises :class:`MissingSampleError`.

        Example:
            >>> import torch, tempfile, pickle, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
            >>> _ = ds.warmup()
            >>> twin = pickle.loads(pickle.dumps(ds.without_source()))
            >>> twin.source is None, int(twin[3][0]), ds.stats.hits
            (True, 3, 1)
        """
        self._check_open()
        twin = copy.copy(self)  # __getstate__: no files, no verified flags; the same location and counters
        twin._source = None
        twin._publish_pending = False
        return twin

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Release what this dataset holds in this process: its files and memory maps (and with them
        its hold on the cache, so ``nbkit.remove`` can delete it), its store's connections and
        threads, its shared counters. Closing twice does nothing more; ``with CachedDataset(...) as
        ds:`` closes it at the end of the block.

        A closed dataset keeps its ``path`` and length, and raises ``ValueError`` on every read,
        ``warmup``, ``stats`` and the like, saying how to open it again. Close it once the loops
        reading it have ended: copies already in running DataLoader workers keep their own files
        open until the workers end, but a batch they send back to this closed dataset fails with
        the same ``ValueError``, and so does a ``DeviceLoader`` pass still reading it.

        Example:
            >>> import torch, tempfile, nbkit
            >>> path = tempfile.mkdtemp() + "/cache"
            >>> with nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), path) as ds:
            ...     ds.warmup().computed
            4
            >>> ds[0]  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: this CachedDataset of .../cache was closed (ds.close(), or the end of its with block)...
            >>> nbkit.remove(path).bytes > 0    # nothing holds the cache any more
            True
        """
        if self._closed:
            return
        self._closed = True
        store, self._files_obj, self._files_pid, self._verified = self._files_obj, None, None, None
        if store is not None:
            store.close()
        self._location.close()
        self._counters.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (here, or before this copy was pickled)."""
        return self._closed

    def __enter__(self) -> "CachedDataset":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(
                f"this CachedDataset of {self.path} was closed (ds.close(), or the end of its with block), so it no "
                f"longer reads or writes the cache. Open it again: nbkit.CachedDataset(source, {self.path!r}), or "
                f"nbkit.CachedDataset.open({self.path!r}) without the source."
            )

    @property
    def store(self) -> Store:
        """The sample store of this process (a :class:`nbkit.stores.base.Store`), opened on first use."""
        self._check_open()
        if self._into is not None:
            return self._into
        pid = os.getpid()
        if self._files_obj is None or self._files_pid != pid:
            # Each process maps the files itself (after fork too: never share fds or locks), and
            # first makes sure they are still the cache this handle opened.
            self._generation, _ = self._location.check_generation(self._generation, reread=True)
            self._generation_checked = time.monotonic()
            self._files_obj = self._location.open_store(self._meta, writable=self._source is not None)
            self._files_pid = pid
            self._verified = np.zeros(self._length, dtype=bool)
        return self._files_obj

    @contextlib.contextmanager
    def writing_into(self, store: Store):
        """Store what this dataset computes into ``store`` for the block: its compute path, schema and
        encoders unchanged, its own files untouched (a rebuilt cache is still refused: the generation
        check runs as always).

        Package-internal (a part build, :func:`nbkit.cluster.part.build_part`), not notebook API.

        Example:
            >>> import tempfile, torch, nbkit
            >>> from nbkit.cluster.part import PartStore, part_meta
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
            >>> part = PartStore(tempfile.mkdtemp(), part_meta(ds.store.meta, 4, 8), 4, writable=True, create=True)
            >>> with ds.writing_into(part):
            ...     _ = ds.compute_and_store(np.array([5, 6]))
            >>> part.state.tolist(), len(ds.missing())
            ([0, 1, 1, 0], 10)
            >>> part.close()
        """
        if self._into is not None:
            raise RuntimeError(f"this CachedDataset of {self.path} is already writing into another store")
        saved = self._verified
        # Its own verified flags: a sample stored into the part is not one read back from the cache.
        self._into, self._verified = store, np.zeros(self._length, dtype=bool)
        try:
            yield self
        finally:
            self._into, self._verified = None, saved

    def check_generation(self, every: float = 0.0) -> None:
        """Raise :class:`StaleCacheError` if the cache was rebuilt since this handle opened it (one
        ``stat`` of ``nbkit.json``; at most every ``every`` seconds); reopen the store if its files
        were replaced by a copy of the same build.

        Package-internal (the engine's reads and writes, :mod:`nbkit.cluster.warmup`), not notebook API.

        Example:
            >>> import torch, tempfile, nbkit
            >>> path = tempfile.mkdtemp()
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), path)
            >>> ds.check_generation()   # nothing rebuilt it: one stat
            >>> _ = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(5)), path, overwrite=True)
            >>> ds.check_generation()  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            nbkit.errors.StaleCacheError: the cache at ... is not the one this dataset opened: it was rebuilt...
        """
        self._check_open()  # first: a closed dataset's cache may be gone, and that is not the news
        now = time.monotonic()
        if every and now - self._generation_checked < every:
            return
        self._generation, replaced = self._location.check_generation(self._generation)
        self._generation_checked = now
        if replaced:
            self._files_obj = None  # reopened (and checked again) on next use

    @property
    def source(self):
        """The source dataset, or ``None`` for a cache opened without it."""
        return self._source

    @property
    def schema(self):
        return self.store.schema

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        src = type(self._source).__name__ if self._source is not None else "no source"
        return f"CachedDataset({src}, {self.path!r}, {len(self)} samples{', closed' if self._closed else ''})"

    # -- reads -----------------------------------------------------------------------------------------

    def _index_array(self, indices) -> np.ndarray:
        return check_indices(indices, self._length)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if isinstance(index, (list, tuple, range, np.ndarray)):  # several indices: their samples, as a list
            self.check_generation(every=_READ_CHECK_SECONDS)
            batch = self._fetch(self._index_array(index), single=False)
            return batch.samples() if isinstance(batch, SampleBatch) else list(batch)
        i = check_index(index, self._length)
        self.check_generation(every=_READ_CHECK_SECONDS)
        return self._fetch(np.array([i], dtype=np.int64), single=True)

    def __getitems__(self, indices):
        """Fetch a batch: one vectorised gather per fixed-shape field (used by DataLoader).

        In a DataLoader worker, a batch that is wholly stored comes back as a
        :class:`~nbkit.collate.DeferredBatch`: collated there, it becomes a small handle, and the
        main process gathers the rows itself from the shared memory-mapped files.
        """
        idx = self._index_array(indices)
        self.check_generation(every=_READ_CHECK_SECONDS)
        if self.transform is None and get_worker_info() is not None and self._column_ready(idx):
            self._counters.add(hits=len(idx))
            self.read_ahead(idx)  # the main process gathers it later: start reading it now
            return DeferredBatch(self.store.schema, idx, self._stored_batch, BatchHandle(self._token, idx))
        return self._fetch(idx, single=False)

    def read_ahead(self, idx) -> None:
        """Start reading the stored rows of ``idx`` into the page cache in the background when they
        are not there (a batch gathered later: DataLoader workers, ``DeviceLoader``'s next batch)."""
        self.store.will_need(self._index_array(idx))

    def _column_ready(self, idx: np.ndarray, local: bool = True) -> bool:
        """Whether every sample of ``idx`` is stored whole in fixed-shape columns (so the batch is
        one gather per column), in a store this host maps in memory when ``local``."""
        f = self.store
        schema = f.schema
        if schema.structure is None or schema.has_var or (local and not f.memory_mapped):
            return False
        return bool(f.is_stored(idx).all()) and not (f.flags_of(idx) & fmt.FLAG_FREEFORM).any()

    def _stored_batch(self, idx: np.ndarray):
        """The stored samples ``idx`` as a SampleBatch (or a list), without counting them again."""
        return self._read_stored(idx, single=False)

    def _collate_stored(self, idx: np.ndarray):
        """A worker's batch handle arriving here: gather and collate its (stored) samples."""
        return collate(self._stored_batch(idx))

    def read_columns(self, idx, out: list | None = None, threads: int | None = None) -> list | None:
        """The batch ``idx`` as gathered, checksum-verified column arrays, or ``None`` when the batch
        cannot be served that way (a sample not stored, free-form, with variable-length fields, or
        failing its checksum): the caller then reads it with ``__getitems__``, which computes,
        repairs and stores. ``transform`` is not applied. Counts the samples as hits.

        Args:
            idx: int64 dataset indices.
            out: arrays to gather into, one per column, each with at least ``len(idx)`` rows.
            threads: gather threads (``None``: by the batch's size).

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(6)), tempfile.mkdtemp())
            >>> ds.read_columns(np.array([1, 2])) is None    # not stored yet
            True
            >>> _ = ds.warmup()
            >>> ds.read_columns(np.array([1, 2]))[0].tolist()
            [1, 2]
        """
        idx = self._index_array(idx)
        self.check_generation(every=_READ_CHECK_SECONDS)
        if len(idx) == 1 and out is None:  # one sample (Grain's per-record reads): a row of each column
            rows = self._read_row(int(idx[0]))
            if rows is not None:
                return rows
        if not self._column_ready(idx, local=False):
            return None
        f = self.store
        n = len(idx)
        dest = None if out is None else [o[:n] for o in out]
        crcs = None
        if f.memory_mapped:
            columns, crcs = f.gather_checked(idx, out=dest, threads=threads, crc=not self._verified[idx].all())
        else:
            columns = f.gather(idx)
            if dest is not None:
                for d, c in zip(dest, columns):
                    np.copyto(d, c)
                columns = dest
        if len(self._check_new(idx, columns, threads=threads or 1, crcs=crcs)):
            return None
        self._counters.add(hits=n)
        return columns

    def _read_row(self, i: int) -> list | None:
        """``read_columns([i])`` for a stored sample of fixed-shape fields, without the batch path's
        per-call work: copies of its rows, checksum-verified once in this process; else ``None``."""
        f = self.store
        schema = f.schema
        if schema.structure is None or schema.has_var:
            return None
        views = f.row(i)
        if views is None:
            return None
        rows = [v[None].copy() for v in views]
        if not self._verified[i]:
            if not fmt.verify(f, np.array([i], dtype=np.int64), columns=rows)[0]:
                return None  # the batch path reports it, and repairs it from the source
            self._verified[i] = True
        self._counters.add(hits=1)
        return rows

    def _check_new(self, idx: np.ndarray, columns: list, blobs: list | None = None, threads: int = 1,
                   crcs: np.ndarray | None = None) -> np.ndarray:
        """Verify the checksums of the samples of ``idx`` not yet verified in this process, given
        their gathered ``columns`` (and heap ``blobs``, and the columns' ``crcs`` when the read took
        them on the bytes it read); return the indices that fail."""
        unverified = ~self._verified[idx]
        if not unverified.any():
            return idx[:0]
        pos = np.flatnonzero(unverified)
        sub = columns if len(pos) == len(idx) or crcs is not None else [c[pos] for c in columns]
        sub_blobs = {m: blobs[j] for m, j in enumerate(pos)} if blobs else {}
        sub_crcs = None if crcs is None else crcs[pos]
        ok = fmt.verify(self.store, idx[pos], columns=sub, blobs=sub_blobs, threads=threads, column_crcs=sub_crcs)
        self._verified[idx[pos[ok]]] = True
        return idx[pos[~ok]]

    def _fetch(self, idx: np.ndarray, single: bool):
        f = self.store
        stored = f.is_stored(idx)
        if stored.all():
            self._counters.add(hits=len(idx))
            return self._read_stored(idx, single)
        misses = int(np.count_nonzero(~stored))
        todo = np.unique(idx[~stored])
        admitted = f.admitted(todo)
        # Samples the store did not keep (beyond a byte budget, or refused by a full store) are
        # served straight from the source: correct, just not cached.
        unkept = self.compute_and_store(todo[admitted]) if admitted.any() else {}
        unkept.update((int(i), None) for i in todo[~admitted])
        self._counters.add(hits=len(idx) - misses, misses=misses)
        if self._publish_pending:
            self._publish_if_complete()
        if unkept:
            return self._mixed(idx, unkept, single)
        return self._read_stored(idx, single)

    def _read_stored(self, idx: np.ndarray, single: bool):
        got = self._gather(idx)
        if isinstance(got, list):
            return self._finish(got, single)
        return self._assemble(idx, *got, single)

    def _gather(self, idx: np.ndarray):
        """``(columns, var_values)`` of the stored samples ``idx`` with their checksums verified, or
        a list of samples when they must be served one by one (free-form, or repaired but refused)."""
        f = self.store
        schema = f.schema
        if schema.structure is None or (f.flags_of(idx) & fmt.FLAG_FREEFORM).any():
            return [self._read_one(int(i)) for i in idx]
        crcs = None
        if f.memory_mapped:
            columns, crcs = f.gather_checked(idx, crc=not self._verified[idx].all())
        else:
            columns = f.gather(idx)
        blobs = None
        if schema.has_var:
            try:
                blobs = [f.read_blob(int(i)) for i in idx]
            except CorruptCacheError:  # a damaged record (past the heap): its sample fails the check below
                blobs = [fmt.read_blob_or_none(f, int(i)) for i in idx]
                self._verified[idx[[b is None for b in blobs]]] = False
        failed = self._check_new(idx, columns, blobs, crcs=crcs,
                                 threads=auto_threads(sum(c.nbytes for c in columns)) if crcs is None else 1)
        if len(failed):
            unkept = {}
            for i in failed:
                unkept.update(self._repair(int(i)))
            if unkept:
                return [self._from_source(int(i), unkept) if int(i) in unkept else self._read_one(int(i)) for i in idx]
            return self._gather(idx)
        var_values = None
        if blobs is not None:
            per_sample = [schema.var_values(b, f"sample {int(i)} of {self.path}", self.allow_pickle) for i, b in zip(idx, blobs)]
            var_values = [list(v) for v in zip(*per_sample)] if per_sample else [[] for _ in schema.var_leaves]
        return columns, var_values

    def _assemble(self, idx: np.ndarray, columns: list, var_values, single: bool):
        """What ``__getitems__`` returns for gathered columns: a :class:`SampleBatch` (or a
        :class:`TensorBatch` for bare-tensor samples), or transformed samples."""
        schema = self.store.schema
        if self.transform is not None:
            return self._finish(SampleBatch(schema, idx, columns, var_values).samples(), single)
        leaf = schema.leaves[0]
        if schema.structure == "*" and leaf.store == "col" and leaf.kind == "tensor":
            batch = TensorBatch(array_to_leaf("tensor", leaf.dtype, columns[0]))
        else:
            batch = SampleBatch(schema, idx, columns, var_values)
        if single:
            return batch.samples()[0] if isinstance(batch, SampleBatch) else batch[0]
        return batch

    def _mixed(self, idx: np.ndarray, unkept: dict, single: bool):
        """A batch where some samples come from the store and others straight from the source.

        When every sample fits the schema's columns, the stored ones are gathered in one read and
        the computed ones are laid into the same arrays, so ``nbkit.collate`` stays vectorised (a
        byte budget's epoch then costs what its hit rate says); otherwise sample by sample.
        """
        schema = self.store.schema
        from_source = np.fromiter((int(i) in unkept for i in idx), dtype=bool, count=len(idx))
        computed = {int(i): self._from_source(int(i), unkept) for i in np.unique(idx[from_source])}
        kept_idx = idx[~from_source]
        got = self._gather(kept_idx) if len(kept_idx) else None
        if schema.structure is not None and not schema.has_var and not isinstance(got, list):
            parts = {i: schema.split(s, "sample", self.allow_pickle) for i, s in computed.items()}
            if all(p is not None for p in parts.values()):
                columns = []
                for k, leaf in enumerate(schema.columns):
                    col = np.empty((len(idx), *leaf.shape), dtype=schema.column_dtype(leaf))
                    if got is not None:
                        col[~from_source] = got[0][k]
                    col[from_source] = schema.stack(k, [parts[int(i)][0][k] for i in idx[from_source]])
                    columns.append(col)
                return self._assemble(idx, columns, None, single)
        if got is None:
            kept = iter(())
        elif isinstance(got, list):
            kept = iter(got)
        else:
            kept = iter(SampleBatch(schema, kept_idx, *got).samples())
        return self._finish([computed[int(i)] if from_source[j] else next(kept) for j, i in enumerate(idx)], single)

    def _where(self, i) -> str:
        return f"sample {int(i)} of {type(self._source).__name__}"

    def _finish(self, samples: list, single: bool):
        if self.transform is not None:
            samples = apply_transform(self.transform, samples, self.path)
        return samples[0] if single else samples

    def _read_one(self, i: int):
        """Read one stored sample the slow, general way (free-form or variable-length fields)."""
        f = self.store
        where = f"sample {i} of {self.path}"
        one = np.array([i])
        flag = int(f.flags_of(one)[0])
        blob = fmt.read_blob_or_none(f, i) if flag & (fmt.FLAG_FREEFORM | fmt.FLAG_VAR) else b""
        rows = [] if flag & fmt.FLAG_FREEFORM else [r[0] for r in f.gather(one)]
        if not self._verified[i] or blob is None:
            if not fmt.verify(f, one, columns=[r[None] for r in rows], blobs={0: blob})[0]:
                unkept = self._repair(i)
                return self._from_source(i, unkept) if unkept else self._read_one(i)
            self._verified[i] = True
        if flag & fmt.FLAG_FREEFORM:
            return decode_freeform(blob, allow_pickle=self.allow_pickle, where=where)
        schema = f.schema
        var_values = [[v] for v in schema.var_values(blob, where, self.allow_pickle)] if blob else None
        return SampleBatch(schema, np.array([i]), [r[None] for r in rows], var_values).samples()[0]

    def _from_source(self, i: int, computed: dict):
        """Sample ``i`` as just computed (``computed[i]``), or computed now if it is ``None``."""
        sample = computed.get(i)
        return self._compute(i) if sample is None else sample

    def _repair(self, i: int) -> dict:
        """Recompute a sample that failed its checksum; return ``{i: sample}`` if the store refused it."""
        if self._source is None:
            raise CorruptCacheError(
                f"sample {i} in the cache at {self.path} fails its checksum: the stored bytes, or its record in "
                f"{fmt.INDEX}, were damaged or modified. Open the cache with its source (nbkit.CachedDataset(source, "
                "path)) to recompute it, or pull / import the cache again."
            )
        self._counters.add(recomputed=1)
        return self.compute_and_store(np.array([i]))

    # -- writes ----------------------------------------------------------------------------------------

    def _compute(self, i: int):
        """Sample ``i`` from the source (with the index named in any error it raises)."""
        i = int(i)  # sources get plain ints, never numpy scalars
        if self._source is None:
            f = self.store
            budget = ""
            if not f.admitted(np.array([i]))[0]:
                budget = " (it lies outside the cache's byte budget, max_bytes, so it is never stored)"
            raise MissingSampleError(
                f"sample {i} is not in the cache at {self.path}{budget}; the cache holds {f.stored_count()} of "
                f"{self._length} samples and was opened without its source. Open it with the source to compute "
                "missing samples (nbkit.CachedDataset(source, path)), or warm it up completely before sharing it."
            )
        try:
            sample = self._source[i]
        except Exception as e:
            if hasattr(e, "add_note"):
                e.add_note(f"(raised by the source dataset while nbkit cached sample {i} into {self.path})")
            raise
        return sample

    def compute_and_store(self, indices: np.ndarray) -> dict:
        """Compute ``indices`` from the source and store them; return ``{i: sample}`` for those the
        store refused (a full Redis server, say), which callers serve without reading them back.

        Package-internal (misses, repairs, :mod:`nbkit.cluster.warmup`'s chunks and parts), not notebook API.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
            >>> ds.compute_and_store(np.array([0, 2])), ds.missing().tolist()
            ({}, [1, 3])
        """
        samples = [self._compute(int(i)) for i in indices]
        kept = self._store(indices, samples)
        if kept.all():
            return {}
        return {int(i): s for i, s, k in zip(indices, samples, kept) if not k}

    def _store(self, indices: np.ndarray, samples: list) -> np.ndarray:
        """Store computed samples; return which ones the store kept."""
        self.check_generation()  # never write old-source samples into a cache rebuilt meanwhile
        f = self.store
        if not f.writable:
            raise PermissionError(f"the cache at {self.path} is open read-only")
        schema = f.schema
        n = len(indices)
        col_rows = [[] for _ in range(f.n_columns)]
        conforming_pos, blobs_pos, blobs = [], [], []
        flags = np.zeros(n, np.uint8)
        split, allow = schema.split, self.allow_pickle
        for j, s in enumerate(samples):
            try:
                parts = split(s, "sample", allow)
            except TypeError:
                parts = split(s, self._where(indices[j]), allow)  # again, for an error that names the sample
            if parts is None:
                flags[j] = fmt.FLAG_FREEFORM
                blobs_pos.append(j)
                blobs.append(encode_freeform(s, allow_pickle=allow, where=self._where(indices[j])))
                continue
            cols, blob = parts
            conforming_pos.append(j)
            for rows, a in zip(col_rows, cols):
                rows.append(a)
            if blob:
                flags[j] = fmt.FLAG_VAR
                blobs_pos.append(j)
                blobs.append(blob)
        idx = np.asarray(indices, dtype=np.int64)
        crc = np.zeros(n, np.uint32)
        blob_of = dict(zip(blobs_pos, blobs))
        cpos = np.asarray(conforming_pos, dtype=np.int64)
        stacked = []
        if conforming_pos:
            stacked = [self._column(k, rows) for k, rows in enumerate(col_rows)]
            var_blobs = {m: blob_of[j] for m, j in enumerate(conforming_pos) if j in blob_of}
            crc[cpos] = fmt.batch_crc(stacked, len(cpos), var_blobs)
        for j in blobs_pos:
            if flags[j] == fmt.FLAG_FREEFORM:
                crc[j] = f.row_crc([], blob_of[j])
        kept = f.put(idx, flags, crc, cpos, stacked, np.asarray(blobs_pos, dtype=np.int64), blobs)
        kept = np.ones(n, dtype=bool) if kept is None else np.asarray(kept, dtype=bool)
        self._verified[idx[kept]] = True
        self._counters.add(stored=int(kept.sum()), refused=n - int(kept.sum()))
        return kept

    def _column(self, k: int, values: list):
        """Column ``k``'s rows of a batch for the store: stacked, or as :class:`nbkit.format.Rows`
        (each sample's own array) when its rows are large and the store writes them row by row."""
        f = self.store
        schema = f.schema
        if f.takes_rows:
            leaf = schema.columns[k]
            if schema.row_bytes(leaf) >= fmt.ROWS_MIN_BYTES:
                dtype, shape = schema.column_dtype(leaf), tuple(leaf.shape)
                if all(type(v) is np.ndarray and v.dtype == dtype and v.shape == shape for v in values):
                    return fmt.Rows(values)
        return schema.stack(k, values)

    def _publish_if_complete(self) -> None:
        """Publish a remote cache (``gs://…``) as soon as reads have stored its last sample, so that
        ordinary training fills the bucket, without ``warmup()`` or ``sync()``.

        Cheap enough to call after every read that stored something: it rescans the index only from
        the lowest sample not known to be stored, and only once that one is. Every process (DataLoader
        workers, TPU replicas) checks for itself, and more than one may find the cache complete; the
        location's ``publish`` holds the working copy's lock, skips a remote that already holds this
        cache and respects another host's lease, so the cache is pushed once.
        """
        f = self.store
        while self._unfilled_from < self._length:
            if f.missing(np.array([self._unfilled_from], dtype=np.int64)).size:
                return  # the usual answer while the cache fills: one lookup
            stop = min(self._length, self._unfilled_from + 65536)
            gap = f.missing(np.arange(self._unfilled_from, stop, dtype=np.int64))
            self._unfilled_from = int(gap[0]) if gap.size else stop
        self._publish_pending = False
        try:
            self._location.publish()
        except OSError as e:
            # Training goes on from the working copy; only sharing it waits.
            warnings.warn(f"nbkit: the cache at {self.path} is complete but could not be published; training goes on "
                          f"from the local working copy. {e}", RuntimeWarning, stacklevel=2)

    # -- bulk operations -------------------------------------------------------------------------------

    def missing(self) -> np.ndarray:
        """Indices of the samples not stored yet."""
        return self.store.missing()

    def warmup(self, num_workers: int = 0, callback=None, *, shard: tuple[int, int] | None = None,
               chunk_size: int = 256, multiprocessing_context=None):
        """Compute and store every missing sample; resumable and stoppable.

        Args:
            num_workers: ``0`` fills in this process; ``k > 0`` fills in ``k`` worker processes (the
                build protocol's local engine: each writes parts of ``chunk_size`` samples or more, up to
                1,024 while every worker still gets 8 of them, merged here).
            callback: an :class:`nbkit.progress.Callback` (or any fsspec callback) for progress;
                ``callback.request_stop()`` stops the warmup: after the current chunk in this process,
                at once with workers (they are terminated, even when stuck in the source; what they
                stored is kept). ``KeyboardInterrupt`` ends the workers too.
            shard: ``(rank, world)``: fill only the missing indices ``i`` with ``i % world == rank``
                (several processes sharing one cache each fill their part, no sample twice); with
                workers, the whole chunks ``k`` (indices ``k * chunk_size`` on) with ``k % world == rank``.
            chunk_size: samples per unit of work (and per progress update); with workers, the
                smallest part.
            multiprocessing_context: start method for the workers: ``"fork"``, ``"spawn"``,
                ``"forkserver"`` or a context (default: multiprocessing's default). With ``spawn`` and
                ``forkserver`` the source must be importable (defined in a module, not in ``__main__``).

        Raises:
            StaleCacheError: the cache at ``path`` was rebuilt (``overwrite=True``) elsewhere after
                this handle opened it.

        Returns:
            A :class:`nbkit.cluster.report.WarmupReport`.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
            >>> ds.warmup().computed
            10
        """
        from .progress import as_callback
        from .cluster.warmup import run_warmup

        report = run_warmup(self, num_workers=num_workers, callback=callback, shard=shard, chunk_size=chunk_size,
                            multiprocessing_context=multiprocessing_context)
        if not report.stopped and self._location.is_remote:
            cb = as_callback(callback)
            cb.start_phase("publish", unit="bytes")  # the panel then shows bytes uploaded, not samples
            self._location.publish(callback=cb)
        return report

    def prefetch(self, indices) -> int:
        """Ask the store to fetch ``indices`` ahead of reading them (read-through caches); return
        how many it queued (``0`` for stores that hold everything locally).

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
            >>> ds.prefetch([1, 2, 3])   # a local cache has nothing to fetch
            0
        """
        return int(self.store.prefetch(self._index_array(indices)) or 0)

    def loader(self, batch_size: int, **options):
        """Batches of this cache already on the accelerator: ``nbkit.DeviceLoader(self, batch_size, **options)``.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
            >>> [b.tolist() for (b,) in ds.loader(5, shuffle=False)]
            [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        """
        from .loader import DeviceLoader

        return DeviceLoader(self, batch_size, **options)

    def sync(self, callback=None) -> None:
        """Push the local working copy of a remote cache (``gs://…``) to its URL; no-op for local paths."""
        self._check_open()
        self._location.publish(callback=callback)

    def verify(self, callback=None) -> int:
        """Check every stored sample against its checksum; return how many were checked.

        Raises:
            CorruptCacheError: listing the first damaged samples.

        Example:
            >>> import torch, tempfile, nbkit
            >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(10)), tempfile.mkdtemp())
            >>> _ = ds.warmup()
            >>> ds.verify()
            10
        """
        store = self.store  # opened first: opening resets the per-process verified flags
        return fmt.verify_store(store, where=self.path, callback=callback, verified=self._verified)

    # -- stats -----------------------------------------------------------------------------------------

    @property
    def stats(self) -> Stats:
        """Counters summed over every process reading this dataset (DataLoader workers included)."""
        f = self.store
        t = self._counters.totals()
        return Stats(
            hits=t["hits"], misses=t["misses"], recomputed=t["recomputed"], stored=t["stored"], refused=t["refused"],
            cached=f.stored_count(), total=self._length, bytes=f.data_bytes(), capacity=f.capacity,
            disk_bytes=f.stored_bytes(),
        )

    def reset_stats(self) -> None:
        """Start hits/misses/recomputed/stored from zero (``cached`` is a fact about the disk and stays)."""
        self._check_open()
        self._counters.reset()

    @property
    def is_complete(self) -> bool:
        return len(self.store.missing()) == 0


#: Reads check the cache's generation at most this often (seconds); writes check every time.
_READ_CHECK_SECONDS = 1.0

# torch_xla's CachedDataset options and what nbkit does instead (each is accepted, ignored, and warned about).
_TORCH_XLA_OPTIONS = {
    "max_files_per_folder": "nbkit writes no file per sample, so there are no folders to split: a cache is a few "
                            "column files, an index and a heap",
    "compress": "nbkit stores samples uncompressed so they can be memory-mapped; to carry a smaller copy, "
                "compress it with nbkit.export_tar(path, 'cache.tar.zst', compression='zst')",
}


def _warn_torch_xla_options(**options) -> None:
    """One ``FutureWarning`` for each of torch_xla's ``CachedDataset`` options that was given (they are ignored)."""
    for name, value in options.items():
        if value is None:
            continue
        warnings.warn(f"CachedDataset({name}={value!r}) is an option of torch_xla's CachedDataset; nbkit ignores it: "
                      f"{_TORCH_XLA_OPTIONS[name]}. Remove {name}= (it will raise TypeError in a future release).",
                      FutureWarning, stacklevel=3)


def _capacity(max_bytes: int, length: int, schema, probes: list, allow_pickle: bool) -> int:
    """How many samples fit in ``max_bytes`` (the index, one record per sample, counts too)."""
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be a number of bytes >= 0, got {max_bytes}")
    per_sample = sum(schema.row_bytes(leaf) for leaf in schema.columns)
    if schema.structure is None or schema.has_var:
        sizes = []
        for s in probes:
            parts = schema.split(s, "probe", allow_pickle)
            sizes.append(len(encode_freeform(s, allow_pickle=allow_pickle)) if parts is None else len(parts[1]))
        per_sample += int(np.ceil(np.mean(sizes))) if sizes else 0
    available = max_bytes - length * fmt.RECORD.itemsize
    if available <= 0 or per_sample == 0:
        return 0 if available <= 0 else length
    return int(min(length, available // per_sample))
