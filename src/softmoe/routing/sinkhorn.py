"""Entropic optimal transport between tokens and experts (the Sinkhorn routers), in the log domain.

Solves ``max_P <P, logits> - epsilon <P, log P>`` subject to ``P 1_E = a`` (token marginals, default 1) and
``P^T 1_T = b`` (expert marginals, default T/E) with Sinkhorn's alternating normalizations on the log potentials:

    f = log a - logsumexp_e((logits + g) / eps) * eps,   g = log b - logsumexp_t((logits + f) / eps) * eps,
    P = exp((logits + f + g) / eps).

Every iteration ends with the expert update, so the expert marginals hold exactly and the token marginals
converge (to about 1e-4 within a few dozen iterations for logits of moderate size).
"""

from __future__ import annotations

import math

import torch


def sinkhorn_potentials(
    logits: torch.Tensor,
    iterations: int = 20,
    epsilon: float = 1.0,
    token_marginal: float = 1.0,
    expert_marginal: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log potentials (f (..., T), g (..., E)) of the entropic plan for logits (..., T, E), computed in float32+."""
    if iterations < 1 or epsilon <= 0:
        raise ValueError(f"iterations must be >= 1 and epsilon > 0, got {iterations}, {epsilon}")
    t, e = logits.shape[-2:]
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / epsilon
    log_a = math.log(token_marginal)
    log_b: float | torch.Tensor
    if expert_marginal is not None:
        log_b = math.log(expert_marginal)
    elif torch.compiler.is_compiling():
        # Under torch.compile with dynamic shapes T is a SymInt, and math.log of it would specialize the graph to one
        # batch size: log(T * token_marginal / E) is taken on a float64 0-dim tensor instead (the same float64
        # product and quotient; torch's log may differ from math.log in the last bit of the float64, which float32
        # scores never see).
        log_b = torch.full((), t, dtype=torch.float64, device=scores.device).mul(token_marginal).div(e).log()
    else:
        log_b = math.log(t * token_marginal / e)
    g = scores.new_zeros(*scores.shape[:-2], e)
    f = scores.new_zeros(*scores.shape[:-2], t)
    for _ in range(iterations):
        f = log_a - torch.logsumexp(scores + g.unsqueeze(-2), dim=-1)
        g = log_b - torch.logsumexp(scores + f.unsqueeze(-1), dim=-2)
    return f, g


def sinkhorn_plan(
    logits: torch.Tensor,
    iterations: int = 20,
    epsilon: float = 1.0,
    token_marginal: float = 1.0,
    expert_marginal: float | None = None,
) -> torch.Tensor:
    """The entropic transport plan (..., T, E) for the utility ``logits`` (cost = -logits); see the module doc."""
    f, g = sinkhorn_potentials(logits, iterations, epsilon, token_marginal, expert_marginal)
    scores = logits.to(f.dtype) / epsilon
    return torch.exp(scores + f.unsqueeze(-1) + g.unsqueeze(-2))
