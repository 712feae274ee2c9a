"""The manifest: ``manifest.json``, the size and sha256 of every file of a cache and how many samples it stores.

:func:`nbkit.push` writes it next to the cache's files, :func:`nbkit.export_tar` into the archive,
and every reader checks what it fetched against it (:func:`check_entry`): a file whose sha256
matches is byte-identical to what was pushed. A manifest is untrusted input: :func:`parse_manifest`
checks it against :data:`SPEC` (file names from :data:`nbkit.trust.CACHE_FILE`, sizes ``>= 0``,
sha256 as 64 hex digits) and :func:`check_listing` checks its sizes against the objects really
there and the free disk before anything is fetched.

Example:
    >>> import tempfile, torch, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
    >>> m = build_manifest(ds.root)
    >>> sorted(m["files"]), m["stored"], m["length"]
    (['col-0.bin', 'index.bin', 'nbkit.json'], 0, 4)
    >>> parse_manifest(manifest_bytes(m), "here") == m
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

from .. import format as fmt
from ..cachedir import data_files, stored_count
from ..errors import CorruptCacheError, UnsafeArchiveError
from ..progress import as_callback
from ..commit import CHUNK, disk_full, leftover_of, temp_pid
from ..trust import (MAX_JSON_BYTES, Int, Map, Obj, Str, cache_file_path, check_cache_file, check_json, is_cache_file, load_json,
                    open_readable)

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "sha256_file", "build_manifest", "new_manifest", "manifest_bytes",
           "parse_manifest", "read_remote_manifest", "trusted_remote_manifest", "read_local_manifest", "digest",
           "check_name", "check_entry", "check_bytes", "SPEC", "REPUSH", "meta_files", "check_file_set", "check_listing",
           "check_free_disk", "read_bounded", "check_meta_sizes"]

#: The object (and archive member) listing every file's size and sha256.
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "nbkit-manifest"
#: The fix for a manifest or cache that arrived damaged: rerunning the same copy cannot help.
REPUSH = "Ask whoever pushed or exported it to push or export it again from a good copy."
#: The name a host's publish lease has under a pushed prefix (:mod:`nbkit.stores.mirror`); the one
#: object besides the cache's files a prefix may hold. Never fetched.
LEASE = ".nbkit-publish-lease"

#: What a manifest must hold. Every size is checked again against the real files before use.
SPEC = Obj({
    "format": Str(choices={MANIFEST_FORMAT}),
    "version": Int(min=1, max=1),
    "stored": Int(min=0),
    "length": Int(min=0),
    "files": Map(Obj({"size": Int(min=0), "sha256": Str(pattern="[0-9a-f]{64}")}), max_len=4200),
})


def sha256_file(path: str, progress=None) -> str:
    """The sha256 of a local file, read in chunks; ``progress(n)`` is called after each chunk."""
    h = hashlib.sha256()
    with open_readable(path) as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))


def build_manifest(root: str, *, callback=None) -> dict:
    """Size and sha256 of every file of the cache at ``root`` (``nbkit.json`` included).

    The ``callback`` (:func:`nbkit.progress.as_callback`) is told of a ``"hash"`` phase in bytes, its
    total (every file's size) known before the first byte."""
    stored, length = stored_count(root)
    names = data_files(root) + [fmt.META]
    paths = {n: cache_file_path(root, n, os.path.join(root, fmt.META), error=UnsafeArchiveError) for n in names}
    sizes = {n: os.path.getsize(p) for n, p in paths.items()}
    cb = as_callback(callback)
    cb.start_phase("hash", unit="bytes", size=sum(sizes.values()))
    files = {n: {"size": sizes[n], "sha256": sha256_file(paths[n], cb.relative_update)} for n in names}
    return new_manifest(files, stored, length)


def new_manifest(files: dict, stored: int, length: int) -> dict:
    """The manifest of a cache holding ``files`` (``name -> {"size", "sha256"}``), as push and export write it."""
    return {"format": MANIFEST_FORMAT, "version": 1, "stored": stored, "length": length, "files": files}


def manifest_bytes(manifest: dict) -> bytes:
    """The manifest as written (sorted keys: the same manifest gives the same bytes)."""
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def digest(manifest: dict) -> str:
    """A short hash naming one manifest (so one version of a pushed cache)."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:12]


def parse_manifest(raw: bytes, where: str, fix: str = REPUSH) -> dict:
    """Parse ``raw`` read from ``where`` and check it against :data:`SPEC`.

    Raises:
        CorruptCacheError: not JSON, too large, or a field of the wrong kind, naming ``where`` and ``fix``.
        UnsafeArchiveError: it lists a file that is not one of a cache's files.

    Example:
        >>> parse_manifest(b'{"format": "nbkit-manifest", "version": 1, "stored": 0, "length": 0,'
        ...                b' "files": {"a.py": {"size": 1, "sha256": "%s"}}}' % (b"0" * 64), "t.tar")
        Traceback (most recent call last):
        ...
        nbkit.errors.UnsafeArchiveError: t.tar names the file 'a.py', which is not one of an nbkit cache's files ...
    """
    manifest = load_json(raw, where, fix, format_name=MANIFEST_FORMAT, what="an nbkit manifest")
    manifest = check_json(manifest, SPEC, where, fix)
    for name in manifest["files"]:
        check_cache_file(name, where, error=UnsafeArchiveError)
    if MANIFEST in manifest["files"]:
        raise CorruptCacheError(f"{where} lists itself ({MANIFEST}). {fix}")
    if manifest["stored"] > manifest["length"]:
        raise CorruptCacheError(f"{where} says {manifest['stored']} of {manifest['length']} samples are stored. {fix}")
    return manifest


def read_bounded(fs, path: str, limit: int = MAX_JSON_BYTES) -> bytes:
    """The object at ``path`` of ``fs``, read with one ranged request of at most ``limit + 1`` bytes
    (a longer object comes back cut, and its parser refuses it); ``FileNotFoundError`` if absent."""
    return fs.cat_file(path, start=0, end=limit + 1)


def read_remote_manifest(fs, rroot: str, url: str | None = None) -> dict | None:
    """The manifest at ``rroot`` of ``fs`` (errors name ``url``), or ``None`` if there is none;
    ``CorruptCacheError`` if it is damaged."""
    try:
        raw = read_bounded(fs, f"{rroot}/{MANIFEST}")
    except FileNotFoundError:
        return None
    return parse_manifest(raw, f"{url or rroot}/{MANIFEST}")


def trusted_remote_manifest(fs, rroot: str) -> dict | None:
    """The manifest at ``rroot``, or ``None`` if there is none or it is damaged (then nothing in it is trusted)."""
    try:
        return read_remote_manifest(fs, rroot)
    except (CorruptCacheError, UnsafeArchiveError):
        return None


def read_local_manifest(root: str) -> dict | None:
    """The manifest in the local directory ``root``, or ``None`` if it is missing or unreadable."""
    try:
        with open_readable(os.path.join(root, MANIFEST)) as f:
            return json.loads(f.read())
    except (FileNotFoundError, ValueError):
        return None


def check_name(name: str, where: str) -> None:
    """Raise :class:`CorruptCacheError` unless ``name`` is a plain file name inside one flat directory."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise CorruptCacheError(f"{where} lists the file name {name!r}, which is not a plain file name inside the cache")


def check_entry(url: str, name: str, entry: dict | None, sha: str, size: int) -> None:
    """Raise :class:`CorruptCacheError` unless ``url/name`` (``size`` bytes, sha256 ``sha``) matches its manifest ``entry``.

    Example:
        >>> check_entry("memory://c", "a", {"size": 1, "sha256": "00"}, "00", 1)
        >>> check_entry("memory://c", "a", None, "00", 1)
        Traceback (most recent call last):
        ...
        nbkit.errors.CorruptCacheError: memory://c/manifest.json does not list a. Ask whoever pushed or exported it ...
    """
    if entry is None:
        raise CorruptCacheError(f"{url}/{MANIFEST} does not list {name}. {REPUSH}")
    if size != entry["size"] or sha != entry["sha256"]:
        raise CorruptCacheError(
            f"{url}/{name} does not match its manifest entry (size {size} vs {entry['size']}, sha256 {sha[:12]}… vs "
            f"{entry['sha256'][:12]}…): the copy is damaged, or was changed while being read (then reading it again "
            f"helps). {REPUSH}"
        )


def check_bytes(url: str, name: str, manifest: dict, data: bytes) -> None:
    """:func:`check_entry` for the whole content ``data`` of ``name``, fetched from ``url``."""
    check_entry(url, name, manifest["files"].get(name), hashlib.sha256(data).hexdigest(), len(data))


def meta_files(meta: dict) -> list:
    """The column file names of ``meta`` (``nbkit.json`` already checked by :func:`nbkit.format.parse_meta`,
    which holds each entry to ``col-<k>.bin`` in order)."""
    return [fmt.column_file(k) for k in range(len(meta["columns"]))]


def check_file_set(meta: dict, names, where: str, fix: str = REPUSH) -> None:
    """Raise unless ``names`` (the data files that arrived, ``nbkit.json`` and ``manifest.json`` aside)
    are exactly the index, the column files ``meta`` names, and optionally the heap."""
    want = {fmt.INDEX, *meta_files(meta)}
    have = set(names) - {fmt.META, MANIFEST}
    missing, extra = sorted(want - have), sorted(have - want - {fmt.HEAP})
    if missing or extra:
        raise CorruptCacheError(
            f"{where} does not hold the files its {fmt.META} names (missing: {missing}, not named: {extra}). {fix}")


def check_free_disk(nbytes: int, dest: str, where: str) -> None:
    """Raise :class:`nbkit.errors.DiskFullError` (``ENOSPC``) unless the disk holding ``dest``'s
    parent has ``nbytes`` free; the message names the target (a staged copy's by its own name)."""
    parent = os.path.dirname(os.path.abspath(dest)) or "."
    free = shutil.disk_usage(parent).free
    if nbytes > free:
        left = leftover_of(os.path.basename(dest))
        target = os.path.join(parent, left[0]) if left else os.path.abspath(dest)
        raise disk_full(target, nbytes, doing=f"copy ({where}) into", note=" (a size this large may also mean the source is damaged)")


def check_listing(fs, rroot: str, url: str, manifest: dict) -> dict:
    """Check the objects really under ``rroot`` against ``manifest`` before anything is fetched.

    Every object must be a cache file (or the publish lease), and every file the manifest lists must
    be there with the size the manifest says (so a manifest claiming ``2**50`` bytes fails here,
    with one listing request). Returns ``name -> size`` of the objects.

    Raises:
        UnsafeArchiveError: an object or subdirectory that is not one of a cache's files.
        CorruptCacheError: a listed file missing or of another size.
    """
    try:
        entries = fs.ls(rroot, detail=True)
    except FileNotFoundError:
        entries = []
    sizes = {}
    for e in entries:
        name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        if name == LEASE and e.get("type") != "directory":
            continue
        if e.get("type") != "directory" and temp_pid(name) is not None and is_cache_file(leftover_of(name)[0]):
            continue  # a committed write a killed push left (local "buckets"): never fetched, swept by the next push
        if e.get("type") == "directory":
            raise UnsafeArchiveError(f"{url} holds the subdirectory {name!r}; an nbkit cache is one flat prefix of its own "
                                     "files. Refusing to pull it: push the cache to a prefix of its own.")
        check_cache_file(name, url, error=UnsafeArchiveError)
        size = e.get("size")
        sizes[name] = size if isinstance(size, int) and not isinstance(size, bool) else None
    for name, entry in manifest["files"].items():
        if name not in sizes:
            raise CorruptCacheError(f"{url}/{MANIFEST} lists {name}, which is not there: the push was cut short, "
                                    f"or the prefix was changed since. {REPUSH}")
        if sizes[name] is not None and sizes[name] != entry["size"]:
            raise CorruptCacheError(f"{url}/{name} is {sizes[name]} bytes but its manifest says {entry['size']}: the "
                                    f"prefix was changed after the push, or the manifest is damaged. {REPUSH}")
    return sizes


def check_meta_sizes(meta: dict, sizes: dict, where: str, fix: str = REPUSH) -> None:
    """Raise :class:`CorruptCacheError` unless ``sizes`` (name -> bytes, from a manifest, a listing
    or the disk) are what ``meta`` (checked by :func:`nbkit.format.parse_meta`) implies: ``index.bin``
    holds ``length`` records and each column file ``capacity`` rows. Checked before any of those
    files is opened or allocated, so a length or shape in the metadata is bounded by real bytes."""
    from ..codec import Schema

    length, capacity = meta["length"], meta.get("capacity")
    schema = Schema.from_json(meta["schema"])
    columns = meta_files(meta)
    rows = length if capacity is None else capacity
    want = {fmt.INDEX: length * fmt.RECORD.itemsize}
    for name, leaf in zip(columns, schema.columns):
        want[name] = rows * schema.row_bytes(leaf)
    for name, n in want.items():
        if sizes.get(name) != n:
            raise CorruptCacheError(f"{where}/{name} is {sizes.get(name)} bytes, but {fmt.META} says it holds {n}: the "
                                    f"metadata disagrees with the files. {fix}")
