"""numpy arrays of ``ml_dtypes.bfloat16`` (JAX's and TensorFlow's bfloat16 numpy dtype).

numpy has no bfloat16 of its own: ``ml_dtypes`` adds one, which numpy reports as a void dtype
(``'<V2'``), so the ``ndarray`` kind would refuse it. This kind stores the bits, little-endian int16
(as a bfloat16 tensor is stored), under the schema dtype ``"bfloat16"``, and views them back: the
same dtype and bits come back. ``ml_dtypes`` is imported only to rebuild such arrays (``import
nbkit`` never imports it); reading them without it raises ``ImportError`` naming the package.

Batches: a sample holds a numpy bfloat16 array; :func:`nbkit.collate` (and ``default_collate`` over
a ``CachedDataset``) gives a ``torch.bfloat16`` tensor ``(N, *shape)``, the same bits, since torch
batches tensors and has the dtype.

This module is the example of a kind added in one file: the class below and one line in
``nbkit/codec/table.py``.

Example:
    >>> import ml_dtypes, numpy as np
    >>> kind = BFloat16Kind()
    >>> a = np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16)
    >>> back = kind.from_array("bfloat16", kind.to_array(a))
    >>> back.dtype == a.dtype, back.tolist() == a.tolist()
    (True, True)
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptCacheError
from ..extras import require
from .kind import Kind, Leaf, describe_array, native

DTYPE = "bfloat16"
STORAGE = np.dtype("<i2")


def bfloat16_dtype(where: str = "a cache"):
    """``ml_dtypes.bfloat16``, or ``ImportError`` naming the package to install (:func:`nbkit.extras.require`)."""
    ml_dtypes = require("ml_dtypes", extra="jax", feature=f"reading the numpy bfloat16 arrays {where} holds",
                        install="pip install ml_dtypes")
    return np.dtype(ml_dtypes.bfloat16)


class BFloat16Kind(Kind):
    """A numpy array of dtype ``ml_dtypes.bfloat16`` (column when its shape agrees, else var)."""

    name = "bfloat16"
    legacy_pickled = True  # before this kind, nbkit pickled such arrays where allowed

    def describe(self, leaf: Leaf) -> str:
        return describe_array(leaf, "ndarray")

    def claims(self, value) -> bool:
        # By the dtype's name: ml_dtypes is loaded already if such an array exists.
        return isinstance(value, np.ndarray) and value.dtype.name == DTYPE and value.dtype.kind == "V"

    def dtype_shape(self, value) -> tuple:
        return DTYPE, tuple(value.shape)

    def storage_dtype(self, dtype_name: str) -> np.dtype:
        if dtype_name != DTYPE:
            raise CorruptCacheError(f"refusing bfloat16 array dtype {dtype_name!r} in cache metadata (expected {DTYPE!r})")
        return STORAGE

    def to_array(self, value) -> np.ndarray:
        return np.ascontiguousarray(value).view(np.int16).astype(STORAGE, copy=False)

    def from_array(self, dtype_name: str, arr: np.ndarray):
        return native(arr).view(bfloat16_dtype())

    def matcher(self, leaf: Leaf):
        shape = leaf.shape
        to_array = self.to_array

        def bfloat16(v):
            if not isinstance(v, np.ndarray) or v.dtype.name != DTYPE or v.shape != shape:
                return None
            return to_array(v)
        return bfloat16

    def column_values(self, leaf: Leaf, col: np.ndarray) -> list:
        return list(self.from_array(leaf.dtype, col))

    def column_tensor(self, leaf: Leaf, col: np.ndarray):
        import torch

        return torch.from_numpy(native(col)).view(torch.bfloat16)

    def collate_values(self, values: list):
        import torch
        from torch.utils.data import default_collate

        return default_collate([torch.from_numpy(native(self.to_array(v))).view(torch.bfloat16) for v in values])
