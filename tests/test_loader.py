"""nbkit.DeviceLoader and ds.loader(): correctness on the CPU (every sample once per epoch and
equal to the source, deterministic shuffles, shards, early break, partial caches, budgets,
transforms, errors). Speed lives in benchmarks/bench_device.py."""

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from sources import BareTensorSource, CollatableDictSource, DtypeSource, NamedSource, PilSource, TupleSource, assert_equal
from torch.utils.data import default_collate

import nbkit
from nbkit.errors import MissingSampleError

HERE = os.path.dirname(__file__)


def _loader_threads():
    return [t for t in threading.enumerate() if t.name == "nbkit-device-loader" and t.is_alive()]


def _check_epoch(ds, src, loader):
    """Iterate one epoch; check every row equals its source sample; return the indices seen."""
    order = loader.batches(loader.epoch)
    seen = []
    for idx, batch in zip(order, loader):
        want = default_collate([src[int(i)] for i in idx])
        assert_equal(batch, want, f"batch of {idx.tolist()[:4]}…")
        seen.extend(idx.tolist())
    return seen


@pytest.mark.parametrize("make", [TupleSource, CollatableDictSource, BareTensorSource], ids=lambda c: c.__name__)
def test_every_sample_once_per_epoch_and_equal_to_the_source(tmp_path, make):
    src = make()
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    loader = ds.loader(8)
    assert len(loader) == -(-len(src) // 8)
    for _ in range(2):
        seen = _check_epoch(ds, src, loader)
        assert sorted(seen) == list(range(len(src)))


def test_a_partial_cache_is_filled_by_the_epoch(tmp_path):
    src = TupleSource(60)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.__getitems__(list(range(0, 60, 3)))  # a third stored
    ds.reset_stats()
    seen = _check_epoch(ds, src, ds.loader(7, seed=2))
    assert sorted(seen) == list(range(60))
    assert ds.is_complete
    assert ds.stats.misses == 40 and ds.stats.hits == 20


def test_shuffles_are_deterministic_and_change_per_epoch(tmp_path):
    src = TupleSource(40)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    a, b = ds.loader(10, seed=5), nbkit.DeviceLoader(ds, 10, seed=5)
    first_a = [x for x, _ in a]
    first_b = [x for x, _ in b]
    assert all(torch.equal(p, q) for p, q in zip(first_a, first_b))
    second_a = [x for x, _ in a]  # iterating again moves to the next epoch
    assert not all(torch.equal(p, q) for p, q in zip(first_a, second_a))
    a.set_epoch(0)
    again = [x for x, _ in a]
    assert all(torch.equal(p, q) for p, q in zip(first_a, again))
    assert a.epoch == 1
    assert [x.tolist() for x in a.batches(0)] == [x.tolist() for x in b.batches(0)]
    plain = ds.loader(10, shuffle=False)
    assert np.concatenate(plain.batches(4)).tolist() == list(range(40))


@pytest.mark.parametrize("drop_last", [False, True])
def test_shards_split_every_epoch_like_distributed_sampler(tmp_path, drop_last):
    src = TupleSource(50)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    world = 3
    loaders = [ds.loader(4, rank=r, world_size=world, drop_last=drop_last, seed=1) for r in range(world)]
    assert len({len(lo) for lo in loaders}) == 1
    for epoch in range(2):
        per_rank = [np.concatenate(lo.batches(epoch)).tolist() for lo in loaders]
        everything = sum(per_rank, [])
        if drop_last:
            assert len(set(everything)) == len(everything) == (50 // world) // 4 * 4 * world
        else:
            assert set(everything) == set(range(50))  # padded by repeating, as DistributedSampler
        for lo, want in zip(loaders, per_rank):
            got = []
            for x, y in lo:
                got.extend(y.tolist())
            assert got == [i % 10 for i in want]


def test_break_leaves_no_thread_and_no_buffer(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(200), tmp_path / "c")
    ds.warmup()
    loader = ds.loader(4, prefetch=2)
    for k, batch in enumerate(loader):
        if k == 3:
            break
    del batch
    gc.collect()
    deadline = time.monotonic() + 5
    while _loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _loader_threads()
    it = iter(loader)
    next(it)
    it.close()
    assert not _loader_threads()


def test_budget_and_transform_and_variable_fields(tmp_path):
    src = TupleSource(64)
    budget = nbkit.CachedDataset(src, tmp_path / "b", max_bytes=64 * 24 + 20 * (8 * 8 * 4 + 8))
    assert 0 < budget.stats.capacity < 64
    for _ in range(2):
        assert sorted(_check_epoch(budget, src, budget.loader(8))) == list(range(64))

    flip = nbkit.CachedDataset(src, tmp_path / "t", transform=lambda s: (s[0].flip(-1), s[1]))
    for idx, (x, y) in zip(flip.loader(8).batches(0), flip.loader(8)):
        assert torch.equal(x, torch.stack([src[int(i)][0].flip(-1) for i in idx]))

    var = CollatableDictSource(30)
    ds = nbkit.CachedDataset(var, tmp_path / "v")
    ds.warmup()
    assert sorted(_check_epoch(ds, var, ds.loader(4))) == list(range(30))


def test_batch_transform_runs_on_the_device_batch(tmp_path):
    class Uint8Images(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            return torch.full((1, 4, 4), i, dtype=torch.uint8), i

    ds = nbkit.CachedDataset(Uint8Images(), tmp_path / "c")
    ds.warmup()
    def norm(b):
        return (b[0].float() / 255 - 0.5) / 0.5, b[1]

    for x, y in ds.loader(8, batch_transform=norm):
        assert x.dtype == torch.float32
        assert torch.allclose(x[:, 0, 0, 0], (y.float() / 255 - 0.5) / 0.5)


def test_any_map_style_dataset_works(tmp_path):
    src = TupleSource(20)
    seen = []
    loader = nbkit.DeviceLoader(src, 6, shuffle=False)
    for x, y in loader:
        seen.extend(y.tolist())
    assert seen == [i % 10 for i in range(20)]


def test_missing_sample_without_source_raises_from_the_iteration(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(40), tmp_path / "c")
    ds.__getitems__(list(range(20)))
    opened = nbkit.CachedDataset.open(tmp_path / "c")
    loader = opened.loader(8, shuffle=False)
    got = []
    with pytest.raises(MissingSampleError, match=r"sample 2\d is not in the cache"):
        for x, y in loader:
            got.append(len(y))
    assert got == [8, 8]  # the two full batches before the first missing sample
    assert not _loader_threads()


def test_bad_arguments_are_clear(tmp_path):
    ds = nbkit.CachedDataset(TupleSource(10), tmp_path / "c")
    with pytest.raises(ValueError, match="not a device"):
        ds.loader(4, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            ds.loader(4, device="cuda")
    with pytest.raises(TypeError, match="does not take num_workers=.*threads="):
        ds.loader(4, num_workers=8)
    with pytest.raises(TypeError, match="does not take sampler="):
        ds.loader(4, sampler=None)
    with pytest.raises(TypeError, match="unexpected keyword argument 'colour'"):
        ds.loader(4, colour=1)
    with pytest.raises(ValueError, match=r"batch_size must be an int in \[1, 2\*\*40\], got 0"):
        ds.loader(0)
    with pytest.raises(ValueError, match="rank must be"):
        ds.loader(4, rank=3, world_size=2)
    with pytest.raises(ValueError, match="prefetch"):
        ds.loader(4, prefetch=0)
    # Issue 25: bounded where they are checked, each naming the range and what to pass instead.
    for kwargs, text in (({"batch_size": 2**63}, r"batch_size must be an int in \[1, 2\*\*40\], got 9223372036854775808: a batch"),
                         ({"batch_size": 4, "prefetch": 10**9}, r"prefetch \(batches kept ready\) must be an int in \[1, 1024\]"),
                         ({"batch_size": 4, "threads": 10**6}, r"threads \(None: automatic\) must be an int in \[1, 256\]"),
                         ({"batch_size": 4, "rank": 0, "world_size": 2**63}, r"world_size must be an int in \[1, 2\*\*20\]"),
                         ({"batch_size": 2**10000}, r"batch_size must be an int in \[1, 2\*\*40\], got an int of 10001 bits")):
        with pytest.raises(ValueError, match=text):
            ds.loader(**kwargs)


def test_gathers_large_rows_with_several_threads(tmp_path):
    src = TupleSource(24, shape=(3, 64, 64))
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    loader = ds.loader(24, threads=4, shuffle=False)
    (x, y), = list(loader)
    assert torch.equal(x, torch.stack([src[i][0] for i in range(24)]))
    assert nbkit.DeviceLoader(ds, 256).threads >= 1


def test_xla_device_in_a_subprocess(tmp_path):
    """Real torch_xla on the CPU: batches arrive on xla:0 and a tiny model trains on them."""
    pytest.importorskip("torch_xla")
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    out = subprocess.run([sys.executable, os.path.join(HERE, "tpu_scripts", "device_loader_xla.py"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok xla" in out.stdout


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU with CUDA (torch.cuda.is_available() is False here)")


@cuda
@pytest.mark.parametrize("make", [TupleSource, CollatableDictSource], ids=lambda c: c.__name__)
def test_cuda_batches_equal_the_source_and_overlap_safely(tmp_path, make):
    src = make(200) if make is TupleSource else make(40)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    loader = ds.loader(16, device="cuda", prefetch=2)
    for epoch in range(2):
        order = loader.batches(loader.epoch)
        for idx, batch in zip(order, loader):
            for t in (batch.values() if isinstance(batch, dict) else batch):
                if isinstance(t, torch.Tensor):
                    assert t.is_cuda
            # work on the caller's stream right away: the side-stream copy must be complete
            host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()} if isinstance(batch, dict) \
                else [v.cpu() for v in batch]
            want = default_collate([src[int(i)] for i in idx])
            if isinstance(batch, dict):
                for k in ("x", "arr", "label", "half"):
                    assert torch.equal(host[k], want[k] if isinstance(want[k], torch.Tensor) else torch.as_tensor(want[k]))
            else:
                assert torch.equal(host[0], want[0]) and torch.equal(host[1], want[1])


@cuda
def test_cuda_break_frees_and_misses_are_filled(tmp_path):
    src = TupleSource(300, shape=(3, 32, 32))
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    x_all = torch.stack([src[i][0] for i in range(300)]).cuda()
    loader = ds.loader(32, device="cuda", shuffle=False, threads=4)
    for k, (x, y) in enumerate(loader):  # cold: misses computed in the loader thread
        assert torch.equal(x, x_all[32 * k:32 * k + len(x)])
    assert ds.is_complete
    it = iter(loader)
    for k, (x, y) in enumerate(it):
        assert torch.equal(x, x_all[32 * k:32 * k + len(x)])
        if k == 2:
            break
    buffers = [weakref.ref(t) for slot in it._pipeline.slots for t in slot["tensors"]]
    assert buffers
    del it
    gc.collect()
    assert all(ref() is None for ref in buffers)  # the pinned buffers are released
    deadline = time.monotonic() + 5
    while _loader_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _loader_threads()


@cuda
def test_large_batches_are_gathered_into_pinned_memory_for_cuda(tmp_path):
    src = TupleSource(64, shape=(3, 64, 64))
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    ds.warmup()
    torch.cuda.init()
    x, y = nbkit.collate(ds.__getitems__(list(range(64))))
    assert x.is_pinned()
    assert x.pin_memory() is x or x.pin_memory().data_ptr() == x.data_ptr()  # pin_memory=True copies nothing
    loader = torch.utils.data.DataLoader(ds, batch_size=32, num_workers=2, pin_memory=True)
    got = torch.cat([x for x, _ in loader])
    assert torch.equal(got, torch.stack([src[i][0] for i in range(64)]))


def test_read_through_cache(tmp_path, monkeypatch):
    """A bucket cache read through a bounded local area (memory:// stands in for gs://)."""
    monkeypatch.setenv("NBKIT_CACHE_DIR", str(tmp_path / "areas"))
    src = TupleSource(300)
    local = nbkit.CachedDataset(src, tmp_path / "local")
    local.warmup()
    url = f"memory://nbkit-loader/{tmp_path.name}"
    nbkit.push(local.root, url)
    remote = nbkit.CachedDataset.open(url, local_max_bytes=64 << 10)
    seen = _check_epoch(remote, src, remote.loader(32, seed=3))
    assert sorted(seen) == list(range(300))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_pil_images_float8_and_namedtuples_through_the_loader(tmp_path, device):
    pytest.importorskip("PIL.Image")
    from torchvision.transforms import PILToTensor

    for src in (PilSource(40, "L"), PilSource(40, "RGB"), DtypeSource(torch.float8_e4m3fn, n=40), NamedSource(40)):
        ds = nbkit.CachedDataset(src, tmp_path / f"{type(src).__name__}-{getattr(src, 'mode', '')}")
        ds.warmup()
        for batch in ds.loader(8, device=device, shuffle=False):
            pass
        loader = ds.loader(8, device=device, shuffle=False)
        for k, batch in enumerate(loader):
            want = [src[i] for i in range(8 * k, 8 * k + 8)]
            if isinstance(src, PilSource):
                want = [(PILToTensor()(img), y) for img, y in want]
            want = default_collate(want)
            assert type(batch) is type(want) and batch[0].device.type == device
            got = batch[0].cpu()
            assert got.dtype == want[0].dtype and got.shape == want[0].shape
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                               want[0].view(torch.uint8) if want[0].dtype == torch.float8_e4m3fn else want[0])


def test_each_pass_counts_what_it_handed_out_apart_from_its_read_ahead(tmp_path):
    src = TupleSource(60)
    ds = nbkit.CachedDataset(src, tmp_path / "c")
    stored = set(range(0, 60, 3))
    ds.__getitems__(sorted(stored))  # a third stored: batches mix hits and misses
    loader = ds.loader(7, seed=2, prefetch=4)
    order = loader.batches(loader.epoch)
    it = iter(loader)
    for _ in range(3):
        next(it)
    deadline = time.monotonic() + 60
    while ds.stats.reads <= 60 // 3 + 21:  # the thread has read batches ahead of the caller
        assert time.monotonic() < deadline
        time.sleep(0.01)
    got = np.concatenate(order[:3])
    hits = sum(int(i) in stored for i in got)
    c = it.consumed
    assert (c.batches, c.samples, c.hits, c.misses) == (3, 21, hits, 21 - hits)
    it.close()
    whole = iter(loader)
    for _ in whole:
        pass
    assert (whole.consumed.batches, whole.consumed.samples) == (9, 60)
    assert whole.consumed.hits + whole.consumed.misses == 60


def test_a_dataset_without_a_cache_reports_samples_but_no_hits(tmp_path):
    it = iter(nbkit.DeviceLoader(TupleSource(10), 4))
    assert sum(len(y) for _, y in it) == 10
    assert (it.consumed.samples, it.consumed.hits, it.consumed.misses) == (10, None, None)


def test_ragged_fields_name_the_fix(tmp_path):
    """Samples whose fields differ in shape cannot be stacked: the error says so and names the fix,
    not torch's bare "stack expects each tensor to be equal size"."""
    class Ragged(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.arange(i + 1), i

    ds = nbkit.CachedDataset(Ragged(), str(tmp_path / "c"))
    ds.warmup()
    with pytest.raises(RuntimeError, match="different shapes.*collate_fn"):
        for _ in ds.loader(4, shuffle=False):
            pass
