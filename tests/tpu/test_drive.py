"""nbkit.tpu.drive_path: notebook 02's `drive` option. On Colab (a fake google.colab here) it mounts
Google Drive and puts the file under MyDrive; anywhere else it does nothing and says so."""

import sys
import types

from nbkit import tpu


def fake_colab(monkeypatch):
    """A google.colab whose drive.mount() records the call and makes MyDrive, as Colab's does."""
    mounts = []

    def mount(mountpoint, force_remount=False):
        mounts.append(mountpoint)
        (__import__("pathlib").Path(mountpoint) / "MyDrive").mkdir(parents=True, exist_ok=True)

    google = types.ModuleType("google")
    colab = types.ModuleType("google.colab")
    drive = types.ModuleType("google.colab.drive")
    drive.mount = mount
    colab.drive = drive
    google.colab = colab
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.setitem(sys.modules, "google.colab.drive", drive)
    if "google" not in sys.modules:
        monkeypatch.setitem(sys.modules, "google", google)
    else:
        monkeypatch.setattr(sys.modules["google"], "colab", colab, raising=False)
    return mounts


def test_on_colab_drive_is_mounted_and_the_tar_goes_under_mydrive(monkeypatch, tmp_path):
    mounts = fake_colab(monkeypatch)
    mount_point = tmp_path / "drive"
    path, message = tpu.drive_path("export/mnist-cache.tar", mount_point=str(mount_point))
    assert mounts == [str(mount_point)]
    assert path == str(mount_point / "MyDrive" / "nbkit" / "mnist-cache.tar")
    assert (mount_point / "MyDrive" / "nbkit").is_dir()
    assert "mounted" in message and path in message and "outlives this runtime" in message


def test_elsewhere_drive_does_nothing_and_says_so(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    path, message = tpu.drive_path("export/mnist-cache.tar", mount_point=str(tmp_path / "drive"))
    assert path == "export/mnist-cache.tar"
    assert message.startswith("drive: Google Drive is mounted only on Colab, and this is not Colab: nothing mounted")
    assert not (tmp_path / "drive").exists()
