"""Races between real processes on one cache (issue 25): a push during a warmup, an open during a
removal, two rebuilds at once, a directory swapped during ``nbkit rm``.

Each interleaving is forced: a child process stops at a hook (a source sample, a wrapped nbkit
function), tells the test through an event, and waits to be let go; the test acts in between. Waits
have timeouts only so that a hung run fails instead of hanging; no timing decides an outcome. The
free-running loops at the end add rounds where the processes meet wherever they meet.
"""

import contextlib
import multiprocessing as mp
import os
import threading
import time
import traceback

import numpy as np
import pytest

import nbkit
import nbkit.disk
import nbkit.format
import nbkit.stores.local
import nbkit.transfer.sync
from nbkit.errors import CorruptCacheError, StaleCacheError
from nbkit.fingerprint import fingerprint
from sources import TupleSource, assert_equal

# fork: the hooks below are set inside the children, and a spawned child would spend seconds importing torch.
CTX = mp.get_context("fork")
WAIT = 60.0  # only so that a hung run fails; never reached when the code is right
# The test process has threads (torch's, a push's pool) when it forks; the children only run nbkit.
pytestmark = pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
CACHE_FILES = ("nbkit.json", "index.bin", "heap.bin", "heap.lock")


class GatedSource(TupleSource):
    """TupleSource (same samples) that, once ``arm()`` was called, stops at sample ``pause_at`` until
    the test lets it go, and tells when it reaches sample ``mark`` (so the test knows what was stored)."""

    def __init__(self, n=64, shift=0):
        super().__init__(n)
        self.shift = shift
        self.gate = None

    def arm(self, pause_at, reached, go, mark=None, marked=None):
        self.gate = (pause_at, reached, go, mark, marked)

    def __getitem__(self, i):
        if self.gate is not None:
            pause_at, reached, go, mark, marked = self.gate
            if i == pause_at:
                reached.set()
                assert go.wait(WAIT), "the test never let the source go on"
            if i == mark:
                marked.set()
        x, y = super().__getitem__(i)
        return x + self.shift, y


class Shifted(GatedSource):
    """Another source of the same shape (another fingerprint): samples shifted by 1000."""

    def __init__(self, n=64):
        super().__init__(n, shift=1000)


def _run_child(q, fn, args, barrier):
    try:
        q.put(("ok", fn(*args)))
    except BaseException as e:  # noqa: BLE001 - every outcome goes back to the test
        q.put(("error", type(e).__name__, str(e), getattr(e, "errno", None), traceback.format_exc()))
        if barrier is not None:
            barrier.abort()  # the test stops waiting for this process at once


class Child:
    """``fn(*args)`` in a forked process; :meth:`result` is ``("ok", value)`` or ``("error", type, text, errno)``."""

    def __init__(self, fn, *args, barrier=None):
        self.q = CTX.Queue()
        self.p = CTX.Process(target=_run_child, args=(self.q, fn, args, barrier), daemon=True)
        self.p.start()

    def result(self, timeout=WAIT):
        try:
            out = self.q.get(timeout=timeout)
        finally:
            self.p.join(timeout)
            if self.p.is_alive():
                self.p.kill()
        return out


@contextlib.contextmanager
def failing_children(*children):
    """A barrier broken by a child that failed shows that child's error."""
    try:
        yield
    except threading.BrokenBarrierError:
        raise AssertionError(f"a child process failed: {[c.result(5) for c in children]}") from None


def wait_for(pred, what, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def _pid_blocked(pid) -> bool:
    """Whether process ``pid`` waits for a ``flock`` now (``/proc/locks`` lists waiters as ``N: -> FLOCK …``)."""
    with open("/proc/locks") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[1] == "->" and str(pid) in parts[5:6]:
                return True
    return False


def assert_clean_error(outcome, where):
    """An error a user can act on: one of nbkit's kinds, with its own message (not a raw ``[Errno 2]``)."""
    assert outcome[0] == "error", f"{where}: expected an error, got {outcome}"
    kind, text = outcome[1], outcome[2]
    assert kind in ("FileNotFoundError", "StaleCacheError", "CorruptCacheError"), f"{where}: {kind}: {text}"
    assert not text.startswith("[Errno"), f"{where}: a raw error from deep inside: {kind}: {text}"
    assert "nbkit" in text or "cache" in text, f"{where}: {kind}: {text}"


def assert_whole(path, src, *, complete=None):
    """The cache at ``path`` verifies, and every sample it stores equals ``src``'s."""
    ds = nbkit.CachedDataset.open(path)
    assert ds.verify() == len(ds) - len(ds.missing())
    stored = np.setdiff1d(np.arange(len(ds)), ds.missing())
    if complete is not None:
        assert ds.is_complete == complete
    if len(stored):
        batch = ds.__getitems__(stored.tolist())
        for j, i in enumerate(stored):
            assert_equal(batch[j], src[int(i)], f"sample {i}")
    return len(stored)


def assert_no_orphan(path):
    """Nothing at ``path``, or a whole cache, or only what ``nbkit ls`` lists and ``nbkit rm`` removes."""
    if not os.path.lexists(path):
        return
    names = os.listdir(path)
    if "nbkit.json" in names:
        nbkit.CachedDataset.open(path).verify()
        return
    orphans = [n for n in names if n in CACHE_FILES or n.startswith("col-")]
    if orphans:
        listed = [c for c in nbkit.caches(os.path.dirname(path), max_depth=1) if c.path == os.path.abspath(path)]
        assert listed and listed[0].leftover, f"{path} holds {orphans} without nbkit.json, and nbkit ls does not list it"
        nbkit.remove(path)
        assert not os.path.exists(path) or not [n for n in os.listdir(path) if n in CACHE_FILES or n.startswith("col-")]


# ---------------------------------------------------------------------------------------------------
# 1. push during a warmup in another process


def _warm(path, src, pause_at, reached, go, mark, marked):
    ds = nbkit.CachedDataset(src, path)
    src.arm(pause_at, reached, go, mark, marked)
    return ds.warmup(chunk_size=4).computed


def test_a_push_during_a_warmup_in_another_process_uploads_exactly_what_it_hashed(tmp_path, monkeypatch):
    n, path, url = 64, str(tmp_path / "c"), str(tmp_path / "remote" / "c")
    src = GatedSource(n)
    older = nbkit.CachedDataset(src, path)
    older.__getitems__(list(range(8)))  # an older good copy with 8 samples, pushed first
    older.store.close()
    del older
    nbkit.push(path, url)
    nbkit.pull(url, str(tmp_path / "old"))
    assert assert_whole(str(tmp_path / "old"), src) == 8

    reached, go, marked = CTX.Event(), CTX.Event(), CTX.Event()
    # The warmup stops at sample 16 (samples 0-15 stored), then fills 16-19 and reaches 20 only
    # once that chunk is stored: the push lets it go right after hashing.
    child = Child(_warm, path, src, 16, reached, go, 20, marked)
    assert reached.wait(WAIT)
    seen = {}
    real_manifest, real_parallel = nbkit.transfer.sync.build_manifest, nbkit.transfer.sync._run_parallel

    def manifest_then_let_the_writer_go(root, **kwargs):
        m = real_manifest(root, **kwargs)
        go.set()
        # The writer either stores its chunk now (nothing holds it off) or waits for the push's lock.
        wait_for(lambda: marked.is_set() or _pid_blocked(child.p.pid), "the warmup to write or wait")
        seen["writer held off"] = not marked.is_set()
        return m

    def pull_mid_upload(*a, **k):
        if "mid" in seen:  # the pull's own downloads
            return real_parallel(*a, **k)
        seen["mid"] = None
        try:  # a reader of the URL meanwhile: the older copy whole, or nothing published (never a torn copy)
            nbkit.pull(url, str(tmp_path / "mid"))
            seen["mid"] = assert_whole(str(tmp_path / "mid"), src)
        except FileNotFoundError as e:
            seen["mid"] = str(e)
        return real_parallel(*a, **k)

    monkeypatch.setattr(nbkit.transfer.sync, "build_manifest", manifest_then_let_the_writer_go)
    monkeypatch.setattr(nbkit.transfer.sync, "_run_parallel", pull_mid_upload)
    try:
        outcome = "ok", nbkit.push(path, url)
    except (OSError, RuntimeError) as e:  # refusing cleanly (a file changed) is allowed; a torn copy is not
        outcome = "refused", e
    finally:
        go.set()
    assert child.result() == ("ok", n - 8)
    assert seen["writer held off"], "the warmup wrote into the cache while the push read it"
    assert outcome[0] == "ok", outcome
    nbkit.pull(url, str(tmp_path / "copy"))
    assert assert_whole(str(tmp_path / "copy"), src) >= 16
    assert seen["mid"] == 8 or "holds no complete nbkit cache" in seen["mid"], seen["mid"]
    # and a push once the warmup is done sends the whole cache
    nbkit.push(path, url)
    nbkit.pull(url, str(tmp_path / "copy"))
    assert assert_whole(str(tmp_path / "copy"), src, complete=True) == n


# ---------------------------------------------------------------------------------------------------
# 2. opening a cache while nbkit.remove / nbkit.prune removes it


def _open_paused_at_open_store(path, with_source, reached, go):
    real = nbkit.stores.local.CacheFiles

    def paused(*a, **k):
        reached.set()
        assert go.wait(WAIT)
        return real(*a, **k)

    nbkit.stores.local.CacheFiles = paused
    ds = nbkit.CachedDataset(GatedSource(32), path) if with_source else nbkit.CachedDataset.open(path)
    return len(ds[3])


@pytest.mark.parametrize("with_source", [False, True], ids=["open", "with-source"])
def test_a_cache_removed_between_reading_its_metadata_and_mapping_its_files(tmp_path, with_source):
    path = str(tmp_path / "c")
    nbkit.CachedDataset(GatedSource(32), path).warmup()
    reached, go = CTX.Event(), CTX.Event()
    child = Child(_open_paused_at_open_store, path, with_source, reached, go)
    assert reached.wait(WAIT)
    nbkit.remove(path)  # nothing holds it yet: removed whole
    go.set()
    assert_clean_error(child.result(), "an open racing nbkit.remove")
    assert not os.path.lexists(path) or not os.listdir(path), f"files re-created after the removal: {os.listdir(path)}"


def _remove_paused_holding_it(path, reached, go):
    real = nbkit.disk.unused

    @contextlib.contextmanager
    def paused(root):
        with real(root) as free:
            reached.set()
            assert go.wait(WAIT)
            yield free

    nbkit.disk.unused = paused
    return nbkit.remove(path).left


@pytest.mark.parametrize("with_source", [False, True], ids=["open", "with-source"])
def test_an_open_waits_for_a_removal_in_progress_then_fails_cleanly(tmp_path, with_source):
    path = str(tmp_path / "c")
    nbkit.CachedDataset(GatedSource(32), path).warmup()
    reached, go = CTX.Event(), CTX.Event()
    child = Child(_remove_paused_holding_it, path, reached, go)
    assert reached.wait(WAIT)
    outcome = {}

    def opener():
        try:
            ds = nbkit.CachedDataset(GatedSource(32), path) if with_source else nbkit.CachedDataset.open(path)
            outcome["r"] = ("ok", ds[3])
            ds.store.close()
        except BaseException as e:  # noqa: BLE001 - every outcome goes back to the test
            outcome["r"] = ("error", type(e).__name__, str(e), getattr(e, "errno", None))

    t = threading.Thread(target=opener)
    t.start()
    wait_for(lambda: "r" in outcome or _pid_blocked(os.getpid()), "the opener to wait for the removal")
    go.set()
    t.join(WAIT)
    removal = child.result()
    assert removal == ("ok", ()), removal
    if outcome["r"][0] == "ok":  # the opener came first (with its source it may also re-create the cache)
        assert_equal(outcome["r"][1], GatedSource(32)[3])
        assert with_source and assert_whole(path, GatedSource(32)) >= 1
    else:
        assert_clean_error(outcome["r"], "an open racing nbkit.remove")
    assert_no_orphan(path)


def _open_and_read_in_a_loop(path, rounds, barrier, with_source):
    src, errors, reads = GatedSource(32), {}, 0
    for _ in range(rounds):
        barrier.wait(WAIT)
        try:
            ds = nbkit.CachedDataset(src, path) if with_source else nbkit.CachedDataset.open(path)
            batch = ds.__getitems__(list(range(0, 32, 5)))
            for j, i in enumerate(range(0, 32, 5)):
                assert_equal(batch[j], src[i], f"sample {i}")
            reads += 1
            ds.store.close()
            del ds
        except (FileNotFoundError, StaleCacheError, CorruptCacheError) as e:
            assert not str(e).startswith("[Errno"), f"a raw error from deep inside: {type(e).__name__}: {e}"
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
    return reads, errors


@pytest.mark.parametrize("how", ["remove", "prune", "remove-with-source"])
def test_opening_and_reading_while_another_process_removes_the_cache(tmp_path, monkeypatch, how):
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "copies"))
    path = str(tmp_path / "copies" / "c") if how == "prune" else str(tmp_path / "c")
    rounds = 12
    barrier = CTX.Barrier(2)
    child = Child(_open_and_read_in_a_loop, path, rounds, barrier, how == "remove-with-source", barrier=barrier)
    with failing_children(child):
        _remove_in_a_loop(path, rounds, barrier, how)
    reads, errors = child.result()[1]
    assert reads + sum(errors.values()) == rounds
    assert_no_orphan(path)


def _remove_in_a_loop(path, rounds, barrier, how):
    for _ in range(rounds):
        if not os.path.exists(os.path.join(path, "nbkit.json")):
            ds = nbkit.CachedDataset(GatedSource(32), path)
            ds.warmup()
            ds.store.close()
            del ds
        barrier.wait(WAIT)
        try:
            if how == "prune":
                nbkit.prune(older_than=0)
            else:
                nbkit.remove(path)
        except OSError as e:
            assert e.errno == 16 or isinstance(e, FileNotFoundError), e  # busy: the opener has it open
        except ValueError as e:  # the opener (with its source) is re-creating it right now
            assert how == "remove-with-source" and "not an nbkit cache" in str(e), e


# ---------------------------------------------------------------------------------------------------
# 3. two overwrite=True at once


def _fp(src):
    return fingerprint(src)[0]


def assert_one_whole_cache(path, sources):
    meta = nbkit.format.read_meta(path)
    named = [s for s in sources if _fp(s) == meta["fingerprint"]]
    assert len(named) == 1, "the metadata names neither source"
    assert_whole(path, named[0])
    return named[0]


def _overwrite_paused_at_publish(path, reached, go):
    real = nbkit.format.publish_meta

    def paused(root, meta):
        reached.set()
        assert go.wait(WAIT)
        return real(root, meta)

    nbkit.format.publish_meta = paused
    ds = nbkit.CachedDataset(GatedSource(32), path, overwrite=True)
    return ds.warmup().computed


def _overwrite_paused_after_removing(path, read, read_go, reached, go):
    real_read, real = nbkit.stores.local.LocalLocation.read_meta, nbkit.stores.local.LocalLocation.remove
    first = [True]

    def read_paused(self):
        meta = real_read(self)
        if first:  # B has seen the old cache (of a third source), so it will remove it
            first.clear()
            read.set()
            assert read_go.wait(WAIT)
        return meta

    def paused(self):
        real(self)
        reached.set()
        assert go.wait(WAIT)

    nbkit.stores.local.LocalLocation.read_meta = read_paused
    nbkit.stores.local.LocalLocation.remove = paused
    ds = nbkit.CachedDataset(Shifted(32), path, overwrite=True)
    return ds.warmup().computed


def test_an_overwrite_that_removes_a_cache_being_created_never_leaves_metadata_without_files(tmp_path):
    """A creates the cache and stops before publishing its metadata; B (overwrite) removes what is
    there and stops before creating its own; A publishes; B goes on."""
    path = str(tmp_path / "c")
    # A third source: overwrite=True replaces only a cache of another source, so both A and B remove it.
    nbkit.CachedDataset(GatedSource(32, shift=500), path).warmup()
    a_reached, a_go, b_reached, b_go = CTX.Event(), CTX.Event(), CTX.Event(), CTX.Event()
    b_read, b_read_go = CTX.Event(), CTX.Event()
    b = Child(_overwrite_paused_after_removing, path, b_read, b_read_go, b_reached, b_go)
    assert b_read.wait(WAIT)  # B read the old cache's metadata
    a = Child(_overwrite_paused_at_publish, path, a_reached, a_go)
    assert a_reached.wait(WAIT)
    b_read_go.set()
    wait_for(lambda: b_reached.is_set() or _pid_blocked(b.p.pid), "B to remove the cache (or wait for A)")
    a_go.set()
    wait_for(lambda: not a.q.empty() or b_reached.is_set(), "A to finish or B to remove")
    b_go.set()
    results = [a.result(), b.result()]
    for r in results:
        assert r[0] == "ok" or r[1] in ("StaleCacheError", "CorruptCacheError"), r
        if r[0] == "error":
            assert_clean_error(r, "the loser of two overwrites")
    winner = assert_one_whole_cache(path, [GatedSource(32), Shifted(32)])
    ds = nbkit.CachedDataset(winner, path)
    ds.warmup()
    assert_whole(path, winner, complete=True)


def _warm_paused(path, src, overwrite, pause_at, reached, go):
    ds = nbkit.CachedDataset(src, path, overwrite=overwrite)
    src.arm(pause_at, reached, go)
    return ds.warmup(chunk_size=4).computed


def test_an_overwrite_while_another_process_warms_the_old_cache_leaves_only_the_new_one(tmp_path):
    path = str(tmp_path / "c")
    reached, go = CTX.Event(), CTX.Event()
    a = Child(_warm_paused, path, GatedSource(32), True, 8, reached, go)
    assert reached.wait(WAIT)  # A stored 0-7 and computes 8-11
    nbkit.CachedDataset(Shifted(32), path, overwrite=True).warmup()
    go.set()
    r = a.result()
    assert r[0] == "error" and r[1] == "StaleCacheError", r  # A never writes its samples into B's cache
    assert assert_one_whole_cache(path, [GatedSource(32), Shifted(32)]).shift == 1000
    assert_whole(path, Shifted(32), complete=True)


def _overwrite_at_once(path, shift, barrier, rounds):
    src = Shifted(32) if shift else GatedSource(32)
    out = []
    for _ in range(rounds):
        barrier.wait(WAIT)
        try:
            nbkit.CachedDataset(src, path, overwrite=True).warmup(chunk_size=4)
            out.append("ok")
        except (StaleCacheError, CorruptCacheError) as e:
            assert not str(e).startswith("[Errno"), e
            out.append(type(e).__name__)
        barrier.wait(WAIT)
    return out


def test_two_overwrites_at_once_leave_one_whole_cache(tmp_path):
    path, rounds = str(tmp_path / "c"), 6
    barrier = CTX.Barrier(3)
    a = Child(_overwrite_at_once, path, 0, barrier, rounds, barrier=barrier)
    b = Child(_overwrite_at_once, path, 1000, barrier, rounds, barrier=barrier)
    with failing_children(a, b):
        for _ in range(rounds):
            barrier.wait(WAIT)  # both start
            barrier.wait(WAIT)  # both ended
            assert_one_whole_cache(path, [GatedSource(32), Shifted(32)])
    ra, rb = a.result(), b.result()
    assert ra[0] == rb[0] == "ok", (ra, rb)


# ---------------------------------------------------------------------------------------------------
# 4. the directory swapped during nbkit rm


@pytest.mark.parametrize("swap", ["symlink", "rename"])
def test_a_directory_swapped_during_nbkit_rm_leaves_the_other_cache_untouched(tmp_path, swap):
    path, other, aside = str(tmp_path / "c"), str(tmp_path / "other"), str(tmp_path / "aside")
    nbkit.CachedDataset(GatedSource(32), path).warmup()
    nbkit.CachedDataset(Shifted(16), other).warmup()
    reached, go = CTX.Event(), CTX.Event()
    child = Child(_remove_paused_holding_it, path, reached, go)
    assert reached.wait(WAIT)  # rm checked the cache and holds it
    os.rename(path, aside)
    if swap == "symlink":
        os.symlink(other, path)
        other_now = other
    else:
        os.rename(other, path)
        other_now = path
    go.set()
    r = child.result()
    # rm may finish on the directory it opened or refuse what it finds; either way the other cache is untouched
    assert r[0] == "ok" or r[1] in ("ValueError", "UnsafeArchiveError", "OSError", "FileNotFoundError", "NotADirectoryError"), r
    assert "nbkit.json" in os.listdir(other_now)
    assert_whole(other_now, Shifted(16), complete=True)
    if swap == "symlink":
        assert os.path.islink(path)
