"""The execution modes the kernels' dispatch rules look at: gradients, torch.func transforms, torch.compile and
autocast."""

from __future__ import annotations

import torch

from softmoe.compat import transforms_active


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an operation on ``tensors`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def host_reads_are_free(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host costs nothing: a CPU tensor, outside torch.compile and torch.func
    transforms (elsewhere a read synchronizes with the device or breaks the graph)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not transforms_active()


def plain_eager_mode(device_type: str) -> bool:
    """Whether ops run as written: not traced by torch.compile, not under torch.func transforms, and autocast off
    for ``device_type``."""
    return not torch.compiler.is_compiling() and not transforms_active() and not torch.is_autocast_enabled(device_type)


def eager_inference(device_type: str, *tensors: torch.Tensor | None) -> bool:
    """Whether ops on ``tensors`` run as written and record no gradient: :func:`plain_eager_mode` for
    ``device_type`` and no gradient recorded for them (:func:`needs_grad`)."""
    return plain_eager_mode(device_type) and not needs_grad(*tensors)
