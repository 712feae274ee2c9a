"""Torch tensors: every dtype torch holds in a dense tensor comes back with that dtype.

Those numpy lacks (bfloat16, float8, complex32, uint1 …) are stored as their bit pattern in an
integer of the same size and viewed back. Quantized tensors are refused (``TypeError``: store
``dequantize()``). The schema names the dtype by its torch name (``"float32"``); the bytes it stands
for are known without importing torch (:data:`TENSOR_STORAGE`), so ``nbkit ls``, ``info`` and
``verify`` never import it.

Example:
    >>> import torch
    >>> kind = TensorKind()
    >>> kind.dtype_shape(torch.zeros(2, 3, dtype=torch.bfloat16)), kind.storage_dtype("bfloat16").str
    (('bfloat16', (2, 3)), '<i2')
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np

from ..errors import CorruptCacheError
from ..extras import is_tensor, require
from .kind import Kind, Leaf, describe_array, native


@lru_cache(maxsize=None)
def torch_dtypes() -> dict:
    """Every dtype this torch can hold in a dense tensor, by name (``"float8_e4m3fn"``).

    Quantized dtypes are left out: their values need a scale and zero point besides the bytes.
    """
    import torch

    out = {}
    for name in dir(torch):
        d = getattr(torch, name)
        if isinstance(d, torch.dtype) and str(d) == f"torch.{name}" and not name.startswith(("qint", "quint")):
            out[name] = d
    return out


# dtypes numpy lacks travel as their bit pattern in an integer of the same size (bfloat16 as int16,
# as the first nbkit stored it; float8 as uint8 …), and are viewed back on read.
BITS = {1: np.dtype("|u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}
#: The stored bytes of each tensor dtype torch names (its numpy twin, else :data:`BITS` of its size),
#: so that metadata is checked without importing torch: ``nbkit ls``, ``info`` and ``verify`` never
#: do. A name missing here (a newer torch's dtype) is looked up in torch itself; tests/test_codec.py
#: checks the table against the installed torch.
TENSOR_STORAGE = {name: np.dtype(code) for name, code in {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4",
    "int64": "<i8", "uint64": "<u8", "float16": "<f2", "float32": "<f4", "float64": "<f8", "complex64": "<c8",
    "complex128": "<c16", "bfloat16": "<i2", "bits16": "<i2", "complex32": "<i4", "bcomplex32": "<i4",
    **dict.fromkeys(("bits1x8", "bits2x4", "bits4x2", "bits8", "float4_e2m1fn_x2", "float8_e4m3fn", "float8_e4m3fnuz",
                     "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", *(f"int{k}" for k in range(1, 8)),
                     *(f"uint{k}" for k in range(1, 8))), "|u1"),
}.items()}


def torch_dtype(name: str):
    """The torch dtype a cache names ``name``; :class:`CorruptCacheError` if this torch lacks it."""
    d = torch_dtypes().get(name)
    if d is None:
        import torch

        raise CorruptCacheError(
            f"unsupported tensor dtype {name!r} in cache metadata: torch {torch.__version__} has no such dtype. "
            "Open the cache with the torch version that wrote it (or a newer one)."
        )
    return d


@lru_cache(maxsize=None)
def numpy_twin(dtype):
    """The numpy dtype of a tensor of ``dtype``, or ``None`` where numpy has none (bfloat16, float8 …)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 warns that it is experimental
        try:
            import torch

            return torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            return None


def torch_storage_dtype(dtype) -> np.dtype:
    """The numpy dtype whose bytes hold a tensor of ``dtype``."""
    twin = numpy_twin(dtype)
    return BITS[dtype.itemsize] if twin is None else np.dtype(twin).newbyteorder("<")


class TensorKind(Kind):
    """A dense torch tensor (column when dtype and shape agree, else var with the dtype in the schema)."""

    name = "tensor"

    def describe(self, leaf: Leaf) -> str:
        return describe_array(leaf, "Tensor")

    def claims(self, value) -> bool:
        return is_tensor(value)

    def check(self, value, where: str, allow_pickle: bool) -> str:
        if value.is_quantized:
            raise TypeError(
                f"{where} is a quantized tensor ({value.dtype}), which nbkit cannot store: its values need a scale "
                "and zero point besides the bytes. Store value.dequantize() (or value.int_repr() and the "
                "quantization parameters) in your dataset."
            )
        return self.name

    def dtype_shape(self, value) -> tuple:
        return str(value.dtype).removeprefix("torch."), tuple(value.shape)

    def storage_dtype(self, dtype_name: str) -> np.dtype:
        known = TENSOR_STORAGE.get(dtype_name)
        return known if known is not None else torch_storage_dtype(torch_dtype(dtype_name))

    def to_array(self, value) -> np.ndarray:
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.layout != torch.strided:
            raise TypeError(f"nbkit stores dense tensors only, got layout {t.layout}; call .to_dense() in your dataset")
        t = t.resolve_conj().resolve_neg().contiguous()
        if numpy_twin(t.dtype) is None:
            t = t.view(torch_dtype(BITS[t.dtype.itemsize].name))
        return t.numpy()

    def from_array(self, dtype_name: str, arr: np.ndarray):
        import torch

        t = torch.from_numpy(arr)
        dtype = torch_dtype(dtype_name)
        return t if t.dtype == dtype else t.view(dtype)

    def matcher(self, leaf: Leaf):
        import torch

        tdtype = torch_dtype(leaf.dtype)
        shape = torch.Size(leaf.shape)
        plain = numpy_twin(tdtype) is not None
        to_array = self.to_array

        def tensor(v):
            if not isinstance(v, torch.Tensor) or v.dtype != tdtype or v.shape != shape:
                return None
            if plain:
                # The common case in one call: numpy() itself refuses what needs to_array (a tensor that
                # requires grad, lies off the CPU, is sparse, or has its conj or neg bit set); a
                # non-contiguous one would give a strided view, which a row write cannot take.
                try:
                    if v.is_contiguous():
                        return v.numpy()
                except (RuntimeError, TypeError, NotImplementedError):
                    pass
            return to_array(v)
        return tensor

    def column_values(self, leaf: Leaf, col: np.ndarray) -> list:
        return list(self.from_array(leaf.dtype, col).unbind())

    def column_tensor(self, leaf: Leaf, col: np.ndarray):
        return self.from_array(leaf.dtype, col)

    def numpy_values(self, leaf: Leaf, col: np.ndarray) -> list:
        # No tensor is made: the rows of the column, viewed as the tensor dtype's numpy twin.
        return list(native(col).view(numpy_dtype(leaf.dtype)))


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of tensors of dtype ``name``: numpy's twin (``float32``), else ``ml_dtypes``' dtype
    of the same name and size (``bfloat16``, ``float8_e4m3fn`` …, the dtypes JAX uses), told without
    importing torch.

    Raises:
        TypeError: neither numpy nor ml_dtypes has it (``float4_e2m1fn_x2``, ``bits16`` …).

    Example:
        >>> numpy_dtype("float32").name, numpy_dtype("bfloat16").name
        ('float32', 'bfloat16')
    """
    storage = TENSOR_STORAGE.get(name)
    if storage is None:
        storage = torch_storage_dtype(torch_dtype(name))
    if storage.name == name:
        return storage
    ml_dtypes = require("ml_dtypes", extra="jax", feature=f"a torch.{name} tensor as a numpy array",
                        install="pip install ml_dtypes")
    dtype = getattr(ml_dtypes, name, None)
    if dtype is None or np.dtype(dtype).itemsize != storage.itemsize:
        raise TypeError(f"tensors of dtype torch.{name} have no numpy dtype (not even in ml_dtypes), so numpy and JAX "
                        "cannot take them: convert them in your dataset (e.g. tensor.float()) or in the cache's transform=")
    return np.dtype(dtype)
