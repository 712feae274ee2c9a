"""Deprecated alias of :mod:`nbkit.stores.readthrough` and :mod:`nbkit.samplers` (``PrefetchSampler``), kept for one release.

Names are forwarded lazily, with a ``DeprecationWarning`` naming the new module.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from nbkit.readthrough import PrefetchSampler
    >>> PrefetchSampler.__module__
    'nbkit.samplers'
"""

from .extras import moved

_MOVED = {
    "PrefetchSampler": "nbkit.samplers",
    "plan_windows": "nbkit.samplers",
    "ReadThroughLocation": "nbkit.stores.readthrough",
    "ReadThroughStore": "nbkit.stores.readthrough",
    "Geometry": "nbkit.stores.readthrough",
    "resolve_read_through": "nbkit.stores.readthrough",
    "store_of": "nbkit.stores.readthrough",
    "area_usage": "nbkit.stores.readthrough",
    "PIECE_MAX": "nbkit.stores.readthrough.geometry",
    "MIN_PIECES": "nbkit.stores.readthrough.geometry",
    "BLOCK": "nbkit.stores.readthrough.geometry",
    "WAIT_SECONDS": "nbkit.stores.readthrough.area",
}


__getattr__ = moved(__name__, _MOVED)
