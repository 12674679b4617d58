"""Expert banks: every weight carries a leading expert axis and all experts run in one call.

Every bank implements :class:`Experts`, the interface the Soft MoE layer uses:

- all experts on their slots: ``experts(rows)``, rows (num_experts, rows, dim) -> (num_experts, rows, out_dim), row
  block ``rows[j]`` through expert ``j``;
- grouped rows of selected experts: ``experts.forward_selected(rows, expert)``, rows (groups, rows, dim) and
  expert (groups,) int64 -> (groups, rows, out_dim), group ``g`` through expert ``expert[g]``; experts no group
  names cost nothing, and nothing synchronizes with the host on a GPU. ``expert[g] = -1`` marks a padding group
  (inputs that keep fewer experts than others in one batch): its output is zero and it runs through no expert;

Two banks:

- :class:`MLPExperts`: the two-layer MLP of the papers, run with batched matmuls; every backend of
  :mod:`softmoe.backends` runs it.
- :class:`StackedExperts`: any user module, copied ``num_experts`` times, parameters stacked, run with
  ``torch.func.vmap`` over the stacked parameters; the "reference" backend runs it.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Protocol, TypedDict, runtime_checkable

import torch
from torch import nn

from softmoe.activations import activation_fn
from softmoe.checks import check_positive_ints
from softmoe.compat import registered, transforms_active
from softmoe.kernels.grouped_mm import GroupedProduct, grouped_mm
from softmoe.kernels.modes import host_reads_are_free, needs_grad


class FactoryKwargs(TypedDict):
    """The ``device`` and ``dtype`` keyword arguments that modules pass on to the tensors and modules they create."""

    device: torch.device | str | None
    dtype: torch.dtype | None


def check_expert_input(x: torch.Tensor, num_experts: int, dim: int) -> None:
    """Raise a ValueError unless ``x`` has shape (num_experts, rows, dim)."""
    if x.dim() != 3 or x.shape[0] != num_experts or x.shape[2] != dim:
        raise ValueError(
            f"expert input must have shape (num_experts={num_experts}, rows, dim={dim}), got {tuple(x.shape)}"
        )


def check_selected_rows(rows: torch.Tensor, expert: torch.Tensor, dim: int) -> None:
    """Raise a ValueError unless rows is (groups, rows, dim) and expert a (groups,) int64 tensor (shapes only)."""
    if rows.dim() != 3 or rows.shape[2] != dim:
        raise ValueError(f"selected rows must have shape (groups, rows, dim={dim}), got {tuple(rows.shape)}")
    if expert.dtype != torch.int64 or expert.shape != rows.shape[:1]:
        raise ValueError(
            f"expert must be an int64 tensor of shape (groups={rows.shape[0]},), "
            f"got {expert.dtype} {tuple(expert.shape)}"
        )


@runtime_checkable
class Experts(Protocol):
    """What the Soft MoE layer needs of an expert bank (see the module doc)."""

    num_experts: int
    dim: int
    out_dim: int

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (num_experts, rows, dim) -> (num_experts, rows, out_dim): all experts on their slots."""
        ...

    def forward_selected(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """rows (groups, rows, dim), expert (groups,) int64 (-1: a padding group, zero output, no compute)
        -> (groups, rows, out_dim)."""
        ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The bank's parameters: a bank is an ``nn.Module`` (the layer registers it as its child)."""
        ...


class MLPExperts(nn.Module):
    """``num_experts`` independent two-layer MLPs ``dim -> hidden -> out_dim`` with stacked weights.

    Parameters (``out_dim`` defaults to ``dim``):
        weight1: (num_experts, dim, hidden)       bias1: (num_experts, hidden)
        weight2: (num_experts, hidden, out_dim)   bias2: (num_experts, out_dim)
    Each expert is initialized like a pair of ``nn.Linear`` layers (uniform in +-1/sqrt(fan_in)); with
    ``identical_init`` every expert starts from expert 0's weights (the authors' published configs).
    """

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden: int,
        activation: str = "gelu",
        bias: bool = True,
        identical_init: bool = False,
        out_dim: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        out_dim = dim if out_dim is None else out_dim
        check_positive_ints(num_experts=num_experts, dim=dim, hidden=hidden, out_dim=out_dim)
        self.num_experts, self.dim, self.hidden, self.out_dim = num_experts, dim, hidden, out_dim
        self.activation = activation
        self.act = activation_fn(activation)
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.weight1 = nn.Parameter(torch.empty(num_experts, dim, hidden, **factory))
        self.weight2 = nn.Parameter(torch.empty(num_experts, hidden, out_dim, **factory))
        self.bias1 = nn.Parameter(torch.empty(num_experts, hidden, **factory)) if bias else None
        self.bias2 = nn.Parameter(torch.empty(num_experts, out_dim, **factory)) if bias else None
        self.identical_init = identical_init
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight1.is_meta:
            return
        experts = 1 if self.identical_init else self.num_experts
        with torch.no_grad():
            for param, fan_in in (
                (self.weight1, self.dim),
                (self.bias1, self.dim),
                (self.weight2, self.hidden),
                (self.bias2, self.hidden),
            ):
                if param is None:
                    continue
                bound = 1.0 / math.sqrt(fan_in)
                param[:experts].uniform_(-bound, bound)
                if self.identical_init:
                    param.copy_(param[:1].expand_as(param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_experts, rows, dim) -> (num_experts, rows, out_dim), in torch's batched matmuls (the backends
        that run faster products for these experts run them in their own mixing)."""
        check_expert_input(x, self.num_experts, self.dim)
        return affine(self.act(affine(x, self.weight1, self.bias1)), self.weight2, self.bias2)

    def forward_selected(
        self, rows: torch.Tensor, expert: torch.Tensor, product: GroupedProduct | None = grouped_mm
    ) -> torch.Tensor:
        """rows (groups, rows, dim), expert (groups,) int64 -> (groups, rows, out_dim).

        The groups are sorted by expert and both layers run as grouped products, ``product`` (a custom op with the
        contract of :mod:`softmoe.kernels.grouped_mm`: that op, torch's products, by default; the "cpu" backend
        passes ``softmoe::native_grouped_mm``, the "cuda" backend ``softmoe::skinny_grouped_mm`` for few rows): an
        expert no group names costs nothing; no host synchronization where torch's grouped GEMM serves.
        Padding groups (expert -1) sort last, past every expert's rows: no product reads them and the grouped
        products give them zero rows (no bias), so their output is zero and no gradient flows through them. Without
        a gradient to compute, the first product applies the activation itself (a native kernel in its registers).
        With ``product`` None (the "reference" backend: plain torch ops), and under torch.func transforms and
        forward-mode AD (the grouped products are custom ops, which have no forward-mode rule), every expert runs on
        every group in torch's batched products and each group keeps its own expert's rows: the work of every
        expert, no copy of the weights.
        """
        check_selected_rows(rows, expert, self.dim)
        groups, per_group, _ = rows.shape
        if product is None or transforms_active():
            every = self(rows.reshape(1, groups * per_group, self.dim).expand(self.num_experts, -1, -1))
            y = every.view(self.num_experts, groups, per_group, self.out_dim)[
                expert.clamp_min(0), torch.arange(groups, device=rows.device)
            ]
            return torch.where((expert >= 0).view(-1, 1, 1), y, 0.0)
        key, order = torch.sort(torch.where(expert < 0, self.num_experts, expert), stable=True)  # padding last
        experts = torch.arange(self.num_experts, device=expert.device)
        ends = torch.searchsorted(key, experts, right=True, out_int32=True) * per_group  # no host sync
        flat = rows[order].reshape(groups * per_group, self.dim)
        fused = "none" if needs_grad(flat, self.weight1, self.bias1) else self.activation
        h = product(flat, self.weight1, ends, self.bias1, fused)
        y = product(h if fused != "none" else self.act(h), self.weight2, ends, self.bias2, "none")
        y = y.view(groups, per_group, self.out_dim)
        return torch.empty_like(y).index_copy(0, order, y)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(weight1, bias1, weight2, bias2), looked up by :func:`registered` (this runs on every call)."""
        weight1, bias1 = registered(self, "weight1"), registered(self, "bias1")
        weight2, bias2 = registered(self, "weight2"), registered(self, "bias2")
        # Only the biases are optional: __init__ always sets both weights.
        assert weight1 is not None and weight2 is not None
        return weight1, bias1, weight2, bias2

    def extra_repr(self) -> str:
        out = "" if self.out_dim == self.dim else f", out_dim={self.out_dim}"
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}{out}, "
            f"activation={self.activation!r}, bias={self.bias1 is not None}"
        )


def affine(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (E, rows, K) @ weight (E, K, N) + bias (E, N) -> (E, rows, N), each expert's rows through its own weight."""
    return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, weight)


def _reinitialize(module: nn.Module) -> None:
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


class StackedExperts(nn.Module):
    """``num_experts`` copies of a user module mapping (rows, dim) -> (rows, out_dim), run with ``torch.func.vmap``.

    The copies are re-initialized independently (every submodule's ``reset_parameters``) unless
    ``identical_init``; their parameters are stacked into tensors with a leading expert axis and registered on
    this module under the template's parameter names with '.' replaced by '__'.
    """

    template: nn.Module  # set in __init__ through __dict__, outside the module tree

    def __init__(
        self, expert: nn.Module, num_experts: int, dim: int, identical_init: bool = False, out_dim: int | None = None
    ) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.num_experts, self.dim = num_experts, dim
        self.out_dim = dim if out_dim is None else out_dim
        copies = [copy.deepcopy(expert) for _ in range(num_experts)]
        if not identical_init:
            for module in copies:
                _reinitialize(module)
        params, buffers = torch.func.stack_module_state(copies)
        self._param_names = list(params)
        self._buffer_names = list(buffers)
        for name, value in params.items():
            self.register_parameter(name.replace(".", "__"), nn.Parameter(value.detach().clone()))
        for name, value in buffers.items():
            self.register_buffer(name.replace(".", "__"), value.clone())
        # Kept outside the module tree: the template only supplies the computation, never its own weights.
        self.__dict__["template"] = copy.deepcopy(expert).to("meta")

    def _stacked(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        params = {name: getattr(self, name.replace(".", "__")) for name in self._param_names}
        buffers = {name: getattr(self, name.replace(".", "__")) for name in self._buffer_names}
        return params, buffers

    def _call_one(self, params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(self.template, (params, buffers), (x,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_experts, rows, dim) -> (num_experts, rows, out_dim)."""
        check_expert_input(x, self.num_experts, self.dim)
        params, buffers = self._stacked()
        return torch.func.vmap(self._call_one)(params, buffers, x)

    def forward_selected(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """rows (groups, rows, dim), expert (groups,) int64 -> (groups, rows, out_dim).

        Each group's expert parameters are gathered (one copy per group) and the groups run under one
        ``torch.func.vmap``: no host synchronization and no recompilation for a new selection, at the memory cost of
        ``groups`` parameter copies (custom experts are usually small).
        Padding groups (expert -1) get a zero output. Where reading the selection on the host is free (CPU, outside
        torch.compile and torch.func) they are left out; elsewhere they run through expert 0 and are discarded (one
        vmap needs one shape, and leaving them out would synchronize).
        """
        check_selected_rows(rows, expert, self.dim)
        padding = expert < 0
        if host_reads_are_free(expert):
            if not bool(padding.any()):
                return self._vmap_selected(rows, expert)
            kept = (~padding).nonzero().squeeze(1)
            out = rows.new_zeros(rows.shape[0], rows.shape[1], self.out_dim)
            return out.index_copy(0, kept, self._vmap_selected(rows[kept], expert[kept]))
        mask = padding.view(-1, 1, 1)
        return torch.where(mask, 0.0, self._vmap_selected(torch.where(mask, 0.0, rows), expert.clamp_min(0)))

    def _vmap_selected(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        params, buffers = self._stacked()
        gathered = ({k: v[expert] for k, v in params.items()}, {k: v[expert] for k, v in buffers.items()})
        return torch.func.vmap(self._call_one)(*gathered, rows)

    def expert_state(self, j: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The parameters and buffers of expert ``j`` as plain dicts keyed by the template's names."""
        params, buffers = self._stacked()
        return {k: v[j] for k, v in params.items()}, {k: v[j] for k, v in buffers.items()}
