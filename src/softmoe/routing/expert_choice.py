"""Expert Choice: Algorithm 2 of the router study, and the Softmax / Sinkhorn / sparsity-constrained routers.

Expert Choice allocation, for each group: every expert takes the C tokens with the highest affinity in its column
(ties to the lower token index, as ``jax.lax.top_k`` in vmoe's ``get_top_items_per_expert_dispatcher``); a token may
be taken by several experts or by none, and every expert processes exactly C tokens. The combine weight is the
softmax gate at the chosen position (for Softmax Expert Choice the affinity is that softmax; Sinkhorn and
sparsity-constrained only choose the tokens, vmoe's ``use_softmax_combine_weights``).
"""

from __future__ import annotations

import torch

from softmoe.layer import add_logit_noise
from softmoe.routing.capacity import buffer_capacity, check_capacity_factor
from softmoe.routing.formulation import Router, SparseRouting, check_affinity
from softmoe.routing.gate import LinearGate
from softmoe.routing.sinkhorn import sinkhorn_plan
from softmoe.routing.sparse_ot import sparse_plan
from softmoe.topk import top_k


def expert_choice_allocation(
    affinity: torch.Tensor, capacity: int, combine_from: torch.Tensor | None = None
) -> SparseRouting:
    """Algorithm 2 on affinity (G, T, E): each expert's top-C tokens (C clamped to T, ties to the lower token);
    combine from ``combine_from`` (G, T, E) at the chosen positions (default: the affinity)."""
    check_affinity(affinity)
    _, t, _ = affinity.shape
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    values, token_index = top_k(affinity.transpose(1, 2), min(capacity, t))  # (G, E, C)
    combine = values if combine_from is None else combine_from.transpose(1, 2).gather(-1, token_index)
    return SparseRouting(token_index, combine, t)


AFFINITIES = ("softmax", "sinkhorn", "sparse")


def resolve_noise_std(affinity: str, noise_std: float | None) -> float:
    """The logit noise's scale: vmoe's default 1.0 for "softmax" and "sinkhorn"; "sparse" has none (vmoe's k-sparse
    router adds no noise), so a positive ``noise_std`` for it is a ValueError."""
    if noise_std is None:
        return 0.0 if affinity == "sparse" else 1.0
    if noise_std < 0:
        raise ValueError(f"noise_std must be >= 0, got {noise_std}")
    if affinity == "sparse" and noise_std > 0:
        raise ValueError(
            f"the sparsity-constrained router adds no logit noise (as vmoe's); expected noise_std None "
            f"or 0, got {noise_std}"
        )
    return float(noise_std)


class ExpertChoiceRouter(Router):
    """Softmax, Sinkhorn or sparsity-constrained Expert Choice (sections 2.3 to 2.5 of the router study), as vmoe's
    NoisyTopItemsPerExpertRouter, KLProjectionNoisyTopItemsPerExpertRouter and
    KSparseProjectionTransportTopItemsPerExpertRouter.

    Args:
        dim, num_experts: token size d and E.
        capacity_factor: c; C = round(c * T / E) (at most T), see ``rounding``.
        affinity: "softmax" (Pi = softmax(XW + noise)), "sinkhorn" (Pi = entropic plan of XW + noise) or "sparse"
            (Pi = the k-sparse transport plan of softmax(XW), at most C nonzeros per expert:
            :mod:`softmoe.routing.sparse_ot`). Combine weights are softmax(XW + noise) (no noise for "sparse") at the
            chosen positions; no gradient flows through the OT solvers.
        noise_std: in training mode only, Gaussian noise of std ``noise_std / E`` is added to the logits. None (the
            default): 1.0 (vmoe's default) for "softmax" and "sinkhorn", 0 for "sparse", which accepts no other.
        sinkhorn_iterations: for "sinkhorn" (20 in the authors' code).
        sparse_iterations, sparse_learning_rate: for "sparse", the Adam steps on the semi-dual (at most; vmoe's
            ``maxiter`` 20) and their learning rate (vmoe's ``adam_lr`` 1e-2).
        rounding, multiple_of: see :func:`softmoe.routing.capacity.buffer_capacity`.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        capacity_factor: float = 1.0,
        affinity: str = "softmax",
        noise_std: float | None = None,
        sinkhorn_iterations: int = 20,
        sparse_iterations: int = 20,
        sparse_learning_rate: float = 1e-2,
        rounding: str = "round",
        multiple_of: int = 1,
    ) -> None:
        super().__init__()
        if affinity not in AFFINITIES:
            raise ValueError(f"affinity must be one of {AFFINITIES}, got {affinity!r}")
        self.gate = LinearGate(dim, num_experts)
        self.num_experts, self.affinity = num_experts, affinity
        self.capacity_factor = check_capacity_factor(capacity_factor)
        self.noise_std = resolve_noise_std(affinity, noise_std)
        self.sinkhorn_iterations, self.sparse_iterations = sinkhorn_iterations, sparse_iterations
        self.sparse_learning_rate = sparse_learning_rate
        self.rounding, self.multiple_of = rounding, multiple_of
        self.auxiliary_weights: dict[str, float] = {}

    def capacity(self, num_tokens: int) -> int:
        return buffer_capacity(
            num_tokens,
            self.num_experts,
            self.capacity_factor,
            rounding=self.rounding,
            multiple_of=self.multiple_of,
            maximum=num_tokens,
        )

    def forward(self, x: torch.Tensor) -> SparseRouting:
        """x (G, T, d) -> index-form routing in which every expert holds exactly ``self.capacity(T)`` tokens."""
        logits = self.gate(x)
        capacity = self.capacity(x.shape[1])
        if self.training:
            logits = add_logit_noise(logits, self.noise_std / self.num_experts)
        probs = logits.softmax(dim=-1)
        if self.affinity == "softmax":
            return expert_choice_allocation(probs, capacity)
        with torch.no_grad():
            if self.affinity == "sinkhorn":
                plan = sinkhorn_plan(logits, self.sinkhorn_iterations)
            else:
                plan = sparse_plan(
                    probs.detach(), capacity, self.sparse_iterations, learning_rate=self.sparse_learning_rate
                )
        return expert_choice_allocation(plan, capacity, combine_from=probs)

    def extra_repr(self) -> str:
        return f"affinity={self.affinity!r}, capacity_factor={self.capacity_factor}, noise_std={self.noise_std}"
