"""``CacheLoader``: a persistent cache looked up by key inside your own ``__getitem__`` (Bagua's spelling).

Use it when your dataset decides what to cache: ``loader.get(key, load_fn)`` returns the value stored
under ``key``, or calls ``load_fn(key)``, stores the result and returns it. Random augmentation then
runs after it, in your code. Values are the samples :class:`nbkit.CachedDataset` stores (tensors,
arrays, numbers, strings, bytes, nested in tuples, lists and dicts), each encoded free-form with its
CRC-32, which is checked on every read. The stores live in :mod:`nbkit.stores.keyed` (a local
directory: append-only values and key index) and :mod:`nbkit.stores.keyed_redis` (``redis://``).

Example:
    >>> import tempfile, torch, nbkit
    >>> loader = nbkit.CacheLoader(tempfile.mkdtemp())
    >>> loader.get("img-7", lambda key: torch.full((2,), 7.0))       # a miss: load_fn runs, the value is stored
    tensor([7., 7.])
    >>> loader.get("img-7", lambda key: 1 / 0), "img-7" in loader, len(loader)   # a hit: load_fn is not called
    (tensor([7., 7.]), True, 1)
"""

from __future__ import annotations

import functools
import os

from . import format as fmt
from . import trust
from .codec import decode_freeform, encode_freeform
from .errors import CorruptCacheError, MissingSampleError
from .stores import keyed
from .text import format_list

__all__ = ["CacheLoader", "resolve"]


class CacheLoader:
    """A persistent key → value cache shared by DataLoader workers, processes and sessions.

    Args:
        path_or_url: a local directory (created if absent), or ``redis://[[user]:password@]host[:port]
            [,host[:port]…]/<db>/<name>`` to share one cache between hosts (``pip install redis``; the ``redis`` extra).
            ``gs://`` and other bucket URLs are refused, with the reason: a bucket only receives complete
            caches, and a key-value cache is never complete; keep it local (copy the directory when
            nothing writes to it) or use Redis.
        allow_pickle: store values of types nbkit does not know by pickling them, and read such values
            back. Off by default: a cache someone sends you must not run code. Writer and reader both need it.
        storage_options: for ``redis://``, keyword arguments of ``redis.Redis`` (``password``, ``ssl_ca_certs`` …).

    Guarantees, as for :class:`nbkit.CachedDataset`: a value is visible to other processes only once it is
    whole; its checksum is verified on every read (damage raises :class:`nbkit.CorruptCacheError` naming the
    key, or is repaired with ``load_fn`` when one is given); a process killed at any moment leaves a cache that
    reopens and serves only whole values. When two processes miss the same key at once, both call ``load_fn``
    and the first to finish stores its value.

    Example:
        >>> import tempfile, nbkit
        >>> path = tempfile.mkdtemp()
        >>> nbkit.CacheLoader(path).get(3, lambda i: {"x": [i, i * i], "name": f"n{i}"})
        {'x': [3, 9], 'name': 'n3'}
        >>> nbkit.CacheLoader(path).get(3)                 # next session: no load_fn needed
        {'x': [3, 9], 'name': 'n3'}
    """

    def __init__(self, path_or_url, *, allow_pickle: bool = False, storage_options: dict | None = None):
        #: the path or URL as given; ``root``: the local directory, or the normalized Redis URL
        self.path = _check_url(path_or_url)
        self.allow_pickle = trust.check_bool(allow_pickle, "allow_pickle")
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict (keyword arguments of redis.Redis) or None, got "
                            f"{type(storage_options).__name__}")
        self.root, self._opener = resolve(self.path, storage_options)
        self._store = None
        self._store_pid = None
        _ = self.store  # a bad path, metadata or server fails here, not on the first read

    @property
    def store(self):
        """This process's key-value store, opened on first use (after fork too: never share descriptors)."""
        if self._store is None or self._store_pid != os.getpid():
            self._store, self._store_pid = self._opener(), os.getpid()
        return self._store

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_store"] = state["_store_pid"] = None
        return state

    def __repr__(self) -> str:
        return f"CacheLoader({self.path!r})"

    def _where(self, kb: bytes) -> str:
        return f"the value of key {keyed.key_of(kb)!r} in the CacheLoader at {self.path}"

    def get(self, key, load_fn=None):
        """The value stored under ``key``; on a miss, ``load_fn(key)``, stored and returned.

        Args:
            key: a ``str``, an ``int`` (numpy and 0-d tensor integers too) or ``bytes``; ``1`` and ``"1"``
                are different keys.
            load_fn: computes the value of a key not stored yet (or whose stored bytes are damaged).

        Raises:
            MissingSampleError: ``key`` is not stored and no ``load_fn`` was given (a ``LookupError``).
            CorruptCacheError: the stored value fails its checksum and no ``load_fn`` was given.
            TypeError: ``load_fn`` returned a type that needs pickle and ``allow_pickle`` is off.
        """
        kb = keyed.key_bytes(key)
        if load_fn is not None and not callable(load_fn):
            raise TypeError(f"load_fn must be a callable (key -> value) or None, got {type(load_fn).__name__}")
        value, damage = self._read(kb)
        if damage is not None:
            value, damage = self._read(kb, fresh=True)  # another process may have stored it again since
        if value is not None:
            try:
                return decode_freeform(value, allow_pickle=self.allow_pickle, where=self._where(kb))
            except CorruptCacheError:
                if load_fn is None:
                    raise
                return self._load(kb, key, load_fn, replace=True)  # whole but malformed (forged): replaced
        if damage is not None:
            if load_fn is None:
                raise CorruptCacheError(f"{damage} Call get(key, load_fn) to compute and store it again, or delete the cache.")
            return self._load(kb, key, load_fn, replace=True)
        if load_fn is None:
            raise MissingSampleError(
                f"key {key!r} is not in the CacheLoader at {self.path} ({len(self)} keys stored); pass load_fn to "
                "compute it: loader.get(key, load_fn)."
            )
        return self._load(kb, key, load_fn, replace=False)

    def _read(self, kb: bytes, *, fresh: bool = False):
        """``(value bytes, None)`` of a stored key whose checksum holds; ``(None, None)`` if not stored;
        ``(None, what is wrong)`` if its record or bytes are damaged."""
        try:
            found = self.store.get(kb, fresh=fresh)
        except CorruptCacheError as e:  # a record pointing outside values.bin
            return None, f"{self._where(kb)} is damaged: {e}"
        if found is None:
            return None, None
        if not intact(found):
            return None, f"{self._where(kb)} fails its checksum: the stored bytes were damaged or modified."
        return found[1], None

    def _load(self, kb: bytes, key, load_fn, *, replace: bool):
        value = load_fn(key)
        blob = encode_freeform(value, allow_pickle=self.allow_pickle, where=f"the value load_fn returned for key {key!r}")
        self.store.put(kb, fmt.row_crc([], blob), blob, replace=replace)
        return value

    def __contains__(self, key) -> bool:
        return self.store.contains(keyed.key_bytes(key))

    def __len__(self) -> int:
        return self.store.count()

    def num_keys(self) -> int:
        """How many keys are stored (Bagua's name for ``len(loader)``)."""
        return len(self)

    def keys(self) -> list:
        """Every stored key, as given to :meth:`get` (an ``int`` key comes back as an ``int``)."""
        return [keyed.key_of(kb) for kb in self.store.keys()]

    def verify(self) -> int:
        """Check every stored value against its checksum; return how many were checked.

        Raises:
            CorruptCacheError: naming the first damaged keys.
        """
        kbs = self.store.keys()
        bad = [keyed.key_of(kb) for kb in kbs if self._read(kb)[0] is None]
        if bad:
            raise CorruptCacheError(
                f"{len(bad)} value(s) in the CacheLoader at {self.path} fail their checksum (keys "
                f"{format_list(bad, show=repr)}). Call get(key, load_fn) on them to compute and store them again."
            )
        return len(kbs)

    def close(self) -> None:
        """Release this process's files or connections (reopened on next use)."""
        if self._store is not None and self._store_pid == os.getpid():
            self._store.close()
        self._store = None


def intact(found) -> bool:
    """Whether a stored ``(crc, value)`` matches its checksum."""
    crc, blob = found
    return fmt.row_crc([], blob) == crc


def _check_url(url) -> str:
    """``url`` as ``str``, refusing a wrong type or a URL typo (``gs:/x``, an unknown scheme) with the fix."""
    from .stores.registry import check_cache_url

    return check_cache_url(url, "path_or_url")


def resolve(url: str, storage_options: dict | None = None):
    """``(root, opener)``: where the keyed store at ``url`` lives, and a picklable callable that opens
    it in a process (each process calls it once; DataLoader workers after they start).

    Local paths and ``file://`` give :class:`LocalKeyed`; ``redis://`` / ``rediss://`` give
    :class:`nbkit.stores.keyed_redis.RedisKeyed`. Other fsspec URLs (``gs://`` …) are refused with
    the reason and the alternatives: the bucket mirror publishes only complete caches, and a keyed
    cache is never complete (any key may come next).
    """
    from fsspec.core import split_protocol, strip_protocol

    url = _check_url(url)
    protocol, _ = split_protocol(url)
    if protocol in ("redis", "rediss"):
        from .stores.keyed_redis import RedisKeyed
        from .stores.registry import resolve as resolve_location

        location = resolve_location(url, storage_options)  # checks the redis package, parses the URL
        return location.root, functools.partial(RedisKeyed, location)
    if protocol in (None, "file", "local"):
        root = os.path.abspath(os.path.expanduser(strip_protocol(url) if protocol else url))
        return root, functools.partial(keyed.LocalKeyed, root)
    raise ValueError(
        f"a CacheLoader cannot live at {url}: nbkit mirrors a {protocol}:// cache through a local working copy that "
        "it publishes only once complete, and a key-value cache is never complete (any key may come next). Share it "
        "live with redis:// (nbkit.CacheLoader('redis://host:6379/0/name')), or keep it in a local directory and copy "
        "that directory to the bucket when no process writes to it (e.g. gsutil -m cp -r); the checksums catch a "
        "damaged copy. For a fixed set of samples, nbkit.CachedDataset(source, 'gs://…') publishes to the bucket."
    )
