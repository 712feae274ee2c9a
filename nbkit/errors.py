"""The exceptions nbkit raises on purpose.

Each is a small subclass of a built-in type, so callers who do not know nbkit can still catch
``ValueError`` or ``LookupError``. Messages name the thing, what was expected, and the fix.

Example:
    >>> issubclass(MissingSampleError, LookupError), issubclass(MissingSampleError, RuntimeError)
    (True, True)
"""

from __future__ import annotations

__all__ = [
    "StaleCacheError",
    "CorruptCacheError",
    "MissingSampleError",
    "NondeterministicSourceError",
    "UnsafeArchiveError",
    "DiskFullError",
    "ResumeStateError",
]


class StaleCacheError(ValueError):
    """The cache at a path was built from a different source than the one given now."""


class CorruptCacheError(ValueError):
    """Stored bytes fail their checksum, or a cache file is damaged, and nothing can recompute them."""


class MissingSampleError(LookupError, RuntimeError):
    """A cache opened without its source was asked for a sample it never stored.

    A ``LookupError`` (nbkit's contract) and a ``RuntimeError`` (what torch_xla's ``CachedDataset``
    raised there), so code ported with ``except RuntimeError:`` still catches it.
    """


class NondeterministicSourceError(ValueError):
    """The source dataset returns different samples for the same index."""


class UnsafeArchiveError(ValueError):
    """An archive holds a member that could write outside its target (absolute path, ``..``, link, device)."""


class DiskFullError(OSError):
    """A write found the disk full (``errno`` ``ENOSPC``); the message names the file, the room it
    needed, what is free, and what to do. Nothing stored before it is lost.

    Example:
        >>> import errno
        >>> e = DiskFullError(errno.ENOSPC, "not enough disk space to write /d/x ...")
        >>> isinstance(e, OSError), str(e)
        (True, 'not enough disk space to write /d/x ...')
    """

    def __str__(self) -> str:
        return self.strerror or super().__str__()


class LockHeldError(TimeoutError):
    """Another process has held a lock on one of a cache's files past :data:`nbkit.commit.LOCK_SECONDS`
    (a stuck process, a ``nbkit rm`` of a huge cache, or anyone who can read the file holding it): nbkit
    never waits without end. The message names the file and how to find the holder. An ``OSError``
    (``TimeoutError``): a build counts it as the storage's failure.

    Example:
        >>> e = LockHeldError("/c/index.bin has been locked by another process for 30 s ...")
        >>> isinstance(e, OSError), str(e)[:14]
        (True, '/c/index.bin h')
    """


class ResumeStateError(ValueError):
    """A resume state (``loader.state_dict()``, read back from a checkpoint) was made for other
    settings than the loader given it: ``field`` names the setting, ``saved`` is the state's value,
    ``current`` the loader's. A notebook can word it for its own form from these three.

    Example:
        >>> e = ResumeStateError("batch_size", 64, 128, "create the loader with batch_size=64")
        >>> isinstance(e, ValueError), e.field, e.saved, e.current
        (True, 'batch_size', 64, 128)
    """

    def __init__(self, field: str, saved, current, message: str):
        super().__init__(message)
        self.field, self.saved, self.current = field, saved, current
