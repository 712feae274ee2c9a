"""The contract of a sample kind: one class says how one kind of leaf is stored, read and batched.

Every leaf of a sample (a tensor, a numpy array, a PIL image, a Python number, a string …) belongs to
exactly one :class:`Kind`: the first in :data:`nbkit.codec.table.KINDS` whose :meth:`Kind.claims` is
true. The kind's :attr:`~Kind.name` is what a cache's schema and free-form headers store, so a name,
once written, never changes. A kind declares where its leaves may go (:attr:`~Kind.stores`):

* ``col`` — same dtype and shape in every sample: one row of a fixed-size column file;
* ``var`` — a payload of its own in the sample's heap blob;
* ``const`` — nothing stored (``None``).

The rest of the codec (schema inference, splitting, free-form blobs, batches) loops over the table or
looks a kind up by name; it never switches on a kind's name. A new kind is one subclass in its own
module plus one line in the table (``nbkit/codec/bfloat16.py`` is the example).

Example:
    >>> from nbkit.codec.table import kind_of
    >>> kind = kind_of(3, "sample", allow_pickle=False)
    >>> kind.name, kind.stores, kind.to_array(3).dtype.str
    ('int', ('col',), '<i8')
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import CorruptCacheError
from ..trust import Int, List, Obj, Str

#: At most this many dimensions in a stored array (numpy's own limit is 64).
MAX_NDIM = 32
#: The largest row one column may have (a sample's fixed-shape field), in bytes.
MAX_ROW_BYTES = 1 << 40
#: What a damaged free-form header's error ends with.
DAMAGED = "The stored sample is damaged."
DIM = Int(min=0, max=1 << 48)
SIZED = Int(min=0, max=1 << 48)
#: Free-form header of a leaf stored as an array: kind, dtype name, shape, payload bytes.
ARRAY_HEADER = Obj({"k": Str(), "d": Str(max_len=32), "s": List(DIM, max_len=MAX_NDIM), "n": SIZED})
#: Free-form header of a leaf stored as opaque bytes: kind, payload bytes.
BYTES_HEADER = Obj({"k": Str(), "n": SIZED})

NP_KINDS = set("biufcSU")  # never "O" (objects) or "V" (void/structured)
#: The numpy dtype strings a cache may name (as ``dtype.str`` writes them): numbers, bools, and
#: fixed-size byte or unicode strings. Never objects, structured, datetime or sub-array dtypes.
_DTYPE = re.compile(r"[<>|=]?(?:[biufc](?:1|2|4|8|16)|[SU][1-9][0-9]{0,7})\Z")


@dataclass(frozen=True)
class Leaf:
    """How one leaf of a conforming sample is stored (one entry of a schema's ``leaves``)."""

    kind: str  # a Kind's name
    store: str  # col | var | const
    dtype: str = ""  # for array-like leaves (a PIL col leaf: its pixels' numpy dtype)
    shape: tuple = ()  # for col leaves
    column: int = -1  # column index for col leaves
    mode: str = ""  # a PIL col leaf's image mode

    def to_json(self):
        out = {"kind": self.kind, "store": self.store, "dtype": self.dtype, "shape": list(self.shape), "column": self.column}
        if self.mode:
            out["mode"] = self.mode
        return out

    @classmethod
    def from_json(cls, obj):
        """The leaf stored as ``obj`` (already checked by :meth:`nbkit.codec.Schema.from_json`)."""
        return cls(obj["kind"], obj["store"], obj.get("dtype", ""), tuple(obj.get("shape", ())), obj.get("column", -1),
                   obj.get("mode", ""))


def dtype_name(dtype: str) -> str | None:
    """A leaf's dtype as people write it: torch names stay, numpy codes (``<i8``) become ``int64``.

    Example:
        >>> dtype_name("<i8"), dtype_name("float32"), dtype_name("")
        ('int64', 'float32', None)
    """
    if dtype[:1] in ("<", ">", "|", "="):
        return np.dtype(dtype).name
    return dtype or None


def describe_array(leaf: Leaf, label: str) -> str:
    """``label[1, 28, 28] float32``: an array-like leaf as ``nbkit info`` shows it (``…`` for a var
    leaf's shape, which varies)."""
    shape = ", ".join(map(str, leaf.shape)) if leaf.store == "col" else "…"
    dtype = dtype_name(leaf.dtype)
    return f"{label}[{shape}]" + (f" {dtype}" if dtype else "")


def nbytes(shape, itemsize: int) -> int:
    """Bytes of an array of ``shape`` (Python integers: a shape read from a cache cannot overflow)."""
    n = itemsize
    for d in shape:
        n *= int(d)
    return n


def native(arr: np.ndarray) -> np.ndarray:
    """``arr`` in this machine's byte order (torch takes no other)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def value_array(values) -> np.ndarray:
    """A batch of values no tensor holds as one 1-D numpy array: numpy strings (``str_``) for
    strings, else an object array (bytes, ``None``, pickled objects: numpy's ``S`` dtype would drop
    trailing zero bytes).

    Example:
        >>> value_array(("a", "bc")), value_array([b"\\x00", None])
        (array(['a', 'bc'], dtype='<U2'), array([b'\\x00', None], dtype=object))
    """
    values = list(values)
    if values and all(isinstance(v, str) for v in values):
        return np.array(values, dtype=str)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def numpy_dtype(dtype_name: str) -> np.dtype:
    """The numpy dtype a cache names ``dtype_name``, from the allow-list (numbers, bools, fixed-size
    strings); anything else raises :class:`CorruptCacheError`."""
    if not isinstance(dtype_name, str) or not _DTYPE.match(dtype_name):
        raise CorruptCacheError(f"refusing array dtype {dtype_name!r} in cache metadata (only numbers, bools and "
                                "fixed-size strings are stored; objects are never loaded)")
    try:
        dt = np.dtype(dtype_name)
    except TypeError as e:
        raise CorruptCacheError(f"unsupported array dtype {dtype_name!r} in cache metadata") from e
    if dt.kind not in NP_KINDS or dt.itemsize == 0:
        raise CorruptCacheError(f"refusing array dtype {dtype_name!r} in cache metadata (objects are never loaded)")
    return dt


def pack_array(arr: np.ndarray, shape) -> bytes:
    """A var payload of an array: its number of dimensions, its shape, its bytes."""
    return struct.pack(f"<I{len(shape)}q", len(shape), *shape) + arr.tobytes()


def unpack_array(data, dt: np.dtype, where: str) -> np.ndarray:
    """Inverse of :func:`pack_array` (a copy: the result outlives ``data``)."""
    try:
        (ndim,) = struct.unpack_from("<I", data, 0)
        if ndim > MAX_NDIM:
            raise CorruptCacheError(f"{where}: a stored array claims {ndim} dimensions; the blob is damaged")
        shape = struct.unpack_from(f"<{ndim}q", data, 4)
    except struct.error as e:
        raise CorruptCacheError(f"{where}: stored array header is truncated") from e
    raw = data[4 + 8 * ndim :]
    if min(shape, default=0) < 0 or nbytes(shape, dt.itemsize) != len(raw):
        raise CorruptCacheError(f"{where}: stored array size does not match its shape")
    return np.frombuffer(raw, dtype=dt).reshape(shape).copy()


class Kind:
    """One kind of leaf: the base class declares every hook, with the defaults of an array-like kind
    (a leaf stored as the bytes of a numpy array, dtype and shape in the schema).

    Attributes:
        name: the kind's name in caches (schema leaves, free-form headers). Never changes once written.
        stores: where its leaves may go: ``"col"``, ``"var"``, or only ``"const"``.
        var_dtype: whether a var leaf names its dtype in the schema (arrays whose shape varies).
        header_spec: the free-form header of one leaf (checked before it is read).
        inline: the free-form header holds the value itself (no payload).
        legacy_pickled: ``encode_freeform(..., legacy=True, allow_pickle=True)`` pickles it, as nbkit
            did before this kind existed (source fingerprints of older caches still match).
        exact_types: types whose every instance (of exactly that type) this kind takes, with no
            :meth:`check`: the table looks them up in one step (no kind before it may claim them).
    """

    name = ""
    exact_types: tuple = ()
    stores: tuple = ("col", "var")
    var_dtype = True
    header_spec = ARRAY_HEADER
    inline = False
    legacy_pickled = False

    # -- which values ------------------------------------------------------------------------

    def claims(self, value) -> bool:
        """Whether this kind takes ``value`` (the first kind of the table that does, does)."""
        raise NotImplementedError

    def describe(self, leaf: Leaf) -> str:
        """One stored leaf of this kind as ``nbkit info`` shows it (``Tensor[1, 28, 28] float32``)."""
        return self.name

    def check(self, value, where: str, allow_pickle: bool) -> str:
        """The name of the kind that stores a claimed ``value``: this one, or ``"pickle"`` for a value
        only pickle can store (when allowed); raises ``TypeError`` naming the fix otherwise."""
        return self.name

    # -- array-like leaves: dtype, shape and bytes -------------------------------------------

    def dtype_shape(self, value) -> tuple:
        """``(dtype_name, shape)`` describing ``value``, as stored in the schema."""
        arr = self.to_array(value)
        return arr.dtype.str, arr.shape

    def storage_dtype(self, dtype_name: str) -> np.dtype:
        """The numpy dtype of the stored bytes of a leaf whose schema dtype is ``dtype_name``."""
        return numpy_dtype(dtype_name)

    def to_array(self, value) -> np.ndarray:
        """The numpy array whose bytes store ``value``."""
        raise NotImplementedError

    def from_array(self, dtype_name: str, arr: np.ndarray):
        """The leaf that the stored bytes ``arr`` (an array of the storage dtype) hold."""
        return arr.item()

    # -- schema ------------------------------------------------------------------------------

    def infer(self, values: list, column: int) -> Leaf | None:
        """The leaf that stores ``values`` (this leaf in every probe sample) as column ``column`` if
        it is one; ``None``: store every sample free-form."""
        descs = {self.dtype_shape(v) for v in values}
        dtypes = {d for d, _ in descs}
        if len(dtypes) != 1:
            return None
        if len(descs) == 1:
            dtype_name, shape = descs.pop()
            return Leaf(self.name, "col", dtype_name, tuple(shape), column)
        return Leaf(self.name, "var", dtypes.pop()) if "var" in self.stores else None

    def column_problem(self, leaf: Leaf) -> tuple | None:
        """What is wrong with a col ``leaf`` read from a cache, as ``(field suffix, what)``, or ``None``."""
        return None

    def matcher(self, leaf: Leaf):
        """For a col ``leaf``: a function ``value -> array or scalar`` if ``value`` fits the column
        exactly, else ``None``."""
        dtype, shape = self.storage_dtype(leaf.dtype), leaf.shape

        def match(v):
            if not self.claims(v) or self.dtype_shape(v) != (leaf.dtype, shape):
                return None
            return self.to_array(v).astype(dtype, copy=False)
        return match

    def stack(self, values: list, dtype: np.dtype) -> np.ndarray:
        """Rows of a column of ``dtype`` from the matched values of several samples."""
        return np.stack(values)

    def column_values(self, leaf: Leaf, col: np.ndarray) -> list:
        """Per-sample leaves from a gathered column of shape ``(n, *shape)``."""
        return list(col)

    def numpy_values(self, leaf: Leaf, col: np.ndarray) -> list:
        """Per-sample leaves from a gathered column, as numpy users (JAX, Grain) take them: what
        :meth:`column_values` gives, in this machine's byte order. A kind whose leaves are not numpy
        (tensors, PIL images) gives numpy arrays on the column's memory instead (docs/jax.md, "What comes out")."""
        return self.column_values(leaf, native(col))

    # -- var payloads ------------------------------------------------------------------------

    def encode_var(self, leaf: Leaf, value) -> bytes | None:
        """The heap payload of a var ``leaf``'s ``value``, or ``None`` if it does not fit the leaf."""
        dtype_name, shape = self.dtype_shape(value)
        if dtype_name != leaf.dtype:
            return None
        return pack_array(self.to_array(value), shape)

    def decode_var(self, leaf: Leaf, data, where: str, allow_pickle: bool):
        """Inverse of :meth:`encode_var`; anything malformed raises :class:`CorruptCacheError`."""
        return self.from_array(leaf.dtype, unpack_array(data, self.storage_dtype(leaf.dtype), where))

    # -- free-form blobs ---------------------------------------------------------------------

    def to_freeform(self, value) -> tuple:
        """``(header, payload)`` of ``value`` in a free-form blob (the header is JSON)."""
        arr = self.to_array(value)
        dtype_name, shape = self.dtype_shape(value)
        data = arr.tobytes()
        return {"k": self.name, "d": dtype_name, "s": list(shape), "n": len(data)}, data

    def from_freeform(self, header: dict, data, where: str, allow_pickle: bool):
        """Inverse of :meth:`to_freeform` (``header`` already checked against :attr:`header_spec`;
        ``data`` is ``None`` for an :attr:`inline` kind)."""
        dt = self.storage_dtype(header["d"])
        shape = tuple(header["s"])
        if nbytes(shape, dt.itemsize) != len(data) or not self.shape_ok(shape):
            raise CorruptCacheError(f"{where}: stored array size does not match its shape")
        return self.from_array(header["d"], np.frombuffer(data, dtype=dt).reshape(shape).copy())

    def shape_ok(self, shape: tuple) -> bool:
        """Whether a stored leaf of this kind may have ``shape``."""
        return True

    # -- batches (nbkit.collate) -------------------------------------------------------------

    def column_tensor(self, leaf: Leaf, col: np.ndarray):
        """A gathered column as the tensor ``default_collate`` would stack for it."""
        import torch

        return torch.from_numpy(native(col))

    def collate_column(self, leaf: Leaf, col):
        """The batch of a gathered column (a numpy array, or a tensor already made, e.g. pinned)."""
        import torch

        if not isinstance(col, torch.Tensor):
            if col.dtype.kind in "SU":  # fixed-width numpy strings: no tensor holds them
                if col.ndim > 1:  # a string array per sample: default_collate refuses those, the column is the batch
                    return native(col)
                from torch.utils.data import default_collate

                return default_collate(list(col))  # one string per sample: a list of them, as torch batches strings
            col = self.column_tensor(leaf, col)
        return col

    def collate_values(self, values: list):
        """The batch of a var leaf's values, one per sample."""
        from torch.utils.data import default_collate

        return default_collate(values)

    def numpy_batch(self, leaf: Leaf, batch):
        """A collated batch of ``leaf`` (what :meth:`collate_column` or :meth:`collate_values` gave) as
        numpy readers (``nbkit.jax.JaxLoader``) take it: the rows stacked as this kind's samples come
        out of :meth:`numpy_values`, so that a batch of ``n`` is ``np.stack`` of ``n`` numpy samples.
        The default keeps ``batch`` (a tensor becomes its numpy array afterwards); a batch of values
        torch leaves as a list (strings, bytes, objects) becomes a 1-D array (:func:`value_array`)."""
        return value_array(batch) if isinstance(batch, (list, tuple)) else batch

    def collate_types(self) -> dict:
        """``{type: collate_fn}`` for ``default_collate``'s map, for values of this kind that torch
        cannot batch (checked per batch: a kind whose package is not imported returns ``{}``)."""
        return {}

    def __repr__(self) -> str:
        return f"<nbkit kind {self.name!r}>"


def refuse(value, where: str):
    """Raise the ``TypeError`` for a leaf that only pickle could store, pickle not being allowed."""
    hint = ""
    if type(value).__module__.startswith("PIL"):
        hint = " For PIL images add transforms.PILToTensor() or ToTensor() to the source dataset."
    raise TypeError(
        f"{where} has type {type(value).__module__}.{type(value).__qualname__}, which nbkit can only store "
        f"with pickle.{hint} Convert it to a tensor, numpy array, number, str or bytes in your dataset, or "
        "pass allow_pickle=True (anyone opening the cache must then pass allow_pickle=True too, because "
        "unpickling can run code)."
    )
