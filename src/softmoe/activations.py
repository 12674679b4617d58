"""The elementwise activations of the experts' MLPs, by name (the names the native kernels fuse too)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation called ``name`` ("gelu", "gelu_tanh" or "relu")."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]
