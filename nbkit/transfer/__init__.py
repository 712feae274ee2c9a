"""Moving a cache directory: to and from a bucket (:mod:`~nbkit.transfer.sync`: :func:`push`,
:func:`pull`) and into and out of one tar file (:mod:`~nbkit.transfer.archive`: :func:`export_tar`,
:func:`import_tar`). Beneath them, :mod:`~nbkit.transfer.remote` reaches a URL (fsspec, a bounded
connect, classified errors) and :mod:`~nbkit.transfer.manifest` lists and checks a copy's files.
Both directions treat what arrives as untrusted (``docs/DESIGN.md``, "Transfer and archives").

The stores import ``remote`` and ``manifest`` from below the copies, so this package imports
nothing itself: each name loads its module on first use.

Example:
    >>> import tempfile, torch, nbkit
    >>> from nbkit import transfer
    >>> ds = nbkit.CachedDataset(torch.utils.data.TensorDataset(torch.arange(8.0)), tempfile.mkdtemp())
    >>> _ = ds.warmup()
    >>> sorted(transfer.push(ds.root, "memory://doctest/transfer").transferred)
    ['col-0.bin', 'index.bin', 'nbkit.json']
"""

from __future__ import annotations

from ..extras import lazy_names

__all__ = ["push", "pull", "export_tar", "import_tar", "TransferReport", "Stopped"]

_PUBLIC = {"push": "sync", "pull": "sync", "TransferReport": "sync", "Stopped": "remote",
           "export_tar": "archive", "import_tar": "archive"}


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)  # nbkit.transfer.remote etc. load on first use too
