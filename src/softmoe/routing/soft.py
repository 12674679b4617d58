"""Soft MoE in the unified formulation (section 2.6 of the router study): dense routing within one image.

For the tokens X (T, d) of one image and slot parameters Phi (d, E, C): Z = X Phi (T, E, C),
dispatch = softmax of Z over tokens (for each slot), combine = softmax of Z over all E*C slots (for each token).
With ``normalize="router"`` (the default, as in :class:`softmoe.SoftMoE`) X and Phi are L2-normalized over d and the
logits multiplied by a learnable scalar ``scale``. The parameters are laid out exactly as the ``SoftMoE`` layer's and
the routing is the layer's own function (:func:`softmoe.layer.soft_moe_routing`), so
:meth:`SoftMoERouter.from_layer` copies a layer's router and gives the same outputs.

As vmoe's SoftRouter (vmoe/projects/soft_moe/router.py) the router can add Gaussian noise to the logits in training
(``add_noise``) and report its monitoring metrics (``get_metrics`` and ``cosine_psim``): :func:`soft_moe_metrics`.
"""

from __future__ import annotations

import torch
from torch import nn

from softmoe.checks import check_normalization, check_positive_ints
from softmoe.initializers import truncated_lecun_normal_
from softmoe.layer import SoftMoE, l2_normalize, soft_moe_logits, soft_moe_routing
from softmoe.routing.formulation import DenseRouting, Router

COSINE_EPS = 1e-9
"""vmoe's ``cosine_psim`` normalizes with rsqrt(sum x^2 + 1e-9)."""


def cosine_similarities(vectors: torch.Tensor) -> torch.Tensor:
    """Pairwise cosine similarities of the rows of each batch: vectors (B, N, K) -> (B, N, N).

    As vmoe's ``cosine_psim``: every row is scaled by rsqrt(sum of its squares + 1e-9) before the dot products.
    """
    unit = vectors * torch.rsqrt(vectors.square().sum(dim=-1, keepdim=True) + COSINE_EPS)
    return unit @ unit.transpose(1, 2)


def similarity_stats(similarity: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """``{prefix}_min``, ``_max`` and ``_mean`` of the off-diagonal entries of similarity (B, N, N), as vmoe.

    min / max: the diagonal is first zeroed and then set to the maximum of that zeroed tensor (so it never wins);
    mean: ``(sum of all entries - B * N) / (B * N * (N - 1))`` (the diagonal counted as exactly 1).
    """
    b, n, _ = similarity.shape
    diagonal = torch.eye(n, dtype=torch.bool, device=similarity.device)
    zeroed = similarity.masked_fill(diagonal, 0.0)
    masked = torch.where(diagonal, zeroed.max(), zeroed)
    return {
        f"{prefix}_min": masked.min(),
        f"{prefix}_max": masked.max(),
        f"{prefix}_mean": (similarity.sum() - b * n) / (b * n * (n - 1)),
    }


@torch.no_grad()
def soft_moe_metrics(dispatch: torch.Tensor, combine: torch.Tensor, mu: torch.Tensor) -> dict[str, torch.Tensor]:
    """vmoe's SoftRouter metrics: dispatch, combine (G, T, E, C) and the normalized slot parameters mu (d, E, C) ->
    detached 0-dim tensors (no host synchronization).

    ``combine_weights_{min,max}_mean``: the min / max of each token's combine weights over the E*C slots, averaged
    over (G, T); ``dispatch_weights_{min,max}_mean``: the min / max of each slot's dispatch weights over the T tokens,
    averaged over (G, E, C); ``combine_weights_similarity_*``: cosine similarities between the combine rows of all
    token pairs of a group; ``dispatch_weights_similarity_*``: between the dispatch columns of all slot pairs of a
    group; ``mu_similarity_*``: between the E*C columns of mu (see :func:`similarity_stats`).
    """
    g, t, e, c = combine.shape
    combine_rows = combine.reshape(g, t, e * c)
    dispatch_columns = dispatch.reshape(g, t, e * c).transpose(1, 2)
    metrics = {
        "combine_weights_min_mean": combine_rows.amin(dim=-1).mean(),
        "combine_weights_max_mean": combine_rows.amax(dim=-1).mean(),
        "dispatch_weights_min_mean": dispatch_columns.amin(dim=-1).mean(),
        "dispatch_weights_max_mean": dispatch_columns.amax(dim=-1).mean(),
    }
    metrics.update(similarity_stats(cosine_similarities(combine_rows), "combine_weights_similarity"))
    metrics.update(similarity_stats(cosine_similarities(dispatch_columns), "dispatch_weights_similarity"))
    mu_columns = mu.reshape(mu.shape[0], e * c).t().unsqueeze(0)
    metrics.update(similarity_stats(cosine_similarities(mu_columns), "mu_similarity"))
    return metrics


class SoftMoERouter(Router):
    """Soft MoE's router: (G images, T tokens, d) -> dense (G, T, E, C) routing with C = slots_per_expert.

    Args:
        dim, num_experts, slots_per_expert: d, E and C.
        normalize: "router" (True; vmoe's normalization with a learnable ``scale``) or "none" (False; Z = X Phi).
            The ``SoftMoE`` layer's "inputs" normalization builds its slots from normalized tokens, which equation
            (2) over the raw tokens cannot express, so it is refused.
        noise_std: in training mode only, ``noise_std * N(0, 1)`` is added to the logits before both softmaxes, as
            vmoe's ``SoftRouter.add_noise`` (default 0). Unlike the sparse routers' noise it is NOT divided by E.
        metrics: fill ``DenseRouting.metrics`` with :func:`soft_moe_metrics` on every call.
    """

    per_image = True

    def __init__(
        self,
        dim: int,
        num_experts: int,
        slots_per_expert: int = 1,
        normalize: str | bool = "router",
        noise_std: float = 0.0,
        metrics: bool = False,
    ) -> None:
        super().__init__()
        check_positive_ints(dim=dim, num_experts=num_experts, slots_per_expert=slots_per_expert)
        normalize = check_normalization(normalize)
        if normalize == "inputs":
            raise ValueError(
                'SoftMoERouter supports normalize "router" or "none", got "inputs" (its slots are built '
                "from normalized tokens, which the MoE layer's equation (2) over the raw tokens cannot do)"
            )
        if noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        self.dim, self.num_experts, self.slots_per_expert = dim, num_experts, slots_per_expert
        self.normalize, self.noise_std, self.compute_metrics = normalize, noise_std, metrics
        self.phi = nn.Parameter(torch.empty(dim, num_experts, slots_per_expert))
        self.scale = nn.Parameter(torch.ones(())) if normalize == "router" else None
        self.auxiliary_weights: dict[str, float] = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The ``SoftMoE`` layer's initialization: truncated LeCun normal over fan_in = dim * num_experts."""
        truncated_lecun_normal_(self.phi, self.dim * self.num_experts)
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
                assert layer.scale is not None  # the layer's normalization, so the layer has a scale too
                router.scale.copy_(layer.scale)
        return router

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (G, T, d) -> Z (G, T, E*C) in float32 or wider (no noise)."""
        return soft_moe_logits(x, self.phi.reshape(self.dim, -1), self.scale, self.normalize)

    def unit_slots(self) -> torch.Tensor:
        """The slot parameters as the logits see them before ``scale``: (d, E, C), normalized over d for "router"
        (vmoe's ``mu_unit``), phi itself for "none"."""
        return l2_normalize(self.phi, dim=0) if self.normalize == "router" else self.phi

    def forward(self, x: torch.Tensor) -> DenseRouting:
        """x (G, T, d) -> dense routing (G, T, E, C), with metrics when the router was built with ``metrics=True``."""
        noise = self.noise_std if self.training else 0.0
        phi = self.phi.reshape(self.dim, -1)
        _, dispatch, combine = soft_moe_routing(x, phi, self.scale, self.normalize, noise)
        shape = (*x.shape[:2], self.num_experts, self.slots_per_expert)
        routing = DenseRouting(dispatch.view(shape), combine.view(shape))
        if self.compute_metrics:
            routing.metrics = soft_moe_metrics(routing.dispatch, routing.combine, self.unit_slots())
        return routing

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, num_experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, "
            f"normalize={self.normalize!r}, noise_std={self.noise_std}, metrics={self.compute_metrics}"
        )
