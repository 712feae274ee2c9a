"""How one sample becomes bytes and back, without pickle unless asked.

A sample is any nesting of tuples, namedtuples, lists and dicts (string keys) whose leaves are
tensors, numpy arrays or scalars, PIL images, Python numbers, strings, bytes or ``None``.
:func:`flatten` splits a sample into a *structure* (hashable, JSON-able) and a list of leaves. A
:class:`Schema`, inferred from a few samples, decides per leaf how it is stored (a column row, a
heap payload, or nothing); a sample that does not fit it is stored whole as a self-describing
*free-form* blob. Decoding only ever uses JSON and ``numpy.frombuffer``; pickle is used only for
leaves of other types, and only when the writer and the reader both pass ``allow_pickle=True``.

The package, one concept a module:

* :mod:`~nbkit.codec.kind` — the contract of a sample kind (:class:`~nbkit.codec.kind.Kind`): which
  values it claims, its name in caches, column or var, its bytes, its batches;
* :mod:`~nbkit.codec.table` — the kinds in one ordered table, the single place that dispatches;
* the kinds: :mod:`~nbkit.codec.tensor` (torch tensors of every dtype), :mod:`~nbkit.codec.arrays`
  (numpy arrays and scalars), :mod:`~nbkit.codec.bfloat16` (``ml_dtypes`` bfloat16 arrays),
  :mod:`~nbkit.codec.python` (numbers, str, bytes, None, pickle), :mod:`~nbkit.codec.pil` (PIL images);
* :mod:`~nbkit.codec.structure` — the containers around the leaves (namedtuples found without importing);
* :mod:`~nbkit.codec.schema` — :class:`Schema` and :func:`infer_schema`;
* :mod:`~nbkit.codec.freeform` — self-describing blobs.

Example:
    >>> import torch
    >>> from nbkit.codec import encode_freeform, decode_freeform
    >>> sample = (torch.arange(3), {"label": 7, "name": "seven"})
    >>> decode_freeform(encode_freeform(sample, allow_pickle=False), allow_pickle=False)
    (tensor([0, 1, 2]), {'label': 7, 'name': 'seven'})
"""

from __future__ import annotations

from .freeform import decode_freeform, encode_freeform
from .kind import Kind, Leaf
from .pil import stack_pil
from .schema import Schema, infer_schema
from .structure import flatten, register_namedtuple, structure_from_json, unflatten
from .table import KINDS, array_to_leaf, batch_leaf_values, kind_named, kind_of, leaf_kind, storage_dtype

# The names the rest of nbkit imports from here; each concept's other helpers live in its module.
__all__ = ["Schema", "flatten", "unflatten", "encode_freeform", "decode_freeform", "infer_schema", "register_namedtuple",
           "structure_from_json", "storage_dtype", "array_to_leaf", "batch_leaf_values", "stack_pil", "Kind", "Leaf",
           "KINDS", "kind_of", "kind_named", "leaf_kind"]
