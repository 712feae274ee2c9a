"""The harness tested on toy operations whose crash behaviour is known (``crash.toys``): it must find
what is wrong with each and nothing in what is right, in every mode."""

import pytest

from crash.harness import MODES
from crash.toys import TOYS

pytestmark = [pytest.mark.crash]

#: (toy, mode) -> the invariants violated (at any point); pairs not listed violate none.
EXPECTED = {
    ("toy_no_sync", "power-meta"): {"1"},  # renamed before its data was synced: an empty file after a power cut
    ("toy_in_place", "kill"): {"1"},  # truncated, then written: a kill leaves it empty or half written
    ("toy_unlink_then_write", "kill"): {"1"},
    ("toy_unlink_then_write", "power-meta"): {"1"},
}


@pytest.mark.parametrize("toy", sorted(TOYS))
def test_harness_finds_what_each_toy_gets_wrong(crash_harness, toy):
    for mode in MODES:
        result = crash_harness.run(TOYS[toy], mode, cap=None)
        assert not result.errors, result.summary()
        assert set(result.by_invariant()) == EXPECTED.get((toy, mode), set()), result.summary()
