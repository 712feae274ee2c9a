"""A cache in a local directory (a plain path or a ``file://`` URL): the base :class:`Location` itself.

Example:
    >>> resolve("/tmp/my-cache").root, resolve("file:///tmp/my-cache").is_remote
    ('/tmp/my-cache', False)
"""

from __future__ import annotations

import os

from .base import Location

__all__ = ["resolve"]


def resolve(url: str, storage_options: dict | None = None, **location_options) -> Location:
    """The :class:`Location` of a local directory; ``local_max_bytes`` does not apply to one."""
    from fsspec.core import split_protocol, strip_protocol

    if location_options.get("local_max_bytes") is not None:
        raise ValueError(f"local_max_bytes only applies to a remote cache (gs://…), not to the local path {url}")
    unknown = set(location_options) - {"local_max_bytes"}
    if unknown:
        raise TypeError(f"unexpected options for a local cache: {sorted(unknown)}")
    protocol, _ = split_protocol(url)
    local = strip_protocol(url) if protocol else url
    return Location(url=url, root=os.path.abspath(os.path.expanduser(local)), is_remote=False,
                    storage_options=dict(storage_options or {}))
