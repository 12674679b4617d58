"""The six routers of the study by name, at a common capacity factor c (section 3.1 of the router study).

c plays the same role for every router: Token Choice selects k = c experts per token with capacity factor 1
(C = round(c * T / E)); Expert Choice uses C = round(c * T / E); Soft MoE uses C = round(c * T_image / E) slots per
expert (T_image the tokens of one image). At equal c every router therefore runs about c * T token-sized rows
through the experts per group: the same expert compute.
"""

from __future__ import annotations

from softmoe.routing.capacity import buffer_capacity
from softmoe.routing.expert_choice import ExpertChoiceRouter
from softmoe.routing.formulation import Router
from softmoe.routing.soft import SoftMoERouter
from softmoe.routing.token_choice import TokenChoiceRouter

ROUTERS: dict[str, str] = {
    "softmax_token_choice": "Softmax Token Choice",
    "sinkhorn_token_choice": "Sinkhorn Token Choice",
    "softmax_expert_choice": "Softmax Expert Choice",
    "sinkhorn_expert_choice": "Sinkhorn Expert Choice",
    "sparsity_constrained_expert_choice": "Sparsity-constrained Expert Choice",
    "soft_moe": "Soft MoE",
}
"""Router name -> the study's label, in the study's order."""


def make_router(
    name: str, dim: int, num_experts: int, capacity_factor: int = 1, tokens_per_image: int | None = None, **options
) -> Router:
    """One of :data:`ROUTERS` at capacity factor c; ``tokens_per_image`` is needed by "soft_moe" (to size its slots).

    Extra keyword ``options`` go to the router's constructor (e.g. ``batch_priority=True``, ``noise_std=0``).
    """
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    if name.endswith("token_choice"):
        if capacity_factor != int(capacity_factor) or capacity_factor < 1:
            raise ValueError(f"token choice routers need an integer c (= k), got {capacity_factor!r}")
        affinity = name.split("_")[0]
        return TokenChoiceRouter(
            dim, num_experts, k=int(capacity_factor), capacity_factor=1.0, affinity=affinity, **options
        )
    if name.endswith("expert_choice"):
        affinity = {"softmax": "softmax", "sinkhorn": "sinkhorn", "sparsity": "sparse"}[name.split("_")[0]]
        return ExpertChoiceRouter(dim, num_experts, capacity_factor, affinity=affinity, **options)
    if tokens_per_image is None:
        raise ValueError("soft_moe needs tokens_per_image to set its slots per expert")
    slots = buffer_capacity(tokens_per_image, num_experts, capacity_factor)  # vmoe SoftRouter: round, multiple_of=1
    return SoftMoERouter(dim, num_experts, slots, **options)
