"""How one pushed cache is cut into pieces for one ``local_max_bytes`` (the same in every process).

A **column piece** is a run of consecutive rows of every column (``col-<k>.bin``), fetched with one
``cat_ranges`` call; a **heap piece** is an aligned byte range of ``heap.bin``. Pieces are about
``local_max_bytes / 12`` bytes, at most 8 MiB; every local file is accounted rounded up to 4 KiB.

Example:
    >>> rounded(1), rounded(4096), rounded(4097)
    (4096, 4096, 8192)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ... import format as fmt
from ...codec import Schema
from ...errors import CorruptCacheError
from ...transfer.manifest import digest, manifest_bytes

__all__ = ["Geometry", "rounded", "PIECE_MAX", "MIN_PIECES", "BLOCK"]

PIECE_MAX = 8 << 20  # largest piece: big enough for object-store throughput, small enough to evict
MIN_PIECES = 12  # pieces shrink until the local area holds at least this many
BLOCK = 4096  # files are accounted rounded up to this, so blocks on disk never exceed the limit


def rounded(n: int) -> int:
    """``n`` bytes rounded up to whole :data:`BLOCK` s (what a file of ``n`` bytes occupies)."""
    return -(-int(n) // BLOCK) * BLOCK


@dataclass(frozen=True)
class Geometry:
    """How one cache is cut into pieces for one ``local_max_bytes`` (the same in every process)."""

    rows_per_piece: int  # column piece = this many consecutive rows of every column
    heap_piece: int  # heap piece = this many bytes of heap.bin
    row_bytes: tuple  # bytes of one row of each column
    capacity: int  # rows of each column
    heap_size: int
    fixed: int  # bytes of the local files that are not pieces (rounded)
    usable: int  # local_max_bytes - fixed: room for pieces
    tag: str  # names this cache's pieces (manifest digest and geometry)

    @classmethod
    def of(cls, meta: dict, manifest: dict, limit: int, piece_bytes: int | None, url: str) -> "Geometry":
        schema = Schema.from_json(meta["schema"])
        row_bytes = tuple(int(np.prod(leaf.shape, dtype=np.int64)) * schema.column_dtype(leaf).itemsize for leaf in schema.columns)
        length = int(meta["length"])
        capacity = length if meta.get("capacity") is None else int(meta["capacity"])
        files = manifest["files"]
        for spec, rb in zip(meta["columns"], row_bytes):
            size = files.get(spec["file"], {}).get("size")
            if size != capacity * rb:
                raise CorruptCacheError(f"{url}/{spec['file']} is {size} bytes in the manifest, expected {capacity * rb}: "
                                        "the remote cache is incomplete or damaged. Push it again with nbkit.push.")
        if files.get(fmt.INDEX, {}).get("size") != length * fmt.RECORD.itemsize:
            raise CorruptCacheError(f"{url}/{fmt.INDEX} does not hold {length} records; push the cache again with nbkit.push.")
        heap_size = int(files.get(fmt.HEAP, {}).get("size", 0))
        fixed = sum(rounded(files[n]["size"]) for n in (fmt.INDEX, fmt.META)) + rounded(len(manifest_bytes(manifest))) + BLOCK
        usable = limit - fixed
        total_row = sum(row_bytes)
        target = int(piece_bytes) if piece_bytes else min(PIECE_MAX, max(usable // MIN_PIECES, 1))
        rows = max(1, target // total_row) if total_row else 1
        heap_piece = max(BLOCK, rounded(target)) if heap_size else BLOCK
        largest = max(rounded(rows * total_row) if total_row else 0, heap_piece if heap_size else 0)
        if usable < 2 * largest:
            raise ValueError(
                f"local_max_bytes={limit} is too small to read {url} through: its index and metadata take {fixed} bytes "
                f"and reading needs room for two pieces of {largest} bytes (one sample's rows are {total_row} bytes). "
                f"Pass local_max_bytes of at least {fixed + 2 * largest}."
            )
        tag = f"{digest(manifest)}-r{rows}-h{heap_piece}"
        return cls(rows, heap_piece, row_bytes, capacity, heap_size, fixed, usable, tag)

    @property
    def n_column_pieces(self) -> int:
        return -(-self.capacity // self.rows_per_piece) if self.row_bytes else 0

    def rows_of(self, p: int) -> tuple[int, int]:
        a = p * self.rows_per_piece
        return a, min(a + self.rows_per_piece, self.capacity)

    def piece_size(self, key: tuple) -> int:
        kind, p = key
        if kind == "c":
            a, b = self.rows_of(p)
            return (b - a) * sum(self.row_bytes)
        return min(self.heap_piece, self.heap_size - p * self.heap_piece)
