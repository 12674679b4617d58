"""Token Choice: Algorithm 1 of the router study, and the Softmax / Sinkhorn Token Choice routers.

Token Choice allocation, for each group: every token picks its top-k experts by the affinity (ties to the lower
expert index, as ``jax.lax.top_k`` in vmoe: :func:`softmoe.topk.top_k`); assignments are made
in K-major order (all first choices, then all second choices, ...), tokens in array order or, with Batch Priority
Routing (BPR), in decreasing order of their top-1 affinity; an assignment whose expert's buffer already holds C
tokens is dropped. The combine weight of a kept (token, expert) pair is the affinity there, or, for Sinkhorn, the
softmax probability there (the study's "softmax combine" trick).

Vectorized without any (T, E) or (T, E, C) one-hot: the k*T assignments of a group are stable-sorted by expert, so an
assignment's buffer position is its rank among the earlier assignments to the same expert.
"""

from __future__ import annotations

import torch

from softmoe.layer import add_logit_noise
from softmoe.routing.capacity import buffer_capacity, check_capacity_factor
from softmoe.routing.formulation import Router, SparseRouting, check_affinity
from softmoe.routing.gate import LinearGate
from softmoe.routing.losses import importance_loss, load_loss
from softmoe.routing.sinkhorn import sinkhorn_plan
from softmoe.topk import top_k


def token_choice_allocation(
    affinity: torch.Tensor,
    capacity: int,
    k: int = 1,
    combine_from: torch.Tensor | None = None,
    priority: torch.Tensor | None = None,
) -> SparseRouting:
    """Algorithm 1 on affinity (G, T, E) with buffer capacity C and k choices per token.

    Args:
        combine_from: (G, T, E) values to use as combine weights at the chosen (token, expert) pairs (default: the
            affinity itself).
        priority: (G, T) token priorities (higher first) for Batch Priority Routing; None keeps array order.
    """
    check_affinity(affinity)
    g, t, e = affinity.shape
    if not 1 <= k <= e:
        raise ValueError(f"k must lie in [1, num_experts={e}], got {k}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    device = affinity.device
    values, experts = top_k(affinity, k)  # (G, T, k)
    weights = values if combine_from is None else combine_from.gather(-1, experts)
    if priority is None:
        order = torch.arange(t, device=device).expand(g, t)
    else:
        order = torch.argsort(priority, dim=-1, descending=True, stable=True)
        by_priority = order.unsqueeze(-1).expand(g, t, k)
        experts, weights = experts.gather(1, by_priority), weights.gather(1, by_priority)
    # K-major sequence of assignments: index i * T + j is the (i+1)-th choice of the j-th token in priority order.
    expert_seq = experts.transpose(1, 2).reshape(g, k * t)
    weight_seq = weights.transpose(1, 2).reshape(g, k * t)
    token_seq = order.unsqueeze(1).expand(g, k, t).reshape(g, k * t)

    key = (expert_seq + e * torch.arange(g, device=device).unsqueeze(1)).reshape(-1)  # (group, expert) id
    sorted_key, perm = torch.sort(key, stable=True)
    counts = key.new_zeros(g * e).scatter_add_(0, key, torch.ones_like(key))  # assignments per (group, expert)
    starts = counts.cumsum(0) - counts  # where each (group, expert) run begins in the sorted order
    rank_sorted = torch.arange(key.numel(), device=device) - starts[sorted_key]
    position = torch.empty_like(rank_sorted).scatter_(0, perm, rank_sorted)
    keep = position < capacity
    dummy = g * e * capacity
    slot = torch.where(keep, key * capacity + position, dummy)

    token_index = torch.full((dummy + 1,), -1, dtype=torch.int64, device=device)
    token_index = token_index.scatter(0, slot, torch.where(keep, token_seq.reshape(-1), -1))
    combine = weight_seq.new_zeros(dummy + 1).scatter(0, slot, torch.where(keep, weight_seq.reshape(-1), 0.0))
    return SparseRouting(token_index[:dummy].view(g, e, capacity), combine[:dummy].view(g, e, capacity), t)


class TokenChoiceRouter(Router):
    """Softmax or Sinkhorn Token Choice (sections 2.1 and 2.2 of the router study).

    Args:
        dim, num_experts: token size d and E.
        k: experts per token (1 or 2 in the study).
        capacity_factor: C = round(capacity_factor * k * T / E) (the study uses capacity_factor 1, so C = round(kT/E)).
        affinity: "softmax" (Pi = softmax(XW + noise), also the combine weights) or "sinkhorn" (Pi = the entropic
            plan of XW + noise; combine from the clean softmax(XW); no gradient through Sinkhorn), as vmoe's
            NoisyTopExpertsPerItemRouter and KLProjectionNoisyTopExpertsPerItemRouter.
        noise_std: in training mode only, Gaussian noise of std ``noise_std / E`` is added to the logits that choose
            the experts (vmoe's default 1.0); 0 disables it.
        batch_priority: Batch Priority Routing (tokens with the highest top-1 affinity are served first).
        importance_weight, load_weight: weights of the auxiliary losses (softmax only; V-MoE: 0.005 each). The
            importance loss (of the clean softmax) is always reported; the load loss only in training mode with
            noise, as vmoe computes it only for a stochastic (non-deterministic) router.
        sinkhorn_iterations: Sinkhorn iterations (20 in the authors' code).
        rounding, multiple_of: see :func:`softmoe.routing.capacity.buffer_capacity`.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        affinity: str = "softmax",
        noise_std: float = 1.0,
        batch_priority: bool = False,
        importance_weight: float = 0.005,
        load_weight: float = 0.005,
        sinkhorn_iterations: int = 20,
        rounding: str = "round",
        multiple_of: int = 1,
    ) -> None:
        super().__init__()
        if affinity not in ("softmax", "sinkhorn"):
            raise ValueError(f"affinity must be 'softmax' or 'sinkhorn', got {affinity!r}")
        if not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"k must be an integer in [1, num_experts={num_experts}], got {k!r}")
        if noise_std < 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std}")
        self.gate = LinearGate(dim, num_experts)
        self.num_experts, self.k, self.capacity_factor = num_experts, k, capacity_factor
        self.affinity, self.noise_std, self.batch_priority = affinity, noise_std, batch_priority
        self.auxiliary_weights = {"importance": importance_weight, "load": load_weight} if affinity == "softmax" else {}
        self.sinkhorn_iterations, self.rounding, self.multiple_of = sinkhorn_iterations, rounding, multiple_of
        check_capacity_factor(capacity_factor)

    def capacity(self, num_tokens: int) -> int:
        return buffer_capacity(
            num_tokens,
            self.num_experts,
            self.capacity_factor,
            k=self.k,
            rounding=self.rounding,
            multiple_of=self.multiple_of,
            maximum=num_tokens,
        )

    def forward(self, x: torch.Tensor) -> SparseRouting:
        """x (G, T, d) -> index-form routing with buffer capacity ``self.capacity(T)``."""
        logits = self.gate(x)
        capacity = self.capacity(x.shape[1])
        std = self.noise_std / self.num_experts if self.training else 0.0
        noisy = add_logit_noise(logits, std)
        losses: dict[str, torch.Tensor] = {}
        if self.affinity == "softmax":
            selection, combine_from = noisy.softmax(dim=-1), None
            losses["importance"] = importance_loss(logits.softmax(dim=-1))
            if std > 0:
                losses["load"] = load_loss(logits, noisy, self.k, std)
        else:
            with torch.no_grad():
                selection = sinkhorn_plan(noisy, self.sinkhorn_iterations)
            combine_from = logits.softmax(dim=-1)
        priority = selection.max(dim=-1).values if self.batch_priority else None
        routing = token_choice_allocation(selection, capacity, self.k, combine_from, priority)
        routing.auxiliary_losses = losses
        routing.auxiliary_weights = {name: w for name, w in self.auxiliary_weights.items() if name in losses}
        return routing

    def extra_repr(self) -> str:
        return (
            f"affinity={self.affinity!r}, k={self.k}, capacity_factor={self.capacity_factor}, "
            f"batch_priority={self.batch_priority}, noise_std={self.noise_std}"
        )
