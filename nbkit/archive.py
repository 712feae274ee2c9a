"""Pack a cache into one reproducible tar file and unpack it safely: :func:`export_tar` and :func:`import_tar`.

The archive holds the cache's files, ``manifest.json``, then ``nbkit.json``; both functions stream
to or from any fsspec URL, and an import checks every member and every sha256 before it swaps the
cache into place (``docs/DESIGN.md``, "Transfer and archives").

Example:
    >>> import tempfile, torch, nbkit
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8.0)), tempfile.mkdtemp())
    >>> _ = ds.warmup()
    >>> tar = tempfile.mkdtemp() + "/cache.tar.gz"
    >>> _ = nbkit.export_tar(ds.root, tar, compression="gz")
    >>> copy = tempfile.mkdtemp() + "/copy"
    >>> _ = nbkit.import_tar(tar, copy)
    >>> float(nbkit.CachedDataset.open(copy)[5][0])
    5.0
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import tarfile
import tempfile
import time

from . import format as fmt
from .cachedir import cache_root, check_replaceable, data_files, stored_count, swap_into_place, verify
from .errors import CorruptCacheError, UnsafeArchiveError
from .extras import require
from .files import CHUNK
from .manifest import MANIFEST, check_entry, manifest_bytes, new_manifest, parse_manifest, sha256_file
from .progress import as_callback
from .remote import BLOCK, abandon, is_connection_error, is_local, url_to_fs
from .transfer import Stopped, TransferReport, describe

__all__ = ["export_tar", "import_tar", "open_decompressed", "stale_tar_reason"]

COMPRESSIONS = (None, "gz", "zst")
#: Files up to this size are compared by sha256 in :func:`stale_tar_reason` (``index.bin`` holds every
#: sample's CRC, so equal small files and equal sizes mean the same samples); larger ones by size.
_HASHED_MAX = 4 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _zstandard():
    return require("zstandard", extra="zst", feature="zstd compression")


class _HashingReader:
    """Reads a file for :meth:`tarfile.TarFile.addfile`, hashing and reporting progress as it goes."""

    def __init__(self, f, cb):
        self.f, self.cb, self.sha = f, cb, hashlib.sha256()

    def read(self, n=-1):
        if getattr(self.cb, "stop_requested", False) is True:
            raise Stopped()
        chunk = self.f.read(n)
        self.sha.update(chunk)
        self.cb.relative_update(len(chunk))
        return chunk


def _member(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


def export_tar(cache_path, tar_path, *, compression: str | None = None, callback=None,
               storage_options: dict | None = None) -> TransferReport:
    """Write the cache at ``cache_path`` into one reproducible tar file at ``tar_path``.

    Args:
        cache_path: local cache directory (do not warm it while exporting).
        tar_path: a local path or any fsspec URL (``gs://bucket/cache.tar.zst``); streamed.
        compression: ``None``, ``"gz"`` or ``"zst"`` (needs ``pip install 'nbkit[zst]'``).
        callback: progress in bytes of cache read; ``stop_requested`` aborts and leaves no tar.
        storage_options: passed to fsspec for a remote ``tar_path``.

    Returns:
        A :class:`nbkit.transfer.TransferReport` (``bytes`` is the cache bytes read).

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> nbkit.export_tar(ds.root, tempfile.mkdtemp() + "/c.tar").transferred
        ('col-0.bin', 'index.bin', 'manifest.json', 'nbkit.json')
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    start = time.perf_counter()
    cb = as_callback(callback)
    root = cache_root(cache_path)
    zstd = _zstandard() if compression == "zst" else None
    names = sorted(data_files(root))
    sizes = {n: os.path.getsize(os.path.join(root, n)) for n in names + [fmt.META]}
    stored, length = stored_count(root)
    cb.set_size(sum(sizes.values()))
    cb.absolute_update(0)
    describe(cb, f"exporting to {tar_path}")

    fs, path = url_to_fs(os.fspath(tar_path), storage_options)
    local = is_local(fs)
    if local:
        fs.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    # Locally the tar is written under a temporary name and renamed when done; remote uploads
    # (GCS) only appear once finished, and are cancelled on failure.
    raw = fs.open(path, "wb", autocommit=False) if local else fs.open(path, "wb", block_size=BLOCK)
    try:
        if compression == "gz":
            stream = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)
        elif compression == "zst":
            stream = zstd.ZstdCompressor(level=3).stream_writer(raw, closefd=False)
        else:
            stream = raw
        files = {}
        # bufsize: tarfile's stream mode re-slices its buffer for every record it passes on, which
        # with the default 10 KiB records makes each 4 MiB chunk cost ~400 copies of itself.
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=CHUNK, bufsize=CHUNK) as tar:
            for name in names:
                with open(os.path.join(root, name), "rb") as f:
                    reader = _HashingReader(f, cb)
                    tar.addfile(_member(name, sizes[name]), reader)
                files[name] = {"size": sizes[name], "sha256": reader.sha.hexdigest()}
            with open(os.path.join(root, fmt.META), "rb") as f:
                meta = f.read()
            files[fmt.META] = {"size": len(meta), "sha256": hashlib.sha256(meta).hexdigest()}
            manifest = manifest_bytes(new_manifest(files, stored, length))
            tar.addfile(_member(MANIFEST, len(manifest)), io.BytesIO(manifest))
            tar.addfile(_member(fmt.META, len(meta)), io.BytesIO(meta))
            cb.relative_update(len(meta))
        if stream is not raw:
            stream.close()
    except Stopped:
        abandon(raw, tell_backend=True)
        describe(cb, "stopped")
        return TransferReport(seconds=time.perf_counter() - start, stopped=True)
    except BaseException as e:
        abandon(raw, tell_backend=not is_connection_error(e))
        raise
    raw.close()
    if local:
        raw.commit()
    describe(cb, "exported")
    return TransferReport(tuple(names) + (MANIFEST, fmt.META), (), sum(sizes.values()), time.perf_counter() - start)


def open_decompressed(raw):
    """Wrap ``raw`` in the decompressor its first bytes call for (gzip, zstd, or none)."""
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head == _ZSTD_MAGIC:
        return _zstandard().ZstdDecompressor().stream_reader(raw, closefd=False)
    return raw


def _check_member(m: tarfile.TarInfo, tar_path) -> str | None:
    """The plain file name ``m`` extracts to, ``None`` for a harmless directory entry, or raise."""
    name = m.name
    kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "device" if m.isdev() else
            "fifo" if m.isfifo() else None)
    if kind is not None:
        raise UnsafeArchiveError(
            f"{tar_path} holds the {kind} {name!r}; an nbkit archive holds regular files only. Refusing to import it: "
            "recreate the archive with nbkit.export_tar."
        )
    if name.startswith(("/", "\\")) or os.path.isabs(name) or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchiveError(f"{tar_path} holds the absolute path {name!r}; refusing to import it (it could write outside the cache).")
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafeArchiveError(f"{tar_path} holds the path {name!r} with '..'; refusing to import it (it could write outside the cache).")
    if m.isdir():
        if parts:
            raise UnsafeArchiveError(f"{tar_path} holds the subdirectory {name!r}; an nbkit cache is one flat directory.")
        return None
    if not m.isreg():
        raise UnsafeArchiveError(f"{tar_path} holds {name!r} of tar type {m.type!r}; an nbkit archive holds regular files only.")
    if len(parts) != 1 or "\x00" in parts[0]:
        raise UnsafeArchiveError(f"{tar_path} holds {name!r}, which is not a plain file name; an nbkit cache is one flat directory.")
    return parts[0]


def import_tar(tar_path, cache_path, *, callback=None, storage_options: dict | None = None) -> TransferReport:
    """Unpack a tar made by :func:`export_tar` (or plain ``tar`` of a cache directory) into ``cache_path``.

    Args:
        tar_path: a local path or any fsspec URL; gzip and zstd are detected from the content.
        cache_path: local directory to create (an existing cache there is replaced).
        callback: progress in bytes extracted, then samples verified.
        storage_options: passed to fsspec for a remote ``tar_path``.

    Raises:
        UnsafeArchiveError: a member is an absolute path, has ``..``, or is a link, device or fifo.
        CorruptCacheError: a file fails its sha256 (or, in a tar without manifest, a sample its CRC),
            or the tar holds no ``nbkit.json``.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> tar = tempfile.mkdtemp() + "/c.tar"; _ = nbkit.export_tar(ds.root, tar)
        >>> nbkit.import_tar(tar, tempfile.mkdtemp() + "/copy").transferred[-1]
        'nbkit.json'
    """
    start = time.perf_counter()
    cb = as_callback(callback)
    dest = os.path.abspath(os.path.expanduser(os.fspath(cache_path)))
    check_replaceable(dest)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)

    import fsspec

    with fsspec.open(os.fspath(tar_path), "rb", **(storage_options or {})) as raw:
        size = getattr(raw, "size", None)
        if size is None:
            size = os.fstat(raw.fileno()).st_size if hasattr(raw, "fileno") else None
        cb.set_size(size)
        cb.absolute_update(0)
        describe(cb, f"importing {tar_path}")
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.import-", dir=parent)
        try:
            hashes, sizes, names = {}, {}, []
            stream = open_decompressed(raw)
            # "r|" reads the tar as a stream: members are checked and written one at a time.
            with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tar:
                for m in tar:
                    name = _check_member(m, tar_path)
                    if name is None:
                        continue
                    if name in hashes:
                        raise UnsafeArchiveError(f"{tar_path} holds {name!r} twice; refusing to import it (a later copy could replace a checked one).")
                    # nbkit.json makes a directory a cache: hold it under another name until all is checked.
                    target = os.path.join(tmp, f".{fmt.META}.pending" if name == fmt.META else name)
                    h = hashlib.sha256()
                    src = tar.extractfile(m)
                    with open(target, "wb") as out:
                        while chunk := src.read(CHUNK):
                            if getattr(cb, "stop_requested", False) is True:
                                raise Stopped()
                            h.update(chunk)
                            out.write(chunk)
                            cb.absolute_update(raw.tell())  # compressed bytes read, like the size
                    hashes[name], sizes[name] = h.hexdigest(), m.size
                    names.append(name)
            if fmt.META not in hashes:
                raise CorruptCacheError(f"{tar_path} holds no {fmt.META}, so it is not an nbkit cache archive (or it was cut short).")
            if MANIFEST in hashes:
                with open(os.path.join(tmp, MANIFEST), "rb") as f:
                    manifest = parse_manifest(f.read(), f"{tar_path}:{MANIFEST}")
                os.unlink(os.path.join(tmp, MANIFEST))
                listed = set(manifest["files"])
                extracted = set(hashes) - {MANIFEST}
                if listed != extracted:
                    raise CorruptCacheError(
                        f"{tar_path} does not hold the files its manifest lists (missing: {sorted(listed - extracted)}, "
                        f"extra: {sorted(extracted - listed)}); export the cache again."
                    )
                for name, entry in manifest["files"].items():
                    check_entry(str(tar_path), name, entry, hashes[name], sizes[name])
            os.rename(os.path.join(tmp, f".{fmt.META}.pending"), os.path.join(tmp, fmt.META))
            if MANIFEST not in hashes:
                # A plain tar of a cache directory has no sha256 to check against: check every sample.
                describe(cb, "verifying checksums")
                verify(tmp, cb)
            swap_into_place(tmp, dest)
        except Stopped:
            shutil.rmtree(tmp, ignore_errors=True)
            describe(cb, "stopped")
            return TransferReport(seconds=time.perf_counter() - start, stopped=True)
        except tarfile.TarError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            raise CorruptCacheError(f"{tar_path} is not a readable tar archive ({e}); export the cache again.") from e
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    describe(cb, "imported")
    files = tuple(n for n in names if n not in (MANIFEST, fmt.META)) + (fmt.META,)
    return TransferReport(files, (), sum(sizes.values()), time.perf_counter() - start)


def _tar_manifest(tar_path, storage_options) -> dict | None:
    """``manifest.json`` of the archive at ``tar_path``, or ``None`` when it holds none."""
    import fsspec

    with fsspec.open(os.fspath(tar_path), "rb", **(storage_options or {})) as raw:
        try:
            with tarfile.open(fileobj=open_decompressed(raw), mode="r|", bufsize=CHUNK) as tar:
                for m in tar:
                    if m.name == MANIFEST and m.isreg():
                        return parse_manifest(tar.extractfile(m).read(), f"{tar_path}:{MANIFEST}")
        except (tarfile.TarError, EOFError, OSError) as e:
            raise CorruptCacheError(f"{tar_path} is not a readable tar archive ({e}); export the cache again.") from e
    return None


def stale_tar_reason(tar_path, cache_path, *, storage_options: dict | None = None) -> str | None:
    """Why the archive at ``tar_path`` does not hold the cache at ``cache_path`` as it is now, or ``None`` if it does.

    Compares the archive's manifest (written by :func:`export_tar`) with the cache's files: the
    metadata, the stored sample count and the record index by sha256, the other files by size. So
    it tells a tar exported before a warmup finished, or from another cache, from an up-to-date
    one, whoever made it and whenever, without reading the samples.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> tar = tempfile.mkdtemp() + "/c.tar"; _ = nbkit.export_tar(ds.root, tar)
        >>> stale_tar_reason(tar, ds.root)
        >>> _ = ds.warmup(); stale_tar_reason(tar, ds.root)
        '... holds 0 of 4 samples; the cache now holds 4: export it again.'
    """
    fs, path = url_to_fs(os.fspath(tar_path), storage_options)
    if not fs.exists(path):
        return f"{tar_path} does not exist yet."
    manifest = _tar_manifest(tar_path, storage_options)
    if manifest is None:
        return f"{tar_path} holds no {MANIFEST} (it was not written by nbkit.export_tar, or was cut short): export the cache again."
    root = cache_root(cache_path)
    files = manifest["files"]
    with open(os.path.join(root, fmt.META), "rb") as f:
        meta_sha = hashlib.sha256(f.read()).hexdigest()
    if files.get(fmt.META, {}).get("sha256") != meta_sha:
        return f"{tar_path} was exported from another cache (its {fmt.META} differs from {root}'s): export this cache again."
    stored, length = stored_count(root)
    if (manifest.get("stored"), manifest.get("length")) != (stored, length):
        return (f"{tar_path} holds {manifest.get('stored', 0):,} of {manifest.get('length', 0):,} samples; "
                f"the cache now holds {stored:,}: export it again.")
    names = data_files(root)
    if set(files) != set(names) | {fmt.META}:
        return f"{tar_path} lists other files than the cache at {root} holds now: export it again."
    for name in names:
        file = os.path.join(root, name)
        size = os.path.getsize(file)
        if size != files[name].get("size") or (size <= _HASHED_MAX and sha256_file(file) != files[name].get("sha256")):
            return f"{tar_path} holds another version of {name} than the cache at {root} (the cache changed since): export it again."
    return None
