"""Free-form blobs: any supported sample, self-describing (a JSON header, then raw payloads).

A sample that does not fit its cache's schema is stored this way: slower, but it always works.
Decoding only ever uses JSON and ``numpy.frombuffer``; pickle only for ``pickle`` leaves, and only
when the writer and the reader both pass ``allow_pickle=True``.

Example:
    >>> import torch
    >>> sample = (torch.arange(3), {"label": 7, "name": "seven"})
    >>> decode_freeform(encode_freeform(sample, allow_pickle=False), allow_pickle=False)
    (tensor([0, 1, 2]), {'label': 7, 'name': 'seven'})
"""

from __future__ import annotations

import json
import struct

from ..errors import CorruptCacheError
from ..trust import AnyJSON, List, Obj, Str, check_json
from .kind import DAMAGED
from .structure import count_leaves, flatten, structure_from_json, structure_to_json, unflatten
from .table import BY_NAME, PICKLE, kind_of

_FREEFORM_MAGIC = b"NBKF"
_FREEFORM_HEADER = Obj({"s": AnyJSON(), "l": List(Obj({"k": Str(max_len=16)}))})


def encode_freeform(sample, *, allow_pickle: bool, where: str = "sample", legacy: bool = False) -> bytes:
    """A self-describing blob holding any supported sample.

    ``legacy=True`` encodes as nbkit did before it kept namedtuples, PIL images and bfloat16 numpy
    arrays (a namedtuple as a tuple, such leaves pickled where allowed): source fingerprints hash
    that, so caches built before still match their source.
    """
    leaves: list = []
    structure = flatten(sample, leaves, where, named=not legacy)
    headers, payloads = [], []
    for j, leaf in enumerate(leaves):
        kind = kind_of(leaf, f"{where} leaf {j}", allow_pickle)
        if legacy and allow_pickle and kind.legacy_pickled:
            kind = PICKLE
        h, p = kind.to_freeform(leaf)
        headers.append(h)
        payloads.append(p)
    header = json.dumps({"s": structure_to_json(structure), "l": headers}, separators=(",", ":")).encode()
    return b"".join([_FREEFORM_MAGIC, struct.pack("<I", len(header)), header, *payloads])


def decode_freeform(blob, *, allow_pickle: bool, where: str = "sample"):
    """Inverse of :func:`encode_freeform`. Never unpickles unless ``allow_pickle``; anything malformed
    raises :class:`CorruptCacheError` naming ``where``."""
    mv = memoryview(blob)
    if len(mv) < 8 or bytes(mv[:4]) != _FREEFORM_MAGIC:
        raise CorruptCacheError(f"{where}: stored blob is not an nbkit sample")
    (hlen,) = struct.unpack_from("<I", mv, 4)
    if 8 + hlen > len(mv):
        raise CorruptCacheError(f"{where}: stored sample is truncated (its header claims {hlen} bytes)")
    try:
        header = json.loads(bytes(mv[8 : 8 + hlen]))
    except (ValueError, RecursionError) as e:
        raise CorruptCacheError(f"{where}: stored sample header is malformed ({e})") from e
    header = check_json(header, _FREEFORM_HEADER, f"{where} (its header)", DAMAGED)
    structure = structure_from_json(header["s"], f"{where} (its header)", DAMAGED)
    descs = header["l"]
    if len(descs) != count_leaves(structure):
        raise CorruptCacheError(f"{where}: stored sample header lists {len(descs)} values for a structure of "
                                f"{count_leaves(structure)}. {DAMAGED}")
    pos = 8 + hlen
    leaves = []
    for j, h in enumerate(descs):
        kind = BY_NAME.get(h["k"])
        if kind is None:
            raise CorruptCacheError(f"{where}: unknown leaf kind {h['k']!r} (written by a newer nbkit?)")
        h = check_json(h, kind.header_spec, f"{where} (its header, value {j})", DAMAGED)
        if kind.inline:
            leaves.append(kind.from_freeform(h, None, where, allow_pickle))
            continue
        n = h["n"]
        if pos + n > len(mv):
            raise CorruptCacheError(f"{where}: stored sample is truncated")
        data = mv[pos : pos + n]
        pos += n
        leaves.append(kind.from_freeform(h, data, where, allow_pickle))
    return unflatten(structure, iter(leaves), where)
