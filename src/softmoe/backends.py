"""Backends of the Soft MoE mixing step ``C f(D^T X)``: which code computes it, chosen explicitly per layer.

``SoftMoE(backend=...)`` takes one of :data:`BACKENDS`; ``layer.backend_for(x)`` says which one runs for an input
and why (a :class:`BackendChoice`).

    "reference"  Definition 1 as written, in plain torch ops: slots = D^T X, every expert on its slots, C Y~.
                 Any experts, any device and dtype, torch.compile, torch.func, forward-mode AD and autocast.
    "slots"      the same products in one autograd node with the backward written out (MLP experts; no torch.func
                 transform, forward-mode AD or autocast): no copies between the slot and expert layouts, less
                 autograd overhead; without a gradient to record, the products alone.
    "tokens"     the exact token-space rewrite of the MLP experts (no slot tensor is written): cheaper for many small
                 experts on few tokens.
    "native"     softmoe's CPU kernels, registered as ``torch.ops.softmoe`` custom ops (float32 CPU, MLP experts):
                 the fused small-expert mixing where it applies, else the slot formulation with the native batched
                 expert matmul.
    "auto"       the default: on CPU the native ops where they are tuned to win, else a cost model between "slots"
                 and "tokens" (constants measured on CPU, used on CPU only); on other devices "slots"; under a
                 torch.func transform or forward-mode AD (``torch.autograd.forward_ad``), or autocast, "reference".

A backend that cannot serve an input (e.g. "native" on a GPU) raises a ValueError saying why; "auto" never does.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from softmoe.kernels.modes import transforms_active

__all__ = [
    "BACKENDS", "BackendChoice", "ReferenceOnly", "autocast_on", "check_backend", "transforms_active", "unsupported"
]

BACKENDS = ("auto", "reference", "slots", "tokens", "native")


class BackendChoice(NamedTuple):
    """The backend that runs for one input (one of :data:`BACKENDS` but "auto") and the reason, in words."""

    name: str
    reason: str


def check_backend(backend: str) -> str:
    """``backend`` if it names one of :data:`BACKENDS`, else a ValueError."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def autocast_on(x: torch.Tensor) -> bool:
    """Whether autocast is enabled for x's device type ("meta" counts as "cpu")."""
    # (x.is_cpu first: x.device builds a torch.device, 0.3 us, and this runs on every eager call)
    return torch.is_autocast_enabled("cpu" if x.is_cpu or x.is_meta else x.device.type)


def unsupported(backend: str, why: str) -> ValueError:
    """The error for an explicitly requested backend that cannot serve the input."""
    return ValueError(f"backend {backend!r} cannot run this input: {why}")


class ReferenceOnly:
    """The backend methods of an expert bank that runs the "reference" backend only (the layer runs its experts on
    all slots); ``reference_reason`` says why, in words."""

    reference_reason: str

    def choose_backend(self, backend: str, x: torch.Tensor, slots_per_expert: int) -> BackendChoice:
        if backend not in ("auto", "reference"):
            raise unsupported(backend, f"{self.reference_reason}, the 'reference' backend only")
        return BackendChoice("reference", self.reference_reason)

    def mix(
        self, backend: str, x, dispatch, combine, slots_per_expert: int, kept_combine: bool = False
    ) -> torch.Tensor:
        raise unsupported(backend, f"{self.reference_reason}, the 'reference' backend only")
