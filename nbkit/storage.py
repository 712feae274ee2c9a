"""Deprecated alias of :mod:`nbkit.stores` (``resolve``, ``Location``, ``working_copy_dir``, the publish lease), kept for one release.

Names are forwarded lazily, with a ``DeprecationWarning`` naming the new module.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from nbkit.storage import resolve
    >>> resolve("/tmp/my-cache").root
    '/tmp/my-cache'
"""

_MOVED = {
    "resolve": "nbkit.stores.registry",
    "Location": "nbkit.stores.base",
    "MirrorLocation": "nbkit.stores.mirror",
    "working_copy_dir": "nbkit.stores.mirror",
    "LEASE": "nbkit.stores.mirror",
    "LEASE_SECONDS": "nbkit.stores.mirror",
}


def __getattr__(name):
    import importlib
    import warnings

    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"nbkit.storage is deprecated: use {_MOVED[name]}.{name}", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)

