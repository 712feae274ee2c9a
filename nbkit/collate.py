"""Batches without per-sample work.

``CachedDataset.__getitems__`` gathers each fixed-shape field of a whole batch with one
vectorised read and returns a :class:`SampleBatch`: a read-only sequence of samples that
builds per-sample objects only if someone asks for them (the default collate does). Passing
``collate_fn=nbkit.collate`` to the DataLoader skips that step and returns the gathered columns
directly, in the same structure ``torch.utils.data.default_collate`` would produce.

Example:
    >>> import torch, tempfile
    >>> from torch.utils.data import DataLoader, TensorDataset
    >>> import nbkit
    >>> src = TensorDataset(torch.randn(10, 3), torch.arange(10))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp())
    >>> x, y = next(iter(DataLoader(ds, batch_size=4, collate_fn=nbkit.collate)))
    >>> x.shape, y.tolist()
    (torch.Size([4, 3]), [0, 1, 2, 3])
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info

from .codec.structure import is_namedtuple, named_class, unflatten_columns
from .codec.table import BY_NAME, collate_types

__all__ = ["SampleBatch", "DeferredBatch", "BatchHandle", "collate", "collate_columns", "map_tensors", "iter_tensors"]


class SampleBatch(Sequence):
    """The samples of one batch, stored column-wise.

    Indexing or iterating gives each sample as a :class:`TupleRow`, :class:`ListRow` or
    :class:`DictRow`: a plain tuple, list or dict subclass that ``default_collate`` recognises, so
    it collates the batch in one step from its columns.

    Attributes:
        indices: the dataset indices, in batch order.
    """

    def __init__(self, schema, indices: np.ndarray, columns: list, var_values: list | None):
        self._schema = schema
        self.indices = indices
        self._columns = columns  # gathered arrays, one per col leaf, shape (n, *leaf.shape)
        self._var_values = var_values  # per var leaf: list of n values (or None if no var leaves)
        self._samples = None

    def __len__(self) -> int:
        return len(self.indices)

    def _leaf_lists(self) -> list:
        n = len(self.indices)
        out, var_iter = [], iter(self._var_values or ())
        for leaf in self._schema.leaves:
            if leaf.store == "col":
                out.append(BY_NAME[leaf.kind].column_values(leaf, self._columns[leaf.column]))
            elif leaf.store == "var":
                out.append(next(var_iter))
            else:
                out.append([None] * n)
        return out

    def samples(self) -> list:
        """The per-sample objects (built once, on first use)."""
        if self._samples is None:
            self._samples = unflatten_columns(self._schema.structure, iter(self._leaf_lists()), len(self.indices))
        return self._samples

    def __getitem__(self, j):
        if self._samples is None and not isinstance(j, slice):
            # default_collate looks at batch[0] only, to pick how to collate: build that one sample
            # (as a row type registered with default_collate, which then collates the columns).
            j = range(len(self))[j]
            one = SampleBatch(self._schema, self.indices[j:j + 1], [c[j:j + 1] for c in self._columns],
                              None if self._var_values is None else [v[j:j + 1] for v in self._var_values])
            return as_row(one.samples()[0])
        if isinstance(j, slice):
            return [as_row(s) for s in self.samples()[j]]
        return as_row(self.samples()[j])

    def __iter__(self):
        return map(as_row, self.samples())

    def __repr__(self) -> str:
        return f"SampleBatch({len(self)} samples)"

    def collate(self):
        """The collated batch, as ``default_collate`` would build it, without per-sample objects."""
        return collate_columns(self._schema, self._columns, self._var_values, len(self.indices))


def column_tensor(leaf, col):
    """One gathered column as the tensor ``default_collate`` would stack for ``leaf`` (a PIL leaf's
    pixels as gathered, ``(n, H, W[, C])``): its kind decides (:meth:`nbkit.codec.kind.Kind.column_tensor`)."""
    return BY_NAME[leaf.kind].column_tensor(leaf, col)


def collate_columns(schema, columns: list, var_values: list | None, n: int):
    """The collated batch of ``n`` samples from their gathered columns (numpy arrays, or tensors
    already in place, e.g. pinned buffers) and var-leaf values, in ``default_collate``'s structure.

    Each leaf's kind batches it (:meth:`~nbkit.codec.kind.Kind.collate_column`, ``collate_values``):
    PIL images, which ``default_collate`` refuses, are stacked as ``PILToTensor`` would make them:
    ``(n, C, H, W)`` (uint8 for 8-bit modes); images of different sizes raise ``TypeError``; numpy
    bfloat16 arrays become a ``torch.bfloat16`` tensor.
    """
    leaf_batches, var_iter = [], iter(var_values or ())
    for leaf in schema.leaves:
        if leaf.store == "col":
            leaf_batches.append(BY_NAME[leaf.kind].collate_column(leaf, columns[leaf.column]))
        elif leaf.store == "var":
            leaf_batches.append(BY_NAME[leaf.kind].collate_values(next(var_iter)))
        else:
            leaf_batches.append([None] * n)
    return _rebuild(schema.structure, iter(leaf_batches))


def rebuild_batch(structure, batches: list):
    """The batch made of one batch per leaf (in schema order) in ``default_collate``'s structure for
    samples of ``structure``: what :func:`collate_columns` returns; :func:`leaf_batches` is its inverse."""
    return _rebuild(structure, iter(batches))


def leaf_batches(structure, batch) -> list | None:
    """The per-leaf batches of ``batch`` (built for samples of ``structure``), in schema order;
    ``None`` when ``batch`` has another structure (a batch of free-form samples that do not fit the schema)."""
    out: list = []

    def walk(s, b) -> bool:
        if s == "*":
            out.append(b)
            return True
        if s[0] == "D":
            return (isinstance(b, dict) and list(b) == list(s[1])
                    and all(walk(child, b[key]) for key, child in zip(s[1], s[2])))
        children = s[2] if s[0] == "N" else s[1]
        return (isinstance(b, (list, tuple)) and len(b) == len(children)
                and all(walk(child, part) for child, part in zip(children, b)))
    return out if walk(structure, batch) else None


def _rebuild(structure, it, in_sequence: bool = False):
    # default_collate returns a list for tuples and lists and a dict for dicts; a batch of strings
    # comes back as the list it was given, or as a tuple (from zip) when it sits inside a sequence.
    if structure == "*":
        value = next(it)
        return tuple(value) if in_sequence and type(value) is list else value
    if structure[0] == "D":
        return {k: _rebuild(s, it) for k, s in zip(structure[1], structure[2])}
    if structure[0] == "N":  # default_collate keeps a namedtuple's type
        return named_class(structure)(*(_rebuild(s, it, True) for s in structure[2]))
    return [_rebuild(s, it, True) for s in structure[1]]


class DeferredBatch(SampleBatch):
    """A batch whose samples are all stored, gathered only when someone looks at them.

    In a DataLoader worker, collating it returns a small :class:`BatchHandle` instead of the
    batch's bytes: the handle crosses the process boundary and the main process gathers the rows
    from the same memory-mapped files, so workers never copy sample data through shared memory.

    Args:
        schema: the cache's schema.
        indices: dataset indices, in batch order.
        read: ``read(idx)`` returns the stored samples ``idx`` as a :class:`SampleBatch` or a list.
        handle: what ``collate`` returns in the worker process that made this batch.
    """

    def __init__(self, schema, indices: np.ndarray, read, handle: "BatchHandle"):
        super().__init__(schema, indices, None, None)
        self._read = read
        self._handle = handle
        self._pid = os.getpid()
        self._real = None

    def _resolved(self):
        if self._real is None:
            self._real = self._read(self.indices)
        return self._real

    def samples(self) -> list:
        real = self._resolved()
        return real.samples() if isinstance(real, SampleBatch) else list(real)

    def __getitem__(self, j):
        if self._real is None and not isinstance(j, slice):
            # default_collate looks at batch[0] only: a row type sends the whole batch to collate()
            j = range(len(self))[j]
            return as_row(self._read(self.indices[j:j + 1])[0])
        return self._resolved()[j]

    def __iter__(self):
        return iter(self._resolved())

    def collate(self):
        if self._real is None and os.getpid() == self._pid and get_worker_info() is not None:
            return self._handle
        return collate(self._resolved())


class BatchHandle:
    """A batch in flight from a DataLoader worker: the dataset's token and the indices. Unpickled
    in the receiving process, it turns into the collated batch, gathered there."""

    __slots__ = ("token", "indices")

    def __init__(self, token: str, indices: np.ndarray):
        self.token = token
        self.indices = indices

    def __reduce__(self):
        return gather_on_arrival, (self.token, self.indices)

    def __repr__(self) -> str:
        return f"BatchHandle({len(self.indices)} samples)"


# token -> the live datasets' gather methods. A token can have several: a copy of a dataset
# (pickle, deepcopy) made in the process that holds the original carries its token, and either
# dying must leave the other's DataLoader workers working.
_gatherers: dict = {}


def register_gatherer(token: str, method) -> None:
    """Let batch handles carrying ``token`` be gathered by ``method(indices)`` in this process
    (held weakly: a dataset that is gone unregisters itself, and only itself).

    Example:
        >>> class Cache:
        ...     def gather(self, idx):
        ...         return idx.tolist()
        >>> a, b = Cache(), Cache()
        >>> register_gatherer("t", a.gather); register_gatherer("t", b.gather)
        >>> del a
        >>> gather_on_arrival("t", [1, 2])
        [1, 2]
    """
    # A weak reference to the object and its plain function, not a WeakMethod: WeakMethod's own
    # callback fails noisily when the interpreter exits ("'NoneType' object has no attribute '_alive'").
    refs = _gatherers.setdefault(token, [])
    refs.append((weakref.ref(method.__self__, lambda ref, token=token: _unregister(token, ref)), method.__func__))


def _unregister(token: str, ref) -> None:
    refs = _gatherers.get(token)
    if refs is None:
        return
    refs[:] = [r for r in refs if r[0] is not ref]
    if not refs:
        _gatherers.pop(token, None)


def gather_on_arrival(token: str, indices):
    """Unpickling a :class:`BatchHandle`: gather its batch from this process's dataset."""
    for ref, func in list(_gatherers.get(token, ())):
        obj = ref()
        if obj is not None:
            return func(obj, np.asarray(indices))
    raise RuntimeError(
        "nbkit: a DataLoader worker sent a batch of a CachedDataset that this process does not hold. "
        "Iterate the DataLoader in the process that created it, or pass collate_fn=None-safe settings "
        "such as num_workers=0."
    )


# default_collate picks its method by the type of batch[0]. A SampleBatch hands out its samples as
# these plain-container subclasses, registered below, so default_collate passes the whole batch to
# SampleBatch.collate (one step, as nbkit.collate) instead of stacking sample by sample.
class TupleRow(tuple):
    __slots__ = ()


class ListRow(list):
    __slots__ = ()


class DictRow(dict):
    __slots__ = ()


class TensorRow(torch.Tensor):
    """A bare-tensor sample that ``default_collate`` hands to nbkit: without it, a batch that is
    not a real list reaches ``torch.stack`` ("must be tuple of Tensors, not DeferredBatch").
    Arithmetic on it gives plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class StrRow(str):
    """A bare string sample (``default_collate`` returns a batch of strings as it is given: the
    list the source's loader gives, not the batch object)."""

    __slots__ = ()


class BytesRow(bytes):
    __slots__ = ()


class NamedRow:
    """Base of the row type of each namedtuple class (made by :func:`named_row`): a subclass of the
    namedtuple (``row.x`` works) that names it in ``_nbkit_named`` and pickles as it."""

    __slots__ = ()

    def __reduce__(self):
        return self._nbkit_named._make, (tuple(self),)


# Every kind of sample whose batch torch's per-type collate mishandles when it is not a real list
# (containers: one step instead of per-sample objects; tensors: torch.stack; strings: kept as is).
_ROWS = {tuple: TupleRow, list: ListRow, dict: DictRow, torch.Tensor: TensorRow, str: StrRow, bytes: BytesRow}


def named_row(cls: type) -> type:
    row = _ROWS.get(cls)
    if row is None:
        row = _ROWS[cls] = type(cls.__name__, (cls, NamedRow), {"__slots__": (), "_nbkit_named": cls})
    return row


def _pil_row():
    """The row type of a bare PIL image, made (and registered) when the first one is read: PIL is
    optional, and only a cache of images has imported it."""
    global _PIL_ROW
    if _PIL_ROW is None:
        from PIL import Image

        _PIL_ROW = type("PilRow", (Image.Image,), {"__module__": __name__, "__reduce_ex__": _plain_pil_reduce})
        if default_collate_fn_map is not None:
            default_collate_fn_map[_PIL_ROW] = _collate_rows
    return _PIL_ROW


_PIL_ROW = None


def _plain_pil_reduce(self, protocol):
    return _same, (self.copy(),)  # copy() makes a plain Image.Image: a row pickles as one


def _same(value):
    return value


def as_row(sample):
    typ = type(sample)
    row = _ROWS.get(typ)
    if row is None and typ.__module__ == "PIL.Image" and typ.__name__ == "Image":
        sample.__class__ = _pil_row()  # images nbkit decoded, so changed in place (no pixel copy)
        return sample
    if row is None:
        if not is_namedtuple(sample) or isinstance(sample, NamedRow):
            return sample
        return named_row(typ)._make(sample)
    if row is TensorRow:
        return sample.as_subclass(TensorRow)
    return row._make(sample) if issubclass(row, NamedRow) else row(sample)


def plain_sample(sample):
    """A batch row as the plain tuple, list, dict or namedtuple it stands for."""
    if isinstance(sample, NamedRow):
        return sample._nbkit_named._make(sample)
    if type(sample) is TensorRow:
        return sample.as_subclass(torch.Tensor)
    if _PIL_ROW is not None and type(sample) is _PIL_ROW:
        return sample.copy()
    return type(sample).__mro__[1](sample) if type(sample) in _ROW_TYPES else sample


def _collate_rows(batch, *, collate_fn_map=None):
    if isinstance(batch, SampleBatch):
        return batch.collate()
    return _torch_collate([plain_sample(s) for s in batch], collate_fn_map=collate_fn_map)


_ROW_TYPES = frozenset(_ROWS.values()) | {NamedRow}
try:
    from torch.utils.data._utils.collate import collate as _torch_collate
    from torch.utils.data._utils.collate import default_collate_fn_map
except ImportError:  # torch < 1.13: default_collate then stacks sample by sample, still correct
    _torch_collate = default_collate_fn_map = None
else:
    # torch documents extending default_collate this way (see torch.utils.data.default_collate).
    for _row in _ROW_TYPES:
        default_collate_fn_map[_row] = _collate_rows


class TensorBatch(list):
    """A batch of bare-tensor samples: a real list (``torch.stack`` needs one) that also keeps the
    gathered tensor, so :func:`collate` returns it without stacking."""

    def __init__(self, stacked: torch.Tensor):
        super().__init__(torch.unbind(stacked))
        self.stacked = stacked


def collate(batch):
    """A ``collate_fn`` for ``DataLoader`` over a ``CachedDataset``: zero per-sample work.

    Falls back to ``torch.utils.data.default_collate`` for anything else, so it is safe to use
    everywhere; PIL images, which ``default_collate`` refuses, are stacked as ``PILToTensor``
    would make them (``(N, C, H, W)``), or refused with a ``TypeError`` when their sizes differ.
    """
    if isinstance(batch, SampleBatch):
        return batch.collate()
    if isinstance(batch, BatchHandle):
        return batch
    if isinstance(batch, TensorBatch):
        return batch.stacked
    extra = collate_types()  # values torch cannot batch (PIL images) in a batch of samples read one by one
    if extra and _torch_collate is not None:
        return _torch_collate(batch, collate_fn_map={**default_collate_fn_map, **extra})
    return default_collate(batch)


def map_tensors(batch, fn):
    """``batch`` with ``fn`` applied to every tensor in it (tuples, lists and dicts rebuilt).

    Example:
        >>> map_tensors((torch.ones(2), {"y": torch.zeros(1)}, "name"), lambda t: t + 1)
        (tensor([2., 2.]), {'y': tensor([1.])}, 'name')
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, tuple):
        values = [map_tensors(v, fn) for v in batch]
        return type(batch)._make(values) if is_namedtuple(batch) else tuple(values)
    if isinstance(batch, list):
        return [map_tensors(v, fn) for v in batch]
    return batch


def iter_tensors(batch):
    """Every tensor in ``batch``, depth first."""
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from iter_tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from iter_tensors(v)
