"""nbkit.commit: the one commit protocol (atomic writes, directories by descriptor, swaps, leftovers, full disk)."""

import os
import threading
import time

import pytest

from nbkit.commit import atomic_write, file_lock, temp_name, temp_pid


def test_lock_excludes_threads(tmp_path):
    path = str(tmp_path / "x.lock")
    inside, overlaps = [], []

    def work():
        for _ in range(20):
            with file_lock(path):
                if inside:
                    overlaps.append(1)
                inside.append(1)
                time.sleep(0.001)
                inside.pop()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps


def test_atomic_write_replaces_or_creates_once(tmp_path):
    path = str(tmp_path / "f")
    assert atomic_write(path, b"a") and atomic_write(path, b"b")
    assert open(path, "rb").read() == b"b"
    assert atomic_write(path, b"c", exclusive=True) is False
    assert atomic_write(str(tmp_path / "g"), b"c", exclusive=True, sync=True)
    assert sorted(os.listdir(tmp_path)) == ["f", "g"]  # no temporary file left behind


def test_temp_names_carry_the_pid(tmp_path):
    name = os.path.basename(temp_name(str(tmp_path / "piece.bin")))
    assert name.startswith(".piece.bin.") and temp_pid(name) == os.getpid()


def test_names_that_claim_impossible_process_ids_are_no_live_process(tmp_path):
    from nbkit.stats import process_alive

    assert temp_pid(".index.bin." + "9" * 40 + ".1.abcdef01.tmp") is None  # never an int no pid can be
    assert not process_alive(10**30) and not process_alive(0) and not process_alive(-1)
    assert process_alive(os.getpid())


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from nbkit.commit import LEFTOVER_OPS, leftover_of, staging_name


@pytest.mark.fuzz
@given(st.text(min_size=1, max_size=200))
def test_fuzz_leftover_names_from_a_listing(name):
    # Directory and bucket listings are outside input: any name parses to None or to a (target, why) pair,
    # a pid that fits an int, never an exception.
    left = leftover_of(name)
    assert left is None or (isinstance(left[0], str) and left[0] and isinstance(left[1], str))
    pid = temp_pid(name)
    assert pid is None or 0 <= pid < 10**10


@pytest.mark.fuzz
@given(st.text(min_size=1, max_size=100).filter(lambda t: "/" not in t and "\x00" not in t), st.sampled_from(sorted(LEFTOVER_OPS)))
def test_fuzz_staging_names_name_their_target(target, op):
    assert leftover_of(staging_name(target, op)) == (target, LEFTOVER_OPS[op])
