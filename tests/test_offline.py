"""Offline MNIST-format files load in torchvision and are learnable (labels match patterns)."""

import numpy as np
import pytest

from nbkit.offline import write_mnist


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
