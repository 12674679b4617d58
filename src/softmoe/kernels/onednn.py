"""oneDNN's linear for CPU inference (``torch.ops.mkldnn._linear_pointwise``, the kernel torch.compile's CPU
inference uses), bias and activation fused.

On the reference machine (AMD EPYC, 2 cores) MKL reaches about 40% of its matmul peak for 25 rows through a 768 x
30720 weight and about 35% of the bandwidth for logits against 8 slots; oneDNN runs the same products 1.5-2.5x
faster. It has no backward, so it is only taken when no gradient is needed.
"""

from __future__ import annotations

import torch

from softmoe.kernels.modes import needs_grad

# The activations oneDNN can fuse, as (attribute, algorithm) of _linear_pointwise.
ONEDNN_ACTIVATIONS = {None: ("none", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight`` may run in oneDNN: float32 CPU tensors, no gradient needed, oneDNN built in."""
    return (
        not needs_grad(x, weight)
        and x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """activation(x @ weight + bias) in one oneDNN call: x (..., K), weight (K, N), bias (N,) -> (..., N).

    ``activation`` is None, "gelu", "gelu_tanh" or "relu". Only where :func:`onednn_applies`.
    """
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, weight.t(), bias, attr, [], algorithm)
