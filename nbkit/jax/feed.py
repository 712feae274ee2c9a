"""``JaxLoader``: a cache's batches as ``jax.Array`` s on JAX's devices, read ahead in the background.

It is :class:`nbkit.DeviceLoader` with another last step: the same shuffle and shards
(:class:`nbkit.samplers.EpochSampler`), the same read-ahead thread gathering whole batches from the
memory-mapped columns, the same ``state_dict()`` / ``load_state_dict()`` resume at the exact batch;
then, still in that thread, each batch becomes numpy (:func:`nbkit.jax.trees.numpy_batch`, no copy) and is
placed: with ``jax.device_put`` in one process (on ``sharding``, or JAX's default device), with
``jax.make_array_from_process_local_data`` when several processes feed one global batch (each
process reads its own shard: ``rank=jax.process_index()``, ``world_size=jax.process_count()``).

Example:
    >>> import tempfile, numpy as np, nbkit
    >>> from nbkit.jax import JaxLoader
    >>> ds = nbkit.CachedDataset([(np.full(2, i, np.float32), i) for i in range(6)], tempfile.mkdtemp())
    >>> x, y = next(iter(JaxLoader(ds, 4, shuffle=False)))
    >>> type(x).__name__, x.shape, y.tolist()
    ('ArrayImpl', (4, 2), [0, 1, 2, 3])
"""

from __future__ import annotations

from ..extras import require
from ..loader import DeviceLoader
from .trees import INSTALL, numpy_batch, numpy_tree

__all__ = ["JaxLoader", "place", "batch_sharding"]


def _jax(feature: str = "nbkit.jax.JaxLoader"):
    return require("jax", extra="jax", feature=feature, install=INSTALL)


class JaxLoader(DeviceLoader):
    """Iterate a cache in batches of ``jax.Array`` s, prepared and placed in the background.

    Args:
        dataset: a :class:`nbkit.CachedDataset` (any map-style dataset works, slower).
        batch_size: samples per batch read by this process (the global batch is this times the
            number of processes).
        sharding: a ``jax.sharding.Sharding`` for every array of a batch (its first axis is the
            batch), e.g. ``NamedSharding(mesh, PartitionSpec("data"))``. Default: JAX's default
            device in one process; over several processes, the batch axis split over every device
            of a one-axis mesh (``"batch"``).
        rank, world_size: this process's shard of every epoch (default: ``jax.process_index()``,
            ``jax.process_count()``).
        shuffle, drop_last, seed, threads, prefetch, batch_transform: as for
            :class:`nbkit.DeviceLoader` (``drop_last=True`` keeps every batch the same shape, so a
            jitted step compiles once and a sharded batch always divides over the devices).

    Fields that JAX cannot hold stay numpy arrays on the host: strings a ``str_`` array, bytes,
    ``None`` and pickled objects an object array (docs/jax.md, "What comes out").

    Example:
        >>> import tempfile, numpy as np, jax, nbkit
        >>> ds = nbkit.CachedDataset([np.arange(3) * i for i in range(8)], tempfile.mkdtemp())
        >>> loader = JaxLoader(ds, 4, seed=0, drop_last=True)
        >>> it = iter(loader); first = next(it)
        >>> state = loader.state_dict()                      # save it with the model's checkpoint
        >>> again = JaxLoader(ds, 4, seed=0, drop_last=True); again.load_state_dict(state)
        >>> bool((next(iter(again)) == next(it)).all())      # the batch an uninterrupted run gets next
        True
    """

    # Gather several batches in one read (their rows 64-byte aligned: placed on the CPU without a copy).
    _place_in_chunks = True
    # Its processes make one global batch: process 0's state is every process's (docs/jax.md).
    _lockstep = True

    def __init__(self, dataset, batch_size: int, *, sharding=None, shuffle: bool = True, drop_last: bool = False,
                 seed: int = 0, rank: int | None = None, world_size: int | None = None, threads: int | None = None,
                 prefetch: int = 3, batch_transform=None, **dataloader_args):
        jax = _jax()
        if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
            raise TypeError(f"JaxLoader: sharding must be a jax.sharding.Sharding (e.g. NamedSharding(mesh, "
                            f"PartitionSpec('data'))), got {type(sharding).__name__}")
        if "device" in dataloader_args:
            raise TypeError("JaxLoader does not take device= (a torch device): give sharding= "
                            "(jax.sharding.SingleDeviceSharding(jax.devices()[0]) for one device)")
        if rank is None and world_size is None:
            rank, world_size = jax.process_index(), jax.process_count()
        super().__init__(dataset, batch_size, shuffle=shuffle, drop_last=drop_last, device=None, seed=seed, rank=rank,
                         world_size=world_size, threads=threads, prefetch=prefetch, batch_transform=batch_transform,
                         **dataloader_args)
        self.sharding = sharding if sharding is not None or jax.process_count() == 1 else batch_sharding()

    def place(self, batch):
        """``batch`` as numpy, each field as its samples come out of :class:`GrainSource`
        (:func:`nbkit.jax.trees.numpy_batch`), then on JAX's devices (runs in the read-ahead thread)."""
        if self._columnar:  # a cache's own samples (no transform): their kinds give the numpy form
            batch = numpy_batch(self.dataset.schema, batch)
        return place(batch, self.sharding)

    def _place_batches(self, batches: list) -> list:
        """Every batch of one read placed in one ``jax.device_put`` (a call per batch costs more than its
        arrays' placing, which on the CPU is no copy: the rows are 64-byte aligned)."""
        if self._columnar:
            batches = [numpy_batch(self.dataset.schema, batch) for batch in batches]
        return place(batches, self.sharding)  # a list of batches is one tree

    def __repr__(self) -> str:
        return (f"JaxLoader({type(self.dataset).__name__}, batch_size={self.batch_size}, {len(self)} batches, "
                f"sharding={self.sharding}, rank {self.rank}/{self.world_size}, prefetch={self.prefetch})")


def batch_sharding():
    """The batch axis split over every device of every process: ``NamedSharding`` of a one-axis
    mesh named ``"batch"`` (what :class:`JaxLoader` uses over several processes when not told).

    Example:
        >>> import jax
        >>> batch_sharding().spec == jax.sharding.PartitionSpec("batch")
        True
    """
    jax = _jax("nbkit.jax.batch_sharding")
    mesh = jax.sharding.Mesh(jax.devices(), ("batch",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("batch"))


def place(batch, sharding=None):
    """``batch`` (tensors, arrays, in any containers) as ``jax.Array`` s: ``jax.device_put`` on
    ``sharding`` (``None``: the default device) in one process; over several processes, each
    array is this process's rows of a global array (``jax.make_array_from_process_local_data``).
    Arrays of strings and other values JAX cannot hold are left as they are.

    Example:
        >>> import numpy as np, torch
        >>> x, names = place([torch.ones(2, 3), np.array(["a", "b"])])
        >>> type(x).__name__, x.dtype, names.tolist()
        ('ArrayImpl', dtype('float32'), ['a', 'b'])
    """
    import numpy as np

    jax = _jax("nbkit.jax.place")
    tree = numpy_tree(batch)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [k for k, leaf in enumerate(leaves) if isinstance(leaf, np.ndarray) and leaf.dtype.kind not in "SUO"]
    picked = [leaves[k] for k in arrays]
    if jax.process_count() > 1:
        sharding = batch_sharding() if sharding is None else sharding
        moved = [jax.make_array_from_process_local_data(sharding, a) for a in picked]
    else:
        moved = jax.device_put(picked, sharding)
    for k, array in zip(arrays, moved):
        leaves[k] = array
    return jax.tree_util.tree_unflatten(treedef, leaves)
