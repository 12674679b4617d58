"""The initializers of the papers' weights where torch's differ: JAX's, which vmoe uses."""

from __future__ import annotations

import math

import torch
from torch import nn

# A normal truncated to [-2 std, 2 std] has standard deviation 0.8796... std: LeCun init divides by it.
TRUNCATED_NORMAL_STD = 0.87962566103423978


def truncated_lecun_normal_(tensor: torch.Tensor, fan_in: int) -> torch.Tensor:
    """LeCun normal truncated to two standard deviations, in place: std 1/sqrt(fan_in) after truncation (JAX's
    ``lecun_normal``, which vmoe uses for phi and the patch embedding)."""
    std = 1.0 / math.sqrt(fan_in) / TRUNCATED_NORMAL_STD
    return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)
