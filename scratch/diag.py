import sys, time, os
sys.path.insert(0, "benchmarks")
import workloads, torch, nbkit, numpy as np
from torch.utils.data import DataLoader
from nbkit.gather import cpu_count
dev = torch.device("cuda")
for name in ("mnist", "jpeg"):
    spec = workloads.build(name, "bench-data", n=8000 if name == "jpeg" else None)
    src = workloads.source(spec)
    ds = nbkit.CachedDataset(src, f"bench-data/work-diag/{name}")
    ds.warmup(num_workers=16)
    for label, kw in [("w0 pin", dict(pin_memory=True)), ("w0", {}), ("w2 pin", dict(num_workers=2, pin_memory=True)), ("w2", dict(num_workers=2)),
                      ("w2 pin persistent", dict(num_workers=2, pin_memory=True, persistent_workers=True)),
                      ("w8 pin", dict(num_workers=8, pin_memory=True)), ("w8 pin persistent", dict(num_workers=8, pin_memory=True, persistent_workers=True))]:
        dl = DataLoader(ds, 256, shuffle=True, **kw)
        for e in range(3):
            t0 = time.perf_counter(); ts = []
            for x, y in dl:
                ts.append(time.perf_counter())
            tot = ts[-1] - t0
        gaps = np.diff(ts)
        print(f"{name} {label:20s} epoch {tot:.3f} first {ts[0]-t0:.3f} median gap {np.median(gaps)*1e3:.2f} ms max gap {gaps.max()*1e3:.1f} ms", flush=True)
    for chunk in (None,):
        lo = ds.loader(256, device="cuda")
        for e in range(3):
            t0 = time.perf_counter()
            for x, y in lo: pass
            torch.cuda.synchronize(); tot = time.perf_counter() - t0
        print(f"{name} DeviceLoader chunk={lo.chunk} threads={lo.threads} data-only {tot:.3f} wait {lo.wait_seconds:.3f}", flush=True)
    # fork cost
    import multiprocessing as mp
    t0 = time.perf_counter(); ps = [mp.get_context("fork").Process(target=time.sleep, args=(0,)) for _ in range(8)]
    for p in ps: p.start()
    for p in ps: p.join()
    print(f"{name} fork+join 8 processes {time.perf_counter()-t0:.3f}s", flush=True)
