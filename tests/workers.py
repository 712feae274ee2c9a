"""Process entry points for the concurrency tests (importable by spawned processes)."""

import random

import nbkit
from sources import CountingSource, TupleSource, assert_equal


def warm(path, n, log_dir, delay, barrier=None):
    if barrier is not None:
        barrier.wait()  # every process creates the cache at the same moment
    ds = nbkit.CachedDataset(CountingSource(n, log_dir, delay=delay), path)
    ds.warmup(chunk_size=16)


def warm_shard(path, n, log_dir, rank, world, barrier):
    ds = nbkit.CachedDataset(CountingSource(n, log_dir), path)
    barrier.wait()
    ds.warmup(shard=(rank, world), chunk_size=8)


def read_while_filling(path, n, log_dir, rounds, result):
    src = TupleSource(n)
    ds = nbkit.CachedDataset(CountingSource(n, log_dir), path)
    rng = random.Random(0)
    checked = 0
    for _ in range(rounds):
        idx = rng.sample(range(n), 32)
        batch = ds.__getitems__(idx)
        for j, i in enumerate(idx):
            assert_equal(batch[j], src[i], f"sample {i}")
            checked += 1
    result.put(checked)


def warm_var(path, n, barrier):
    from sources import VarShapeSource

    barrier.wait()
    nbkit.CachedDataset(VarShapeSource(n), path).warmup(chunk_size=7)


# -- sources and entry points for tests/test_start_methods.py and the lifecycle tests --------------
# (module level, so that spawn and forkserver workers can import them)

import os
import time

import torch
from torch.utils.data import Dataset

from sources import TupleSource, image


class ShiftedSource(TupleSource):
    """TupleSource's shape of sample, with other values: ``shift`` tells an old source from a new one."""

    def __init__(self, n=200, shift=0):
        super().__init__(n)
        self.shift = shift

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        return image(i + self.shift, self.shape), (i + self.shift) % 10


class StuckSource(TupleSource):
    """Samples below ``free`` come at once; any other index sleeps ``seconds`` (a source stuck in I/O)."""

    def __init__(self, n=64, free=0, seconds=600.0):
        super().__init__(n)
        self.free, self.seconds = free, seconds

    def __getitem__(self, i):
        if i >= self.free:
            time.sleep(self.seconds)
        return super().__getitem__(i)


class KeyedDataset(Dataset):
    """A dataset that caches its own samples with ``nbkit.CacheLoader`` inside ``__getitem__``."""

    def __init__(self, path, n=32):
        self.loader = nbkit.CacheLoader(path)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.loader.get(f"k{i}", lambda key: image(i)), i


def overwrite(path, n, shift):
    """Rebuild the cache at ``path`` from ``ShiftedSource(n, shift)`` (another process's overwrite=True)."""
    nbkit.CachedDataset(ShiftedSource(n, shift), path, overwrite=True).warmup()


def warm_stuck(path, result, stop_by):
    """Warm a cache whose source sticks after 32 samples, with 2 workers; once 32 are stored, stop
    it (``stop_by="callback"``: ``request_stop()`` from another thread, as the panel's Stop does;
    ``"signal"``: tell the parent, which sends SIGINT); put what happened on ``result``."""
    import signal
    import threading

    # As in an interactive Python: a suite run as a background job of a script (CI's .ci/run runs
    # both stacks' suites at once that way) starts with SIGINT ignored, and its processes inherit it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ds = nbkit.CachedDataset(StuckSource(64, free=32), path, fingerprint_samples=0)
    cb = nbkit.Callback()

    def stop_when_stuck():
        while cb.value < 32:
            time.sleep(0.01)
        time.sleep(0.5)  # the workers are inside the stuck source by now
        result.put(("asked", time.monotonic()))
        if stop_by == "callback":
            cb.request_stop()

    threading.Thread(target=stop_when_stuck, daemon=True).start()
    try:
        report = ds.warmup(num_workers=2, chunk_size=8, callback=cb)
    except KeyboardInterrupt:
        result.put(("interrupted", time.monotonic()))
    else:
        result.put(("report", report.computed, report.stopped, time.monotonic()))


class FailingSource(TupleSource):
    """Index ``bad`` raises ``ValueError`` (``crash=True``: the process dies at once, as if OOM-killed)."""

    def __init__(self, n=40, bad=30, crash=False):
        super().__init__(n)
        self.bad, self.crash = bad, crash

    def __getitem__(self, i):
        if i == self.bad:
            if self.crash:
                os._exit(9)
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


def kill_at_signal(args, signal_file, env, *, timeout=120):
    """Start ``args`` as a child process, wait until it writes ``signal_file`` (its kill point), then
    SIGKILL it; asserts that it got there alive and that the kill is what ended it."""
    import os
    import signal
    import subprocess
    import time

    # A process group of its own: what the child started (Grain's worker processes, which outlive a
    # SIGKILLed parent) is killed with the group afterwards, not left running for the rest of the session.
    child = subprocess.Popen(args, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not os.path.exists(signal_file):
            assert child.poll() is None, "the training process ended before it was killed"
            assert time.monotonic() < deadline, "the training process never reached the kill point"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert child.returncode == -signal.SIGKILL
