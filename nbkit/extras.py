"""Optional dependencies: import one, or raise an ``ImportError`` that names the pip extra to install.

``import nbkit`` needs torch, numpy and fsspec only. Everything else (ipywidgets, matplotlib, gcsfs,
redis, zstandard, torch_xla) is imported where it is used, through :func:`require`, so a missing
package fails at the first use with the exact install command.

Example:
    >>> from nbkit.extras import require
    >>> require("json", extra="notebook", feature="nbkit.widgets").__name__
    'json'
    >>> require("no_such_module_xyz", extra="gcs", feature="gs:// caches")
    Traceback (most recent call last):
    ...
    ImportError: gs:// caches needs the no_such_module_xyz package: pip install 'nbkit[gcs]'
"""

from __future__ import annotations

import importlib

__all__ = ["require", "EXTRAS"]

# pip extra -> what it installs (kept in step with pyproject.toml's optional-dependencies)
EXTRAS = {
    "notebook": ("ipywidgets", "matplotlib"),
    "gcs": ("gcsfs",),
    "redis": ("redis",),
    "zst": ("zstandard",),
    "tpu": ("torch_xla",),
}


def require(module: str, *, extra: str, feature: str, package: str | None = None):
    """Import ``module`` and return it; if it is missing, raise ``ImportError`` naming ``feature``
    (what needed it) and the ``pip install 'nbkit[extra]'`` command.

    Args:
        module: the dotted module name to import (``"matplotlib.pyplot"``).
        extra: the pip extra of nbkit that installs it.
        feature: what the user tried to use, for the message (``"nbkit.widgets"``).
        package: the distribution name when it differs from the module's top-level name.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        name = package or module.split(".")[0]
        raise ImportError(f"{feature} needs the {name} package: pip install 'nbkit[{extra}]'") from e
