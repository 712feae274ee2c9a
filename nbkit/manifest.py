"""The manifest: ``manifest.json``, the size and sha256 of every file of a cache and how many samples it stores.

:func:`nbkit.push` writes it next to the cache's files, :func:`nbkit.export_tar` into the archive,
and every reader checks what it fetched against it (:func:`check_entry`): a file whose sha256
matches is byte-identical to what was pushed. File names in a manifest are plain names inside one
flat directory (:func:`check_name`).

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

from . import format as fmt
from .cachedir import data_files, stored_count
from .errors import CorruptCacheError
from .files import CHUNK

__all__ = ["MANIFEST", "MANIFEST_FORMAT", "sha256_file", "build_manifest", "new_manifest", "manifest_bytes",
           "parse_manifest", "read_remote_manifest", "trusted_remote_manifest", "read_local_manifest", "digest",
           "check_name", "check_entry", "check_bytes"]

#: The object (and archive member) listing every file's size and sha256.
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "nbkit-manifest"


def sha256_file(path: str, progress=None) -> str:
    """The sha256 of a local file, read in chunks; ``progress(n)`` is called after each chunk."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(CHUNK)
            if not chunk:
                return h.hexdigest()
            h.update(chunk)
            if progress is not None:
                progress(len(chunk))


def build_manifest(root: str, progress=None) -> dict:
    """Size and sha256 of every file of the cache at ``root`` (``nbkit.json`` included)."""
    stored, length = stored_count(root)
    files = {}
    for name in data_files(root) + [fmt.META]:
        path = os.path.join(root, name)
        files[name] = {"size": os.path.getsize(path), "sha256": sha256_file(path, progress)}
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


def parse_manifest(raw: bytes, where: str) -> dict:
    """Parse and check a manifest read from ``where``; damage raises :class:`CorruptCacheError`."""
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise CorruptCacheError(f"{where} is not valid JSON ({e}); push the cache again with nbkit.push") from e
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT or not isinstance(manifest.get("files"), dict):
        raise CorruptCacheError(f"{where} is not an nbkit manifest; push the cache again with nbkit.push")
    return manifest


def read_remote_manifest(fs, rroot: str) -> dict | None:
    """The manifest at ``rroot`` of ``fs``, or ``None`` if there is none; ``CorruptCacheError`` if it is damaged."""
    try:
        raw = fs.cat_file(f"{rroot}/{MANIFEST}")
    except FileNotFoundError:
        return None
    return parse_manifest(raw, f"{rroot}/{MANIFEST}")


def trusted_remote_manifest(fs, rroot: str) -> dict | None:
    """The manifest at ``rroot``, or ``None`` if there is none or it is damaged (then nothing in it is trusted)."""
    try:
        return read_remote_manifest(fs, rroot)
    except CorruptCacheError:
        return None


def read_local_manifest(root: str) -> dict | None:
    """The manifest in the local directory ``root``, or ``None`` if it is missing or unreadable."""
    try:
        with open(os.path.join(root, MANIFEST), "rb") as f:
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
        nbkit.errors.CorruptCacheError: memory://c/manifest.json does not list a; push the cache again with nbkit.push
    """
    if entry is None:
        raise CorruptCacheError(f"{url}/{MANIFEST} does not list {name}; push the cache again with nbkit.push")
    if size != entry["size"] or sha != entry["sha256"]:
        raise CorruptCacheError(
            f"{url}/{name} does not match its manifest entry (size {size} vs {entry['size']}, sha256 {sha[:12]}… vs "
            f"{entry['sha256'][:12]}…): the remote copy is damaged or was changed while being read. Push the cache again "
            "from a good copy with nbkit.push."
        )


def check_bytes(url: str, name: str, manifest: dict, data: bytes) -> None:
    """:func:`check_entry` for the whole content ``data`` of ``name``, fetched from ``url``."""
    check_entry(url, name, manifest["files"].get(name), hashlib.sha256(data).hexdigest(), len(data))
