"""Reading the CIFAR python-pickle batches safely.

The CIFAR files are Python 2 pickles of a dict of NumPy arrays, lists, ints and byte strings. Unpickling
can run arbitrary code, so :func:`load_array_pickle` uses an unpickler that only resolves the few globals
such a file needs (NumPy's array/dtype reconstructors and ``_codecs.encode``) and refuses anything else.
Keys come back as ``str`` whether the file was written by Python 2 (byte strings) or Python 3.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import Any

from softmoe.data.errors import DatasetError

_ALLOWED_GLOBALS = {
    ("_codecs", "encode"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
}


def _resolve(module: str, name: str) -> Any:
    if module.startswith("numpy.core."):  # NumPy 2 moved numpy.core to numpy._core; try the new home first
        try:
            return getattr(importlib.import_module("numpy._core." + module.removeprefix("numpy.core.")), name)
        except (ImportError, AttributeError):
            pass
    return getattr(importlib.import_module(module), name)


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load the global {module}.{name} (only NumPy arrays are allowed)")
        return _resolve(module, name)


def load_array_pickle(path: Path) -> dict[str, Any]:
    """The dict stored in the pickle file ``path``, with ``str`` keys; :class:`DatasetError` naming the file if not."""
    try:
        with open(path, "rb") as f:
            obj = _ArrayUnpickler(f, encoding="bytes").load()
    except FileNotFoundError:
        raise DatasetError(f"{path}: file not found") from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read file: {exc.strerror or exc}") from None
    except EOFError:
        raise DatasetError(f"{path}: truncated pickle (the file ends early)") from None
    except pickle.UnpicklingError as exc:
        if "truncated" in str(exc):  # the file ends inside a long string
            raise DatasetError(f"{path}: truncated pickle (the file ends early)") from None
        raise DatasetError(f"{path}: corrupt or unsafe pickle: {exc}") from None
    except Exception as exc:  # a damaged pickle can fail inside any reconstructor, with any exception type
        raise DatasetError(f"{path}: corrupt pickle: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        out[key.decode("latin-1") if isinstance(key, bytes) else str(key)] = value
    return out
