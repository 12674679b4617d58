"""Expert Choice: Algorithm 2 of the router study, and the Softmax / Sinkhorn / sparsity-constrained routers.

Expert Choice allocation, for each group: every expert takes the C tokens with the highest affinity in its column; a
token may be taken by several experts or by none. The combine weight is the softmax gate at the chosen position
(for Softmax Expert Choice the affinity is that softmax; Sinkhorn and sparsity-constrained only choose the tokens).
"""

from __future__ import annotations

import torch

from softmoe.routing.capacity import buffer_capacity
from softmoe.routing.formulation import Router, SparseRouting, check_affinity
from softmoe.routing.gate import LinearGate
from softmoe.routing.sinkhorn import sinkhorn_plan
from softmoe.routing.sparse_ot import sparse_plan_columns


def expert_choice_allocation(
    affinity: torch.Tensor, capacity: int, combine_from: torch.Tensor | None = None
) -> SparseRouting:
    """Algorithm 2 on affinity (G, T, E): each expert's top-C tokens (C clamped to T); combine from ``combine_from``
    (G, T, E) at the chosen positions (default: the affinity)."""
    check_affinity(affinity)
    g, t, e = affinity.shape
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    values, token_index = affinity.transpose(1, 2).topk(min(capacity, t), dim=-1)  # (G, E, C)
    combine = values if combine_from is None else combine_from.transpose(1, 2).gather(-1, token_index)
    return SparseRouting(token_index, combine, t)


def columns_to_routing(weights: torch.Tensor, token_index: torch.Tensor, num_tokens: int, combine_from: torch.Tensor) -> SparseRouting:
    """A column-sparse plan (weights, token indices (G, E, C)) -> routing: the nonzero entries are dispatched, with
    combine weights from ``combine_from`` (G, T, E); zero entries become empty slots."""
    chosen = weights > 0
    combine = combine_from.transpose(1, 2).gather(-1, token_index)
    return SparseRouting(
        torch.where(chosen, token_index, -1), torch.where(chosen, combine, torch.zeros_like(combine)), num_tokens
    )


AFFINITIES = ("softmax", "sinkhorn", "sparse")


class ExpertChoiceRouter(Router):
    """Softmax, Sinkhorn or sparsity-constrained Expert Choice (sections 2.3 to 2.5 of the router study).

    Args:
        dim, num_experts: token size d and E.
        capacity_factor: c; C = round(c * T / E) (at most T).
        affinity: "softmax" (Pi = softmax(XW) over experts), "sinkhorn" (Pi = entropic plan of XW) or "sparse"
            (Pi = the sparsity-constrained plan of softmax(XW), at most C nonzeros per expert, solved approximately).
            Combine weights are always softmax(XW) at the chosen positions; no gradient flows through the OT solvers.
        sinkhorn_iterations: for "sinkhorn" (20 in the authors' code).
        sparse_iterations: semi-dual gradient steps for "sparse".
        rounding, multiple_of: see :func:`softmoe.routing.capacity.buffer_capacity`.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        capacity_factor: float = 1.0,
        affinity: str = "softmax",
        sinkhorn_iterations: int = 20,
        sparse_iterations: int = 30,
        rounding: str = "round",
        multiple_of: int = 1,
    ) -> None:
        super().__init__()
        if affinity not in AFFINITIES:
            raise ValueError(f"affinity must be one of {AFFINITIES}, got {affinity!r}")
        self.gate = LinearGate(dim, num_experts)
        self.num_experts, self.capacity_factor, self.affinity = num_experts, capacity_factor, affinity
        self.sinkhorn_iterations, self.sparse_iterations = sinkhorn_iterations, sparse_iterations
        self.rounding, self.multiple_of = rounding, multiple_of
        self.auxiliary_weights: dict[str, float] = {}
        buffer_capacity(1, 1, capacity_factor)  # validates the factor

    def capacity(self, num_tokens: int) -> int:
        return buffer_capacity(
            num_tokens, self.num_experts, self.capacity_factor, rounding=self.rounding,
            multiple_of=self.multiple_of, maximum=num_tokens,
        )

    def forward(self, x: torch.Tensor) -> SparseRouting:
        logits = self.gate(x)
        capacity = self.capacity(x.shape[1])
        probs = logits.softmax(dim=-1)
        if self.affinity == "softmax":
            return expert_choice_allocation(probs, capacity)
        with torch.no_grad():
            if self.affinity == "sinkhorn":
                plan = sinkhorn_plan(logits, self.sinkhorn_iterations)
            else:
                weights, token_index = sparse_plan_columns(probs.detach(), capacity, self.sparse_iterations)
        if self.affinity == "sinkhorn":
            return expert_choice_allocation(plan, capacity, combine_from=probs)
        return columns_to_routing(weights, token_index, x.shape[1], probs)

    def extra_repr(self) -> str:
        return f"affinity={self.affinity!r}, capacity_factor={self.capacity_factor}"
