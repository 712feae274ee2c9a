"""Copy a cache directory to and from any fsspec URL (``gs://`` first): :func:`push` and :func:`pull`.

A pushed cache is its files under the URL plus ``manifest.json`` (:mod:`nbkit.transfer.manifest`); a push is
resumable and publishes ``nbkit.json`` last. A bucket prefix is untrusted input: a pull takes only
a cache's own file names, checks the manifest's sizes against the objects and the free disk before
fetching, and checks every sha256 and every stored sample's CRC (:func:`check_whole`) before it
swaps the copy into place. Before any of it, :func:`nbkit.transfer.remote.connect` checks within seconds that
the URL works (bucket, credentials, endpoint), and a failure says what happened in a short first line
and the fix; "it resumes" only when a rerun has uploaded files to skip (``docs/DESIGN.md``,
"Transfer and archives"; ``docs/SECURITY.md``).

Example:
    >>> import tempfile, torch, nbkit
    >>> src = torch.utils.data.TensorDataset(torch.arange(8.0))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
    >>> nbkit.push(ds.root, "memory://doctest/cache").skipped
    ()
    >>> copy = tempfile.mkdtemp() + "/copy"
    >>> _ = nbkit.pull("memory://doctest/cache", copy)
    >>> float(nbkit.CachedDataset.open(copy)[3][0])
    3.0
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from ..cachedir import cache_root, check_replaceable, discard_stage, frozen, open_files, stage_dir, swap_into_place
from ..errors import CorruptCacheError, UnsafeArchiveError
from ..commit import CHUNK, Dir, disk_full, leftover_of, temp_pid, unnamed_full_disk
from .manifest import (MANIFEST, REPUSH, build_manifest, check_entry, check_file_set, check_free_disk, check_listing,
                       check_meta_sizes, manifest_bytes, read_bounded, read_remote_manifest, sha256_file,
                       trusted_remote_manifest)
from ..progress import as_callback
from ..text import fix as fix_for
from .remote import (BLOCK, Stopped, abandon, check_bucket, classify, connect, is_connection_error, is_local, remote_errors,
                     remote_sizes, write_bytes)
from ..stats import process_alive
from ..trust import MAX_JSON_BYTES, cache_file_path, check_int, check_path, check_url, is_cache_file, open_readable, read_small

__all__ = ["push", "pull", "TransferReport", "Stopped", "check_whole"]

# Downloads fetch a large file as ranged reads of PART bytes, at most PARTS_IN_FLIGHT of them
# (over all files) fetched and not yet written: this bounds pull's memory to ~100 MiB. Against the
# emulator, 16 MiB parts with 4+ in flight, hashed as they arrive, match gcsfs's get_file (no hash).
PART = 16 << 20
PARTS_IN_FLIGHT = 6
# After a file finishes, checkpoint the manifest if at least this much was uploaded since the
# last checkpoint: a failed push then resumes after the large files, at the cost of one small
# extra object write.
CHECKPOINT_BYTES = 8 << 20


@dataclass(frozen=True)
class TransferReport:
    """What a push, pull, export or import did.

    Attributes:
        transferred: names of the files copied.
        skipped: names already present at the destination with the right size and hash.
        bytes: bytes copied.
        seconds: wall time.
        stopped: ``True`` if the callback's ``stop_requested`` ended it early (nothing was published).

    Example:
        >>> TransferReport(transferred=("index.bin", "nbkit.json"), bytes=1024).stopped
        False
    """

    transferred: tuple = ()
    skipped: tuple = ()
    bytes: int = 0
    seconds: float = 0.0
    stopped: bool = False


def check_whole(tmp: str, where: str, fix: str, callback=None, describe_as: str | None = None) -> int:
    """Check, before it is swapped into place, that the copy in ``tmp`` is a whole cache: ``nbkit.json``
    names exactly the data files there, agrees with their sizes, and every stored sample's CRC holds.
    Returns the samples checked.

    Raises:
        CorruptCacheError: naming ``where`` (the tar or URL it came from) and ``fix``.
    """
    cb = as_callback(callback)
    meta_where = f"{where}: {fmt.META}"
    meta = fmt.parse_meta(read_small(os.path.join(tmp, fmt.META)), meta_where, fix)
    names = os.listdir(tmp)
    check_file_set(meta, names, where, fix)
    check_meta_sizes(meta, {n: os.path.getsize(os.path.join(tmp, n)) for n in names}, where, fix)
    try:
        try:
            files = open_files(tmp)
        except (TypeError, KeyError, IndexError, AttributeError, OverflowError) as e:
            # nbkit.json that parse_meta let through but the store cannot use: damaged all the same.
            raise CorruptCacheError(f"{meta_where} is damaged ({type(e).__name__}: {e}). {fix}") from e
        try:
            # A phase of its own, in samples: never counted against the bytes copied before it.
            cb.start_phase("verify", unit="samples", size=int(np.count_nonzero(files.is_stored(np.arange(files.length)))))
            if describe_as:
                cb.set_description(describe_as)
            # Rows checked where they lie, checksums on two threads: keeps an import's full check
            # within its budget (benchmarks/results/trust.md).
            return fmt.verify_store(files, where=where, callback=cb, chunk=8192, threads=2, fix="")
        finally:
            files.close()  # release the maps before the directory is renamed
    except CorruptCacheError as e:
        text = str(e).replace(tmp, where)
        if where not in text:
            text = f"{where}: {text}"
        raise CorruptCacheError(f"{text} Nothing was replaced. {fix}") from e


# -- parallel copy with progress on the calling thread --------------------------------------------


def _run_parallel(jobs, cb, max_workers: int, on_done=None):
    """Run ``jobs`` (``(name, fn(report, stop_event))`` pairs) in threads; progress goes through ``cb`` on
    this thread, and so does ``on_done(name, last=...)`` after each job that succeeds. Returns
    ``(done_names, failure, stopped)``: ``failure`` is the first ``(name, exc)`` or ``None``."""
    progress: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    done, failure = [], None

    def drain():
        n = 0
        while True:
            try:
                n += progress.get_nowait()
            except queue.Empty:
                break
        if n:
            cb.relative_update(n)

    with ThreadPoolExecutor(max_workers=max(1, max_workers), thread_name_prefix="nbkit-transfer") as pool:
        futures = {pool.submit(fn, progress.put, stop): name for name, fn in jobs}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
            drain()
            for fut in finished:
                if fut.cancelled():
                    continue
                name = futures[fut]
                exc = fut.exception()
                if exc is None:
                    done.append(name)
                    if on_done is not None and failure is None and not stop.is_set():
                        try:
                            on_done(name, last=not pending)
                        except Exception as e:  # noqa: BLE001 - e.g. the checkpoint write failed: stop like any failure
                            failure = (name, e)
                            stop.set()
                elif not isinstance(exc, Stopped) and failure is None:
                    failure = (name, exc)
                    stop.set()
            if cb.should_stop():
                stop.set()
            if stop.is_set():
                for fut in pending:
                    fut.cancel()  # jobs not started yet never start (a dead endpoint would make each wait out its retries)
        drain()
    return done, failure, stop.is_set() and failure is None


# -- push -------------------------------------------------------------------------------------------


def push(cache_path, url: str, *, callback=None, storage_options: dict | None = None, max_workers: int = 8) -> TransferReport:
    """Copy the cache at ``cache_path`` to ``url`` (any fsspec URL); resumable, published last.

    Args:
        cache_path: local cache directory.
        url: destination prefix, e.g. ``"gs://bucket/caches/mnist"``.
        callback: progress (:class:`nbkit.progress.Callback`) in two phases, ``"hash"`` then ``"push"``,
            both in bytes; ``stop_requested`` stops the push before anything is published.
        storage_options: passed to fsspec (for gcsfs: ``token``, ``project`` …).
        max_workers: files uploaded at once.

    Returns:
        A :class:`TransferReport`.

    Raises:
        OSError: the endpoint cannot be reached, or an upload failed; the message names the URL,
            the endpoint and what to do (rerun to resume).

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tempfile.mkdtemp())
        >>> _ = ds.warmup()
        >>> r = nbkit.push(ds.root, "memory://doctest/push")
        >>> sorted(r.transferred)
        ['col-0.bin', 'index.bin', 'nbkit.json']
    """
    url = check_bucket(check_url(url, "url"), "url")
    max_workers = check_int(max_workers, "max_workers", min=1, max=256)
    start = time.perf_counter()
    cb = as_callback(callback)
    root = cache_root(check_path(cache_path, "cache_path"))
    rerun = fix_for("retry push", path=root, url=url)  # in the words of the front end running the push
    cb.set_description(f"connecting to {url}")
    try:
        fs, rroot = connect(url, storage_options, doing="pushing to", fix=rerun, write=True,
                            should_stop=cb.should_stop)
    except Stopped:
        cb.set_description("stopped")
        return TransferReport(seconds=time.perf_counter() - start, stopped=True)
    # Writers (a warmup in this or another process) wait while the push reads the files, so what is
    # uploaded is one consistent state: exactly the bytes that were hashed.
    with frozen(root):
        return _push(root, url, fs, rroot, cb, max_workers, start, rerun)


def _push(root, url, fs, rroot, cb, max_workers, start, rerun) -> TransferReport:
    if is_local(fs) and (os.path.realpath(rroot) + os.sep).startswith(os.path.realpath(root) + os.sep):
        raise ValueError(f"cannot push the cache at {root} to {url}: that is the cache's own directory (or lies in it), "
                         "and pushing would overwrite the files it reads. Push to another directory or bucket.")
    cb.set_description("reading the cache")
    manifest = build_manifest(root, callback=cb)
    files = manifest["files"]
    names = [n for n in files if n != fmt.META]
    # The files a rerun would skip: in the remote manifest (the last checkpoint) and uploaded whole.
    kept: set = set()

    def fix():
        if not kept:
            return rerun
        n = len(kept)
        return f"{rerun}: it resumes, skipping the {n} file{'s' if n != 1 else ''} already uploaded"

    with remote_errors(fs, url, "pushing to", fix, note=" (nothing was changed there)"):
        fs.invalidate_cache()
        if is_local(fs):
            fs.makedirs(rroot, exist_ok=True)  # object stores have no directories to create
            _sweep_temp(rroot)
        remote = trusted_remote_manifest(fs, rroot)  # a damaged one: everything is uploaded again
        remote_files = (remote or {}).get("files", {})
        sizes = remote_sizes(fs, rroot)

    def present(name):
        return remote_files.get(name) == files[name] and sizes.get(name) == files[name]["size"]

    todo = sorted((n for n in names if not present(n)), key=lambda n: -files[n]["size"])
    skipped = tuple(n for n in names if n not in todo)
    if not todo and present(fmt.META) and remote == manifest:
        cb.set_description("up to date")
        return TransferReport(skipped=skipped + (fmt.META,), seconds=time.perf_counter() - start)
    kept.update(skipped)

    # Unpublish first: from here until nbkit.json is written again the prefix is not a cache.
    with remote_errors(fs, url, "pushing to", fix, note=" (unpublishing the older copy)"):
        if fmt.META in sizes:
            fs.rm_file(f"{rroot}/{fmt.META}")
        for stale in set(remote_files) - set(files):
            if stale in sizes:
                fs.rm_file(f"{rroot}/{stale}")

    total = sum(files[n]["size"] for n in todo) + files[fmt.META]["size"]
    cb.start_phase("push", unit="bytes", size=total)
    cb.set_description(f"pushing to {url}")
    state = {"since_checkpoint": 0, "confirmed": set(skipped)}

    def checkpoint():
        partial = dict(manifest, files={n: files[n] for n in sorted(state["confirmed"])})
        write_bytes(fs, f"{rroot}/{MANIFEST}", manifest_bytes(partial))
        state["since_checkpoint"] = 0
        kept.update(state["confirmed"])

    def on_done(name, last):
        state["confirmed"].add(name)
        state["since_checkpoint"] += files[name]["size"]
        # The last file needs no checkpoint: the final manifest follows at once.
        if not last and state["since_checkpoint"] >= CHECKPOINT_BYTES:
            checkpoint()

    def upload(name):
        def job(report, stop):
            with open_readable(cache_file_path(root, name, root, error=UnsafeArchiveError)) as src:
                dst = fs.open(f"{rroot}/{name}", "wb", block_size=BLOCK)
                sha, size = hashlib.sha256(), 0
                try:
                    while chunk := src.read(CHUNK):
                        if stop.is_set():
                            raise Stopped()
                        sha.update(chunk)
                        size += len(chunk)
                        dst.write(chunk)
                        report(len(chunk))
                    if size != files[name]["size"] or sha.hexdigest() != files[name]["sha256"]:
                        # Never finalised: the object is not replaced by bytes the manifest does not describe.
                        raise RuntimeError(f"{root}/{name} changed while it was being pushed (something other than nbkit "
                                           f"wrote to the cache); nothing was published. {rerun} once it is done.")
                except BaseException as e:
                    abandon(dst, tell_backend=not is_connection_error(e))
                    raise
                dst.close()  # the last part goes up here: the object exists only once it is whole
        return job

    done, failed, stopped = _run_parallel([(n, upload(n)) for n in todo], cb, max_workers, on_done)
    nbytes = sum(files[n]["size"] for n in done)
    if failed is not None:
        name, exc = failed
        note = ""
        # After a connection failure the checkpoint would only wait for the same dead endpoint; files
        # confirmed before the last checkpoint are skipped by the rerun, the few since then sent again.
        if state["since_checkpoint"] and not is_connection_error(exc):
            try:
                checkpoint()
            except Exception as e2:  # noqa: BLE001 - any backend error; the first failure is what matters
                note = f" (the resume checkpoint could not be written either: {type(e2).__name__})"
        classified = classify(exc, fs, url, "pushing to", fix(), note=f" (uploading {name}; nothing was published{note})")
        if classified is not None:
            raise classified from exc
        first, _, rest = str(exc).strip().partition("\n")
        raise OSError(
            f"push to {url} failed while uploading {name} ({type(exc).__name__}: {first})\n"
            f"Nothing was published ({url}/{fmt.META} is absent, so no reader sees a cache there){note}.\n"
            f"To try again, {fix()}." + (f"\n{rest.strip()}" if rest.strip() else "")
        ) from exc
    if stopped:
        if state["since_checkpoint"]:
            with remote_errors(fs, url, "pushing to", fix, note=" (writing the resume checkpoint after Stop)"):
                checkpoint()
        cb.set_description("stopped")
        return TransferReport(tuple(done), skipped, nbytes, time.perf_counter() - start, stopped=True)

    cb.set_description("publishing")
    with remote_errors(fs, url, "pushing to", fix, note=" (publishing: every file was uploaded, the cache is not published yet)"):
        write_bytes(fs, f"{rroot}/{MANIFEST}", manifest_bytes(manifest))
        kept.update(names)
        with open_readable(os.path.join(root, fmt.META)) as f:
            meta = f.read()
        if hashlib.sha256(meta).hexdigest() != files[fmt.META]["sha256"]:
            raise RuntimeError(f"{root}/{fmt.META} changed while the cache was being pushed; nothing was published. {rerun}.")
        write_bytes(fs, f"{rroot}/{fmt.META}", meta)
    cb.relative_update(len(meta))
    cb.set_description("pushed")
    fs.invalidate_cache()
    return TransferReport(tuple(done) + (fmt.META,), skipped, nbytes + len(meta), time.perf_counter() - start)


def _sweep_temp(rroot: str) -> None:
    """Remove the temporary files a killed push left in a local "bucket" (a directory, a mounted Drive)."""
    with Dir(rroot) as d:
        for name in d.names():
            left = leftover_of(name)
            if left is not None and temp_pid(name) is not None and is_cache_file(left[0]) \
                    and not process_alive(temp_pid(name)):
                d.unlink(name)


# -- pull -------------------------------------------------------------------------------------------


def pull(url: str, cache_path, *, callback=None, storage_options: dict | None = None, max_workers: int = 8) -> TransferReport:
    """Copy the cache at ``url`` to the local directory ``cache_path``, verifying every file's sha256 first.

    Downloads into a temporary sibling of ``cache_path``, hashing each file as it arrives, and
    renames the directory into place only after every file matched the manifest, so
    ``cache_path`` is never a half-copied or damaged cache. An existing cache at ``cache_path`` is
    replaced; files it already holds unchanged are reused.

    Args:
        url: where the cache was pushed, e.g. ``"gs://bucket/caches/mnist"``.
        cache_path: local directory to create or replace.
        callback: progress in two phases: ``"pull"`` in bytes downloaded, then ``"verify"`` in samples checked.
        storage_options: passed to fsspec.
        max_workers: files downloaded at once.

    Raises:
        FileNotFoundError: ``url`` holds no complete cache (never pushed, or a push is unfinished).
        CorruptCacheError: a file fails its sha256; nothing at ``cache_path`` changed.
        OSError: the endpoint cannot be reached or a download failed; ``cache_path`` is unchanged.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), tempfile.mkdtemp())
        >>> _ = ds.warmup(); _ = nbkit.push(ds.root, "memory://doctest/pull")
        >>> r = nbkit.pull("memory://doctest/pull", tempfile.mkdtemp() + "/copy")
        >>> r.transferred[-1]
        'nbkit.json'
    """
    url = check_bucket(check_url(url, "url"), "url")
    dest = os.path.abspath(os.path.expanduser(check_path(cache_path, "cache_path")))
    max_workers = check_int(max_workers, "max_workers", min=1, max=256)
    start = time.perf_counter()
    cb = as_callback(callback)
    fix = fix_for("retry pull", url=url, path=dest)
    cb.set_description(f"connecting to {url}")
    try:
        fs, rroot = connect(url, storage_options, doing="pulling from", fix=fix, should_stop=cb.should_stop)
    except Stopped:
        cb.set_description("stopped")
        return TransferReport(seconds=time.perf_counter() - start, stopped=True)
    return _pull(url, dest, fs, rroot, cb, max_workers, start, fix)


def _pull(url, dest, fs, rroot, cb, max_workers, start, fix) -> TransferReport:
    with remote_errors(fs, url, "pulling from", fix, note=f" ({dest} is unchanged)"):
        fs.invalidate_cache()
        if not fs.exists(f"{rroot}/{fmt.META}"):
            raise FileNotFoundError(
                f"{url} holds no complete nbkit cache ({fmt.META} is missing): push one with "
                f"{fix_for('push a cache', url=url)}, or wait until the push in progress has finished."
            )
        manifest = read_remote_manifest(fs, rroot, url)
        if manifest is None:
            raise CorruptCacheError(f"{url} has {fmt.META} but no {MANIFEST}; it was not written by an nbkit push. {REPUSH}")
        files = manifest["files"]
        if fmt.META not in files:
            raise CorruptCacheError(f"{url}/{MANIFEST} does not list {fmt.META}. {REPUSH}")
        # Every size is checked before anything is fetched: against the objects really there (one
        # listing), the metadata's bound and the free disk.
        check_listing(fs, rroot, url, manifest)
        if files[fmt.META]["size"] > MAX_JSON_BYTES:
            raise CorruptCacheError(f"{url}/{MANIFEST} says {fmt.META} is {files[fmt.META]['size']:,} bytes; a real one is a few KiB. {REPUSH}")

        check_replaceable(dest)
        parent = os.path.dirname(dest)
        os.makedirs(parent, exist_ok=True)
        check_free_disk(sum(e["size"] for e in files.values()), dest, f"pulling {url}")
        # nbkit.json first (small, bounded): the files it names must be exactly those the manifest lists.
        meta = read_bounded(fs, f"{rroot}/{fmt.META}")
        check_entry(url, fmt.META, files[fmt.META], hashlib.sha256(meta).hexdigest(), len(meta))
        parsed = fmt.parse_meta(meta, f"{url}/{fmt.META}", REPUSH)
        check_file_set(parsed, files, url)
        check_meta_sizes(parsed, {n: e["size"] for n, e in files.items()}, url)
    tmp = stage_dir(dest, "pull")  # beside dest: a crash leaves a leftover nbkit ls lists and nbkit rm removes
    try:
        reused = []
        for name, entry in files.items():
            old = os.path.join(dest, name)
            if (name != fmt.META and os.path.isfile(old) and not os.path.islink(old) and os.path.getsize(old) == entry["size"]
                    and sha256_file(old) == entry["sha256"]):
                shutil.copyfile(old, os.path.join(tmp, name))
                reused.append(name)
        todo = sorted((n for n in files if n not in reused and n != fmt.META), key=lambda n: -files[n]["size"])
        nbytes = sum(files[n]["size"] for n in todo) + files[fmt.META]["size"]
        cb.start_phase("pull", unit="bytes", size=nbytes)
        cb.set_description(f"pulling from {url}")
        budget = threading.BoundedSemaphore(PARTS_IN_FLIGHT)

        with ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="nbkit-fetch") as fetchers:
            def download(name):
                def job(report, stop):
                    sha = _download(fs, f"{rroot}/{name}", os.path.join(tmp, name), files[name]["size"],
                                    fetchers, budget, report, stop, url)
                    check_entry(url, name, files[name], sha, os.path.getsize(os.path.join(tmp, name)))
                return job

            done, failed, stopped = _run_parallel([(n, download(n)) for n in todo], cb, max_workers)
        if failed is not None:
            name, exc = failed
            if isinstance(exc, CorruptCacheError):
                raise exc
            if unnamed_full_disk(exc):
                raise disk_full(dest, sum(e["size"] for e in files.values()), exc, doing="pull the cache into") from exc
            classified = classify(exc, fs, url, "pulling from", fix, note=f" (downloading {name}; {dest} is unchanged)")
            if classified is not None:
                raise classified from exc
            first, _, rest = str(exc).strip().partition("\n")
            raise OSError(f"pull of {url} failed while downloading {name} ({type(exc).__name__}: {first})\n"
                          f"{dest} is unchanged.\nTo try again, {fix}." + (f"\n{rest.strip()}" if rest.strip() else "")) from exc
        if stopped:
            discard_stage(tmp)
            cb.set_description("stopped")
            return TransferReport(tuple(done), tuple(reused), sum(files[n]["size"] for n in done), time.perf_counter() - start, stopped=True)
        with open(os.path.join(tmp, fmt.META), "wb") as f:
            f.write(meta)
        cb.relative_update(len(meta))
        check_whole(tmp, url, REPUSH, cb, describe_as="verifying checksums")  # a "verify" phase, in samples
        swap_into_place(tmp, dest)  # durable first, then in place in one step
    except BaseException as e:
        discard_stage(tmp)
        if unnamed_full_disk(e):
            # The room check passed but a write still met a full disk (copying a reused file, nbkit.json).
            raise disk_full(dest, sum(f["size"] for f in files.values()), e, doing="pull the cache into") from e
        raise
    cb.set_description("pulled")
    return TransferReport(tuple(todo) + (fmt.META,), tuple(reused), nbytes, time.perf_counter() - start)


def _download(fs, rpath: str, lpath: str, size: int, fetchers, budget, report, stop, url: str = "") -> str:
    """Copy ``rpath`` to ``lpath`` as ranged reads fetched ahead in ``fetchers``; return its sha256.

    Parts are written and hashed in order while the next ones are in flight, so the file is read
    once and hashed once. ``budget`` (shared by all files) bounds the parts held in memory.
    """
    h = hashlib.sha256()
    offsets = range(0, size, PART)
    ahead: deque = deque()
    k = 0  # the next part to request

    def request_more():
        nonlocal k
        while k < len(offsets) and len(ahead) < PARTS_IN_FLIGHT and not stop.is_set():
            # Wait for budget only while none of this file's parts is in flight; otherwise two files
            # could each hold part of the budget and wait for the rest forever.
            if not budget.acquire(blocking=not ahead):
                return
            begin = offsets[k]
            k += 1
            ahead.append((min(PART, size - begin), fetchers.submit(fs.cat_file, rpath, start=begin, end=min(begin + PART, size))))

    if stop.is_set():
        raise Stopped()
    try:
        with open(lpath, "wb") as out:
            request_more()
            while ahead:
                want, fut = ahead.popleft()
                try:
                    data = fut.result()
                finally:
                    budget.release()
                if len(data) != want:  # never write more (or less) than the manifest's size
                    raise CorruptCacheError(f"{url}: a ranged read of {rpath} returned {len(data)} bytes, expected {want}: "
                                            f"the object changed while being read (pull again; if it persists, the prefix is damaged: {REPUSH})")
                request_more()
                if stop.is_set():
                    raise Stopped()
                h.update(data)  # hashlib and the write release the GIL: the fetches go on meanwhile
                out.write(data)
                report(len(data))
    finally:
        for _, fut in ahead:  # failed or stopped: drop the parts in flight and give their budget back
            fut.cancel()
            budget.release()
    return h.hexdigest()
