"""Deprecated alias of :mod:`nbkit.stores.redis`, kept for one release.

Names are forwarded lazily, with a ``DeprecationWarning`` naming the new module.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from nbkit.redis_store import parse_url
    >>> parse_url("redis://h:1/0/x").servers
    [('h', 1)]
"""

_TARGET = "nbkit.stores.redis"


def __getattr__(name):
    import importlib
    import warnings

    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_TARGET)
    if name not in module.__all__ and name != "meta_tag":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"nbkit.redis_store is deprecated: use {_TARGET}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(module, name)
