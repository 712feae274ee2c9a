"""Every operation of ``crash.operations.OPERATIONS`` killed before each of its file-system calls
(and, where it matters, at a simulated power cut), then checked on reopen (``docs/CRASH.md``).

CI runs a fixed budget of crash points per operation (``crash.harness.CI_POINTS``);
``NBKIT_CRASH=all`` (``make crash``) runs every one.
"""

import pytest

from crash.harness import RESULTS
from crash.harness import all_cases, budget
from crash.operations import OPERATIONS

pytestmark = [pytest.mark.crash, pytest.mark.one_stack]  # the file-system protocol: the same on every torch


@pytest.mark.parametrize("name,mode", all_cases(), ids=[f"{n}-{m}" for n, m in all_cases()])
def test_crash_points(crash_harness, name, mode):
    result = crash_harness.run(OPERATIONS[name], mode, cap=budget())
    RESULTS.append(result)
    assert not result.errors and not result.violations, "\n" + result.summary()
