"""A training checkpoint kept next to a cache: move it aside to start over, never deleting it.

A notebook that resumes from a checkpoint (notebook 04) must sometimes start at step 0 instead:
the checkpoint was made with another batch size or seed, or for another dataset. Deleting it would
lose hours of training to a ticked box, so :func:`set_aside` renames it to a name that says so
(``run-checkpoint.started-over-20261126-101500.pt``) and the next run finds no checkpoint.

Locally (a folder, a mounted Drive) the move is a hard link to the new name, then the old name
removed, then the directory synced: a crash at any point leaves the checkpoint readable under one
name or both, and an existing file is never replaced. On an object store (``gs://``) it is a copy,
then the old object removed: a crash leaves the old object, or both.

Example:
    >>> import os, tempfile, nbkit
    >>> path = os.path.join(tempfile.mkdtemp(), "run-checkpoint.pt")
    >>> nbkit.transfer.remote.write_url(path, b"step 100")
    >>> moved = set_aside(path, label="started-over", stamp="20261126-101500")
    >>> os.path.basename(moved), os.path.exists(path), open(moved, "rb").read()
    ('run-checkpoint.started-over-20261126-101500.pt', False, b'step 100')
"""

from __future__ import annotations

import errno
import os
import re
import time

from .commit import HAS_DIR_FD, Dir
from .transfer.remote import is_local, url_to_fs

__all__ = ["set_aside", "aside_name"]

_LABEL = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
_TRIES = 100


def aside_name(name: str, label: str, stamp: str, n: int = 0) -> str:
    """``name`` with ``.<label>-<stamp>`` (and ``-<n>`` past the first try) before its extension.

    Example:
        >>> aside_name("mnist-checkpoint.pt", "started-over", "20261126-101500", 2)
        'mnist-checkpoint.started-over-20261126-101500-2.pt'
    """
    base, ext = os.path.splitext(name)
    return f"{base}.{label}-{stamp}" + (f"-{n}" if n else "") + ext


def set_aside(url: str, storage_options: dict | None = None, *, label: str = "set-aside",
              stamp: str | None = None) -> str:
    """Move the file at ``url`` (a path or an fsspec URL) to a sibling named by :func:`aside_name`,
    never replacing a file there and never deleting it; return the new path or URL.

    Args:
        url: the checkpoint.
        storage_options: for fsspec, for a remote ``url``.
        label: what the new name says (lowercase letters, digits and ``-``): ``"started-over"``.
        stamp: the time in the name (default: now, UTC, ``YYYYmmdd-HHMMSS``).

    Raises:
        FileNotFoundError: nothing at ``url``.
    """
    if not _LABEL.match(label):
        raise ValueError(f"set_aside: label={label!r} must be lowercase letters, digits and '-' (at most 40)")
    stamp = stamp or time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    if not re.match(r"^[0-9A-Za-z-]{1,40}$", stamp):
        raise ValueError(f"set_aside: stamp={stamp!r} must be letters, digits and '-' (at most 40)")
    fs, path = url_to_fs(url, storage_options)
    if is_local(fs):
        new = _move_local(path, label, stamp)
    else:
        new = _move_remote(fs, path, label, stamp)
    new_name = new.rsplit("/", 1)[-1]
    if "://" in url:
        return url.rstrip("/").rpartition("/")[0] + "/" + new_name
    return os.path.join(os.path.dirname(url), new_name)


def _move_local(path: str, label: str, stamp: str) -> str:
    parent, name = os.path.split(os.path.abspath(path))
    with Dir(parent) as d:
        if d.lstat(name) is None:
            raise FileNotFoundError(errno.ENOENT, f"set_aside: no checkpoint at {path}", path)
        for n in range(_TRIES):
            new = aside_name(name, label, stamp, n)
            try:  # a new name only: a link fails where the name exists (rename would replace it)
                if HAS_DIR_FD:
                    os.link(name, new, src_dir_fd=d.fd, dst_dir_fd=d.fd, follow_symlinks=False)
                else:
                    os.link(d.join(name), d.join(new))
            except FileExistsError:
                continue
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                    raise
                if d.exists(new):  # a filesystem without hard links (some FUSE mounts): rename-if-absent
                    continue
                d.rename(name, new)
                d.sync()
                return d.join(new)
            d.sync()  # the new name is durable before the old one goes
            d.unlink(name)
            d.sync()
            return d.join(new)
    raise FileExistsError(errno.EEXIST, f"set_aside: {_TRIES} names like {aside_name(name, label, stamp)} are taken "
                          f"in {parent}: move some of them away", path)


def _move_remote(fs, path: str, label: str, stamp: str) -> str:
    if not fs.exists(path):
        raise FileNotFoundError(errno.ENOENT, f"set_aside: no checkpoint at {path}", path)
    parent, _, name = path.rpartition("/")
    for n in range(_TRIES):
        new = f"{parent}/{aside_name(name, label, stamp, n)}" if parent else aside_name(name, label, stamp, n)
        if fs.exists(new):
            continue
        fs.copy(path, new)  # an object appears whole; the old one stays until the copy is there
        if fs.size(new) != fs.size(path):
            raise OSError(errno.EIO, f"set_aside: the copy {new} of {path} has another size; {path} is kept", path)
        fs.rm(path)
        return new
    raise FileExistsError(errno.EEXIST, f"set_aside: {_TRIES} names like {aside_name(name, label, stamp)} are taken "
                          f"next to {path}: move some of them away", path)
