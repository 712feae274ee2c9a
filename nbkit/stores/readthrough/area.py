"""The local area of a read-through cache, shared by every process of a host that reads one URL.

It holds ``nbkit.json``, ``manifest.json``, ``index.bin`` and a ``pieces/`` directory, in at most
``local_max_bytes``. A piece is fetched under its stripe's file lock (so once); every change to
``pieces/`` happens under the area lock; :func:`reserve` evicts least recently used pieces (their
mtime, set by :func:`stamp`) until a new piece fits, and bumps the area's generation so processes
drop their maps of evicted pieces.

Example:
    >>> import tempfile
    >>> root = tempfile.mkdtemp()
    >>> with area_lock(root):
    ...     bump_generation(root)
    >>> read_generation(root), area_usage(root)
    (1, 4096)
"""

from __future__ import annotations

import contextlib
import os
import time

from ... import format as fmt
from ...commit import atomic_write, file_lock, temp_pid
from ...errors import CorruptCacheError
from ...transfer.manifest import MANIFEST, REPUSH, check_bytes, digest, manifest_bytes
from ...stats import process_alive
from .geometry import rounded

__all__ = ["area_lock", "piece_lock", "bump_generation", "read_generation", "area_usage", "stamp", "replace_area",
           "read_listed", "reserve", "STRIPES", "WAIT_SECONDS"]

STRIPES = 64  # piece fetch locks (a piece's lock is its stripe key % 64)
WAIT_SECONDS = 120.0  # how long a fetch waits for room held by other processes' fetches in flight


def area_lock(root: str):
    """The lock every change to the area's pieces happens under (a context manager)."""
    return file_lock(os.path.join(root, "area.lock"))


def piece_lock(root: str, stripe: int):
    """The lock a piece is fetched under (so it is fetched once); ``stripe`` is the same in every process."""
    return file_lock(os.path.join(root, "locks", f"{stripe % STRIPES}.lock"))


def _gen_path(root: str) -> str:
    return os.path.join(root, "area.gen")


def bump_generation(root: str) -> None:
    """Count an eviction (caller holds the area lock): processes then drop maps of deleted pieces."""
    fd = os.open(_gen_path(root), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        raw = os.pread(fd, 8, 0)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else 0
        os.pwrite(fd, (n + 1).to_bytes(8, "little"), 0)
    finally:
        os.close(fd)


def read_generation(root: str) -> int:
    """How many evictions the area has seen."""
    try:
        with open(_gen_path(root), "rb") as f:
            return int.from_bytes(f.read(8), "little")
    except FileNotFoundError:
        return 0


def _top_usage(d: str, seen: set) -> int:
    # Counted by inode: a piece being renamed into place may show up under both names in one scan.
    total = 0
    try:
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return 0
    for e in entries:
        try:
            if e.is_file(follow_symlinks=False):
                st = e.stat(follow_symlinks=False)
                if st.st_ino not in seen:
                    seen.add(st.st_ino)
                    total += rounded(st.st_size)
        except FileNotFoundError:
            continue
    return total


def area_usage(root: str) -> int:
    """Bytes the local area at ``root`` holds (each file rounded up to 4 KiB)."""
    seen: set = set()
    return _top_usage(root, seen) + _top_usage(os.path.join(root, "pieces"), seen)


def stamp(path: str) -> None:
    """Mark a piece used now: its mtime orders eviction across processes (least recently used first).

    The time is given explicitly: the kernel stamps files with a coarse clock (one tick is several
    milliseconds), which would make the pieces of consecutive batches look equally old.
    """
    now = time.time_ns()
    with contextlib.suppress(FileNotFoundError):
        os.utime(path, ns=(now, now))


def replace_area(root: str, fs, rroot: str, url: str, manifest: dict, meta_raw: bytes) -> None:
    """Make the local area hold this manifest's index (caller holds the area lock): the manifest
    file goes last, so an area is trusted only once index and metadata are in place."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(root, MANIFEST))
    tag = digest(manifest)
    pieces = os.path.join(root, "pieces")
    if os.path.isdir(pieces):
        for e in os.scandir(pieces):
            if not e.name.startswith((".", tag)):  # pieces of another (older) cache at this URL
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
    bump_generation(root)
    index = read_listed(fs, rroot, url, manifest, fmt.INDEX)  # its size was checked against the metadata (Geometry)
    atomic_write(os.path.join(root, fmt.INDEX), index)
    atomic_write(os.path.join(root, fmt.META), meta_raw)
    atomic_write(os.path.join(root, MANIFEST), manifest_bytes(manifest))


def read_listed(fs, rroot: str, url: str, manifest: dict, name: str) -> bytes:
    """The object ``name`` under ``url``, read with one request of at most the size its manifest entry
    says plus one byte (a longer object then fails its entry too), checked against that entry.

    Raises:
        CorruptCacheError: the manifest does not list ``name``, or the bytes read do not match its entry.
        FileNotFoundError: the object is not there.
    """
    entry = manifest["files"].get(name)
    if entry is None:
        raise CorruptCacheError(f"{url}/{MANIFEST} does not list {name}. {REPUSH}")
    data = fs.cat_file(f"{rroot}/{name}", start=0, end=entry["size"] + 1)
    check_bytes(url, name, manifest, data)
    return data


def reserve(root: str, limit: int, tmp: str, nbytes: int) -> tuple[int, int]:
    """Make room for a piece of ``nbytes`` (evicting least recently used pieces), then create the
    temporary file ``tmp`` of that size (counted at its full size from then on).

    Returns:
        ``(evicted, used)``: pieces evicted, and the bytes the area holds with the new piece.

    Raises:
        OSError: other processes' pieces in flight kept the area full for :data:`WAIT_SECONDS`.
    """
    pieces = os.path.join(root, "pieces")
    need = rounded(nbytes)
    deadline = time.monotonic() + WAIT_SECONDS
    evicted = 0
    while True:
        with area_lock(root):
            used = _top_usage(root, set())
            evictable = []
            for e in os.scandir(pieces):
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.endswith(".tmp"):
                    pid = temp_pid(e.name)
                    if pid is not None and not process_alive(pid):
                        os.unlink(e.path)  # left by a process that died mid-fetch
                        continue
                else:
                    evictable.append((st.st_mtime_ns, rounded(st.st_size), e.path))
                used += rounded(st.st_size)
            now_evicted = 0
            for _, size, path in sorted(evictable):  # least recently used first
                if used + need <= limit:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                used -= size
                now_evicted += 1
            if now_evicted:
                bump_generation(root)
                evicted += now_evicted
            if used + need <= limit:
                fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.ftruncate(fd, nbytes)
                finally:
                    os.close(fd)
                return evicted, used + need
        if time.monotonic() > deadline:
            raise OSError(f"the local area {root} (local_max_bytes={limit}) stayed full of pieces being fetched by other "
                          f"processes for {WAIT_SECONDS:.0f} s; give it more room (local_max_bytes) or read with fewer "
                          "processes.")
        time.sleep(0.05)
