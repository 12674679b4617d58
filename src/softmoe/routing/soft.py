"""Soft MoE in the unified formulation (section 2.6 of the router study): dense routing within one image.

For the tokens X (T, d) of one image and slot parameters Phi (d, E, C): Z = X Phi (T, E, C),
dispatch = softmax of Z over tokens (for each slot), combine = softmax of Z over all E*C slots (for each token).
With ``normalize`` (the default, as in :class:`softmoe.SoftMoE`) X and Phi are L2-normalized over d and the logits
multiplied by a learnable scalar ``scale``. The parameters are laid out exactly as the ``SoftMoE`` layer's, so
:meth:`SoftMoERouter.from_layer` copies a layer's router and gives the same outputs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from softmoe.layer import SoftMoE, soft_moe_logits
from softmoe.routing.formulation import DenseRouting, Router


class SoftMoERouter(Router):
    """Soft MoE's router: (G images, T tokens, d) -> dense (G, T, E, C) routing with C = slots_per_expert."""

    per_image = True

    def __init__(self, dim: int, num_experts: int, slots_per_expert: int = 1, normalize: bool = True) -> None:
        super().__init__()
        for name, value in (("dim", dim), ("num_experts", num_experts), ("slots_per_expert", slots_per_expert)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.dim, self.num_experts, self.slots_per_expert, self.normalize = dim, num_experts, slots_per_expert, normalize
        self.phi = nn.Parameter(torch.empty(dim, num_experts, slots_per_expert))
        self.scale = nn.Parameter(torch.ones(())) if normalize else None
        self.auxiliary_weights: dict[str, float] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The ``SoftMoE`` layer's initialization: truncated LeCun normal over fan_in = dim * num_experts."""
        std = 1.0 / math.sqrt(self.dim * self.num_experts) / 0.87962566103423978
        nn.init.trunc_normal_(self.phi, std=std, a=-2 * std, b=2 * std)
        if self.scale is not None:
            nn.init.ones_(self.scale)

    @classmethod
    def from_layer(cls, layer: SoftMoE) -> SoftMoERouter:
        """A router with a copy of ``layer``'s phi (and scale)."""
        router = cls(layer.dim, layer.num_experts, layer.slots_per_expert, layer.normalize)
        router = router.to(device=layer.phi.device, dtype=layer.phi.dtype)
        with torch.no_grad():
            router.phi.copy_(layer.phi)
            if router.scale is not None:
                router.scale.copy_(layer.scale)
        return router

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (G, T, d) -> Z (G, T, E*C) in float32 or wider."""
        return soft_moe_logits(x, self.phi.reshape(self.dim, -1), self.scale)

    def forward(self, x: torch.Tensor) -> DenseRouting:
        z = self.logits(x)
        shape = (*x.shape[:2], self.num_experts, self.slots_per_expert)
        return DenseRouting(z.softmax(dim=1).view(shape), z.softmax(dim=-1).view(shape))

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, "
            f"normalize={self.normalize}"
        )
