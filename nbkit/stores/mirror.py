"""A remote cache (``gs://…``, ``memory://…``, any non-local fsspec URL) used through a local working copy.

The engine memory-maps files, so the cache is read and written in a working copy under
``$NBKIT_CACHE_DIR/<name>-<hash of the URL>`` (default ``~/.cache/nbkit``): ``prepare()`` pulls
the remote cache when it is complete and holds more samples than the copy; ``publish()`` (after
``warmup()``, on ``ds.sync()``, and when training's reads store the last sample) pushes the copy
once every sample is stored, unless the remote already holds it or another host holds the publish
lease. See ``docs/DESIGN.md`` ("Stores").

Example:
    >>> loc = resolve("memory://bucket/cache")
    >>> loc.is_remote, loc.root == working_copy_dir("memory://bucket/cache")
    (True, True)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import stat
import time
import urllib.parse
import uuid
from dataclasses import dataclass

from .. import format as fmt
from .. import trust
from ..cachedir import stored_count
from ..errors import CorruptCacheError
from ..commit import Dir, file_lock
from ..transfer.manifest import LEASE, sha256_file, trusted_remote_manifest
from ..transfer.remote import connect, remote_errors
from ..text import fix
from ..transfer.sync import pull, push
from .local import LocalLocation

__all__ = ["MirrorLocation", "resolve", "working_copy_dir", "cache_dir", "read_origin", "ORIGIN_SUFFIX", "lease", "LEASE",
           "LEASE_SECONDS"]

# LEASE (from nbkit.transfer.manifest): the object a host creates under a remote prefix while it publishes
# there; the one object besides a cache's files that a pull accepts under the prefix.
#: A lease older than this (seconds) is taken as abandoned.
LEASE_SECONDS = 15 * 60


#: Beside each working copy ``<dir>``, the file ``<dir>.origin.json`` names the URL it mirrors; it is
#: rewritten each time a dataset opens the copy, so its time is when the copy was last opened.
ORIGIN_SUFFIX = ".origin.json"
_ORIGIN_FORMAT = "nbkit-working-copy"
_ORIGIN_SPEC = trust.Obj({"url": trust.Str(max_len=4096), "endpoint": trust.Optional(trust.Str(max_len=4096))},
                         required=("url",))


def cache_dir() -> str:
    """Where working copies live: ``$NBKIT_CACHE_DIR``, default ``~/.cache/nbkit`` (absolute).

    Example:
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR="/tmp/wc"):
        ...     cache_dir()
        '/tmp/wc'
    """
    base = os.environ.get("NBKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "nbkit")
    return os.path.abspath(base)


def without_secrets(url: str) -> str:
    """``url`` without what may be a credential: a ``user:password@`` part, a query, a fragment.

    Example:
        >>> without_secrets("https://me:s3cret@host:8080/b/c?sig=abc#x")
        'https://host:8080/b/c'
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))


def _record_origin(root: str, url: str, storage_options: dict) -> None:
    # The origin file is read by nbkit.caches() and shown to whoever lists the machine's caches:
    # it keeps where the copy comes from, never a credential that came with the URL.
    endpoint = storage_options.get("endpoint_url")
    body = {"format": _ORIGIN_FORMAT, "url": without_secrets(url),
            "endpoint": without_secrets(endpoint) if isinstance(endpoint, str) else None}
    parent, name = os.path.split(root + ORIGIN_SUFFIX)
    os.makedirs(parent, exist_ok=True)
    with Dir(parent) as d:
        st = d.lstat(name)
        if st is not None and not stat.S_ISREG(st.st_mode):
            d.remove_tree(name)  # not a file nbkit wrote (a directory, a link): ours to replace, never followed
        d.write(name, json.dumps(body).encode())


def read_origin(root: str) -> dict:
    """``{"url": ..., "endpoint": ...}`` of the working copy at ``root`` (its ``.origin.json``).

    Raises:
        FileNotFoundError: no origin file (a copy made before nbkit recorded one).
        CorruptCacheError: a file that is not one nbkit wrote.
    """
    path = root + ORIGIN_SUFFIX
    fix = "Delete it: nbkit writes it again the next time the working copy is opened."
    value = trust.load_json(trust.read_small(path, 1 << 16), path, fix, format_name=_ORIGIN_FORMAT,
                            what="the origin of a working copy")
    return trust.check_json(value, _ORIGIN_SPEC, path, fix)


def working_copy_dir(url: str, storage_options: dict | None = None) -> str:
    """Where the working copy of the remote cache at ``url`` lives.

    ``$NBKIT_CACHE_DIR`` (default ``~/.cache/nbkit``), then the last part of the URL and a hash of
    the URL (and of the endpoint, when ``storage_options`` names one).

    Example:
        >>> os.path.basename(working_copy_dir("gs://bucket/mnist/"))[:6]
        'mnist-'
    """
    normalized = url.rstrip("/")
    endpoint = (storage_options or {}).get("endpoint_url") or ""
    digest = hashlib.sha256(f"{normalized}\n{endpoint}".encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]", "_", normalized.rsplit("/", 1)[-1].split("://")[-1]) or "cache"
    return os.path.join(cache_dir(), f"{name}-{digest}")


def resolve(url: str, storage_options: dict | None = None, **location_options) -> "MirrorLocation":
    """The :class:`MirrorLocation` of a remote URL; no network access."""
    unknown = {k for k, v in location_options.items() if v is not None}
    if unknown:
        raise TypeError(f"unexpected options for a remote cache's working copy: {sorted(unknown)}")
    return MirrorLocation(url=url, root=working_copy_dir(url, storage_options), is_remote=True,
                          storage_options=dict(storage_options or {}))


@dataclass
class MirrorLocation(LocalLocation):
    """A remote cache and its local working copy (``root``). Processes of one host share the copy under a file lock."""

    publishes = True

    def not_found(self) -> Exception:
        """Opening a prefix that holds no published cache (and no working copy here): name the URL, not the copy."""
        return FileNotFoundError(
            f"no nbkit cache at {self.url}: nothing has been published there ({fmt.META} is missing; a cache is "
            "published once every sample is stored), and this machine has no working copy of it. To build it there, "
            f"open it with its source: nbkit.CachedDataset(source, {self.url!r}), then train or call warmup(). "
            f"To send a cache you already have: {fix('push a cache', url=self.url)}."
        )

    def prepare(self, callback=None) -> bool:
        """Pull the remote cache into the working copy if that is missing or older; return whether it pulled.

        A no-op for a remote URL with no complete cache yet.
        """
        _record_origin(self.root, self.url, self.storage_options)  # for nbkit.caches(): which URL, last opened when
        fix = "open the cache again: a complete remote cache is pulled, otherwise warming starts from the working copy"
        doing = "looking for a cache at"
        fs, rroot = connect(self.url, self.storage_options, doing=doing, fix=fix)
        with file_lock(self.root + ".lock"), remote_errors(fs, self.url, doing, fix):
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

        Skipped (returns ``False``) while samples are missing, when the remote already holds this
        complete cache, or while another host holds the publish lease.
        """
        with file_lock(self.root + ".lock"):
            if not os.path.exists(os.path.join(self.root, fmt.META)):
                return False
            stored, length = stored_count(self.root)
            if stored < length:
                return False
            again = f"call sync() on the dataset again, or {fix('retry push', path=self.root, url=self.url)}: it resumes"
            fs, rroot = connect(self.url, self.storage_options, doing="publishing to", fix=again, write=True)
            with remote_errors(fs, self.url, "publishing to", again):
                return self._publish(fs, rroot, length, callback)

    def _publish(self, fs, rroot: str, length: int, callback) -> bool:
        fs.invalidate_cache()
        remote = trusted_remote_manifest(fs, rroot)
        if (remote is not None and fs.exists(f"{rroot}/{fmt.META}") and int(remote.get("stored", -1)) >= length
                and remote["files"].get(fmt.META, {}).get("sha256") == sha256_file(os.path.join(self.root, fmt.META))):
            return False  # the remote already holds this cache, complete
        with lease(fs, rroot) as held:
            if not held:
                return False
            push(self.root, self.url, callback=callback, storage_options=self.storage_options)
            return True


def _local_stored(root: str) -> int | None:
    """Samples stored in the working copy, or ``None`` if it is missing or unreadable."""
    if not os.path.exists(os.path.join(root, fmt.META)):
        return None
    try:
        return stored_count(root)[0]
    except (CorruptCacheError, OSError, ValueError):
        return None


@contextlib.contextmanager
def lease(fs, rroot: str):
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
            age = time.time() - float(_lease_body(fs, path).get("time"))
            if not -LEASE_SECONDS < age < 10 * LEASE_SECONDS:  # clocks of two hosts may differ a little
                age = LEASE_SECONDS  # far in the future, or not a time: not a lease nbkit wrote
        except FileNotFoundError:
            age = None
        except (ValueError, TypeError, OverflowError):
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
            held = _lease_body(fs, path).get("token") == token
        except FileNotFoundError:
            held = False
        break
    try:
        yield held
    finally:
        if held:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)


def _lease_body(fs, path: str) -> dict:
    """The lease object at ``path`` as a dict (``{}`` when it is not one): a bucket is shared, so
    its lease is read bounded and never trusted to be well-formed."""
    try:
        body = json.loads(fs.cat_file(path, start=0, end=4096))
    except (ValueError, RecursionError):
        return {}
    return body if isinstance(body, dict) else {}
