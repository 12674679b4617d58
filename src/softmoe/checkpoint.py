"""Atomic files, training checkpoints (safetensors weights + JSON metadata) and run-folder locks.

Every file is written to a temporary name in the same folder, flushed, then renamed over the target, so a run
killed at any instant leaves either the old file or the new one, never a torn one; the temporary files of a killed
write are removed by the next write of the same file. Files get the permissions of the user's umask (as ``open``
would give them). A file that cannot be read back raises :class:`CorruptFileError` naming it and the problem.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class CorruptFileError(ValueError):
    """A file softmoe wrote (or was given) is unreadable: truncated, corrupt or of the wrong kind."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write) -> None:
    """Call ``write(temp_path)`` then rename the temporary file onto ``path`` (mode 0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left by a write that was killed
        stale.unlink(missing_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(temp)
        os.chmod(temp, 0o666 & ~_umask())  # after the write: a writer may have replaced mkstemp's 0600 file
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON, atomically."""

    def write(temp: str) -> None:
        with open(temp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    atomic_write(path, write)


def read_json(path: str | Path) -> Any:
    """The JSON value in ``path``; :class:`CorruptFileError` naming the file when it is not valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptFileError(f"{path}: not a valid JSON file ({error})") from None


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Save a flat dict of tensors as safetensors, atomically."""
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    atomic_write(path, lambda temp: save_file(contiguous, temp, metadata=metadata))


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; :class:`CorruptFileError` naming the file when it cannot be read
    (``FileNotFoundError`` when it is missing)."""
    if not Path(path).is_file():
        raise FileNotFoundError(2, "No such file", str(path))
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, RuntimeError) as error:
        raise CorruptFileError(f"{path}: not a readable safetensors file ({error})") from None


@contextlib.contextmanager
def run_lock(folder: str | Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``folder`` (its ``.lock`` file) for the block.

    A second process asking for the same folder gets a ValueError naming the process that holds it, instead of
    writing into the folder at the same time.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise ValueError(
                f"{folder} is in use by process {holder}; wait for it to finish or use another folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
