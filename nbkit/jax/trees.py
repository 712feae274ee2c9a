"""Samples and batches as numpy pytrees: what JAX and Grain take.

:func:`numpy_tree` turns what a cache gives back (rows of a batch, tuples, namedtuples, lists, dicts;
torch tensors, numpy arrays, PIL images, numbers, strings) into plain containers of numpy arrays.
A tensor becomes the numpy array on the same memory (no copy); a dtype numpy lacks comes back as
``ml_dtypes``' dtype of the same name (``bfloat16``, ``float8_e4m3fn`` …), which JAX uses too. A
cache that stores numpy arrays gives them as they are: torch does no work on that path.

Example:
    >>> import torch
    >>> numpy_tree({"x": torch.arange(3), "y": (torch.ones(2, dtype=torch.bfloat16), "cat")})
    {'x': array([0, 1, 2]), 'y': (array([1, 1], dtype=bfloat16), 'cat')}
"""

from __future__ import annotations

import numpy as np

from ..codec.kind import native
from ..codec.structure import is_namedtuple
from ..codec.tensor import BITS, numpy_twin, torch_dtype
from ..collate import plain_sample
from ..extras import is_tensor, require

#: How to install what nbkit.jax needs (nbkit-cache's ``jax`` extra).
INSTALL = "pip install jax grain"

__all__ = ["numpy_tree", "tensor_array", "INSTALL"]


def numpy_tree(value):
    """``value`` with every tensor, array and image as a numpy array, in plain tuples, namedtuples,
    lists and dicts (a batch's row types become the containers they stand for); numbers, strings,
    bytes and ``None`` stay as they are.

    Example:
        >>> import numpy as np
        >>> numpy_tree([np.arange(2, dtype=">i4"), 7])     # big-endian arrays come back native
        [array([0, 1], dtype=int32), 7]
    """
    value = plain_sample(value)
    if isinstance(value, np.ndarray):
        return native(value)
    if is_tensor(value):
        return tensor_array(value)
    if isinstance(value, dict):
        return {k: numpy_tree(v) for k, v in value.items()}
    if isinstance(value, tuple):
        values = [numpy_tree(v) for v in value]
        return type(value)._make(values) if is_namedtuple(value) else tuple(values)
    if isinstance(value, list):
        return [numpy_tree(v) for v in value]
    if type(value).__module__.startswith("PIL."):
        return np.asarray(value)  # (H, W) or (H, W, C), as JAX image code expects
    return value


def tensor_array(t) -> np.ndarray:
    """The numpy array of a torch tensor, on its memory when it is a CPU tensor (no copy).

    Raises:
        TypeError: the tensor's dtype has no numpy counterpart, not even in ``ml_dtypes``.

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> a = tensor_array(t); a[0] = 5; float(t[0])      # the same memory
        5.0
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg()
    if numpy_twin(t.dtype) is not None:
        return t.numpy()
    name = str(t.dtype).removeprefix("torch.")
    ml_dtypes = require("ml_dtypes", extra="jax", feature=f"a torch.{name} tensor as a numpy array",
                        install=INSTALL)  # a dependency of jax: present wherever jax is
    dtype = getattr(ml_dtypes, name, None)
    if dtype is None or np.dtype(dtype).itemsize != t.dtype.itemsize:
        raise TypeError(f"a tensor of dtype torch.{name} has no numpy dtype (not even in ml_dtypes), so JAX cannot take "
                        f"it: convert it in your dataset (e.g. tensor.float()) or in the cache's transform=")
    bits = t.contiguous().view(torch_dtype(BITS[t.dtype.itemsize].name))
    return bits.numpy().view(dtype)
