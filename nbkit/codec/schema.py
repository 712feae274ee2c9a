"""The schema: how the leaves of a conforming sample are stored, inferred from a few samples.

A :class:`Schema` decides per leaf (by its kind, see :mod:`nbkit.codec.table`) how it is stored:

* ``col`` — same dtype and shape in every sample: one row of a fixed-size column file, so a
  batch read is one vectorised gather;
* ``var`` — strings, bytes, arrays whose shape varies: packed into a per-sample blob;
* ``const`` — ``None``: nothing stored.

A sample that does not fit the schema (other structure, kind, dtype or shape) is stored whole as a
free-form blob (:mod:`nbkit.codec.freeform`).

Example:
    >>> schema = infer_schema([(1, "a"), (2, "bb")], allow_pickle=False)
    >>> [(leaf.kind, leaf.store) for leaf in schema.leaves]
    [('int', 'col'), ('str', 'var')]
    >>> cols, blob = schema.split((3, "ccc"), "sample", False)
    >>> cols, schema.var_values(blob, "sample", False)
    ([3], ['ccc'])
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import CorruptCacheError
from ..trust import AnyJSON, Int, List, Obj, Str, check_json
from .kind import DIM, MAX_NDIM, MAX_ROW_BYTES, Leaf, nbytes
from .structure import compile_structure, count_leaves, flatten, structure_from_json, structure_to_json
from .table import BY_NAME, kind_of

__all__ = ["Leaf", "Schema", "infer_schema", "MAX_ROW_BYTES"]

# The kinds' names are read live from the table (a kind added to it is a valid name at once).
_LEAF_SPEC = Obj({"kind": Str(choices=BY_NAME.keys()), "store": Str(choices=("col", "var", "const")),
                  "dtype": Str(max_len=32), "shape": List(DIM, max_len=MAX_NDIM), "column": Int(min=-1, max=4095),
                  "mode": Str(max_len=8)}, required=("kind", "store"))
_SCHEMA_SPEC = Obj({"structure": AnyJSON(), "leaves": List(_LEAF_SPEC)})


@dataclass(frozen=True)
class Schema:
    """How the leaves of a conforming sample are stored. ``structure is None`` means every sample is free-form."""

    structure: object
    leaves: tuple

    # Cached: the read path asks for these on every batch.
    @cached_property
    def columns(self) -> list:
        return [leaf for leaf in self.leaves if leaf.store == "col"]

    @cached_property
    def var_leaves(self) -> list:
        return [leaf for leaf in self.leaves if leaf.store == "var"]

    @cached_property
    def _var_kinds(self) -> list:
        return [BY_NAME[leaf.kind] for leaf in self.var_leaves]

    @property
    def has_var(self) -> bool:
        return bool(self.var_leaves)

    def column_dtype(self, leaf: Leaf) -> np.dtype:
        return BY_NAME[leaf.kind].storage_dtype(leaf.dtype)

    def row_bytes(self, leaf: Leaf) -> int:
        return nbytes(leaf.shape, self.column_dtype(leaf).itemsize)

    def to_json(self):
        if self.structure is None:
            return None
        return {"structure": structure_to_json(self.structure), "leaves": [leaf.to_json() for leaf in self.leaves]}

    @classmethod
    def from_json(cls, obj, where: str = "cache metadata", fix: str = "Re-create the cache, or get it again."):
        """The schema stored as ``obj``, every leaf checked against the structure and each other;
        anything malformed raises :class:`CorruptCacheError` naming ``where``, the field and ``fix``.

        Example:
            >>> Schema.from_json({"structure": "*", "leaves": [{"kind": "int", "store": "col", "dtype": "<i8",
            ...                                                  "shape": [], "column": 0}]}).columns[0].kind
            'int'
            >>> Schema.from_json({"structure": "*", "leaves": []}, "nbkit.json", "Re-create it.")
            Traceback (most recent call last):
            ...
            nbkit.errors.CorruptCacheError: nbkit.json is damaged: the field 'schema.leaves' describes 0 values, but the structure holds 1. Re-create it.
        """
        if obj is None:
            return cls(None, ())
        obj = check_json({"schema": obj}, Obj({"schema": _SCHEMA_SPEC}), where, fix)["schema"]
        structure = structure_from_json(obj["structure"], where, fix)
        leaves = tuple(Leaf.from_json(x) for x in obj["leaves"])

        def bad(field, what):
            raise CorruptCacheError(f"{where} is damaged: the field 'schema.{field}' {what}. {fix}")

        def itemsize(field, leaf):
            try:
                return BY_NAME[leaf.kind].storage_dtype(leaf.dtype).itemsize
            except CorruptCacheError as e:
                bad(f"{field}.dtype", f"names a dtype nbkit does not read ({e})")

        if len(leaves) != count_leaves(structure):
            bad("leaves", f"describes {len(leaves)} values, but the structure holds {count_leaves(structure)}")
        n_columns = 0
        for j, leaf in enumerate(leaves):
            field = f"leaves[{j}]"
            kind = BY_NAME[leaf.kind]
            if (kind.stores == ("const",)) != (leaf.store == "const"):
                bad(field, f"is a {leaf.kind!r} value stored as {leaf.store!r} (None, and only None, is 'const')")
            if leaf.store == "const":
                continue
            if leaf.store not in kind.stores:
                bad(field, f"stores a {leaf.kind!r} value as {leaf.store!r}, which nbkit never does")
            if leaf.store == "var":
                if kind.var_dtype:
                    itemsize(field, leaf)
                continue
            if leaf.column != n_columns:
                bad(f"{field}.column", f"is {leaf.column}, but column leaves are numbered in order from 0 (expected {n_columns})")
            n_columns += 1
            problem = kind.column_problem(leaf)
            if problem is not None:
                bad(field + problem[0], problem[1])
            if nbytes(leaf.shape, itemsize(field, leaf)) > MAX_ROW_BYTES:
                bad(f"{field}.shape", f"makes rows of more than {MAX_ROW_BYTES} bytes")
        return cls(structure, leaves)

    # -- encoding conforming samples -------------------------------------------------------

    @cached_property
    def _plan(self):
        """A compiled splitter: ``(structure_check, col_matchers)``, built once per schema."""
        return compile_structure(self.structure), [BY_NAME[leaf.kind].matcher(leaf) if leaf.store == "col" else None
                                                   for leaf in self.leaves]

    def split(self, sample, where: str, allow_pickle: bool):
        """``(col_values, var_blob)`` for a sample that fits the schema, or ``None`` if it does not.

        ``col_values[k]`` is an array (or a Python scalar) for column ``k``; stack them with
        :meth:`stack`.
        """
        if self.structure is None:
            return None
        check, matchers = self._plan
        leaves: list = []
        if not check(sample, leaves):
            return None
        cols, var_parts = [], []
        for leaf, match, value in zip(self.leaves, matchers, leaves):
            if leaf.store == "col":
                out = match(value)
                if out is None:
                    return None
                cols.append(out)
                continue
            if leaf.store == "const":
                if value is not None:
                    return None
                continue
            kind = kind_of(value, where, allow_pickle)
            if kind.name != leaf.kind:
                return None
            part = kind.encode_var(leaf, value)
            if part is None:
                return None
            var_parts.append(part)
        blob = b""
        if var_parts:
            blob = struct.pack(f"<I{len(var_parts)}Q", len(var_parts), *(len(p) for p in var_parts)) + b"".join(var_parts)
        return cols, blob

    def stack(self, k: int, values: list) -> np.ndarray:
        """Rows for column ``k`` from the ``col_values[k]`` of several samples."""
        leaf = self.columns[k]
        return BY_NAME[leaf.kind].stack(values, self.column_dtype(leaf))

    def var_values(self, blob, where: str, allow_pickle: bool) -> list:
        """Decode the var leaves of one conforming sample from its blob."""
        mv = memoryview(blob)
        var_leaves = self.var_leaves
        try:
            (n,) = struct.unpack_from("<I", mv, 0)
            if n != len(var_leaves):
                raise CorruptCacheError(f"{where}: stored blob has {n} fields, schema expects {len(var_leaves)}")
            lengths = struct.unpack_from(f"<{n}Q", mv, 4)
        except struct.error as e:
            raise CorruptCacheError(f"{where}: stored blob is truncated") from e
        pos = 4 + 8 * n
        out = []
        for leaf, kind, length in zip(var_leaves, self._var_kinds, lengths):
            if pos + length > len(mv):
                raise CorruptCacheError(f"{where}: stored blob is truncated")
            out.append(kind.decode_var(leaf, mv[pos : pos + length], where, allow_pickle))
            pos += length
        return out


def infer_schema(samples: list, *, allow_pickle: bool) -> Schema:
    """The schema that stores ``samples`` (a few probes of the source) most efficiently.

    Leaves whose dtype and shape agree across the probes become columns; array leaves whose
    shape differs become variable-length; if the probes disagree in structure or leaf kinds,
    every sample is stored free-form.
    """
    flats = []
    for j, s in enumerate(samples):
        leaves: list = []
        structure = flatten(s, leaves, f"probe sample {j}")
        kinds = [kind_of(v, f"probe sample {j}", allow_pickle) for v in leaves]
        flats.append((structure, leaves, kinds))
    structure, _, kinds = flats[0]
    if any(f[0] != structure or f[2] != kinds for f in flats[1:]):
        return Schema(None, ())
    out = []
    n_cols = 0
    for j, kind in enumerate(kinds):
        leaf = kind.infer([f[1][j] for f in flats], n_cols)
        if leaf is None:
            return Schema(None, ())
        out.append(leaf)
        n_cols += leaf.store == "col"
    return Schema(structure, tuple(out))
