"""Shared test fixtures. Per-topic fixtures live in tests/fixtures_*.py and are imported by the
test modules that use them."""

import os

import pytest

# Scripts the tests run in subprocesses (they do real work at import): never collected.
collect_ignore = ["tpu_scripts", "notebooks", "widgets7"]

os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture(scope="session")
def mnist_root(tmp_path_factory):
    """An offline MNIST-format root (2,000 train / 500 test images) for torchvision.datasets.MNIST."""
    from nbkit.offline import write_mnist

    root = tmp_path_factory.mktemp("mnist")
    write_mnist(root, n_train=2000, n_test=500)
    return root
