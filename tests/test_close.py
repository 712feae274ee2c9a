"""``CachedDataset.close()`` and ``with CachedDataset(...) as ds:``: what a closed dataset lets go of
(its files, maps and counters: ``nbkit.remove`` then works in the same process), what it says when
used, and copies of it (pickled into DataLoader workers) that outlive the close."""

import errno
import gc
import os
import pickle

import pytest
from torch.utils.data import DataLoader

import nbkit
from sources import TupleSource

N = 24
CLOSED = r"was closed \(ds\.close\(\), or the end of its with block\).*nbkit\.CachedDataset\.open\("


def samples(batch):
    """A collate_fn under which each worker reads its samples itself (no batch handle reaches the parent)."""
    return list(batch)


def _cache_fds(root) -> list:
    """This process's open descriptors on files of the cache at ``root``."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root) + os.sep):
            found.append(target)
    return found


def _cache_maps(root) -> list:
    with open("/proc/self/maps") as f:
        return [line for line in f if str(root) + os.sep in line]


def test_remove_works_after_close_in_the_same_process(tmp_path):
    path = tmp_path / "c"
    ds = nbkit.CachedDataset(TupleSource(N), path)
    ds.warmup()
    assert int(ds[3][1]) == 3
    with pytest.raises(OSError, match=r"a process has the cache open.*ds\.close\(\)") as busy:
        nbkit.remove(path)
    assert busy.value.errno == errno.EBUSY
    ds.close()
    removed = nbkit.remove(path)
    assert removed.bytes > 0 and not path.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux) to list open files and maps")
def test_close_lets_go_of_files_maps_and_counters(tmp_path):
    path = tmp_path / "c"
    ds = nbkit.CachedDataset(TupleSource(N), path)
    ds.warmup()
    _ = ds.__getitems__(list(range(8)))
    counters = ds._counters.path
    assert _cache_fds(path) and _cache_maps(path) and os.path.exists(counters)
    ds.close()
    gc.collect()
    assert _cache_fds(path) == [] and _cache_maps(path) == []
    assert not os.path.exists(counters)


def test_close_twice_and_the_with_block(tmp_path):
    with nbkit.CachedDataset(TupleSource(N), tmp_path / "c") as ds:
        assert ds.warmup().computed == N and not ds.closed
    assert ds.closed and "closed" in repr(ds)
    ds.close()  # again: nothing more to do
    assert ds.closed and len(ds) == N and ds.path == str(tmp_path / "c")
    nbkit.remove(tmp_path / "c")


def test_a_closed_dataset_says_so_and_how_to_open_it_again(tmp_path):
    path = tmp_path / "c"
    ds = nbkit.CachedDataset(TupleSource(N), path)
    ds.warmup()
    ds.close()
    uses = {
        "ds[i]": lambda: ds[0],
        "ds[a:b]": lambda: ds[0:2],
        "__getitems__": lambda: ds.__getitems__([0, 1]),
        "read_columns": lambda: ds.read_columns([0, 1]),
        "stats": lambda: ds.stats,
        "reset_stats": ds.reset_stats,
        "missing": ds.missing,
        "is_complete": lambda: ds.is_complete,
        "warmup": ds.warmup,
        "verify": ds.verify,
        "sync": ds.sync,
        "prefetch": lambda: ds.prefetch([0]),
        "loader": lambda: list(ds.loader(4)),
        "DataLoader": lambda: list(DataLoader(ds, batch_size=4)),
    }
    for name, use in uses.items():
        with pytest.raises(ValueError, match=CLOSED):
            use()
    assert pickle.loads(pickle.dumps(ds)).closed  # a copy of a closed dataset is closed too
    nbkit.remove(path)
    with pytest.raises(ValueError, match=CLOSED):  # not "stale": the dataset was closed first
        ds[0]
    again = nbkit.CachedDataset(TupleSource(N), path)
    assert int(again[5][1]) == 5


def test_a_copy_made_before_the_close_keeps_working(tmp_path):
    path = tmp_path / "c"
    ds = nbkit.CachedDataset(TupleSource(N), path)
    ds.warmup()
    copy = pickle.loads(pickle.dumps(ds))
    assert int(copy[1][1]) == 1
    ds.close()
    assert int(copy[2][1]) == 2 and not copy.closed and copy.stats.hits == 2
    with pytest.raises(OSError, match="a process has the cache open"):
        nbkit.remove(path)  # the copy still holds it
    copy.close()
    nbkit.remove(path)


def test_live_workers_outlive_a_close_in_the_parent(tmp_path):
    path = tmp_path / "c"
    ds = nbkit.CachedDataset(TupleSource(N), path)
    ds.warmup()
    loader = DataLoader(ds, batch_size=6, num_workers=2, persistent_workers=True, collate_fn=samples)
    labels = sorted(i % 10 for i in range(N))
    assert sorted(int(s[1]) for b in loader for s in b) == labels
    ds.close()
    # The workers read with their own copies, which the close in the parent leaves open.
    assert sorted(int(s[1]) for b in loader for s in b) == labels
    with pytest.raises(OSError, match="a process has the cache open"):
        nbkit.remove(path)  # the workers still have it open
    del loader
    gc.collect()  # ends the workers
    nbkit.remove(path)


def test_a_batch_handle_sent_to_a_closed_dataset_says_it_was_closed(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(N), tmp_path / "c")
    ds.warmup()
    loader = DataLoader(ds, batch_size=6, num_workers=1, persistent_workers=True)  # the parent gathers each batch
    assert sum(len(y) for x, y in loader) == N
    ds.close()
    with pytest.raises(ValueError, match=CLOSED):
        list(loader)
    del loader
    gc.collect()
