"""One MoE layer for every router: groups the tokens, routes them, runs the batched experts, combines (eq. 2).

Groups: a router with ``per_image`` (Soft MoE) routes the T tokens of each image separately; the sparse routers route
a group of ``group_size`` images together (T = group_size * tokens per image), by default all the images of the
batch, as in the router study. When the batch is not a multiple of ``group_size`` the remaining images form one
smaller group (with its own, smaller capacity).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from softmoe.checks import check_tokens
from softmoe.experts import MLPExperts
from softmoe.layer import SoftMoE
from softmoe.routing.formulation import (
    DenseRouting,
    Router,
    SparseRouting,
    dense_moe,
    sparse_moe,
)


class MoELayer(nn.Module):
    """A router plus ``MLPExperts``: (batch, tokens, dim) -> (batch, tokens, out_dim); dropped tokens get zero output.

    Args:
        dim: token size d.
        router: any :class:`~softmoe.routing.formulation.Router` (its ``num_experts`` sets E).
        expert_hidden: hidden size of each expert (default 4 * dim).
        activation, expert_bias, identical_expert_init: as for :class:`softmoe.SoftMoE`.
        group_size: images per routing group for the sparse routers (None: the whole batch). Ignored by per-image
            routers.
        experts: an optional module with the ``MLPExperts`` calling convention (E, rows, d) -> (E, rows, out_dim).
        out_dim: the experts' output size (default dim); eq. (2) combines expert outputs of any size.

    After every forward: ``auxiliary_loss`` is the weighted sum of the router's auxiliary losses (a scalar tensor,
    0 for routers without any), ``auxiliary_losses`` the unweighted losses, ``last_stats`` the routing statistics of
    the sparse routers as detached float64 0-dim tensors on x's device ("dropped": fraction of tokens in no buffer
    slot, "fill": fraction of buffer slots holding a token; empty for Soft MoE) and ``last_metrics`` the router's
    monitoring metrics (detached 0-dim tensors, e.g. a ``SoftMoERouter`` built with ``metrics=True``; empty for
    routers without any). Neither is converted to Python numbers here: the forward never synchronizes with the
    device (and compiles into one graph under ``torch.compile(fullgraph=True)``); a caller that logs them calls
    ``float()`` when it records them.
    """

    def __init__(
        self,
        dim: int,
        router: Router,
        expert_hidden: int | None = None,
        activation: str = "gelu",
        expert_bias: bool = True,
        identical_expert_init: bool = False,
        group_size: int | None = None,
        experts: nn.Module | None = None,
        out_dim: int | None = None,
    ) -> None:
        super().__init__()
        if group_size is not None and (
            isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1
        ):
            raise ValueError(f"group_size must be None or an integer >= 1, got {group_size!r}")
        self.dim, self.router, self.group_size = dim, router, group_size
        self.out_dim = dim if out_dim is None else out_dim
        self.num_experts = router.num_experts
        if experts is None:
            hidden = 4 * dim if expert_hidden is None else expert_hidden
            experts = MLPExperts(
                router.num_experts, dim, hidden, activation, expert_bias, identical_expert_init, out_dim=self.out_dim
            )
        self.experts = experts
        self.auxiliary_loss: torch.Tensor = torch.zeros(())
        self.auxiliary_losses: dict[str, torch.Tensor] = {}
        self.last_stats: dict[str, torch.Tensor] = {}
        self.last_metrics: dict[str, torch.Tensor] = {}

    @classmethod
    def from_soft_moe(cls, layer: SoftMoE) -> MoELayer:
        """The ``SoftMoE`` layer expressed in the unified formulation, with copies of its parameters."""
        from softmoe.routing.soft import SoftMoERouter

        if not isinstance(layer.experts, MLPExperts):
            raise ValueError("from_soft_moe needs a layer with the default MLP experts")
        src = layer.experts
        router = SoftMoERouter.from_layer(layer)
        moe = cls(layer.dim, router, src.hidden, src.activation, src.bias1 is not None, out_dim=src.out_dim)
        moe.experts.to(device=layer.phi.device, dtype=layer.phi.dtype).load_state_dict(src.state_dict())
        return moe

    def _groups(self, x: torch.Tensor) -> list[torch.Tensor]:
        batch, tokens, d = x.shape
        if self.router.per_image:
            return [x]
        size = batch if self.group_size is None else min(self.group_size, batch)
        full = batch // size
        parts = [x[: full * size].reshape(full, size * tokens, d)]
        if batch > full * size:
            parts.append(x[full * size :].reshape(1, (batch - full * size) * tokens, d))
        return parts

    def route(self, x: torch.Tensor) -> list[SparseRouting | DenseRouting]:
        """The routing of each group part of x (batch, tokens, dim) (one part, or two with a remainder group)."""
        check_tokens(x, self.dim)
        return [self.router(part) for part in self._groups(x)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_tokens(x, self.dim)
        batch, tokens, _ = x.shape
        outputs, weights, counts, metrics = [], {}, [], {}
        losses: dict[str, list[torch.Tensor]] = {}  # each auxiliary loss of every group
        dropped, fill, slots = [], [], 0  # int64 0-dim tensors (counted on the device: no host synchronization)
        for part in self._groups(x):
            routing = self.router(part)
            if isinstance(routing, SparseRouting):
                outputs.append(sparse_moe(part, routing, self.experts))
                with torch.no_grad():
                    dropped.append((routing.experts_per_token() == 0).sum())
                    fill.append(routing.filled().sum())
                    slots = slots + routing.token_index.numel()
            else:
                outputs.append(dense_moe(part, routing.dispatch, routing.combine, self.experts))
                metrics.update(routing.metrics)  # per-image routers route the batch as one part
            counts.append(part.shape[0])
            for name, value in routing.auxiliary_losses.items():
                losses.setdefault(name, []).append(value)
            weights.update(routing.auxiliary_weights)
        # Each group counts once in the average of the per-group losses. (A sum of tensors: every name has a loss of
        # at least one group, so sum's start, 0, is never its result.)
        self.auxiliary_losses = {
            name: cast(torch.Tensor, sum(v * c for v, c in zip(values, counts)) / sum(counts))
            for name, values in losses.items()
        }
        total = sum((weights.get(name, 0.0) * value for name, value in self.auxiliary_losses.items()), x.new_zeros(()))
        self.auxiliary_loss = total
        self.last_stats = self._stats(dropped, fill, batch * tokens, slots) if dropped else {}
        self.last_metrics = metrics
        width = outputs[0].shape[-1]
        if width != self.out_dim:
            raise ValueError(f"the experts return {width} features per token, expected out_dim = {self.out_dim}")
        return torch.cat([out.reshape(-1, tokens, width) for out in outputs])

    @staticmethod
    @torch.no_grad()
    def _stats(
        dropped: list[torch.Tensor], fill: list[torch.Tensor], tokens: int, slots: int
    ) -> dict[str, torch.Tensor]:
        """The statistics of the sparse routers as detached float64 0-dim tensors: the integer counts of every group
        summed, then divided by the number of tokens (slots) as Python floats would (one IEEE division)."""
        return {
            "dropped": (sum(dropped[1:], dropped[0]).to(torch.float64) / tokens).detach(),
            "fill": (sum(fill[1:], fill[0]).to(torch.float64) / slots).detach(),
        }

    def extra_repr(self) -> str:
        out = "" if self.out_dim == self.dim else f", out_dim={self.out_dim}"
        return f"dim={self.dim}, num_experts={self.num_experts}, group_size={self.group_size}{out}"
