"""Optional dependencies: import one, or raise an ``ImportError`` that names the extra and the package.

nbkit depends on torch, numpy and fsspec only. Everything else (ipywidgets, matplotlib, gcsfs,
redis, zstandard, torch_xla) is imported where it is used, through :func:`require`, so a missing
package fails at the first use with the exact install command. torch itself loads on the first use
of what needs it (a dataset, a tensor): the ``nbkit`` command never does, and :func:`is_tensor`
tells a tensor without importing torch.

Example:
    >>> from nbkit.extras import require
    >>> require("json", extra="notebook", feature="nbkit.widgets").__name__
    'json'
    >>> require("no_such_module_xyz", extra="gcs", feature="gs:// caches")
    Traceback (most recent call last):
    ...
    ImportError: gs:// caches needs the no_such_module_xyz package (nbkit-cache's 'gcs' extra): pip install no_such_module_xyz
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["require", "EXTRAS", "DISTRIBUTION", "is_tensor", "lazy_names"]

# nbkit's distribution name (pyproject.toml's [project] name). The package index's "nbkit" is an
# unrelated project: no message ever sends anyone to `pip install nbkit`. Until nbkit-cache is
# published, messages name the package an extra needs (`pip install gcsfs`), never nbkit itself.
DISTRIBUTION = "nbkit-cache"

# pip extra -> what it installs (kept in step with pyproject.toml's optional-dependencies)
EXTRAS = {
    "notebook": ("ipywidgets", "matplotlib"),
    "gcs": ("gcsfs",),
    "redis": ("redis",),
    "zst": ("zstandard",),
    "tpu": ("torch_xla",),
    "ray": ("ray",),
    "dask": ("dask", "distributed"),
    "jax": ("jax", "grain"),
}


def require(module: str, *, extra: str, feature: str, package: str | None = None, install: str | None = None):
    """Import ``module`` and return it; if it is missing, raise ``ImportError`` naming ``feature``
    (what needed it), the extra of nbkit-cache that brings it, and the ``pip install`` of the package.

    Args:
        module: the dotted module name to import (``"matplotlib.pyplot"``).
        extra: the extra of nbkit-cache (pyproject.toml) that installs it.
        feature: what the user tried to use, for the message (``"nbkit.widgets"``).
        package: the distribution name when it differs from the module's top-level name.
        install: the command to give when ``pip install <package>`` is not the right one.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        name = package or module.split(".")[0]
        raise ImportError(f"{feature} needs the {name} package ({DISTRIBUTION}'s {extra!r} extra): "
                          f"{install or 'pip install ' + name}") from e


def is_tensor(value) -> bool:
    """Whether ``value`` is a torch tensor, told without importing torch (a tensor means it is imported):
    the command line and code that handles only numpy never load it.

    Example:
        >>> is_tensor([1, 2])
        False
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def lazy_names(package: str, names: dict) -> tuple:
    """``(__getattr__, __dir__)`` for a package whose names load on first use, so importing it (or one
    of its low modules: ``nbkit.stores.base`` runs ``nbkit/stores/__init__`` first) loads nothing.

    ``names`` maps each public name to the submodule that defines it (``{"push": "sync"}``); any other
    name that is not private is tried as a submodule (``nbkit.tpu`` after a plain ``import nbkit``).
    A name found is set on the package, so later reads are plain attribute reads.

    Example:
        >>> getattr_, dir_ = lazy_names("email", {"Message": "message"})  # what a package's __init__ assigns
        >>> getattr_("Message").__name__, getattr_("charset").__name__
        ('Message', 'email.charset')
    """

    def __getattr__(name):
        module = names.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f"{package}.{module}"), name)
            setattr(sys.modules[package], name, value)  # found directly from now on
            return value
        if not name.startswith("_"):
            try:
                return importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise  # the submodule exists and lacks one of its own imports
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return sorted({*vars(sys.modules[package]), *getattr(sys.modules[package], "__all__", ())})

    return __getattr__, __dir__
