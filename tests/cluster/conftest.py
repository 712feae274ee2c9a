"""Fixtures the part, placed-part and merge tests share."""

import pytest

import nbkit

from buildsources import PART_N, Named


@pytest.fixture
def cache(tmp_path):
    """A cache of ``Named(PART_N)`` samples, none stored yet (tests/cluster/test_part.py, test_placed.py,
    test_merge.py; a module may define its own ``cache``)."""
    ds = nbkit.CachedDataset(Named(PART_N), str(tmp_path / "cache"))
    yield ds
    ds.close()
