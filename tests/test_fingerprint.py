"""nbkit.fingerprint: what identifies a source (type, length, transforms, probe samples), what it
ignores, that it is the same in another process, and the non-determinism check."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import Dataset

import nbkit
from nbkit.dataset import Opened
from nbkit.fingerprint import differences, fingerprint, probe_indices
from sources import DictSource, RandomSource, TupleSource

HERE = os.path.dirname(os.path.abspath(__file__))


def scale(x):
    return x * 2


class Renamed(TupleSource):
    """The same samples under another type."""


class Edited(TupleSource):
    """``TupleSource`` with sample ``at`` changed."""

    def __init__(self, n, at):
        super().__init__(n)
        self.at = at

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return (x + 1, y) if i == self.at else (x, y)


def test_stale_cache_says_what_differs(tmp_path):
    nbkit.CachedDataset(TupleSource(10), tmp_path).warmup()
    with pytest.raises(nbkit.StaleCacheError, match=r"length: cached 10, source 12.*overwrite=True"):
        nbkit.CachedDataset(TupleSource(12), tmp_path)
    with pytest.raises(nbkit.StaleCacheError, match="dataset type"):
        nbkit.CachedDataset(DictSource(10), tmp_path)
    with pytest.raises(nbkit.StaleCacheError, match="transform"):
        nbkit.CachedDataset(TupleSource(10, transform=lambda x: x), tmp_path)
    with pytest.raises(nbkit.StaleCacheError, match=r"content of sample"):
        nbkit.CachedDataset(TupleSource(10, shape=(1, 8, 9)), tmp_path)
    # The old cache is untouched; overwrite=True replaces it.
    assert nbkit.CachedDataset.open(tmp_path).is_complete
    ds = nbkit.CachedDataset(TupleSource(12), tmp_path, overwrite=True)
    assert len(ds) == 12 and ds.stats.cached == 0
    assert ds.opened is Opened.REPLACED and "length: cached 10, source 12" in ds.replaced_reason


def test_transform_repr_without_addresses_is_stable(tmp_path):
    def make():
        def t(x):
            return x
        return TupleSource(10, transform=t)

    nbkit.CachedDataset(make(), tmp_path)
    nbkit.CachedDataset(make(), tmp_path)  # a new function object, same definition: not stale


def test_nondeterministic_source_points_to_transform(tmp_path):
    with pytest.raises(nbkit.NondeterministicSourceError, match="transform="):
        nbkit.CachedDataset(RandomSource(), tmp_path)
    assert not (tmp_path / "nbkit.json").exists()


# -- the same in another process -------------------------------------------------------------------

CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from nbkit.fingerprint import fingerprint
from sources import TupleSource
from test_fingerprint import scale
print(json.dumps(fingerprint(TupleSource(50, transform=scale), n_probes=4)[0], sort_keys=True))
"""


def test_another_process_computes_the_same_fingerprint():
    """A cache made in one session is recognised in the next: nothing per-process (memory addresses,
    hash seeds, object ids) goes into the fingerprint."""
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", CHILD, HERE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    here, _ = fingerprint(TupleSource(50, transform=scale), n_probes=4)
    assert json.loads(out.stdout) == json.loads(json.dumps(here, sort_keys=True))
    assert "0x" not in here["transform"] and "scale" in here["transform"]


# -- what it depends on ----------------------------------------------------------------------------


def test_it_holds_the_type_length_transforms_and_probe_hashes():
    fp, probes = fingerprint(TupleSource(10), n_probes=3)
    assert fp["type"] == "sources.TupleSource" and fp["length"] == 10
    assert fp["transform"] == "transform=None"
    assert sorted(fp["samples"], key=int) == ["0", "5", "9"] and sorted(probes) == [0, 5, 9]
    assert all(len(h) == 32 for h in fp["samples"].values())
    torch.testing.assert_close(probes[5][0], TupleSource(10)[5][0])  # the probes read, for reuse


@pytest.mark.parametrize("source, other, what", [
    (TupleSource(10), TupleSource(11), "length: cached 10, source 11"),
    (TupleSource(10), Renamed(10), "dataset type: cached sources.TupleSource, source "),
    (TupleSource(10), TupleSource(10, transform=scale), "transform: cached 'transform=None'"),
    (Edited(10, at=None), Edited(10, at=5), "content of sample(s) 5 differs"),
    (Edited(10, at=None), Edited(10, at=9), "content of sample(s) 9 differs"),
], ids=["length", "type", "transform", "middle probe", "last probe"])
def test_each_thing_it_depends_on_changes_it(source, other, what):
    base, _ = fingerprint(source, n_probes=3)
    changed, _ = fingerprint(other, n_probes=3)
    assert changed != base
    said = differences(base, changed)
    assert len(said) == 1 and said[0].startswith(what), said


def test_more_probes_look_at_more_samples():
    assert probe_indices(10, 3) == [0, 5, 9]
    assert probe_indices(100, 5) == [0, 20, 40, 50, 99]
    assert probe_indices(2, 3) == [0, 1] and probe_indices(1, 3) == [0]
    assert probe_indices(0, 3) == [] and probe_indices(10, 0) == []
    base, _ = fingerprint(Edited(100, at=None), n_probes=5)
    assert differences(base, fingerprint(Edited(100, at=20), n_probes=5)[0]) == ["content of sample(s) 20 differs"]


# -- what it ignores -------------------------------------------------------------------------------


def test_samples_between_the_probes_are_not_read():
    base, _ = fingerprint(Edited(10, at=None), n_probes=3)
    assert fingerprint(Edited(10, at=3), n_probes=3)[0] == base
    assert differences(base, base) == []


def test_memory_addresses_and_object_identity_are_ignored():
    class Holder:
        pass

    def make():
        def t(x):
            return x
        return TupleSource(10, transform=t)

    a, b = make(), make()
    assert repr(a.transform) != repr(b.transform)  # different addresses…
    assert fingerprint(a)[0] == fingerprint(b)[0]  # …the same fingerprint
    assert "0x" not in fingerprint(TupleSource(10, transform=Holder()))[0]["transform"]


def test_torchvisions_standard_transform_is_not_described_twice():
    class Vision(TupleSource):
        def __init__(self, n):
            super().__init__(n, transform=scale)
            self.target_transform = None
            self.transforms = type("StandardTransform", (), {"__repr__": lambda self: "wrapped"})()

    fp, _ = fingerprint(Vision(4))
    assert fp["transform"].startswith("transform=<function scale") and "wrapped" not in fp["transform"]
    assert fp["transform"].endswith("target_transform=None")


def test_no_probes_means_no_content_and_no_determinism_check():
    fp, probes = fingerprint(RandomSource(), n_probes=0)
    assert fp["samples"] == {} and probes == {}


def test_a_source_that_answers_twice_differently_is_refused():
    class Flaky(Dataset):
        def __init__(self):
            self.reads = 0

        def __len__(self):
            return 4

        def __getitem__(self, i):
            self.reads += 1
            return torch.tensor([float(self.reads)])

    with pytest.raises(nbkit.NondeterministicSourceError, match="fingerprint_samples=0"):
        fingerprint(Flaky())
