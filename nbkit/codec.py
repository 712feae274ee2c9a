"""How one sample becomes bytes and back, without pickle unless asked.

A sample is any nesting of tuples, namedtuples, lists and dicts (string keys) whose leaves are
tensors, numpy arrays or scalars, PIL images, Python numbers, strings, bytes or ``None``.
:func:`flatten` splits a sample into a *structure* (hashable, JSON-able) and a list of leaves. A
:class:`Schema`, inferred from a few samples, decides per leaf how it is stored:

* ``col`` — same dtype and shape in every sample: one row of a fixed-size column file, so a
  batch read is one vectorised gather;
* ``var`` — strings, bytes, arrays whose shape varies: packed into a per-sample blob;
* ``const`` — ``None``: nothing stored.

A sample that does not fit the schema (other structure, dtype or shape) is stored whole as a
self-describing *free-form* blob: slower, but it always works. Decoding only ever uses JSON and
``numpy.frombuffer``; pickle is used only for leaves of other types, and only when the writer and
the reader both pass ``allow_pickle=True``.

* **Tensors** of every dtype torch can hold come back with that dtype; those numpy lacks
  (bfloat16, float8, complex32, uint1 …) are stored as their bit pattern in an integer of the
  same size and viewed back. Quantized tensors are refused (``TypeError``: store
  ``dequantize()``).
* **PIL images** are stored without pickle: their pixels as ``numpy.asarray`` gives them (uint8
  ``(H, W[, C])`` for 8-bit modes), their mode and size, and the palette of ``P``/``PA`` images;
  they come back as PIL images of the same mode, size, pixels and palette (``info`` — EXIF, ICC
  profile, transparency — is not kept). Images of one mode and size are a column (the mode is in
  the schema); palette images, and images whose size or mode varies, go in the var blob. Batched,
  :mod:`nbkit.collate` stacks them as ``PILToTensor`` would: ``(N, C, H, W)``, uint8 for 8-bit
  modes (a channels-last view of the gathered rows); images of different sizes raise a
  ``TypeError`` that names the fix. Pillow is imported only once an image is seen or rebuilt.
* **namedtuples** keep their type: the structure names the class (``"module:qualname"``) and its
  field names. Reading **never imports** anything: the class comes back when its module is already
  imported in the reading process, or it was registered (:func:`register_namedtuple`); otherwise an
  equivalent ``collections.namedtuple`` of the stored field names does, with one warning saying how
  to get the class back. A class that cannot be found again by its name (defined inside a function,
  bound to another name) and is not registered is refused when the cache is created.

Example:
    >>> import torch
    >>> from nbkit.codec import encode_freeform, decode_freeform
    >>> sample = (torch.arange(3), {"label": 7, "name": "seven"})
    >>> decode_freeform(encode_freeform(sample, allow_pickle=False), allow_pickle=False)
    (tensor([0, 1, 2]), {'label': 7, 'name': 'seven'})
"""

from __future__ import annotations

import collections
import json
import keyword
import pickle
import re
import struct
import sys
import types
import warnings
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from .errors import CorruptCacheError
from .extras import is_tensor
from .trust import AnyJSON, Bool, Float, Int, List, Obj, Str, check_json, shown

__all__ = ["Schema", "flatten", "unflatten", "encode_freeform", "decode_freeform", "infer_schema", "register_namedtuple"]

# ---------------------------------------------------------------------------------------------
# structure

#: Deepest nesting of containers a sample may have (a structure read from a cache deeper than this
#: is damaged: parsing it must not exhaust the stack).
MAX_DEPTH = 100
#: Longest namedtuple name (``"module:qualname"``), field name or dict key nbkit reads from a cache.
MAX_NAME = 512
MAX_KEY_LEN = 1 << 16


def flatten(sample, leaves: list, where: str = "sample", named: bool = True, _depth: int = 0):
    """Append the leaves of ``sample`` to ``leaves`` and return its structure.

    The structure is a nested tuple: ``("T", children)`` for a tuple, ``("N", "module:qualname",
    children, field_names)`` for a namedtuple (a plain ``"T"`` when not ``named``), ``("L", children)``
    for a list, ``("D", keys, children)`` for a dict and ``"*"`` for a leaf.
    """
    if _depth > MAX_DEPTH and isinstance(sample, (tuple, list, dict)):
        raise TypeError(
            f"{where} nests containers more than {MAX_DEPTH} deep, which nbkit does not store. Flatten the sample "
            "(e.g. a dict of tensors) in your dataset."
        )
    if isinstance(sample, tuple):
        children = tuple(flatten(x, leaves, f"{where}[{i}]", named, _depth + 1) for i, x in enumerate(sample))
        if named and is_namedtuple(sample):
            cls = sample_type(sample)
            return ("N", named_path(cls, where), children, tuple(cls._fields))
        return ("T", children)
    if isinstance(sample, list):
        return ("L", tuple(flatten(x, leaves, f"{where}[{i}]", named, _depth + 1) for i, x in enumerate(sample)))
    if isinstance(sample, dict):
        keys = tuple(sample.keys())
        for k in keys:
            if not isinstance(k, str):
                raise TypeError(
                    f"{where} is a dict with key {k!r} of type {type(k).__name__}; nbkit stores dicts "
                    "with string keys only. Convert the keys to str in your dataset."
                )
        return ("D", keys, tuple(flatten(sample[k], leaves, f"{where}[{k!r}]", named, _depth + 1) for k in keys))
    leaves.append(sample)
    return "*"


def is_namedtuple(value) -> bool:
    """Whether ``value`` is an instance of a ``collections.namedtuple`` / ``typing.NamedTuple`` class."""
    return isinstance(value, tuple) and hasattr(type(value), "_fields") and hasattr(type(value), "_make")


def sample_type(value) -> type:
    """The type a sample container stands for (a batch row from :mod:`nbkit.collate` names its
    namedtuple in ``_nbkit_named``)."""
    return getattr(type(value), "_nbkit_named", type(value))


# -- namedtuple classes: found by name without importing anything --------------------------------
#
# A cache names a namedtuple class as "module:qualname". Reading it never imports that module (a
# cache from elsewhere could name any module, or bring one along): the class is taken from a module
# already loaded in this process (through its __dict__, never getattr, whose hooks can import), or
# from those the user registered; otherwise an equivalent namedtuple is built from the stored field
# names, with one warning saying how to get the class back.

_REGISTERED: dict = {}  # "module:qualname" -> class, from register_namedtuple
_REGISTERED_NAME: dict = {}  # class -> the name it was registered under
_FALLBACK: dict = {}  # ("module:qualname", fields) -> the equivalent namedtuple built for it


def register_namedtuple(cls: type, name: str | None = None) -> type:
    """Let caches that name the namedtuple class ``cls`` rebuild it, in this process.

    Reading a cache never imports a module it names (that would run code from a stranger's cache): a
    stored namedtuple comes back as its class only if the class's module is already imported, or the
    class is registered here; otherwise as an equivalent ``collections.namedtuple`` (with a warning).
    ``name`` (``"module:qualname"``, default: the class's own) is the name caches store it under, so a
    class defined inside a function can be cached too. Returns ``cls`` (usable as a decorator).

    Example:
        >>> from collections import namedtuple
        >>> import nbkit
        >>> Pair = nbkit.register_namedtuple(namedtuple("Pair", "image label"), "myproject.data:Pair")
        >>> named_type("myproject.data:Pair", ("image", "label")) is Pair
        True
    """
    if _fields_of(cls) is None:
        raise TypeError(f"register_namedtuple takes a namedtuple class (collections.namedtuple or typing.NamedTuple), got {cls!r}")
    name = f"{cls.__module__}:{cls.__qualname__}" if name is None else name
    if not isinstance(name, str) or not _valid_path(name):
        raise ValueError(f"register_namedtuple: name must be 'module:qualname' (dotted identifiers), got {name!r}")
    _REGISTERED[name] = cls
    _REGISTERED_NAME[cls] = name
    return cls


def _static(cls: type, name: str):
    """``cls.name`` looked up in the class dictionaries along its MRO, running no descriptor or hook."""
    for klass in type.__getattribute__(cls, "__mro__"):
        namespace = type.__getattribute__(klass, "__dict__")
        if name in namespace:
            return namespace[name]
    return None


def _fields_of(cls) -> tuple | None:
    """The field names of a namedtuple class (read without running any of its code), or ``None``."""
    if not isinstance(cls, type) or tuple not in type.__getattribute__(cls, "__mro__"):
        return None
    fields = _static(cls, "_fields")
    if type(fields) is not tuple or not all(type(f) is str for f in fields) or _static(cls, "_make") is None:
        return None
    return fields


def _valid_path(path: str) -> bool:
    module, sep, qualname = path.partition(":")
    return (bool(sep) and len(path) <= MAX_NAME and all(p.isidentifier() for p in module.split("."))
            and all(p.isidentifier() for p in qualname.split(".")))


def _valid_field(name) -> bool:
    return (isinstance(name, str) and len(name) <= MAX_NAME and name.isidentifier() and not keyword.iskeyword(name)
            and not name.startswith("_"))


def _loaded(path: str):
    """The object ``path`` names in a module already loaded here, found through ``__dict__`` s only
    (no import, no ``__getattr__``), or ``None``."""
    module, _, qualname = path.partition(":")
    obj = sys.modules.get(module)
    if not isinstance(obj, types.ModuleType):
        return None
    namespace = object.__getattribute__(obj, "__dict__")
    for part in qualname.split("."):
        if not isinstance(namespace, (dict, types.MappingProxyType)):
            return None
        obj = namespace.get(part)
        if obj is None:
            return None
        namespace = type.__getattribute__(obj, "__dict__") if isinstance(obj, type) else None
    return obj


def _class_path(cls: type) -> str:
    path = getattr(cls, "_nbkit_path", None)  # an equivalent namedtuple nbkit built stands for its original
    if path is not None:
        return path
    return _REGISTERED_NAME.get(cls) or f"{cls.__module__}:{cls.__qualname__}"


def named_path(cls: type, where: str) -> str:
    """``"module:qualname"`` of a namedtuple class that a reader can find again, else ``TypeError``."""
    path = _class_path(cls)
    if getattr(cls, "_nbkit_path", None) is None and _REGISTERED.get(path) is not cls and _loaded(path) is not cls:
        raise TypeError(
            f"{where} is a namedtuple {cls.__module__}.{cls.__qualname__}, which nbkit cannot find again by its "
            "module and name (is it defined inside a function, or bound to another name?), so a reader could "
            "not rebuild it. Define the namedtuple at the top level of a module (or of the notebook) under its "
            "own name, register it (nbkit.register_namedtuple(cls, 'module:Name')), or return a plain tuple or "
            "dict (sample._asdict()) from your dataset."
        )
    return path


def named_type(path: str, fields, where: str = "sample") -> type:
    """The namedtuple class a cache names ``"module:qualname"`` with ``fields`` (its field names, or
    only their number for caches written before names were stored).

    The class is used when it is registered (:func:`register_namedtuple`) or its module is already
    imported, and has those fields; nothing is ever imported or unpickled. Otherwise an equivalent
    ``collections.namedtuple`` of the stored field names comes back, with one warning per name.
    """
    names = None if isinstance(fields, int) else tuple(fields)
    n = fields if names is None else len(names)
    cls = _REGISTERED.get(path)
    if cls is None:
        cls = _loaded(path)
    found = _fields_of(cls)
    if found is not None and len(found) == n and (names is None or found == names):
        return cls
    return _equivalent(path, names or tuple(f"f{k}" for k in range(n)), cls, where)


def named_class(node, where: str = "sample") -> type:
    """The class of a structure's ``("N", path, children, field_names)`` node (see :func:`named_type`)."""
    return named_type(node[1], len(node[2]) if node[3] is None else node[3], where)


def _equivalent(path: str, names: tuple, found, where: str) -> type:
    cls = _FALLBACK.get((path, names))
    if cls is not None:
        return cls
    qualname = path.partition(":")[2].rpartition(".")[2]
    cls = collections.namedtuple(qualname if _valid_field(qualname) else "Sample", names)
    cls._nbkit_path = path
    cls.__module__ = __name__
    cls.__reduce__ = lambda self: (_rebuild_equivalent, (path, names, tuple(self)))
    _FALLBACK[(path, names)] = cls
    dotted, (module, _, qualname) = path.replace(":", "."), path.partition(":")
    if module not in sys.modules:
        why = (f"its module {module!r} is not imported in this process (nbkit never imports a module that a cache "
               "names: a cache from elsewhere could run code that way)")
    else:
        why = f"that name holds {shown(found)} here, not a namedtuple with the fields {names}"
    warnings.warn(
        f"{where} is a namedtuple {dotted}, but {why}. Its samples come back as an equivalent namedtuple with the "
        f"fields {names}. To get the class back, import it before reading (import {module}) or call "
        f"nbkit.register_namedtuple({qualname}).",
        UserWarning,
        stacklevel=3,
    )
    return cls


def _rebuild_equivalent(path: str, names: tuple, values: tuple):
    """Unpickle a sample of an equivalent namedtuple (a DataLoader worker's batch row) by its stored names."""
    return named_type(path, names)._make(values)


def unflatten(structure, leaves_iter, where: str = "sample"):
    """Rebuild one sample from its structure and an iterator over its leaves."""
    if structure == "*":
        return next(leaves_iter)
    tag = structure[0]
    if tag == "T":
        return tuple(unflatten(s, leaves_iter, where) for s in structure[1])
    if tag == "N":
        cls = named_class(structure, where)
        return cls._make([unflatten(s, leaves_iter, where) for s in structure[2]])
    if tag == "L":
        return [unflatten(s, leaves_iter, where) for s in structure[1]]
    if tag == "D":
        return {k: unflatten(s, leaves_iter, where) for k, s in zip(structure[1], structure[2])}
    raise CorruptCacheError(f"unknown structure tag {tag!r} in cache metadata (written by a newer nbkit?)")


def unflatten_columns(structure, columns_iter, n: int):
    """Rebuild ``n`` samples at once from per-leaf lists of ``n`` values (C-level ``zip``)."""
    if structure == "*":
        return next(columns_iter)
    tag = structure[0]
    children = [unflatten_columns(s, columns_iter, n) for s in structure[1 if tag in "TL" else 2]]
    if tag == "N":
        make = named_class(structure)._make
        return [make(t) for t in zip(*children)] if children else [make(()) for _ in range(n)]
    if not children:
        empty = {"T": tuple, "L": list, "D": dict}[tag]
        return [empty() for _ in range(n)]
    if tag == "T":
        return list(zip(*children))
    if tag == "L":
        return [list(t) for t in zip(*children)]
    keys = structure[1]
    return [dict(zip(keys, t)) for t in zip(*children)]


def structure_to_json(structure):
    if structure == "*":
        return "*"
    if structure[0] == "N":
        out = ["N", structure[1], [structure_to_json(s) for s in structure[2]]]
        return out if structure[3] is None else out + [list(structure[3])]
    if structure[0] == "D":
        return ["D", list(structure[1]), [structure_to_json(s) for s in structure[2]]]
    return [structure[0], [structure_to_json(s) for s in structure[1]]]


def structure_from_json(obj, where: str = "cache metadata", fix: str = ""):
    """The structure stored as ``obj`` (JSON), every node checked: tags, names, keys, field names and
    nesting depth; anything else raises :class:`CorruptCacheError` naming ``where``.

    Example:
        >>> structure_from_json(["N", "x.y:P", ["*", "*"], ["image", "label"]])
        ('N', 'x.y:P', ('*', '*'), ('image', 'label'))
    """
    fix = fix or "Re-create the cache, or get it again from where it came from."

    def bad(what, got):
        raise CorruptCacheError(f"{where} holds a malformed sample structure: {what}, got {shown(got)}. {fix}")

    def node(o, depth):
        if o == "*":
            return o
        if depth > MAX_DEPTH:
            bad(f"containers nested more than {MAX_DEPTH} deep", "...")
        if not isinstance(o, list) or not o or not isinstance(o[0], str):
            bad("each node must be '*' or a list starting with a tag", o)
        tag = o[0]
        if tag in ("T", "L"):
            if len(o) != 2 or not isinstance(o[1], list):
                bad(f"a {tag!r} node is [{tag!r}, children]", o)
            return (tag, tuple(node(c, depth + 1) for c in o[1]))
        if tag == "D":
            if len(o) != 3 or not isinstance(o[1], list) or not isinstance(o[2], list) or len(o[1]) != len(o[2]):
                bad("a 'D' node is ['D', keys, children] with one child per key", o)
            keys = o[1]
            if not all(isinstance(k, str) and len(k) <= MAX_KEY_LEN for k in keys) or len(set(keys)) != len(keys):
                bad("dict keys must be distinct strings", keys)
            return ("D", tuple(keys), tuple(node(c, depth + 1) for c in o[2]))
        if tag == "N":
            if len(o) not in (3, 4) or not isinstance(o[2], list):
                bad("an 'N' node is ['N', 'module:qualname', children, field names]", o)
            if not isinstance(o[1], str) or not _valid_path(o[1]):
                bad("a namedtuple is named 'module:qualname' (dotted identifiers)", o[1])
            names = None
            if len(o) == 4:
                names = o[3]
                if (not isinstance(names, list) or len(names) != len(o[2]) or not all(map(_valid_field, names))
                        or len(set(names)) != len(names)):
                    bad("namedtuple field names must be distinct identifiers not starting with '_', one per child", names)
                names = tuple(names)
            return ("N", o[1], tuple(node(c, depth + 1) for c in o[2]), names)
        raise CorruptCacheError(f"{where}: unknown structure tag {tag!r} (written by a newer nbkit?) {fix}")

    return node(obj, 0)


def count_leaves(structure) -> int:
    """How many leaves a sample of ``structure`` has."""
    if structure == "*":
        return 1
    return sum(count_leaves(c) for c in structure[1 if structure[0] in "TL" else 2])


# ---------------------------------------------------------------------------------------------
# leaves

@lru_cache(maxsize=None)
def _torch_dtypes() -> dict:
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


_NP_KINDS = set("biufcSU")  # never "O" (objects) or "V" (void/structured)
#: The numpy dtype strings a cache may name (as ``dtype.str`` writes them): numbers, bools, and
#: fixed-size byte or unicode strings. Never objects, structured, datetime or sub-array dtypes.
_DTYPE = re.compile(r"[<>|=]?(?:[biufc](?:1|2|4|8|16)|[SU][1-9][0-9]{0,7})\Z")
# dtypes numpy lacks travel as their bit pattern in an integer of the same size (bfloat16 as int16,
# as the first nbkit stored it; float8 as uint8 …), and are viewed back on read.
_BITS = {1: np.dtype("|u1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}
#: The stored bytes of each tensor dtype torch names (its numpy twin, else :data:`_BITS` of its size),
#: so that metadata is checked without importing torch: ``nbkit ls``, ``info`` and ``verify`` never
#: do. A name missing here (a newer torch's dtype) is looked up in torch itself; tests/test_codec.py
#: checks the table against the installed torch.
_TENSOR_STORAGE = {name: np.dtype(code) for name, code in {
    "bool": "|b1", "uint8": "|u1", "int8": "|i1", "int16": "<i2", "uint16": "<u2", "int32": "<i4", "uint32": "<u4",
    "int64": "<i8", "uint64": "<u8", "float16": "<f2", "float32": "<f4", "float64": "<f8", "complex64": "<c8",
    "complex128": "<c16", "bfloat16": "<i2", "bits16": "<i2", "complex32": "<i4", "bcomplex32": "<i4",
    **dict.fromkeys(("bits1x8", "bits2x4", "bits4x2", "bits8", "float4_e2m1fn_x2", "float8_e4m3fn", "float8_e4m3fnuz",
                     "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", *(f"int{k}" for k in range(1, 8)),
                     *(f"uint{k}" for k in range(1, 8))), "|u1"),
}.items()}


def torch_dtype(name: str):
    """The torch dtype a cache names ``name``; :class:`CorruptCacheError` if this torch lacks it."""
    d = _torch_dtypes().get(name)
    if d is None:
        import torch

        raise CorruptCacheError(
            f"unsupported tensor dtype {name!r} in cache metadata: torch {torch.__version__} has no such dtype. "
            "Open the cache with the torch version that wrote it (or a newer one)."
        )
    return d


@lru_cache(maxsize=None)
def _numpy_twin(dtype):
    """The numpy dtype of a tensor of ``dtype``, or ``None`` where numpy has none (bfloat16, float8 …)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # complex32 warns that it is experimental
        try:
            import torch

            return torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            return None


def _torch_storage_dtype(dtype) -> np.dtype:
    """The numpy dtype whose bytes hold a tensor of ``dtype``."""
    twin = _numpy_twin(dtype)
    return _BITS[dtype.itemsize] if twin is None else np.dtype(twin).newbyteorder("<")


# ---------------------------------------------------------------------------------------------
# PIL images: Pillow is imported only once a value from it is seen (``import nbkit`` never does)

PALETTE_MODES = ("P", "PA")
#: The PIL image modes nbkit rebuilds (a mode read from a cache is one of these, or the cache is damaged).
PIL_MODES = ("1", "L", "LA", "La", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr", "LAB", "HSV", "I", "F",
             "I;16", "I;16L", "I;16B", "I;16N")
#: At most this many dimensions in a stored array (numpy's own limit is 64).
MAX_NDIM = 32
_DIM = Int(min=0, max=1 << 48)
_PIL_HEADER = Obj({"m": Str(choices=PIL_MODES), "d": Str(max_len=16), "s": List(_DIM, max_len=3),
                   "pm": Str(choices=PIL_MODES)}, required=("m", "d", "s"))


def nbytes(shape, itemsize: int) -> int:
    """Bytes of an array of ``shape`` (Python integers: a shape read from a cache cannot overflow)."""
    n = itemsize
    for d in shape:
        n *= int(d)
    return n


def is_pil_image(value) -> bool:
    if not type(value).__module__.startswith("PIL."):
        return False
    from PIL import Image

    return isinstance(value, Image.Image)


def pil_pixels(img) -> np.ndarray:
    """The pixels of a PIL image as ``numpy.asarray`` gives them: ``(H, W)`` or ``(H, W, bands)``,
    uint8 for 8-bit modes (bool for mode ``"1"``, uint16 / int32 / float32 for ``I;16`` / ``I`` / ``F``)."""
    return np.asarray(img)


def pil_from_pixels(mode: str, arr: np.ndarray, palette: tuple | None = None, where: str = "sample"):
    """The PIL image of ``mode`` whose pixels are ``arr`` (as :func:`pil_pixels` gave them), with
    ``palette = (palette_mode, bytes)`` for ``P``/``PA`` images."""
    try:
        from PIL import Image
    except ImportError as e:
        raise ImportError(f"{where} is a PIL image; reading it needs Pillow: pip install pillow") from e
    size = (arr.shape[1], arr.shape[0])
    if mode not in PIL_MODES or (palette is not None and palette[0] not in PIL_MODES):
        raise CorruptCacheError(f"{where}: stored PIL image has the unknown mode {mode!r}; the cache is damaged")
    try:
        data = np.packbits(arr, axis=1).tobytes() if mode == "1" else np.ascontiguousarray(arr).tobytes()
        img = Image.frombytes(mode, size, data)
        if palette is not None:
            img.putpalette(palette[1], rawmode=palette[0])
    except (ValueError, TypeError) as e:
        raise CorruptCacheError(f"{where}: stored PIL image (mode {mode!r}, size {size}) is malformed ({e})") from e
    return img


def pil_to_bytes(img) -> bytes:
    """A self-describing blob of one PIL image: pixels, mode, size and palette (never ``info``)."""
    arr = pil_pixels(img)
    palette = b""
    head = {"m": img.mode, "d": arr.dtype.str, "s": list(arr.shape)}
    if img.mode in PALETTE_MODES and img.palette is not None:
        head["pm"] = img.palette.mode
        palette = bytes(img.getpalette(rawmode=img.palette.mode) or ())
    header = json.dumps(head, separators=(",", ":")).encode()
    return b"".join([struct.pack("<I", len(header)), header, arr.tobytes(), palette])


def pil_from_bytes(data, where: str):
    """Inverse of :func:`pil_to_bytes`."""
    mv = memoryview(data)
    try:
        (hlen,) = struct.unpack_from("<I", mv, 0)
        head = json.loads(bytes(mv[4 : 4 + hlen]))
    except (struct.error, ValueError, RecursionError) as e:
        raise CorruptCacheError(f"{where}: stored PIL image header is malformed ({e})") from e
    head = check_json(head, _PIL_HEADER, f"{where} (its PIL image header)", "The stored sample is damaged.")
    mode, shape, dt = head["m"], tuple(head["s"]), storage_dtype("ndarray", head["d"])
    pos = 4 + hlen
    n = nbytes(shape, dt.itemsize)
    if len(shape) not in (2, 3) or pos + n > len(mv):
        raise CorruptCacheError(f"{where}: stored PIL image is truncated")
    arr = np.frombuffer(mv[pos : pos + n], dtype=dt).reshape(shape)
    palette = (head["pm"], bytes(mv[pos + n :])) if "pm" in head else None
    return pil_from_pixels(mode, arr, palette, where)


def stack_pil(images: list, where: str = "batch") -> torch.Tensor:
    """A batch of PIL images as ``default_collate([PILToTensor()(im) for im in images])`` gives it:
    ``(N, C, H, W)``; ``TypeError`` naming the fix when their sizes or modes differ."""
    arrays = [pil_pixels(im) for im in images]
    shapes = {(a.dtype.str, a.shape) for a in arrays}
    if len(shapes) > 1:
        raise TypeError(
            f"nbkit cannot stack the PIL images of {where} into one tensor: they differ in size or mode "
            f"({', '.join(sorted({f'{im.mode} {im.size[0]}x{im.size[1]}' for im in images}))}). Make them one size "
            "in the source (e.g. transforms.Resize and CenterCrop), convert them per sample with "
            "transform=... (e.g. transforms.PILToTensor()), or pass a collate_fn that keeps a list."
        )
    import torch

    return channels_first(torch.from_numpy(native(np.stack(arrays))))


def native(arr: np.ndarray) -> np.ndarray:
    """``arr`` in this machine's byte order (torch takes no other)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def channels_first(pixels: torch.Tensor) -> torch.Tensor:
    """Stacked PIL pixels ``(N, H, W[, C])`` as ``(N, C, H, W)``, PILToTensor's layout (a view:
    channels-last in memory, which convolutions take as is)."""
    return pixels.unsqueeze(1) if pixels.dim() == 3 else pixels.permute(0, 3, 1, 2)


def leaf_kind(value, where: str, allow_pickle: bool) -> str:
    if is_tensor(value):
        if value.is_quantized:
            raise TypeError(
                f"{where} is a quantized tensor ({value.dtype}), which nbkit cannot store: its values need a scale "
                "and zero point besides the bytes. Store value.dequantize() (or value.int_repr() and the "
                "quantization parameters) in your dataset."
            )
        return "tensor"
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NP_KINDS:
            if allow_pickle:
                return "pickle"
            raise TypeError(
                f"{where} is a numpy array of dtype {value.dtype}, which nbkit cannot store without pickle. "
                "Convert it to a numeric array in your dataset, or pass allow_pickle=True (openers must then "
                "pass allow_pickle=True too)."
            )
        return "ndarray"
    if isinstance(value, np.generic):
        return "npscalar" if np.dtype(type(value)).kind in _NP_KINDS else ("pickle" if allow_pickle else _refuse(value, where))
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -(2**63) <= value < 2**63 else ("pickle" if allow_pickle else _refuse(value, where))
    if isinstance(value, float):
        return "float"
    if isinstance(value, complex):
        return "complex"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    if value is None:
        return "none"
    if is_pil_image(value):
        return "pil"
    if allow_pickle:
        return "pickle"
    return _refuse(value, where)


def _refuse(value, where: str):
    hint = ""
    if type(value).__module__.startswith("PIL"):
        hint = " For PIL images add transforms.PILToTensor() or ToTensor() to the source dataset."
    raise TypeError(
        f"{where} has type {type(value).__module__}.{type(value).__qualname__}, which nbkit can only store "
        f"with pickle.{hint} Convert it to a tensor, numpy array, number, str or bytes in your dataset, or "
        "pass allow_pickle=True (anyone opening the cache must then pass allow_pickle=True too, because "
        "unpickling can run code)."
    )


def leaf_to_array(kind: str, value) -> np.ndarray:
    """The numpy array whose bytes store a leaf of ``kind`` (col and var leaves)."""
    if kind == "tensor":
        import torch

        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.layout != torch.strided:
            raise TypeError(f"nbkit stores dense tensors only, got layout {t.layout}; call .to_dense() in your dataset")
        t = t.resolve_conj().resolve_neg().contiguous()
        if _numpy_twin(t.dtype) is None:
            t = t.view(torch_dtype(_BITS[t.dtype.itemsize].name))
        return t.numpy()
    if kind == "ndarray":
        return np.ascontiguousarray(value)
    if kind == "pil":
        return pil_pixels(value)
    if kind == "npscalar":
        return np.asarray(value)
    if kind == "int":
        return np.asarray(value, dtype="<i8")
    if kind == "float":
        return np.asarray(value, dtype="<f8")
    if kind == "bool":
        return np.asarray(value, dtype="|b1")
    if kind == "complex":
        return np.asarray(value, dtype="<c16")
    raise AssertionError(kind)


def leaf_dtype_shape(kind: str, value):
    """``(dtype_name, shape)`` describing an array-like leaf, as stored in the schema."""
    if kind == "tensor":
        return str(value.dtype).removeprefix("torch."), tuple(value.shape)
    if kind == "ndarray":
        return value.dtype.str, tuple(value.shape)
    if kind == "pil":
        arr = pil_pixels(value)
        return arr.dtype.str, arr.shape
    if kind == "npscalar":
        return np.dtype(type(value)).str, ()
    return {"int": "<i8", "float": "<f8", "bool": "|b1", "complex": "<c16"}[kind], ()


def storage_dtype(kind: str, dtype_name: str) -> np.dtype:
    """The numpy dtype of the stored bytes for a leaf described by ``(kind, dtype_name)``."""
    if kind == "tensor":
        known = _TENSOR_STORAGE.get(dtype_name)
        return known if known is not None else _torch_storage_dtype(torch_dtype(dtype_name))
    if not isinstance(dtype_name, str) or not _DTYPE.match(dtype_name):
        raise CorruptCacheError(f"refusing array dtype {dtype_name!r} in cache metadata (only numbers, bools and "
                                "fixed-size strings are stored; objects are never loaded)")
    try:
        dt = np.dtype(dtype_name)
    except TypeError as e:
        raise CorruptCacheError(f"unsupported array dtype {dtype_name!r} in cache metadata") from e
    if dt.kind not in _NP_KINDS or dt.itemsize == 0:
        raise CorruptCacheError(f"refusing array dtype {dtype_name!r} in cache metadata (objects are never loaded)")
    return dt


def array_to_leaf(kind: str, dtype_name: str, arr: np.ndarray):
    """Turn stored bytes (as an array of the storage dtype) back into a leaf of ``kind``."""
    if kind == "tensor":
        import torch

        t = torch.from_numpy(arr)
        dtype = torch_dtype(dtype_name)
        return t if t.dtype == dtype else t.view(dtype)
    if kind == "ndarray":
        return arr
    if kind == "npscalar":
        return arr[()]
    return arr.item()


def batch_leaf_values(kind: str, dtype_name: str, col: np.ndarray, mode: str = "") -> list:
    """Per-sample leaf values from a gathered column of shape ``(n, *shape)`` (``mode``: of a PIL leaf)."""
    if kind == "pil":
        return [pil_from_pixels(mode, row) for row in col]
    if kind == "tensor":
        return list(array_to_leaf(kind, dtype_name, col).unbind())
    if kind == "ndarray" or kind == "npscalar":
        return list(col)
    return col.tolist()


# ---------------------------------------------------------------------------------------------
# free-form blobs: a JSON header, then raw payloads

_FREEFORM_MAGIC = b"NBKF"


def _leaf_header_and_payload(value, where: str, allow_pickle: bool, legacy: bool = False):
    kind = leaf_kind(value, where, allow_pickle)
    if kind == "pil" and legacy and allow_pickle:
        kind = "pickle"
    if kind in ("int", "float", "bool", "none"):
        return {"k": kind, "v": value}, b""  # Python's JSON keeps NaN and ±inf
    if kind == "complex":
        return {"k": "complex", "v": [value.real, value.imag]}, b""
    if kind == "str":
        data = value.encode("utf-8", "surrogatepass")
        return {"k": "str", "n": len(data)}, data
    if kind == "bytes":
        data = bytes(value)
        return {"k": "bytes", "n": len(data)}, data
    if kind == "pickle":
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return {"k": "pickle", "n": len(data)}, data
    if kind == "pil":
        data = pil_to_bytes(value)
        return {"k": "pil", "n": len(data)}, data
    arr = leaf_to_array(kind, value)
    dtype_name, shape = leaf_dtype_shape(kind, value)
    data = arr.tobytes()
    return {"k": kind, "d": dtype_name, "s": list(shape), "n": len(data)}, data


def encode_freeform(sample, *, allow_pickle: bool, where: str = "sample", legacy: bool = False) -> bytes:
    """A self-describing blob holding any supported sample.

    ``legacy=True`` encodes as nbkit did before it kept namedtuples and PIL images (a namedtuple as
    a tuple, a PIL image pickled where allowed): source fingerprints hash that, so caches built
    before still match their source.
    """
    leaves: list = []
    structure = flatten(sample, leaves, where, named=not legacy)
    headers, payloads = [], []
    for j, leaf in enumerate(leaves):
        h, p = _leaf_header_and_payload(leaf, f"{where} leaf {j}", allow_pickle, legacy)
        headers.append(h)
        payloads.append(p)
    header = json.dumps({"s": structure_to_json(structure), "l": headers}, separators=(",", ":")).encode()
    return b"".join([_FREEFORM_MAGIC, struct.pack("<I", len(header)), header, *payloads])


_SIZED = Int(min=0, max=1 << 48)
_ARRAY_HEADER = Obj({"k": Str(), "d": Str(max_len=32), "s": List(_DIM, max_len=MAX_NDIM), "n": _SIZED})
_BYTES_HEADER = Obj({"k": Str(), "n": _SIZED})
_FREEFORM_HEADER = Obj({"s": AnyJSON(), "l": List(Obj({"k": Str(max_len=16)}))})
_LEAF_HEADERS = {
    "int": Obj({"k": Str(), "v": Int(min=-(2**63), max=2**63 - 1)}),
    "bool": Obj({"k": Str(), "v": Bool()}),
    "none": Obj({"k": Str(), "v": AnyJSON()}),
    "float": Obj({"k": Str(), "v": AnyJSON()}),  # NaN and ±inf are kept: checked below
    "complex": Obj({"k": Str(), "v": List(AnyJSON(), max_len=2)}),
    **dict.fromkeys(("str", "bytes", "pickle", "pil"), _BYTES_HEADER),
    **dict.fromkeys(("tensor", "ndarray", "npscalar"), _ARRAY_HEADER),
}


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    damaged = "The stored sample is damaged."
    header = check_json(header, _FREEFORM_HEADER, f"{where} (its header)", damaged)
    structure = structure_from_json(header["s"], f"{where} (its header)", damaged)
    descs = header["l"]
    if len(descs) != count_leaves(structure):
        raise CorruptCacheError(f"{where}: stored sample header lists {len(descs)} values for a structure of "
                                f"{count_leaves(structure)}. {damaged}")
    pos = 8 + hlen
    leaves = []
    for j, h in enumerate(descs):
        k = h["k"]
        spec = _LEAF_HEADERS.get(k)
        if spec is None:
            raise CorruptCacheError(f"{where}: unknown leaf kind {k!r} (written by a newer nbkit?)")
        h = check_json(h, spec, f"{where} (its header, value {j})", damaged)
        if k in ("int", "bool", "none", "float", "complex"):
            v = h["v"]
            if (k == "none" and v is not None) or (k == "float" and not _number(v)) or (
                    k == "complex" and (len(v) != 2 or not all(map(_number, v)))):
                raise CorruptCacheError(f"{where}: stored {k} value {v!r} is malformed. {damaged}")
            leaves.append(float(v) if k == "float" else complex(*v) if k == "complex" else v)
            continue
        n = h["n"]
        if pos + n > len(mv):
            raise CorruptCacheError(f"{where}: stored sample is truncated")
        data = mv[pos : pos + n]
        pos += n
        if k == "str":
            leaves.append(_utf8(data, where))
        elif k == "bytes":
            leaves.append(bytes(data))
        elif k == "pickle":
            if not allow_pickle:
                raise pickle_refused(where)
            leaves.append(pickle.loads(data))
        elif k == "pil":
            leaves.append(pil_from_bytes(data, where))
        else:
            dt = storage_dtype(k, h["d"])
            shape = tuple(h["s"])
            if nbytes(shape, dt.itemsize) != n or (k == "npscalar" and shape):
                raise CorruptCacheError(f"{where}: stored array size does not match its shape")
            arr = np.frombuffer(data, dtype=dt).reshape(shape).copy()
            leaves.append(array_to_leaf(k, h["d"], arr))
    return unflatten(structure, iter(leaves), where)


def _utf8(data, where: str) -> str:
    try:
        return bytes(data).decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise CorruptCacheError(f"{where}: a stored string is not UTF-8 ({e}); the stored sample is damaged") from e


def pickle_refused(where: str) -> Exception:
    return PermissionError(
        f"{where} holds a pickled object; unpickling data from a cache can run arbitrary code. If you trust "
        "where this cache came from, open it with allow_pickle=True."
    )


# ---------------------------------------------------------------------------------------------
# schema


@dataclass(frozen=True)
class Leaf:
    kind: str  # tensor ndarray npscalar int float bool complex str bytes none pickle pil
    store: str  # col | var | const
    dtype: str = ""  # for array-like leaves (a PIL col leaf: its pixels' numpy dtype)
    shape: tuple = ()  # for col leaves
    column: int = -1  # column index for col leaves
    mode: str = ""  # a PIL col leaf's image mode

    def to_json(self):
        out = {"kind": self.kind, "store": self.store, "dtype": self.dtype, "shape": list(self.shape), "column": self.column}
        if self.mode:
            out["mode"] = self.mode
        return out

    @classmethod
    def from_json(cls, obj):
        """The leaf stored as ``obj`` (already checked against ``_LEAF_SPEC`` by :meth:`Schema.from_json`)."""
        return cls(obj["kind"], obj["store"], obj.get("dtype", ""), tuple(obj.get("shape", ())), obj.get("column", -1),
                   obj.get("mode", ""))


_SCALAR_DTYPES = {"int": "<i8", "float": "<f8", "bool": "|b1", "complex": "<c16"}
_COL_KINDS = ("tensor", "ndarray", "npscalar", "pil", *_SCALAR_DTYPES)
_VAR_KINDS = ("tensor", "ndarray", "str", "bytes", "pickle", "pil")
#: The largest row one column may have (a sample's fixed-shape field), in bytes.
MAX_ROW_BYTES = 1 << 40
_LEAF_SPEC = Obj({"kind": Str(choices=(*_COL_KINDS, *_VAR_KINDS, "none")), "store": Str(choices=("col", "var", "const")),
                  "dtype": Str(max_len=32), "shape": List(_DIM, max_len=MAX_NDIM), "column": Int(min=-1, max=4095),
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

    @property
    def has_var(self) -> bool:
        return bool(self.var_leaves)

    def column_dtype(self, leaf: Leaf) -> np.dtype:
        return storage_dtype(leaf.kind, leaf.dtype)

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
                return storage_dtype(leaf.kind, leaf.dtype).itemsize
            except CorruptCacheError as e:
                bad(f"{field}.dtype", f"names a dtype nbkit does not read ({e})")

        if len(leaves) != count_leaves(structure):
            bad("leaves", f"describes {len(leaves)} values, but the structure holds {count_leaves(structure)}")
        n_columns = 0
        for j, leaf in enumerate(leaves):
            field = f"leaves[{j}]"
            if (leaf.kind == "none") != (leaf.store == "const"):
                bad(field, f"is a {leaf.kind!r} value stored as {leaf.store!r} (None, and only None, is 'const')")
            if leaf.store == "const":
                continue
            if leaf.kind not in (_COL_KINDS if leaf.store == "col" else _VAR_KINDS):
                bad(field, f"stores a {leaf.kind!r} value as {leaf.store!r}, which nbkit never does")
            if leaf.store == "var":
                if leaf.kind in ("tensor", "ndarray"):
                    itemsize(field, leaf)
                continue
            if leaf.column != n_columns:
                bad(f"{field}.column", f"is {leaf.column}, but column leaves are numbered in order from 0 (expected {n_columns})")
            n_columns += 1
            if leaf.kind in _SCALAR_DTYPES and (leaf.dtype != _SCALAR_DTYPES[leaf.kind] or leaf.shape):
                bad(field, f"is a Python {leaf.kind} stored as {leaf.dtype!r} {list(leaf.shape)}, not {_SCALAR_DTYPES[leaf.kind]!r} []")
            if leaf.kind == "npscalar" and leaf.shape:
                bad(f"{field}.shape", f"is {list(leaf.shape)} for a numpy scalar (expected [])")
            if leaf.kind == "pil" and (leaf.mode not in PIL_MODES or len(leaf.shape) not in (2, 3)):
                bad(field, f"is a PIL image of mode {leaf.mode!r} and shape {list(leaf.shape)} (a known mode and 2 or 3 dimensions expected)")
            if nbytes(leaf.shape, itemsize(field, leaf)) > MAX_ROW_BYTES:
                bad(f"{field}.shape", f"makes rows of more than {MAX_ROW_BYTES} bytes")
        return cls(structure, leaves)

    # -- encoding conforming samples -------------------------------------------------------

    @cached_property
    def _plan(self):
        """A compiled splitter: ``(structure_check, leaf_handlers)``, built once per schema."""
        return _compile_structure(self.structure), [_leaf_handler(leaf) for leaf in self.leaves]

    def split(self, sample, where: str, allow_pickle: bool):
        """``(col_values, var_blob)`` for a sample that fits the schema, or ``None`` if it does not.

        ``col_values[k]`` is an array (or a Python scalar) for column ``k``; stack them with
        :meth:`stack`.
        """
        if self.structure is None:
            return None
        check, handlers = self._plan
        leaves: list = []
        if not check(sample, leaves):
            return None
        cols, var_parts = [], []
        for leaf, handler, value in zip(self.leaves, handlers, leaves):
            if leaf.store == "col":
                out = handler(value)
                if out is None:
                    return None
                cols.append(out)
                continue
            if leaf.store == "const":
                if value is not None:
                    return None
                continue
            kind = leaf_kind(value, where, allow_pickle)
            if kind != leaf.kind:
                return None
            if kind in ("tensor", "ndarray"):
                dtype_name, shape = leaf_dtype_shape(kind, value)
                if dtype_name != leaf.dtype:
                    return None
                arr = leaf_to_array(kind, value)
                var_parts.append(struct.pack(f"<I{len(shape)}q", len(shape), *shape) + arr.tobytes())
            elif kind == "pil":
                var_parts.append(pil_to_bytes(value))
            elif kind == "str":
                var_parts.append(value.encode("utf-8", "surrogatepass"))
            elif kind == "bytes":
                var_parts.append(bytes(value))
            else:  # pickle
                var_parts.append(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
        blob = b""
        if var_parts:
            blob = struct.pack(f"<I{len(var_parts)}Q", len(var_parts), *(len(p) for p in var_parts)) + b"".join(var_parts)
        return cols, blob

    def stack(self, k: int, values: list) -> np.ndarray:
        """Rows for column ``k`` from the ``col_values[k]`` of several samples."""
        leaf = self.columns[k]
        if leaf.kind in ("tensor", "ndarray", "npscalar", "pil"):
            return np.stack(values)
        return np.array(values, dtype=self.column_dtype(leaf))

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
        for leaf, length in zip(var_leaves, lengths):
            if pos + length > len(mv):
                raise CorruptCacheError(f"{where}: stored blob is truncated")
            data = mv[pos : pos + length]
            pos += length
            if leaf.kind in ("tensor", "ndarray"):
                try:
                    (ndim,) = struct.unpack_from("<I", data, 0)
                    if ndim > MAX_NDIM:
                        raise CorruptCacheError(f"{where}: a stored array claims {ndim} dimensions; the blob is damaged")
                    shape = struct.unpack_from(f"<{ndim}q", data, 4)
                except struct.error as e:
                    raise CorruptCacheError(f"{where}: stored array header is truncated") from e
                dt = storage_dtype(leaf.kind, leaf.dtype)
                raw = data[4 + 8 * ndim :]
                if min(shape, default=0) < 0 or nbytes(shape, dt.itemsize) != len(raw):
                    raise CorruptCacheError(f"{where}: stored array size does not match its shape")
                out.append(array_to_leaf(leaf.kind, leaf.dtype, np.frombuffer(raw, dtype=dt).reshape(shape).copy()))
            elif leaf.kind == "str":
                try:  # inline: the hot path of var fields
                    out.append(bytes(data).decode("utf-8", "surrogatepass"))
                except UnicodeDecodeError:
                    out.append(_utf8(data, where))  # raises, naming the sample
            elif leaf.kind == "bytes":
                out.append(bytes(data))
            elif leaf.kind == "pil":
                out.append(pil_from_bytes(data, where))
            elif leaf.kind == "pickle":
                if not allow_pickle:
                    raise pickle_refused(where)
                out.append(pickle.loads(data))
            else:
                raise CorruptCacheError(f"{where}: unexpected var leaf kind {leaf.kind!r}")
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
        kinds = [leaf_kind(v, f"probe sample {j}", allow_pickle) for v in leaves]
        flats.append((structure, leaves, kinds))
    structure, first_leaves, kinds = flats[0]
    if any(f[0] != structure or f[2] != kinds for f in flats[1:]):
        return Schema(None, ())
    out = []
    n_cols = 0
    for j, kind in enumerate(kinds):
        if kind == "none":
            out.append(Leaf(kind, "const"))
        elif kind in ("str", "bytes", "pickle"):
            out.append(Leaf(kind, "var"))
        elif kind == "pil":
            # One mode and size: a column of pixels; the mode lives in the schema. Palettes (P, PA)
            # differ per image, so those images, like mixed sizes or modes, go in the var blob.
            descs = {(f[1][j].mode, *leaf_dtype_shape(kind, f[1][j])) for f in flats}
            mode, dtype_name, shape = next(iter(descs))
            if len(descs) == 1 and mode not in PALETTE_MODES:
                out.append(Leaf(kind, "col", dtype_name, shape, n_cols, mode))
                n_cols += 1
            else:
                out.append(Leaf(kind, "var"))
        else:
            descs = {leaf_dtype_shape(kind, f[1][j]) for f in flats}
            dtypes = {d for d, _ in descs}
            if len(dtypes) != 1:
                return Schema(None, ())
            if len(descs) == 1:
                dtype_name, shape = descs.pop()
                out.append(Leaf(kind, "col", dtype_name, shape, n_cols))
                n_cols += 1
            elif kind in ("tensor", "ndarray"):
                out.append(Leaf(kind, "var", dtypes.pop()))
            else:
                return Schema(None, ())
    return Schema(structure, tuple(out))


def _compile_structure(structure):
    """A function ``check(sample, out) -> bool`` that appends the leaves of a sample with this structure."""
    if structure == "*":
        def leaf(s, out):
            out.append(s)
            return True
        return leaf
    tag = structure[0]
    if tag == "N":
        path, subs = structure[1], [_compile_structure(c) for c in structure[2]]
        n = len(subs)

        def named(s, out):
            if not is_namedtuple(s) or len(s) != n:
                return False
            cls = sample_type(s)
            if _class_path(cls) != path:
                return False
            return all(sub(x, out) for sub, x in zip(subs, s))
        return named
    if tag in ("T", "L"):
        typ = tuple if tag == "T" else list
        children = structure[1]
        n = len(children)
        if all(c == "*" for c in children):
            def flat(s, out):
                if not isinstance(s, typ) or len(s) != n:
                    return False
                out.extend(s)
                return True
            return flat
        subs = [_compile_structure(c) for c in children]

        def seq(s, out):
            if not isinstance(s, typ) or len(s) != n:
                return False
            return all(sub(x, out) for sub, x in zip(subs, s))
        return seq
    keys = structure[1]
    subs = [_compile_structure(c) for c in structure[2]]

    def mapping(s, out):
        if not isinstance(s, dict) or tuple(s) != keys:
            return False
        return all(sub(s[k], out) for sub, k in zip(subs, keys))
    return mapping


def _leaf_handler(leaf: Leaf):
    """For a col leaf: ``value -> array or scalar`` if it matches the leaf exactly, else ``None``."""
    if leaf.store != "col":
        return None
    kind = leaf.kind
    if kind == "tensor":
        import torch

        tdtype = torch_dtype(leaf.dtype)
        shape = torch.Size(leaf.shape)
        plain = _numpy_twin(tdtype) is not None

        def tensor(v):
            if not isinstance(v, torch.Tensor) or v.dtype != tdtype or v.shape != shape:
                return None
            if plain and not v.requires_grad and v.device.type == "cpu" and v.layout == torch.strided \
                    and v.is_contiguous() and not v.is_conj() and not v.is_neg():
                return v.numpy()
            return leaf_to_array("tensor", v)
        return tensor
    if kind == "ndarray":
        dtype, shape = np.dtype(leaf.dtype), leaf.shape

        def ndarray(v):
            if not isinstance(v, np.ndarray) or v.dtype != dtype or v.shape != shape:
                return None
            return v
        return ndarray
    if kind == "pil":
        mode, dtype, shape = leaf.mode, np.dtype(leaf.dtype), leaf.shape
        size = (shape[1], shape[0])

        def pil(v):
            if not is_pil_image(v) or v.mode != mode or v.size != size:
                return None
            arr = pil_pixels(v)
            return arr if arr.dtype == dtype and arr.shape == shape else None
        return pil
    if kind == "npscalar":
        dtype = np.dtype(leaf.dtype)

        def npscalar(v):
            if not isinstance(v, np.generic) or v.dtype != dtype:
                return None
            return v
        return npscalar
    pytype = {"int": int, "float": float, "bool": bool, "complex": complex}[kind]

    def scalar(v):
        if type(v) is not pytype:
            if kind == "int" and isinstance(v, int) and not isinstance(v, bool):
                return int(v)
            return None
        if kind == "int" and not -(2**63) <= v < 2**63:
            return None
        return v
    return scalar
