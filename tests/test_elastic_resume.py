"""Elastic resume: a ``DeviceLoader`` state saved with N ranks and batch size B continues with M ranks
and batch size B'.

Every sample of the interrupted epoch that no old rank had trained on is trained exactly once
across the new ranks, the rest of the epoch in a deterministic order, then the new topology's
normal epochs: with ranks simulated in one process (``rank=``/``world_size=``), at any cut (each
rank at its own position, given as the list of every rank's state; or all at one position, given
as one state), resumed again on a third topology; and with real ``torch.distributed`` (gloo)
processes killed at random steps, resumed with 1 and with 4 processes and another batch size.
"""

import collections
import io
import os
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

import nbkit
from servers import free_port

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings
from hypothesis import strategies as st


def round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def loaders(ds, world, batch, **kw):
    return [nbkit.DeviceLoader(ds, batch, rank=r, world_size=world, prefetch=2, **kw) for r in range(world)]


def take(loader, count):
    it = iter(loader)
    got = [x.tolist() for _, (x,) in zip(range(count), it)]
    return got, it


def epoch_samples(ds, world, batch, epoch, **kw):
    """Every sample ``world`` ranks train on in ``epoch`` (the same-topology path: ``batches``)."""
    c = collections.Counter()
    for loader in loaders(ds, world, batch, **kw):
        for b in loader.batches(epoch):
            c.update(b.tolist())
    return c


def interrupt(group, positions, epoch):
    """Each loader of ``group`` trains ``positions[r]`` batches of ``epoch``; their samples and states."""
    trained, states = collections.Counter(), []
    for loader, p in zip(group, positions):
        loader.set_epoch(epoch)
        got, it = take(loader, p)
        for b in got:
            trained.update(b)
        states.append(round_trip(loader.state_dict()))
        del it
    return trained, states


@pytest.mark.fuzz
@settings(deadline=None)
@given(st.data())
def test_any_cut_on_any_topology_trains_each_sample_once(data):
    n = data.draw(st.integers(1, 50), label="samples")
    kw = dict(shuffle=data.draw(st.booleans(), label="shuffle"), drop_last=data.draw(st.booleans(), label="drop_last"),
              seed=data.draw(st.integers(0, 3), label="seed"))
    ds = TensorDataset(torch.arange(n))
    epoch = data.draw(st.integers(0, 2), label="epoch")
    old_w, old_b = data.draw(st.integers(1, 4), label="old world"), data.draw(st.integers(1, 6), label="old batch")
    old = loaders(ds, old_w, old_b, **kw)
    lockstep = data.draw(st.booleans(), label="lockstep")
    if lockstep:
        p = data.draw(st.integers(0, len(old[0])), label="position")
        positions = [p] * old_w
    else:
        positions = [data.draw(st.integers(0, len(loader)), label=f"position {r}") for r, loader in enumerate(old)]
    trained, states = interrupt(old, positions, epoch)
    want = epoch_samples(ds, old_w, old_b, epoch, **kw)

    # Resumed on a new topology, perhaps interrupted again and resumed on a third one.
    again = data.draw(st.booleans(), label="interrupt again")
    for hop in range(2 if again else 1):
        new_w, new_b = data.draw(st.integers(1, 5), label="new world"), data.draw(st.integers(1, 6), label="new batch")
        new = loaders(ds, new_w, new_b, **kw)
        for loader in new:
            loader.load_state_dict(states[0] if lockstep and (new_w, new_b) != (old_w, old_b) else states)
        if not trained:  # nothing trained yet: the epoch is the new topology's own
            want = epoch_samples(ds, new_w, new_b, epoch, **kw)
        passes = [iter(loader) if loader.epoch == epoch else iter(()) for loader in new]  # the rest of the epoch
        counts = [len(it) if hasattr(it, "__len__") else 0 for it in passes]
        if (new_w, new_b) != (old_w, old_b):  # (the same topology: each rank goes on from its own position)
            assert max(counts) - min(counts) <= 1  # ranks' passes differ by one batch at most
        lockstep, old_w, old_b = False, new_w, new_b
        if hop == 0 and again:
            states = []
            for loader, it, c in zip(new, passes, counts):
                for _, (x,) in zip(range(data.draw(st.integers(0, c), label="cut")), it):
                    trained.update(x.tolist())
                states.append(round_trip(loader.state_dict()))
            continue
        for it in passes:
            for (x,) in it:
                trained.update(x.tolist())
        break
    assert trained == want  # every sample of the epoch once (padding repeats: as often as the epoch has it)
    # Later epochs: the new topology's own.
    for loader, other in zip(new, loaders(ds, new_w, new_b, **kw)):
        assert loader.epoch == epoch + 1
        assert [x.tolist() for (x,) in loader] == [b.tolist() for b in other.batches(epoch + 1)]


def test_the_rest_is_deterministic_and_in_the_epochs_order():
    ds = TensorDataset(torch.arange(40))
    old = loaders(ds, 2, 4, seed=7)
    _, states = interrupt(old, [3, 3], 1)
    runs = []
    for _ in range(2):
        new = loaders(ds, 3, 2, seed=7)
        for loader in new:
            loader.load_state_dict(states)
        runs.append([[x.tolist() for (x,) in loader] for loader in new])
    assert runs[0] == runs[1]
    # Lockstep from one state gives the same: the 24 samples after the 3 steps of 2 x 4, in the epoch's order,
    # dealt over 3 ranks as an epoch is (rank r takes every 3rd, in batches of 2).
    order = torch.randperm(40, generator=torch.Generator().manual_seed(7 + 1)).tolist()
    rest = order[24:]
    for r, batches in enumerate(runs[0]):
        mine = rest[r::3]
        assert batches == [mine[a:a + 2] for a in range(0, len(mine), 2)]
    one = nbkit.DeviceLoader(ds, 2, rank=1, world_size=3, seed=7)
    one.load_state_dict(states[0])
    assert [x.tolist() for (x,) in one] == runs[0][1]


def test_the_state_of_a_resumed_epoch_carries_its_rest_and_resumes_on_the_same_topology():
    ds = TensorDataset(torch.arange(30))
    _, states = interrupt(loaders(ds, 2, 3), [2, 4], 0)
    new = nbkit.DeviceLoader(ds, 4, rank=0, world_size=1)
    new.load_state_dict(states)
    it = iter(new)
    head = [next(it)[0].tolist() for _ in range(2)]
    state = round_trip(new.state_dict())
    assert state["version"] == 2 and state["rest"] == [{"world_size": 2, "batch_size": 3, "positions": [2, 4]}]
    assert all(isinstance(v, int) for level in state["rest"] for v in level["positions"])
    again = nbkit.DeviceLoader(ds, 4, rank=0, world_size=1)
    again.load_state_dict(state)
    tail = [x.tolist() for (x,) in again]
    whole = nbkit.DeviceLoader(ds, 4, rank=0, world_size=1)
    whole.load_state_dict(states)
    assert head + tail == [x.tolist() for (x,) in whole]
    # A state with no rest is version 1, as before.
    assert round_trip(nbkit.DeviceLoader(ds, 4).state_dict())["version"] == 1


def test_a_list_of_states_must_be_one_checkpoints_every_rank():
    ds = TensorDataset(torch.arange(20))
    old = loaders(ds, 3, 2)
    _, states = interrupt(old, [1, 1, 1], 0)
    loader = nbkit.DeviceLoader(ds, 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="one state of each of the 3 ranks"):
        loader.load_state_dict(states[:2])
    with pytest.raises(ValueError, match="one state of each of the 3 ranks"):
        loader.load_state_dict([states[0], states[0], states[2]])
    with pytest.raises(ValueError, match="disagree on epoch"):
        loader.load_state_dict([states[0], states[1], dict(states[2], epoch=1)])
    with pytest.raises(ValueError, match="disagree on world_size"):
        loader.load_state_dict([states[0], dict(states[1], world_size=4), states[2]])
    with pytest.raises(ValueError, match="rank 3 is not below its world_size 3"):
        loader.load_state_dict([dict(states[0], rank=3)])
    # The same topology's list: each rank takes its own state (the exact path).
    same = nbkit.DeviceLoader(ds, 2, rank=2, world_size=3)
    same.load_state_dict(states)
    assert [x.tolist() for (x,) in same] == [b.tolist() for b in same.batches(0)[1:]]


REST = st.lists(st.fixed_dictionaries({"world_size": st.one_of(st.integers(-1, 5), st.just(1 << 30), st.booleans()),
                                       "batch_size": st.one_of(st.integers(-1, 5), st.text(max_size=2)),
                                       "positions": st.one_of(st.lists(st.integers(-2, 12), max_size=6), st.none())}),
                max_size=3)


@pytest.mark.fuzz
@settings(deadline=None)
@given(rest=st.one_of(REST, st.none(), st.integers(), st.text(max_size=3)), world=st.integers(-1, 6),
       batch=st.integers(-1, 6), rank=st.integers(-1, 6), position=st.integers(-1, 12), as_list=st.booleans())
def test_hostile_rest_fields_are_refused_cleanly(rest, world, batch, rank, position, as_list):
    ds = TensorDataset(torch.arange(17))
    state = dict(nbkit.DeviceLoader(ds, 3, rank=0, world_size=1).state_dict(), version=2, rest=rest,
                 world_size=world, batch_size=batch, rank=rank, position=position)
    loader = nbkit.DeviceLoader(ds, 2, rank=1, world_size=2)
    try:
        loader.load_state_dict([state] if as_list else state)
    except ValueError:
        return
    # Accepted: a pass of samples of the epoch, no sample more often than the epoch has it.
    got = collections.Counter(i for (x,) in loader for i in x.tolist())
    assert not got - collections.Counter(range(17))


def test_states_holding_arrays_or_tensors_are_refused_naming_the_field():
    """A state from torch.load may hold a tensor or an array where an int belongs: a clean error naming
    the field, never torch's or numpy's "ambiguous truth value"."""
    ds = TensorDataset(torch.arange(20))
    good = nbkit.DeviceLoader(ds, 2, rank=0, world_size=2).state_dict()
    loader = nbkit.DeviceLoader(ds, 2, rank=0, world_size=2)
    for name in ("world_size", "batch_size", "rank"):
        for value in (torch.tensor([2, 2]), np.array([2, 2]), torch.tensor(2), np.int64(2)):
            with pytest.raises(ValueError, match=f"'{name}'"):
                loader.load_state_dict(dict(good, **{name: value}))
    # A rest level's position past what nbkit counts (not an int64): damaged, not an OverflowError.
    with pytest.raises(ValueError, match=r"rest\[0\]\.positions\[0\]"):
        loader.load_state_dict(dict(good, version=2, rest=[{"world_size": 2, "batch_size": 2, "positions": [1 << 70, 0]}]))


def test_a_long_list_of_states_is_refused_before_each_is_checked():
    ds = TensorDataset(torch.arange(20))
    _, states = interrupt(loaders(ds, 3, 2), [1, 1, 1], 0)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="one state of each of the 3 ranks.*got 1000000 states"):
        nbkit.DeviceLoader(ds, 2).load_state_dict([states[r % 3] for r in range(10 ** 6)])
    assert time.perf_counter() - t0 < 5  # (checking each state first took ~40 s)


def test_a_rest_level_of_a_million_ranks_is_checked_at_once():
    ds = TensorDataset(torch.arange(20))
    world = 1 << 20
    state = dict(nbkit.DeviceLoader(ds, 2).state_dict(), version=2, rank=0, world_size=world, batch_size=1,
                 rest=[{"world_size": world, "batch_size": 1, "positions": [0] * (world - 1) + [2]}])
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"rest\\[0\\] position 2 of rank {world - 1} is past the end"):
        nbkit.DeviceLoader(ds, 2).load_state_dict(state)
    assert time.perf_counter() - t0 < 5


def test_a_refused_set_epoch_keeps_the_restored_position():
    ds = TensorDataset(torch.arange(20))
    _, states = interrupt(loaders(ds, 1, 4), [2], 1)
    loader = nbkit.DeviceLoader(ds, 4)
    loader.load_state_dict(states[0])
    for bad in (-1, 1 << 63):
        with pytest.raises(ValueError, match="epoch"):
            loader.set_epoch(bad)
    assert loader.state_dict()["position"] == 2
    loader.set_epoch(1)
    assert [x.tolist() for (x,) in loader] == [b.tolist() for b in loader.batches(1)[2:]]


def test_state_dict_right_after_an_elastic_load_resumes_the_same_rest():
    """Resume, save before the first batch, resume again (on the new topology and on a third one):
    the same samples, every one once; then set_epoch of another epoch starts that one from its beginning."""
    ds = TensorDataset(torch.arange(37))
    for drop_last in (False, True):
        kw = dict(seed=2, drop_last=drop_last)
        trained, states = interrupt(loaders(ds, 3, 4, **kw), [2, 1, 2], 0)
        want = epoch_samples(ds, 3, 4, 0, **kw)
        new = loaders(ds, 2, 5, **kw)
        for loader in new:
            loader.load_state_dict(states)
        saved = [round_trip(loader.state_dict()) for loader in new]
        assert all(s["position"] == 0 and s["epoch"] == 0 for s in saved)
        third = loaders(ds, 4, 3, **kw)
        for loader in third:
            loader.load_state_dict(saved)
        assert trained + collections.Counter(i for loader in third for (x,) in loader for i in x.tolist()) == want
        again = loaders(ds, 2, 5, **kw)
        for loader in again:
            loader.load_state_dict(saved[loader.rank])   # its own topology: each rank its own state
            loader.set_epoch(2)
            assert [x.tolist() for (x,) in loader] == [b.tolist() for b in loader.batches(2)]


def test_a_finished_epoch_stays_finished_through_a_topology_with_no_batch():
    """Found by the long fuzz run: an epoch finished on 1 rank of batch 2 (6 samples, drop_last), resumed on
    2 ranks of batch 4 (no batch an epoch there), saved, then resumed on 1 rank of batch 1 trained the
    whole epoch again: the state said "position 0 of 0", which reads as an epoch not begun."""
    ds = TensorDataset(torch.arange(6))
    kw = dict(shuffle=False, drop_last=True)
    trained, states = interrupt(loaders(ds, 1, 2, **kw), [3], 0)
    assert sum(trained.values()) == 6
    middle = loaders(ds, 2, 4, **kw)
    for loader in middle:
        loader.load_state_dict(states)
        assert len(loader) == 0 and loader.epoch == 1
    saved = [round_trip(loader.state_dict()) for loader in middle]
    for states_given in (saved, saved[0]):
        last = nbkit.DeviceLoader(ds, 1, **kw)
        last.load_state_dict(states_given)
        assert last.epoch == 1
        last.set_epoch(0)  # the restored epoch: nothing of it is left
        assert list(last) == []
    # This world's own state, too.
    again = nbkit.DeviceLoader(ds, 4, rank=1, world_size=2, **kw)
    again.load_state_dict(saved[1])
    assert again.epoch == 1


# -- real processes: torch.distributed (gloo), killed at random steps ------------------------------

TRAIN = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    import nbkit

    cache, out, world, batch, every, kill_file, port = sys.argv[1:8]
    world, batch, every = int(world), int(batch), int(every)
    rank = int(os.environ.get("RANK", "0"))
    kill_after = int(open(kill_file).read().split()[rank])   # this rank's kill step (0: never)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    loader = nbkit.CachedDataset.open(cache).loader(batch, seed=5, prefetch=3)   # rank, world from torch.distributed
    assert (loader.rank, loader.world_size) == (rank, world)
    saved = sorted(f for f in os.listdir(out) if f.startswith("ckpt-")) if os.path.exists(os.path.join(out, "resume")) else []
    if saved:   # every rank of the interrupted run saved its own state: give them all (ranks may differ)
        loader.load_state_dict([torch.load(os.path.join(out, f), weights_only=True) for f in saved])
    step = 0
    with open(os.path.join(out, f"log-{world}-{rank}"), "a") as log:
        for epoch in range(loader.epoch, 2):
            loader.set_epoch(epoch)
            for (x,) in loader:
                log.write(f"{step} {epoch} {' '.join(map(str, x.tolist()))}\\n"); log.flush()
                step += 1
                if not saved and step % every == 0:   # this rank's own checkpoint, atomically
                    path = os.path.join(out, f"ckpt-{rank}.pt")
                    torch.save(loader.state_dict(), path + ".tmp"); os.replace(path + ".tmp", path)
                if step == kill_after:
                    open(os.path.join(out, f"killed-{rank}"), "w").close()
                    time.sleep(120)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
""")


def run_ranks(script, args, world, env, *, kill=False, timeout=240):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), *args(world), port], env={**env, "RANK": str(r)},
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for r in range(world)]
    try:
        if kill:  # wait until every rank reached its kill point (its own step), then SIGKILL them all
            deadline = time.monotonic() + timeout
            while not all(os.path.exists(os.path.join(args(world)[1], f"killed-{r}")) for r in range(world)):
                assert all(p.poll() is None for p in procs), [p.stderr.read()[-2000:] for p in procs if p.poll() is not None]
                assert time.monotonic() < deadline, "the ranks never reached their kill points"
                time.sleep(0.05)
            for p in procs:
                p.kill()
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            if not kill:
                assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)


def read_logs(out, world):
    """``[(step, epoch, samples)]`` of each rank's log."""
    logs = []
    for r in range(world):
        with open(os.path.join(out, f"log-{world}-{r}")) as f:
            logs.append([(int(s), int(e), [int(v) for v in rest.split()]) for s, e, rest in
                         (line.split(" ", 2) for line in f.read().splitlines())])
    return logs


@pytest.mark.parametrize("new_world,new_batch", [(1, 5), (4, 3)])
def test_two_gloo_ranks_killed_at_random_steps_resume_with_another_world_and_batch(tmp_path, new_world, new_batch):
    n, batch, every = 96, 4, 3
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(n)), tmp_path / "cache")
    ds.warmup()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "run"
    out.mkdir()
    rng = random.Random(new_world)
    per_epoch = n // 2 // batch  # 12 steps an epoch on each of the 2 ranks
    kills = [rng.randrange(every, per_epoch), rng.randrange(every, per_epoch)]  # each rank its own step, mid-epoch
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(os.path.dirname(os.path.dirname(nbkit.__file__))),
                                                         os.environ.get("PYTHONPATH", "")])}
    kill_file = tmp_path / "kill"
    kill_file.write_text(" ".join(map(str, kills)))
    run_ranks(script, lambda w: [str(ds.root), str(out), str(w), str(batch), str(every), str(kill_file)], 2, env, kill=True)
    saved = [torch.load(out / f"ckpt-{r}.pt", weights_only=True) for r in range(2)]
    assert [s["position"] for s in saved] == [k // every * every for k in kills]

    for f in ("killed-0", "killed-1"):
        os.remove(out / f)
    kill_file.write_text(" ".join(["0"] * new_world))
    (out / "resume").touch()
    run_ranks(script, lambda w: [str(ds.root), str(out), str(w), str(new_batch), str(every), str(kill_file)],
              new_world, env)
    first, second = read_logs(out, 2), read_logs(out, new_world)
    trained = collections.Counter()
    for log, s in zip(first, saved):
        assert [step for step, _, _ in log] == list(range(len(log)))
        for step, epoch, samples in log[:s["position"]]:  # what each rank trained on before its checkpoint
            assert epoch == 0
            trained.update(samples)
    resumed = collections.Counter()
    for r, log in enumerate(second):
        for _, epoch, samples in log:
            if epoch == 0:
                trained.update(samples)
            else:
                resumed.update(samples)
        normal = ds.loader(new_batch, seed=5, rank=r, world_size=new_world).batches(1)
        assert [b for _, e, b in log if e == 1] == [b.tolist() for b in normal]
    assert trained == collections.Counter(range(n))  # the interrupted epoch: every sample exactly once
    assert resumed == collections.Counter(range(n))  # the next epoch: the new world's, every sample once
    lengths = [sum(1 for _, e, _ in log if e == 0) for log in second]
    assert max(lengths) - min(lengths) <= 1
