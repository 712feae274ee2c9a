"""A training loop over a partial cache opened without its source (warm up, stop, export_tar,
import_tar, CachedDataset.open), the way notebook 02 reaches it after Warm up -> Stop -> Export.
argv: workdir, path ("xla", "tpu", "cpu", "host", "dataloader"). Prints one JSON line: the
exception type and message that reached the loop, and the batches it trained on first.
Run by tests/tpu/test_run.py in a subprocess with a timeout: a hang fails the test."""

import json
import sys

import torch

import nbkit
from nbkit.progress import Callback
from nbkit.widgets import HitRateMeter
from sources import TupleSource

work, path = sys.argv[1], sys.argv[2]


class StopAfterFirstChunk(Callback):
    def call(self, *args, **kwargs):
        if self.value > 0:
            self.request_stop()


src = TupleSource(600)
report = nbkit.CachedDataset(src, work + "/c").warmup(callback=StopAfterFirstChunk(), chunk_size=128)
assert report.stopped, report
nbkit.export_tar(work + "/c", work + "/c.tar")
nbkit.import_tar(work + "/c.tar", work + "/imported")
cached = nbkit.CachedDataset.open(work + "/imported")
assert 0 < cached.stats.cached < len(cached), cached.stats

if path == "xla":
    import torch_xla

    loader = cached.loader(32, device=torch_xla.device(), drop_last=True)
elif path == "tpu":
    loader = nbkit.tpu.device_loader(cached, batch_size=32)
elif path == "cpu":
    loader = cached.loader(32, device="cpu", drop_last=True)
elif path == "host":
    loader = cached.loader(32, drop_last=True)
else:
    loader = torch.utils.data.DataLoader(cached, batch_size=32, shuffle=True, num_workers=2, drop_last=True,
                                         collate_fn=nbkit.collate)

meter = HitRateMeter(cached, file=sys.stdout)
trained = 0
try:
    for images, labels in meter.track(loader, steps=1000):  # notebook 02's training cell
        trained += 1
except Exception as e:  # noqa: BLE001 - reported to the test, which checks the type
    print(json.dumps({"error": type(e).__name__, "message": str(e), "trained": trained,
                      "cached": cached.stats.cached}))
else:
    print(json.dumps({"error": None, "trained": trained}))
