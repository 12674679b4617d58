"""Batched experts: every weight carries a leading expert axis and all experts run in one call.

Two kinds share one calling convention, ``experts(x)`` with ``x`` of shape (num_experts, rows, dim)
returning (num_experts, rows, out_dim): row block ``x[j]`` goes through expert ``j`` (``out_dim`` is ``dim`` unless
set otherwise).

- :class:`MLPExperts`: the two-layer MLP of the papers, run with batched matmuls (``torch.baddbmm``, or the native
  kernels of :mod:`softmoe.kernels` for few rows through large weights).
- :class:`StackedExperts`: any user module, copied ``num_experts`` times, parameters stacked, run with
  ``torch.func.vmap`` over the stacked parameters.

Both also run on *grouped rows* (``run_grouped``): a flat (rows, dim) tensor sorted by expert together with the
number of rows of each expert, which is how expert selection skips the experts it does not need.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from softmoe.kernels import (
    expert_matmul,
    native_applies,
    needs_grad,
    onednn_applies,
    onednn_linear,
    plain_eager_mode,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "relu": F.relu,
}


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation called ``name`` ("gelu", "gelu_tanh" or "relu")."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {name!r}")
    return ACTIVATIONS[name]


def autocast_device(x: torch.Tensor) -> str:
    """The autocast device type of x's device; "meta" (shape-only tensors) counts as "cpu"."""
    return "cpu" if x.device.type == "meta" else x.device.type


def check_expert_input(x: torch.Tensor, num_experts: int, dim: int) -> None:
    """Raise a ValueError unless ``x`` has shape (num_experts, rows, dim)."""
    if x.dim() != 3 or x.shape[0] != num_experts or x.shape[2] != dim:
        raise ValueError(
            f"expert input must have shape (num_experts={num_experts}, rows, dim={dim}), got {tuple(x.shape)}"
        )


def grouped_output(x: torch.Tensor, out_dim: int) -> torch.Tensor:
    """An uninitialized (rows, out_dim) tensor for the outputs of grouped rows x (rows, dim)."""
    return x.new_empty(x.shape[0], out_dim)


def check_groups(x: torch.Tensor, counts: torch.Tensor, num_experts: int) -> None:
    """Raise a ValueError unless ``counts`` (num_experts,) splits the rows of ``x`` (rows, dim)."""
    if counts.shape != (num_experts,):
        raise ValueError(f"counts must have shape ({num_experts},), got {tuple(counts.shape)}")
    if counts.is_floating_point() or counts.is_complex() or counts.dtype == torch.bool:
        raise ValueError(f"counts must be an integer tensor, got dtype {counts.dtype} (float counts are not row counts)")
    if bool((counts < 0).any()):
        raise ValueError(f"counts must be >= 0, got {counts.tolist()}")
    if int(counts.sum()) != x.shape[0]:
        raise ValueError(f"counts sum to {int(counts.sum())} but x has {x.shape[0]} rows")


# A large expert (dim * hidden >= LARGE_EXPERT) run alone on CPU takes faster kernels than plain matmuls: oneDNN's
# (activation fused) for inference on >= ONEDNN_MIN_ROWS float32 rows, else row blocks (see MLPExperts.run_one).
LARGE_EXPERT = 1 << 20
ONEDNN_MIN_ROWS = 4


def row_block_matmul(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    """x (rows, K) @ w (K, N) -> (rows, N), w cut into ``blocks`` contiguous blocks of K/blocks rows.

    The blocks (views of w, no copy) run as one batched matmul, which threaded BLAS spreads over its threads
    one matrix each, and their partial products are summed. Plain matmul when ``blocks`` does not divide K.
    """
    rows, k = x.shape
    if blocks == 1 or k % blocks:
        return x @ w
    return torch.bmm(x.reshape(rows, blocks, k // blocks).transpose(0, 1), w.view(blocks, k // blocks, -1)).sum(0)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (E, rows, K) @ weight (E, K, N) (+ bias (E, N)) with torch's batched matmul."""
    return torch.bmm(x, weight) if bias is None else torch.baddbmm(bias.unsqueeze(1), x, weight)


def expert_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None = None
) -> torch.Tensor:
    """activation(x (E, rows, K) @ weight (E, K, N) + bias (E, N)) -> (E, rows, N), every expert in one call.

    Few rows per expert through large weights (a ViT-S layer: 8 rows, 384 x 1536) take the native kernels of
    :mod:`softmoe.kernels`, which stream the weights about twice as fast as MKL and, in inference, apply the
    activation to the product while it is in cache; everything else runs torch's batched matmul.
    """
    if native_applies(x, weight):
        if activation is not None and not needs_grad(x, weight, bias):
            return expert_matmul(x, weight, bias, activation)
        out = expert_matmul(x, weight, bias)
    else:
        out = _linear(x, weight, bias)
    return out if activation is None else activation_fn(activation)(out)


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
        for name, value in (("num_experts", num_experts), ("dim", dim), ("hidden", hidden), ("out_dim", out_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_experts, self.dim, self.hidden, self.out_dim = num_experts, dim, hidden, out_dim
        self.activation = activation
        self.act = activation_fn(activation)
        factory = {"device": device, "dtype": dtype}
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
        """x: (num_experts, rows, dim) -> (num_experts, rows, out_dim)."""
        check_expert_input(x, self.num_experts, self.dim)
        return expert_linear(expert_linear(x, self.weight1, self.bias1, self.activation), self.weight2, self.bias2)

    def forward_through_tokens(self, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor) -> torch.Tensor:
        """The whole Soft MoE mixing C f(D^T X) computed in token space, without materializing any slot.

        x: (batch, tokens, dim); dispatch, combine: (batch, tokens, num_experts, slots) -> (batch, tokens, out_dim).
        Exact rewrite: both expert layers are linear around the activation, so
        ``slot_j @ W1_j = sum_m D[m, j] (x_m @ W1_j)`` and ``sum_j C[m, j] (a_j @ W2_j) = (C * a) @ [W2_1; ...; W2_n]``.
        It costs 4*batch*tokens*dim*num_experts*hidden FLOPs with intermediates of size batch*tokens*n*hidden, so
        it wins when many small experts would otherwise write large (batch, n*p, dim) slot tensors.
        """
        batch, tokens, dim = x.shape
        n, hidden = self.num_experts, self.hidden
        projected = (x @ self.weight1.transpose(0, 1).reshape(dim, n * hidden)).view(batch, tokens, n, hidden)
        dispatch, combine = dispatch.to(x.dtype), combine.to(x.dtype)
        if dispatch.shape[-1] == 1:  # one slot per expert: plain broadcasts beat einsum's many tiny matmuls
            h = (dispatch * projected).sum(dim=1).unsqueeze(2)
        else:
            h = torch.einsum("bmnp,bmnh->bnph", dispatch, projected)
        if self.bias1 is not None:
            h = h + self.bias1.unsqueeze(1)
        activated = self.act(h)
        if combine.shape[-1] == 1:
            mixed = combine * activated.squeeze(2).unsqueeze(1)
        else:
            mixed = torch.einsum("bmnp,bnph->bmnh", combine, activated)
        out = mixed.reshape(batch, tokens, n * hidden) @ self.weight2.reshape(n * hidden, self.out_dim)
        if self.bias2 is not None:
            out = out + combine.sum(-1) @ self.bias2
        return out

    def forward_through_slots(
        self, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, slots_per_expert: int
    ) -> torch.Tensor:
        """The whole Soft MoE mixing C f(D^T X) in the slot formulation, as one autograd node.

        x (batch, tokens, dim); dispatch, combine (batch, tokens, num_experts * slots_per_expert) of x's dtype ->
        (batch, tokens, out_dim). The same batched matmuls as the layer's dispatch, experts and combine, with the
        backward written out (:class:`_SlotMixing`): no copies between the (batch, slots) and (expert, rows)
        layouts for one slot per expert, and none of autograd's per-op bookkeeping, which for a few tokens and a
        few experts (the MNIST layer, n = 2 and 4) costs about as much as the products themselves. Only where
        :meth:`slot_function_applies`.
        """
        weights = (self.weight1, self.bias1, self.weight2, self.bias2)
        return _SlotMixing.apply(x, dispatch, combine, *weights, slots_per_expert, self.activation)

    def slot_function_applies(self, x: torch.Tensor, rows_per_expert: int) -> bool:
        """Whether :meth:`forward_through_slots` serves x: eager mode (not under torch.compile, torch.func transforms
        or autocast), and experts that run torch's batched matmuls (not the native kernels for few rows)."""
        return plain_eager_mode(autocast_device(x)) and not native_applies(x, self.weight1, rows_per_expert)

    def run_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim) sorted by expert, counts: (num_experts,) rows per expert -> (rows, out_dim).

        Experts with no rows cost nothing; each other expert runs once on its contiguous block.
        """
        check_groups(x, counts, self.num_experts)
        out = grouped_output(x, self.out_dim)
        start = 0
        for j, count in enumerate(counts.tolist()):
            if count:
                out[start : start + count] = self.run_one(x[start : start + count], j)
                start += count
        return out

    def run_one(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """x (rows, dim) through expert ``expert`` alone -> (rows, out_dim).

        Threaded CPU BLAS (MKL) runs a skinny product through one large matrix far below the machine's limits: 25
        rows through 768 x 30720 reach about 40% of the matmul peak, one row reads it at about 23 GB/s on the
        reference machine's 2 cores. So a large expert on CPU takes one of two faster kernels, chosen per call:

        - inference (no gradient needed) on at least ONEDNN_MIN_ROWS float32 rows: oneDNN's linear with bias and
          activation fused (:mod:`softmoe.kernels`), 1.5-2x MKL's FLOP rate at 8-100 rows;
        - otherwise each weight is cut into one block of rows per thread (:func:`row_block_matmul`): every thread
          streams its own contiguous part, 1.2-1.5x faster (one row: 28-35 GB/s).

        Small experts, other devices and one thread: plain matmuls.
        """
        large = x.device.type == "cpu" and self.dim * self.hidden >= LARGE_EXPERT
        bias1 = None if self.bias1 is None else self.bias1[expert]
        bias2 = None if self.bias2 is None else self.bias2[expert]
        if large and x.shape[0] >= ONEDNN_MIN_ROWS and onednn_applies(x, self.weight1):
            h = onednn_linear(x, self.weight1[expert], bias1, self.activation)
            return onednn_linear(h, self.weight2[expert], bias2)
        blocks = torch.get_num_threads() if large else 1
        h = row_block_matmul(x, self.weight1[expert], blocks)
        if bias1 is not None:
            h = h + bias1
        y = row_block_matmul(self.act(h), self.weight2[expert], blocks)
        return y if bias2 is None else y + bias2

    def extra_repr(self) -> str:
        out = "" if self.out_dim == self.dim else f", out_dim={self.out_dim}"
        return (
            f"num_experts={self.num_experts}, dim={self.dim}, hidden={self.hidden}{out}, "
            f"activation={self.activation!r}, bias={self.bias1 is not None}"
        )


def _expert_rows(slots: torch.Tensor, experts: int, slots_per_expert: int) -> torch.Tensor:
    """(batch, experts * p, dim) -> (experts, batch * p, dim): a view for p = 1, else a copy."""
    batch, _, dim = slots.shape
    if slots_per_expert == 1:
        return slots.transpose(0, 1)
    return slots.view(batch, experts, slots_per_expert, dim).transpose(0, 1).reshape(experts, -1, dim)


def _slot_rows(rows: torch.Tensor, batch: int, slots_per_expert: int) -> torch.Tensor:
    """(experts, batch * p, dim) -> (batch, experts * p, dim), the inverse of :func:`_expert_rows`."""
    experts, _, dim = rows.shape
    if slots_per_expert == 1:
        return rows.transpose(0, 1)
    view = rows.view(experts, batch, slots_per_expert, dim).transpose(0, 1)
    return view.reshape(batch, experts * slots_per_expert, dim)


def _activation_backward(grad: torch.Tensor, pre: torch.Tensor, activation: str) -> torch.Tensor:
    """The gradient of ``activation`` at ``pre``, times ``grad`` (overwritten for relu)."""
    if activation == "relu":
        return grad.mul_(pre > 0)
    approximate = "tanh" if activation == "gelu_tanh" else "none"
    return torch.ops.aten.gelu_backward(grad, pre, approximate=approximate)


def _slot_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, slots_per_expert, activation):
    """C act(rows(D^T X) W1 + b1) W2 + b2 -> (out, rows, hidden, activated, y): :class:`_SlotMixing`'s forward."""
    rows = _expert_rows(torch.bmm(dispatch.transpose(1, 2), x), weight1.shape[0], slots_per_expert)
    hidden = _linear(rows, weight1, bias1)
    activated = activation_fn(activation)(hidden)
    y = _slot_rows(_linear(activated, weight2, bias2), x.shape[0], slots_per_expert)
    return torch.bmm(combine, y), rows, hidden, activated, y


class _SlotMixing(torch.autograd.Function):
    """out = C act(rows(D^T X) W1 + b1) W2 + b2, for :meth:`MLPExperts.forward_through_slots`.

    With slots = D^T X, rows its (expert, batch * p) view, h = rows W1 + b1, a = act(h), y = a W2 + b2 and out = C y
    (y back in slot order), the backward of an upstream gradient G is: dC = G y^T, dy = C^T G, dW2 = a^T dy,
    db2 = sum dy, dh = act'(h) (dy W2^T), dW1 = rows^T dh, db1 = sum dh, dslots = dh W1^T, dX = D dslots and
    dD = X dslots^T. When the backward itself is to be differentiated (``create_graph=True``) it first recomputes
    the intermediates from the inputs under autograd, so that these formulas, and second derivatives, stay exact.
    """

    @staticmethod
    def forward(ctx, x, dispatch, combine, weight1, bias1, weight2, bias2, slots_per_expert, activation):
        inputs = (x, dispatch, combine, weight1, bias1, weight2, bias2)
        out, rows, hidden, activated, y = _slot_mixing(*inputs, slots_per_expert, activation)
        ctx.save_for_backward(*inputs, rows, hidden, activated, y)
        ctx.slots_per_expert, ctx.activation = slots_per_expert, activation
        return out

    @staticmethod
    def backward(ctx, grad):
        x, dispatch, combine, weight1, bias1, weight2, bias2, rows, hidden, activated, y = ctx.saved_tensors
        p, need = ctx.slots_per_expert, ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph: the intermediates again, now as functions of the inputs
            inputs = (x, dispatch, combine, weight1, bias1, weight2, bias2)
            _, rows, hidden, activated, y = _slot_mixing(*inputs, p, ctx.activation)
        grad_combine = torch.bmm(grad, y.transpose(1, 2)) if need[2] else None
        grad_y = _expert_rows(torch.bmm(combine.transpose(1, 2), grad), weight1.shape[0], p)
        grad_w2 = torch.bmm(activated.transpose(1, 2), grad_y) if need[5] else None
        grad_b2 = grad_y.sum(1) if need[6] else None
        grad_hidden = _activation_backward(torch.bmm(grad_y, weight2.transpose(1, 2)), hidden, ctx.activation)
        grad_w1 = torch.bmm(rows.transpose(1, 2), grad_hidden) if need[3] else None
        grad_b1 = grad_hidden.sum(1) if need[4] else None
        grad_x = grad_dispatch = None
        if need[0] or need[1]:
            grad_slots = _slot_rows(torch.bmm(grad_hidden, weight1.transpose(1, 2)), x.shape[0], p)
            grad_x = torch.bmm(dispatch, grad_slots) if need[0] else None
            grad_dispatch = torch.bmm(x, grad_slots.transpose(1, 2)) if need[1] else None
        return grad_x, grad_dispatch, grad_combine, grad_w1, grad_b1, grad_w2, grad_b2, None, None


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

    def expert_state(self, j: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The parameters and buffers of expert ``j`` as plain dicts keyed by the template's names."""
        params, buffers = self._stacked()
        return {k: v[j] for k, v in params.items()}, {k: v[j] for k, v in buffers.items()}

    def run_grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (rows, dim) sorted by expert, counts: (num_experts,) -> (rows, out_dim); empty experts are skipped."""
        check_groups(x, counts, self.num_experts)
        out = grouped_output(x, self.out_dim)
        start = 0
        for j, count in enumerate(counts.tolist()):
            if count == 0:
                continue
            rows = slice(start, start + count)
            out[rows] = self._call_one(*self.expert_state(j), x[rows])
            start += count
        return out
