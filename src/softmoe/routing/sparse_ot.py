"""Sparsity-constrained optimal transport for the sparsity-constrained Expert Choice router, as vmoe solves it.

vmoe's KSparseProjectionTransportTopItemsPerExpertRouter (vmoe/projects/sparsity_constrained_ot/
ksparse_projection_routing.py) hands jaxopt's ``_regularized_transport_semi_dual`` the similarity S = softmax(X W)
(T, E) of each group, cost -S, token marginals a = 1_T and expert marginals b = (T/E) 1_E. With prices alpha (T,),
column r of the plan is

    P[:, r] = b_r * p_r,   p_r = the projection of (alpha + S[:, r]) / b_r onto the unit simplex with at most C
                                 nonzeros (its C largest entries, ties to the lower token, projected onto the simplex),

and the semi-dual ``f(alpha) = sum_r b_r * maxop_r(alpha + S[:, r]) - sum_t alpha_t`` (maxop with p_r held constant)
has the gradient ``P(alpha) 1_E - 1_T``. jaxopt's OptaxSolver minimizes it with ``optax.adam(1e-2)`` from alpha = 0,
``maxiter=20``, ``tol=1e-3``: the first Adam step is always taken; each later one only while the L2 norm of the
gradient at the previous step's prices exceeds ``tol``. The groups are independent (vmapped), so each stops on its
own. The plan is P at the final prices: every column sums to T/E and has at most C nonzeros; the token marginals hold
only approximately. Nothing here is differentiated (the router calls it on a detached similarity).
"""

from __future__ import annotations

import torch

from softmoe.topk import top_k

ADAM_BETAS = (0.9, 0.999)
"""optax.adam's default b1, b2."""
ADAM_EPS = 1e-8
"""optax.adam's default eps (added to the root of the second moment; eps_root = 0)."""


def sparse_simplex_projection(values: torch.Tensor, mass: float, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Euclidean projection of each row of ``values`` (..., n) onto {p >= 0, sum p = mass, ||p||_0 <= k}.

    As jaxopt's ``projection_sparse_simplex(values, k, value=mass)``: ``mass`` times the projection of
    ``values / mass`` onto the unit simplex restricted to its k largest entries (ties to the lower index; k is
    clamped to n). Returns (weights (..., k), indices (..., k)): the projection's possibly-nonzero entries (in
    decreasing order of ``values``) and where they sit; every other entry of the projection is 0.
    """
    top, index = top_k(values / mass, min(k, values.shape[-1]))
    cumsum = top.cumsum(dim=-1)
    ranks = torch.arange(1, top.shape[-1] + 1, device=values.device, dtype=top.dtype)
    # The support is the j largest entries for the largest j with top[j] > (cumsum[j] - 1) / j (j >= 1 unless the
    # row holds NaN, for which the clamp keeps the gather in range).
    support = (top * ranks > cumsum - 1).sum(dim=-1, keepdim=True).clamp_min(1)
    tau = (cumsum.gather(-1, support - 1) - 1) / support.to(top.dtype)
    return mass * (top - tau).clamp_min(0), index


def _plan_columns(
    similarity: torch.Tensor, alpha: torch.Tensor, mass: float, capacity: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's columns at prices alpha: similarity (G, T, E), alpha (G, T) -> (weights, token indices), each
    (G, E, C') with C' = min(C, T)."""
    scores = (alpha.unsqueeze(-1) + similarity).transpose(1, 2)  # (G, E, T): alpha - cost, cost = -similarity
    return sparse_simplex_projection(scores, mass, capacity)


def _token_sums(weights: torch.Tensor, index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Row sums of a plan in column form: weights, indices (G, E, C) -> (G, T)."""
    g = weights.shape[0]
    return weights.new_zeros(g, num_tokens).scatter_add(1, index.reshape(g, -1), weights.reshape(g, -1))


def sparse_plan_columns(
    similarity: torch.Tensor,
    capacity: int,
    max_iterations: int = 20,
    tolerance: float = 1e-3,
    learning_rate: float = 1e-2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vmoe's k-sparse transport plan of ``similarity`` (G, T, E) in column form, computed in float32 or wider.

    Returns (weights (G, E, C'), token indices (G, E, C')), C' = min(capacity, T): column r of the plan is
    weights[g, r, c] at token indices[g, r, c] and zero elsewhere. Adam (``learning_rate``, optax's defaults
    otherwise) on the semi-dual prices for at most ``max_iterations`` steps, stopping per group as jaxopt's
    OptaxSolver does with ``tol=tolerance`` (see the module doc); ``max_iterations=0`` keeps alpha = 0.
    """
    if capacity < 1 or max_iterations < 0:
        raise ValueError(f"capacity must be >= 1 and max_iterations >= 0, got {capacity} and {max_iterations}")
    g, t, e = similarity.shape
    mass = t / e
    similarity = similarity.to(torch.promote_types(similarity.dtype, torch.float32))
    alpha = similarity.new_zeros(g, t)
    first, second = torch.zeros_like(alpha), torch.zeros_like(alpha)
    active = torch.ones(g, 1, dtype=torch.bool, device=similarity.device)
    b1, b2 = ADAM_BETAS
    for step in range(1, max_iterations + 1):
        weights, index = _plan_columns(similarity, alpha, mass, capacity)
        grad = _token_sums(weights, index, t) - 1.0
        first = b1 * first + (1 - b1) * grad
        second = b2 * second + (1 - b2) * grad.square()
        update = (first / (1 - b1**step)) / ((second / (1 - b2**step)).sqrt() + ADAM_EPS)
        alpha = torch.where(active, alpha - learning_rate * update, alpha)
        active = active & (torch.linalg.vector_norm(grad, dim=-1, keepdim=True) > tolerance)
    return _plan_columns(similarity, alpha, mass, capacity)


def sparse_plan(
    similarity: torch.Tensor,
    capacity: int,
    max_iterations: int = 20,
    tolerance: float = 1e-3,
    learning_rate: float = 1e-2,
) -> torch.Tensor:
    """The k-sparse transport plan of :func:`sparse_plan_columns` as a dense (G, T, E) tensor."""
    g, t, e = similarity.shape
    weights, index = sparse_plan_columns(similarity, capacity, max_iterations, tolerance, learning_rate)
    return weights.new_zeros(g, e, t).scatter(-1, index, weights).transpose(1, 2)
