"""Sources the widget tests share: one caught mid-warmup, one that fails, and a filled cache."""

import threading

import nbkit
from sources import TupleSource


class GatedSource(TupleSource):
    """Blocks at index ``at`` once armed, until the test releases it: a warmup caught mid-run."""

    def __init__(self, n):
        super().__init__(n)
        self.at = None
        self.reached = threading.Event()
        self.release = threading.Event()

    def __getitem__(self, i):
        if self.at is not None and i == self.at:
            self.reached.set()
            self.release.wait(timeout=60)
        return super().__getitem__(i)


class FailingSource(TupleSource):
    """Raises at index ``bad`` once armed (after the cache was created)."""

    def __init__(self, n, bad):
        super().__init__(n)
        self.bad = bad
        self.armed = False

    def __getitem__(self, i):
        if self.armed and i == self.bad:
            raise OSError(f"source image {i} is unreadable")
        return super().__getitem__(i)


def filled(tmp_path, n=300, name="cache"):
    ds = nbkit.CachedDataset(TupleSource(n), str(tmp_path / name))
    ds.warmup()
    return ds

