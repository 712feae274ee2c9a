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

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import default_collate

from .codec import array_to_leaf, batch_leaf_values, unflatten_columns

__all__ = ["SampleBatch", "collate"]


class SampleBatch(Sequence):
    """The samples of one batch, stored column-wise.

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
                out.append(batch_leaf_values(leaf.kind, leaf.dtype, self._columns[leaf.column]))
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
        return self.samples()[j]

    def __iter__(self):
        return iter(self.samples())

    def __repr__(self) -> str:
        return f"SampleBatch({len(self)} samples)"

    def collate(self):
        """The collated batch, as ``default_collate`` would build it, without per-sample objects."""
        n = len(self.indices)
        leaf_batches, var_iter = [], iter(self._var_values or ())
        for leaf in self._schema.leaves:
            if leaf.store == "col":
                col = self._columns[leaf.column]
                if col.dtype.kind in "SU":  # fixed-width numpy strings: default_collate decides
                    leaf_batches.append(default_collate(list(col)))
                else:
                    leaf_batches.append(array_to_leaf("tensor", leaf.dtype, col) if leaf.kind == "tensor"
                                        else torch.from_numpy(col))
            elif leaf.store == "var":
                values = next(var_iter)
                leaf_batches.append(values if leaf.kind in ("str", "bytes") else default_collate(values))
            else:
                leaf_batches.append([None] * n)
        return _rebuild(self._schema.structure, iter(leaf_batches))


def _rebuild(structure, it, in_sequence: bool = False):
    # default_collate returns a list for tuples and lists and a dict for dicts; a batch of strings
    # comes back as the list it was given, or as a tuple (from zip) when it sits inside a sequence.
    if structure == "*":
        value = next(it)
        return tuple(value) if in_sequence and type(value) is list else value
    if structure[0] == "D":
        return {k: _rebuild(s, it) for k, s in zip(structure[1], structure[2])}
    return [_rebuild(s, it, True) for s in structure[1]]


class TensorBatch(list):
    """A batch of bare-tensor samples: a real list (``torch.stack`` needs one) that also keeps the
    gathered tensor, so :func:`collate` returns it without stacking."""

    def __init__(self, stacked: torch.Tensor):
        super().__init__(torch.unbind(stacked))
        self.stacked = stacked


def collate(batch):
    """A ``collate_fn`` for ``DataLoader`` over a ``CachedDataset``: zero per-sample work.

    Falls back to ``torch.utils.data.default_collate`` for anything else, so it is safe to use
    everywhere.
    """
    if isinstance(batch, SampleBatch):
        return batch.collate()
    if isinstance(batch, TensorBatch):
        return batch.stacked
    return default_collate(batch)
