"""Where a cache lives: URL resolution and local working copies of remote caches.

(Minimal local-only version; remote support follows.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Location", "resolve"]


@dataclass
class Location:
    """A resolved cache location."""

    url: str
    root: str
    is_remote: bool = False
    storage_options: dict | None = None

    def prepare(self, callback=None) -> None:
        """Before the engine opens files: nothing to do for a local path."""

    def publish(self, callback=None) -> None:
        """After warmup / ``sync()``: nothing to do for a local path."""


def resolve(path, storage_options=None) -> Location:
    """Resolve ``path`` (a local path for now) to a :class:`Location`."""
    url = os.fspath(path)
    return Location(url=url, root=os.path.abspath(os.path.expanduser(url)), is_remote=False,
                    storage_options=storage_options)
