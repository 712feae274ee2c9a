"""Exact mid-epoch resume: ``state_dict``/``load_state_dict`` of ``DeviceLoader`` and ``EpochSampler``.

The batches a loop receives before a checkpoint, followed by those a fresh loader restored from it
yields, must equal an uninterrupted run: for every rank of a world, with and without shuffle and
``drop_last``, at any cut point (0, mid-epoch, an epoch's last batch, after a finished pass),
through a real ``torch.save``/``torch.load(weights_only=True)`` round trip and through a real
``SIGKILL`` of the training process. States from elsewhere (a file) are checked at the trust boundary.
"""

import collections
import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import nbkit
from nbkit.samplers import EpochSampler
from workers import kill_at_signal

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st


def round_trip(state):
    """``state`` through torch.save and torch.load(weights_only=True), as a checkpoint file carries it."""
    buf = io.BytesIO()
    torch.save({"loader": state}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["loader"]


def make_loader(ds, **kw):
    kw = {"batch_size": 3, "seed": 11, "rank": 0, "world_size": 1, "prefetch": 4, **kw}
    return nbkit.DeviceLoader(ds, kw.pop("batch_size"), **kw)


def uninterrupted(ds, passes, **kw):
    loader = make_loader(ds, **kw)
    return [x.tolist() for _ in range(passes) for (x,) in loader]


def interrupted(ds, passes, cut, *, finish_pass=False, **kw):
    """Receive ``cut`` batches (across passes), checkpoint, restore into a new loader, go on.
    ``finish_pass``: the cut is a pass's last batch, and that pass ends before the checkpoint
    (``None`` when it is not)."""
    first = make_loader(ds, **kw)
    got, it = [], None
    while len(got) < cut:
        it = iter(first)
        for (x,) in it:
            got.append(x.tolist())
            if len(got) == cut:
                break
    if finish_pass:
        if it is None or len(it) > 0:
            return None
        assert list(it) == []  # StopIteration: the pass is over
    state = round_trip(first.state_dict())
    del first, it
    total = passes * len(make_loader(ds, **kw))
    second = make_loader(ds, **kw)
    second.load_state_dict(state)
    while len(got) < total:
        before = len(got)
        got.extend(x.tolist() for (x,) in second)
        assert len(got) > before, "a restored loader must not yield an empty pass"
    return got


@pytest.mark.fuzz
@given(st.data())
def test_any_cut_then_restore_equals_an_uninterrupted_run(data):
    n = data.draw(st.integers(1, 40), label="samples")
    world = data.draw(st.integers(1, 3), label="world_size")
    kw = dict(batch_size=data.draw(st.integers(1, 7), label="batch_size"), shuffle=data.draw(st.booleans()),
              drop_last=data.draw(st.booleans()), rank=data.draw(st.integers(0, world - 1)), world_size=world,
              seed=data.draw(st.integers(0, 5)))
    ds = TensorDataset(torch.arange(n))
    passes = data.draw(st.integers(1, 3), label="passes")
    want = uninterrupted(ds, passes, **kw)
    cut = data.draw(st.integers(0, len(want)), label="cut")
    assert interrupted(ds, passes, cut, **kw) == want
    finished = interrupted(ds, passes, cut, finish_pass=True, **kw)
    assert finished is None or finished == want


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_every_rank_and_cut_through_a_checkpoint_file(tmp_path, world, shuffle, drop_last):
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(23)), tmp_path / "c")
    ds.warmup()
    for rank in range(world):
        kw = dict(batch_size=4, rank=rank, world_size=world, shuffle=shuffle, drop_last=drop_last)
        want = uninterrupted(ds, 3, **kw)
        per_epoch = len(make_loader(ds, **kw))
        for cut in sorted({0, 1, per_epoch - 1, per_epoch, per_epoch + 1, len(want) - 1, len(want)}):
            assert interrupted(ds, 3, cut, **kw) == want, (rank, cut)
        # Through a real file, as a checkpoint is written.
        loader = make_loader(ds, **kw)
        it = iter(loader)
        head = [next(it)[0].tolist() for _ in range(min(2, per_epoch))]
        torch.save({"step": len(head), "loader": loader.state_dict()}, tmp_path / "ckpt.pt")
        back = torch.load(tmp_path / "ckpt.pt", weights_only=True)
        resumed = make_loader(ds, **kw)
        resumed.load_state_dict(back["loader"])
        # The next pass is the rest of the epoch; after a whole epoch, the next epoch.
        upto = per_epoch if len(head) < per_epoch else 2 * per_epoch
        assert head + [x.tolist() for (x,) in resumed] == want[:upto]


def test_the_state_counts_what_the_loop_received_not_what_was_read_ahead():
    ds = TensorDataset(torch.arange(100))
    loader = make_loader(ds, batch_size=5, prefetch=8)
    it = iter(loader)
    next(it), next(it)
    deadline = time.monotonic() + 30
    while it._pipeline.queue.qsize() < 8 and time.monotonic() < deadline:  # the thread has read ahead
        time.sleep(0.01)
    assert it._pipeline.queue.qsize() == 8
    state = loader.state_dict()
    assert (state["epoch"], state["position"]) == (0, 2)
    assert set(state) == {"kind", "version", "epoch", "position", "length", "batch_size", "drop_last", "shuffle",
                          "seed", "rank", "world_size", "cache", "content"}
    assert all(isinstance(v, (int, str, bool, type(None))) for v in state.values())


def test_a_batch_its_batch_transform_fails_on_was_not_received():
    """The loop never got the batch the transform raised on (a device out of memory): a checkpoint taken
    in the handler resumes at that batch, not after it."""
    ds = TensorDataset(torch.arange(20))
    calls = []

    def transform(batch):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("the device is full")
        return batch

    loader = make_loader(ds, batch_size=4, shuffle=False, batch_transform=transform)
    got = []
    with pytest.raises(MemoryError):
        for (x,) in loader:
            got.append(x.tolist())
    state = round_trip(loader.state_dict())
    assert state["position"] == 2 and got == [[0, 1, 2, 3], [4, 5, 6, 7]]
    again = make_loader(ds, batch_size=4, shuffle=False)
    again.load_state_dict(state)
    assert [x.tolist() for (x,) in again] == [[8, 9, 10, 11], [12, 13, 14, 15], [16, 17, 18, 19]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is False here)")
def test_cuda_batches_gathered_in_chunks_resume_exactly(tmp_path):
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(300)), tmp_path / "c")
    ds.warmup()
    kw = dict(batch_size=7, device="cuda")
    assert make_loader(ds, **kw).chunk > 1  # several batches gathered and copied at once, then split
    want = uninterrupted(ds, 2, **kw)
    for cut in (0, 1, 15, 16, 17, 42, 43, 44, len(want) - 1, len(want)):
        assert interrupted(ds, 2, cut, **kw) == want, cut


def test_a_set_epoch_loop_resumes_mid_epoch_and_at_an_epoch_end():
    ds = TensorDataset(torch.arange(20))

    def run(loader, start, epochs, stop_at=None):
        got = []
        for epoch in range(start, epochs):
            loader.set_epoch(epoch)
            for (x,) in loader:
                got.append((epoch, x.tolist()))
                if len(got) == stop_at:
                    return got, epoch
        return got, epochs

    want, _ = run(make_loader(ds, batch_size=6), 0, 4)
    for stop_at in (0, 1, 3, 4, 5, 9, 16):
        first = make_loader(ds, batch_size=6)
        head, epoch = run(first, 0, 4, stop_at) if stop_at else ([], 0)
        state = round_trip(first.state_dict())
        # The loop restarts at the epoch it was in (saved with the checkpoint) or at loader.epoch.
        for start in ("saved", "loader"):
            second = make_loader(ds, batch_size=6)
            second.load_state_dict(state)
            tail, _ = run(second, epoch if start == "saved" else second.epoch, 4)
            assert head + tail == want, (stop_at, start)
    # Another epoch than the restored one starts from its beginning.
    loader = make_loader(ds, batch_size=6)
    loader.load_state_dict(dict(state, epoch=1, position=2))
    loader.set_epoch(2)
    assert [x.tolist() for (x,) in loader] == [b.tolist() for b in loader.batches(2)]


def test_state_before_iterating_and_after_a_finished_pass():
    ds = TensorDataset(torch.arange(10))
    loader = make_loader(ds, batch_size=4)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (0, 0)
    list(loader)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (0, 3)
    restored = make_loader(ds, batch_size=4)
    restored.load_state_dict(loader.state_dict())
    assert restored.epoch == 1 and restored.state_dict() == loader.state_dict()
    loader.set_epoch(5)
    assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (5, 0)


# -- EpochSampler, alone and in a DataLoader ---------------------------------------------------


@pytest.mark.fuzz
@given(n=st.integers(0, 30), world=st.integers(1, 3), shuffle=st.booleans(), drop_last=st.booleans(),
       cut=st.integers(0, 30), epoch=st.integers(0, 3), data=st.data())
def test_sampler_resumes_at_any_position(n, world, shuffle, drop_last, cut, epoch, data):
    rank = data.draw(st.integers(0, world - 1))
    kw = dict(shuffle=shuffle, drop_last=drop_last, rank=rank, world_size=world, seed=4)
    a = EpochSampler(n, **kw)
    a.set_epoch(epoch)
    want = list(a)
    cut = min(cut, len(want))
    it = iter(a)
    head = [next(it) for _ in range(cut)]
    b = EpochSampler(n, **kw)
    b.load_state_dict(round_trip(a.state_dict()))
    b.set_epoch(epoch)  # the restored epoch: keeps the position
    assert head + list(b) == want
    b.set_epoch(epoch + 1)
    a.set_epoch(epoch + 1)
    assert list(b) == list(a)


def test_sampler_in_a_dataloader_without_and_with_workers():
    ds = TensorDataset(torch.arange(60))
    sampler = EpochSampler(ds, seed=2)
    sampler.set_epoch(1)
    want = [x.tolist() for (x,) in DataLoader(ds, batch_size=8, sampler=sampler)]
    for workers in (0, 2):
        sampler = EpochSampler(ds, seed=2)
        sampler.set_epoch(1)
        loader = DataLoader(ds, batch_size=8, sampler=sampler, num_workers=workers)
        it = iter(loader)
        head = [next(it)[0].tolist() for _ in range(3)]
        drawn = sampler.state_dict()["position"]
        # Without workers the sampler yields a batch's indices when the loop asks for it: exact.
        # With workers the DataLoader draws ahead, so the loop's own count says what was consumed.
        assert drawn == 24 if workers == 0 else drawn > 24
        state = round_trip(sampler.state_dict(consumed=3 * 8))
        del it
        again = EpochSampler(ds, seed=2)
        again.load_state_dict(state)
        again.set_epoch(1)
        tail = [x.tolist() for (x,) in DataLoader(ds, batch_size=8, sampler=again, num_workers=workers)]
        assert head + tail == want, workers


# -- refusals ----------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path):
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(30)), tmp_path / "c")
    ds.warmup()
    return ds


def test_a_state_is_refused_by_another_dataset_or_setting(tmp_path, cache):
    loader = cache.loader(4, seed=1)
    next(iter(loader))
    state = round_trip(loader.state_dict())
    assert state["cache"] == cache.store.meta["generation"]
    refusals = {
        "length=30": nbkit.DeviceLoader(TensorDataset(torch.arange(31)), 4, seed=1),
        "seed=1": cache.loader(4, seed=2),
        "shuffle=True": cache.loader(4, seed=1, shuffle=False),
        "drop_last=False": cache.loader(4, seed=1, drop_last=True),
    }
    for field, other in refusals.items():
        with pytest.raises(ValueError, match=f"made for {field}, but this one has"):
            other.load_state_dict(state)
        # on another topology too (the elastic path checks the same settings)
        other = nbkit.DeviceLoader(other.dataset, 5, seed=other.sampler.seed, shuffle=other.sampler.shuffle,
                                   drop_last=other.drop_last, rank=1, world_size=3)
        with pytest.raises(ValueError, match=f"made for {field}, but this one has"):
            other.load_state_dict(state)
    # Another batch size or world size resumes elastically (tests/test_elastic_resume.py).
    cache.loader(5, seed=1).load_state_dict(state)
    cache.loader(4, seed=1, rank=0, world_size=2).load_state_dict(state)
    two = round_trip(cache.loader(4, seed=1, rank=1, world_size=2).state_dict())
    with pytest.raises(ValueError, match="rank=1.*load each process's own state"):
        cache.loader(4, seed=1, rank=0, world_size=2).load_state_dict(two)
    # Refusals are ResumeStateErrors naming the field, the saved and the current value, and a fix
    # with the saved value (no variable the caller may not have).
    with pytest.raises(nbkit.errors.ResumeStateError, match="seed=1, the checkpointed run's, or start over") as e:
        cache.loader(4, seed=2).load_state_dict(state)
    assert (e.value.field, e.value.saved, e.value.current) == ("seed", 1, 2)
    assert "state[" not in str(e.value)
    # An EpochSampler's state still needs its own topology.
    sampler_state = EpochSampler(cache, seed=1).state_dict()
    with pytest.raises(nbkit.errors.ResumeStateError, match="made for world_size=1"):
        EpochSampler(cache, seed=1, rank=0, world_size=2).load_state_dict(sampler_state)
    # A loader's state is not a sampler's, and the other way round.
    with pytest.raises(ValueError, match="'kind' must be one of \\['nbkit.EpochSampler'\\]"):
        EpochSampler(cache, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="'kind' must be one of \\['nbkit.DeviceLoader'\\]"):
        loader.load_state_dict(EpochSampler(cache, seed=1).state_dict())


def test_a_cache_rebuilt_from_the_same_source_resumes_another_is_refused(tmp_path, cache):
    # The realistic Colab case: the checkpoint kept on Drive, the cache on the runtime's disk, lost
    # and rebuilt from the same source: another generation, the same samples at the same indices.
    loader = cache.loader(4, seed=1)
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(3)]
    state = round_trip(loader.state_dict())
    assert state["content"] and state["content"] == nbkit.samplers.content_identity(cache)
    # (built anew elsewhere: overwrite=True keeps a cache of the same source, it never rebuilds one)
    rebuilt = nbkit.CachedDataset(TensorDataset(torch.arange(30)), tmp_path / "rebuilt")
    assert rebuilt.store.meta["generation"] != state["cache"]
    again = rebuilt.loader(4, seed=1)
    again.load_state_dict(state)
    assert seen + [x.tolist() for (x,) in again] == [b.tolist() for b in cache.loader(4, seed=1).batches(0)]
    # The same too for a copy opened without its source (a pulled or imported cache keeps the fingerprint).
    rebuilt.warmup()
    nbkit.CachedDataset.open(tmp_path / "rebuilt").loader(4, seed=1).load_state_dict(state)
    # Another source of the same length: its batches would differ, refused with the field and the fix.
    other = nbkit.CachedDataset(TensorDataset(torch.arange(30) + 1), tmp_path / "other")
    with pytest.raises(nbkit.errors.ResumeStateError, match="made for cache='[0-9a-f]{32}'.*not built from the same "
                       "source.*start over.*'cache' entry set to None") as e:
        other.loader(4, seed=1).load_state_dict(state)
    assert e.value.field == "cache" and e.value.saved == state["cache"]
    other.loader(4, seed=1).load_state_dict(dict(state, cache=None))  # waived by the caller, as before
    # A state saved by the previous release (no "content"): the same cache loads, a rebuilt one is refused.
    old = {k: v for k, v in state.items() if k != "content"}
    rebuilt = nbkit.CachedDataset(TensorDataset(torch.arange(30)), tmp_path / "rebuilt-again")
    with pytest.raises(nbkit.errors.ResumeStateError, match="made for cache="):
        rebuilt.loader(4, seed=1).load_state_dict(old)
    rebuilt.loader(4, seed=1).load_state_dict(dict(old, cache=rebuilt.store.meta["generation"]))
    # A cache without probe samples in its fingerprint has no content identity: only its own generation fits.
    blind = nbkit.CachedDataset(TensorDataset(torch.arange(30)), tmp_path / "b", fingerprint_samples=0)
    blind_state = blind.loader(4, seed=1).state_dict()
    assert blind_state["content"] is None
    blind = nbkit.CachedDataset(TensorDataset(torch.arange(30)), tmp_path / "b2", fingerprint_samples=0)
    with pytest.raises(nbkit.errors.ResumeStateError):
        blind.loader(4, seed=1).load_state_dict(blind_state)


@pytest.mark.parametrize("change,match", [
    ({"epoch": "3"}, "'epoch' must be an integer >= 0"),
    ({"position": True}, "'position' must be an integer >= 0"),
    ({"position": 1.0}, "'position' must be an integer >= 0"),
    ({"position": -1}, "'position' must be an integer >= 0"),
    ({"position": 9}, "position 9 is past the end of its epoch \\(8\\)"),
    ({"epoch": 1 << 70}, "'epoch' must be an integer"),
    ({"shuffle": 1}, "'shuffle' must be true or false"),
    ({"cache": 5}, "'cache' must be a string"),
    ({"content": 5}, "'content' must be a string"),
    ({"content": "x" * 300}, "'content' must be a string"),
    ({"version": 3}, "has version 3; this nbkit reads version 2. Install a newer nbkit"),
    ({"kind": None}, "'kind' must be one of"),
])
def test_damaged_states_are_refused_naming_the_field(cache, change, match):
    state = dict(cache.loader(4).state_dict(), **change)
    with pytest.raises(ValueError, match=match):
        cache.loader(4).load_state_dict(state)


@pytest.mark.parametrize("key", ["kind", "version", "epoch", "position", "length", "batch_size", "seed", "cache"])
def test_a_state_missing_a_key_is_refused(cache, key):
    state = cache.loader(4).state_dict()
    del state[key]
    with pytest.raises(ValueError, match=f"'{key}' must be present"):
        cache.loader(4).load_state_dict(state)


def test_not_a_dict_is_refused(cache):
    for bad in (None, [], "state", b"\x80", 3):
        with pytest.raises(ValueError, match="its content must be an object"):
            cache.loader(4).load_state_dict(bad)


VALUES = st.one_of(st.none(), st.booleans(), st.integers(-3, 1 << 64), st.floats(), st.text(max_size=40),
                   st.binary(max_size=8), st.lists(st.integers(), max_size=3))


@pytest.mark.fuzz
@given(st.dictionaries(st.sampled_from(["kind", "version", "epoch", "position", "length", "batch_size", "drop_last",
                                        "shuffle", "seed", "rank", "world_size", "cache", "content", "extra"]),
                       VALUES, max_size=5), st.sets(st.sampled_from(["epoch", "position", "seed", "cache", "content"])))
def test_mutated_states_load_cleanly_or_are_refused(changes, dropped):
    ds = TensorDataset(torch.arange(26))
    state = make_loader(ds, batch_size=4).state_dict()
    state.update(changes)
    for key in dropped:
        state.pop(key, None)
    loader = make_loader(ds, batch_size=4)
    try:
        loader.load_state_dict(state)
    except ValueError:
        return
    # Accepted: then it is a valid place to resume from, and the pass is the rest of that epoch.
    epoch, position = state["epoch"], state["position"]
    loader.set_epoch(epoch)
    got = [x.tolist() for (x,) in loader]
    if (state["world_size"], state["batch_size"]) == (1, 4):
        assert got == [b.tolist() for b in loader.batches(epoch)[position:]]
    else:  # another topology (elastic): what no rank had trained on, each sample as often as the epoch has it
        assert not collections.Counter(i for b in got for i in b) - collections.Counter(range(26))


# -- a real process kill -----------------------------------------------------------------------

TRAIN = textwrap.dedent("""
    import os, sys, time
    import torch
    import nbkit

    cache, ckpt, log, every, kill_after, signal_file = sys.argv[1:]
    every, kill_after = int(every), int(kill_after)
    ds = nbkit.CachedDataset.open(cache)
    loader = ds.loader(7, seed=5, rank=1, world_size=2, prefetch=4)
    step = 0
    if os.path.exists(ckpt):
        saved = torch.load(ckpt, weights_only=True)
        loader.load_state_dict(saved["loader"])
        step = saved["step"]
        print(f"resumed at step {step}: epoch {loader.epoch}", flush=True)
    with open(log, "a") as out:
        for epoch in range(loader.epoch, 5):
            loader.set_epoch(epoch)
            for (x,) in loader:
                out.write(f"{step} {epoch} {x.tolist()}\\n")
                out.flush()
                step += 1
                if step % every == 0:  # a checkpoint, written atomically: temporary file, then rename
                    torch.save({"step": step, "loader": loader.state_dict()}, ckpt + ".tmp")
                    os.replace(ckpt + ".tmp", ckpt)
                if step == kill_after:
                    open(signal_file, "w").close()
                    time.sleep(120)  # killed here, mid-epoch, with batches read ahead
""")


def read_log(path):
    with open(path) as f:
        rows = [line.split(" ", 2) for line in f.read().splitlines()]
    return [(int(step), int(epoch), batch) for step, epoch, batch in rows]


@pytest.mark.parametrize("every,kill_after", [(3, 10), (4, 10)], ids=["checkpoint-mid-epoch", "checkpoint-at-epoch-end"])
def test_a_killed_process_resumes_from_its_checkpoint(tmp_path, every, kill_after):
    ds = nbkit.CachedDataset(TensorDataset(torch.arange(50)), tmp_path / "cache")
    ds.warmup()
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    ckpt, signal_file = tmp_path / "ckpt.pt", tmp_path / "killed-here"
    args = [sys.executable, str(script), str(tmp_path / "cache"), str(ckpt)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(os.path.dirname(os.path.dirname(nbkit.__file__))),
                                                         os.environ.get("PYTHONPATH", "")])}
    kill_at_signal([*args, str(tmp_path / "first.log"), str(every), str(kill_after), str(signal_file)], signal_file, env)
    saved = torch.load(ckpt, weights_only=True)
    done = subprocess.run([*args, str(tmp_path / "second.log"), str(every), "0", str(signal_file)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"resumed at step {saved['step']}" in done.stdout

    loader = ds.loader(7, seed=5, rank=1, world_size=2)
    want = [(step, epoch, str(x.tolist())) for step, (epoch, x) in
            enumerate((e, x) for e in range(5) for x in loader.batches(e))]
    first, second = read_log(tmp_path / "first.log"), read_log(tmp_path / "second.log")
    assert [s for s, _, _ in first] == list(range(kill_after))
    last = saved["step"]
    assert last == (kill_after // every) * every
    # Batches after the last checkpoint are trained again, exactly once, from the checkpoint.
    assert [s for s, _, _ in second] == list(range(last, len(want)))
    assert first[last:] == second[:kill_after - last]
    assert first[:last] + second == want
    assert np.diff([s for s, _, _ in first[:last] + second]).tolist() == [1] * (len(want) - 1)
