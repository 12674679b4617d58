"""The backends in plain torch ops: "reference" (Definition 1 as written), and the slot and token formulations of
MLP experts, "slots" and "tokens" (see :mod:`softmoe.backends`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from softmoe.activations import activation_fn
from softmoe.backends.base import Backend, autocast_on
from softmoe.compat import transforms_active
from softmoe.experts import MLPExperts, affine
from softmoe.kernels.modes import needs_grad
from softmoe.tuning import value

if TYPE_CHECKING:
    from softmoe.layer import SoftMoE


class ReferenceBackend(Backend):
    """Plain torch ops for every step: the base class's generic steps; Algorithm 1 as the dense plan unless
    the plan "selected" is asked for (the experts' own ``forward_selected``, MLP experts' every expert on every
    group in batched matmuls)."""

    name = "reference"

    def plan(self, layer, x, dispatch, combine, selected, renormalize, top_k=False) -> str:
        return "dense"

    def selected_product(self, layer, x, selected):
        return None  # plain torch ops: every expert on every group

    def steps(self, layer, x):
        select = "the selector on the combine weights; plan auto: the dense plan; the selected plan in torch ops"
        return {**super().steps(layer, x), "select": select}


class MLPBackend(Backend):
    """A backend for :class:`~softmoe.experts.MLPExperts` outside torch.func transforms and autocast."""

    def unsupported(self, layer: SoftMoE, x: torch.Tensor) -> str | None:
        experts = layer.experts
        if not isinstance(experts, MLPExperts):
            return f"it runs MLPExperts, not {type(experts).__name__} (use 'reference')"
        if transforms_active():
            return "a torch.func transform or forward-mode AD is active (use 'reference')"
        return None


class SlotsBackend(MLPBackend):
    """slots = D^T X, every expert on its slots in batched matmuls, C Y~: one autograd node with its backward
    written out (:class:`SlotMixing`), which autocast does not see into.

    ``matmul`` runs the batched products (a (E, M, K) @ b (E, K, N) + bias (E, N)), ``gradient_buffer`` gives the
    block a weight gradient is written into ((shape, like) -> an uninitialized tensor; None: torch's own): torch's
    here, the "cpu" backend's its own (:class:`~softmoe.backends.cpu.CpuBackend`)."""

    name = "slots"
    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = staticmethod(affine)
    gradient_buffer: Callable[[tuple[int, ...], torch.Tensor], torch.Tensor] | None = None

    def unsupported(self, layer, x):
        why = super().unsupported(layer, x)
        if why is None and autocast_on(x):
            return "autocast is on (use 'reference')"
        return why

    def mix(self, layer, x, dispatch, combine, kept=False):
        experts = layer.experts
        dispatch, combine = dispatch.to(x.dtype), combine.to(x.dtype)
        weights = experts.weights()
        p, activation = layer.slots_per_expert, experts.activation
        if needs_grad(x, dispatch, combine, *weights):
            return SlotMixing.apply(x, dispatch, combine, *weights, p, activation, self.matmul, self.gradient_buffer)
        # no gradient to record: the formulas without the autograd Function (its apply costs host time, by which
        # eager CUDA calls are bound)
        return slot_mixing(x, dispatch, combine, *weights, p, activation, self.matmul)[0]

    def mixing(self, layer, x):
        return "slots"

    def steps(self, layer, x):
        return {**super().steps(layer, x), "mix": "the slot formulation in batched matmuls"}


class TokensBackend(MLPBackend):
    """The exact token-space rewrite of the MLP experts (:func:`token_space_mixing`): no slot tensor is written."""

    name = "tokens"

    def mix(self, layer, x, dispatch, combine, kept=False):
        shape = (*x.shape[:2], layer.num_experts, layer.slots_per_expert)
        return token_space_mixing(layer.experts, x, dispatch.view(shape), combine.view(shape))

    def mixing(self, layer, x):
        return "tokens"

    def steps(self, layer, x):
        return {**super().steps(layer, x), "mix": "the token-space rewrite of the MLP experts"}


def token_space_is_cheaper(experts: MLPExperts, tokens: int, slots_per_expert: int) -> bool:
    """The cost model between the slot and token formulations, per input.

    cost = FLOPs + bytes moved through memory for the large intermediates, in FLOPs (softmoe.tuning.TABLE's
    "mixing_flops_per_byte"): the slot formulation writes and reads (n*p, dim) tensors about six times; the
    token-space one handles (tokens, n*hidden) tensors about four times but spends tokens/p times the expert FLOPs.
    """
    n, p, d, h = experts.num_experts, slots_per_expert, experts.dim, experts.hidden
    per_byte = value("mixing_flops_per_byte")
    slot_cost = 2 * n * p * d * (2 * tokens + 2 * h) + per_byte * 4 * n * p * d * 6
    token_cost = 4 * tokens * d * n * h + 4 * tokens * n * p * h + per_byte * 4 * tokens * n * h * 4
    return token_cost < slot_cost


def token_space_mixing(
    experts: MLPExperts, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor
) -> torch.Tensor:
    """The whole Soft MoE mixing C f(D^T X) computed in token space, without materializing any slot.

    x: (batch, tokens, dim); dispatch, combine: (batch, tokens, num_experts, slots) -> (batch, tokens, out_dim).
    Exact rewrite: both expert layers are linear around the activation, so
    ``slot_j @ W1_j = sum_m D[m, j] (x_m @ W1_j)`` and ``sum_j C[m, j] (a_j @ W2_j) = (C * a) @ [W2_1; ...; W2_n]``.
    It costs 4*batch*tokens*dim*num_experts*hidden FLOPs with intermediates of size batch*tokens*n*hidden, so
    it wins when many small experts would otherwise write large (batch, n*p, dim) slot tensors.
    """
    batch, tokens, dim = x.shape
    n, hidden = experts.num_experts, experts.hidden
    projected = (x @ experts.weight1.transpose(0, 1).reshape(dim, n * hidden)).view(batch, tokens, n, hidden)
    dispatch, combine = dispatch.to(x.dtype), combine.to(x.dtype)
    if dispatch.shape[-1] == 1:  # one slot per expert: plain broadcasts beat einsum's many tiny matmuls
        h = (dispatch * projected).sum(dim=1).unsqueeze(2)
    else:
        h = torch.einsum("bmnp,bmnh->bnph", dispatch, projected)
    if experts.bias1 is not None:
        h = h + experts.bias1.unsqueeze(1)
    activated = experts.act(h)
    if combine.shape[-1] == 1:
        mixed = combine * activated.squeeze(2).unsqueeze(1)
    else:
        mixed = torch.einsum("bmnp,bnph->bmnh", combine, activated)
    out = mixed.reshape(batch, tokens, n * hidden) @ experts.weight2.reshape(n * hidden, experts.out_dim)
    if experts.bias2 is not None:
        out = out + combine.sum(-1) @ experts.bias2
    return out


def expert_rows(slots: torch.Tensor, experts: int, slots_per_expert: int) -> torch.Tensor:
    """(batch, experts * p, dim) -> (experts, batch * p, dim): a view for p = 1, else a copy."""
    batch, _, dim = slots.shape
    if slots_per_expert == 1:
        return slots.transpose(0, 1)
    return slots.view(batch, experts, slots_per_expert, dim).transpose(0, 1).reshape(experts, -1, dim)


def slot_rows(rows: torch.Tensor, batch: int, slots_per_expert: int) -> torch.Tensor:
    """(experts, batch * p, dim) -> (batch, experts * p, dim), the inverse of :func:`expert_rows`."""
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


def slot_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, slots_per_expert, activation, matmul):
    """C act(rows(D^T X) W1 + b1) W2 + b2 -> (out, rows, hidden, activated, y): :class:`SlotMixing`'s forward, its
    batched products by ``matmul`` (:class:`SlotsBackend`)."""
    rows = expert_rows(torch.bmm(dispatch.transpose(1, 2), x), weight1.shape[0], slots_per_expert)
    hidden = matmul(rows, weight1, bias1)
    activated = activation_fn(activation)(hidden)
    y = slot_rows(matmul(activated, weight2, bias2), x.shape[0], slots_per_expert)
    return matmul(combine, y, None), rows, hidden, activated, y


class SlotMixing(torch.autograd.Function):
    """out = C act(rows(D^T X) W1 + b1) W2 + b2, the "slots" backend's mixing.

    With slots = D^T X, rows its (expert, batch * p) view, h = rows W1 + b1, a = act(h), y = a W2 + b2 and out = C y
    (y back in slot order), the backward of an upstream gradient G is: dC = G y^T, dy = C^T G, dW2 = a^T dy,
    db2 = sum dy, dh = act'(h) (dy W2^T), dW1 = rows^T dh, db1 = sum dh, dslots = dh W1^T, dX = D dslots and
    dD = X dslots^T. When the backward itself is to be differentiated (``create_graph=True``) it first recomputes
    the intermediates from the inputs under autograd, so that these formulas, and second derivatives, stay exact.
    ``matmul`` and ``gradient_buffer`` as :class:`SlotsBackend`'s.
    """

    @staticmethod
    def forward(
        ctx, x, dispatch, combine, weight1, bias1, weight2, bias2, slots_per_expert, activation, matmul, gradient_buffer
    ):
        inputs = (x, dispatch, combine, weight1, bias1, weight2, bias2)
        out, rows, hidden, activated, y = slot_mixing(*inputs, slots_per_expert, activation, matmul)
        ctx.save_for_backward(*inputs, rows, hidden, activated, y)
        ctx.slots_per_expert, ctx.activation = slots_per_expert, activation
        ctx.matmul, ctx.gradient_buffer = matmul, gradient_buffer
        return out

    @staticmethod
    def backward(ctx, grad):
        x, dispatch, combine, weight1, bias1, weight2, bias2, rows, hidden, activated, y = ctx.saved_tensors
        p, need, matmul, buffer = ctx.slots_per_expert, ctx.needs_input_grad, ctx.matmul, ctx.gradient_buffer
        # out.sum().backward() hands over an expanded (stride-0) gradient, which sent both products below through
        # torch's slow strided path; one copy instead
        grad = grad.contiguous()
        if torch.is_grad_enabled():  # create_graph: the intermediates again, now as functions of the inputs
            inputs = (x, dispatch, combine, weight1, bias1, weight2, bias2)
            _, rows, hidden, activated, y = slot_mixing(*inputs, p, ctx.activation, matmul)
        grad_combine = torch.bmm(grad, y.transpose(1, 2)) if need[2] else None
        grad_y = expert_rows(torch.bmm(combine.transpose(1, 2), grad), weight1.shape[0], p)
        grad_w2 = _weight_gradient(activated, grad_y, buffer) if need[5] else None
        grad_b2 = grad_y.sum(1) if need[6] else None
        grad_hidden = _activation_backward(matmul(grad_y, weight2.transpose(1, 2), None), hidden, ctx.activation)
        grad_w1 = _weight_gradient(rows, grad_hidden, buffer) if need[3] else None
        grad_b1 = grad_hidden.sum(1) if need[4] else None
        grad_x = grad_dispatch = None
        if need[0] or need[1]:
            grad_slots = slot_rows(matmul(grad_hidden, weight1.transpose(1, 2), None), x.shape[0], p)
            grad_x = torch.bmm(dispatch, grad_slots) if need[0] else None
            grad_dispatch = torch.bmm(x, grad_slots.transpose(1, 2)) if need[1] else None
        return grad_x, grad_dispatch, grad_combine, grad_w1, grad_b1, grad_w2, grad_b2, None, None, None, None


def _weight_gradient(inputs: torch.Tensor, grad: torch.Tensor, buffer) -> torch.Tensor:
    """Each expert's weight gradient inputs^T @ grad: (n, rows, K), (n, rows, N) -> (n, K, N). Without a graph to
    record and with a ``buffer`` (:class:`SlotsBackend`'s ``gradient_buffer``) it goes into the block that gives:
    the "cpu" backend's is reused from step to step (a ViT-S layer's gradients are 302 MB each, fresh pages at every
    step in a default process)."""
    if torch.is_grad_enabled() or buffer is None:  # create_graph: torch.bmm's out= records no graph
        return torch.bmm(inputs.transpose(1, 2), grad)
    shape = (inputs.shape[0], inputs.shape[2], grad.shape[2])
    return torch.bmm(inputs.transpose(1, 2), grad, out=buffer(shape, grad))
