"""The bias-free linear gate of the sparse routers (logits = X W, computed in float32 or wider) and the Gaussian
logit noise the routers add in training."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from softmoe.checks import check_positive_ints


class LinearGate(nn.Module):
    """x (..., dim) -> logits (..., num_experts), with W (num_experts, dim) initialized like ``nn.Linear``."""

    def __init__(self, dim: int, num_experts: int, device=None, dtype=None) -> None:
        super().__init__()
        check_positive_ints(dim=dim, num_experts=num_experts)
        self.dim, self.num_experts = dim, num_experts
        self.weight = nn.Parameter(torch.empty(num_experts, dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / self.dim**0.5
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(torch.promote_types(x.dtype, self.weight.dtype), torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            return F.linear(x.to(dtype), self.weight.to(dtype))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, num_experts={self.num_experts}, bias=False"
