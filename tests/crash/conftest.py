"""Fixtures of the crash-point tests: one process server and one harness per session, and a summary
of every operation's crash points at the end of the run (also written to ``$NBKIT_CRASH_REPORT``)."""

import json
import os

import pytest

# The driver is a script run by the harness (it forks and serves jobs on stdin), never collected.
collect_ignore = ["driver.py"]




@pytest.fixture(scope="session")
def crash_harness(tmp_path_factory):
    from crash.harness import Harness, Server

    base = tmp_path_factory.mktemp("crash")
    server = Server(str(base / "driver.log"))
    harness = Harness(server, str(base))
    yield harness
    harness.close()
    server.close()


def pytest_terminal_summary(terminalreporter):
    from crash.harness import RESULTS

    if not RESULTS:
        return
    tr = terminalreporter
    tr.section("crash points")
    tr.write_line(f"{'operation':<18}{'mode':<7}{'calls':>6}{'points':>8}{'bad':>6}{'seconds':>9}  violations by invariant")
    for r in RESULTS:
        bad = len({v.point for v in r.violations})
        tr.write_line(f"{r.op:<18}{r.mode:<7}{r.calls:>6}{r.points:>8}{bad:>6}{r.seconds:>9.1f}  {r.by_invariant() or ''}"
                      + (f"  harness errors: {len(r.errors)}" if r.errors else ""))
    total = sum(r.seconds for r in RESULTS)
    tr.write_line(f"{len(RESULTS)} operation/mode pairs, {sum(r.points for r in RESULTS)} crash points, {total:.0f} s")
    path = os.environ.get("NBKIT_CRASH_REPORT")
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump([r.to_json() for r in RESULTS], f, indent=1)
        tr.write_line(f"report: {path}")
