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

from .extras import moved

_MOVED = {
    "resolve": "nbkit.stores.registry",
    "Location": "nbkit.stores.base",
    "MirrorLocation": "nbkit.stores.mirror",
    "working_copy_dir": "nbkit.stores.mirror",
    "LEASE": "nbkit.stores.mirror",
    "LEASE_SECONDS": "nbkit.stores.mirror",
}


__getattr__ = moved(__name__, _MOVED)
