"""The checks of a Soft MoE layer's inputs: a clear ValueError naming what is wrong, expected and actual."""

from __future__ import annotations

import torch

__all__ = ["NORMALIZATIONS", "check_normalization", "check_positive_ints", "check_selected", "check_tokens"]

# The Soft MoE layer's normalizations of its tokens and slot parameters (softmoe.layer's module doc).
NORMALIZATIONS = ("router", "inputs", "none")


def autocast_device(x: torch.Tensor) -> str:
    """The autocast device type of x's device; "meta" (shape-only tensors) counts as "cpu"."""
    return "cpu" if x.device.type == "meta" else x.device.type


def check_normalization(normalize: str | bool) -> str:
    """The normalization's name: one of :data:`NORMALIZATIONS`; True means "router" and False "none"."""
    if isinstance(normalize, bool):
        return "router" if normalize else "none"
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS} (or a bool), got {normalize!r}")
    return normalize


def check_positive_ints(**values: object) -> None:
    """Raise a ValueError naming the first of ``values`` that is not an integer >= 1 (a Python int, not a bool, or a
    symbolic size under torch.compile)."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int | torch.SymInt) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_tokens(x: torch.Tensor, dim: int, mask: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> None:
    """Raise a ValueError unless x is a floating (batch, tokens, dim) tensor and mask a bool (batch, tokens).

    With ``dtype`` (the layer's), x must have that dtype too, except under autocast, which casts for itself.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, tokens, dim={dim}), got rank {x.dim()} shape {tuple(x.shape)}")
    if x.shape[-1] != dim:
        raise ValueError(f"x must have feature size dim={dim}, got {x.shape[-1]} (shape {tuple(x.shape)})")
    if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(autocast_device(x)):
        raise ValueError(f"x has dtype {x.dtype} but the layer's parameters are {dtype}; convert one of them")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != x.shape[:2]:
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must have shape (batch, tokens)={tuple(x.shape[:2])}, got {got}")
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = real token), got dtype {mask.dtype}")


def check_selected(selected: torch.Tensor, batch: int, num_experts: int, values: bool = True) -> None:
    """Raise a ValueError unless ``selected`` is an int64 (batch, k) tensor of distinct expert indices per row,
    where -1 marks an unused place (an input that keeps fewer than k experts).

    ``values=False`` checks the dtype and shape only: the values' checks read them on the host (a synchronization
    on a GPU, a graph break under torch.compile).
    """
    if selected.dtype != torch.int64 or selected.dim() != 2 or selected.shape[0] != batch:
        raise ValueError(
            f"selected must be an int64 tensor of shape (batch={batch}, k), "
            f"got {selected.dtype} {tuple(selected.shape)}"
        )
    if not values:
        return
    if selected.numel() and (int(selected.min()) < -1 or int(selected.max()) >= num_experts):
        raise ValueError(
            f"selected expert indices must lie in [0, {num_experts}) (or be -1, unused), got {selected.tolist()}"
        )
    ordered = selected.sort(dim=1).values
    if selected.shape[1] > 1 and bool(((ordered.diff(dim=1) == 0) & (ordered[:, 1:] >= 0)).any()):
        raise ValueError(f"selected must not repeat an expert within a row, got {selected.tolist()}")
