"""The trust boundary: what comes from outside the process is checked here, once, before it is used.

Everything nbkit reads from a cache directory, a tar or a bucket (``nbkit.json``, ``manifest.json``,
member and object names, sizes) and every argument a user passes is turned into a trusted value by
a function of this module, or refused with an error that names the thing, what it got, what was
expected and the fix. The rest of nbkit never re-checks. ``docs/SECURITY.md`` says what is trusted.

* **Arguments**: :func:`check_int`, :func:`check_size`, :func:`check_bool`, :func:`check_path`,
  :func:`check_url` raise ``TypeError`` (wrong kind) or ``ValueError`` (wrong value) naming the
  argument.
* **File names** come from one fixed pattern (:data:`CACHE_FILE`), never from data:
  :func:`is_cache_file`, :func:`cache_file_path` (which also refuses a link out of the directory).
* **JSON** (metadata, manifests) is checked against a declarative spec (:class:`Int`, :class:`Str`,
  :class:`List`, :class:`Obj` …) by :func:`check_json`, which raises :class:`CorruptCacheError`
  naming the file and the field. (A spec language of our own rather than pydantic or msgspec:
  nbkit depends on torch, numpy and fsspec only, and the checks that matter — names from a pattern,
  sizes against real files — are ours either way.)

Example:
    >>> check_int(2, "num_workers", min=0)
    2
    >>> check_int(1.5, "num_workers", min=0)
    Traceback (most recent call last):
    ...
    TypeError: num_workers must be an int >= 0, got 1.5 (float)
    >>> is_cache_file("col-3.bin"), is_cache_file("../evil.py")
    (True, False)
    >>> check_json({"n": 3}, Obj({"n": Int(min=0)}), "nbkit.json", "Re-create it.")
    {'n': 3}
"""

from __future__ import annotations

import errno
import json
import math
import numbers
import operator
import os
import re
import reprlib
import stat

import numpy as np

from .errors import CorruptCacheError, UnsafeArchiveError
from .text import fix

__all__ = ["check_int", "check_size", "check_bool", "check_path", "check_url", "CACHE_FILE", "is_cache_file",
           "check_cache_file", "cache_file_path", "check_json", "Int", "Str", "Bool", "Float", "List", "Obj", "Map",
           "Optional", "AnyJSON", "MAX_COLUMNS", "MAX_JSON_BYTES", "MAX_EPOCH", "MAX_SEED", "MAX_SAMPLES", "MAX_WORLD_SIZE",
           "MAX_WORKERS", "MAX_PREFETCH", "MAX_FINGERPRINT_SAMPLES", "SEED_FIX", "open_regular", "open_readable", "read_small", "shown", "load_json"]

#: The largest metadata or manifest file nbkit parses (a real one is a few KiB).
MAX_JSON_BYTES = 16 << 20
#: At most this many column files (``col-0.bin`` … ``col-4095.bin``).
MAX_COLUMNS = 4096

# Integer arguments are bounded where they are checked, so that a value that passes works through
# every computation made with it (a seed of 2**64 - 1 passed, then ``seed + 1`` overflowed
# ``torch.Generator.manual_seed`` at the second epoch).
#: The largest epoch number a sampler or loader takes (and a resume state may hold).
MAX_EPOCH = 1 << 62
#: The largest shuffle seed: ``seed + epoch`` stays a signed 64-bit integer (what torch and numpy
#: take as a seed, and what a checkpoint's tensors hold) for every epoch up to :data:`MAX_EPOCH`.
MAX_SEED = (1 << 63) - 1 - MAX_EPOCH
SEED_FIX = ("seed + epoch must fit a signed 64-bit integer (torch.Generator.manual_seed, numpy) for every epoch; "
            "pass a smaller seed, e.g. seed % 2**62")
#: The most samples a batch, a chunk or a sampled length may hold (``nbkit.format.MAX_LENGTH``).
MAX_SAMPLES = 1 << 40
#: The most processes a run is sharded over (ranks ``0 … MAX_WORLD_SIZE - 1``): a sampler pads its
#: order to a multiple of the world size, so a larger one would allocate that many indices.
MAX_WORLD_SIZE = 1 << 20
#: The most worker processes or threads one nbkit operation starts (as ``max_workers`` of a transfer).
MAX_WORKERS = 256
#: The most batches a loader keeps ready ahead of the training step.
MAX_PREFETCH = 1024
#: The most source samples a cache's fingerprint hashes: what ``nbkit.json``'s ``fingerprint.samples``
#: may hold (a :class:`Map`'s default size), so a cache made with more would not open again.
MAX_FINGERPRINT_SAMPLES = 1 << 16

# ---------------------------------------------------------------------------------------------
# arguments


def _got(value) -> str:
    return f"{shown(value)} ({type(value).__name__})"


def _bound(n) -> str:
    """A bound as people read it: ``1099511627776`` → ``'2**40'``, ``2**62 - 1`` → ``'2**62 - 1'``, ``256`` → ``'256'``."""
    if n is None or abs(n) < 1 << 16:
        return str(n)
    for offset, suffix in ((0, ""), (1, " - 1")):
        if (n + offset) & (n + offset - 1) == 0:
            return f"2**{(n + offset).bit_length() - 1}{suffix}"
    return str(n)


def check_int(value, name: str, *, min: int | None = None, max: int | None = None, fix: str = "") -> int:
    """``value`` as an ``int`` (Python or numpy integers; not ``bool``, floats or strings), within bounds.

    ``fix``: why the bounds are what they are, or what to pass instead; ends a ``ValueError``'s message.

    Example:
        >>> check_int(2**64, "seed", min=0, max=MAX_SEED, fix=SEED_FIX)
        Traceback (most recent call last):
        ...
        ValueError: seed must be an int in [0, 2**62 - 1], got 18446744073709551616: seed + epoch must fit a signed 64-bit integer (torch.Generator.manual_seed, numpy) for every epoch; pass a smaller seed, e.g. seed % 2**62
    """
    lo, hi = _bound(min), _bound(max)
    bounds = f" >= {lo}" if min is not None and max is None else (
        f" in [{lo}, {hi}]" if min is not None else (f" <= {hi}" if max is not None else ""))
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{bounds}, got {_got(value)}")
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        got = shown(value) if value.bit_length() <= 256 else f"an int of {value.bit_length()} bits"  # str() refuses huge ones
        raise ValueError(f"{name} must be an int{bounds}, got {got}" + (f": {fix}" if fix else ""))
    return value


def check_size(value, name: str, *, min: int = 0) -> int:
    """A number of bytes: an ``int`` (or a whole, finite float such as ``2e9``) ``>= min``.

    Example:
        >>> check_size(2e9, "max_bytes")
        2000000000
    """
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a number of bytes (an int >= {min}, e.g. 2 * 2**30 for 2 GiB), got {_got(value)}")
    if value < min:
        raise ValueError(f"{name} must be a number of bytes >= {min}, got {int(value)}")
    return int(value)


def check_bool(value, name: str) -> bool:
    """``value`` if it is a ``bool`` (numpy bools too).

    Example:
        >>> check_bool(True, "overwrite")
        True
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {_got(value)}")
    return bool(value)


def check_index(value, length: int, name: str = "index") -> int:
    """One sample index: an integer or an integer-like (``operator.index``: numpy integers, a one-element
    integer tensor), in ``[-length, length)``; a negative one counts from the end.

    Example:
        >>> check_index(-1, 10)
        9
        >>> check_index(1.5, 10)
        Traceback (most recent call last):
        ...
        TypeError: index must be an integer (or integer-like: operator.index), got 1.5 (float)
    """
    try:
        i = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer (or integer-like: operator.index), got {_got(value)}") from None
    if not -length <= i < length:
        got = i if i.bit_length() <= 256 else f"an int of {i.bit_length()} bits"
        raise IndexError(f"{name} {got} is out of range for {length} samples")
    return i + length if i < 0 else i


def check_indices(values, length: int, name: str = "indices") -> np.ndarray:
    """Sample indices (a sequence or an array of integers or integer-likes) as an int64 array in ``[0, length)``.

    Floats, strings and other types are refused with a ``TypeError`` naming the type (``[1.5]`` is not
    sample 1), out-of-range values of any size with an ``IndexError``; negative ones count from the end.

    Example:
        >>> check_indices([0, -1, np.int32(2)], 10)
        array([0, 9, 2])
        >>> check_indices(["3"], 10)
        Traceback (most recent call last):
        ...
        TypeError: indices must be integers (or integer-likes: operator.index), got '3' (str)
    """
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of integers, got {_got(values)}")
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is not None and arr.dtype.kind in "iu" and arr.ndim >= 1:
        idx = arr.reshape(-1)
        if not idx.size:
            return idx.astype(np.int64)
        lo, hi = int(idx.min()), int(idx.max())  # one pass each: this runs for every batch
        if lo < -length or hi >= length:
            raise IndexError(f"index {lo if lo < -length else hi} is out of range for {length} samples")
        idx = idx.astype(np.int64, copy=False)
        return np.where(idx < 0, idx + length, idx) if lo < 0 else idx
    if arr is not None and arr.ndim == 0:
        raise TypeError(f"{name} must be a sequence of integers, got {_got(values)}")
    out = []
    for v in values:
        try:
            out.append(check_index(v, length, "index"))
        except TypeError:
            raise TypeError(f"{name} must be integers (or integer-likes: operator.index), got {_got(v)}") from None
    return np.array(out, dtype=np.int64)


def check_path(value, name: str) -> str:
    """A path argument as ``str``: a ``str`` or an ``os.PathLike`` giving one (``bytes`` paths are refused).

    Example:
        >>> import pathlib
        >>> check_path(pathlib.Path("/tmp/cache"), "cache_path")
        '/tmp/cache'
    """
    if isinstance(value, (bytes, bytearray)):
        raise TypeError(f"{name} must be a str path or URL, got bytes {_got(value)}; decode it first (os.fsdecode(path))")
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path or URL (str or pathlib.Path), got {_got(value)}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{name} must be a str path or URL, got a path-like giving {_got(path)}")
    if not path:
        raise ValueError(f"{name} is empty; give a directory path or a URL such as gs://bucket/prefix")
    if "\x00" in path:
        raise ValueError(f"{name} contains a NUL character: {path!r}")
    return path


# "gs:/bucket", "gcs:/x", "s3:bucket/x": a scheme followed by something other than "//". One letter
# before the colon is a Windows drive ("C:\\data"), not a scheme.
_ONE_SLASH = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)/*(.*)$", re.S)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def check_url(value, name: str, known_schemes=None) -> str:
    """A path or URL argument as ``str``, refusing URL typos that would silently become a local path.

    ``known_schemes``: the schemes a URL may have (``None``: fsspec's known protocols).

    Example:
        >>> check_url("gs:/bucket/cache", "path")
        Traceback (most recent call last):
        ...
        ValueError: path 'gs:/bucket/cache' looks like a URL with one slash (or none) where '//' belongs; write 'gs://bucket/cache' (or './gs:/bucket/cache' for a local directory of that name)
    """
    url = check_path(value, name)
    typo = _ONE_SLASH.match(url)
    if typo:
        scheme, rest = typo.groups()
        raise ValueError(
            f"{name} {url!r} looks like a URL with one slash (or none) where '//' belongs; write '{scheme}://{rest}' (or './{url}' for a local "
            "directory of that name)"
        )
    m = _SCHEME.match(url)
    if m:
        scheme = m.group(1).lower()
        if known_schemes is None:
            from fsspec.registry import known_implementations, registry

            known_schemes = set(known_implementations) | set(registry)
        if scheme not in known_schemes:
            raise ValueError(
                f"{name} {url!r} has the unknown scheme '{scheme}://'. Use a local path, or a URL fsspec knows "
                "(gs://, s3://, memory://, file://, redis:// …); a misspelt scheme such as 'gcs:/' or 'gs:' needs "
                "the form gs://bucket/prefix."
            )
    return url


# ---------------------------------------------------------------------------------------------
# file names

#: Every file name a cache directory, its tar or its bucket prefix may hold. ``col-<k>.bin`` takes a
#: decimal ``k`` without leading zeros, below :data:`MAX_COLUMNS`.
CACHE_FILE = re.compile(r"(?:nbkit\.json|index\.bin|heap\.bin|manifest\.json|col-(?:0|[1-9][0-9]{0,3})\.bin)\Z")


def is_cache_file(name) -> bool:
    """Whether ``name`` is one of the names a cache's files may have (:data:`CACHE_FILE`)."""
    if not isinstance(name, str) or not CACHE_FILE.match(name):
        return False
    return not name.startswith("col-") or int(name[4:-4]) < MAX_COLUMNS


def check_cache_file(name, where: str, *, error=CorruptCacheError) -> str:
    """``name`` if it is a cache file name; else ``error`` naming it and ``where`` it came from."""
    if not is_cache_file(name):
        raise error(
            f"{where} names the file {name!r}, which is not one of an nbkit cache's files (nbkit.json, index.bin, "
            "heap.bin, manifest.json, col-<k>.bin). Refusing it: nbkit never opens, writes or copies a file by a name "
            "that data carries. Get the cache again from its owner, or re-create it."
        )
    return name


def cache_file_path(root: str, name, where: str, *, error=CorruptCacheError) -> str:
    """``root/name`` for a cache file ``name``, refusing a name outside the pattern or a path that
    leads out of ``root`` (a symbolic link)."""
    check_cache_file(name, where, error=error)
    path = os.path.join(root, name)
    if os.path.islink(path):
        raise UnsafeArchiveError(
            f"{path} is a symbolic link; an nbkit cache holds regular files only. Refusing to follow it out of the "
            "cache directory: replace it with the file, or re-create the cache."
        )
    return path


# ---------------------------------------------------------------------------------------------
# JSON against a declarative spec


class _Spec:
    what = "a value"

    def check(self, value, path: str, fail):
        return value


class AnyJSON(_Spec):
    """Any JSON value (nested no deeper than JSON allows)."""


class Int(_Spec):
    def __init__(self, min: int | None = None, max: int | None = None):
        self.min, self.max = min, max
        lo = "" if min is None else f" >= {min}"
        hi = "" if max is None else f" <= {max}"
        self.what = f"an integer{lo}{' and' if lo and hi else ''}{hi}"

    def check(self, value, path, fail):
        if isinstance(value, bool) or not isinstance(value, int):
            fail(path, self.what, value)
        if (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            fail(path, self.what, value)
        return value


class Float(_Spec):
    what = "a finite number"

    def check(self, value, path, fail):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            fail(path, self.what, value)
        return value


class Bool(_Spec):
    what = "true or false"

    def check(self, value, path, fail):
        if not isinstance(value, bool):
            fail(path, self.what, value)
        return value


class Str(_Spec):
    def __init__(self, pattern: str | None = None, max_len: int = 4096, choices=None):
        self.pattern = None if pattern is None else re.compile(pattern + r"\Z")
        self.max_len, self.choices = max_len, choices
        self.what = (f"one of {sorted(choices)}" if choices else
                     "a string" + (f" matching {pattern!r}" if pattern else ""))

    def check(self, value, path, fail):
        if not isinstance(value, str) or len(value) > self.max_len:
            fail(path, self.what, value)
        if self.pattern is not None and not self.pattern.match(value):
            fail(path, self.what, value)
        if self.choices is not None and value not in self.choices:
            fail(path, self.what, value)
        return value


class Optional(_Spec):
    def __init__(self, inner: _Spec):
        self.inner = inner
        self.what = f"null or {inner.what}"

    def check(self, value, path, fail):
        return None if value is None else self.inner.check(value, path, fail)


class List(_Spec):
    def __init__(self, item: _Spec, max_len: int = 1 << 20):
        self.item, self.max_len = item, max_len
        self.what = f"a list (of at most {max_len} items)"

    def check(self, value, path, fail):
        if not isinstance(value, list) or len(value) > self.max_len:
            fail(path, self.what, value)
        return [self.item.check(v, f"{path}[{i}]", fail) for i, v in enumerate(value)]


class Map(_Spec):
    """An object with arbitrary keys (checked by ``key``) and values of one spec."""

    def __init__(self, value: _Spec, key: _Spec | None = None, max_len: int = 1 << 16):
        self.value, self.key, self.max_len = value, key or Str(), max_len
        self.what = "an object"

    def check(self, value, path, fail):
        if not isinstance(value, dict) or len(value) > self.max_len:
            fail(path, self.what, value)
        return {self.key.check(k, f"{path} key", fail): self.value.check(v, f"{path}[{k!r}]", fail)
                for k, v in value.items()}


class Obj(_Spec):
    """An object with named fields; ``required`` names those that must be present (default: all).
    Fields not in the spec are kept as they are (a newer nbkit may add some)."""

    def __init__(self, fields: dict, required=None):
        self.fields = fields
        self.required = set(fields) if required is None else set(required)
        self.what = "an object"

    def check(self, value, path, fail):
        if not isinstance(value, dict):
            fail(path, self.what, value)
        out = dict(value)
        for key, spec in self.fields.items():
            sub = f"{path}.{key}" if path else key
            if key not in value:
                if key in self.required:
                    fail(sub, f"present ({spec.what})", _MISSING)
                continue
            out[key] = spec.check(value[key], sub, fail)
        return out


class _Missing:
    def __repr__(self):
        return "nothing (the field is missing)"


_MISSING = _Missing()


def check_json(value, spec: _Spec, where: str, fix: str):
    """``value`` checked against ``spec``; the first mismatch raises :class:`CorruptCacheError`
    naming ``where``, the field, what it holds, what was expected, and ``fix``."""

    def fail(path, what, got):
        field = f"the field {path!r}" if path else "its content"
        raise CorruptCacheError(f"{where} is damaged: {field} must be {what}, but holds {shown(got)}. {fix}")

    return spec.check(value, "", fail)


# ---------------------------------------------------------------------------------------------
# opening a cache file

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (fifo)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a symbolic link"))


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o644, *, dir_fd: int | None = None) -> int:
    """``os.open(path, flags)`` for a cache file, refusing anything but a regular file, and, when
    ``flags`` write, a file with other names (a hard link to a file elsewhere is never written through).

    A copied cache directory may hold a named pipe, a device or a directory under a cache file's
    name: opening a fifo for reading would block forever, and a device could be read without end.
    The file is opened without following a final symbolic link and without blocking, checked with
    ``fstat``, then switched back to blocking mode. Anything else raises :class:`CorruptCacheError`
    (``UnsafeArchiveError`` for a link) naming the path and the fix.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); os.mkfifo(d + "/index.bin")
        >>> open_regular(d + "/index.bin")
        Traceback (most recent call last):
        ...
        nbkit.errors.CorruptCacheError: .../index.bin is a named pipe (fifo), not a regular file: an nbkit cache holds regular files only. Remove it and get it again (nbkit.pull / nbkit.import_tar), or re-create it.
    """
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeArchiveError(
                f"{path} is a symbolic link; an nbkit cache holds regular files only. Refusing to follow it out of the "
                "cache directory: replace it with the file, or re-create the cache."
            ) from e
        if e.errno in (errno.EISDIR, errno.ENXIO):  # a directory opened for writing; a fifo with no reader
            raise CorruptCacheError(_not_regular(path, "a directory" if e.errno == errno.EISDIR else "a named pipe (fifo)")) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
            raise CorruptCacheError(_not_regular(path, kind))
        if flags & (os.O_WRONLY | os.O_RDWR) and st.st_nlink > 1:
            raise UnsafeArchiveError(
                f"{path} has {st.st_nlink} names (a hard link): writing into it would change a file outside the cache. "
                "nbkit refuses to: remove the cache (nbkit rm) and create it again.")
        if _NONBLOCK and hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_regular(path: str, kind: str) -> str:
    return (f"{path} is {kind}, not a regular file: an nbkit cache holds regular files only. Remove it and "
            f"{fix('get a cache again')}.")


def read_small(path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The content of the regular file ``path`` (metadata, a manifest), refusing one over ``limit`` bytes.

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp() + "/nbkit.json"
        >>> _ = open(path, "wb").write(b"{}")
        >>> read_small(path), open_readable(path).read()
        (b'{}', b'{}')
    """
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptCacheError(f"{path} is larger than {limit:,} bytes, far more than any nbkit metadata; it is "
                                "damaged or not nbkit's. Re-create the cache, or get it again.")
    return data


def open_readable(path: str):
    """A binary file object reading the regular file ``path`` (see :func:`open_regular`)."""
    return os.fdopen(open_regular(path), "rb")


def shown(value, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for an error message about untrusted data.

    Example:
        >>> shown("x" * 100, 10)
        "'xxxxxx..."
    """
    if isinstance(value, int) and value.bit_length() > 256:  # repr() of a huge int is slow, or refused
        return f"an int of {value.bit_length()} bits"
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        text = _SHORT_REPR.repr(value)  # a few levels and items: a state nested 200,000 deep is no RecursionError
    else:
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _short_repr():
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset, r.maxfrozenset = 3, 4, 4, 4, 4, 4
    r.maxstring, r.maxother, r.maxlong = 40, 40, 40
    return r


_SHORT_REPR = _short_repr()


def load_json(raw: bytes, where: str, fix: str, *, format_name: str, what: str, version: int | None = None) -> dict:
    """The JSON object of one of nbkit's own files (``nbkit.json``, ``manifest.json``, CacheLoader
    metadata) read from ``where``: at most :data:`MAX_JSON_BYTES`, valid JSON, an object whose
    ``format`` is ``format_name``, and, when ``version`` is given, no newer than that. Its fields are
    then checked by the caller's spec (:func:`check_json`). Anything else raises
    :class:`CorruptCacheError` naming ``where`` and ending with ``fix``.

    Example:
        >>> load_json(b'{"format": "x", "version": 1}', "f.json", "", format_name="x", what="x data", version=1)
        {'format': 'x', 'version': 1}
    """
    if len(raw) > MAX_JSON_BYTES:
        raise CorruptCacheError(f"{where} is larger than {MAX_JSON_BYTES} bytes; it is not {what}. {fix}")
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise CorruptCacheError(f"{where} is not valid JSON ({e}); the {what} is damaged. {fix}") from e
    if not isinstance(value, dict) or value.get("format") != format_name:
        found = value.get("format") if isinstance(value, dict) else None
        raise CorruptCacheError(f"{where} is not {what} (format field is {shown(found)}). {fix}")
    got = value.get("version")
    if version is not None and isinstance(got, int) and not isinstance(got, bool) and got > version:
        raise CorruptCacheError(f"{where} has format version {got!r}; this nbkit reads version {version}. Install "
                                "a newer nbkit (the nbkit-cache distribution: README, Install) to open it.")
    return value


# ---------------------------------------------------------------------------------------------
# sizes and replies read from a server (Redis)


def check_bound(value, limit: int, where: str, what: str, why: str, fix: str) -> int:
    """``value`` (a count or size read from ``where``) if it is an ``int`` in ``[0, limit]``; else
    :class:`CorruptCacheError` naming ``where``, ``what`` it claims, the bound and ``why``, and ``fix``.

    Example:
        >>> check_bound(2**40, 2**32, "nbkit:x:meta", "samples", "a Redis bitmap holds 2**32 bits", "Rebuild it.")
        Traceback (most recent call last):
        ...
        nbkit.errors.CorruptCacheError: nbkit:x:meta claims 1,099,511,627,776 samples, more than 4,294,967,296 (a Redis bitmap holds 2**32 bits): it is damaged or not nbkit's. Rebuild it.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise CorruptCacheError(f"{where} claims {shown(value)} {what}, not a count: it is damaged or not nbkit's. {fix}")
    if value > limit:
        raise CorruptCacheError(f"{where} claims {int(value):,} {what}, more than {limit:,} ({why}): it is damaged "
                                f"or not nbkit's. {fix}")
    return int(value)


def check_sample_values(reply, n: int, *, header: int, row_bytes: int, freeform: int, var: int, where: str,
                        fix: str) -> list:
    """Which of ``n`` sample values read from ``where`` (an ``MGET`` reply: each ``bytes`` or ``None``)
    have a size their flags allow, before any checksum is computed: at least the ``header``; for a
    sample that fits the schema (no ``freeform`` bit) its ``row_bytes`` of rows too, and exactly that
    unless ``var`` (a blob follows). ``None`` (not stored) passes. A value of the wrong size is a
    damaged sample (the store marks it, and it is recomputed or reported); a reply that is not ``n``
    values raises :class:`CorruptCacheError` naming ``where`` and ending with ``fix``.

    Example:
        >>> check_sample_values([b"\\x00" * 9, b"\\x00" * 3, None], 3, header=5, row_bytes=4, freeform=2, var=1,
        ...                     where="w", fix="")
        [True, False, True]
    """
    if not isinstance(reply, (list, tuple)) or len(reply) != n:
        got = f"{len(reply)} values" if isinstance(reply, (list, tuple)) else shown(reply)
        raise CorruptCacheError(f"{where} answered a read of {n} values with {got}: the server is not a Redis server "
                                f"nbkit can use, or the connection is broken. {fix}")
    out = []
    for v in reply:
        if v is None:
            out.append(True)
            continue
        if not isinstance(v, (bytes, bytearray, memoryview)):
            raise CorruptCacheError(f"{where} answered a read with {shown(v)} where a value or nothing belongs: the "
                                    f"server is not a Redis server nbkit can use. {fix}")
        size = len(v)
        if size < header:
            out.append(False)
        elif v[0] & freeform:
            out.append(True)
        else:
            out.append(size == header + row_bytes or (bool(v[0] & var) and size > header + row_bytes))
    return out


def check_hello(reply, where: str, fix: str) -> dict:
    """The reply of a server to ``HELLO 3`` (RESP3's handshake) if it is a map whose ``proto`` is 3;
    else :class:`CorruptCacheError` naming ``where``, what it answered, and ``fix``.

    Example:
        >>> check_hello({b"server": b"redis", b"proto": 3}, "127.0.0.1:6379", "")[b"proto"]
        3
    """
    proto = None
    if isinstance(reply, dict):
        proto = reply.get(b"proto", reply.get("proto"))
    if isinstance(proto, bool) or proto != 3:
        raise CorruptCacheError(f"the server at {where} answered HELLO 3 with {shown(reply)}, not a RESP3 handshake "
                                f"(protocol 3). {fix}")
    return reply


_STORED_KEY = re.compile(rb"(?:i-?(?:0|[1-9][0-9]*)|s.*|b.*)\Z", re.S)


def check_stored_key(kb, max_len: int, where: str, fix: str) -> bytes:
    """A key in its stored form (``i<decimal>``, ``s<utf-8>``, ``b<bytes>``) read from ``where``, at
    most ``max_len`` bytes after its tag; else :class:`CorruptCacheError`.

    Example:
        >>> check_stored_key(b"i12", 1 << 16, "h", ""), check_stored_key(b"s\\xc3\\xa9", 1 << 16, "h", "")
        (b'i12', b's\\xc3\\xa9')
    """
    ok = isinstance(kb, bytes) and 1 <= len(kb) <= max_len + 1 and _STORED_KEY.match(kb) is not None
    if ok and kb[:1] == b"s":
        try:
            kb[1:].decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            ok = False
    if not ok:
        raise CorruptCacheError(f"{where} holds the key {shown(kb)}, which is not a key nbkit stores (i<decimal>, "
                                f"s<utf-8> or b<bytes>, at most {max_len} bytes). {fix}")
    return kb


__all__ += ["check_bound", "check_sample_values", "check_hello", "check_stored_key", "check_index", "check_indices"]


#: The longest ``Requires-Dist`` line of an installed package's metadata that nbkit reads.
MAX_REQUIREMENT_CHARS = 200
#: Two-character operators first, so ``<=`` is not read as ``<`` and ``=1``.
_OPERATORS = ("==", "!=", "<=", ">=", "~=", "<", ">")
#: One version, matched alone (one character class, no nesting): linear in its length.
_VERSION = re.compile(r"[0-9][0-9A-Za-z.*+!-]*\Z")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _specifiers(rest: str):
    """The specifiers of ``>=2.11.0, <=2.15.0`` as ``[">=2.11.0", "<=2.15.0"]``, or ``None`` if malformed.

    Split on commas, then each piece read by hand: every character is looked at a bounded number of
    times (a nested regex over this text backtracked exponentially)."""
    pieces = rest.split(",")
    if pieces[-1].strip() == "":
        pieces.pop()  # one trailing comma, as before
    out = []
    for piece in pieces:
        piece = piece.strip()
        op = next((o for o in _OPERATORS if piece.startswith(o)), None)
        if op is None:
            return None
        version = piece[len(op):].strip()
        if not _VERSION.match(version):
            return None
        out.append(op + version)
    return out or None


def requirement_specifier(lines, name: str):
    """The version specifier an installed package's metadata puts on ``name`` (its ``Requires-Dist``
    lines, from ``importlib.metadata.requires``), or ``None`` when it names none or any line about
    ``name`` is malformed: a package's metadata is data from outside, read as such (bounded,
    parsed by pattern, never evaluated), and the caller falls back to the range it documents.

    Example:
        >>> requirement_specifier(["numpy>=2", "torch<=2.15.0,>=2.11.0"], "torch")
        '>=2.11.0,<=2.15.0'
        >>> requirement_specifier(["torch; os.system('x')"], "torch") is None
        True
    """
    found = None
    for line in lines or ():
        if not isinstance(line, str) or len(line) > MAX_REQUIREMENT_CHARS:
            continue
        line = line.lstrip()
        head = _NAME.match(line)
        if not head or re.sub(r"[-_.]+", "-", head.group(0)).lower() != name.lower():
            continue
        rest = line[head.end():].strip()
        if ";" in rest or "[" in rest or "@" in rest:
            return None  # markers, extras or URLs: not the plain range nbkit reads
        rest = rest.strip("()").strip()
        parts = _specifiers(rest) if rest else None
        if parts is None:
            return None
        found = ",".join(sorted(parts, key=lambda p: p[0] != ">"))
    return found


__all__ += ["requirement_specifier", "MAX_REQUIREMENT_CHARS"]
