"""``GrainBatches``: a cache as a Grain data source whose records are whole shuffled batches.

grain 0.2.18 reads one record at a time (its ``Batch`` and ``.batch`` never call a source's
``_getitems``) and spends far more of its own time on each record than the cache does. Here a record
is a whole batch: record ``j`` of shard ``k`` is batch ``(j mod B) · S + k`` of epoch ``j div B``
(``S`` shards, ``B`` batches per shard and epoch), each epoch's order the shuffle of ``seed + epoch``
(:class:`nbkit.samplers.EpochSampler`'s, so one shard's batches are ``JaxLoader``'s), read with one
gather per column. Grain then does its per-record work once per batch, and its samplers, worker
processes and checkpoints work on batches: a checkpoint resumes at the exact batch. The shard is
the source's (``shard_options=``, as Grain's ``ShardOptions``), not the sampler's: every shard's
step ``t`` is then in the same epoch, and the shards' batches of one step are consecutive batches
of that epoch's order.

Batches are numpy, as ``JaxLoader``'s host batches (docs/jax.md, "What comes out"): ``nbkit.collate``'s
structure (a sample's tuple is a list of batched fields), each field the samples' numpy forms stacked.

Example:
    >>> import tempfile, numpy as np, nbkit, grain
    >>> ds = nbkit.CachedDataset([(np.full(2, i, np.float32), i) for i in range(10)], tempfile.mkdtemp())
    >>> _ = ds.warmup()
    >>> source = GrainBatches(ds, 4, seed=0, num_epochs=2, drop_remainder=True)   # 2 batches an epoch
    >>> loader = grain.DataLoader(data_source=source, sampler=grain.samplers.SequentialSampler(len(source)),
    ...                           worker_count=0)
    >>> [y.tolist() for x, y in loader]
    [[4, 1, 7, 5], [3, 9, 0, 8], [5, 6, 1, 2], [0, 8, 9, 3]]
"""

from __future__ import annotations

import operator
import sys

from ..collate import collate, collate_columns
from ..samplers import EpochSampler
from ..trust import MAX_EPOCH, MAX_SAMPLES, MAX_SEED, SEED_FIX, check_bool, check_int
from .source import GrainSource
from .trees import numpy_batch, numpy_tree

__all__ = ["GrainBatches"]

_ORDERS_KEPT = 2  # epoch orders kept per process: the current one, and the next one read ahead by Grain


class GrainBatches:
    """A cache as a Grain data source of whole batches: ``len(source)`` batches (this shard's, over
    ``num_epochs`` epochs), ``source[j]`` the ``j``-th, read with one gather per column.

    Use it with ``grain.DataLoader(data_source=source, sampler=grain.samplers.SequentialSampler(len(source)),
    worker_count=...)`` (no ``operations=`` batching: records are batches already) or
    ``grain.MapDataset.source(source)``; shard it here, not in the sampler.

    Args:
        cache: a :class:`nbkit.CachedDataset`, or the path or URL of a cache (opened without its source).
        batch_size: samples per batch (on this shard).
        seed: the shuffle seed: epoch ``e``'s order is the shuffle of ``seed + e``, the same on every host.
        num_epochs: epochs in the source (records of epoch ``e`` come after those of epoch ``e - 1``); at
            most ``sys.maxsize // batches`` of this shard's epoch, so that ``len(source)`` fits a Python length.
        shuffle: ``False`` reads each epoch in index order.
        drop_remainder: drop each epoch's last batch when it has fewer than ``batch_size`` samples
            (every batch one shape: one compilation of a jitted step).
        shard_options: a ``grain.sharding.ShardOptions`` (``ShardByJaxProcess()`` on a pod): this
            process reads every ``shard_count``-th batch of each epoch from ``shard_index``; with its
            ``drop_remainder=True`` each epoch's last batches that do not divide over the shards are
            dropped, so every shard has as many steps. ``None``: one shard, the whole epochs.
        storage_options: for a URL given as ``cache``: passed to fsspec (credentials, endpoint).

    Example:
        >>> import tempfile, numpy as np, nbkit, grain
        >>> ds = nbkit.CachedDataset([{"x": np.arange(3) + i, "y": i} for i in range(8)], tempfile.mkdtemp())
        >>> _ = ds.warmup()
        >>> shards = [GrainBatches(ds, 2, seed=1, shard_options=grain.sharding.ShardOptions(k, 2)) for k in (0, 1)]
        >>> len(shards[0]), shards[0][0]["x"].shape                 # 4 batches an epoch: 2 per shard
        (2, (2, 3))
        >>> sorted(int(y) for s in shards for b in grain.MapDataset.source(s) for y in b["y"])
        [0, 1, 2, 3, 4, 5, 6, 7]
    """

    def __init__(self, cache, batch_size: int, *, seed: int = 0, num_epochs: int = 1, shuffle: bool = True,
                 drop_remainder: bool = False, shard_options=None, storage_options: dict | None = None):
        self.samples = GrainSource(cache, storage_options=storage_options)
        self.batch_size = check_int(batch_size, "GrainBatches: batch_size", min=1, max=MAX_SAMPLES,
                                    fix="samples per batch, at most as many as a cache can hold (2**40)")
        self.seed = check_int(seed, "GrainBatches: seed", min=0, max=MAX_SEED, fix=SEED_FIX)
        self.num_epochs = check_int(num_epochs, "GrainBatches: num_epochs", min=1, max=MAX_EPOCH,
                                    fix="the epochs to read; make a new source with another seed to read more")
        self.shuffle = check_bool(shuffle, "GrainBatches: shuffle")
        self.drop_remainder = check_bool(drop_remainder, "GrainBatches: drop_remainder")
        self.shard_index, self.shard_count, shard_drop = _shard(shard_options)
        n = len(self.samples)
        per_epoch = n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)
        if shard_drop:
            per_epoch -= per_epoch % self.shard_count
        self.batches_per_epoch = per_epoch  # of every shard together
        self.per_shard = len(range(self.shard_index, per_epoch, self.shard_count))
        if self.per_shard == 0:
            dropped = " (after the shard options' drop_remainder=True)" if shard_drop else ""
            raise ValueError(f"GrainBatches: shard {self.shard_index} of {self.shard_count} gets no batch: the cache has "
                             f"{n} samples, {per_epoch} batches of batch_size={self.batch_size} an epoch{dropped} "
                             f"(drop_remainder={self.drop_remainder}); pass a smaller batch_size, drop_remainder=False, "
                             "or fewer shards")
        if self.per_shard * self.num_epochs > sys.maxsize:  # len() of a source must fit a Py_ssize_t
            raise ValueError(f"GrainBatches: num_epochs={self.num_epochs} of {self.per_shard} batches is more records "
                             f"than a Python length holds ({sys.maxsize}): pass num_epochs <= "
                             f"{sys.maxsize // self.per_shard}")
        self._orders: dict = {}  # epoch -> its shuffled indices, in this process

    def __len__(self) -> int:
        return self.per_shard * self.num_epochs

    def indices(self, record: int):
        """The sample indices of batch ``record`` (int64), in batch order."""
        j = _record(record, len(self))
        epoch, b = divmod(j, self.per_shard)
        start = (b * self.shard_count + self.shard_index) * self.batch_size
        return self._order(epoch)[start:start + self.batch_size]

    def __getitem__(self, record):
        """Batch ``record``: numpy, as ``JaxLoader``'s host batches (``nbkit.collate``'s structure)."""
        idx = self.indices(record)
        ds = self.samples._open()
        if ds.transform is None:
            columns = ds.read_columns(idx)  # stored fixed-shape fields: one verified gather per column
            if columns is not None:
                return numpy_tree(numpy_batch(ds.schema, collate_columns(ds.schema, columns, None, len(idx))))
            return numpy_tree(numpy_batch(ds.schema, collate(ds.__getitems__(idx.tolist()))))
        return numpy_tree(collate(ds.__getitems__(idx.tolist())))  # computes, repairs, transforms

    def _getitems(self, records) -> list:
        return [self[r] for r in records]

    def _order(self, epoch: int):
        order = self._orders.get(epoch)
        if order is None:
            order = EpochSampler(len(self.samples), shuffle=self.shuffle, seed=self.seed, rank=0,
                                 world_size=1).indices(epoch)
            # Grain reads from many threads: replace the dict whole (no thread sees one being changed).
            kept = {e: o for e, o in self._orders.items() if e > epoch - _ORDERS_KEPT}
            kept[epoch] = order
            self._orders = kept
        return order

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_orders"] = {}  # recomputed in each worker process from (seed, epoch)
        return state

    def __repr__(self) -> str:
        # Grain's DataLoader checkpoints compare the source's repr: the cache and every setting that
        # decides which samples a record holds.
        return (f"nbkit.jax.GrainBatches({self.samples!r}, batch_size={self.batch_size}, seed={self.seed}, "
                f"num_epochs={self.num_epochs}, shuffle={self.shuffle}, drop_remainder={self.drop_remainder}, "
                f"shard={self.shard_index}/{self.shard_count}, batches_per_epoch={self.batches_per_epoch})")


def _shard(options) -> tuple[int, int, bool]:
    """``(shard_index, shard_count, drop_remainder)`` of a ``grain.sharding.ShardOptions`` (or ``None``)."""
    if options is None:
        return 0, 1, False
    if not all(hasattr(options, a) for a in ("shard_index", "shard_count", "drop_remainder")):
        raise TypeError("GrainBatches: shard_options must be a grain.sharding.ShardOptions (e.g. "
                        f"grain.sharding.ShardByJaxProcess(drop_remainder=True)) or None, got {type(options).__name__}")
    count = check_int(options.shard_count, "GrainBatches: shard_options.shard_count", min=1, max=MAX_SAMPLES,
                      fix="the number of processes reading the data")
    index = check_int(options.shard_index, "GrainBatches: shard_options.shard_index", min=0, max=count - 1,
                      fix="this process's shard, below shard_count")
    return index, count, check_bool(options.drop_remainder, "GrainBatches: shard_options.drop_remainder")


def _record(record, length: int) -> int:
    """A record number in ``[0, length)`` (negative ones count from the end, as a sequence's)."""
    if isinstance(record, bool):
        raise TypeError("GrainBatches: a record number must be an int, got a bool")
    try:
        j = operator.index(record)
    except TypeError as e:
        raise TypeError(f"GrainBatches: a record number must be an int (a batch's position), got "
                        f"{type(record).__name__}") from e
    if not -length <= j < length:
        raise IndexError(f"GrainBatches: record {j} is out of range: the source has {length} batches")
    return j + length if j < 0 else j
