"""nbkit.commit: the one commit protocol (atomic writes, directories by descriptor, swaps, leftovers, full disk)."""

import os
import threading
import time

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
