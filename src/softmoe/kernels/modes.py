"""The execution modes the kernels' dispatch rules look at: gradients, torch.func transforms, torch.compile and
autocast."""

from __future__ import annotations

import torch


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an operation on ``tensors`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, ...) is tracing the current call."""
    return torch._C._are_functorch_transforms_active()


def host_reads_are_free(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host costs nothing: a CPU tensor, outside torch.compile and torch.func
    transforms (elsewhere a read synchronizes with the device or breaks the graph)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not transforms_active()


def plain_eager_mode(device_type: str) -> bool:
    """Whether ops run as written: not traced by torch.compile, not under torch.func transforms, and autocast off
    for ``device_type`` (hand-written autograd Functions serve only this mode; softmoe's native ops, registered as
    custom ops, do not need it)."""
    return (
        not torch.compiler.is_compiling()
        and not transforms_active()
        and not torch.is_autocast_enabled(device_type)
    )
