"""Optional third-party packages: found or imported only inside the loaders that need them.

``import softmoe.data`` never imports scikit-learn or mlxtend; the loaders call :func:`import_optional` or
:func:`package_dir` at load time and turn a missing package into a :class:`MissingDependencyError` that
says what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from softmoe.data.errors import MissingDependencyError


def _missing(distribution: str, dataset: str) -> MissingDependencyError:
    return MissingDependencyError(
        f"the {dataset!r} dataset needs the optional package {distribution!r}, which is not installed: "
        f"run `pip install {distribution}`"
    )


def import_optional(module: str, distribution: str, dataset: str) -> ModuleType:
    """Import ``module`` (from the pip distribution ``distribution``), or explain how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(distribution, dataset) from None


def package_dir(package: str, distribution: str, dataset: str) -> Path:
    """The directory of the installed top-level ``package``, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise _missing(distribution, dataset)
    return Path(next(iter(spec.submodule_search_locations)))
