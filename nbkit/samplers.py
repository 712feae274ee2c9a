"""Which indices each process reads in each epoch.

:class:`EpochSampler` is ``DistributedSampler``'s contract as a reusable piece: a shuffle that
depends only on ``seed + epoch`` (the same order on every host), split so that every rank gets the
same number of samples (padded by repeating, or truncated with ``drop_last``); the device loader
uses it, and it plugs into a ``DataLoader`` as ``sampler=``. Its :meth:`~EpochSampler.state_dict`
records where an epoch stopped (a few numbers), so a run restarted from a checkpoint reads exactly
the indices it had not read yet. :class:`PrefetchSampler` knows how a
read-through cache is stored: it reads it in windows of pieces, fetching the next window while
one is read, so an epoch fetches each piece once.

Example:
    >>> s = EpochSampler(10, shuffle=False, rank=1, world_size=3)
    >>> list(s), len(s)
    ([1, 4, 7, 0], 4)
    >>> import os, tempfile, torch, nbkit
    >>> from unittest import mock
    >>> src = torch.utils.data.TensorDataset(torch.arange(4096.0).reshape(1024, 4))
    >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
    >>> _ = nbkit.push(ds.root, "memory://doctest/samplers")
    >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):  # where local areas live
    ...     rt = nbkit.CachedDataset.open("memory://doctest/samplers", local_max_bytes=64 << 10)
    >>> loader = torch.utils.data.DataLoader(rt, batch_size=100, sampler=PrefetchSampler(rt, seed=0),
    ...                                      collate_fn=nbkit.collate)
    >>> sum(float(b[0].sum()) for b in loader) == float(torch.arange(4096.0).sum())
    True
"""

from __future__ import annotations

import hashlib
import json
import operator
import sys

import numpy as np
import torch
from torch.utils.data import Sampler

from .errors import CorruptCacheError, ResumeStateError
from .trust import (MAX_EPOCH, MAX_SAMPLES, MAX_SEED, MAX_WORLD_SIZE, SEED_FIX, Bool, Int, List, Obj, Optional, Str,
                    check_bool, check_int, check_json, check_size)
from .stores import base
from .stores.readthrough import store_of

__all__ = ["EpochSampler", "default_rank_world", "PrefetchSampler", "plan_windows", "cache_identity",
           "content_identity", "check_resume_state", "epoch_sequence", "unconsumed", "dealt", "dealt_batches",
           "MAX_RESUMES"]

#: The version of the resume states (``state_dict()``) this nbkit writes and reads. The ``content``
#: field was added without a new version: it is optional, states without it (older nbkit) load as
#: before, and an older nbkit ignores it (and then checks ``cache`` strictly, as it always did).
#: Version 2 adds ``rest`` (an epoch resumed on another topology, see :func:`unconsumed`); only such
#: states are written as version 2, so an older nbkit refuses them rather than misreading them.
STATE_VERSION = 2
#: The most times one epoch may be resumed on another number of processes or batch size (the levels
#: of a state's ``rest``): each adds one position per rank of the topology it left.
MAX_RESUMES = 16


def default_rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from ``torch.distributed`` when it is initialised,
    else from the torch_xla runtime when this process has started it, else ``(0, 1)``."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    # Ask torch_xla only when its runtime is already running here: asking would start it (and a
    # process that started it can no longer spawn one process per TPU chip).
    if "torch_xla" in sys.modules:
        from . import devices  # every torch_xla call goes through nbkit's one adapter

        if devices.runtime_started():
            return devices.rank_world()
    return 0, 1


class EpochSampler(Sampler):
    """This rank's indices of a dataset for one epoch, reshuffled per epoch from ``seed``.

    Args:
        data: the dataset or its length.
        shuffle: shuffle with ``torch.randperm`` seeded by ``seed + epoch`` (as ``DistributedSampler``).
        seed: the shuffle seed; the same on every host.
        rank, world_size: this process's share (default: :func:`default_rank_world`).
        drop_last: drop the tail that does not divide evenly over the ranks, instead of padding it
            with repeated indices.

    Resuming: :meth:`state_dict` says which epoch the latest pass is in and how many of its indices
    it has yielded; :meth:`load_state_dict` makes the next pass yield the rest of that epoch. In a
    ``DataLoader`` with ``num_workers=0`` the sampler yields a batch's indices when the loop asks
    for the batch, so ``state_dict()`` is exact; with workers the ``DataLoader`` draws indices ahead
    of the loop, so pass the loop's own count: ``state_dict(consumed=batches_done * batch_size)``.

    Example:
        >>> s = EpochSampler(10, seed=1, rank=0, world_size=2)
        >>> it = iter(s); first = [next(it), next(it)]
        >>> state = s.state_dict()                       # plain ints and strs: torch.save it
        >>> state["epoch"], state["position"]
        (0, 2)
        >>> resumed = EpochSampler(10, seed=1, rank=0, world_size=2); resumed.load_state_dict(state)
        >>> first + list(resumed) == list(EpochSampler(10, seed=1, rank=0, world_size=2))
        True
    """

    def __init__(self, data, *, shuffle: bool = True, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False):
        if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
            n = check_int(data, "data (a length)", min=0, max=MAX_SAMPLES, fix="pass the dataset's length")
        elif hasattr(data, "__len__"):
            n = len(data)
        else:
            raise TypeError(f"EpochSampler needs a dataset (with __len__) or its length, got {type(data).__name__}")
        shuffle, drop_last = check_bool(shuffle, "shuffle"), check_bool(drop_last, "drop_last")
        seed = check_int(seed, "seed", min=0, max=MAX_SEED, fix=SEED_FIX)
        if rank is None and world_size is None:
            rank, world_size = default_rank_world()
        elif rank is None or world_size is None:
            raise ValueError(f"give both rank and world_size, or neither (got rank={rank}, world_size={world_size})")
        world_size = check_int(world_size, "world_size", min=1, max=MAX_WORLD_SIZE,
                               fix="pass the number of processes the data is split over")
        rank = check_int(rank, "rank", min=0, max=world_size - 1, fix="pass this process's rank, below world_size")
        self.n, self.shuffle, self.seed = int(n), shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch = 0
        if self.drop_last:
            self.per_rank = self.n // self.world_size
        else:
            self.per_rank = -(-self.n // self.world_size)
        self.cache = cache_identity(data)
        self.content = content_identity(data)
        self._resume = None  # (epoch, position) the next pass starts at, from load_state_dict
        self._pass = None  # (epoch, iterator, length) of the latest pass: its position is length - what is left

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle of ``epoch`` (the same ``seed`` and epoch give the same order anywhere).

        After :meth:`load_state_dict`, setting the restored epoch keeps the restored position (a
        ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop resumes mid-epoch); any
        other epoch starts from its beginning.
        """
        epoch = check_epoch(epoch)
        if self._resume is None or self._resume[0] != epoch:
            self._resume, self._pass = None, None
        self.epoch = epoch

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices for ``epoch`` (default: the current one), as int64."""
        epoch = self.epoch if epoch is None else check_epoch(epoch)
        order = _order(self.n, self.shuffle, self.seed, epoch)
        total = self.per_rank * self.world_size
        if total > self.n:  # pad by repeating from the start (as DistributedSampler)
            order = np.resize(order, total) if self.n else order
        order = order[:total]
        return order[self.rank:total:self.world_size].astype(np.int64, copy=False)

    def __iter__(self):
        order = self.indices().tolist()
        start = 0
        if self._resume is not None:
            start = self._resume[1] if self._resume[0] == self.epoch else 0
            self._resume = None
        it = iter(order[start:])
        self._pass = (self.epoch, it, len(order))
        return it

    def __len__(self) -> int:
        return self.per_rank

    def state_dict(self, consumed: int | None = None) -> dict:
        """Where this sampler is: the epoch of its latest pass and how many of that pass's indices
        were used (plus the settings a restore must match). Plain values, no index arrays.

        Args:
            consumed: indices of this epoch the training loop has used, when that is fewer than the
                sampler has yielded (a ``DataLoader`` with workers draws indices ahead of the loop).

        Example:
            >>> s = EpochSampler(10, seed=0); s.set_epoch(2)
            >>> state = s.state_dict(consumed=4)      # the loop trained on 4 indices of epoch 2
            >>> state["epoch"], state["position"], state["length"]
            (2, 4, 10)
        """
        if self._pass is not None:
            epoch, it, length = self._pass
            position = length - operator.length_hint(it)
        elif self._resume is not None:
            epoch, position = self._resume
        else:
            epoch, position = self.epoch, 0
        if consumed is not None:
            position = check_int(consumed, "EpochSampler.state_dict: consumed", min=0, max=self.per_rank)
        return {"kind": "nbkit.EpochSampler", "version": 1, "epoch": epoch, "position": position,
                **self._settings()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, perhaps read back from a file): the next
        pass yields the rest of that epoch; then :meth:`set_epoch` moves on as usual.

        Raises:
            ValueError: the state is damaged, or was made for another dataset length, cache, rank,
                world size, seed, shuffle or ``drop_last`` (the message names the field).

        Example:
            >>> state = EpochSampler(6, shuffle=False).state_dict(consumed=4)
            >>> resumed = EpochSampler(6, shuffle=False); resumed.load_state_dict(state)
            >>> list(resumed)
            [4, 5]
        """
        state = check_resume_state(state, "nbkit.EpochSampler", self._settings(), self.per_rank)
        self.epoch = state["epoch"]
        self._resume = (state["epoch"], state["position"])
        self._pass = None

    def _settings(self) -> dict:
        return {"length": self.n, "shuffle": self.shuffle, "seed": self.seed, "rank": self.rank,
                "world_size": self.world_size, "drop_last": self.drop_last, "cache": self.cache,
                "content": self.content}


def cache_identity(data) -> str | None:
    """The ``generation`` of the cache behind ``data`` (a ``CachedDataset``: the id in its
    ``nbkit.json``, kept by copies, new when the cache is re-created), else ``None``.

    Example:
        >>> import tempfile, nbkit
        >>> src = torch.utils.data.TensorDataset(torch.arange(4))
        >>> len(cache_identity(nbkit.CachedDataset(src, tempfile.mkdtemp()))), cache_identity(src)
        (32, None)
    """
    generation = _meta_of(data).get("generation")
    return generation if isinstance(generation, str) else None


def _meta_of(data) -> dict:
    """The metadata of the cache behind ``data`` (a ``CachedDataset``'s store), else ``{}``."""
    store = base.store_of(data)
    return store.meta if store is not None and isinstance(store.meta, dict) else {}


def content_identity(data) -> str | None:
    """What the cache behind ``data`` holds, as a short id: a hash of its source's fingerprint (type,
    length, transforms, probe samples' hashes), so a cache rebuilt from the same source (another
    ``generation``) has the same id, and its batches are the same. ``None`` for a dataset that is
    not a cache, or a cache whose fingerprint holds no probe samples (``fingerprint_samples=0``:
    nothing says the samples are the same).

    Example:
        >>> import tempfile, nbkit
        >>> src = torch.utils.data.TensorDataset(torch.arange(4))
        >>> a, b = (nbkit.CachedDataset(src, tempfile.mkdtemp()) for _ in range(2))
        >>> content_identity(a) == content_identity(b) != None, cache_identity(a) != cache_identity(b)
        (True, True)
    """
    fp = _meta_of(data).get("fingerprint")
    if not isinstance(fp, dict) or not fp.get("samples"):
        return None
    blob = json.dumps(fp, sort_keys=True, separators=(",", ":"), default=str).encode()
    return "source-" + hashlib.sha256(blob).hexdigest()[:32]


def _order(n: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The dataset's order in ``epoch``: ``torch.randperm`` seeded by ``seed + epoch`` (as ``DistributedSampler``)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).numpy()


def epoch_sequence(n: int, *, shuffle: bool, seed: int, epoch: int, world_size: int, batch_size: int,
                   drop_last: bool) -> np.ndarray:
    """Every index ``world_size`` ranks train on in ``epoch``, batches of ``batch_size``, in one line:
    rank ``r`` takes ``[r::world_size]``, cut in batches (:func:`dealt`), so the ``k``-th batches of
    all ranks are the ``k``-th run of ``world_size * batch_size`` (what :class:`nbkit.DeviceLoader` reads).

    Example:
        >>> seq = epoch_sequence(10, shuffle=False, seed=0, epoch=0, world_size=3, batch_size=2, drop_last=False)
        >>> seq.tolist(), [b.tolist() for b in dealt(seq, 3, 2, rank=1)]
        ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1], [[1, 4], [7, 0]])
    """
    order = _order(n, shuffle, seed, epoch)
    per_rank = n // world_size if drop_last else -(-n // world_size)
    total = per_rank * world_size
    if total > n:  # pad by repeating from the start (as DistributedSampler)
        order = np.resize(order, total)
    order = order[:total]
    if drop_last:  # and the last incomplete batch of every rank
        order = order[:per_rank // batch_size * batch_size * world_size]
    return order.astype(np.int64, copy=False)


def dealt(sequence: np.ndarray, world_size: int, batch_size: int, rank: int) -> list:
    """Rank ``rank``'s batches of ``sequence`` dealt over ``world_size`` ranks: ``sequence[rank::world_size]``
    cut every ``batch_size`` (the last batch may be shorter; ranks' batch counts differ by one at most).

    Example:
        >>> [b.tolist() for b in dealt(np.arange(7), 2, 2, rank=0)], [b.tolist() for b in dealt(np.arange(7), 2, 2, rank=1)]
        ([[0, 2], [4, 6]], [[1, 3], [5]])
    """
    mine = sequence[rank::world_size]
    return [mine[a:a + batch_size] for a in range(0, len(mine), batch_size)]


def dealt_batches(m: int, world_size: int, batch_size: int, rank: int) -> int:
    """``len(dealt(sequence, world_size, batch_size, rank))`` for a sequence of ``m`` items.

    Example:
        >>> [dealt_batches(5, 4, 1, rank) for rank in range(4)]
        [2, 1, 1, 1]
    """
    items = max(0, -(-(m - rank) // world_size))
    return -(-items // batch_size)


def unconsumed(sequence: np.ndarray, world_size: int, batch_size: int, positions) -> np.ndarray:
    """What is left of ``sequence`` once each rank ``r`` of ``world_size`` (batches of ``batch_size``,
    :func:`dealt`) trained on its first ``positions[r]`` batches, in the sequence's order: the item at
    ``q`` belongs to rank ``q % world_size``, batch ``q // (world_size * batch_size)``.

    Example:
        >>> seq = np.arange(12)
        >>> unconsumed(seq, 2, 3, [1, 2]).tolist()      # rank 0 trained 1 batch, rank 1 two
        [6, 8, 10]
    """
    q = np.arange(len(sequence))
    return sequence[q // (world_size * batch_size) >= np.asarray(positions, np.int64)[q % world_size]]


def _rest_sequence(ours: dict, epoch: int, rest: list, fail) -> np.ndarray:
    """The sequence of the pass that ``rest`` (a checked state's levels) leaves of ``epoch``; each
    level's positions are checked against what its ranks had (``fail(message)`` raises)."""
    first = rest[0]
    seq = epoch_sequence(ours["length"], shuffle=ours["shuffle"], seed=ours["seed"], epoch=epoch,
                         world_size=first["world_size"], batch_size=first["batch_size"], drop_last=ours["drop_last"])
    for k, level in enumerate(rest):
        w, b, positions = level["world_size"], level["batch_size"], level["positions"]
        if len(positions) != w:
            fail(f"its rest[{k}] has {len(positions)} positions for world_size={w}")
        # Every rank's batches at once (a hostile level may name a million ranks): dealt_batches, vectorised.
        had = -(-np.maximum(0, -(-(len(seq) - np.arange(w, dtype=np.int64)) // w)) // b)
        past = np.flatnonzero(np.asarray(positions, np.int64) > had)
        if len(past):
            r = int(past[0])
            fail(f"its rest[{k}] position {positions[r]} of rank {r} is past the end of that rank's batches ({int(had[r])})")
        seq = unconsumed(seq, w, b, positions)
    return seq


_MAX_EPOCH = MAX_EPOCH


def check_epoch(epoch) -> int:
    """An epoch number (anything ``int()`` takes, as before) in ``[0, MAX_EPOCH]``: with the seed's
    bound, ``seed + epoch`` then always fits a signed 64-bit integer.

    Example:
        >>> check_epoch(3.0)
        3
    """
    return check_int(int(epoch), "epoch", min=0, max=_MAX_EPOCH,
                     fix="epochs count from 0, and seed + epoch must fit a signed 64-bit integer")


# Why each setting must match, and what a Python user can do about it ({saved}: the state's value).
_START_OVER = "or start over: do not load this state (move the checkpoint aside)"
_FIXES = {
    "length": "the dataset has another number of samples: resume with the dataset the checkpoint was made with "
              "({saved} samples), " + _START_OVER,
    "batch_size": "create the loader with batch_size={saved}, the checkpointed run's, " + _START_OVER,
    "drop_last": "create the loader with drop_last={saved}, the checkpointed run's, " + _START_OVER,
    "shuffle": "create the loader with shuffle={saved}, the checkpointed run's, " + _START_OVER,
    "seed": "create the loader with seed={saved}, the checkpointed run's, " + _START_OVER,
    "rank": "load each process's own state (save one file per rank, e.g. f'loader-{{rank}}.pt')",
    "world_size": "resume with {saved} processes, as the checkpointed run (an EpochSampler's state cannot be split "
                  "over another number of ranks; a DeviceLoader's can), " + _START_OVER,
    "cache": "this cache is another one, and was not built from the same source (its source fingerprint differs, "
             "or the state or the cache has none): open the cache the checkpoint was made with, " + _START_OVER
             + ". If you know it holds the same samples in the same order, load the state with its 'cache' "
             "entry set to None",
}


def check_resume_state(state, kind: str, ours: dict, length, *, elastic: bool = False, memo: dict | None = None) -> dict:
    """``state`` (a resume state for ``kind``, maybe read from a file) checked at the trust
    boundary: its fields and types, then each setting against ``ours``, then its position against
    ``length`` (the items of an epoch, or a function of the checked state giving them). Raises
    ``CorruptCacheError`` (a ``ValueError``) for a damaged state, and
    :class:`~nbkit.errors.ResumeStateError` (a ``ValueError`` with ``field``, ``saved`` and
    ``current``) for one made with other settings, naming the field and the fix.

    The ``cache`` setting (the cache's ``generation``) may differ when the state's ``content``
    equals this cache's (:func:`content_identity`): a cache rebuilt from the same source holds the
    same samples at the same indices, so its batches are the checkpointed run's.

    ``elastic``: the state may come from another topology: its ``rank``, ``world_size`` and
    ``batch_size`` are bounded (a rank below its world size) rather than compared with ``ours``.
    A loader's state may hold ``rest``, the levels of an epoch resumed on other topologies, each
    ``{"world_size", "batch_size", "positions"}`` with one position per rank, checked against the
    batches that rank had (:func:`unconsumed`). ``memo``: a dict kept across the states of one list
    (the same ``rest`` is checked once).

    Example:
        >>> ours = {"length": 10, "seed": 0}
        >>> state = {"kind": "k", "version": 1, "epoch": 0, "position": 3, "length": 12, "seed": 0}
        >>> check_resume_state(state, "k", ours, 10)
        Traceback (most recent call last):
        ...
        nbkit.errors.ResumeStateError: k.load_state_dict: the state was made for length=12, but this one has length=10: the dataset has another number of samples: resume with the dataset the checkpoint was made with (12 samples), or start over: do not load this state (move the checkpoint aside).
    """
    where = f"the state given to {kind}.load_state_dict"
    fix = f"Pass a state from {kind}.state_dict() (saved with torch.save, read back with torch.load)."
    fields = {"kind": Str(choices={kind}), "version": Int(min=1), "epoch": Int(min=0, max=_MAX_EPOCH),
              "position": Int(min=0)}
    for name, value in ours.items():
        if name in ("cache", "content"):
            fields[name] = Optional(Str(max_len=256))
        elif isinstance(value, bool):
            fields[name] = Bool()
        else:
            fields[name] = Int(min=0)
    topology = ("rank", "world_size", "batch_size") if elastic else ()
    if elastic:
        fields.update(world_size=Int(min=1, max=MAX_WORLD_SIZE), rank=Int(min=0, max=MAX_WORLD_SIZE - 1))
        if "batch_size" in ours:
            fields["batch_size"] = Int(min=1, max=MAX_SAMPLES)
    level = Obj({"world_size": Int(min=1, max=MAX_WORLD_SIZE), "batch_size": Int(min=1, max=MAX_SAMPLES),
                 "positions": List(Int(min=0, max=MAX_SAMPLES), max_len=MAX_WORLD_SIZE)})
    fields["rest"] = List(level, max_len=MAX_RESUMES)
    state = check_json(state, Obj(fields, required=set(fields) - {"content", "rest"}), where, fix)
    if state["version"] > STATE_VERSION:
        raise ValueError(f"{where} has version {state['version']}; this nbkit reads version {STATE_VERSION}. "
                         "Install a newer nbkit (the nbkit-cache distribution: README, Install) to load it.")

    def damaged(what):
        raise CorruptCacheError(f"{where} is damaged: {what}. {fix}")

    if elastic and state["rank"] >= state["world_size"]:
        damaged(f"its rank {state['rank']} is not below its world_size {state['world_size']}")
    if state.get("rest") and "batch_size" not in ours:
        damaged("it has 'rest' (an epoch resumed on another topology), which only a loader's state holds")
    for name, value in ours.items():
        if name == "content" or name in topology:
            continue  # content is not a setting: it decides whether another cache is the same (below)
        theirs = state[name]
        if name == "cache" and theirs is None:
            continue  # made for a dataset that is not a cache (or the check was waived)
        if name == "cache" and state.get("content") is not None and state.get("content") == ours.get("content"):
            continue  # another cache built from the same source: the same samples at the same indices
        if theirs != value:
            raise ResumeStateError(name, theirs, value,
                                   f"{kind}.load_state_dict: the state was made for {name}={theirs!r}, but this one "
                                   f"has {name}={value!r}: {_FIXES[name].format(saved=theirs)}.")
    if state.get("rest"):
        state["rest"] = [{"world_size": level["world_size"], "batch_size": level["batch_size"],
                          "positions": list(level["positions"])} for level in state["rest"]]
        key = repr((state["epoch"], state["rest"]))
        if memo is None or key not in memo:
            seq = _rest_sequence(ours, state["epoch"], state["rest"], damaged)
            if memo is not None:
                memo.clear()  # one entry: a list of states shares its rest
                memo[key] = len(seq)
        length = memo[key] if memo is not None else len(seq)
        length = dealt_batches(length, state["world_size"], state["batch_size"], state["rank"])
    elif callable(length):
        length = length(state)
    if state["position"] > length:
        raise ValueError(f"{kind}.load_state_dict: the state's position {state['position']} is past the end of its "
                         f"epoch ({length}); the state is damaged. {fix}")
    return state


class PrefetchSampler(torch.utils.data.Sampler):
    """Sample a read-through cache in windows of pieces, fetching the next window while one is read.

    Each epoch puts the cache's pieces in random order and cuts that order into windows of about
    ``window_bytes`` (default: a third of the local area); samples are shuffled within a window.
    So every piece is fetched about once an epoch, and the mixing is over a window's samples
    rather than the whole dataset (as with webdataset's shard shuffle). Halfway through a window,
    the next window's pieces are queued for the store's prefetch thread (in the main process; with
    DataLoader workers the pieces land in the shared local area, where the workers find them).

    Args:
        dataset: a ``CachedDataset`` opened with ``local_max_bytes=``.
        shuffle: ``False`` reads in index order (still prefetching ahead).
        seed: the order is a function of ``(seed, epoch)``; ``None`` picks a random seed once. Each
            iteration moves to the next epoch; :meth:`set_epoch` sets it explicitly.
        window_bytes: bytes of pieces per window.

    Example:
        >>> import os, tempfile, torch, nbkit
        >>> from unittest import mock
        >>> src = torch.utils.data.TensorDataset(torch.randn(2000, 64))     # 512 KB of rows
        >>> ds = nbkit.CachedDataset(src, tempfile.mkdtemp()); _ = ds.warmup()
        >>> _ = nbkit.push(ds.root, "memory://doctest/sampler")
        >>> with mock.patch.dict(os.environ, NBKIT_CACHE_DIR=tempfile.mkdtemp()):
        ...     rt = nbkit.CachedDataset.open("memory://doctest/sampler", local_max_bytes=256 << 10)
        >>> sampler = PrefetchSampler(rt, seed=0)
        >>> sorted(sampler) == list(range(2000)), len(sampler.windows()) > 1
        (True, True)
    """

    def __init__(self, dataset, *, shuffle: bool = True, seed: int | None = None, window_bytes: int | None = None):
        self.dataset = dataset
        store = store_of(dataset)
        self.shuffle = check_bool(shuffle, "shuffle")
        self.seed = (int(np.random.SeedSequence().entropy % (2**32)) if seed is None else
                     check_int(seed, "seed", min=0, max=MAX_SEED, fix=SEED_FIX))
        if window_bytes is not None:
            window_bytes = check_size(window_bytes, "window_bytes", min=1)
        self.window_bytes = window_bytes or max(1, store.geometry.usable // 3)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use the order of epoch ``epoch`` next (call it each epoch, as with ``DistributedSampler``)."""
        self.epoch = check_epoch(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def windows(self) -> list:
        """This epoch's windows: a list of index arrays, in the order they are read."""
        store = store_of(self.dataset)
        return plan_windows(store, np.random.default_rng([self.seed, self.epoch]), self.window_bytes, self.shuffle)

    def __iter__(self):
        store = store_of(self.dataset)
        windows = self.windows()
        self.epoch += 1
        for w, win in enumerate(windows):
            order = win.tolist()
            half = len(order) // 2
            if w == 0:
                store.prefetch(win)
            yield from order[:half]
            if w + 1 < len(windows):
                store.prefetch(windows[w + 1])  # halfway through this window
            yield from order[half:]


def plan_windows(store, rng, window_bytes: int, shuffle: bool = True) -> list:
    """Group every index by the piece it lives in, order the pieces, cut them into windows of about
    ``window_bytes``, shuffle within each window (see :class:`PrefetchSampler`)."""
    if store.length == 0:
        return []
    groups, cost, loose = store.piece_groups()
    perm = rng.permutation(len(groups)) if shuffle else np.arange(len(groups))
    windows, current, size = [], [], 0
    for j in perm:
        if current and size + cost[j] > window_bytes:
            windows.append(np.concatenate(current))
            current, size = [], 0
        current.append(groups[j])
        size += cost[j]
    if current:
        windows.append(np.concatenate(current))
    if len(loose):
        if not windows:
            windows = [np.zeros(0, np.int64)]
        loose = rng.permutation(loose) if shuffle else loose
        parts = np.array_split(loose, len(windows))
        windows = [np.concatenate([w, p]) for w, p in zip(windows, parts)]
    if shuffle:
        windows = [rng.permutation(w) for w in windows]
    else:
        windows = [np.sort(w) for w in windows]
    return windows
