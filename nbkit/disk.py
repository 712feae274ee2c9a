"""Disk space: the caches on this machine: list them (:func:`caches`), remove one safely (:func:`remove`), and
prune working copies of remote caches (:func:`prune`), as ``huggingface-cli scan-cache`` /
``delete-cache`` do for the Hugging Face hub.

Everything read from the directories is untrusted: metadata is parsed by ``nbkit.format``, a
directory that does not read as a cache is listed with the reason, links are never followed, and
the walk goes at most ``max_depth`` directories down. A cache is *in use* while a process has its
files open (``nbkit.cachedir.in_use``: each holds a shared ``flock`` on its ``nbkit.json``).

Example:
    >>> import tempfile, torch, nbkit
    >>> root = tempfile.mkdtemp()
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8)), root + "/mnist")
    >>> _ = ds.warmup(); del ds
    >>> [(c.name, c.stored, c.length, c.in_use) for c in caches(root) if not c.working_copy]
    [('mnist', 8, 8, False)]
    >>> remove(root + "/mnist").left
    ()
"""

from __future__ import annotations

import dataclasses
import datetime
import errno
import os
import re
import stat
import time
from dataclasses import dataclass

from . import format as fmt
from . import trust
from .cachedir import PARTS_SUFFIX, PartsListing, allocated, is_part_name, interrupted, in_use, parts_listing, remove_cache, stored_count, unused
from .commit import Dir, is_claimed, leftover_of, staging_name
from .stores.mirror import ORIGIN_SUFFIX, cache_dir, read_origin
from .stores.readthrough.location import AREA_SUFFIX
from .text import (Table, fill, fix as fix_for, format_age, format_bytes, format_count, format_list, plural,
                   printable)

__all__ = ["CacheInfo", "CacheList", "Removal", "Removals", "caches", "remove", "prune", "not_a_directory", "MAX_DEPTH"]

#: How many directories below a root :func:`caches` looks for caches.
MAX_DEPTH = 6


@dataclass(frozen=True)
class CacheInfo:
    """One cache directory found by :func:`caches`.

    Attributes:
        path: the directory.
        url: the remote URL a working copy mirrors (``None`` for a local cache, or a working copy
            whose origin file is missing).
        working_copy: whether it lives under ``$NBKIT_CACHE_DIR`` (``nbkit.prune`` may remove it).
        stored, length: samples cached of the total (``None`` when the cache does not read).
        bytes: bytes allocated on disk (real blocks: column files are preallocated, sparse where
            the filesystem allows).
        version: its format version.
        last_used: when it was last written, or (a working copy) last opened; seconds since the epoch.
        in_use: whether a process has it open now.
        problem: why the directory does not read as a cache, or ``None``.
    """

    path: str
    url: str | None
    working_copy: bool
    stored: int | None
    length: int | None
    bytes: int
    version: int | None
    last_used: float | None
    in_use: bool
    problem: str | None = None

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @property
    def leftover(self) -> bool:
        """Whether this is what an interrupted operation left (``nbkit rm`` removes it), not a cache."""
        return self.problem is not None and self.problem.startswith("leftover of ")

    @property
    def complete(self) -> bool:
        return self.problem is None and self.stored is not None and self.stored == self.length

    def to_json(self) -> dict:
        """A plain dict (for ``nbkit ls --json``)."""
        return {**dataclasses.asdict(self), "complete": self.complete, "leftover": self.leftover}


class CacheList(list):
    """The list :func:`caches` returns; shows as a table in a terminal or a notebook."""

    def table(self) -> Table:
        """The caches as a :class:`nbkit.text.Table` (every column, full paths: for HTML), with their total size as a note."""
        now = time.time()
        rows = []
        for c in self:
            used = "-" if c.last_used is None else format_age(now - c.last_used)
            rows.append((c.path, self._samples(c), format_bytes(c.bytes), used, "yes" if c.in_use else "", c.url or c.problem or ""))
        return Table(rows, header=("path", "samples", "on disk", "last used", "in use", "mirrors / problem"),
                     align="lrrrll", notes=[self._total()])

    def text(self, width: int | None = None) -> str:
        """The caches in ``width`` columns, one line each: the short columns first, the path last,
        never cut (it is copied from here into the next command): a path that does not fit goes
        alone on the next line, indented and whole (``width=None``: every row on one line, for a
        pipe or a file); what a working copy mirrors, or why a directory is not a whole cache, on an
        indented line under it, filled to ``width``.

        Example:
            >>> c = CacheInfo("/data/caches/mnist", None, False, 60000, 60000, 190_100_000, 1, None, False)
            >>> print(CacheList([c]).text(60))
            samples        on disk   last used  path
            60,000/60,000  190.1 MB  -          /data/caches/mnist
            1 cache, 190.1 MB on disk
            >>> print(CacheList([c]).text(40))
            samples        on disk   last used  path
            60,000/60,000  190.1 MB  -
                /data/caches/mnist
            1 cache, 190.1 MB on disk
        """
        now = time.time()
        in_use = any(c.in_use for c in self)
        header = ("samples", "on disk", "last used") + (("in use",) if in_use else ()) + ("path",)
        rows = [(self._samples(c), format_bytes(c.bytes), "-" if c.last_used is None else format_age(now - c.last_used))
                + (("yes" if c.in_use else "",) if in_use else ()) for c in self]
        widths = [max(len(r[k]) for r in rows + [header[:-1]]) for k in range(len(header) - 1)]
        room = None if width is None else max(12, width - sum(widths) - 2 * len(widths))

        def line(cells, path):
            return "  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + path

        out = [line(header[:-1], "path")]
        for c, r in zip(self, rows):
            path = printable(c.path)
            if room is None or len(path) <= room:
                out.append(line(r, path).rstrip())
            else:
                out += [line(r, "").rstrip(), "    " + path]
            under = f"mirrors {c.url}" if c.url else c.problem
            if under:
                under = printable(under) if width is None else fill(printable(under), max(20, width - 4))
                out.append("    " + under.replace("\n", "\n    "))
        return "\n".join(out + [self._total()])

    @staticmethod
    def _samples(c) -> str:
        return ("leftover" if c.leftover else "broken") if c.problem else f"{format_count(c.stored)}/{format_count(c.length)}"

    def _total(self) -> str:
        return self._count() + f", {format_bytes(sum(c.bytes for c in self))} on disk"

    def _count(self) -> str:
        left = sum(c.leftover for c in self)
        text = plural(len(self) - left, "cache")
        return text + (f", {plural(left, 'leftover')} of interrupted operations ({fix_for('remove leftovers')} removes them)" if left else "")

    def __repr__(self) -> str:
        import shutil

        return self.text(shutil.get_terminal_size().columns)

    __str__ = __repr__

    def _repr_html_(self) -> str:
        return self.table().html()


@dataclass(frozen=True)
class Removal:
    """What :func:`remove` or :func:`prune` removed (or, with ``dry_run``, would remove).

    Attributes:
        path: the cache directory.
        bytes: bytes freed on disk.
        left: names left in the directory because they are not cache files (the directory stays).
    """

    path: str
    bytes: int
    left: tuple = ()

    def to_json(self) -> dict:
        return {"path": self.path, "bytes": self.bytes, "left": list(self.left)}


def _files_of(root: str) -> list[tuple[str, os.stat_result]]:
    """``(name, lstat)`` of the plain entries directly in ``root`` (links are not followed)."""
    out = []
    with os.scandir(root) as it:
        for entry in it:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                out.append((entry.name, st))
    return out


def _first_line(e: BaseException) -> str:
    return (str(e) or type(e).__name__).splitlines()[0]


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _tree_bytes(path: str) -> int:
    """Bytes allocated by ``path`` and everything below it, links not followed.

    The tree is untrusted (a leftover, a part of a stranger's: a 3,000-level directory chain, paths
    past ``PATH_MAX``): it is walked with an explicit stack of names, one directory descriptor held
    at a time, each name resolved against it; going back up opens ``..`` and checks it is the very
    directory it came from (a tree moved meanwhile ends the count, which stands as far as it got).
    """
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    total = allocated(st)
    if not stat.S_ISDIR(st.st_mode):
        return total
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError:
        return total
    try:
        mine = os.fstat(fd)
        ids = [(mine.st_dev, mine.st_ino)]
        pending = [os.listdir(fd)]  # names still to visit, one list per level
    except OSError:
        os.close(fd)
        return total
    try:
        while pending:
            if not pending[-1]:  # this level is done: back up to its parent, the same one as before
                pending.pop()
                ids.pop()
                if not pending:
                    break
                up = os.open("..", _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = up
                there = os.fstat(fd)
                if (there.st_dev, there.st_ino) != ids[-1]:
                    break
                continue
            name = pending[-1].pop()
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            total += allocated(st)
            if not stat.S_ISDIR(st.st_mode):
                continue
            try:
                sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            try:
                names = os.listdir(sub)
                there = os.fstat(sub)
            except OSError:
                os.close(sub)
                continue
            os.close(fd)
            fd = sub
            ids.append((there.st_dev, there.st_ino))
            pending.append(names)
    except OSError:
        pass  # unreadable below here: what was counted stands
    finally:
        os.close(fd)
    return total


def leftover_problem(path: str) -> str | None:
    """Why ``path`` is a leftover (what left it, and how to remove it), or ``None`` if it is not one.

    Example:
        >>> import tempfile
        >>> left = os.path.join(tempfile.mkdtemp(), ".c.nbkit-pull-0123456789ab"); os.mkdir(left)
        >>> leftover_problem(left).split(";")[0]
        'leftover of an interrupted pull (a copy being downloaded or the cache it replaced)'
    """
    return _leftover_problem(path, path)


def _leftover_problem(path: str, at: str) -> str | None:
    """:func:`leftover_problem` of ``path``, read through ``at`` (a path naming the same entry by
    descriptor: ``/proc/self/fd/N/<name>``, any length)."""
    left = leftover_of(os.path.basename(path))
    if left is not None:
        what = left[1]
    elif os.path.isdir(at) and not os.path.islink(at) and (marked := interrupted(at)) is not None:
        what = f"{marked} (its files are no cache and are never reused)"
    else:
        return None
    busy = " (still being written by a running process)" if is_claimed(at) else ""
    return f"leftover of {what}{busy}; {fix_for('remove', path=path)} removes it"


def describe(root: str, *, at: str | None = None) -> CacheInfo:
    """The :class:`CacheInfo` of one directory holding ``nbkit.json`` (never raises for a broken one),
    a leftover, or a build's parts directory; read through ``at`` when given (the same entry named by
    a directory descriptor, ``/proc/self/fd/N/<name>``: a path of any length, resolved once).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); _ = open(d + "/nbkit.json", "w").write("{")
        >>> describe(d).problem.split(" (")[0]
        '.../nbkit.json is not valid JSON'
    """
    at = root if at is None else at
    working_copy = os.path.dirname(root) == cache_dir()
    parts = _parts_at(root, at)
    leftover = _leftover_problem(root, at) or (None if parts is None else _parts_problem(root, parts))
    if leftover is not None:
        try:
            mtime = os.lstat(at).st_mtime
        except OSError:
            mtime = None
        busy = is_claimed(at) or (parts is not None and parts.claimed > 0)
        return CacheInfo(path=root, url=None, working_copy=working_copy, stored=None, length=None, bytes=_tree_bytes(at),
                         version=None, last_used=mtime, in_use=busy, problem=leftover)
    root, shown = at, root  # every read below goes through ``at``
    try:
        files = _files_of(root)
    except OSError as e:  # unreadable (permissions), or removed meanwhile
        return CacheInfo(path=shown, url=None, working_copy=working_copy, stored=None, length=None, bytes=0,
                         version=None, last_used=None, in_use=False, problem=_first_line(e))
    size = sum(allocated(st) for _, st in files)
    last_used = max((st.st_mtime for _, st in files), default=None)
    url = None
    if working_copy:
        try:
            url = read_origin(shown)["url"]
            last_used = max(last_used or 0.0, os.lstat(shown + ORIGIN_SUFFIX).st_mtime)
        except (OSError, ValueError):
            pass  # a copy made before nbkit recorded its origin, or a damaged origin file: no URL
    stored = length = version = None
    problem = None
    try:
        busy = in_use(root)
    except (OSError, ValueError) as e:  # nbkit.json a link (UnsafeArchiveError), a fifo, unreadable
        busy = False
        problem = _first_line(e)
    if problem is None:
        try:
            meta = fmt.read_meta(root)
            version = int(meta["version"])
            stored, length = stored_count(root)
        except (OSError, ValueError) as e:  # CorruptCacheError is a ValueError
            problem = _first_line(e)
    return CacheInfo(path=shown, url=url, working_copy=working_copy, stored=stored, length=length, bytes=size,
                     version=version, last_used=last_used, in_use=busy, problem=problem)


def _parts_at(root: str, at: str) -> PartsListing | None:
    """What ``root`` (read through ``at``) holds if it is a build's parts directory (``<cache>.parts``,
    :mod:`nbkit.cluster`: parts not merged yet, and leftovers of part builds); else ``None``."""
    if not root.endswith(PARTS_SUFFIX) or os.path.islink(at) or not os.path.isdir(at):
        return None
    try:
        with Dir(at) as d:
            return parts_listing(d)
    except (OSError, ValueError):
        return None


def _parts_problem(root: str, listing: PartsListing) -> str:
    held = f", {plural(listing.claimed, 'part')} being built by a running process" if listing.claimed else ""
    return (f"leftover of an unfinished build of {root[: -len(PARTS_SUFFIX)]}: {plural(listing.parts, 'part')} not "
            f"merged yet, {plural(listing.builds, 'interrupted part build')}{held}; rerun the build to merge them, or "
            f"{fix_for('remove', path=root)} removes them")


#: Directory entries a search (:func:`caches`) looks at, at most: an untrusted tree of millions of
#: names is cut short, not walked for hours.
MAX_ENTRIES = 1_000_000


def _walk(root: str, depth: int, found: dict) -> None:
    """Describe into ``found`` (path: :class:`CacheInfo`) every cache, leftover and parts directory
    under ``root``, ``depth`` levels down at most: an explicit stack of directories held open (never
    more than ``depth + 1`` descriptors), each name resolved against its parent's descriptor (no
    path is resolved twice, none is limited by ``PATH_MAX``), links never followed."""

    def add(path: str, at: str) -> None:
        if path not in found:
            found[path] = describe(path, at=at)

    def is_found(d: Dir, parts: bool = True) -> bool:
        """A cache, what an interrupted removal or creation left, or (``parts``) a build's parts directory."""
        return (d.exists(fmt.META) or interrupted(d.anchor) is not None
                or (parts and d.path.endswith(PARTS_SUFFIX) and parts_listing(d) is not None))

    try:
        top = Dir(root)
    except (OSError, ValueError):
        return  # not ours to read, a link, or gone meanwhile
    if is_found(top, parts=False):  # a parts directory given as the root: its parts and leftovers, one by one
        add(root, root)
        top.close()
        return  # a cache holds no caches
    stack, seen = [], 0
    try:
        if depth > 0:
            try:
                stack.append((top, iter(top.names()), depth))
            except OSError:
                top.close()
        else:
            top.close()
        while stack:
            d, names, left = stack[-1]
            name = next(names, None)
            seen += 1
            if name is None or seen > MAX_ENTRIES:
                stack.pop()
                d.close()
                continue
            if leftover_of(name) is not None:  # a staged copy or temporary file an interrupted operation left
                add(d.join(name), os.path.join(d.anchor, name))
                continue
            st = d.lstat(name)
            if st is None or not stat.S_ISDIR(st.st_mode) or name.endswith(AREA_SUFFIX):
                continue
            try:
                sub = Dir(name, parent=d)
            except (OSError, ValueError):
                continue  # not ours to read, swapped for a link, or gone meanwhile
            if is_found(sub):
                add(sub.path, os.path.join(d.anchor, name))  # by its parent's descriptor: the name is no link
                sub.close()
            elif left > 1:
                try:
                    stack.append((sub, iter(sub.names()), left - 1))
                except OSError:
                    sub.close()
            else:
                sub.close()
    finally:
        for d, _, _ in stack:
            d.close()


def caches(*roots, max_depth: int = MAX_DEPTH, storage_options: dict | None = None) -> CacheList:
    """The caches under ``roots`` (directories searched, links never followed, at most ``max_depth``
    levels down) and every working copy under ``$NBKIT_CACHE_DIR`` (default ``~/.cache/nbkit``).

    The parts an unfinished build left beside a cache (``<cache>.parts``, :mod:`nbkit.cluster`) are
    one entry (a leftover :func:`remove` removes); given as a root, its parts and leftovers are listed
    one by one. A root that is a URL (``gs://bucket/caches``, with ``storage_options``) lists the
    parts prefixes an unfinished build uploaded under it.

    Returns:
        A :class:`CacheList` of :class:`CacheInfo`, least recently used first; it prints as a table.

    Example:
        >>> import tempfile
        >>> caches(tempfile.mkdtemp(), max_depth=2).table().notes[0].split(",")[0].endswith("caches")
        True
    """
    max_depth = trust.check_int(max_depth, "max_depth", min=0, max=64)
    roots = [trust.check_path(r, "root") for r in roots]
    urls = [trust.check_url(r, "root") for r in roots if _is_url(r)]
    dirs = [os.path.abspath(os.path.expanduser(r)) for r in roots if not _is_url(r)]
    for d in dirs:
        if not os.path.isdir(d):
            why = not_a_directory(d, "look for caches in it")
            if why is not None:
                raise NotADirectoryError(why)
            raise FileNotFoundError(f"no directory {d} to look for caches in; check the path ({fix_for('list caches')} "
                                    "alone lists the working copies in $NBKIT_CACHE_DIR)")
    found: dict = {}
    for url in urls:
        for info in _remote_parts(url, storage_options):
            found.setdefault(info.path, info)
    for d in dirs + [cache_dir()]:
        if os.path.isdir(d):
            _walk(d, max_depth, found)
    return CacheList(sorted(found.values(), key=lambda c: (c.last_used or 0.0, c.path)))


_TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.zst", ".tzst")


def not_a_directory(path: str, doing: str = "use it") -> str | None:
    """Why ``path`` cannot be a cache directory because it is a file (a tar, a cache's ``nbkit.json``, any
    other file), with the fix; ``None`` when it is not a file. For the message of a command given a
    file where a cache directory is expected (rather than ``[Errno 20] Not a directory``).

    Example:
        >>> import tempfile, os
        >>> tar = os.path.join(tempfile.mkdtemp(), "mnist.tar"); open(tar, "wb").close()
        >>> print(not_a_directory(tar, "show it"))
        ... # doctest: +ELLIPSIS
        cannot show it: .../mnist.tar is a tar archive, not a cache directory. Unpack it into a cache directory with nbkit.import_tar('.../mnist.tar', cache_dir); then open it with nbkit.CachedDataset.open(cache_dir).
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        return None
    if os.path.basename(path) == fmt.META:
        return (f"cannot {doing}: {path} is the metadata file of a cache, not the cache; "
                f"give its directory {os.path.dirname(path)}.")
    if path.lower().endswith(_TAR_SUFFIXES) or _is_tar(path):
        return (f"cannot {doing}: {path} is a tar archive, not a cache directory. Unpack it into a cache directory "
                f"with {fix_for('import a tar', tar=path)}; then {fix_for('show a cache')}.")
    return (f"cannot {doing}: {path} is a file, not a cache directory (a directory holding {fmt.META}); "
            f"{fix_for('list caches')} lists the caches there are.")


def _is_tar(path: str) -> bool:
    import tarfile

    try:
        return tarfile.is_tarfile(path)
    except OSError:
        return False


def _refuse_special(path: str) -> None:
    """``/``, the home directory and the working copies' directory are never removed whole."""
    special = {os.path.abspath(os.sep), os.path.abspath(os.path.expanduser("~")), cache_dir()}
    if os.path.abspath(path) in special:
        raise ValueError(f"refusing to remove {path}: it is a root directory, not one cache. Pass the cache "
                         f"directory itself (see {fix_for('list caches')}).")


def remove(path, *, dry_run: bool = False, storage_options: dict | None = None) -> Removal:
    """Remove one cache directory: its cache files, then the directory if nothing else is in it, and
    the parts of its unfinished build beside it (``<cache>.parts``); or such a parts directory, or a
    leftover of an interrupted operation; or, at a URL (``gs://…/cache.parts``, with
    ``storage_options``), the parts an unfinished build uploaded.

    Refuses anything that is not an nbkit cache (a readable ``nbkit.json``), a cache a process has
    open, parts a running build is writing, a path that is a symbolic link, ``/`` and the home
    directory. Links inside are removed themselves, never what they point to.

    Returns:
        A :class:`Removal`: bytes freed, and the names left behind (not cache files).

    Raises:
        FileNotFoundError, NotADirectoryError: nothing to remove there.
        ValueError: not a cache, a link, or a root directory.
        OSError: ``errno.EBUSY`` when a process uses it.

    Example:
        >>> import tempfile, pytest
        >>> with pytest.raises(ValueError, match="not an nbkit cache"):
        ...     remove(tempfile.mkdtemp())
    """
    path = trust.check_path(path, "path")
    dry_run = trust.check_bool(dry_run, "dry_run")
    if _is_url(path):
        return _remove_remote_parts(trust.check_url(path, "path"), dry_run, storage_options)
    root = os.path.abspath(os.path.expanduser(path))
    _refuse_special(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        raise FileNotFoundError(f"nothing to remove at {root}: no such directory. See the caches there are: "
                                f"{fix_for('list caches')}") from None
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"refusing to remove {root}: it is a symbolic link (to {os.readlink(root)}), and nbkit never "
                         "follows links. Remove the link itself with rm, or pass the cache directory it points to.")
    if leftover_problem(root) is not None:  # a leftover file too (a tar an interrupted export was writing)
        return _remove_leftover(root, dry_run)
    if _parts_at(root, root) is not None:
        return _remove_parts(root, dry_run)
    if stat.S_ISREG(st.st_mode):
        raise NotADirectoryError(not_a_directory(root, "remove it"))
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{root} is not a directory, so not an nbkit cache; nothing was removed")
    # Held open once: every step below works on this directory, even if the path is swapped meanwhile
    # (for a link, or for another cache): no path is resolved twice.
    with Dir(root) as d:
        here = d.anchor
        try:
            fmt.read_meta(here)
        except (FileNotFoundError, ValueError) as e:  # CorruptCacheError, UnsafeArchiveError are ValueErrors
            why = f"it has no {fmt.META}" if isinstance(e, FileNotFoundError) else _first_line(e)
            raise ValueError(f"refusing to remove {root}: it is not an nbkit cache ({why}). nbkit removes only cache "
                             "directories; delete anything else yourself.") from e
        with unused(here) as free:
            if not free:
                raise OSError(errno.EBUSY, f"refusing to remove {root}: a process has the cache open (a dataset, a "
                              "DataLoader worker, a training run). Close it with ds.close() (or open it in a `with "
                              "CachedDataset(...) as ds:` block), or end that process, and remove it again.")
            files = _files_of(here)
            size = sum(allocated(s) for name, s in files if trust.is_cache_file(name) or name == fmt.LOCK
                       or leftover_of(name) is not None)
            if not dry_run:
                remove_cache(d)  # metadata first, durably; never follows a link
        left = () if dry_run else tuple(d.names())
        if not dry_run and not left:
            _rmdir_if(d, root)
    # The parts of its unfinished build beside it: of no use without it (their generation names it).
    parts = root + PARTS_SUFFIX
    if _parts_at(parts, parts) is not None:
        try:
            size += _remove_parts(parts, dry_run).bytes
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise
            left += (f"{os.path.basename(parts)} (beside it: {_first_line(e).split(': ', 1)[-1]})",)
    return Removal(root, size, left)


def _remove_parts(root: str, dry_run: bool) -> Removal:
    """Remove the parts directory ``root`` of a build (:mod:`nbkit.cluster`) whole: refused while a
    running build writes into it; renamed to a removal leftover first (one step: from then on no
    build finds a part there, and a crash leaves a name ``nbkit ls`` lists), then deleted through
    descriptors (links removed, never followed; a tree of any depth)."""
    parent, name = os.path.split(root)
    with Dir(parent) as p:
        try:
            d = Dir(name, parent=p)
        except FileNotFoundError:
            raise FileNotFoundError(f"nothing to remove at {root}: no such directory") from None
        with d:
            listing = parts_listing(d)
            if listing is None:
                raise ValueError(f"refusing to remove {root}: it holds more than parts and their leftovers; delete it "
                                 "yourself")
            if listing.claimed:
                raise OSError(errno.EBUSY, f"refusing to remove {root}: a running build is writing "
                              f"{plural(listing.claimed, 'part')} into it. Let it finish or stop it (its finished parts "
                              "are kept), then remove it again.")
            mine = os.fstat(d.fd)
        size = _tree_bytes(os.path.join(p.anchor, name))
        if dry_run:
            return Removal(root, size)
        st = p.lstat(name)
        if st is None or (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            raise FileNotFoundError(f"{root} changed while it was being removed; nothing was removed. List it again "
                                    f"({fix_for('list caches')})")
        trash = staging_name(name, "trash")
        p.rename(name, trash)
        p.sync()
        p.remove_tree(trash)
        p.sync()
    return Removal(root, size)


def _is_url(path: str) -> bool:
    return re.match(r"[A-Za-z][A-Za-z0-9+.\-]*://", path) is not None


def _parts_prefix(fs, root: str) -> tuple[int, int, int] | None:
    """``(parts, objects, bytes)`` under the prefix ``root`` (on ``fs``) if it holds a build's parts
    only (``part-<start>-<stop>/`` and compose's scratch ``.compose/``); else ``None``."""
    try:
        entries = fs.ls(root, detail=True)
    except FileNotFoundError:
        return None
    parts = 0
    for e in entries:
        name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") != "directory" or not (is_part_name(name) or name == ".compose"):
            return None
        parts += is_part_name(name)
    found = fs.find(root, detail=True)
    return parts, len(found), sum(int(e.get("size") or 0) for e in found.values())


def _remote_parts(url: str, storage_options: dict | None) -> list:
    """A :class:`CacheInfo` (a leftover) for each build's parts prefix at or directly under ``url``."""
    from .transfer.remote import check_bucket, connect, remote_errors

    url = check_bucket(url, "root").rstrip("/")
    fix = f"{fix_for('list caches')} again once the storage answers"
    fs, root = connect(url, storage_options, doing="listing the parts under", fix=fix)
    out = []
    with remote_errors(fs, url, "listing the parts under", fix):
        fs.invalidate_cache()
        if url.endswith(PARTS_SUFFIX):
            candidates = [(url, root)]
        else:
            try:
                entries = fs.ls(root, detail=True)
            except FileNotFoundError:
                entries = []
            candidates = []
            for e in entries:
                name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
                if e.get("type") == "directory" and name.endswith(PARTS_SUFFIX):
                    candidates.append((f"{url}/{name}", f"{root}/{name}"))
        for where, prefix in candidates:
            held = _parts_prefix(fs, prefix)
            if held is None:
                continue
            parts, objects, size = held
            problem = (f"leftover of an unfinished build of {where[: -len(PARTS_SUFFIX)]}: {plural(parts, 'part')} uploaded, "
                       f"not composed yet; rerun the build to compose them, or {fix_for('remove', path=where)} removes them")
            out.append(CacheInfo(path=where, url=None, working_copy=False, stored=None, length=None, bytes=size,
                                 version=None, last_used=None, in_use=False, problem=problem))
    return out


def _remove_remote_parts(url: str, dry_run: bool, storage_options: dict | None) -> Removal:
    """Remove the parts an unfinished build uploaded under ``url`` (``<cache>.parts``), and only those:
    a prefix holding anything else is refused. A build running meanwhile finds its parts gone and
    builds them again."""
    from .transfer.remote import check_bucket, connect, remote_errors

    url = check_bucket(url, "path").rstrip("/")
    if not url.endswith(PARTS_SUFFIX):
        raise ValueError(f"refusing to remove {url}: nbkit removes a remote cache's parts ({url}{PARTS_SUFFIX}, what an "
                         f"unfinished build uploaded), never a remote cache. {fix_for('list caches')} with the URL of "
                         "their folder lists them.")
    fix = f"{fix_for('remove', path=url)} again once the storage answers"
    fs, root = connect(url, storage_options, doing="removing the parts at", fix=fix, write=not dry_run)
    with remote_errors(fs, url, "removing the parts at", fix):
        fs.invalidate_cache()
        held = _parts_prefix(fs, root)
        if held is None:
            if not fs.exists(root):
                raise FileNotFoundError(f"nothing to remove at {url}: no parts there. See what there is: "
                                        f"{fix_for('list caches')}")
            raise ValueError(f"refusing to remove {url}: it holds more than a build's parts (part-<start>-<stop>/); "
                             "delete it yourself")
        if not dry_run:
            fs.rm(root, recursive=True)
            fs.invalidate_cache()
    return Removal(url, held[2])


def _rmdir_if(d: Dir, root: str) -> None:
    """Remove the empty directory ``d`` (at ``root``) from its parent, and a working copy's files beside it."""
    parent, name = os.path.split(root)
    with Dir(parent) as p:
        st = p.lstat(name)
        mine = os.fstat(d.fd)
        if st is None or (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
            return  # something else is at the path now: never touched
        try:
            os.rmdir(name, dir_fd=p.fd)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                return
            raise
        if parent == cache_dir():  # a working copy's files beside it
            for suffix in (ORIGIN_SUFFIX, ".lock"):
                p.remove_tree(name + suffix)  # a file, or whatever replaced it (a directory): never followed
        p.sync()


def _remove_leftover(root: str, dry_run: bool) -> Removal:
    """Remove what an interrupted operation left at ``root`` (see :func:`leftover_problem`)."""
    if is_claimed(root):
        raise OSError(errno.EBUSY, f"refusing to remove {root}: a running process is still writing it (an import, pull "
                      "or export in progress). Let it finish or stop it, then remove it again.")
    size = _tree_bytes(root)
    if dry_run:
        return Removal(root, size)
    if leftover_of(os.path.basename(root)) is not None:
        parent, name = os.path.split(root)
        with Dir(parent) as p:
            p.remove_tree(name)  # through descriptors: links inside are removed, never followed
            p.sync()
        return Removal(root, size)
    with Dir(root) as d:  # cache files without nbkit.json: the data files, then the directory if empty
        remove_cache(d)
        left = tuple(d.names())
        if not left:
            _rmdir_if(d, root)
    return Removal(root, size, left)


_MAX_AGE = datetime.timedelta.max.total_seconds()  # what a timedelta holds; beyond it, inf, NaN: refused


def _seconds(older_than) -> float | None:
    if older_than is None:
        return None
    if isinstance(older_than, datetime.timedelta):
        older_than = older_than.total_seconds()
    if isinstance(older_than, bool) or not isinstance(older_than, (int, float)):
        raise TypeError(f"older_than must be seconds (a number >= 0) or a datetime.timedelta, got {trust.shown(older_than)}")
    if not 0 <= older_than <= _MAX_AGE:  # NaN compares false: it would keep every copy, silently
        raise ValueError(f"older_than must be a number of seconds in [0, {_MAX_AGE:.0f}] (e.g. 7 * 86400 for a week) or a "
                         f"datetime.timedelta, got {trust.shown(older_than)}")
    return float(older_than)


def prune(older_than=None, max_bytes=None, *, dry_run: bool = False) -> list[Removal]:
    """Remove working copies under ``$NBKIT_CACHE_DIR``: those unused for ``older_than``, then the
    least recently used until the rest fit in ``max_bytes``; copies in use are skipped.

    Args:
        older_than: seconds, or a ``datetime.timedelta``.
        max_bytes: the most bytes the working copies that stay may take.
        dry_run: only say what would be removed.

    Returns:
        A :class:`Removal` for each copy removed (or that would be), least recently used first.

    Example:
        >>> import tempfile
        >>> from unittest import mock
        >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):
        ...     prune(older_than=0, dry_run=True)
        []
    """
    age = _seconds(older_than)
    limit = None if max_bytes is None else trust.check_size(max_bytes, "max_bytes")
    dry_run = trust.check_bool(dry_run, "dry_run")
    # Least recently used first. A hidden name is the temporary sibling of a pull or import in progress
    # (``.<copy>.pull-…``): never pruned (``nbkit ls`` lists one a crash left, ``nbkit rm`` removes it).
    listed = caches(max_depth=1)
    removed = []
    # What interrupted pulls left (unless a running one still writes it) is never worth keeping.
    for c in listed:
        if c.working_copy and c.leftover and not c.in_use:
            try:
                removed.append(remove(c.path, dry_run=dry_run))
            except (OSError, ValueError):
                continue  # claimed or gone since it was listed
    copies = [c for c in listed if c.working_copy and not c.leftover and not c.name.startswith(".")]
    now = time.time()
    kept = sum(c.bytes for c in copies)
    for c in copies:
        too_old = age is not None and (c.last_used is None or now - c.last_used >= age)
        too_big = limit is not None and kept > limit
        if not (too_old or too_big) or c.in_use:
            continue
        try:
            done = remove(c.path, dry_run=dry_run)
        except ValueError:
            continue  # its nbkit.json does not read: not a cache nbkit removes (listed as broken)
        except OSError as e:
            if e.errno == errno.EBUSY:
                continue  # opened since it was listed
            raise
        kept -= c.bytes
        removed.append(done)
    result = Removals(removed)
    if not any(r.bytes for r in removed):
        result.why_nothing = _why_nothing(copies, age, limit, now)
    return result


class Removals(list):
    """The :class:`Removal` list :func:`prune` returns; when it frees nothing, :attr:`why_nothing` says why.

    Example:
        >>> pruned = Removals()  # what prune(max_bytes=...) returns when every copy fits already
        >>> pruned.why_nothing = "the 2 working copies take 1.0 GB, within the limit of 2.0 GB already"
        >>> len(pruned), pruned.why_nothing.endswith("already")
        (0, True)
    """

    why_nothing: str | None = None


def _why_nothing(copies: list, age: float | None, limit: int | None, now: float) -> str:
    """Why a prune of ``copies`` (least recently used first) freed nothing."""
    where = f"{cache_dir()} ($NBKIT_CACHE_DIR)"
    if not copies:
        return f"there are no working copies of remote caches in {where}"
    total = sum(c.bytes for c in copies)
    busy = [c for c in copies if c.in_use]
    held = f"; {format_list([c.name for c in busy])} in use" if busy else ""
    reasons = []
    them = f"the {plural(len(copies), 'working copy', 'working copies')} take{'s' if len(copies) == 1 else ''}"
    if limit is not None:
        if total <= limit:
            reasons.append(f"{them} {format_bytes(total)}, within the limit of {format_bytes(limit)} already")
        else:
            reasons.append(f"{them} {format_bytes(total)}, "
                           f"over the limit of {format_bytes(limit)}, but every one that could go is in use or "
                           f"protected{held} (close the notebooks or processes that use them)")
            held = ""
    if age is not None:
        idle = [c for c in copies if c.last_used is None or now - c.last_used >= age]
        if not idle:  # every copy has a last use, within ``age``
            oldest = max(now - c.last_used for c in copies)
            reasons.append(f"none was unused for {format_age(age).removesuffix(' ago')} (the least recently used was last used "
                           f"{format_age(oldest)})")
        else:
            reasons.append(f"{plural(len(idle), 'working copy', 'working copies')} unused that long "
                           f"{'is' if len(idle) == 1 else 'are'} in use or protected")
    return "; ".join(reasons) + held
