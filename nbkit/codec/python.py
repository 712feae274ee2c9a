"""Python values: numbers and bools (columns), strings and bytes (heap payloads), ``None`` (nothing
stored), and pickled objects (only when the writer and the reader both pass ``allow_pickle=True``).

A free-form blob keeps a number, bool or ``None`` in its JSON header (Python's JSON keeps NaN and
±inf); strings, bytes and pickles are payloads after it.

Example:
    >>> FloatKind().to_freeform(0.5), StrKind().encode_var(Leaf("str", "var"), "é")
    (({'k': 'float', 'v': 0.5}, b''), b'\\xc3\\xa9')
"""

from __future__ import annotations

import pickle

import numpy as np

from ..errors import CorruptCacheError
from ..trust import AnyJSON, Bool, Int, List, Obj, Str
from .kind import BYTES_HEADER, DAMAGED, Kind, Leaf, refuse


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class ScalarKind(Kind):
    """A Python number or bool: a column of one fixed dtype; in a free-form header, the value itself."""

    stores = ("col",)
    inline = True
    pytype: type = object
    dtype = ""

    def claims(self, value) -> bool:
        return isinstance(value, self.pytype)

    def dtype_shape(self, value) -> tuple:
        return self.dtype, ()

    def to_array(self, value) -> np.ndarray:
        return np.asarray(value, dtype=self.dtype)

    def column_problem(self, leaf: Leaf) -> tuple | None:
        if leaf.dtype != self.dtype or leaf.shape:
            return "", f"is a Python {self.name} stored as {leaf.dtype!r} {list(leaf.shape)}, not {self.dtype!r} []"
        return None

    def matcher(self, leaf: Leaf):
        pytype = self.pytype

        def scalar(v):
            return v if type(v) is pytype else None
        return scalar

    def stack(self, values: list, dtype: np.dtype) -> np.ndarray:
        return np.array(values, dtype=dtype)

    def column_values(self, leaf: Leaf, col: np.ndarray) -> list:
        return col.tolist()

    def to_freeform(self, value) -> tuple:
        return {"k": self.name, "v": value}, b""

    def from_freeform(self, header: dict, data, where: str, allow_pickle: bool):
        v = header["v"]
        if not self.valid(v):
            raise CorruptCacheError(f"{where}: stored {self.name} value {v!r} is malformed. {DAMAGED}")
        return self.from_json(v)

    def valid(self, v) -> bool:
        return True

    def from_json(self, v):
        return v


class BoolKind(ScalarKind):
    name, pytype, dtype = "bool", bool, "|b1"
    exact_types = (bool,)
    header_spec = Obj({"k": Str(), "v": Bool()})


class IntKind(ScalarKind):
    """A Python int in int64's range (a larger one is pickled where allowed)."""

    name, pytype, dtype = "int", int, "<i8"
    header_spec = Obj({"k": Str(), "v": Int(min=-(2**63), max=2**63 - 1)})

    def check(self, value, where: str, allow_pickle: bool) -> str:
        if -(2**63) <= value < 2**63:
            return self.name
        return "pickle" if allow_pickle else refuse(value, where)

    def matcher(self, leaf: Leaf):
        def integer(v):
            if type(v) is not int:
                return int(v) if isinstance(v, int) and not isinstance(v, bool) else None
            return v if -(2**63) <= v < 2**63 else None
        return integer


class FloatKind(ScalarKind):
    name, pytype, dtype = "float", float, "<f8"
    exact_types = (float,)
    header_spec = Obj({"k": Str(), "v": AnyJSON()})  # NaN and ±inf are kept: checked by valid()

    def valid(self, v) -> bool:
        return is_number(v)

    def from_json(self, v):
        return float(v)


class ComplexKind(ScalarKind):
    name, pytype, dtype = "complex", complex, "<c16"
    exact_types = (complex,)
    header_spec = Obj({"k": Str(), "v": List(AnyJSON(), max_len=2)})

    def to_freeform(self, value) -> tuple:
        return {"k": self.name, "v": [value.real, value.imag]}, b""

    def valid(self, v) -> bool:
        return len(v) == 2 and all(map(is_number, v))

    def from_json(self, v):
        return complex(*v)


class NoneKind(Kind):
    """``None``: stored as nothing (a ``const`` leaf)."""

    name = "none"
    exact_types = (type(None),)

    def describe(self, leaf: Leaf) -> str:
        return "None"
    stores = ("const",)
    var_dtype = False
    inline = True
    header_spec = Obj({"k": Str(), "v": AnyJSON()})

    def claims(self, value) -> bool:
        return value is None

    def infer(self, values: list, column: int) -> Leaf | None:
        return Leaf(self.name, "const")

    def to_freeform(self, value) -> tuple:
        return {"k": self.name, "v": value}, b""

    def from_freeform(self, header: dict, data, where: str, allow_pickle: bool):
        if header["v"] is not None:
            raise CorruptCacheError(f"{where}: stored none value {header['v']!r} is malformed. {DAMAGED}")
        return None


class PayloadKind(Kind):
    """A leaf stored as opaque bytes: always a heap payload, never a column."""

    stores = ("var",)
    var_dtype = False
    header_spec = BYTES_HEADER

    def infer(self, values: list, column: int) -> Leaf | None:
        return Leaf(self.name, "var")

    def encode(self, value) -> bytes:
        raise NotImplementedError

    def decode(self, data, where: str, allow_pickle: bool):
        raise NotImplementedError

    def encode_var(self, leaf: Leaf, value) -> bytes | None:
        return self.encode(value)

    def decode_var(self, leaf: Leaf, data, where: str, allow_pickle: bool):
        return self.decode(data, where, allow_pickle)

    def to_freeform(self, value) -> tuple:
        data = self.encode(value)
        return {"k": self.name, "n": len(data)}, data

    def from_freeform(self, header: dict, data, where: str, allow_pickle: bool):
        return self.decode(data, where, allow_pickle)


def utf8(data, where: str) -> str:
    try:
        return bytes(data).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise CorruptCacheError(f"{where}: a stored string is not UTF-8 ({e}); the stored sample is damaged") from e


class StrKind(PayloadKind):
    """A string, as UTF-8 (lone surrogates kept); a batch of strings is the list of them."""

    name = "str"
    exact_types = (str,)

    def claims(self, value) -> bool:
        return isinstance(value, str)

    def encode(self, value) -> bytes:
        return value.encode("utf-8", "surrogatepass")

    def decode(self, data, where: str, allow_pickle: bool):
        return utf8(data, where)

    def decode_var(self, leaf: Leaf, data, where: str, allow_pickle: bool):
        try:  # inline: the hot path of var fields
            return bytes(data).decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return utf8(data, where)  # raises, naming the sample

    def collate_values(self, values: list):
        return values


class BytesKind(PayloadKind):
    """``bytes``, ``bytearray`` or ``memoryview`` (read back as ``bytes``)."""

    name = "bytes"
    exact_types = (bytes, bytearray, memoryview)

    def claims(self, value) -> bool:
        return isinstance(value, (bytes, bytearray, memoryview))

    def encode(self, value) -> bytes:
        return bytes(value)

    def decode(self, data, where: str, allow_pickle: bool):
        return bytes(data)

    def collate_values(self, values: list):
        return values


def pickle_refused(where: str) -> Exception:
    return PermissionError(
        f"{where} holds a pickled object; unpickling data from a cache can run arbitrary code. If you trust "
        "where this cache came from, open it with allow_pickle=True."
    )


class PickleKind(PayloadKind):
    """Any other object, pickled: it claims nothing itself; a leaf no other kind stores comes here
    when ``allow_pickle`` (see :func:`nbkit.codec.table.kind_of`)."""

    name = "pickle"

    def describe(self, leaf: Leaf) -> str:
        return "pickled object"

    def claims(self, value) -> bool:
        return False

    def encode(self, value) -> bytes:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)

    def decode(self, data, where: str, allow_pickle: bool):
        if not allow_pickle:
            raise pickle_refused(where)
        return pickle.loads(data)

    def collate_values(self, values: list):
        return list(values)  # default_collate refuses arbitrary objects: the batch keeps them, as it keeps strings
