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

from .extras import moved

_NAMES = ("RedisLocation", "RedisStore", "RedisURL", "parse_url", "resolve", "resolve_redis", "meta_tag",
          "FULL_RETRY_SECONDS", "PUT_BYTES")
__getattr__ = moved(__name__, dict.fromkeys(_NAMES, "nbkit.stores.redis"))
