"""Atomic files and training checkpoints (safetensors weights + JSON metadata).

Every file is written to a temporary name in the same folder, flushed, then renamed over the target, so a run
killed at any instant leaves either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def atomic_write(path: str | Path, write) -> None:
    """Call ``write(temp_path)`` then rename the temporary file onto ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(temp)
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
    with open(path) as f:
        return json.load(f)


def save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Save a flat dict of tensors as safetensors, atomically."""
    contiguous = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    atomic_write(path, lambda temp: save_file(contiguous, temp, metadata=metadata))


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state flattened to ``state.{param_index}.{name}`` tensors."""
    flat = {}
    for index, state in optimizer.state_dict()["state"].items():
        for name, value in state.items():
            flat[f"state.{index}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return flat


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor]) -> None:
    """Inverse of :func:`optimizer_tensors` (hyper-parameters come from the optimizer as constructed)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in flat.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    current = optimizer.state_dict()
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
