"""Reading pickled NumPy arrays safely: the CIFAR python batches and the classic ``mnist.pkl.gz``.

Unpickling can run arbitrary code, so :func:`restricted_load` uses an unpickler that resolves only the globals it is
given and refuses anything else, naming it. :data:`CIFAR_GLOBALS` is what a CIFAR batch (a Python 2 pickle of a dict
of arrays, lists, ints and byte strings) needs; :data:`ARRAY_GLOBALS` admits nothing but NumPy's array
reconstruction. Keys of :func:`load_array_pickle`'s dict come back as ``str`` whether the file was written by
Python 2 (byte strings) or Python 3.
"""

from __future__ import annotations

import importlib
import pickle
from pathlib import Path
from typing import IO, Any

from softmoe.data.errors import DatasetError

ARRAY_GLOBALS = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
    }
)
"""NumPy's array reconstruction and nothing else (``numpy._core`` is NumPy 2's name for ``numpy.core``)."""

CIFAR_GLOBALS = ARRAY_GLOBALS | {
    ("_codecs", "encode"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
}
"""What a CIFAR python batch needs besides arrays: NumPy scalars, buffers and the codec of Python 2 strings."""


def _resolve(module: str, name: str) -> Any:
    if module.startswith("numpy.core."):  # NumPy 2 moved numpy.core to numpy._core; try the new home first
        try:
            return getattr(importlib.import_module("numpy._core." + module.removeprefix("numpy.core.")), name)
        except (ImportError, AttributeError):
            pass
    return getattr(importlib.import_module(module), name)


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], allowed: frozenset[tuple[str, str]], encoding: str) -> None:
        super().__init__(file, encoding=encoding)
        self.allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"refusing to load the global {module}.{name} (only NumPy arrays are allowed)")
        return _resolve(module, name)


def restricted_load(path: Path, allowed: frozenset[tuple[str, str]], encoding: str = "bytes", opener=open) -> Any:
    """The object pickled in ``path`` (opened with ``opener``, e.g. ``gzip.open``), resolving only the globals in
    ``allowed``; a :class:`DatasetError` naming the file for a missing, truncated, corrupt or unsafe pickle."""
    try:
        with opener(path, "rb") as f:
            return _RestrictedUnpickler(f, allowed, encoding).load()
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


def load_array_pickle(path: Path) -> dict[str, Any]:
    """The dict stored in the CIFAR-style pickle file ``path``, with ``str`` keys; :class:`DatasetError` naming the
    file if not."""
    obj = restricted_load(path, CIFAR_GLOBALS)
    if not isinstance(obj, dict):
        raise DatasetError(f"{path}: expected a pickled dict, got {type(obj).__name__}")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        out[key.decode("latin-1") if isinstance(key, bytes) else str(key)] = value
    return out
