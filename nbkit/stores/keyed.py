"""Key-value stores for :class:`nbkit.CacheLoader`: values found by an arbitrary str/int key, not by index.

A local keyed cache is a directory of three files: ``nbkit-keys.json`` (metadata, created once),
``values.bin`` (the encoded values, appended) and ``keys.bin`` (the index, appended: one record per
value, ``magic, key length, offset, length, value CRC, record CRC``, then the key). A writer appends
the value first and its record second, both under ``files.file_lock(keys.lock)``, so a record only
ever points at bytes already written. Readers take no lock: they parse the records appended since
they last looked, and stop at bytes that are no whole record (one being written) unless whole
records follow them (bytes left by a killed writer, or damage: skipped). So a value is never seen
before it is whole, and a writer killed mid-append leaves at most a torn record in ``keys.bin`` and
orphan bytes in ``values.bin``, neither of them ever served. A later record for the same key
replaces the earlier one (a value rewritten after failing its checksum). ``redis://`` URLs go to
:mod:`nbkit.stores.keyed_redis`.

Example:
    >>> import tempfile, zlib
    >>> store = LocalKeyed(tempfile.mkdtemp())
    >>> store.put(key_bytes("a"), zlib.crc32(b"one"), b"one"), store.put(key_bytes("a"), 0, b"two")
    (True, False)
    >>> store.get(key_bytes("a")) == (zlib.crc32(b"one"), b"one"), store.count()
    (True, 1)
"""

from __future__ import annotations

import json
import os
import re
import struct
import threading

import numpy as np
import torch

from .. import format as fmt
from .. import trust
from ..errors import CorruptCacheError, UnsafeArchiveError
from ..commit import atomic_write, file_lock, write_all
from ..gather import physical_memory
from .base import KeyedStore

__all__ = ["KEYS_META", "KEYS", "VALUES", "KEYS_LOCK", "FORMAT_NAME", "RECORD", "key_bytes", "key_of", "LocalKeyed"]

FORMAT_NAME = "nbkit-keyed"
VERSION = 1
KEYS_META = "nbkit-keys.json"
KEYS = "keys.bin"
VALUES = "values.bin"
KEYS_LOCK = "keys.lock"
MAGIC = b"NBKV"
#: One index record, followed by the key's bytes: magic, key length, value offset, value length,
#: value CRC-32, and the CRC-32 of the record's first 28 bytes and the key.
RECORD = struct.Struct("<4sIQQII")
MAX_KEY = 1 << 16
#: keys.bin is read at most this many bytes at a time (a record is at most 28 bytes + MAX_KEY).
_READ = 16 << 20


def key_bytes(key, name: str = "key") -> bytes:
    """The stored form of a key: ``i<decimal>`` for an integer, ``s<utf-8>`` for a string, ``b<bytes>``.

    Integers and strings stay apart (``1`` and ``"1"`` are different keys), and numpy or 0-d tensor
    integers equal Python ones. Anything else (``bool``, floats, NaN, float or complex tensors …)
    raises ``TypeError`` naming ``name`` and what is accepted.

    Example:
        >>> key_bytes(7), key_bytes("7"), key_bytes(__import__("numpy").int64(7))
        (b'i7', b's7', b'i7')
        >>> key_bytes(True)
        Traceback (most recent call last):
        ...
        TypeError: key must be a str, an int (numpy and 0-d integer tensors too) or bytes, got True (bool); convert it (e.g. str(key)) in your dataset
    """
    if isinstance(key, str):
        out = b"s" + key.encode("utf-8", "surrogatepass")
    elif isinstance(key, (bytes, bytearray)):
        out = b"b" + bytes(key)
    elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        out = _int_key(int(key), name)
    elif isinstance(key, torch.Tensor) and key.ndim == 0 and not key.is_floating_point() and not key.is_complex() \
            and key.dtype != torch.bool:
        out = _int_key(int(key.item()), name)  # a 0-d integer tensor (a DataLoader's index)
    else:
        raise TypeError(
            f"{name} must be a str, an int (numpy and 0-d integer tensors too) or bytes, got {trust.shown(key, 60)} "
            f"({type(key).__name__}); convert it (e.g. str(key)) in your dataset"
        )
    if len(out) > MAX_KEY:
        raise ValueError(f"{name} is at most {MAX_KEY - 1} bytes long in its stored form; got one of {len(out) - 1}")
    return out


def _int_key(value: int, name: str) -> bytes:
    if not -MAX_INT_KEY < value < MAX_INT_KEY:
        raise ValueError(f"{name} is too large for an int key (at most {MAX_INT_DIGITS} digits); use a str key (str(key)) or bytes")
    return b"i%d" % value



MAX_INT_DIGITS = 1000
MAX_INT_KEY = 10**MAX_INT_DIGITS
_INT_KEY = re.compile(rb"i-?(?:0|[1-9][0-9]{0,999})\Z")


def valid_key(kb: bytes) -> bool:
    """Whether ``kb`` is a stored key form that :func:`key_bytes` could have made (checked on every
    record read from a cache: anything else is damage)."""
    tag = kb[:1]
    if tag == b"i":
        return _INT_KEY.match(kb) is not None
    if tag == b"s":
        try:
            kb[1:].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return False
        return True
    return tag == b"b"


def key_of(kb: bytes):
    """The key a stored form stands for (inverse of :func:`key_bytes`; ``kb`` passed :func:`valid_key`).

    Example:
        >>> key_of(b"i7"), key_of(b"sseven"), key_of(b"b\\x00")
        (7, 'seven', b'\\x00')
    """
    body = kb[1:]
    if kb[:1] == b"i":
        return int(body)
    if kb[:1] == b"s":
        return body.decode("utf-8", "surrogatepass")
    return bytes(body)


def keyed_meta() -> dict:
    return {"format": FORMAT_NAME, "version": VERSION}


_META_SPEC = trust.Obj({"format": trust.Str(choices=(FORMAT_NAME,)), "version": trust.Int(min=1, max=VERSION),
                       "shards": trust.Int(min=1, max=4096)}, required=("format", "version"))


def check_keyed_meta(raw: bytes, where: str) -> dict:
    """Parse keyed-cache metadata read from ``where``; anything else raises :class:`CorruptCacheError`."""
    fix = "Delete the CacheLoader's directory (or Redis keys) and let it fill again, or give it a directory of its own."
    meta = trust.load_json(raw, where, fix, format_name=FORMAT_NAME, what="CacheLoader metadata", version=VERSION)
    return trust.check_json(meta, _META_SPEC, where, fix)


class LocalKeyed(KeyedStore):
    """The files of one local keyed cache, opened in one process (each DataLoader worker opens its own).

    Methods take keys in their stored form (:func:`key_bytes`).
    """

    is_remote = False

    def __init__(self, root: str):
        self.root = root
        if os.path.exists(os.path.join(root, fmt.META)):
            raise ValueError(
                f"{root} holds a CachedDataset cache (it has {fmt.META}); open it with nbkit.CachedDataset.open({root!r}), "
                "and give the CacheLoader a directory of its own."
            )
        os.makedirs(root, exist_ok=True)
        meta_path = os.path.join(root, KEYS_META)
        if not os.path.lexists(meta_path):
            atomic_write(meta_path, json.dumps(keyed_meta(), sort_keys=True).encode(), exclusive=True, sync=True)
        for name in (KEYS_META, KEYS, VALUES, KEYS_LOCK):
            if os.path.islink(os.path.join(root, name)):
                raise UnsafeArchiveError(f"{os.path.join(root, name)} is a symbolic link; a CacheLoader's directory holds "
                                         "regular files only. Refusing to follow it: remove it.")
        check_keyed_meta(trust.read_small(meta_path), meta_path)
        self._values = trust.open_regular(os.path.join(root, VALUES), os.O_RDWR | os.O_CREAT)
        self._keys = trust.open_regular(os.path.join(root, KEYS), os.O_RDWR | os.O_CREAT)
        self._values_size = 0  # bytes of values.bin known to exist (refreshed when a record points further)
        self._lock = os.path.join(root, KEYS_LOCK)
        self._map: dict = {}  # key bytes -> (offset, length, crc)
        self._pos = 0  # end of the last whole record read from keys.bin
        self._stuck = None  # (position, size of keys.bin) where no whole record could be read
        self._mutex = threading.Lock()  # threads of this process (a DataLoader's pin thread, a device loader) share _pos

    def refresh(self) -> int:
        """Read the records appended since the last call; return where the whole records end."""
        with self._mutex:
            size = os.fstat(self._keys).st_size
            # Read in bounded pieces: keys.bin's size is data (a copied or damaged file may be a huge
            # sparse one), so it never decides how much is allocated at once.
            while size > self._pos and (self._pos, size) != self._stuck:
                data = os.pread(self._keys, min(size - self._pos, _READ), self._pos)
                used = self._parse(data)
                if used == 0:
                    # No whole record in what is left (a record being written), or none in a whole
                    # piece, far more than any torn record (damage): stop until keys.bin grows.
                    self._stuck = (self._pos, size)
                    break
                self._pos += used
            return self._pos

    def _parse(self, data: bytes) -> int:
        """Add the whole records in ``data`` to the map; return how many bytes were read past."""
        pos, n = 0, len(data)
        while pos < n:
            end = self._record(data, pos)
            if end is None:
                # Bytes that are no record: the tail of a record still being written (nothing whole
                # follows: stop, and read it again next time), or bytes left by a writer that was
                # killed, or damaged, with whole records after them: skip to the next one.
                nxt = data.find(MAGIC, pos + 1)
                while nxt >= 0 and self._record(data, nxt, add=False) is None:
                    nxt = data.find(MAGIC, nxt + 1)
                if nxt < 0:
                    break
                pos = nxt
                continue
            pos = end
        return pos

    def _record(self, data: bytes, pos: int, add: bool = True):
        """The end of the whole record at ``pos`` in ``data`` (added to the map), or ``None``."""
        head = RECORD.size
        if pos + head > len(data):
            return None
        magic, klen, off, length, crc, rcrc = RECORD.unpack_from(data, pos)
        end = pos + head + klen
        if magic != MAGIC or end > len(data):
            return None
        key = data[pos + head:end]
        if fmt.row_crc([data[pos:pos + head - 4], key]) != rcrc or not valid_key(key):
            return None
        if add:
            self._map[key] = (off, length, crc)
        return end

    def lookup(self, kb: bytes):
        """``(offset, length, crc)`` of a stored key, or ``None``."""
        found = self._map.get(kb)
        if found is None:
            self.refresh()  # another process may have stored it since
            found = self._map.get(kb)
        return found

    def contains(self, kb: bytes) -> bool:
        return self.lookup(kb) is not None

    def get(self, kb: bytes, *, fresh: bool = False):
        """``(crc, value)`` of a stored key, or ``None``; ``fresh``: look for a newer record of it first
        (another process may have replaced a damaged value)."""
        if fresh:
            self.refresh()
        found = self.lookup(kb)
        if found is None:
            return None
        off, length, crc = found
        if off + length > self._values_size:
            self._values_size = os.fstat(self._values).st_size  # another process may have appended since
            if off + length > self._values_size:
                raise CorruptCacheError(
                    f"the record of key {key_of(kb)!r} in {os.path.join(self.root, KEYS)} points at bytes {off}..{off + length} "
                    f"of {os.path.join(self.root, VALUES)}, which holds {self._values_size}: the record is damaged."
                )
        if length > fmt.BLOB_PIECE:  # a claim: checked piece by piece (a sparse values.bin holds nothing) first
            where = f"the record of key {key_of(kb)!r} in {os.path.join(self.root, KEYS)}"
            if length > physical_memory() // 2:
                raise CorruptCacheError(f"{where} claims a value of {length:,} bytes, more than half of this machine's "
                                        "memory: the record is damaged.")
            if fmt.range_crc(self._values, off, length) != crc:
                raise CorruptCacheError(f"{where} points at {length:,} bytes of {os.path.join(self.root, VALUES)} that "
                                        "fail its checksum: the record is damaged.")
        return crc, os.pread(self._values, length, off)

    def put(self, kb: bytes, crc: int, value: bytes, *, replace: bool = False) -> bool:
        """Store ``value`` under ``kb`` unless another process stored the key first (or ``replace``);
        return whether this call stored it."""
        with file_lock(self._lock):
            self.refresh()
            if not replace and kb in self._map:
                return False
            off = os.fstat(self._values).st_size
            head = RECORD.pack(MAGIC, len(kb), off, len(value), crc, 0)[:-4]
            record = head + struct.pack("<I", fmt.row_crc([head, kb])) + kb
            # At the end of the file, after any bytes a killed writer left (readers skip them) ...
            end = size = os.fstat(self._keys).st_size
            if size - self._pos + len(record) > _READ:
                # ... unless a reader, which reads a bounded piece past the last whole record, could never
                # reach it (a sparse or damaged tail): then over those bytes, which hold no record.
                end = self._pos
            try:
                write_all(self._values, value, off, path=os.path.join(self.root, VALUES))
                write_all(self._keys, record, end, path=os.path.join(self.root, KEYS))
                if end + len(record) < size:
                    os.ftruncate(self._keys, end + len(record))
            except OSError:
                # A full disk: no torn tail is left for the next append to follow.
                os.ftruncate(self._keys, end)
                os.ftruncate(self._values, off)
                raise
        self.refresh()
        return True

    def count(self) -> int:
        self.refresh()
        return len(self._map)

    def keys(self) -> list:
        """Every stored key, in stored form."""
        self.refresh()
        return list(self._map)

    def close(self) -> None:
        for fd in (self._values, self._keys):
            try:
                os.close(fd)
            except OSError:
                pass

