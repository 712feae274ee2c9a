"""A sample's structure: the nesting of tuples, namedtuples, lists and dicts around its leaves.

:func:`flatten` splits a sample into a *structure* (hashable, JSON-able) and a list of leaves;
:func:`unflatten` puts them back. A namedtuple keeps its type: the structure names the class
(``"module:qualname"``) and its field names. Reading **never imports** anything: the class comes back
when its module is already imported in the reading process, or it was registered
(:func:`register_namedtuple`); otherwise an equivalent ``collections.namedtuple`` of the stored field
names does, with one warning saying how to get the class back.

Example:
    >>> leaves = []
    >>> structure = flatten((1, {"a": "x"}), leaves)
    >>> structure, leaves
    (('T', ('*', ('D', ('a',), ('*',)))), [1, 'x'])
    >>> unflatten(structure, iter(leaves))
    (1, {'a': 'x'})
"""

from __future__ import annotations

import collections
import keyword
import sys
import types
import warnings

from ..errors import CorruptCacheError
from ..trust import shown


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


def class_path(cls: type) -> str:
    """The ``"module:qualname"`` a namedtuple class is stored under."""
    path = getattr(cls, "_nbkit_path", None)  # an equivalent namedtuple nbkit built stands for its original
    if path is not None:
        return path
    return _REGISTERED_NAME.get(cls) or f"{cls.__module__}:{cls.__qualname__}"


def named_path(cls: type, where: str) -> str:
    """``"module:qualname"`` of a namedtuple class that a reader can find again, else ``TypeError``."""
    path = class_path(cls)
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
    cls.__module__ = "nbkit.codec"
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



def compile_structure(structure):
    """A function ``check(sample, out) -> bool`` that appends the leaves of a sample with this structure."""
    if structure == "*":
        def leaf(s, out):
            out.append(s)
            return True
        return leaf
    tag = structure[0]
    if tag == "N":
        path, subs = structure[1], [compile_structure(c) for c in structure[2]]
        n = len(subs)

        def named(s, out):
            if not is_namedtuple(s) or len(s) != n:
                return False
            cls = sample_type(s)
            if class_path(cls) != path:
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
        subs = [compile_structure(c) for c in children]

        def seq(s, out):
            if not isinstance(s, typ) or len(s) != n:
                return False
            return all(sub(x, out) for sub, x in zip(subs, s))
        return seq
    keys = structure[1]
    subs = [compile_structure(c) for c in structure[2]]

    def mapping(s, out):
        if not isinstance(s, dict) or tuple(s) != keys:
            return False
        return all(sub(s[k], out) for sub, k in zip(subs, keys))
    return mapping
