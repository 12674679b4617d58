"""Expert banks: every weight carries a leading expert axis and all experts run in one call.

Every bank implements :class:`Experts`, the interface the Soft MoE layer uses:

- all experts on their slots: ``experts(rows)``, rows (num_experts, rows, dim) -> (num_experts, rows, out_dim), row
  block ``rows[j]`` through expert ``j``;
- grouped rows of selected experts: ``experts.forward_selected(rows, expert)``, rows (groups, rows, dim) and
  expert (groups,) int64 -> (groups, rows, out_dim), group ``g`` through expert ``expert[g]``; experts no group
  names cost nothing, and nothing synchronizes with the host on a GPU. ``expert[g] = -1`` marks a padding group
  (inputs that keep fewer experts than others in one batch): its output is zero and it runs through no expert;
- the mixing backends it offers (:mod:`softmoe.backends`): ``choose_backend`` and ``mix``.

Two banks:

- :class:`MLPExperts`: the two-layer MLP of the papers, run with batched matmuls; it offers every backend.
- :class:`StackedExperts`: any user module, copied ``num_experts`` times, parameters stacked, run with
  ``torch.func.vmap`` over the stacked parameters; it offers the "reference" backend.
"""

from __future__ import annotations

import copy
import math
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from softmoe.activations import activation_fn
from softmoe.backends import BackendChoice, ReferenceOnly, autocast_on, transforms_active, unsupported
from softmoe.kernels.expert_matmul import reusable_empty
from softmoe.kernels.grouped_mm import grouped_mm
from softmoe.kernels.modes import direct_call_ok, host_reads_are_free
from softmoe.kernels import (
    NATIVE_FORWARD_MAX_ROWS,
    NATIVE_MAX_ROWS,
    batched_matmul,
    expert_matmul,
    native_applies,
    native_available,
    native_mixing_applies,
    native_status,
    needs_grad,
    soft_moe_mixing,
)

# CPU machine balance of the cost model choosing between the "slots" and "tokens" backends: one byte of memory
# traffic costs about as much as 8 FLOPs (measured on CPU; the model is not used on other devices).
CPU_BYTES_TO_FLOPS = 8


def autocast_device(x: torch.Tensor) -> str:
    """The autocast device type of x's device; "meta" (shape-only tensors) counts as "cpu"."""
    return "cpu" if x.device.type == "meta" else x.device.type


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
            f"expert must be an int64 tensor of shape (groups={rows.shape[0]},), got {expert.dtype} {tuple(expert.shape)}"
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

    def choose_backend(self, backend: str, x: torch.Tensor, slots_per_expert: int) -> BackendChoice:
        """The backend that runs the mixing of tokens x (batch, tokens, dim) when the layer asks for ``backend``;
        a ValueError when an explicitly requested one cannot."""
        ...

    def mix(
        self, backend: str, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, slots_per_expert: int,
        kept_combine: bool = False,
    ) -> torch.Tensor:
        """C f(D^T X) with a backend other than "reference": x (batch, tokens, dim), dispatch and combine
        (batch, tokens, n * p) -> (batch, tokens, out_dim). ``kept_combine``: combine is zero outside the slots of
        the experts each input keeps (Algorithm 1's dense plan), which a backend may use to skip work."""
        ...


def token_counts(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of ``expert`` (int64; -1 entries are not counted) name each expert -> (num_experts,) int64,
    without a host sync (unlike ``torch.bincount``, whose output size depends on the data)."""
    flat = expert.reshape(-1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=expert.device)
    return counts.index_add_(0, torch.where(flat < 0, num_experts, flat), torch.ones_like(flat))[:num_experts]


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
        """x: (num_experts, rows, dim) -> (num_experts, rows, out_dim), in batched matmuls (torch's, or oneDNN's
        where :func:`softmoe.kernels.batched_matmul` finds them faster)."""
        check_expert_input(x, self.num_experts, self.dim)
        return batched_matmul(self.act(batched_matmul(x, self.weight1, self.bias1)), self.weight2, self.bias2)

    def forward_selected(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """rows (groups, rows, dim), expert (groups,) int64 -> (groups, rows, out_dim).

        The groups are sorted by expert and both layers run as grouped products (:mod:`softmoe.kernels.grouped_mm`):
        an expert no group names costs nothing; no host synchronization where torch's grouped GEMM serves.
        Padding groups (expert -1) sort last, past every expert's rows: no product reads them and the grouped
        products give them zero rows (no bias), so their output is zero and no gradient flows through them. Without
        a gradient to compute, the first product applies the activation itself (in the native kernel's registers).
        Under torch.func transforms and forward-mode AD (the grouped products are custom ops, which have no
        forward-mode rule) every expert runs on every group in torch's batched products and each group keeps its
        own expert's rows: the work of every expert, no copy of the weights.
        """
        check_selected_rows(rows, expert, self.dim)
        groups, per_group, _ = rows.shape
        if transforms_active():
            every = self(rows.reshape(1, groups * per_group, self.dim).expand(self.num_experts, -1, -1))
            y = every.view(self.num_experts, groups, per_group, self.out_dim)[expert.clamp_min(0), torch.arange(
                groups, device=rows.device)]
            return torch.where((expert >= 0).view(-1, 1, 1), y, 0.0)
        key = torch.where(expert < 0, self.num_experts, expert)  # padding sorts last
        order = torch.argsort(key, stable=True)
        ends = (token_counts(expert, self.num_experts).cumsum(0) * per_group).to(torch.int32)
        flat = rows[order].reshape(groups * per_group, self.dim)
        fused = "none" if needs_grad(flat, self.weight1, self.bias1) else self.activation
        h = grouped_mm(flat, self.weight1, ends, self.bias1, fused)
        y = grouped_mm(h if fused != "none" else self.act(h), self.weight2, ends, self.bias2)
        y = y.view(groups, per_group, self.out_dim)
        return torch.empty_like(y).index_copy(0, order, y)

    def token_space_is_cheaper(self, tokens: int, slots_per_expert: int) -> bool:
        """The CPU cost model between the "slots" and "tokens" backends, per input.

        cost = FLOPs + CPU_BYTES_TO_FLOPS * bytes moved through memory for the large intermediates: the slot
        formulation writes and reads (n*p, dim) tensors about six times; the token-space one handles
        (tokens, n*hidden) tensors about four times but spends tokens/p times the expert FLOPs.
        """
        n, p, d, h = self.num_experts, slots_per_expert, self.dim, self.hidden
        slot_cost = 2 * n * p * d * (2 * tokens + 2 * h) + CPU_BYTES_TO_FLOPS * 4 * n * p * d * 6
        token_cost = 4 * tokens * d * n * h + 4 * tokens * n * p * h + CPU_BYTES_TO_FLOPS * 4 * tokens * n * h * 4
        return token_cost < slot_cost

    def _fused_native_applies(self, x: torch.Tensor) -> bool:
        return self.out_dim == self.dim and native_mixing_applies(x, self.hidden, self.activation)

    def mix_skips_unkept(
        self, backend: str, x: torch.Tensor, dispatch: torch.Tensor | None = None, combine: torch.Tensor | None = None
    ) -> bool:
        """Whether ``mix(backend, x, dispatch, combine, ..., kept_combine=True)`` itself runs only the kept experts'
        work: the fused native mixing called directly in inference, which lays each call's kept combine out by
        inputs, by the rows of each expert or by pairs (:func:`~softmoe.kernels.soft_moe_mixing`; routing weights not
        given are taken as recording no gradient). Algorithm 1's plan "auto" then runs the dense plan, and where the
        native routing made the choice passes its kept slots as bits (``mix``'s ``kept_slots``)."""
        if backend != "native" or not self._fused_native_applies(x):
            return False
        return direct_call_ok("cpu", x, dispatch, combine, *self._weights())

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
        """(weight1, bias1, weight2, bias2): the registered parameters looked up directly (nn.Module.__getattr__
        costs 0.4 us a name, and this runs on every call), others (e.g. under torch.nn.utils.parametrize) as
        attributes."""
        params = self._parameters
        return tuple([params[name] if name in params else getattr(self, name)
                      for name in ("weight1", "bias1", "weight2", "bias2")])

    def _native_dtypes(self, x: torch.Tensor) -> bool:
        """Whether tokens x and the weights are what the native ops take: float32, on the CPU."""
        return x.is_cpu and x.dtype == self._weights()[0].dtype == torch.float32

    def _unavailable(self, backend: str, x: torch.Tensor) -> str | None:
        """Why ``backend`` cannot run tokens x, or None when it can."""
        if backend in ("slots", "native") and transforms_active():
            return "a torch.func transform or forward-mode AD is active (use 'reference')"
        if backend in ("slots", "native") and autocast_on(x):
            return "autocast is on (use 'reference')"
        if backend == "native":
            if not self._native_dtypes(x):
                return f"the native ops take float32 CPU tensors, got {x.dtype} on {x.device}"
            if not native_available():
                return native_status()
        return None

    def choose_backend(self, backend: str, x: torch.Tensor, slots_per_expert: int) -> BackendChoice:
        """The backend for tokens x (batch, tokens, dim) (see :mod:`softmoe.backends` for the rules of "auto")."""
        if backend != "auto":
            why = self._unavailable(backend, x)
            if why is not None:
                raise unsupported(backend, why)
            return BackendChoice(backend, "requested")
        if transforms_active():
            return BackendChoice("reference", "a torch.func transform or forward-mode AD is active: plain torch ops")
        # what _unavailable checks, each once (this runs on every call)
        slots = not autocast_on(x)
        if not x.is_cpu:
            if not slots:
                return BackendChoice("reference", "autocast is on: plain torch ops")
            return BackendChoice("slots", f"on {x.device.type}: torch's batched matmuls (the CPU cost model is not used)")
        native = slots and self._native_dtypes(x) and native_available()
        if native and self._fused_native_applies(x):
            return BackendChoice("native", "many small relu experts on few float32 tokens: the fused native mixing")
        batch, tokens, _ = x.shape
        if self.token_space_is_cheaper(tokens, slots_per_expert):
            return BackendChoice("tokens", "CPU cost model: the token-space rewrite moves less memory")
        # Without grad mode only the forward products run: the native kernel wins over more rows there.
        most = NATIVE_MAX_ROWS if torch.is_grad_enabled() else NATIVE_FORWARD_MAX_ROWS
        if native and native_applies(x, self.weight1, batch * slots_per_expert, max_rows=most):
            return BackendChoice("native", f"{batch * slots_per_expert} rows per expert through large float32 "
                                           "weights: the native expert matmul streams them faster")
        if not slots:
            return BackendChoice("reference", "CPU cost model: the slot formulation; autocast is on: plain torch ops")
        return BackendChoice("slots", "CPU cost model: the slot formulation")

    def mix(
        self, backend: str, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, slots_per_expert: int,
        kept_combine: bool = False, kept_slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """C f(D^T X) with the "slots", "tokens" or "native" backend: x (batch, tokens, dim), dispatch and combine
        (batch, tokens, n * p) float32 or wider -> (batch, tokens, out_dim). With ``kept_combine`` (combine zero
        outside each input's kept experts) the fused native mixing runs only the kept experts in inference
        (:func:`~softmoe.kernels.soft_moe_mixing`, which takes ``kept_slots``, the kept slots as bits, where the
        routing gives them)."""
        if dispatch.dtype != x.dtype or combine.dtype != x.dtype:
            dispatch, combine = dispatch.to(x.dtype), combine.to(x.dtype)
        if backend == "tokens":
            shape = (*x.shape[:2], self.num_experts, slots_per_expert)
            return self.forward_through_tokens(x, dispatch.view(shape), combine.view(shape))
        weights = self._weights()
        if backend == "slots":
            if needs_grad(x, dispatch, combine, *weights):
                return _SlotMixing.apply(x, dispatch, combine, *weights, slots_per_expert, self.activation)
            # no gradient to record: the formulas without the autograd Function (its apply took 5-16 us a call on an
            # AMD EPYC Zen 4; eager CUDA calls are bound by such host time)
            return _slot_mixing(x, dispatch, combine, *weights, slots_per_expert, self.activation)[0]
        if self._fused_native_applies(x):
            return soft_moe_mixing(x, dispatch, combine, *weights, kept_combine=kept_combine, kept_slots=kept_slots)
        rows = _expert_rows(torch.bmm(dispatch.transpose(1, 2), x), self.num_experts, slots_per_expert)
        if needs_grad(rows, self.weight1, self.bias1):
            h = self.act(expert_matmul(rows, self.weight1, self.bias1))
        else:  # inference: the activation applied inside the kernel
            h = expert_matmul(rows, self.weight1, self.bias1, self.activation)
        y = _slot_rows(expert_matmul(h, self.weight2, self.bias2), x.shape[0], slots_per_expert)
        return batched_matmul(combine, y)

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
    hidden = batched_matmul(rows, weight1, bias1)
    activated = activation_fn(activation)(hidden)
    y = _slot_rows(batched_matmul(activated, weight2, bias2), x.shape[0], slots_per_expert)
    return batched_matmul(combine, y), rows, hidden, activated, y


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
        # out.sum().backward() hands over an expanded (stride-0) gradient, which sent both products below through
        # torch's slow strided path (+1.5 ms, 1.5x the whole step, at the MNIST layer's n = 2); one copy instead
        grad = grad.contiguous()
        if torch.is_grad_enabled():  # create_graph: the intermediates again, now as functions of the inputs
            inputs = (x, dispatch, combine, weight1, bias1, weight2, bias2)
            _, rows, hidden, activated, y = _slot_mixing(*inputs, p, ctx.activation)
        grad_combine = torch.bmm(grad, y.transpose(1, 2)) if need[2] else None
        grad_y = _expert_rows(torch.bmm(combine.transpose(1, 2), grad), weight1.shape[0], p)
        grad_w2 = _weight_gradient(activated, grad_y) if need[5] else None
        grad_b2 = grad_y.sum(1) if need[6] else None
        grad_hidden = _activation_backward(batched_matmul(grad_y, weight2.transpose(1, 2)), hidden, ctx.activation)
        grad_w1 = _weight_gradient(rows, grad_hidden) if need[3] else None
        grad_b1 = grad_hidden.sum(1) if need[4] else None
        grad_x = grad_dispatch = None
        if need[0] or need[1]:
            grad_slots = _slot_rows(batched_matmul(grad_hidden, weight1.transpose(1, 2)), x.shape[0], p)
            grad_x = torch.bmm(dispatch, grad_slots) if need[0] else None
            grad_dispatch = torch.bmm(x, grad_slots.transpose(1, 2)) if need[1] else None
        return grad_x, grad_dispatch, grad_combine, grad_w1, grad_b1, grad_w2, grad_b2, None, None


def _weight_gradient(inputs: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Each expert's weight gradient inputs^T @ grad: (n, rows, K), (n, rows, N) -> (n, K, N). Without a graph to
    record it goes into a block reused from step to step (:func:`softmoe.kernels.expert_matmul.reusable_empty`): a
    ViT-S layer's are 302 MB each, fresh pages at every step in a default process."""
    if torch.is_grad_enabled():  # create_graph: torch.bmm's out= records no graph
        return torch.bmm(inputs.transpose(1, 2), grad)
    shape = (inputs.shape[0], inputs.shape[2], grad.shape[2])
    return torch.bmm(inputs.transpose(1, 2), grad, out=reusable_empty(shape, grad))


def _reinitialize(module: nn.Module) -> None:
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


class StackedExperts(ReferenceOnly, nn.Module):
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
        self.reference_reason = "custom experts (StackedExperts) run Definition 1 with torch.func.vmap"
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
