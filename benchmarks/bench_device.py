"""Training epochs on the accelerator: does the device ever wait for data?

For each workload (``mnist``: 60,000 × 1×28×28 with ``ToTensor``+``Normalize`` and the classic
torch_xla MNIST net; ``jpeg``: 8,000 320-px JPEGs with ``Resize(256)``, ``CenterCrop(224)``,
``ToTensor``, ``Normalize`` and ResNet-18 in bf16 autocast, channels_last), batch 256, it times in
one run:

* raw torchvision through a ``DataLoader`` (``num_workers`` 0/4/8/16, as many as the machine has);
* nbkit through a ``DataLoader``: the line people type (default collate, ``pin_memory``) with
  ``num_workers`` 0/2/4/8 (and 8 with ``persistent_workers=True``), and ``collate_fn=nbkit.collate``;
* ``ds.loader(256, device=...)`` (:class:`nbkit.DeviceLoader`), and for JPEG the uint8 pattern
  (cache ``PILToTensor`` output, normalise on the device with ``batch_transform``);
* the **on-device limit**: the same training with the whole preprocessed dataset already in
  device memory, batches taken by index.

The on-device limit is what SPDL calls *headspace*: SPDL measures it with a loader that replays
batches it has already cached, nbkit with the dataset already in device memory; either way it is
the speed of the training loop when loading costs nothing, the most any loader can give.
"Data wait" is the share of the epoch the device spends beyond it: ``1 - limit / epoch``. Like
FFCV, LitData and SPDL, each row also gives samples per second with the machine's CPU count, and
the peak host memory (resident set of the benchmark process, and its largest DataLoader worker)
reached so far. Each row is the best of 2 epochs after one untimed epoch (raw JPEG: one
epoch). On a machine without a GPU the training step is simulated by a 5 ms sleep (it releases the
GIL, as a GPU step does), and the overlap target applies instead.

Usage::

    python benchmarks/bench_device.py            # full run; writes results/device-<cuda|cpu>.md
    python benchmarks/bench_device.py --quick    # smoke run (small data, fewer rows)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import workloads

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

import nbkit
from nbkit.gather import cpu_count

HERE = Path(__file__).resolve().parent
BATCH = 256
SIM_STEP_S = 0.005


# -- models -----------------------------------------------------------------------------------


class MNISTNet(nn.Module):
    """The network of torch_xla's test_train_mp_mnist.py."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.bn1 = nn.BatchNorm2d(10)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.bn2 = nn.BatchNorm2d(20)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = self.bn1(F.relu(F.max_pool2d(self.conv1(x), 2)))
        x = self.bn2(F.relu(F.max_pool2d(self.conv2(x), 2)))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


class Trainer:
    """One optimiser step per batch on ``device`` (or a simulated step on the CPU)."""

    def __init__(self, workload: str, device: torch.device):
        self.device = device
        self.simulated = device.type != "cuda"
        self.image = workload == "jpeg"
        if self.simulated:
            return
        if self.image:
            import torchvision

            self.model = torchvision.models.resnet18(num_classes=10).to(device, memory_format=torch.channels_last)
        else:
            self.model = MNISTNet().to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def step(self, x, y):
        if self.simulated:
            time.sleep(SIM_STEP_S)
            return
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        if self.image:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.image):
            loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# -- what is timed --------------------------------------------------------------------------------


def time_epoch(batches, trainer: Trainer, train: bool) -> tuple[float, int]:
    trainer.sync()
    t0 = time.perf_counter()
    n = 0
    last = None
    for x, y in batches:
        if train:
            trainer.step(x, y)
        last = x
        n += len(y)
    if last is not None and last.device.type == "cuda":
        last.view(-1)[:1].cpu()  # the last batch really arrived
    trainer.sync()
    return time.perf_counter() - t0, n


def peak_host_memory() -> int:
    """Peak resident bytes so far: this process, and the largest of its finished children (workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) * 1024


def measure(make, trainer, train, epochs, warm=1):
    """Best of ``epochs`` timed epochs after ``warm`` untimed ones; ``make()`` gives the iterable."""
    it = make()
    for _ in range(warm):
        time_epoch(it, trainer, train)
    times = []
    for _ in range(epochs):
        t, n = time_epoch(it, trainer, train)
        times.append(t)
    return {"best": min(times), "epochs": times, "samples": n}


class OnDevice:
    """The on-device limit: the whole preprocessed dataset in device memory, batches by index."""

    def __init__(self, ds, device):
        idx = np.arange(len(ds))
        cols = ds.read_columns(idx)
        self.x = torch.from_numpy(cols[0]).to(device)
        self.y = torch.from_numpy(cols[1]).to(device)
        self.device = device
        self.n = len(ds)

    def __iter__(self):
        perm = torch.randperm(self.n, device=self.device)
        for a in range(0, self.n, BATCH):
            b = perm[a:a + BATCH]
            yield self.x[b], self.y[b]


# -- workloads ------------------------------------------------------------------------------------


def build(name, args):
    spec = workloads.build(name, args.data_dir, quick=args.quick, n=args.jpeg_n if name == "jpeg" and not args.quick else None)
    src = workloads.source(spec)
    work = Path(args.work_dir) / f"{name}{'-quick' if args.quick else ''}-{spec.n}"
    ds = nbkit.CachedDataset(src, work / "float")
    t0 = time.perf_counter()
    ds.warmup(num_workers=min(16, cpu_count()))
    warm_s = time.perf_counter() - t0
    extra = None
    if name == "jpeg":
        from torchvision import datasets, transforms

        tf = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224), transforms.PILToTensor()])
        u8_src = datasets.ImageFolder(str(Path(spec.root) / "images"), transform=tf)
        extra = nbkit.CachedDataset(u8_src, work / "uint8")
        extra.warmup(num_workers=min(16, cpu_count()))
    return spec, src, ds, extra, warm_s


def normalise_on_device(mean, std):
    def fn(batch):
        x, y = batch
        m = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
        s = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
        return (x.float().div_(255).sub_(m).div_(s)), y

    return fn


def bench_workload(name, args, device, log):
    spec, src, ds, u8, warm_s = build(name, args)
    log(f"{name}: {spec.n} samples, cache warmed in {warm_s:.1f}s")
    trainer = Trainer(name, device)
    pin = device.type == "cuda"
    dev_arg = device if device.type == "cuda" else None
    cpus = cpu_count()
    raw_workers = [w for w in (0, 4, 8, 16) if w <= cpus or w == 4] if not args.quick else [0, 2]
    if name == "jpeg" and not args.quick:
        raw_workers = [w for w in raw_workers if w > 0]  # 0 workers: ~40 s an epoch, adds nothing
    nb_workers = [0, 2, 4, 8] if not args.quick else [0, 2]
    rows = []

    def add(key, label, make, train=True, epochs=None, warm=1, kind="nbkit"):
        e = epochs or args.epochs
        r = measure(make, trainer, train, e, warm)
        r.update(key=key, label=label, train=train, kind=kind, peak_rss=peak_host_memory())
        rows.append(r)
        log(f"  {label} [{'train' if train else 'data'}]: {r['best']:.3f}s (epochs {', '.join(f'{t:.3f}' for t in r['epochs'])})")
        return r

    limit = OnDevice(ds, device) if device.type == "cuda" else None
    for train in (True, False):
        tag = "train" if train else "data"
        if limit is not None:
            add(f"limit-{tag}", "on-device limit", lambda: limit, train, kind="limit")
        if train:
            for w in raw_workers:
                add(f"raw-w{w}", f"raw torchvision, `num_workers={w}`",
                    lambda w=w: DataLoader(src, BATCH, shuffle=True, num_workers=w, pin_memory=pin),
                    train, epochs=1 if name == "jpeg" else args.epochs, warm=0, kind="raw")
        add(f"nbkit-collate-w0-{tag}", "nbkit, `collate_fn=nbkit.collate`, `num_workers=0`",
            lambda: DataLoader(ds, BATCH, shuffle=True, collate_fn=nbkit.collate, pin_memory=pin), train)
        for w in nb_workers:
            add(f"nbkit-default-w{w}-{tag}", f"nbkit, default collate, `num_workers={w}`",
                lambda w=w: DataLoader(ds, BATCH, shuffle=True, num_workers=w, pin_memory=pin), train)
        w = nb_workers[-1]
        add(f"nbkit-default-w{w}-persistent-{tag}", f"nbkit, default collate, `num_workers={w}`, `persistent_workers=True`",
            lambda: DataLoader(ds, BATCH, shuffle=True, num_workers=w, pin_memory=pin, persistent_workers=True), train)
        add(f"deviceloader-{tag}", f"nbkit `ds.loader({BATCH}, device=…)`", lambda: ds.loader(BATCH, device=dev_arg), train,
            kind="deviceloader")
        if u8 is not None:
            norm = normalise_on_device((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
            add(f"deviceloader-u8-{tag}", "nbkit `ds.loader(…, batch_transform=normalise)`, uint8 cache",
                lambda: u8.loader(BATCH, device=dev_arg, batch_transform=norm), train, kind="deviceloader")
        if device.type != "cuda" and train:
            data_only = measure(lambda: ds.loader(BATCH), trainer, False, args.epochs)
            rows.append(dict(data_only, key="deviceloader-dataonly-ref", label="(data-only DeviceLoader)", train=False,
                             kind="ref"))
    return {"n": spec.n, "warm_s": warm_s, "rows": rows, "row_bytes": int(sum(ds.schema.row_bytes(leaf) for leaf in ds.schema.columns))}


# -- targets and report -------------------------------------------------------------------------------


def _get(rows, key):
    for r in rows:
        if r["key"] == key:
            return r["best"]
    return None


def targets(name, res, cuda: bool) -> list:
    rows = res["rows"]
    out = []

    def check(text, value, limit, why=""):
        if value is None:
            out.append((text, "not measured", "MISS", why or "no measurement"))
        else:
            out.append((text, f"{value:.2f}×", "PASS" if value <= limit else "MISS", f"target ≤ {limit:.2f}×"))

    def ratio(a, b):
        a, b = _get(rows, a), _get(rows, b)
        return None if a is None or b is None else a / b

    if cuda:
        lim = 1.10 if name == "jpeg" else 1.25
        check(f"{name}: DeviceLoader training epoch vs the on-device limit", ratio("deviceloader-train", "limit-train"), lim)
    else:
        sim = _get(rows, "deviceloader-train")
        steps = res["n"] / BATCH * SIM_STEP_S
        data = _get(rows, "deviceloader-dataonly-ref")
        if sim is not None and data is not None:
            check(f"{name}: DeviceLoader epoch with a {SIM_STEP_S * 1000:.0f} ms step vs max(steps, data-only)",
                  sim / max(steps, data), 1.15)
    for tag in (("train", "data") if cuda else ("data",)):
        check(f"{name}: default collate vs `nbkit.collate` ({'training' if tag == 'train' else 'data-only'}, workers 0)",
              ratio(f"nbkit-default-w0-{tag}", f"nbkit-collate-w0-{tag}"), 1.2)
        for w in (2, 4, 8):
            r = ratio(f"nbkit-default-w{w}-{tag}", f"nbkit-default-w0-{tag}")
            if r is not None:
                check(f"{name}: `num_workers={w}` vs `num_workers=0` ({'training' if tag == 'train' else 'data-only'})", r, 1.2)
    return out


def _s(t):
    return f"{t * 1000:.0f} ms" if t < 1 else f"{t:.2f} s"


def render(results, meta) -> str:
    cuda = meta["device"] == "cuda"
    lines = ["## Device: training epochs on the accelerator", ""]
    lines.append(f"Machine: {meta['machine']}. Batch {BATCH}, `shuffle=True`; best of {meta['epochs']} epochs after one "
                 "untimed epoch (raw JPEG: one epoch). The on-device limit is SPDL's *headspace* (the training loop fed "
                 "by batches already on the device: the most any loader can give); data wait = `1 - on-device limit / epoch`. "
                 + (f"Samples/s at {meta['cpus']} CPUs" if "cpus" in meta else "Samples/s at the CPU count named above")
                 + "; peak host memory: the benchmark process plus its largest DataLoader worker, highest so far in the "
                 "run (so it never falls down the table; not recorded by runs before issue 20). "
                 + ("" if cuda else f"No GPU here: the training step is a {SIM_STEP_S * 1000:.0f} ms sleep (it releases the GIL, as a "
                    "GPU step does), so 'training' shows overlap, not device speed. ")
                 + ("Quick mode: small data, a smoke test." if meta["quick"] else ""))
    lines.append("")
    for name, res in results.items():
        rows = res["rows"]
        limit = _get(rows, "limit-train")
        lines += [f"### {name}: {res['n']:,} samples, {res['row_bytes']:,} bytes a cached sample", "",
                  "| loader | training epoch | samples/s | × on-device limit | data wait | data-only epoch | data-only samples/s "
                  "| peak host memory |", "|---|---|---|---|---|---|---|---|"]
        labels = []
        for r in rows:
            if r["label"] not in labels and r["kind"] != "ref":
                labels.append(r["label"])
        for label in labels:
            tr = next((r for r in rows if r["label"] == label and r["train"]), None)
            do = next((r for r in rows if r["label"] == label and not r["train"]), None)
            t = tr["best"] if tr else None
            n = res["n"]
            peak = max((r.get("peak_rss", 0) for r in (tr, do) if r), default=0)
            cells = [label, _s(t) if t else "—", f"{n / t:,.0f}" if t else "—",
                     f"{t / limit:.2f}×" if t and limit else "—",
                     f"{max(0.0, 1 - limit / t):.0%}" if t and limit else "—",
                     _s(do["best"]) if do else "—", f"{n / do['best']:,.0f}" if do else "—",
                     f"{peak / 2**30:.2f} GiB" if peak else "—"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["### Targets", "", "| target | measured | result | |", "|---|---|---|---|"]
    for name, res in results.items():
        for text, shown, verdict, note in targets(name, res, cuda):
            lines.append(f"| {text} | {shown} | {verdict} | {note} |")
    lines.append("")
    return "\n".join(lines)


def machine() -> str:
    cpu = f"{cpu_count()} CPU cores"
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        return f"one {gpu}, {cpu}, torch {torch.__version__}, Python {platform.python_version()}"
    return f"no GPU, {cpu}, torch {torch.__version__}, Python {platform.python_version()}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small data and fewer rows: a smoke test")
    p.add_argument("--only", choices=workloads.WORKLOADS, action="append", help="run only this workload")
    p.add_argument("--data-dir", default=str(workloads.DEFAULT_DATA_DIR))
    p.add_argument("--work-dir", default=None, help="where caches go (default: <data-dir>/work-device)")
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--epochs", type=int, default=None, help="timed epochs per row (default 2, quick 1)")
    p.add_argument("--render-only", metavar="KIND", choices=("cuda", "cpu"),
                   help="rebuild results/device-KIND.md and its plot from device-KIND.json, measuring nothing")
    p.add_argument("--jpeg-n", type=int, default=None,
                   help="JPEG images in the full run (default: 8,000 on a GPU, the workload's 4,000 on the CPU)")
    args = p.parse_args(argv)
    if args.render_only:
        stem = Path(args.results) / f"device-{args.render_only}"
        data = json.loads(stem.with_suffix(".json").read_text())
        write(Path(args.results), f"device-{args.render_only}", data["meta"], data["results"])
        return 0
    args.work_dir = args.work_dir or str(Path(args.data_dir) / "work-device")
    args.epochs = args.epochs or (1 if args.quick else 2)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.jpeg_n is None and device.type == "cuda":
        args.jpeg_n = 8000
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    t0 = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", flush=True)

    results = {}
    for name in args.only or workloads.WORKLOADS:
        results[name] = bench_workload(name, args, device, log)
    meta = {"device": device.type, "machine": machine(), "epochs": args.epochs, "quick": args.quick, "cpus": cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(write(Path(args.results), f"device-{device.type}", meta, results))
    return 0


def plot(results, meta, path) -> bool:
    """The training epochs of each workload as :class:`nbkit.bench.TrainingComparison` bars
    (compute vs waiting for data); ``False`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    from nbkit.bench import TrainingComparison, TrainingRow

    picks = ("raw-w16", "raw-w8", "nbkit-default-w0-train", "nbkit-default-w2-train", "deviceloader-train",
             "deviceloader-u8-train", "limit-train")
    names = {"nbkit-default-w0-train": "nbkit, DataLoader", "nbkit-default-w2-train": "nbkit, DataLoader, 2 workers",
             "deviceloader-train": "nbkit, ds.loader", "deviceloader-u8-train": "nbkit, ds.loader, uint8 cache",
             "limit-train": TrainingComparison.LIMIT}
    figures = []
    for name, res in results.items():
        rows = {r["key"]: r for r in res["rows"]}
        chosen = [k for k in picks if k in rows]
        raw = [k for k in chosen if k.startswith("raw")][:1]
        chosen = raw + [k for k in chosen if not k.startswith("raw")]
        if "limit-train" not in chosen:
            return False
        comparison = TrainingComparison(
            [TrainingRow(names.get(k, "raw, " + rows[k]["label"].split(", ", 1)[-1].replace("`", "")), rows[k]["best"],
                         tuple(rows[k]["epochs"]), res["n"]) for k in chosen], device=meta["machine"].split(",")[0].replace("one ", ""),
            batch_size=BATCH)
        figures.append(comparison.plot(title=name))
    # One image, workloads stacked.
    from PIL import Image
    import io

    images = []
    for fig in figures:
        buf = io.BytesIO()
        fig.savefig(buf, dpi=100)
        plt.close(fig)
        images.append(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    out = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    y = 0
    for im in images:
        out.paste(im, (0, y))
        y += im.height
    out.save(path)
    return True


def write(out: Path, stem: str, meta, results) -> str:
    """Write ``<stem>.md``, ``<stem>.json`` and, for a GPU run, ``<stem>.png``; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    text = render(results, meta)
    if meta["device"] == "cuda" and not meta["quick"] and plot(results, meta, out / f"{stem}.png"):
        text += f"\n![Training epochs on the GPU: compute vs waiting for data]({stem}.png)\n"
    for fname, content in ((f"{stem}.md", text), (f"{stem}.json", json.dumps({"meta": meta, "results": results}, indent=1))):
        tmp = out / f".{fname}.tmp-{os.getpid()}"
        tmp.write_text(content + "\n")
        os.replace(tmp, out / fname)
    return text


if __name__ == "__main__":
    sys.exit(main())
