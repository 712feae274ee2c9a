"""Where a cache lives: a local directory, or a remote URL served from a local working copy.

The engine memory-maps files, so a remote cache (``gs://bucket/prefix``, ``memory://…``, any
non-local fsspec URL) is used through a local *working copy*, kept in
``$NBKIT_CACHE_DIR/<name>-<hash of the URL>`` (default ``~/.cache/nbkit``):

* :meth:`Location.prepare` (before the engine opens the cache) pulls the remote cache when it is
  complete (``nbkit.json`` published) and the working copy is missing or holds fewer samples. A
  host that finds a finished cache in the bucket therefore downloads it instead of warming, and
  then reads epochs as fast as from any local cache.
* :meth:`Location.publish` (after ``warmup()`` and on ``ds.sync()``) pushes the working copy, but
  only once every sample is stored: a bucket prefix only ever receives complete caches. It skips
  the push when the remote already holds a complete cache with the same metadata ("first complete
  cache wins"), and while another host holds the publish lease (``.nbkit-publish-lease``, an
  exclusively created object that expires after :data:`LEASE_SECONDS`).

Several hosts can share one prefix: each warms or pulls into its own working copy; only complete
caches are published, each published by one pusher at a time, ``nbkit.json`` last; every pull
checks every hash. Several processes on one host share the working copy under a file lock.
To carry a partial cache, call :func:`nbkit.push` explicitly.

Example:
    >>> from nbkit.storage import resolve
    >>> loc = resolve("/tmp/my-cache")
    >>> loc.root, loc.is_remote
    ('/tmp/my-cache', False)
    >>> resolve("memory://bucket/cache").is_remote
    True
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import time
import uuid
from dataclasses import dataclass, field

from . import format as fmt
from .errors import CorruptCacheError

__all__ = ["Location", "resolve", "working_copy_dir", "LEASE", "LEASE_SECONDS"]

#: The object a host creates under a remote prefix while it publishes there.
LEASE = ".nbkit-publish-lease"
#: A lease older than this (seconds) is taken as abandoned.
LEASE_SECONDS = 15 * 60
_LOCAL_PROTOCOLS = (None, "file", "local")


@dataclass
class Location:
    """A resolved cache location.

    Attributes:
        url: the path or URL as given.
        root: the local directory the engine reads and writes.
        is_remote: ``True`` when ``root`` is a working copy of ``url``.
        storage_options: passed to fsspec for ``url``.

    Example:
        >>> import tempfile
        >>> loc = resolve(tempfile.mkdtemp())
        >>> loc.read_meta() is None, loc.prepare(), loc.publish()
        (True, False, False)
    """

    url: str
    root: str
    is_remote: bool = False
    storage_options: dict = field(default_factory=dict)

    # -- the engine's hooks: where metadata and samples live ------------------------------------
    # A backend that keeps samples elsewhere (a Redis server, a bucket read through) subclasses
    # Location and overrides these four; the engine calls nothing else.

    def read_meta(self) -> dict | None:
        """The cache metadata, or ``None`` when no cache exists here yet."""
        if not os.path.exists(os.path.join(self.root, fmt.META)):
            return None
        return fmt.read_meta(self.root)

    def not_found(self) -> Exception:
        """The error for opening a cache that does not exist here (naming how to make one)."""
        try:
            fmt.read_meta(self.root)
        except FileNotFoundError as e:
            return e
        return FileNotFoundError(f"no nbkit cache at {self.url}")

    def publish_meta(self, meta: dict) -> dict:
        """Create the store's files for ``meta``, then publish ``meta`` once; return whichever metadata won."""
        os.makedirs(self.root, exist_ok=True)
        fmt.CacheFiles(self.root, meta, writable=True).close()  # sized before anyone sees the metadata
        return fmt.publish_meta(self.root, meta)

    def open_store(self, meta: dict, *, writable: bool):
        """The sample store (see ``docs/DESIGN.md``, "Store protocol") for this process."""
        return fmt.CacheFiles(self.root, meta, writable=writable)

    def remove(self) -> None:
        """Delete the cache here (metadata first), for ``overwrite=True``."""
        fmt.remove_cache(self.root)

    def prepare(self, callback=None) -> bool:
        """Pull the remote cache into the working copy if that is missing or older; return whether it pulled.

        A no-op for local paths and for a remote URL with no complete cache yet.
        """
        if not self.is_remote:
            return False
        from .transfer import _fs, network_errors, pull, trusted_remote_manifest

        fs, rroot = _fs(self.url, self.storage_options)
        fix = "open the cache again: a complete remote cache is pulled, otherwise warming starts from the working copy"
        with _file_lock(self.root + ".lock"), network_errors(fs, self.url, "looking for a cache at", fix):
            fs.invalidate_cache()
            if not fs.exists(f"{rroot}/{fmt.META}"):
                return False
            remote_stored = int((trusted_remote_manifest(fs, rroot) or {}).get("stored", 0))
            local_stored = _local_stored(self.root)
            if local_stored is not None and local_stored >= remote_stored:
                return False
            pull(self.url, self.root, callback=callback, storage_options=self.storage_options)
            return True

    def publish(self, callback=None) -> bool:
        """Push the working copy to the URL if it is complete; return whether it pushed.

        A no-op for local paths. Skipped (returns ``False``) while samples are missing, when the remote
        already holds this complete cache, or while another host holds the publish lease.
        """
        if not self.is_remote:
            return False
        from .transfer import _fs, network_errors, stored_count

        with _file_lock(self.root + ".lock"):
            if not os.path.exists(os.path.join(self.root, fmt.META)):
                return False
            stored, length = stored_count(self.root)
            if stored < length:
                return False
            fs, rroot = _fs(self.url, self.storage_options)
            fix = f"call sync() on the dataset again, or nbkit.push({self.root!r}, {self.url!r}): it resumes"
            with network_errors(fs, self.url, "publishing to", fix):
                return self._publish(fs, rroot, length, callback)

    def _publish(self, fs, rroot: str, length: int, callback) -> bool:
        from .transfer import push, sha256_file, trusted_remote_manifest

        fs.invalidate_cache()
        remote = trusted_remote_manifest(fs, rroot)
        if (remote is not None and fs.exists(f"{rroot}/{fmt.META}") and int(remote.get("stored", -1)) >= length
                and remote["files"].get(fmt.META, {}).get("sha256") == sha256_file(os.path.join(self.root, fmt.META))):
            return False  # the remote already holds this cache, complete
        with _lease(fs, rroot) as held:
            if not held:
                return False
            push(self.root, self.url, callback=callback, storage_options=self.storage_options)
            return True


def working_copy_dir(url: str, storage_options: dict | None = None) -> str:
    """Where the working copy of the remote cache at ``url`` lives.

    ``$NBKIT_CACHE_DIR`` (default ``~/.cache/nbkit``), then the last part of the URL and a hash of
    the URL (and of the endpoint, when ``storage_options`` names one).

    Example:
        >>> os.path.basename(working_copy_dir("gs://bucket/mnist/"))[:6]
        'mnist-'
    """
    base = os.environ.get("NBKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nbkit")
    normalized = url.rstrip("/")
    endpoint = (storage_options or {}).get("endpoint_url") or ""
    digest = hashlib.sha256(f"{normalized}\n{endpoint}".encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", normalized.rsplit("/", 1)[-1].split("://")[-1]) or "cache"
    return os.path.join(os.path.abspath(base), f"{name}-{digest}")


def resolve(path, storage_options: dict | None = None, **location_options) -> Location:
    """Turn a local path or fsspec URL into a :class:`Location`; no network access.

    Example:
        >>> loc = resolve("gs://bucket/cache", {"token": "anon"})
        >>> loc.is_remote, loc.root == working_copy_dir("gs://bucket/cache", {"token": "anon"})
        (True, True)
    """
    from fsspec.core import split_protocol, strip_protocol

    url = os.fspath(path)
    protocol, _ = split_protocol(url)
    if protocol in ("redis", "rediss"):
        from .redis_store import resolve_redis  # samples live in Redis servers, not in files

        return resolve_redis(url, storage_options, **location_options)
    if location_options.get("local_max_bytes") is not None:
        if protocol in _LOCAL_PROTOCOLS:
            raise ValueError(f"local_max_bytes only applies to a remote cache (gs://…), not to the local path {url}")
        from .readthrough import resolve_read_through  # pieces fetched on demand into a bounded local area

        return resolve_read_through(url, storage_options, **location_options)
    if protocol in _LOCAL_PROTOCOLS:
        local = strip_protocol(url) if protocol else url
        return Location(url=url, root=os.path.abspath(os.path.expanduser(local)), is_remote=False,
                        storage_options=dict(storage_options or {}))
    return Location(url=url, root=working_copy_dir(url, storage_options), is_remote=True,
                    storage_options=dict(storage_options or {}))


def _local_stored(root: str) -> int | None:
    """Samples stored in the working copy, or ``None`` if it is missing or unreadable."""
    from .transfer import stored_count

    if not os.path.exists(os.path.join(root, fmt.META)):
        return None
    try:
        return stored_count(root)[0]
    except (CorruptCacheError, OSError, ValueError):
        return None


@contextlib.contextmanager
def _file_lock(path: str):
    """Serialise prepare/publish of one working copy across the processes of this host."""
    import fcntl

    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # blocks while another process pulls or pushes
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _lease(fs, rroot: str):
    """Hold the publish lease of a remote prefix; yields whether we hold it.

    Created exclusively (``"xb"``: ``ifGenerationMatch=0`` on GCS) and read back, so where the
    backend enforces exclusive creation one host publishes at a time, and elsewhere the window is
    a single round trip; a lease older than :data:`LEASE_SECONDS` is taken as abandoned.
    """
    path = f"{rroot}/{LEASE}"
    token = uuid.uuid4().hex
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time(), "token": token}).encode()
    held = False
    for _ in range(2):
        # Look first: not every backend enforces exclusive creation (the GCS emulator does not).
        try:
            age = time.time() - float(json.loads(fs.cat_file(path))["time"])
        except FileNotFoundError:
            age = None
        except (ValueError, KeyError, TypeError):
            age = LEASE_SECONDS  # unreadable: treat as abandoned
        if age is not None:
            if age < LEASE_SECONDS:
                break
            fs.rm_file(path)
        try:
            with fs.open(path, "xb") as f:
                f.write(body)
        except FileExistsError:
            continue  # another host created it just now: look again
        try:
            held = json.loads(fs.cat_file(path)).get("token") == token
        except (FileNotFoundError, ValueError):
            held = False
        break
    try:
        yield held
    finally:
        if held:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)
