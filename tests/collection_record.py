"""The stash key under which tests/conftest.py records every collected item's file (tests/test_collection.py)."""

import pytest

COLLECTED = pytest.StashKey[set]()
#: Test files skipped whole at collection (a module-level ``pytest.importorskip`` of a package this
#: environment lacks), by their path from the repository root: collected, with nothing to run.
SKIPPED_FILES: set = set()
