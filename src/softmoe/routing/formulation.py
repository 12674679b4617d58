"""The unified MoE formulation of the router study (equation 2) and the routing tensors routers return.

For one group of T tokens X (T, d), a router returns a dispatch tensor D and a combine tensor C, both (T, E, C_buf),
and the MoE layer computes

    MoE(X)[t] = sum_{r, c} C[t, r, c] * MLP_r(X^T D[:, r, c])                                   (eq. 2)

(the experts may map d to any output width d_out).

Two representations of the routing tensors, one per kind of router:

- :class:`SparseRouting` (Token Choice, Expert Choice, Sinkhorn, sparsity-constrained): D is binary with at most one
  token per (expert, slot), so it is stored in *index form*: for each (group, expert, slot) the index of the token it
  holds (-1 for an empty slot) and that token's combine weight. No one-hot (T, E, C) tensor is ever built on the
  forward path; :meth:`SparseRouting.to_dense` builds one for tests and inspection.
- :class:`DenseRouting` (Soft MoE): D and C are dense (groups, T, E, C) tensors.

:func:`dense_moe` is equation (2) written literally on dense tensors (the reference); :func:`sparse_moe` is the
index-based gather / scatter-add path used for sparse routers. Both run the experts once, batched over experts, on
(E, groups * C, d) buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class SparseRouting:
    """Routing of sparse routers in index form, for G groups of T tokens, E experts and buffer capacity C.

    Attributes:
        token_index: (G, E, C) int64, the token (0..T-1 within its group) in each buffer slot, -1 for an empty slot.
        combine: (G, E, C) float, the combine weight of that token for that expert (0 for an empty slot).
        num_tokens: T (a ``torch.SymInt`` when traced by ``torch.compile`` with dynamic shapes).
        auxiliary_losses: unweighted auxiliary losses of this call (e.g. "importance", "load"), scalar tensors
            averaged over the groups.
        auxiliary_weights: the weight of each auxiliary loss in the total the layer reports.
    """

    token_index: torch.Tensor
    combine: torch.Tensor
    num_tokens: int
    auxiliary_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    auxiliary_weights: dict[str, float] = field(default_factory=dict)

    @property
    def groups(self) -> int:
        return self.token_index.shape[0]

    @property
    def num_experts(self) -> int:
        return self.token_index.shape[1]

    @property
    def capacity(self) -> int:
        return self.token_index.shape[2]

    def filled(self) -> torch.Tensor:
        """(G, E, C) bool: which slots hold a token."""
        return self.token_index >= 0

    def experts_per_token(self) -> torch.Tensor:
        """(G, T) int64: how many buffer slots (experts) each token occupies; 0 means the token is dropped."""
        g, t = self.groups, self.num_tokens
        flat = _flat_slot_targets(self.token_index, t).reshape(-1)
        # A scatter-add of ones into G*T + 1 counters: bincount's output size would depend on the data (a graph
        # break under torch.compile); integer additions are exact in any order.
        counts = flat.new_zeros(g * t + 1).scatter_add_(0, flat, torch.ones_like(flat))
        return counts[: g * t].view(g, t)

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense (G, T, E, C) dispatch (0/1, float) and combine tensors; differentiable in ``combine``."""
        g, e, c = self.token_index.shape
        t = self.num_tokens
        target = torch.where(self.token_index >= 0, self.token_index, t).unsqueeze(-1)  # (G, E, C, 1)
        zeros = self.combine.new_zeros(g, e, c, t + 1)
        dispatch = zeros.scatter(-1, target, 1.0)[..., :t].permute(0, 3, 1, 2)
        combine = zeros.scatter(-1, target, self.combine.unsqueeze(-1))[..., :t].permute(0, 3, 1, 2)
        return dispatch, combine

    def validate(self) -> None:
        """Raise a ValueError unless the routing is well formed (indices in range, no token twice in one expert,
        zero combine weight in empty slots)."""
        g, e, c = self.token_index.shape
        if self.token_index.dtype != torch.int64 or self.combine.shape != (g, e, c):
            raise ValueError(
                f"token_index must be int64 (G, E, C) and combine the same shape, got "
                f"{self.token_index.dtype} {tuple(self.token_index.shape)} / {tuple(self.combine.shape)}"
            )
        if bool(((self.token_index < -1) | (self.token_index >= self.num_tokens)).any()):
            raise ValueError(f"token indices must lie in [-1, {self.num_tokens})")
        if bool((self.combine[self.token_index < 0] != 0).any()):
            raise ValueError("empty slots must have a zero combine weight")
        used = self.token_index.sort(dim=-1).values
        repeated = (used.diff(dim=-1) == 0) & (used[..., 1:] >= 0)
        if bool(repeated.any()):
            raise ValueError("a token occupies two slots of the same expert")


@dataclass
class DenseRouting:
    """Dense routing tensors (Soft MoE): dispatch and combine (G, T, E, C), float.

    ``metrics``: monitoring values of this call (detached 0-dim tensors, e.g. Soft MoE's
    :func:`~softmoe.routing.soft.soft_moe_metrics`), empty unless the router was asked for them.
    """

    dispatch: torch.Tensor
    combine: torch.Tensor
    auxiliary_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    auxiliary_weights: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def groups(self) -> int:
        return self.dispatch.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.dispatch.shape[1]

    @property
    def num_experts(self) -> int:
        return self.dispatch.shape[2]

    @property
    def capacity(self) -> int:
        return self.dispatch.shape[3]

    def to_dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.dispatch, self.combine


def _flat_slot_targets(token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(G, E, C) token indices -> row indices into the flattened (G*T + 1) token rows; empty slots -> the last row."""
    g = token_index.shape[0]
    offset = torch.arange(g, device=token_index.device).view(g, 1, 1) * num_tokens
    return torch.where(token_index >= 0, token_index + offset, g * num_tokens)


def run_experts_on_buffers(experts: nn.Module, buffers: torch.Tensor) -> torch.Tensor:
    """buffers (G, E, C, d) -> expert outputs (G, E, C, d_out), d_out the experts' output width; expert r runs once
    on its G*C rows (batched over E)."""
    g, e, c, d = buffers.shape
    out = experts(buffers.transpose(0, 1).reshape(e, g * c, d))
    return out.view(e, g, c, out.shape[-1]).transpose(0, 1)


def dense_moe(x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, experts: nn.Module) -> torch.Tensor:
    """Equation (2) on dense routing tensors: x (G, T, d), dispatch / combine (G, T, E, C) -> (G, T, d_out).

    The buffer of (expert r, slot c) is ``X^T D[:, r, c]``; the output of token t is
    ``sum_{r,c} C[t, r, c] * MLP_r(buffer[r, c])``.
    """
    buffers = torch.einsum("gtec,gtd->gecd", dispatch.to(x.dtype), x)
    out = run_experts_on_buffers(experts, buffers)
    return torch.einsum("gtec,gecd->gtd", combine.to(out.dtype), out)


def sparse_moe(x: torch.Tensor, routing: SparseRouting, experts: nn.Module) -> torch.Tensor:
    """Equation (2) for index-form routing: gather the selected tokens, run the experts, scatter-add back.

    x: (G, T, d) -> (G, T, d_out), d_out the experts' output width. Each expert runs on G*C rows (empty slots hold
    zeros and carry weight 0); a token in no slot (dropped) gets exactly zero output.
    """
    g, t, d = x.shape
    if routing.num_tokens != t or routing.groups != g:
        raise ValueError(
            f"routing is for {routing.groups} groups of {routing.num_tokens} tokens, x is {tuple(x.shape)}"
        )
    rows = torch.cat([x.reshape(g * t, d), x.new_zeros(1, d)])
    target = _flat_slot_targets(routing.token_index, t)  # (G, E, C)
    out = run_experts_on_buffers(experts, rows[target])  # (G, E, C, d_out)
    d_out = out.shape[-1]
    weighted = out * routing.combine.to(out.dtype).unsqueeze(-1)
    result = out.new_zeros(g * t + 1, d_out).index_add(0, target.reshape(-1), weighted.reshape(-1, d_out))
    return result[: g * t].view(g, t, d_out)


def check_affinity(affinity: torch.Tensor) -> None:
    if affinity.dim() != 3:
        raise ValueError(f"affinity must have shape (groups, tokens, experts), got {tuple(affinity.shape)}")


class Router(nn.Module):
    """A router maps groups of tokens (G, T, d) to :class:`SparseRouting` or :class:`DenseRouting`.

    Attributes every router sets: ``num_experts``; ``per_image`` (True when a group must be the tokens of one
    image, as for Soft MoE; False when the layer may group several images, as for the sparse routers).
    """

    num_experts: int
    per_image: bool = False

    def forward(self, x: torch.Tensor) -> SparseRouting | DenseRouting:  # pragma: no cover - interface
        raise NotImplementedError
