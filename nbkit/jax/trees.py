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
from ..codec.structure import is_namedtuple, unflatten_columns
from ..codec.table import BY_NAME
from ..codec.tensor import BITS, numpy_dtype, numpy_twin, torch_dtype
from ..collate import leaf_batches, plain_sample, rebuild_batch
from ..extras import is_tensor

#: How to install what nbkit.jax needs (nbkit-cache's ``jax`` extra).
INSTALL = "pip install jax grain"

__all__ = ["numpy_tree", "numpy_rows", "numpy_batch", "tensor_array", "INSTALL"]


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


def numpy_batch(schema, batch):
    """A collated batch of a cache's samples (``nbkit.collate``'s structure) as numpy, each field
    stacked as its samples come out of :func:`numpy_rows`: images ``(N, H, W[, C])``, strings a numpy
    ``str_`` array, bytes, ``None`` and pickled objects an object array, the rest numpy arrays.
    Each leaf's kind decides (:meth:`nbkit.codec.kind.Kind.numpy_batch`).

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset([(torch.ones(2), "cat"), (torch.zeros(2), "dog")], tempfile.mkdtemp())
        >>> _ = ds.warmup()
        >>> numpy_batch(ds.schema, nbkit.collate([ds[0], ds[1]]))
        [array([[1., 1.],
               [0., 0.]], dtype=float32), array(['cat', 'dog'], dtype='<U3')]
    """
    fields = leaf_batches(schema.structure, batch)
    if fields is None:  # free-form samples of another structure: no kinds to ask
        return numpy_tree(batch)
    return numpy_tree(rebuild_batch(schema.structure, [BY_NAME[leaf.kind].numpy_batch(leaf, b)
                                                       for leaf, b in zip(schema.leaves, fields)]))


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
    name = str(t.dtype).removeprefix("torch.")
    if numpy_twin(t.dtype) is not None:
        return t.numpy()
    dtype = numpy_dtype(name)  # ml_dtypes' (bfloat16 …), or TypeError
    return t.contiguous().view(torch_dtype(BITS[t.dtype.itemsize].name)).numpy().view(dtype)


def numpy_rows(schema, columns: list, n: int) -> list:
    """The ``n`` samples of gathered ``columns`` (``CachedDataset.read_columns``) as numpy pytrees,
    each leaf a row of its column (no copy, no tensor): the fast path of a cache of fixed-shape fields.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.ones(4, 2)), tempfile.mkdtemp())
        >>> _ = ds.warmup()
        >>> numpy_rows(ds.schema, ds.read_columns(np.array([2, 3])), 2)
        [(array([1., 1.], dtype=float32),), (array([1., 1.], dtype=float32),)]
    """
    leaf_lists = [BY_NAME[leaf.kind].numpy_values(leaf, columns[leaf.column]) if leaf.store == "col" else [None] * n
                  for leaf in schema.leaves]
    return unflatten_columns(schema.structure, iter(leaf_lists), n)
