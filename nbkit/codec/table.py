"""The sample kinds, in one ordered table: the single place that decides how a leaf is stored.

The first kind in :data:`KINDS` whose ``claims(value)`` is true takes a value (so ``bool`` precedes
``int``, and numpy scalars precede the Python numbers they subclass); a value no kind claims is
pickled when ``allow_pickle``, else refused with a ``TypeError`` naming the fix. Stored leaves find
their kind by name (:func:`kind_named`). To add a kind, write its :class:`~nbkit.codec.kind.Kind`
subclass in a module of its own and list it here, before any kind that would claim its values.

Example:
    >>> import numpy as np
    >>> [k.name for k in KINDS][:4], kind_of(np.float32(1), "x", allow_pickle=False).name
    (['tensor', 'bfloat16', 'ndarray', 'npscalar'], 'npscalar')
"""

from __future__ import annotations

from .arrays import NdarrayKind, NpScalarKind
from .bfloat16 import BFloat16Kind
from ..errors import CorruptCacheError
from .kind import Kind, Leaf, refuse
from .pil import PilKind
from .python import BoolKind, BytesKind, ComplexKind, FloatKind, IntKind, NoneKind, PickleKind, StrKind
from .tensor import TensorKind

PICKLE = PickleKind()
#: Every kind, in the order they claim values. Their names are what caches store.
KINDS: tuple = (TensorKind(), BFloat16Kind(), NdarrayKind(), NpScalarKind(), BoolKind(), IntKind(), FloatKind(),
                ComplexKind(), StrKind(), BytesKind(), NoneKind(), PilKind(), PICKLE)
BY_NAME: dict = {k.name: k for k in KINDS}


def kind_of(value, where: str, allow_pickle: bool) -> Kind:
    """The kind that stores ``value`` (``where`` names it in errors)."""
    exact = _exact[1] if _exact[0] is KINDS else _exact_types()
    kind = exact.get(type(value))
    if kind is not None:
        return kind
    for kind in KINDS:
        if kind.claims(value):
            return BY_NAME[kind.check(value, where, allow_pickle)]
    if allow_pickle:
        return PICKLE
    return refuse(value, where)


_exact: tuple = (None, {})  # (the table it was built from, {type: kind}) of the kinds' exact_types


def _exact_types() -> dict:
    global _exact
    exact: dict = {}
    for kind in KINDS:
        for t in kind.exact_types:
            exact.setdefault(t, kind)
    _exact = (KINDS, exact)
    return exact


def kind_named(name: str, where: str = "cache metadata") -> Kind:
    """The kind a cache names ``name``; :class:`~nbkit.errors.CorruptCacheError` for an unknown one."""
    kind = BY_NAME.get(name)
    if kind is None:
        raise CorruptCacheError(f"{where}: unknown leaf kind {name!r} (written by a newer nbkit?)")
    return kind


def collate_types() -> dict:
    """``{type: collate_fn}`` that the kinds add to ``default_collate``'s map for values torch cannot batch."""
    out: dict = {}
    for kind in KINDS:
        out.update(kind.collate_types())
    return out


# -- the codec's per-kind functions, by kind name (kept for callers that hold a leaf's kind name) ------

def leaf_kind(value, where: str, allow_pickle: bool) -> str:
    """The name of the kind that stores ``value``."""
    return kind_of(value, where, allow_pickle).name


def storage_dtype(kind: str, dtype_name: str):
    """The numpy dtype of the stored bytes for a leaf described by ``(kind, dtype_name)``."""
    found = BY_NAME.get(kind)
    return (found or BY_NAME["ndarray"]).storage_dtype(dtype_name)


def array_to_leaf(kind: str, dtype_name: str, arr):
    """Turn stored bytes (as an array of the storage dtype) back into a leaf of ``kind``."""
    return BY_NAME[kind].from_array(dtype_name, arr)


def batch_leaf_values(kind: str, dtype_name: str, col, mode: str = "") -> list:
    """Per-sample leaf values from a gathered column of shape ``(n, *shape)`` (``mode``: of a PIL leaf)."""
    return BY_NAME[kind].column_values(Leaf(kind, "col", dtype_name, col.shape[1:], 0, mode), col)
