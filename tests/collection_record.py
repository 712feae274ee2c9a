"""The stash key under which tests/conftest.py records every collected item's file (tests/test_collection.py)."""

import pytest

COLLECTED = pytest.StashKey[set]()
