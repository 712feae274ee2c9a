"""nbkit.jax.GrainBatches: whole shuffled batches as Grain records, read by real Grain (worker processes included)."""

import pickle

import numpy as np
import pytest

grain = pytest.importorskip("grain")

import nbkit
from jax_samples import N, NumpySource, assert_same_batch
from nbkit.jax import GrainBatches, JaxLoader


def loader(source, workers=0):
    return grain.DataLoader(data_source=source, sampler=grain.samplers.SequentialSampler(len(source)),
                            worker_count=workers)


def same(a, b):
    """Two numpy batches (or trees of them) are equal, field by field."""
    import jax

    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def parse_absl_flags():
    """grain 0.2.18 with jaxlib >= 0.11 reads an absl flag when a DataLoader starts workers (docs/jax.md)."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


@pytest.mark.parametrize("writer", ["numpy", "torch"])
@pytest.mark.parametrize("drop", [False, True])
def test_each_epoch_reads_every_sample_once_as_the_caches_samples(caches, writer, drop):
    ds = caches[writer]
    source = GrainBatches(ds, 5, seed=3, num_epochs=2, drop_remainder=drop)
    per_epoch = N // 5 if drop else -(-N // 5)
    assert len(source) == 2 * per_epoch and source.batches_per_epoch == per_epoch
    batches = list(loader(source))
    assert len(batches) == len(source)
    epochs = []
    for e in range(2):
        read = []
        for j in range(e * per_epoch, (e + 1) * per_epoch):
            b = batches[j]
            assert type(b) is list and all(isinstance(x, np.ndarray) for x in b)  # collate's list of fields, numpy
            assert_same_batch(b, source.indices(j))
            read += source.indices(j).tolist()
        assert len(read) == len(set(read)) == (N - N % 5 if drop else N)
        epochs.append(read)
    assert epochs[0] != epochs[1] and sorted(epochs[0]) != epochs[0]  # reshuffled every epoch


@pytest.mark.parametrize("writer", ["numpy", "torch"])
def test_one_shard_gives_jax_loaders_batches(caches, writer):
    """The same seed, epochs and drop setting: JaxLoader's batches (on the host before placing), in its order."""
    ds = caches[writer]
    source = GrainBatches(ds, 8, seed=5, num_epochs=2, drop_remainder=True)
    feed = JaxLoader(ds, 8, seed=5, drop_last=True, rank=0, world_size=1)
    want = []
    for e in range(2):
        feed.set_epoch(e)
        want += list(feed)
    got = list(grain.MapDataset.source(source))
    assert len(got) == len(want) == len(source)
    for g, w in zip(got, want):
        same(g, w)


def test_the_order_depends_only_on_seed_and_epoch(caches):
    a = GrainBatches(caches["numpy"], 6, seed=9, num_epochs=3)
    b = pickle.loads(pickle.dumps(GrainBatches(caches["torch"], 6, seed=9, num_epochs=3)))
    assert [a.indices(j).tolist() for j in range(len(a))] == [b.indices(j).tolist() for j in range(len(b))]
    other = GrainBatches(caches["numpy"], 6, seed=10, num_epochs=3)
    assert a.indices(0).tolist() != other.indices(0).tolist()
    plain = GrainBatches(caches["numpy"], 6, shuffle=False, num_epochs=2)
    assert np.concatenate([plain.indices(j) for j in range(len(plain))]).tolist() == list(range(N)) * 2


@pytest.mark.parametrize("remainder", [False, True])
def test_two_shards_split_each_epoch_by_batch(caches, remainder):
    """Shard k reads batches k, k + 2, … of each epoch: together every batch once, each step's two
    batches consecutive ones of the same epoch. 10 batches an epoch of 5 samples (the last one 3)."""
    ds = caches["torch"]
    whole = GrainBatches(ds, 5, seed=2, num_epochs=3)
    shards = [GrainBatches(ds, 5, seed=2, num_epochs=3, shard_options=grain.sharding.ShardOptions(k, 2, remainder))
              for k in (0, 1)]
    assert [len(s) for s in shards] == [15, 15]
    got = [list(loader(shards[0])), list(grain.MapDataset.source(shards[1]))]  # DataLoader and MapDataset alike
    for k, s in enumerate(shards):
        for j, b in enumerate(got[k]):
            epoch, step = divmod(j, 5)
            assert s.indices(j).tolist() == whole.indices(epoch * 10 + 2 * step + k).tolist()
            assert_same_batch(b, s.indices(j))
    for epoch in range(3):
        read = np.concatenate([s.indices(j) for s in shards for j in range(5 * epoch, 5 * epoch + 5)])
        assert sorted(read.tolist()) == list(range(N))


def test_uneven_shards_and_their_drop_remainder(caches):
    """7 batches an epoch over 2 shards: 4 and 3 (every batch read), or 3 and 3 with the shards' drop_remainder."""
    ds = caches["numpy"]
    make = lambda k, drop: GrainBatches(ds, 7, seed=1, num_epochs=2,  # noqa: E731
                                        shard_options=grain.sharding.ShardOptions(k, 2, drop))
    assert [len(make(k, False)) for k in (0, 1)] == [8, 6]
    assert [len(make(k, True)) for k in (0, 1)] == [6, 6]
    for e in range(2):
        read = [i for k, per in ((0, 4), (1, 3)) for j in range(per) for i in make(k, False).indices(e * per + j)]
        assert sorted(read) == list(range(N))
    dropped = [i for k in (0, 1) for j in range(3) for i in make(k, True).indices(j)]
    assert len(dropped) == len(set(dropped)) == 6 * 7


def test_shard_by_jax_process_is_the_whole_epoch_in_one_process(caches):
    source = GrainBatches(caches["numpy"], 16, shard_options=grain.sharding.ShardByJaxProcess(drop_remainder=True))
    assert (source.shard_index, source.shard_count, len(source)) == (0, 1, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_checkpoint_resumes_at_the_exact_batch(caches, workers, cpu_only_workers):
    """get_state() after 4 batches; a new iterator (new workers) set to it gives exactly the rest, epochs included."""
    parse_absl_flags()
    source = GrainBatches(caches["numpy"], 5, seed=4, num_epochs=2, shard_options=grain.sharding.ShardOptions(1, 2))
    it = iter(loader(source, workers))
    first = [next(it) for _ in range(4)]
    state = it.get_state()
    rest = list(it)
    assert len(first) + len(rest) == len(source) == 10
    for j, b in enumerate(first + rest):
        assert_same_batch(b, source.indices(j))
    again = iter(loader(source, workers))
    again.set_state(state)
    resumed = list(again)
    assert len(resumed) == len(rest)
    for r, b in zip(resumed, rest):
        same(r, b)


def test_a_map_dataset_checkpoint_resumes_at_the_exact_batch(caches):
    source = GrainBatches(caches["torch"], 6, seed=8, num_epochs=3)
    ds = grain.MapDataset.source(source).to_iter_dataset()
    it = iter(ds)
    for _ in range(11):  # into the second epoch
        next(it)
    state = it.get_state()
    rest = list(it)
    again = iter(ds)
    again.set_state(state)
    resumed = list(again)
    assert len(resumed) == len(rest) == 3 * 8 - 11
    for j, (r, b) in enumerate(zip(resumed, rest)):
        same(r, b)
        assert_same_batch(r, source.indices(11 + j))


def test_a_checkpoint_refuses_other_settings(caches):
    source = GrainBatches(caches["numpy"], 5, seed=4)
    it = iter(loader(source))
    next(it)
    state = it.get_state()
    assert b"nbkit.jax.GrainBatches" in state
    for other in (GrainBatches(caches["numpy"], 5, seed=5), GrainBatches(caches["numpy"], 5, seed=4, shuffle=False),
                  GrainBatches(caches["torch"], 5, seed=4)):  # the same length, other batches
        assert len(other) == len(source)
        with pytest.raises(ValueError, match="data source"):
            iter(loader(other)).set_state(state)


def test_a_partial_cache_computes_its_missing_samples(tmp_path):
    ds = nbkit.CachedDataset(NumpySource(), tmp_path / "partial")
    source = GrainBatches(ds, 8, seed=0)
    for j in range(len(source)):
        assert_same_batch(source[j], source.indices(j))
    assert ds.is_complete


def test_a_transform_is_applied(tmp_path):
    ds = nbkit.CachedDataset(NumpySource(), tmp_path / "t", transform=lambda s: (s[0] * 2, s[2]))
    source = GrainBatches(ds, 4, shuffle=False)
    x, y = source[1]
    np.testing.assert_array_equal(x, np.stack([NumpySource()[i][0] * 2 for i in range(4, 8)]))
    assert y.tolist() == [i % 7 for i in range(4, 8)]


def test_hostile_arguments_say_what_to_pass(caches):
    ds = caches["numpy"]
    with pytest.raises(TypeError, match="CachedDataset or the path"):
        GrainBatches(NumpySource(), 4)
    for bad, error, match in ((0, ValueError, "batch_size"), (-3, ValueError, "batch_size"), (2**41, ValueError, "2\\*\\*40"),
                              (1.5, TypeError, "batch_size"), (True, TypeError, "batch_size"), ("8", TypeError, "batch_size")):
        with pytest.raises(error, match=match):
            GrainBatches(ds, bad)
    with pytest.raises(ValueError, match="seed"):
        GrainBatches(ds, 4, seed=-1)
    with pytest.raises(ValueError, match="seed % 2\\*\\*62"):
        GrainBatches(ds, 4, seed=2**64)
    with pytest.raises(ValueError, match="num_epochs"):
        GrainBatches(ds, 4, num_epochs=0)
    with pytest.raises(TypeError, match="num_epochs"):
        GrainBatches(ds, 4, num_epochs=None)
    with pytest.raises(TypeError, match="shuffle"):
        GrainBatches(ds, 4, shuffle="yes")
    with pytest.raises(TypeError, match="drop_remainder"):
        GrainBatches(ds, 4, drop_remainder=1)
    with pytest.raises(TypeError, match="ShardByJaxProcess"):
        GrainBatches(ds, 4, shard_options=(0, 2))
    with pytest.raises(ValueError, match="gets no batch.*smaller batch_size"):
        GrainBatches(ds, N + 1, drop_remainder=True)
    with pytest.raises(ValueError, match="gets no batch.*fewer shards"):
        GrainBatches(ds, 16, shard_options=grain.sharding.ShardOptions(3, 4))
    source = GrainBatches(ds, 4)
    for bad, error in (("3", TypeError), (1.0, TypeError), (True, TypeError), (None, TypeError),
                       (len(source), IndexError), (-len(source) - 1, IndexError), (2**70, IndexError)):
        with pytest.raises(error, match="record"):
            source[bad]
    same(source[-1], source[len(source) - 1])
    same(source[np.int64(2)], source[2])


def test_num_epochs_up_to_what_a_length_holds(caches):
    """len(source) must fit a Py_ssize_t: num_epochs past that is refused with the most there can be
    (it was accepted, and len(), Grain's samplers and MapDataset raised OverflowError)."""
    import sys

    ds = caches["numpy"]
    per = GrainBatches(ds, 4).per_shard
    most = GrainBatches(ds, 4, seed=3, num_epochs=sys.maxsize // per)
    assert len(most) == sys.maxsize // per * per
    same(most[-1], most[len(most) - 1])
    np.testing.assert_array_equal(most.indices(len(most) - 1), most._order(len(most) // per - 1)[(per - 1) * 4:per * 4])
    same(next(iter(loader(most))), GrainBatches(ds, 4, seed=3)[0])
    with pytest.raises(ValueError, match=f"num_epochs <= {sys.maxsize // per}"):
        GrainBatches(ds, 4, num_epochs=sys.maxsize // per + 1)
    with pytest.raises(ValueError, match="num_epochs"):
        GrainBatches(ds, 4, num_epochs=1 << 62)
    # A shard left with nothing by the shard options' drop_remainder says so.
    with pytest.raises(ValueError, match="after the shard options' drop_remainder=True"):
        GrainBatches(ds, N // 3, shard_options=grain.sharding.ShardOptions(0, 8, drop_remainder=True))
