"""Offline MNIST-format files load in torchvision and are learnable (labels match patterns);
mnist_like's offline fallback."""

import numpy as np
import pytest
import torch

import nbkit.offline
from nbkit.offline import mnist_like, write_mnist


@pytest.mark.parametrize("name", ["MNIST", "FashionMNIST", "KMNIST"])
def test_torchvision_loads_the_files(tmp_path, name):
    datasets = pytest.importorskip("torchvision.datasets")
    write_mnist(tmp_path, name=name, n_train=300, n_test=50)
    train = getattr(datasets, name)(tmp_path, train=True, download=False)
    test = getattr(datasets, name)(tmp_path, train=False, download=False)
    assert (len(train), len(test)) == (300, 50)
    image, label = train[0]
    assert image.size == (28, 28) and 0 <= label < 10


def test_classes_are_separable_by_their_mean_image(tmp_path):
    datasets = pytest.importorskip("torchvision.datasets")
    write_mnist(tmp_path, n_train=2000, n_test=10)
    ds = datasets.MNIST(tmp_path, download=False)
    x = ds.data.float().reshape(len(ds), -1)
    y = ds.targets
    means = np.stack([x[y == c].mean(0).numpy() for c in range(10)])
    pred = np.argmin(((x.numpy()[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == y.numpy()).mean() > 0.5


def test_files_are_deterministic(tmp_path):
    a = write_mnist(tmp_path / "a", n_train=50, n_test=5)
    b = write_mnist(tmp_path / "b", n_train=50, n_test=5)
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes()


def test_mnist_like_offline_fallback_says_so(tmp_path, capsys):
    ds = mnist_like("FashionMNIST", tmp_path, download=False, offline_samples=120)
    assert ds.nbkit_source == "offline" and len(ds) == 120
    assert type(ds).__name__ == "FashionMNIST"
    out = capsys.readouterr().out
    assert "Using offline FashionMNIST-format stand-in data (120 samples)" in out
    assert (tmp_path / "nbkit-offline-120" / "FashionMNIST" / "raw" / "train-images-idx3-ubyte").exists()
    # The stand-in never masquerades as the real data: nothing under root/FashionMNIST.
    assert not (tmp_path / "FashionMNIST").exists()
    test = mnist_like("FashionMNIST", tmp_path, train=False, download=False, offline_samples=120)
    assert len(test) == 20


def test_mnist_like_reuses_offline_files(tmp_path):
    mnist_like("MNIST", tmp_path, download=False, offline_samples=60)
    images = tmp_path / "nbkit-offline-60" / "MNIST" / "raw" / "train-images-idx3-ubyte"
    before = images.stat().st_mtime_ns
    mnist_like("MNIST", tmp_path, download=False, offline_samples=60)
    assert images.stat().st_mtime_ns == before


def test_emnist_falls_back_to_mnist_format(tmp_path, capsys):
    ds = mnist_like("EMNIST", tmp_path, download=False, offline_samples=60)
    assert type(ds).__name__ == "MNIST" and ds.nbkit_source == "offline"
    assert "EMNIST has no offline layout; using MNIST-format data instead" in capsys.readouterr().out


def test_real_data_under_root_is_used(tmp_path, capsys):
    from nbkit.offline import write_mnist

    write_mnist(tmp_path, name="KMNIST", n_train=50, n_test=10)  # as if downloaded earlier
    ds = mnist_like("KMNIST", tmp_path, download=False)
    assert ds.nbkit_source == "real" and len(ds) == 50
    assert capsys.readouterr().out == ""


def test_transform_is_applied(tmp_path):
    import torchvision.transforms as T

    ds = mnist_like("MNIST", tmp_path, download=False, offline_samples=60, transform=T.ToTensor())
    image, label = ds[0]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32 and 0 <= int(label) < 10


def test_download_attempt_falls_back_without_a_network(tmp_path, capsys):
    # This machine and CI have no route to the dataset mirrors: the attempt must fail (fast, with a
    # short socket timeout) and fall back. Where a network exists, the real data is fine too.
    ds = mnist_like("MNIST", tmp_path, download=True, offline_samples=60, timeout=3)
    if ds.nbkit_source == "offline":
        assert "the download failed" in capsys.readouterr().out
    else:
        assert len(ds) == 60000
    assert nbkit.offline.socket.getdefaulttimeout() is None  # the global timeout was restored


def test_unknown_dataset_name(tmp_path):
    with pytest.raises(ValueError, match="expected one of MNIST, FashionMNIST, KMNIST, EMNIST"):
        mnist_like("CIFAR10", tmp_path)
