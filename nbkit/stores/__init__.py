"""Where caches live: the store backends and the registry that picks one for a path or URL.

:mod:`.registry` maps a URL scheme (or a location option) to a backend; :mod:`.base` declares the
contracts every backend implements (``Location``: where a cache lives; ``Store``: its samples);
:mod:`.local` (a directory), :mod:`.mirror` (a remote URL through a local working copy),
:mod:`.redis` (Redis servers) and :mod:`.readthrough` (a bucket read through a bounded local area)
are the backends. Backends are imported on first use.

Example:
    >>> from nbkit.stores import resolve
    >>> resolve("/tmp/my-cache").is_remote
    False
"""

from __future__ import annotations

from ..extras import lazy_names

__all__ = ["resolve"]

# Imports nothing up front: cachedir (below the backends) imports .base, which runs this file first.
__getattr__, __dir__ = lazy_names(__name__, {"resolve": "registry"})
