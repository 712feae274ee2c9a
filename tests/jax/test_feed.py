"""nbkit.jax.JaxLoader: a cache's batches as jax.Arrays (real JAX on the CPU), read ahead, resumed exactly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import nbkit
from jax_samples import N, assert_same_batch, child_env, values
from servers import free_port
from workers import kill_at_signal
from nbkit.jax import JaxLoader, place

HERE = Path(__file__).resolve().parent


def test_torch_and_numpy_caches_feed_the_same_jax_batches(caches):
    a, b = (JaxLoader(caches[k], 8, seed=2, drop_last=True) for k in ("torch", "numpy"))
    order = a.batches(0)
    got_a, got_b = list(a), list(b)
    assert len(got_a) == len(got_b) == N // 8
    for idx, x, y in zip(order, got_a, got_b):
        for batch in (x, y):
            assert all(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(batch))
            assert batch[1].dtype == jax.numpy.bfloat16 and batch[0].shape == (8, 2, 4)
            assert_same_batch(batch, idx)
    assert caches["numpy"].stats.misses == 0


def test_batches_are_placed_with_the_sharding(caches):
    device = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    image, _, label = next(iter(JaxLoader(caches["torch"], 4, sharding=sharding, shuffle=False)))
    assert image.sharding == sharding and label.sharding == sharding
    image, _, _ = next(iter(JaxLoader(caches["torch"], 4, shuffle=False)))
    assert image.devices() == {device}
    with pytest.raises(TypeError, match="jax.sharding.Sharding"):
        JaxLoader(caches["torch"], 4, sharding="data")
    with pytest.raises(TypeError, match="sharding="):
        JaxLoader(caches["torch"], 4, device="cpu")
    with pytest.raises(TypeError, match="num_workers"):
        JaxLoader(caches["torch"], 4, num_workers=2)


def test_strings_stay_on_the_host(tmp_path):
    ds = nbkit.CachedDataset([(np.float32(i), f"s{i}") for i in range(6)], tmp_path / "named")
    x, names = next(iter(JaxLoader(ds, 3, shuffle=False)))
    assert isinstance(x, jax.Array) and list(names) == ["s0", "s1", "s2"]
    moved = place({"a": np.arange(3), "b": np.array([b"x", b"y"]), "c": None})
    assert isinstance(moved["a"], jax.Array) and moved["b"].tolist() == [b"x", b"y"] and moved["c"] is None


def test_a_restored_loader_continues_at_the_exact_batch(caches):
    """Across an epoch's middle, its end and the next epochs, and for one rank of two."""
    for kw in ({"drop_last": True}, {"rank": 1, "world_size": 2}):
        full = JaxLoader(caches["numpy"], 5, seed=9, **kw)
        want = [np.asarray(b[2]).tolist() for _ in range(2) for b in full]
        for cut in (0, 3, len(full), len(full) + 2):
            first = JaxLoader(caches["numpy"], 5, seed=9, **kw)
            seen = []
            while len(seen) < cut:  # the loop trains on `cut` batches, then stops (passes left open)
                it = iter(first)
                seen += [np.asarray(b[2]).tolist() for _, b in zip(range(cut - len(seen)), it)]
            state = json.loads(json.dumps(first.state_dict()))  # plain values: any checkpoint format carries it
            again = JaxLoader(caches["numpy"], 5, seed=9, **kw)
            again.load_state_dict(state)
            rest = [np.asarray(b[2]).tolist() for _ in range(again.epoch, 2) for b in again]
            assert seen + rest == want, (kw, cut)


def read_log(path):
    return [tuple(json.loads(line)[:2]) + (json.loads(line)[2],) for line in path.read_text().splitlines()]


def test_a_killed_training_process_resumes_at_the_exact_batch(caches, tmp_path):
    """A real process trains on JaxLoader batches and is SIGKILLed mid-epoch (batches read ahead,
    never trained on); a new loader resumes from its last saved state: every batch after the
    checkpoint is trained once more, and the whole run is an uninterrupted run's."""
    cache = caches["numpy"].root
    ckpt, signal_file = tmp_path / "ckpt.json", tmp_path / "killed-here"
    every, kill_after = 4, 11
    kill_at_signal([sys.executable, str(HERE / "train_jax.py"), str(cache), str(ckpt), str(tmp_path / "first.log"),
                    str(every), str(kill_after), str(signal_file)], signal_file, child_env())
    saved = json.loads(ckpt.read_text())
    assert len(JaxLoader(caches["numpy"], 5, drop_last=True)) == 9  # killed in epoch 1, saved late in epoch 0
    assert (saved["step"], saved["loader"]["epoch"], saved["loader"]["position"]) == (8, 0, 8)
    # Resumed here (a new process as far as the loader knows: a new handle, a new JaxLoader).
    resumed = JaxLoader(nbkit.CachedDataset.open(cache), 5, seed=3, drop_last=True)
    resumed.load_state_dict(saved["loader"])
    assert resumed.epoch == 0
    second, step = [], saved["step"]
    for epoch in range(resumed.epoch, 3):  # the training script's loop
        resumed.set_epoch(epoch)
        for _, _, label in resumed:
            second.append((step, epoch, np.asarray(label).tolist()))
            step += 1

    loader = JaxLoader(caches["numpy"], 5, seed=3, drop_last=True)
    want = [(step, epoch, [values(int(i))[2] for i in idx]) for step, (epoch, idx) in
            enumerate((e, idx) for e in range(3) for idx in loader.batches(e))]
    first = read_log(tmp_path / "first.log")
    assert [s for s, _, _ in first] == list(range(kill_after))  # it trained on 11 batches, then was killed
    assert first[:8] + second == want
    assert first[8:] == second[:kill_after - 8]  # the 3 batches after the checkpoint are trained again


def test_without_jax_the_feed_says_what_to_install(caches):
    """In a process where jax and grain cannot be imported: ``import nbkit`` and ``nbkit.jax`` never
    try to, GrainSource works (it needs neither), and JaxLoader raises ImportError naming the install."""
    code = """
import importlib.abc, sys
tried = []
class Hidden(importlib.abc.MetaPathFinder):  # as if jax and grain were not installed
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "grain"):
            tried.append(name)
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, Hidden())
import nbkit, nbkit.jax
from nbkit.jax import GrainSource, JaxLoader
ds = nbkit.CachedDataset.open(sys.argv[1])
print(GrainSource(ds)[0][2], GrainSource(ds)._getitems([1])[0][2], tried)
try:
    JaxLoader(ds, 4)
except ImportError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code, str(caches["numpy"].root)], env=child_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    read, message = out.stdout.strip().splitlines()
    assert read == f"{values(0)[2]} {values(1)[2]} []"
    assert message == "nbkit.jax.JaxLoader needs the jax package (nbkit-cache's 'jax' extra): pip install jax grain"


def test_exit_with_a_half_read_pass_prints_nothing(caches):
    """A script that ends inside a pass (a ``JaxLoader`` and a ``DeviceLoader`` iterator left at module
    level) exits quietly: at interpreter exit the epoch is not closed through module globals that are gone."""
    code = """
import sys, nbkit
from nbkit.jax import JaxLoader
ds = nbkit.CachedDataset.open(sys.argv[1])
feed = iter(JaxLoader(ds, 4, prefetch=2))
next(feed)
host = iter(nbkit.DeviceLoader(ds, 4, device=None, prefetch=2))
next(host)
print("read")
"""
    # (Before: always the message; and about one exit in ten aborted, a read-ahead thread caught in
    # jax.device_put at shutdown: the threads are stopped at exit now.)
    out = subprocess.run([sys.executable, "-c", code, str(caches["numpy"].root)], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == (0, "read\n", "")


def test_two_processes_feed_one_global_batch(caches, tmp_path):
    """Two real JAX processes (jax.distributed on the CPU): each reads its shard of each epoch and
    the batches are global arrays of both shards, split over the processes' devices."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "feed_ranks.py"), str(caches["numpy"].root), str(port), str(r),
                               str(tmp_path / f"rank{r}.json")], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [(f["rank"], f["world"]) for f in found] == [(0, 2), (1, 2)]
    one = JaxLoader(caches["numpy"], 4, seed=5, drop_last=True, rank=0, world_size=2)
    assert len(found[0]["batches"]) == len(found[1]["batches"]) == len(one) > 0
    every = []
    for f in found:
        for b in f["batches"]:
            assert b["local_labels"] == [values(i)[2] for i in b["indices"]]  # this process's rows of the global batch
            assert b["spec"] == ["batch"]  # the default: the batch axis over every device of both processes
            every += b["indices"]
    assert sorted(every) == list(range(N - N % 8))


def test_the_hit_rate_meter_counts_the_jax_feed_and_grain(caches):
    import io

    import grain

    from nbkit.jax import GrainSource
    from nbkit.widgets import HitRateMeter

    ds = caches["numpy"]
    meter = HitRateMeter(ds, file=io.StringIO())
    for _ in meter.track(JaxLoader(ds, 8, drop_last=True)):
        pass
    sampler = grain.samplers.IndexSampler(N, shuffle=True, num_epochs=1, seed=0)
    loader = grain.DataLoader(data_source=GrainSource(ds), sampler=sampler, worker_count=0,
                              operations=[grain.transforms.Batch(8)])
    for _ in meter.track(loader):
        pass
    assert [(e.hits, e.misses) for e in meter.epochs] == [(N, 0), (N, 0)]


def sample_of(key):
    """The sample whose image starts with ``key`` (each sample's image is random: its first value names it)."""
    if not hasattr(sample_of, "table"):
        sample_of.table = {float(values(i)[0][0, 0]): i for i in range(N)}
    return sample_of.table[key]


def run_ranks(cache, tmp_path, name, *extra):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(HERE / "feed_ranks.py"), str(cache.root), str(port), str(r),
                               str(tmp_path / f"{name}{r}.json"), *extra], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    return [json.loads((tmp_path / f"{name}{r}.json").read_text()) for r in range(2)]


def test_elastic_resume_between_two_jax_processes_and_other_topologies(caches, tmp_path):
    """Two JAX processes (global batches of 2 x 4) stop at a random step of epoch 0; the rest of the
    epoch continues on one process with batch 3, and on four simulated ranks with batch 2: each
    sample of the epoch trained once. Then one process's state (batch 4) resumes on two JAX processes."""
    import collections
    import random

    ds = caches["numpy"]
    stop = random.Random(38).randrange(1, len(JaxLoader(ds, 4, seed=5, drop_last=True, rank=0, world_size=2)))
    found = run_ranks(ds, tmp_path, "stop", str(stop))
    trained = collections.Counter(sample_of(k) for f in found for b in f["batches"] for k in b["local_keys"])
    states = [f["state"] for f in found]
    assert [(s["rank"], s["world_size"], s["position"]) for s in states] == [(0, 2, stop), (1, 2, stop)]
    want = collections.Counter(i for r in range(2) for b in JaxLoader(ds, 4, seed=5, drop_last=True, rank=r,
                                                                      world_size=2).batches(0) for i in b.tolist())
    for world, batch, given in ((1, 3, states[0]), (4, 2, states)):  # one state (lockstep), or every rank's
        rest = collections.Counter()
        for r in range(world):
            feed = JaxLoader(ds, batch, seed=5, drop_last=True, rank=r, world_size=world)
            feed.load_state_dict(json.loads(json.dumps(given)))
            for image, _, _ in feed:
                rest.update(sample_of(float(k)) for k in np.asarray(image)[:, 0, 0])
            assert feed.epoch == 1
        assert trained + rest == want, (world, batch)

    # One process, batch 4, 5 steps in; resumed by two JAX processes (the rest dealt over them).
    one = JaxLoader(ds, 4, seed=5, drop_last=True, rank=0, world_size=1)
    it = iter(one)
    head = collections.Counter(sample_of(float(k)) for _, (image, _, _) in zip(range(5), it)
                               for k in np.asarray(image)[:, 0, 0])
    (tmp_path / "state.json").write_text(json.dumps(one.state_dict()))
    found = run_ranks(ds, tmp_path, "resumed", "0", str(tmp_path / "state.json"))
    assert [f["resumed_epoch"] for f in found] == [0, 0]
    rest = collections.Counter(sample_of(k) for f in found for b in f["batches"] for k in b["local_keys"])
    assert head + rest == collections.Counter(range(N))


def test_process_0s_state_resumes_every_process_of_the_same_topology(caches):
    """docs/jax.md: the processes of a multi-process JaxLoader share one global batch, so process 0's
    state is the whole run's, on the topology it was saved on too (not only on another one)."""
    ds = caches["numpy"]
    for drop_last in (True, False):
        kw = dict(seed=3, drop_last=drop_last, world_size=2)
        zero = JaxLoader(ds, 4, rank=0, **kw)
        it = iter(zero)
        next(it), next(it)
        state = zero.state_dict()
        it.close()
        for r in (0, 1):
            feed = JaxLoader(ds, 4, rank=r, **kw)
            feed.load_state_dict(state)
            assert feed.state_dict()["rank"] == r and feed.state_dict().get("rest") is None
            want = feed.batches(0)[2:]
            got = list(feed)
            assert len(got) == len(want)
            for batch, idx in zip(got, want):
                assert_same_batch(batch, idx)
    for bad in (np.array([0, 1]), np.int64(0), 0.0):
        with pytest.raises(ValueError, match="'rank'"):
            JaxLoader(ds, 4, rank=1, **kw).load_state_dict(dict(state, rank=bad))
    # A DeviceLoader's ranks may be at different steps: there each rank loads its own state.
    with pytest.raises(ValueError, match="load each process's own state"):
        nbkit.DeviceLoader(ds, 4, rank=1, seed=3, drop_last=False, world_size=2).load_state_dict(state)


def test_held_and_donated_batches_survive_recycled_buffers(tmp_path, monkeypatch):
    """On the CPU a placed batch aliases nbkit's gathered buffer (no copy), and buffers of 4 MiB and more
    are recycled once no numpy view of them is left: a jax.Array held across later epochs, and the output
    of a jitted step that donated its input, must keep their values while those epochs reuse the memory."""
    import gc

    from nbkit import gather

    rows = 4096  # 16 KiB float32 rows: batches of 1 MiB, gathered several at a time, reads >= RECYCLE_MIN_BYTES
    ds = nbkit.CachedDataset([(np.full(rows, i, np.float32), i) for i in range(256)], tmp_path / "big")
    ds.warmup()
    feed = JaxLoader(ds, 64, seed=0)
    assert feed.chunk > 1 and feed.chunk * 64 * rows * 4 >= gather.RECYCLE_MIN_BYTES
    recycled = []
    real = gather._recycle
    monkeypatch.setattr(gather, "_recycle", lambda *a: (recycled.append(a[1]), real(*a)))
    step = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
    held, outs = [], []
    for epoch in range(4):
        for k, (x, y) in enumerate(feed):
            np.testing.assert_array_equal(np.asarray(x)[:, :3], np.repeat(np.asarray(y)[:, None], 3, 1))
            if epoch == 0 and k < 2:  # held (not donated)
                held.append((x, np.asarray(y)))
                continue
            out = step(x)
            if epoch == 0:
                outs.append((out, np.asarray(y)))
        gc.collect()
    assert recycled  # later epochs did reuse freed buffers
    for x, y in held:
        np.testing.assert_array_equal(np.asarray(x), np.repeat(y[:, None].astype(np.float32), rows, 1))
    for out, y in outs:
        np.testing.assert_array_equal(np.asarray(out), np.repeat(y[:, None].astype(np.float32) * 2 + 1, rows, 1))
