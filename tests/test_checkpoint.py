"""``nbkit.checkpoint.set_aside``: a checkpoint moved to a name that says so, never deleted, never
replacing a file; locally and on an object store (``memory://``, the GCS emulator)."""

import os

import fsspec
import pytest

import nbkit
from nbkit.checkpoint import set_aside

from fixtures_gcs import gcs, gcs_server


def test_local_checkpoint_is_moved_aside_and_a_taken_name_is_never_replaced(tmp_path):
    path = str(tmp_path / "run-checkpoint.pt")
    taken = tmp_path / "run-checkpoint.started-over-T.pt"
    taken.write_bytes(b"an earlier one")
    nbkit.transfer.remote.write_url(path, b"step 100")
    moved = set_aside(path, label="started-over", stamp="T")
    assert moved == str(tmp_path / "run-checkpoint.started-over-T-1.pt")
    assert open(moved, "rb").read() == b"step 100" and taken.read_bytes() == b"an earlier one"
    assert sorted(os.listdir(tmp_path)) == ["run-checkpoint.started-over-T-1.pt", "run-checkpoint.started-over-T.pt"]
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        set_aside(path)


def test_relative_path_keeps_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    os.makedirs("cache")
    nbkit.transfer.remote.write_url("cache/x-checkpoint.pt", b"1")
    assert set_aside("cache/x-checkpoint.pt", stamp="T") == os.path.join("cache", "x-checkpoint.set-aside-T.pt")


def test_bad_label_is_refused(tmp_path):
    with pytest.raises(ValueError, match="label="):
        set_aside(str(tmp_path / "x.pt"), label="../up")


def test_memory_url_is_copied_then_removed():
    url = "memory://set-aside/run/ckpt.pt"
    nbkit.transfer.remote.write_url(url, b"step 5")
    moved = set_aside(url, stamp="T")
    assert moved == "memory://set-aside/run/ckpt.set-aside-T.pt"
    fs = fsspec.filesystem("memory")
    assert not fs.exists("/set-aside/run/ckpt.pt") and fs.cat(moved) == b"step 5"


def test_gs_checkpoint_is_moved_aside(gcs):
    url = f"{gcs.url}/run-checkpoint.pt"
    nbkit.transfer.remote.write_url(url, b"step 7", gcs.storage_options)
    moved = set_aside(url, gcs.storage_options, label="started-over", stamp="T")
    assert moved == f"{gcs.url}/run-checkpoint.started-over-T.pt"
    assert not gcs.fs.exists(f"{gcs.name}/run-checkpoint.pt")
    assert gcs.fs.cat(f"{gcs.name}/run-checkpoint.started-over-T.pt") == b"step 7"
