"""Remote storage through fsspec: a URL resolved once, and failures to reach its endpoint named clearly.

:func:`url_to_fs` is ``fsspec.core.url_to_fs`` with the root's trailing ``/`` removed. Before a
long operation, :func:`network_errors` opens one TCP connection to the endpoint (an unreachable one
then fails at once, not after gcsfs's ~30 s of retries) and turns connection failures inside the
block into one ``OSError`` naming the URL, the endpoint and the fix. :func:`abandon` drops a file
being written without committing it (a failed upload never publishes a truncated object).

Example:
    >>> fs, root = url_to_fs("memory://doctest/remote/")
    >>> root, endpoint_of(fs), is_local(fs)
    ('/doctest/remote', None, False)
    >>> with network_errors(fs, "memory://doctest/remote", "reading", "rerun"):
    ...     write_bytes(fs, root + "/a", b"x")
    >>> remote_sizes(fs, root)
    {'a': 1}
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from urllib.parse import urlsplit

__all__ = ["url_to_fs", "is_local", "endpoint_of", "connection_errors", "is_connection_error", "unreachable",
           "check_reachable", "network_errors", "remote_sizes", "write_bytes", "abandon", "BLOCK", "PROBE_SECONDS"]

# Bytes in flight per upload. 32 MiB is a multiple of GCS's 256 KiB resumable-upload granularity
# and measured fastest against the emulator.
BLOCK = 32 << 20
# A TCP connect to the endpoint before the first request: an unreachable endpoint then fails at
# once rather than after gcsfs's retries (6 tries, ~30 s, per request).
PROBE_SECONDS = 10.0


def url_to_fs(url: str, storage_options: dict | None = None):
    """``(fs, root)`` of ``url``: the fsspec filesystem and the path in it (no trailing ``/``)."""
    from fsspec.core import url_to_fs as _url_to_fs

    fs, path = _url_to_fs(url, **(storage_options or {}))
    return fs, path.rstrip("/")


def is_local(fs) -> bool:
    """Whether ``fs`` is the local filesystem (directories must be created; renames are atomic)."""
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def endpoint_of(fs) -> str | None:
    """The HTTP(S) endpoint an object-store filesystem talks to, or ``None`` (local, memory …)."""
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if "gs" in protocols:
        base = getattr(fs, "base", None)  # gcsfs: "<endpoint>/storage/v1/"; honours endpoint_url and STORAGE_EMULATOR_HOST
        return base.split("/storage/v1", 1)[0] if base else None
    return getattr(fs, "endpoint_url", None)  # s3fs and others that take endpoint_url


def connection_errors() -> tuple:
    """Exception types that mean "the endpoint could not be reached or dropped the connection"."""
    types = [ConnectionError, socket.gaierror, TimeoutError]
    # Only look at HTTP stacks that are already loaded: if they are not, they raised nothing.
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types.append(aiohttp.ClientConnectionError)  # connect refused, server disconnected, timeouts
    requests = sys.modules.get("requests")
    if requests is not None:
        types.append(requests.exceptions.ConnectionError)
    return tuple(types)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failure to reach the storage endpoint (rather than, say, a missing file)."""
    return isinstance(exc, connection_errors())


def unreachable(url: str, endpoint: str | None, exc: BaseException, doing: str, fix: str) -> OSError:
    """The ``OSError`` for a failure to reach ``endpoint`` while ``doing`` ``url``; ``fix`` says what to do then."""
    where = f"the endpoint {endpoint}" if endpoint else "the storage backend"
    return OSError(
        f"could not reach {where} while {doing} {url} ({type(exc).__name__}: {exc}). Check the URL, the endpoint "
        f"(storage_options['endpoint_url'] or STORAGE_EMULATOR_HOST), the network and the credentials, then {fix}."
    )


def check_reachable(fs, url: str, doing: str, fix: str) -> None:
    """Open (and close) one TCP connection to the endpoint; raise the clear ``OSError`` if that fails."""
    endpoint = endpoint_of(fs)
    if not endpoint or any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return  # nothing to probe, or the HTTP stack may reach it through a proxy we cannot see
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=PROBE_SECONDS).close()
    except OSError as e:
        raise unreachable(url, endpoint, e, doing, fix) from e


@contextlib.contextmanager
def network_errors(fs, url: str, doing: str, fix: str):
    """Check that the endpoint answers, then turn connection failures inside the block into the clear ``OSError``."""
    check_reachable(fs, url, doing, fix)
    try:
        yield
    except connection_errors() as e:
        raise unreachable(url, endpoint_of(fs), e, doing, fix) from e


def remote_sizes(fs, root: str) -> dict:
    """``name -> size`` of the files directly under ``root`` (``{}`` if it does not exist)."""
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries if e.get("type") != "directory"}


def write_bytes(fs, path: str, data: bytes) -> None:
    """Write one small object (an object store makes it visible only once whole)."""
    with fs.open(path, "wb") as f:
        f.write(data)


def abandon(f, *, tell_backend: bool) -> None:
    """Drop a file being written without committing it.

    fsspec files commit what they hold on ``close()`` (also from ``__del__``), so a failed or
    stopped upload must never be closed normally: that would publish a truncated object.
    ``discard()`` cancels it at the backend (the resumable upload session on GCS); when the backend
    is unreachable that would only wait through the same retries, so the file is just marked closed.
    """
    from fsspec.spec import AbstractBufferedFile

    if tell_backend:
        try:
            f.discard()
        except Exception:  # noqa: BLE001 - best effort: a failed cancel leaves an upload session that expires on its own
            pass
    if isinstance(f, AbstractBufferedFile):
        f.closed = True
    elif not getattr(f, "closed", True):
        # Local and memory files: the partial file is not in the manifest, so it is never trusted.
        f.close()
