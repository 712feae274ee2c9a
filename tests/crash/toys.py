"""Toy operations with known crash behaviour, to test the harness itself (``test_model.py``): each
replaces ``parent/file.txt`` (old content → new content) in one of the ways code gets it right or wrong."""

from __future__ import annotations

import os
import shutil

from crash.operations import Expect, Operation


def content(seed: int) -> bytes:
    return f"version {seed}\n".encode() * 300


def _setup(work):
    os.makedirs(os.path.join(work, "parent", "bystander"))
    with open(os.path.join(work, "parent", "bystander", "notes.txt"), "w") as f:
        f.write("not ours\n")
    with open(os.path.join(work, "parent", "file.txt"), "wb") as f:
        f.write(content(1))


def _target(work):
    return os.path.join(work, "parent", "file.txt")


def _replace(*, sync_file: bool, sync_dir: bool):
    def run(work):
        tmp = _target(work) + ".tmp"
        if os.path.lexists(tmp):  # an earlier run's, killed
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        data = content(2)
        os.write(fd, data[:1000])
        os.write(fd, data[1000:])
        if sync_file:
            os.fsync(fd)
        os.close(fd)
        os.replace(tmp, _target(work))
        if sync_dir:
            d = os.open(os.path.dirname(tmp), os.O_RDONLY | os.O_DIRECTORY)
            os.fsync(d)
            os.close(d)
    return run


def _in_place(work):
    with open(_target(work), "wb") as f:
        data = content(2)
        f.write(data[:1000])
        f.flush()
        f.write(data[1000:])


def _unlink_then_write(work):
    if os.path.lexists(_target(work)):
        os.unlink(_target(work))
    with open(_target(work), "wb") as f:
        f.write(content(2))
        f.flush()
        os.fsync(f.fileno())


def _in_staged_dir(work):
    """mkdir a staging directory, write the file there (synced), then rename it over the target."""
    stage = os.path.join(work, "parent", ".stage")
    if os.path.lexists(stage):  # an earlier run's, killed
        shutil.rmtree(stage)
    os.mkdir(stage)
    with open(os.path.join(stage, "file.txt"), "wb") as f:
        f.write(content(2))
        f.flush()
        os.fsync(f.fileno())
    os.rename(os.path.join(stage, "file.txt"), _target(work))
    os.rmdir(stage)
    d = os.open(os.path.join(work, "parent"), os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(d)
    os.close(d)


def _toy(name, run):
    return Operation(name, _setup, run, "parent/file.txt", "file", Expect(1), Expect(2),
                     inputs=("parent/bystander",), power_loss=True, removable=False,
                     entries=("file.txt.tmp", ".stage"))


TOYS = {op.name: op for op in [
    _toy("toy_atomic", _replace(sync_file=True, sync_dir=True)),
    _toy("toy_no_dir_sync", _replace(sync_file=True, sync_dir=False)),
    _toy("toy_no_sync", _replace(sync_file=False, sync_dir=False)),
    _toy("toy_in_place", _in_place),
    _toy("toy_unlink_then_write", _unlink_then_write),
    _toy("toy_staged_dir", _in_staged_dir),
]}
