"""Which store serves a path: a URL scheme (or a location option) names a ``"module:factory"``, imported on first use.

A local path (no scheme, ``file://``) is a directory; ``redis://`` / ``rediss://`` are Redis servers;
``local_max_bytes=`` reads a remote cache through a bounded local area; any other fsspec URL is
used through a local working copy (the mirror). A backend whose package is missing fails with the
extra and the ``pip install`` that brings it. Register another with :func:`register`.

Example:
    >>> loc = resolve("/tmp/my-cache")
    >>> loc.root, loc.is_remote
    ('/tmp/my-cache', False)
    >>> backend_of("redis://h/0/x"), backend_of("gs://b/c", local_max_bytes=1)
    ('nbkit.stores.redis:resolve', 'nbkit.stores.readthrough:resolve')
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass

from ..extras import require
from ..trust import check_url

__all__ = ["Backend", "register", "backend_of", "resolve", "known_schemes", "check_cache_url", "SCHEMES", "OPTIONS", "LOCAL", "REMOTE"]


@dataclass(frozen=True)
class Backend:
    """A store backend: ``target`` is ``"module:factory"``; ``needs`` is ``(module, pip extra)`` or ``None``."""

    target: str
    needs: tuple | None = None


LOCAL = Backend("nbkit.stores.local:resolve")
REMOTE = Backend("nbkit.stores.mirror:resolve")
#: scheme -> backend (checked first)
SCHEMES: dict = {
    "redis": Backend("nbkit.stores.redis:resolve", ("redis", "redis")),
    "rediss": Backend("nbkit.stores.redis:resolve", ("redis", "redis")),
}
#: location option -> backend (for remote URLs without a scheme of their own above)
OPTIONS: dict = {
    "local_max_bytes": Backend("nbkit.stores.readthrough:resolve"),
}
#: fsspec schemes whose implementation is an optional package: (module, pip extra)
REMOTE_NEEDS = {"gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
_LOCAL_PROTOCOLS = (None, "file", "local")


def register(scheme: str, target: str, needs: tuple | None = None) -> None:
    """Serve URLs ``<scheme>://…`` with the factory ``target`` (``"package.module:function"``)."""
    SCHEMES[scheme] = Backend(target, needs)


def _pick(url: str, location_options: dict) -> tuple:
    from fsspec.core import split_protocol

    protocol, _ = split_protocol(url)
    if protocol in SCHEMES:
        return protocol, SCHEMES[protocol]
    if protocol in _LOCAL_PROTOCOLS:
        return protocol, LOCAL
    for option, backend in OPTIONS.items():
        if location_options.get(option) is not None:
            return protocol, backend
    return protocol, Backend(REMOTE.target, REMOTE_NEEDS.get(protocol))


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):  # sys.modules[module] is None, or a broken half-import
        return True


def backend_of(path, **location_options) -> str:
    """The ``"module:factory"`` that serves ``path`` with these options."""
    return _pick(os.fspath(path), location_options)[1].target


def known_schemes() -> set:
    """The URL schemes a cache path may have: fsspec's protocols and the ones registered here."""
    from fsspec.registry import known_implementations, registry

    return set(known_implementations) | set(registry) | set(SCHEMES) | {"file", "local"}


def check_cache_url(path, name: str = "path") -> str:
    """``path`` as a ``str``, refusing a wrong type and URL typos (``gs:/bucket``, an unknown scheme)
    that would otherwise silently become a local directory (see :func:`nbkit.trust.check_url`)."""
    return check_url(path, name, known_schemes())


def resolve(path, storage_options: dict | None = None, **location_options):
    """Turn a local path or URL into a :class:`~nbkit.stores.base.Location`; no network access.

    Raises:
        ImportError: the backend's package is missing (the message names the pip extra).
        ValueError: an option that does not apply to this kind of location, or a URL with a typo
            (``gs:/bucket``, an unknown scheme).
        TypeError: ``path`` is not a str or path-like (``bytes`` included).
    """
    url = check_cache_url(path)
    protocol, backend = _pick(url, location_options)
    if backend.needs is not None:
        module, extra = backend.needs
        if _missing(module):  # checked without importing it: resolving touches neither packages nor the network
            require(module, extra=extra, feature=f"{protocol}:// caches")
    module, _, factory = backend.target.partition(":")
    return getattr(importlib.import_module(module), factory)(url, storage_options, **location_options)
