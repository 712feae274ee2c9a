"""Pack a cache into one reproducible tar file and unpack it safely: :func:`export_tar` and :func:`import_tar`.

The archive holds ``manifest.json`` (every file's size and sha256), ``nbkit.json``, then the data
files; both functions stream to or from any fsspec URL. A tar is untrusted input: an import takes
only a cache's own file names, checks every size against the manifest and the free disk before
writing, refuses links, devices and sparse members, and checks every sha256 and every stored
sample's CRC before it swaps the cache into place (``docs/DESIGN.md``, "Transfer and archives";
``docs/SECURITY.md``). Tars written by older versions (manifest last, or none) still import.

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

import contextlib
import errno
import gzip
import hashlib
import io
import os
import shutil
import tarfile
import time
import zlib

from .. import format as fmt
from ..cachedir import cache_root, check_replaceable, data_files, discard_stage, stage_dir, sweep_leftovers, stored_count, swap_into_place
from ..errors import CorruptCacheError, UnsafeArchiveError
from ..extras import require
from ..commit import CHUNK, Dir, claim, disk_full, release, staging_name, unnamed_full_disk
from .manifest import (MANIFEST, build_manifest, check_entry, check_file_set, check_free_disk, check_meta_sizes,
                       manifest_bytes, parse_manifest, sha256_file)
from ..progress import as_callback
from ..text import fix as fix_for
from .remote import BLOCK, abandon, is_connection_error, is_local, url_to_fs
from .sync import Stopped, TransferReport, check_whole
from ..trust import MAX_COLUMNS, MAX_JSON_BYTES, cache_file_path, check_cache_file, check_path, check_url, open_readable

__all__ = ["export_tar", "import_tar", "compression_of", "open_decompressed", "stale_tar_reason"]

COMPRESSIONS = (None, "gz", "zst")
#: Files up to this size are compared by sha256 in :func:`stale_tar_reason` (``index.bin`` holds every
#: sample's CRC, so equal small files and equal sizes mean the same samples); larger ones by size.
_HASHED_MAX = 4 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: Extended headers (pax, GNU long names) larger than this are refused before tarfile reads them.
_MAX_EXTENDED_HEADER = 64 << 10
#: Extended headers in a row before one member (pax global and own, GNU long name and long link).
_MAX_HEADER_CHAIN = 8
#: Bytes a tar may hold besides its members' data: headers, padding, the end-of-archive blocks,
#: and what the reader fetches ahead.
_TAR_SLACK = 4 * CHUNK
#: ``heap.lock``: nbkit's empty lock file, found in plain tars of a cache directory; skipped, never written.
_SKIPPED = (fmt.LOCK,)
#: Harmless entries a tar may hold besides a cache's files: the directory ``./`` and ``heap.lock``.
_HARMLESS = 1 + len(_SKIPPED)
#: The most members a tar of a cache can have: every file a cache's metadata may name (``nbkit.json``,
#: ``index.bin``, ``heap.bin``, ``manifest.json``, up to :data:`MAX_COLUMNS` column files) and the
#: harmless entries. A tar with more is not one cache: it is refused before tarfile reads on (each
#: member, even an empty skipped one, costs a header read and a place in tarfile's member list).
_MAX_MEMBERS = 4 + MAX_COLUMNS + _HARMLESS
_REEXPORT = "Ask whoever exported it to export it again from a good copy."


def _zstandard():
    return require("zstandard", extra="zst", feature="zstd compression")


class _HashingReader:
    """Reads a file for :meth:`tarfile.TarFile.addfile`, hashing and reporting progress as it goes."""

    def __init__(self, f, cb):
        self.f, self.cb, self.sha = f, cb, hashlib.sha256()

    def read(self, n=-1):
        if self.cb.should_stop():
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


def compression_of(tar_path: str) -> str | None:
    """The compression a tar's name asks for: ``"gz"`` for ``.gz``/``.tgz``, ``"zst"`` for ``.zst``, else ``None``.

    Example:
        >>> compression_of("gs://b/mnist.tar.gz"), compression_of("c.tar.zst"), compression_of("c.tar")
        ('gz', 'zst', None)
    """
    name = str(tar_path).lower().rstrip("/")
    if name.endswith((".gz", ".tgz")):
        return "gz"
    if name.endswith((".zst", ".zstd")):
        return "zst"
    return None


def export_tar(cache_path, tar_path, *, compression: str | None = "auto", callback=None,
               storage_options: dict | None = None) -> TransferReport:
    """Write the cache at ``cache_path`` into one reproducible tar file at ``tar_path``.

    Args:
        cache_path: local cache directory (do not warm it while exporting).
        tar_path: a local path or any fsspec URL (``gs://bucket/cache.tar.zst``); streamed.
        compression: ``"auto"`` (the default: from ``tar_path``'s suffix, ``.gz``/``.tgz`` gzip, ``.zst``
            zstandard, anything else none), ``None``, ``"gz"`` or ``"zst"`` (needs ``pip install zstandard``;
            the ``zst`` extra).
        callback: progress in two phases, ``"hash"`` then ``"export"``, both in bytes of cache read
            (:meth:`nbkit.progress.Callback.start_phase`); ``stop_requested`` aborts and leaves no tar.
        storage_options: passed to fsspec for a remote ``tar_path``.

    Returns:
        A :class:`nbkit.transfer.TransferReport` (``bytes`` is the cache bytes read).

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> nbkit.export_tar(ds.root, tempfile.mkdtemp() + "/c.tar").transferred
        ('col-0.bin', 'index.bin', 'manifest.json', 'nbkit.json')
    """
    if compression != "auto" and compression not in COMPRESSIONS:
        raise ValueError(f"compression must be 'auto' or one of {COMPRESSIONS}, got {compression!r}")
    tar_path = check_url(tar_path, "tar_path")
    if compression == "auto":
        compression = compression_of(tar_path)
    start = time.perf_counter()
    cb = as_callback(callback)
    root = cache_root(check_path(cache_path, "cache_path"))
    zstd = _zstandard() if compression == "zst" else None
    # The manifest goes first, so an import knows every size before it writes a byte: hash first,
    # then write (and hash again: a file changed in between is refused, never exported wrongly).
    cb.set_description("reading the cache")
    manifest = build_manifest(root, callback=cb)  # only cache file names, no symbolic links (trust.cache_file_path)
    files = manifest["files"]
    names = sorted(n for n in files if n != fmt.META)
    paths = {n: cache_file_path(root, n, os.path.join(root, fmt.META), error=UnsafeArchiveError) for n in names}
    # A phase of its own: the bytes written to the tar, after the bytes hashed.
    cb.start_phase("export", unit="bytes", size=sum(f["size"] for f in files.values()))
    cb.set_description(f"exporting to {tar_path}")

    fs, path = url_to_fs(tar_path, storage_options)
    local = is_local(fs)
    # Locally the tar is staged beside its target (never in $TMPDIR on another filesystem: a move
    # across filesystems is a copy that a crash leaves torn), synced, and renamed over the old tar;
    # remote uploads (GCS) only appear once finished, and are cancelled on failure.
    if local:
        staged = _StagedFile(path)
        raw = staged.file
    else:
        raw = fs.open(path, "wb", block_size=BLOCK)
    try:
        if compression == "gz":
            stream = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=6)
        elif compression == "zst":
            stream = zstd.ZstdCompressor(level=3).stream_writer(raw, closefd=False)
        else:
            stream = raw
        # bufsize: tarfile's stream mode re-slices its buffer for every record it passes on, which
        # with the default 10 KiB records makes each 4 MiB chunk cost ~400 copies of itself.
        with tarfile.open(fileobj=stream, mode="w|", format=tarfile.PAX_FORMAT, copybufsize=CHUNK, bufsize=CHUNK) as tar:
            head = manifest_bytes(manifest)
            tar.addfile(_member(MANIFEST, len(head)), io.BytesIO(head))
            with open_readable(os.path.join(root, fmt.META)) as f:
                meta = f.read()
            _check_unchanged(root, fmt.META, files, len(meta), hashlib.sha256(meta).hexdigest())
            tar.addfile(_member(fmt.META, len(meta)), io.BytesIO(meta))
            cb.relative_update(len(meta))
            for name in names:
                with open_readable(paths[name]) as f:
                    reader = _HashingReader(f, cb)
                    tar.addfile(_member(name, files[name]["size"]), reader)
                    _check_unchanged(root, name, files, files[name]["size"] + len(f.read(1)), reader.sha.hexdigest())
        if stream is not raw:
            stream.close()
        if local:
            staged.commit(needed=sum(f["size"] for f in files.values()))
    except Stopped:
        staged.discard() if local else abandon(raw, tell_backend=True)
        cb.set_description("stopped")
        return TransferReport(seconds=time.perf_counter() - start, stopped=True)
    except BaseException as e:
        if local:
            staged.discard()
            if unnamed_full_disk(e):
                raise disk_full(path, sum(f["size"] for f in files.values()), e, doing="export the cache to") from e
        else:
            abandon(raw, tell_backend=not is_connection_error(e))
        raise
    if not local:
        raw.close()
    cb.set_description("exported")
    return TransferReport(tuple(names) + (MANIFEST, fmt.META), (), sum(f["size"] for f in files.values()),
                          time.perf_counter() - start)


class _StagedFile:
    """A local file written under a leftover name beside ``path`` (:func:`nbkit.commit.staging_name`),
    then synced and renamed over ``path`` with the directory synced: the old file or the whole new one."""

    def __init__(self, path: str):
        head, self.name = os.path.split(os.path.abspath(path))
        os.makedirs(head, exist_ok=True)
        sweep_leftovers(path)  # tars an interrupted export left here
        self.dir = Dir(head)
        self.tmp = staging_name(self.name, "export")
        self.file = os.fdopen(self.dir.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb", buffering=CHUNK)
        claim(self.dir.join(self.tmp))

    def commit(self, needed: int) -> None:
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise disk_full(self.dir.join(self.name), needed, e, doing="export the cache to") from e
            raise
        self.file.close()
        self.dir.rename(self.tmp, self.name)
        self.dir.sync()
        release(self.dir.join(self.tmp))
        self.dir.close()

    def discard(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()
        release(self.dir.join(self.tmp))
        self.dir.unlink(self.tmp)
        self.dir.close()


def _check_unchanged(root: str, name: str, files: dict, size: int, sha: str) -> None:
    if size != files[name]["size"] or sha != files[name]["sha256"]:
        raise RuntimeError(f"{os.path.join(root, name)} changed while it was being exported (warmup or writes are "
                           "running on this cache); nothing was written. Export it again once they have finished.")


def open_decompressed(raw):
    """Wrap ``raw`` in the decompressor its first bytes call for (gzip, zstd, or none)."""
    head = raw.read(4)
    raw.seek(0)
    if head.startswith(_GZIP_MAGIC):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head == _ZSTD_MAGIC:
        return _zstandard().ZstdDecompressor().stream_reader(raw, closefd=False)
    return raw


class _Refused(Exception):
    """Raised inside tarfile's reader (which knows no tar path); turned into :class:`UnsafeArchiveError`."""


class _Damaged(Exception):
    """A decompressor or tar reader failed on the bytes; turned into :class:`CorruptCacheError`."""


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's header reader, refusing sparse members and oversized extended headers before
    tarfile acts on them (it would read a pax or long-name header of any claimed size into memory,
    and expand a sparse member's map)."""

    def _proc_member(self, tarfile_):
        extended = self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
                                 tarfile.SOLARIS_XHDTYPE)
        if extended and self.size > _MAX_EXTENDED_HEADER:
            raise _Refused(f"an extended header of {self.size} bytes (at most {_MAX_EXTENDED_HEADER} are allowed)")
        # tarfile reads the header after an extended one by recursing: a long chain of them would end
        # in a RecursionError. A real member has a few (global and own pax headers, long name and link).
        chain = getattr(tarfile_, "_nbkit_chain", 0) + 1 if extended else 0
        if chain > _MAX_HEADER_CHAIN:
            raise _Refused(f"more than {_MAX_HEADER_CHAIN} extended headers in a row")
        tarfile_._nbkit_chain = chain
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _Refused(f"the sparse member {self.name!r}")
        return super()._proc_member(tarfile_)

    def _refuse_sparse(self, next, *args):
        raise _Refused(f"the sparse member {next.name!r}")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


class _GuardedReader:
    """The decompressed tar stream: counts what it hands out and stops past ``limit`` bytes, and
    turns a decompressor's failure on damaged bytes into :class:`_Damaged`."""

    def __init__(self, stream, limit: int):
        self.stream, self.limit, self.count = stream, limit, 0

    def read(self, n=-1):
        if n is None or n < 0:
            n = CHUNK
        try:
            data = self.stream.read(min(n, self.limit - self.count + 1))
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise _Damaged(f"{type(e).__name__}: {e}") from e
        except OSError as e:
            if is_connection_error(e):
                raise
            raise _Damaged(f"{type(e).__name__}: {e}") from e
        except Exception as e:
            if type(e).__name__ == "ZstdError":  # zstandard's error type (imported only when used)
                raise _Damaged(f"ZstdError: {e}") from e
            raise
        self.count += len(data)
        if self.count > self.limit:
            raise _Refused(f"more than the {self.limit:,} bytes its members may hold, given their sizes and the free disk")
        return data


def _check_stop(cb) -> None:
    """Raise :class:`Stopped` when ``cb`` (:func:`nbkit.progress.as_callback`'s) asks to stop."""
    if cb.should_stop():
        raise Stopped()


def _check_count(count: int, limit: int, tar_path) -> None:
    """Refuse the tar at its ``count``-th member when that is past ``limit``, the most its cache can have."""
    if count > limit:
        files = (f"the {limit - _HARMLESS:,} files its manifest names" if limit < _MAX_MEMBERS else
                 f"the {_MAX_MEMBERS - _HARMLESS:,} files an nbkit cache can have (nbkit.json, index.bin, heap.bin, "
                 "manifest.json, col-<k>.bin)")
        raise UnsafeArchiveError(
            f"{tar_path} holds more than {limit:,} members (refused at member {count:,}): more than {files} plus "
            f"'./' and {fmt.LOCK}. Refusing to import it: it is not one cache's archive. {_REEXPORT}")


def _check_member(m: tarfile.TarInfo, tar_path) -> str | None:
    """The cache file name ``m`` extracts to, ``None`` for a harmless entry (``./``, ``heap.lock``), or raise."""
    name = m.name
    kind = ("symlink" if m.issym() else "hard link" if m.islnk() else "device" if m.isdev() else
            "fifo" if m.isfifo() else None)
    if kind is not None:
        raise UnsafeArchiveError(
            f"{tar_path} holds the {kind} {name!r}; an nbkit archive holds regular files only. Refusing to import it: "
            "export the cache again to recreate the archive."
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
    if m.type not in (tarfile.REGTYPE, tarfile.AREGTYPE) or m.sparse is not None or any(
            k.startswith("GNU.sparse") for k in m.pax_headers):
        raise UnsafeArchiveError(f"{tar_path} holds {name!r} of tar type {m.type!r} (sparse, or not a plain file); "
                                 "an nbkit archive holds regular files only. Refusing to import it.")
    if len(parts) != 1 or "\x00" in parts[0]:
        raise UnsafeArchiveError(f"{tar_path} holds {name!r}, which is not a plain file name; an nbkit cache is one flat directory.")
    if parts[0] in _SKIPPED and m.size == 0:
        return None
    return check_cache_file(parts[0], str(tar_path), error=UnsafeArchiveError)


def import_tar(tar_path, cache_path, *, callback=None, storage_options: dict | None = None) -> TransferReport:
    """Unpack a tar made by :func:`export_tar` (or plain ``tar`` of a cache directory) into ``cache_path``.

    The tar is untrusted: only a cache's own files are taken, every size is checked (against the
    manifest, the metadata and the free disk) before it is written, and the copy appears at
    ``cache_path`` only once every sha256 and every stored sample's CRC holds. On any failure
    ``cache_path`` is as it was.

    Args:
        tar_path: a local path or any fsspec URL; gzip and zstd are detected from the content.
        cache_path: local directory to create (an existing cache there is replaced).
        callback: progress in two phases (:meth:`nbkit.progress.Callback.start_phase`): ``"import"``
            in bytes of the tar read, then ``"verify"`` in samples checked.
        storage_options: passed to fsspec for a remote ``tar_path``.

    Raises:
        UnsafeArchiveError: a member is not one of a cache's files (``evil.py``), is an absolute
            path, has ``..``, is a link, device, fifo or sparse member.
        CorruptCacheError: the tar is damaged, cut short or not a tar; a file fails its sha256 or
            its size; a sample fails its CRC; ``nbkit.json`` disagrees with the files.
        OSError: the destination's disk has not enough room for what the tar holds.

    Example:
        >>> import tempfile, torch, nbkit
        >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(4)), tempfile.mkdtemp())
        >>> tar = tempfile.mkdtemp() + "/c.tar"; _ = nbkit.export_tar(ds.root, tar)
        >>> nbkit.import_tar(tar, tempfile.mkdtemp() + "/copy").transferred[-1]
        'nbkit.json'
    """
    tar_path = check_url(tar_path, "tar_path")
    dest = os.path.abspath(os.path.expanduser(check_path(cache_path, "cache_path")))
    start = time.perf_counter()
    cb = as_callback(callback)
    check_replaceable(dest)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    free = shutil.disk_usage(parent).free

    import fsspec

    try:
        opened = fsspec.open(tar_path, "rb", **(storage_options or {}))
        raw = opened.open()
    except FileNotFoundError:
        raise FileNotFoundError(f"tar_path {tar_path} does not exist; export a cache there with "
                                f"{fix_for('export a cache', tar=tar_path)}, or check the path.") from None
    with raw:
        size = getattr(raw, "size", None)
        if size is None:
            size = os.fstat(raw.fileno()).st_size if hasattr(raw, "fileno") else None
        cb.start_phase("import", unit="bytes", size=size)  # tar bytes read; then a "verify" phase in samples
        cb.set_description(f"importing {tar_path}")
        tmp = stage_dir(dest, "import")  # beside dest: a crash leaves a leftover nbkit ls lists and nbkit rm removes
        try:
            names = _extract(raw, tar_path, tmp, free, cb)
            check_whole(tmp, tar_path, _REEXPORT, cb, describe_as="verifying checksums")
            swap_into_place(tmp, dest)  # durable first, then in place in one step
        except Stopped:
            discard_stage(tmp)
            cb.set_description("stopped")
            return TransferReport(seconds=time.perf_counter() - start, stopped=True)
        except BaseException as e:
            discard_stage(tmp)
            if unnamed_full_disk(e):
                # The room checks passed but the writes still met a full disk (another writer took it).
                raise disk_full(dest, size, e, doing="import the cache into") from e
            raise
    cb.set_description("imported")
    files = tuple(n for n in names if n not in (MANIFEST, fmt.META)) + (fmt.META,)
    return TransferReport(files, (), sum(os.path.getsize(os.path.join(dest, n)) for n in files), time.perf_counter() - start)


def _extract(raw, tar_path, tmp: str, free: int, cb) -> list:
    """Check and write the members of the tar ``raw`` into ``tmp``; return the names written.

    Every member's size is checked before a byte of it is written: against the manifest's entry
    when the manifest came first (tars from this version), against the free disk always. With the
    manifest at the end (older tars) or no manifest, the sizes and sha256s are compared once it is
    read. ``nbkit.json`` is held as ``.nbkit.json.pending`` until then.
    """
    hashes, sizes, names = {}, {}, []
    manifest = None
    written = 0
    try:
        stream = _GuardedReader(open_decompressed(raw), free + _TAR_SLACK)
        # "r|" reads the tar as a stream: members are checked and written one at a time.
        with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK, tarinfo=_BoundedTarInfo) as tar:
            limit = _MAX_MEMBERS
            for count, m in enumerate(tar, 1):
                # Every member, skipped ones too: Stop ends the import within one header, and a tar
                # of thousands of empty members is refused at the first one past what a cache can have.
                _check_stop(cb)
                _check_count(count, limit, tar_path)
                name = _check_member(m, tar_path)
                if name is None:
                    continue
                if name in hashes:
                    raise UnsafeArchiveError(f"{tar_path} holds {name!r} twice; refusing to import it (a later copy could replace a checked one).")
                if name in (MANIFEST, fmt.META) and m.size > MAX_JSON_BYTES:
                    raise CorruptCacheError(f"{tar_path} holds a {name} of {m.size:,} bytes; a real one is a few KiB. {_REEXPORT}")
                if manifest is not None:
                    entry = manifest["files"].get(name)
                    if entry is None or entry["size"] != m.size:
                        raise CorruptCacheError(
                            f"{tar_path} holds {name} of {m.size:,} bytes, but its {MANIFEST} "
                            + ("does not list it" if entry is None else f"says {entry['size']:,}") + f". {_REEXPORT}")
                written += m.size
                if written > free:
                    check_free_disk(written, tmp, f"importing {tar_path}")
                sizes[name] = m.size
                names.append(name)
                if name == MANIFEST:  # read, never written (at most MAX_JSON_BYTES)
                    raw_manifest = tar.extractfile(m).read(m.size)
                    hashes[name] = hashlib.sha256(raw_manifest).hexdigest()
                    manifest = parse_manifest(raw_manifest, f"{tar_path}:{MANIFEST}", _REEXPORT)
                    if names == [MANIFEST]:
                        # The manifest came first: every size is known before anything else is written.
                        total = sum(e["size"] for e in manifest["files"].values())
                        check_free_disk(total, tmp, f"importing {tar_path}")
                        stream.limit = min(stream.limit, total + _TAR_SLACK + len(manifest["files"]) * 2 * _MAX_EXTENDED_HEADER)
                        limit = len(manifest["files"]) + 1 + _HARMLESS  # its files, itself, ./ and heap.lock
                    continue
                # nbkit.json makes a directory a cache: hold it under another name until all is checked.
                target = os.path.join(tmp, f".{fmt.META}.pending" if name == fmt.META else name)
                hashes[name] = _copy_member(tar, m, target, raw, cb)
                if name == fmt.META and manifest is not None and names == [MANIFEST, fmt.META]:
                    # Manifest and metadata first: check every size they claim against each other
                    # before any data file is written.
                    with open(target, "rb") as f:
                        meta = fmt.parse_meta(f.read(), f"{tar_path}:{fmt.META}", _REEXPORT)
                    sizes_claimed = {n: e["size"] for n, e in manifest["files"].items()}
                    check_file_set(meta, sizes_claimed, str(tar_path), _REEXPORT)
                    check_meta_sizes(meta, sizes_claimed, str(tar_path), _REEXPORT)
    except _Refused as e:
        raise UnsafeArchiveError(f"{tar_path} holds {e}; refusing to import it. {_REEXPORT}") from e
    except (_Damaged, tarfile.TarError) as e:
        raise CorruptCacheError(f"{tar_path} is not a readable tar archive, or was cut short ({e}). {_REEXPORT}") from e
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:  # from the decompressor, inside tarfile's own reads
        raise CorruptCacheError(f"{tar_path} is not a readable tar archive, or was cut short ({type(e).__name__}: {e}). "
                                f"{_REEXPORT}") from e
    if fmt.META not in hashes:
        raise CorruptCacheError(f"{tar_path} holds no {fmt.META}, so it is not an nbkit cache archive (or it was cut short). {_REEXPORT}")
    if manifest is not None:
        listed, extracted = set(manifest["files"]), set(hashes) - {MANIFEST}
        if listed != extracted:
            raise CorruptCacheError(
                f"{tar_path} does not hold the files its manifest lists (missing: {sorted(listed - extracted)}, "
                f"extra: {sorted(extracted - listed)}): it was cut short or changed. {_REEXPORT}"
            )
        for name, entry in manifest["files"].items():
            check_entry(str(tar_path), name, entry, hashes[name], sizes[name])
    os.rename(os.path.join(tmp, f".{fmt.META}.pending"), os.path.join(tmp, fmt.META))
    return names


def _copy_member(tar, m: tarfile.TarInfo, target: str, raw, cb) -> str:
    """Write member ``m`` to ``target`` (never more than its header's size); return its sha256."""
    h = hashlib.sha256()
    src = tar.extractfile(m)
    left = m.size
    with open(target, "xb") as out:
        while left > 0:
            chunk = src.read(min(CHUNK, left))
            if not chunk:
                raise CorruptCacheError(f"{m.name} ends early")  # tarfile raises ReadError first
            _check_stop(cb)
            left -= len(chunk)
            h.update(chunk)
            out.write(chunk)
            cb.absolute_update(raw.tell())  # compressed bytes read, like the size
    return h.hexdigest()


def _tar_manifest(tar_path, storage_options) -> dict | None:
    """``manifest.json`` of the archive at ``tar_path``, or ``None`` when it holds none (a tar from
    this version has it first, so only its head is read)."""
    import fsspec

    with fsspec.open(tar_path, "rb", **(storage_options or {})) as raw:
        try:
            stream = _GuardedReader(open_decompressed(raw), 1 << 62)
            with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK, tarinfo=_BoundedTarInfo) as tar:
                for count, m in enumerate(tar, 1):
                    _check_count(count, _MAX_MEMBERS, tar_path)
                    if m.name == MANIFEST and m.isreg():
                        if m.size > MAX_JSON_BYTES:
                            raise CorruptCacheError(f"{tar_path} holds a {MANIFEST} of {m.size:,} bytes; a real one is a few KiB. {_REEXPORT}")
                        return parse_manifest(tar.extractfile(m).read(), f"{tar_path}:{MANIFEST}", _REEXPORT)
        except _Refused as e:
            raise UnsafeArchiveError(f"{tar_path} holds {e}. {_REEXPORT}") from e
        except (_Damaged, tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
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
    tar_path = check_url(tar_path, "tar_path")
    fs, path = url_to_fs(tar_path, storage_options)
    if not fs.exists(path):
        return f"{tar_path} does not exist yet."
    manifest = _tar_manifest(tar_path, storage_options)
    if manifest is None:
        return f"{tar_path} holds no {MANIFEST} (it was not written by an nbkit export, or was cut short): export the cache again."
    root = cache_root(check_path(cache_path, "cache_path"))
    files = manifest["files"]
    with open_readable(os.path.join(root, fmt.META)) as f:
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
