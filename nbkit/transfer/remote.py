"""Remote storage through fsspec: a URL resolved once, and failures to reach its endpoint named clearly.

:func:`url_to_fs` is ``fsspec.core.url_to_fs`` with the root's trailing ``/`` removed. :func:`connect`
opens a URL for a long operation (push, pull) and fails within seconds, classified, when it cannot
work: a URL without a bucket (before any network), no credentials (``gs://``: the lookup of
google-auth's default credentials is bounded, where gcsfs would spend 12-18 s on a silent metadata
server), an endpoint that refuses connections or accepts them and never answers, a missing bucket,
a permission denied. Every wait polls the caller's stop flag, and gcsfs gets timeouts for every
request. :func:`classify` turns an error met later into the same short messages (first line: what
happened; then where; then the fix), and :func:`remote_errors` does that for a block of work. Every
user of a bucket (push, pull, the mirror and read-through stores) reaches it through these two, so
one endpoint fails with one message wherever it is met. :func:`abandon` drops a file being written without committing it (a failed upload
never publishes a truncated object).

Example:
    >>> fs, root = connect("memory://doctest/remote/", None, doing="pushing to", fix="rerun")
    >>> root, endpoint_of(fs), is_local(fs)
    ('/doctest/remote', None, False)
    >>> with remote_errors(fs, "memory://doctest/remote", "reading", "rerun"):
    ...     write_bytes(fs, root + "/a", b"x")
    >>> remote_sizes(fs, root)
    {'a': 1}
    >>> check_bucket("gs://", "url")
    Traceback (most recent call last):
    ...
    ValueError: no bucket in the URL 'gs://' (url): write gs://<bucket>/<prefix>, e.g. gs://my-bucket/my-cache
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

from ..commit import atomic_write
from ..text import fix as fix_for

__all__ = ["url_to_fs", "is_local", "endpoint_of", "connection_errors", "is_connection_error", "remote_errors",
           "remote_sizes", "write_bytes", "write_url", "abandon", "BLOCK", "check_bucket", "connect", "classify", "Stopped", "CONNECT_SECONDS", "ANSWER_SECONDS", "CREDENTIALS_SECONDS",
           "READ_SECONDS", "REQUEST_SECONDS", "no_credentials_fix"]

# Bytes in flight per upload. 32 MiB is a multiple of GCS's 256 KiB resumable-upload granularity
# and measured fastest against the emulator.
BLOCK = 32 << 20
#: :func:`connect`'s bounds: a TCP connection to the endpoint, then its first answer (one listing
#: request), and google-auth's default-credentials lookup (a silent metadata server costs it 12-18 s).
CONNECT_SECONDS = 5.0
ANSWER_SECONDS = 6.0
CREDENTIALS_SECONDS = 5.0
#: Timeouts of every gcsfs request: silence while waiting for an answer (gcsfs retries it, up to 6
#: tries), and one request as a whole, which also bounds an upload to an endpoint that stopped
#: reading (not retried). 180 s lets one BLOCK go up at 190 KB/s per upload.
READ_SECONDS = 20.0
REQUEST_SECONDS = 180.0
def no_credentials_fix() -> str:
    """What to do when ``gs://`` has no credentials, in the words of the front end in use (:func:`nbkit.text.fix`).

    Example:
        >>> from nbkit.text import speaking_to
        >>> with speaking_to("shell"):
        ...     "pass -o token=..." in no_credentials_fix()
        True
    """
    return ("run `from google.colab import auth; auth.authenticate_user()` (Colab) or "
            f"`gcloud auth application-default login`, or {fix_for('give token')} "
            "('anon' for a public bucket or an emulator)")
# Object stores whose URL names the bucket first: <scheme>://<bucket>/<prefix>.
_BUCKET_SCHEMES = ("gs", "gcs", "s3", "s3a")
_POLL = 0.05  # how often a bounded wait looks at the stop flag


class Stopped(Exception):
    """Raised where the work is done (a worker thread, a tar reader, a bounded wait) when the caller asked to stop."""


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


def remote_sizes(fs, root: str) -> dict:
    """``name -> size`` of the files directly under ``root`` (``{}`` if it does not exist)."""
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in entries if e.get("type") != "directory"}


def write_bytes(fs, path: str, data: bytes) -> None:
    """Write one small object whole: an object store makes it visible only once complete; on a local
    filesystem (a directory given as the "bucket", a mounted Drive) it is committed
    (:func:`nbkit.commit.atomic_write`: the old file or the whole new one, durably)."""
    if is_local(fs):
        fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write(path, data)
        return
    with fs.open(path, "wb") as f:
        f.write(data)


def write_url(url: str, data: bytes, storage_options: dict | None = None) -> None:
    """Save ``data`` at ``url`` (a path or any fsspec URL) so that a reader finds the previous
    content or the whole new one, even if the process dies while writing (a training checkpoint).

    Example:
        >>> import tempfile
        >>> path = tempfile.mkdtemp() + "/run/checkpoint.pt"
        >>> write_url(path, b"step 100"); open(path, "rb").read()
        b'step 100'
    """
    fs, path = url_to_fs(url, storage_options)
    write_bytes(fs, path, data)


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


# -- connect: fail within seconds, saying what happened ---------------------------------------------


def check_bucket(url: str, name: str = "url") -> str:
    """``url`` unless it is an object-store URL without a bucket (``gs://``, ``gs:///x``): then ``ValueError``."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() in _BUCKET_SCHEMES and not rest.split("/", 1)[0]:
        raise ValueError(f"no bucket in the URL {url!r} ({name}): write {scheme}://<bucket>/<prefix>, "
                         f"e.g. {scheme}://my-bucket/my-cache")
    return url


def _is_gcs(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "gs" in protocols


def _host_port(endpoint: str | None) -> str:
    """``host:port`` of an endpoint URL (what a user checks), or ``the storage backend``."""
    if not endpoint:
        return "the storage backend"
    parts = urlsplit(endpoint)
    if not parts.hostname:
        return endpoint
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def _never() -> bool:
    return False


def _wait(future, seconds: float, should_stop, what: str):
    """``future``'s result, waiting at most ``seconds`` and looking at ``should_stop()`` meanwhile.

    Raises:
        Stopped: ``should_stop()`` became true.
        TimeoutError: ``what`` took longer (the work goes on in its thread; its result is dropped).
    """
    deadline = time.monotonic() + seconds
    while True:
        try:
            return future.result(timeout=max(0.0, min(_POLL, deadline - time.monotonic())))
        except concurrent.futures.TimeoutError:
            if future.done():
                raise  # the work's own TimeoutError
            if should_stop():
                raise Stopped() from None
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{what} took more than {seconds:g} s") from None


def _in_thread(fn) -> concurrent.futures.Future:
    """Run ``fn()`` in a daemon thread (one a caller may give up on without blocking the interpreter's exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
            future.set_exception(e)

    threading.Thread(target=run, name="nbkit-remote", daemon=True).start()
    return future


# One default-credentials lookup per scope at a time, shared by every push and pull of the process;
# a found one is kept (google-auth refreshes it), a failed one is tried again next time.
_lookups: dict = {}
_lookups_lock = threading.Lock()


def _lookup_default_credentials(scope: str):
    import google.auth
    from google.auth.transport.requests import Request

    credentials, project = google.auth.default(scopes=[scope])
    # A token now, in this bounded thread: gcsfs would otherwise fetch it inside its event loop, unbounded.
    credentials.refresh(Request())
    return credentials, project


def _default_credentials(scope: str, should_stop):
    """``((credentials, project), "")`` from google-auth's default credentials for ``scope``, or
    ``(None, why)`` when there are none (none found, refused, or the lookup did not end within
    :data:`CREDENTIALS_SECONDS`)."""
    import google.auth.exceptions

    with _lookups_lock:
        future = _lookups.get(scope)
        if future is None or (future.done() and future.exception() is not None):
            future = _lookups[scope] = _in_thread(lambda: _lookup_default_credentials(scope))
    try:
        return _wait(future, CREDENTIALS_SECONDS, should_stop, "looking for credentials"), ""
    except TimeoutError:
        return None, f"none found within {CREDENTIALS_SECONDS:g} s"
    except google.auth.exceptions.DefaultCredentialsError:
        return None, "none found"
    except (google.auth.exceptions.GoogleAuthError, OSError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:120]
        return None, f"the ones found could not be used: {type(e).__name__}: {first}"


def _gcs_options(url: str, storage_options: dict, should_stop, write: bool, doing: str, fix: str) -> dict:
    """``storage_options`` for gcsfs with credentials resolved (bounded) and timeouts on every request."""
    import logging

    import aiohttp

    # gcsfs logs every failed request with its traceback, which logging's last-resort handler prints
    # into the notebook; the error nbkit raises says it in three lines. (Handlers an application
    # configures still receive the records: they propagate.)
    logger = logging.getLogger("gcsfs")
    if not logger.handlers:
        logger.addHandler(logging.NullHandler())
    so = dict(storage_options)
    so.setdefault("requests_timeout", aiohttp.ClientTimeout(total=REQUEST_SECONDS, sock_connect=CONNECT_SECONDS,
                                                            sock_read=READ_SECONDS))
    if "token" in so:
        return so
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "") not in ("", "default")
    if emulator and "endpoint_url" not in so:
        so["token"] = "anon"  # an emulator takes anyone; gcsfs would look for credentials first all the same
        return so
    found, why = _default_credentials(f"https://www.googleapis.com/auth/devstorage.{so.get('access', 'full_control')}",
                                      should_stop)
    if found is not None:
        so["token"], project = found
        if project:
            so.setdefault("project", project)
        return so
    if write:
        raise PermissionError(
            f"no credentials for {url} ({why})\n"
            f"while {doing} {url}; nothing was sent.\n"
            f"To fix: {no_credentials_fix()}; then {fix}.")
    so["token"] = "anon"  # reading a public bucket needs none; a private one answers 401, named then
    return so


def connect(url: str, storage_options: dict | None, *, doing: str, fix: str, write: bool = False, should_stop=None):
    """``(fs, root)`` of ``url``, checked to work within seconds before a long operation.

    For ``gs://`` without ``storage_options['token']``, google-auth's default credentials are looked
    up for at most :data:`CREDENTIALS_SECONDS` (none: an error for a write, anonymous for a read),
    and every gcsfs request gets timeouts (:data:`READ_SECONDS`, :data:`REQUEST_SECONDS`). For any
    endpoint over the network, one TCP connection (:data:`CONNECT_SECONDS`) and one listing of the
    prefix (:data:`ANSWER_SECONDS`) must succeed. ``should_stop()`` is looked at while waiting.

    Args:
        url: the URL, already checked by ``trust.check_url`` and :func:`check_bucket`.
        storage_options: fsspec options (not modified).
        doing: what the caller does, for messages ("pushing to").
        fix: what to do after fixing the cause ("rerun nbkit.push(...)").
        write: whether the operation writes (then anonymous access is no option).
        should_stop: a callable; when it returns true, :class:`Stopped` is raised.

    Raises:
        Stopped: ``should_stop()`` became true.
        OSError: the endpoint cannot be reached ("cannot reach the endpoint <host:port> …").
        PermissionError: no credentials, or they may not list the prefix.
        FileNotFoundError: the bucket does not exist.

    Example:
        >>> connect("memory://doctest/connect", None, doing="pulling from", fix="rerun")[1]
        '/doctest/connect'
    """
    should_stop = should_stop or _never
    so = dict(storage_options or {})
    if urlsplit(url).scheme.lower() in ("gs", "gcs"):
        so = _gcs_options(url, so, should_stop, write, doing, fix)
    fs, root = url_to_fs(url, so)
    endpoint = endpoint_of(fs)
    try:
        if endpoint:
            _check_connect(endpoint)
        if getattr(fs, "async_impl", False) and getattr(fs, "loop", None) is not None:
            from fsspec.asyn import sync

            sync(fs.loop, _answer, lambda: _first_answer(fs, root), ANSWER_SECONDS, should_stop)
    except Stopped:
        raise
    except Exception as e:
        classified = classify(e, fs, url, doing, fix, probing=True, anonymous=so.get("token") == "anon")
        if classified is None:
            raise
        raise classified from e
    return fs, root


def _check_connect(endpoint: str) -> None:
    """One TCP connection to ``endpoint`` (skipped behind a proxy: the HTTP stack may reach it through one)."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")):
        return
    parts = urlsplit(endpoint)
    if parts.hostname:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=CONNECT_SECONDS).close()


class _NoAnswer(Exception):
    """The endpoint accepted the connection but did not answer within :data:`ANSWER_SECONDS`."""


async def _first_answer(fs, root: str):
    """One small request: list at most one object under ``root`` (gcsfs: the bucket must exist)."""
    if _is_gcs(fs):
        bucket, key, _ = fs.split_path(root)
        return await fs._call("GET", "b/{}/o", bucket, prefix=(key.rstrip("/") + "/") if key else None,
                              maxResults=1, json_out=True)
    try:
        return await fs._ls(root, detail=False)
    except FileNotFoundError:
        return None  # an empty prefix: the endpoint answered


async def _answer(make, seconds: float, should_stop):
    """Await ``make()`` for at most ``seconds``, looking at ``should_stop()``; the request is cancelled either way."""
    task = asyncio.ensure_future(make())
    deadline = time.monotonic() + seconds
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_POLL)
            if done:
                return task.result()
            if should_stop():
                raise Stopped()
            if time.monotonic() >= deadline:
                raise _NoAnswer()
    finally:
        task.cancel()


def _reason(exc: BaseException) -> str:
    """Why a connection failed, in a few words."""
    if isinstance(exc, _NoAnswer):
        return f"it accepted the connection but did not answer within {ANSWER_SECONDS:g} s"
    if isinstance(exc, ConnectionRefusedError) or "Connect call failed" in str(exc) or "refused" in str(exc).lower():
        return "connection refused"
    if isinstance(exc, socket.gaierror) or "Name or service not known" in str(exc):
        return "host not found"
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    first = (str(exc).strip().splitlines() or [""])[0][:120]
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def classify(exc: BaseException, fs, url: str, doing: str, fix: str, *, note: str = "", probing: bool = False,
            anonymous: bool = False) -> Exception | None:
    """The short, classified error for ``exc`` met while ``doing`` ``url``, or ``None`` for an error of another kind.

    Line 1 says what happened (cannot reach the endpoint, no credentials, permission denied, no such
    bucket), line 2 where (``doing`` ``url`` and ``note``), line 3 the fix, ending with ``fix``.
    ``probing``: ``exc`` came from :func:`connect`'s first listing (a missing object there is a missing bucket).

    Example:
        >>> e = classify(ConnectionRefusedError(111, "refused"), None, "gs://b/c", "pushing to", "rerun")
        >>> print(e)
        cannot reach the storage backend (connection refused)
        while pushing to gs://b/c.
        Check the URL, storage_options['endpoint_url'] or STORAGE_EMULATOR_HOST, and the network (proxy, VPN, firewall); then rerun.
    """
    endpoint = endpoint_of(fs) if fs is not None else None
    where = f"while {doing} {url}{note}."
    if isinstance(exc, (_NoAnswer, TimeoutError)) or is_connection_error(exc):
        what = f"the endpoint {_host_port(endpoint)}" if endpoint else "the storage backend"
        return OSError(f"cannot reach {what} ({_reason(exc)})\n{where}\n"
                       f"Check the URL, {fix_for('endpoint option')} or STORAGE_EMULATOR_HOST, and the network "
                       f"(proxy, VPN, firewall); then {fix}.")
    code = getattr(exc, "code", None)
    text = str(exc)
    if code == 401:
        if anonymous:
            return PermissionError(f"no credentials for {url} (the server refused anonymous access)\n{where}\n"
                                   f"To fix: {no_credentials_fix()}; then {fix}.")
        return PermissionError(f"the credentials were refused for {url} (401: expired or revoked?)\n{where}\n"
                               f"Sign in again ({no_credentials_fix()}); then {fix}.")
    # A local file's PermissionError names the file; a backend's (s3fs, adlfs) does not.
    remote_denied = isinstance(exc, PermissionError) and getattr(exc, "filename", None) is None
    if remote_denied or code == 403 or (isinstance(exc, OSError) and text.startswith("Forbidden")):
        detail = next((ln.strip() for ln in text.splitlines()[1:] if ln.strip()), "")
        detail = f" ({detail[:160]})" if detail else ""
        return PermissionError(f"permission denied on {url}{detail}\n{where}\n"
                               f"Use an account that may list{' and write' if 'push' in doing else ''} objects there "
                               f"(e.g. roles/storage.objectAdmin), or another bucket; then {fix}.")
    if probing and isinstance(exc, FileNotFoundError) and fs is not None and _is_gcs(fs):
        bucket = fs.split_path(url)[0]
        at = f" at {_host_port(endpoint)}" if endpoint else ""
        return FileNotFoundError(f"the bucket {bucket!r} does not exist{at}\n{where}\n"
                                 f"Check the bucket's name in the URL, or create it (gcloud storage buckets create "
                                 f"gs://{bucket}); then {fix}.")
    return None


@contextlib.contextmanager
def remote_errors(fs, url: str, doing: str, fix, *, note: str = ""):
    """Turn an unreachable endpoint, missing credentials or a permission denied met inside the block
    into :func:`classify`'s short error; other errors pass unchanged.

    ``fix`` is a string, or a callable that says it as it stands when the error is met (a push that
    uploaded files meanwhile resumes). ``fs`` is what :func:`connect` returned, which checked the
    endpoint first.

    Example:
        >>> fs, _ = connect("memory://doctest/errors", None, doing="reading", fix="rerun")
        >>> with remote_errors(fs, "memory://doctest/errors", "reading", "rerun"):
        ...     raise ConnectionResetError("gone")
        Traceback (most recent call last):
        ...
        OSError: cannot reach the storage backend (ConnectionResetError: gone)
        while reading memory://doctest/errors.
        Check the URL, storage_options['endpoint_url'] or STORAGE_EMULATOR_HOST, and the network (proxy, VPN, firewall); then rerun.
    """
    try:
        yield
    except Exception as e:  # re-raised unchanged unless classify() knows its kind
        classified = classify(e, fs, url, doing, fix() if callable(fix) else fix, note=note)
        if classified is None:
            raise
        raise classified from e
