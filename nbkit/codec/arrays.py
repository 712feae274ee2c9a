"""numpy arrays and scalars of numbers, bools and fixed-size strings (never objects or structured dtypes).

An array whose dtype and shape agree across samples is a column; one whose shape varies goes in the
heap blob with its dtype in the schema. Any other dtype is refused, or pickled where allowed.

Example:
    >>> import numpy as np
    >>> NdarrayKind().dtype_shape(np.zeros((2, 3), dtype=">i4")), NpScalarKind().to_array(np.float32(1)).shape
    (('>i4', (2, 3)), ())
"""

from __future__ import annotations

import numpy as np

from .kind import NP_KINDS, Kind, Leaf, describe_array, dtype_name, refuse


class NdarrayKind(Kind):
    name = "ndarray"

    def describe(self, leaf: Leaf) -> str:
        return describe_array(leaf, "ndarray")

    def claims(self, value) -> bool:
        return isinstance(value, np.ndarray)

    def check(self, value, where: str, allow_pickle: bool) -> str:
        if value.dtype.kind in NP_KINDS:
            return self.name
        if allow_pickle:
            return "pickle"
        raise TypeError(
            f"{where} is a numpy array of dtype {value.dtype}, which nbkit cannot store without pickle. "
            "Convert it to a numeric array in your dataset, or pass allow_pickle=True (openers must then "
            "pass allow_pickle=True too)."
        )

    def dtype_shape(self, value) -> tuple:
        return value.dtype.str, tuple(value.shape)

    def to_array(self, value) -> np.ndarray:
        return np.ascontiguousarray(value)

    def from_array(self, dtype_name: str, arr: np.ndarray):
        return arr

    def collate_values(self, values: list):
        if values and all(v.dtype.kind in "SU" for v in values) and len({v.shape for v in values}) == 1:
            return np.stack(values)  # string arrays: default_collate refuses them, no tensor holds them
        return super().collate_values(values)

    def matcher(self, leaf: Leaf):
        dtype, shape = np.dtype(leaf.dtype), leaf.shape

        def ndarray(v):
            if not isinstance(v, np.ndarray) or v.dtype != dtype or v.shape != shape:
                return None
            return v
        return ndarray


class NpScalarKind(Kind):
    """A numpy scalar (``np.float32(1.5)``): always a column of shape ``()``."""

    name = "npscalar"
    stores = ("col",)

    def describe(self, leaf: Leaf) -> str:
        return f"numpy {dtype_name(leaf.dtype)}"

    def claims(self, value) -> bool:
        return isinstance(value, np.generic)

    def check(self, value, where: str, allow_pickle: bool) -> str:
        if np.dtype(type(value)).kind in NP_KINDS:
            return self.name
        return "pickle" if allow_pickle else refuse(value, where)

    def dtype_shape(self, value) -> tuple:
        return np.dtype(type(value)).str, ()

    def to_array(self, value) -> np.ndarray:
        return np.asarray(value)

    def from_array(self, dtype_name: str, arr: np.ndarray):
        return arr[()]

    def shape_ok(self, shape: tuple) -> bool:
        return not shape

    def column_problem(self, leaf: Leaf) -> tuple | None:
        if leaf.shape:
            return ".shape", f"is {list(leaf.shape)} for a numpy scalar (expected [])"
        return None

    def matcher(self, leaf: Leaf):
        dtype = np.dtype(leaf.dtype)

        def npscalar(v):
            if not isinstance(v, np.generic) or v.dtype != dtype:
                return None
            return v
        return npscalar
