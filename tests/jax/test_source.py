"""nbkit.jax.GrainSource: a cache as a Grain data source, read by real Grain (worker processes included)."""

import io
import multiprocessing
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

grain = pytest.importorskip("grain")

import nbkit
from jax_samples import N, NumpySource, Pair, TorchSource, assert_same_batch, child_env, values
from nbkit.errors import MissingSampleError
from nbkit.jax import GrainSource

HERE = Path(__file__).resolve().parent

def leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_torch_and_numpy_caches_give_the_same_numpy_samples(caches):
    a, b = GrainSource(caches["torch"]), GrainSource(caches["numpy"])
    assert len(a) == len(b) == N
    for i in (0, 5, N - 1, np.int64(7)):
        for got in (a[i], b[i]):
            assert type(got) is tuple and not any(isinstance(x, torch.Tensor) for x in got)
            assert_same_batch([np.asarray(x)[None] for x in got], [i])
    order = [9, 2, 2, 40]
    for got in (a._getitems(order), b._getitems(order)):
        assert [type(s) for s in got] == [tuple] * 4
        assert_same_batch([np.stack([s[k] for s in got]) for k in range(3)], order)


@pytest.mark.parametrize("writer", ["numpy", "torch"])
def test_stored_samples_reach_grain_without_a_tensor(caches, monkeypatch, writer):
    """Samples come from the cache's columns as numpy rows: no tensor is made on the way to Grain,
    whoever wrote the cache."""
    source = GrainSource(caches[writer])
    source[0]  # the store is open, its checks done
    for name in ("from_numpy", "as_tensor", "tensor", "stack"):
        monkeypatch.setattr(torch, name, None)  # calling any of them would raise TypeError
    monkeypatch.setattr(torch.Tensor, "numpy", None)
    got = source._getitems([3, 4]) + [source[5]]
    assert_same_batch([np.stack([s[k] for s in got]) for k in range(3)], [3, 4, 5])


def test_map_dataset_shuffles_batches_and_reads_in_batches(caches):
    source = GrainSource(caches["numpy"])
    ds = grain.MapDataset.source(source).shuffle(seed=4).batch(8)
    order = [int(k) for k in grain.MapDataset.range(N).shuffle(seed=4)]
    for j in range(len(ds)):
        assert_same_batch(ds[j], order[8 * j:8 * j + 8])
    # Grain's batched read (its batch pushdown) reaches the source's _getitems: one gather per batch.
    calls = []
    read = source._getitems
    source._getitems = lambda idx: calls.append(list(idx)) or read(idx)
    got = grain.MapDataset.source(source)._getitems([5, 1, 44])
    assert calls == [[5, 1, 44]]
    assert_same_batch([np.stack([s[k] for s in got]) for k in range(3)], [5, 1, 44])


def test_shards_by_jax_process_and_by_explicit_shards(caches):
    source = GrainSource(caches["torch"])
    seen = []
    for shard in (grain.sharding.ShardByJaxProcess(drop_remainder=True),
                  grain.sharding.ShardOptions(shard_index=0, shard_count=2), grain.sharding.ShardOptions(1, 2)):
        sampler = grain.samplers.IndexSampler(N, shard_options=shard, shuffle=True, num_epochs=1, seed=1)
        loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[grain.transforms.Batch(4)],
                                  worker_count=0)
        # This shard's records are the sampler's positions shard_index, shard_index + shard_count, …
        keys = [int(sampler[j].record_key) for j in range(shard.shard_index, N, shard.shard_count)]
        batches = list(loader)
        assert len(batches) == len(keys) // 4
        for j, b in enumerate(batches):
            assert_same_batch(b, keys[4 * j:4 * j + 4])
        seen.append(keys)
    assert sorted(seen[0]) == list(range(N))  # one process: every sample
    assert sorted(seen[1] + seen[2]) == list(range(N))


def test_grain_workers_read_both_caches_alike_and_resume_from_a_checkpoint(caches, cpu_only_workers):
    """grain.DataLoader with 2 prefetch worker processes: samples from the torch-written and the
    numpy-written cache are identical, the shuffle is the sampler's, and an iterator restored from
    ``get_state()`` (new workers) gives exactly the rest of the epoch."""
    parse_absl_flags()
    for ds in caches.values():
        ds.reset_stats()
    source = Pair(GrainSource(caches["torch"]), GrainSource(caches["numpy"]))
    sampler = grain.samplers.IndexSampler(N, shard_options=grain.sharding.ShardByJaxProcess(), shuffle=True,
                                          num_epochs=1, seed=7)
    loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[grain.transforms.Batch(6)],
                              worker_count=2)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = it.get_state()
    rest = list(it)
    batches = first + rest
    assert len(batches) == N // 6
    for b in batches:  # each worker batches the records it read: the indices say which
        assert_same_batch(b["torch"], b["index"])
        assert_same_batch(b["numpy"], b["index"])
    read = np.concatenate([b["index"] for b in batches]).tolist()
    assert sorted(read) == sorted(int(sampler[k].record_key) for k in range(N)) == list(range(N))
    assert read != list(range(N))  # the sampler's shuffle
    # The workers' reads count in the main process's stats (the hit-rate meter sees them).
    assert caches["numpy"].stats.hits >= N and caches["numpy"].stats.misses == 0

    again = iter(loader)
    again.set_state(state)
    resumed = list(again)
    assert len(resumed) == len(rest)
    for r, b in zip(resumed, rest):
        for x, y in zip(leaves(r), leaves(b)):
            np.testing.assert_array_equal(x, y)


def parse_absl_flags():
    """grain 0.2.18 with jaxlib >= 0.11 (the newest stack) reads an absl flag when a DataLoader starts its
    workers (``grain_enable_multiprocess_worker_profiling``), which raises UnparsedFlagAccessError
    outside ``absl.app.run`` (a notebook, pytest); Colab's jax 0.7.2 never reads it. docs/jax.md gives
    users the same line."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def test_a_checkpoint_refuses_another_cache(caches, tmp_path):
    other = nbkit.CachedDataset([values(i) for i in range(N)], tmp_path / "other")
    sampler = grain.samplers.IndexSampler(N, shuffle=False, num_epochs=1, seed=0)
    make = lambda ds: grain.DataLoader(data_source=GrainSource(ds), sampler=sampler,  # noqa: E731
                                       operations=[grain.transforms.Batch(4)], worker_count=0)
    it = iter(make(caches["numpy"]))
    next(it)
    state = it.get_state()
    assert b"nbkit.jax.GrainSource" in state
    with pytest.raises(ValueError, match="data source"):
        iter(make(other)).set_state(state)


def test_a_complete_cache_pickles_without_its_source(caches):
    data = pickle.dumps(GrainSource(caches["torch"]))

    class WithoutSources(pickle.Unpickler):
        def find_class(self, module, name):
            assert module != "jax_samples", f"the pickle carries {module}.{name}"
            return super().find_class(module, name)

    back = WithoutSources(io.BytesIO(data)).load()
    assert back.dataset.source is None
    assert_same_batch([np.stack([s[k] for s in back._getitems([1, 2])]) for k in range(3)], [1, 2])


def test_a_partial_cache_travels_with_its_source_and_one_without_raises(tmp_path):
    ds = nbkit.CachedDataset(NumpySource(), tmp_path / "partial")
    ds[0]
    back = pickle.loads(pickle.dumps(GrainSource(ds)))
    assert type(back.dataset.source).__name__ == "NumpySource"
    assert_same_batch([np.stack([s[k] for s in back._getitems([3, 0])]) for k in range(3)], [3, 0])
    assert ds.stats.cached == 2  # the copy computed sample 3 and stored it
    opened = pickle.loads(pickle.dumps(GrainSource(tmp_path / "partial")))
    with pytest.raises(MissingSampleError):
        opened[9]


def test_many_threads_read_a_freshly_unpickled_source(caches):
    """Grain's reader threads (``ReadOptions.num_threads``) all start on a source whose files are not
    open yet in this process: each gets its samples."""
    from concurrent.futures import ThreadPoolExecutor

    source = pickle.loads(pickle.dumps(GrainSource(caches["torch"])))
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(source.__getitem__, range(N)))
    assert_same_batch([np.stack([s[k] for s in got]) for k in range(3)], range(N))


def _read_in_worker(source, indices):
    return source.dataset.source is None, [np.stack([s[k] for s in source._getitems(indices)]) for k in range(3)]


# forkserver pickles as spawn does; fork warns because grain's ShardByJaxProcess loaded jax here, whose
# threads the child never uses (it reads the cache with numpy only).
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_a_source_reopens_in_a_new_process(caches, method, cpu_only_workers):
    source = GrainSource(caches["torch"])
    source[0]  # opened here: the worker must reopen its own files, not inherit them
    with multiprocessing.get_context(method).Pool(1) as pool:
        sourceless, batch = pool.apply(_read_in_worker, (source, [4, 1, 30]))
    assert sourceless
    assert_same_batch(batch, [4, 1, 30])


def test_bad_arguments_say_what_to_pass(caches):
    with pytest.raises(TypeError, match="CachedDataset or the path"):
        GrainSource(NumpySource())
    with pytest.raises(TypeError, match="storage_options"):
        GrainSource(caches["numpy"], storage_options={})
    with pytest.raises(FileNotFoundError):
        GrainSource("/nonexistent/nbkit-cache")


def test_a_killed_grain_training_process_resumes_at_the_exact_batch(caches, tmp_path, cpu_only_workers):
    """A real process trains on a grain.DataLoader (2 prefetch workers) over the cache and is
    SIGKILLed mid-run; Grain's iterator state saved in its checkpoint resumes a new loader (new
    workers, a new handle of the cache) at the batch after the checkpoint: the whole run is an
    uninterrupted run's."""
    import base64
    import json
    import sys

    from train_grain import loader
    from workers import kill_at_signal

    cache = str(caches["numpy"].root)
    ckpt, signal_file = tmp_path / "ckpt.json", tmp_path / "killed-here"
    every, kill_after = 4, 11
    kill_at_signal([sys.executable, str(HERE / "train_grain.py"), cache, str(ckpt), str(tmp_path / "first.log"),
                    str(every), str(kill_after), str(signal_file)], signal_file, child_env())
    saved = json.loads(ckpt.read_text())
    assert saved["step"] == 8
    state = base64.b64decode(saved["grain"])
    it = iter(loader(cache))
    it.set_state(state)
    second = [np.asarray(label).tolist() for _, _, label in it]
    want = [np.asarray(label).tolist() for _, _, label in loader(cache)]
    first = [json.loads(line) for line in (tmp_path / "first.log").read_text().splitlines()]
    assert [s for s, _ in first] == list(range(kill_after))  # it trained on 11 batches, then was killed
    assert len(want) == 3 * N // 5 and [labels for _, labels in first[:8]] + second == want
    assert [labels for _, labels in first[8:]] == second[:kill_after - 8]  # trained again after the checkpoint
