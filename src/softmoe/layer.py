"""The Soft MoE layer (Puigcerver et al.; Definition 1 of "Beyond Parameter Count").

For one input X of shape (m, d) with slot parameters phi of shape (d, n, p):

    logits  = X phi                                  (m, n, p)   [normalized X and phi, times `scale`, by default]
    D       = softmax of logits over the m tokens     dispatch: each slot is a convex combination of tokens
    C       = softmax of logits over all n*p slots    combine: each token is a convex combination of slots
    slots   = D^T X                                   (n, p, d)
    Y~[j]   = f_j(slots[j])                           expert j on its own p slots
    output  = C Y~                                    (m, d_out)

Three normalizations (``SoftMoE(normalize=...)``), with a learnable scalar ``scale`` (initialized to 1) in the
first two:

    "router"  vmoe's (Puigcerver et al.), the default: logits = (X / |X|) (scale * phi / |phi|) with
              v / |v| = v * rsqrt(sum v^2 + 1e-6) over d (epsilon inside the rsqrt); slots from the RAW tokens X.
    "inputs"  the MNIST code of "Beyond Parameter Count": X <- X / (sqrt(sum X^2) + 1e-6) over d (epsilon outside
              the sqrt) REPLACES the tokens, so logits AND slots use it; phi / (sqrt(sum phi^2) + 1e-6) * scale.
    "none"    equation (1) of the paper as written: logits = X phi.

Logits and both softmaxes are computed in float32 (float64 for float64 inputs), whatever the autocast dtype.

Each formula is one function below, in plain torch ops: :func:`soft_moe_logits`, :func:`soft_moe_routing` (dispatch
and combine), :func:`dispatch_slots`, :func:`experts_on_slots`, :func:`combine_slots`; :func:`soft_moe_reference`
is the whole layer. :class:`SoftMoE` runs each step on the backend :meth:`SoftMoE.backend_for` names
(:mod:`softmoe.backends`), every one of which equals these functions.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, NamedTuple, cast

import torch
from torch import nn

from softmoe.checks import autocast_device, check_normalization, check_positive_ints, check_selected, check_tokens
from softmoe.compat import registered
from softmoe.experts import Experts, FactoryKwargs, MLPExperts, StackedExperts
from softmoe.initializers import truncated_lecun_normal_
from softmoe.selection_plan import check_plan, host_reads_are_free

if TYPE_CHECKING:
    from softmoe.selection import ExpertSelector

# The epsilon of both L2 normalizations.
NORM_EPS = 1e-6


class Routing(NamedTuple):
    """Routing tensors of one call, each (batch, tokens, num_experts, slots_per_expert), float32 or float64."""

    logits: torch.Tensor
    dispatch: torch.Tensor
    combine: torch.Tensor


def l2_normalize(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t * rsqrt(sum(t^2) + 1e-6)`` over ``dim``: vmoe's normalization (the epsilon is inside the rsqrt)."""
    return t * torch.rsqrt(t.square().sum(dim=dim, keepdim=True) + NORM_EPS)


def l2_normalize_outside_eps(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t / (sqrt(sum(t^2)) + 1e-6)`` over ``dim``: the normalization of the "Beyond Parameter Count" code.

    A zero vector stays zero, with a zero gradient (``vector_norm``'s subgradient at 0).
    """
    return t / (torch.linalg.vector_norm(t, dim=dim, keepdim=True) + NORM_EPS)


def routing_dtype(x: torch.Tensor, phi: torch.Tensor) -> torch.dtype:
    """The dtype of the logits and both softmaxes: float32, or wider where x or phi is."""
    return torch.promote_types(torch.promote_types(x.dtype, phi.dtype), torch.float32)


def soft_moe_logits(
    x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor | None, normalize: str = "router"
) -> torch.Tensor:
    """logits = X phi: tokens x (batch, tokens, dim), phi (dim, slots) -> (batch, tokens, slots), float32 or wider.

    "none" is X phi; "router" normalizes the tokens and the columns of phi with :func:`l2_normalize` and multiplies
    by ``scale``; "inputs" expects x already normalized by the layer (:meth:`SoftMoE.slot_inputs`) and normalizes the
    columns of phi with :func:`l2_normalize_outside_eps` times ``scale``. Computed outside autocast.
    """
    dtype = routing_dtype(x, phi)
    with torch.autocast(device_type=autocast_device(x), enabled=False):
        x, phi = x.to(dtype), phi.to(dtype)
        # A layer has a scale whenever it normalizes, and the callers pass it.
        if normalize == "router":
            assert scale is not None
            x, phi = l2_normalize(x, dim=-1), l2_normalize(phi, dim=0) * scale.to(dtype)
        elif normalize == "inputs":
            assert scale is not None
            phi = l2_normalize_outside_eps(phi, dim=0) * scale.to(dtype)
        return x @ phi


def add_logit_noise(logits: torch.Tensor, std: float) -> torch.Tensor:
    """``logits + std * N(0, 1)``, the noise drawn with ``torch.randn_like`` on the logits' device and dtype; the
    logits themselves when ``std`` is 0. The layer and the routers call it in training mode only."""
    if std == 0:
        return logits
    return logits + std * torch.randn_like(logits)


def soft_moe_routing(
    tokens: torch.Tensor,
    phi: torch.Tensor,
    scale: torch.Tensor | None,
    normalize: str,
    noise_std: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, D (softmax over tokens) and C (softmax over slots) of the slot inputs ``tokens`` (batch, tokens, dim)
    with phi (dim, slots): each (batch, tokens, slots), float32 or wider (:func:`routing_from_logits`)."""
    return routing_from_logits(soft_moe_logits(tokens, phi, scale, normalize), noise_std, mask)


def routing_from_logits(
    logits: torch.Tensor, noise_std: float = 0.0, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, D, C) from the logits (batch, tokens, slots): ``noise_std * N(0, 1)`` added first when ``noise_std``
    > 0 (the callers pass it in training only); padded tokens (``mask`` False) get zero dispatch and combine weight."""
    logits = add_logit_noise(logits, noise_std)
    if mask is None:
        return logits, logits.softmax(dim=1), logits.softmax(dim=-1)
    keep = mask.unsqueeze(-1)
    # A finite fill keeps a fully padded input finite (uniform softmax), then the mask zeroes it.
    filled = logits.masked_fill(~keep, torch.finfo(logits.dtype).min)
    return logits, filled.softmax(dim=1) * keep, logits.softmax(dim=-1) * keep


def dispatch_slots(x: torch.Tensor, dispatch: torch.Tensor) -> torch.Tensor:
    """slots = D^T X: x (batch, tokens, dim), dispatch (batch, tokens, n*p) -> (batch, n*p, dim)."""
    return torch.bmm(dispatch.to(x.dtype).transpose(1, 2), x)


def experts_on_slots(experts: Experts, slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Y~: every expert on its own p slots, (batch, n*p, dim) -> (batch, n*p, d_out)."""
    batch, slot_count, dim = slots.shape
    p = slot_count // num_experts
    per_expert = slots.view(batch, num_experts, p, dim).transpose(0, 1).reshape(num_experts, batch * p, dim)
    out = experts(per_expert)
    return out.view(num_experts, batch, p, -1).transpose(0, 1).reshape(batch, slot_count, -1)


def combine_slots(combine: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
    """output = C Y~: combine (batch, tokens, n*p), expert_out (batch, n*p, d_out) -> (batch, tokens, d_out)."""
    return torch.bmm(combine.to(expert_out.dtype), expert_out)


def soft_moe_reference(
    x: torch.Tensor,
    phi: torch.Tensor,
    scale: torch.Tensor | None,
    experts: Experts,
    normalize: str = "router",
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Definition 1 in plain torch ops: x (batch, m, d), phi (d, n, p), experts (n, rows, d) -> (n, rows, d_out)
    -> (batch, m, d_out). What the "reference" backend of :class:`SoftMoE` runs; every other backend equals it."""
    dim, n, p = phi.shape
    if normalize == "inputs":
        x = l2_normalize_outside_eps(x, dim=-1)
    _, dispatch, combine = soft_moe_routing(x, phi.reshape(dim, n * p), scale, normalize, mask=mask)
    return combine_slots(combine, experts_on_slots(experts, dispatch_slots(x, dispatch), n))


class SoftMoE(nn.Module):
    """Soft Mixture of Experts: (batch, tokens, dim) -> (batch, tokens, d_out), d_out = ``out_dim`` or dim.

    Args:
        dim: token feature size d.
        num_experts: n.
        slots_per_expert: p; the layer has n*p slots per input.
        expert_hidden: hidden size of the default MLP expert (default 4*dim).
        activation: "gelu" (exact), "gelu_tanh" or "relu", for the default expert.
        normalize: "router" (vmoe's, the default), "inputs" (the "Beyond Parameter Count" code: the normalized
            tokens replace X, slots included) or "none" (equation (1) exactly); see the module doc for the
            formulas. True and False mean "router" and "none".
        expert_bias: biases in the default expert.
        out_dim: the experts' output size d_out (default dim).
        expert: an optional module mapping (rows, dim) -> (rows, d_out); the layer stacks ``num_experts``
            independently initialized copies and runs them with ``torch.func.vmap`` (:class:`StackedExperts`).
        identical_expert_init: start every expert from the same weights, as the authors' configs do.
        noise_std: in training mode, ``noise_std * N(0, 1)`` is added to the logits before both softmaxes (vmoe's
            ``SoftRouter.add_noise``; default 0, no noise).
        backend: the code that runs the layer's steps, one of :data:`softmoe.backends.BACKENDS` ("auto" by
            default); settable later as ``layer.backend``. :meth:`backend_for` says which runs for an input, and why.

    Parameters: ``phi`` (dim, num_experts, slots_per_expert), ``scale`` () when normalizing, ``experts``.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        slots_per_expert: int = 1,
        expert_hidden: int | None = None,
        activation: str = "gelu",
        normalize: str | bool = "router",
        expert_bias: bool = True,
        out_dim: int | None = None,
        expert: nn.Module | None = None,
        identical_expert_init: bool = False,
        noise_std: float = 0.0,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_positive_ints(dim=dim, num_experts=num_experts, slots_per_expert=slots_per_expert)
        if expert_hidden is not None:
            check_positive_ints(expert_hidden=expert_hidden)
        if not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std!r}")
        self.noise_std = noise_std
        self.dim, self.num_experts, self.slots_per_expert = dim, num_experts, slots_per_expert
        self.out_dim = dim if out_dim is None else out_dim
        self.normalize = check_normalization(normalize)
        self.backend = backend
        self.selector: ExpertSelector | None = None
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.phi = nn.Parameter(torch.empty(dim, num_experts, slots_per_expert, **factory))
        self.scale = nn.Parameter(torch.ones((), **factory)) if self.normalize != "none" else None
        if expert is None:
            hidden = 4 * dim if expert_hidden is None else expert_hidden
            self.experts: Experts = MLPExperts(
                num_experts, dim, hidden, activation, expert_bias, identical_expert_init, self.out_dim, **factory
            )
        else:
            template = copy.deepcopy(expert).to(**factory)
            self.experts = StackedExperts(template, num_experts, dim, identical_expert_init, self.out_dim)
        self.reset_parameters()

    @property
    def backend(self) -> str:
        """The requested backend (see :mod:`softmoe.backends`)."""
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        from softmoe.backends import check_backend  # (softmoe.backends builds on this module)

        self._backend = check_backend(value)

    def reset_parameters(self) -> None:
        """phi ~ truncated LeCun normal over fan_in = dim * num_experts (std about 1/sqrt(dim * n))."""
        if self.phi.is_meta:
            return
        truncated_lecun_normal_(self.phi, self.dim * self.num_experts)
        if self.scale is not None:
            nn.init.ones_(self.scale)

    @property
    def num_slots(self) -> int:
        return self.num_experts * self.slots_per_expert

    def weights(self) -> tuple[torch.Tensor, torch.Tensor | None, Experts]:
        """(phi as (dim, n*p), scale, experts)."""
        phi, scale, experts = registered(self, "phi"), registered(self, "scale"), registered(self, "experts")
        return phi.reshape(self.dim, self.num_slots), scale, cast(Experts, experts)

    def backend_for(self, x: torch.Tensor):
        """The :class:`~softmoe.backends.BackendChoice` for x (batch, tokens, dim) in the current mode: the backend
        that runs, why, and what runs each of its steps (``.steps``: "route", "mix", "select", in words). A
        ValueError when the requested backend cannot serve x."""
        from softmoe.backends import explain  # (softmoe.backends builds on this module)

        return explain(self, x)

    def _choose(self, x: torch.Tensor):  # the backend backend_for names, without describing its steps
        from softmoe.backends import choose  # (softmoe.backends builds on this module)

        return choose(self, x)[0]

    def slot_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens the slots are built from, (batch, tokens, dim): x itself, or for ``normalize="inputs"`` the
        normalized tokens ``x / (|x| + 1e-6)`` (:func:`l2_normalize_outside_eps`), which then replace x."""
        return l2_normalize_outside_eps(x, dim=-1) if self.normalize == "inputs" else x

    def route(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        """Logits, dispatch and combine weights of x (batch, tokens, dim), each (batch, tokens, n, p), float32 or wider.

        ``dispatch`` sums to 1 over tokens for every slot; ``combine`` sums to 1 over the n*p slots of every
        token. Padded tokens (``mask`` False) get zero dispatch and zero combine weight. The slots are
        ``dispatch_slots(slot_inputs(x), dispatch)``. In plain torch ops (:func:`soft_moe_routing`).
        """
        phi, scale, _ = self.weights()
        check_tokens(x, self.dim, mask, phi.dtype)
        noise = self.noise_std if self.training else 0.0
        routing = soft_moe_routing(self.slot_inputs(x), phi, scale, self.normalize, noise, mask)
        shape = (*x.shape[:2], self.num_experts, self.slots_per_expert)
        return Routing(*(t.view(shape) for t in routing))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (batch, tokens, dim), mask: optional bool (batch, tokens), True for real tokens -> (batch, tokens, d_out).

        Padded tokens get a zero output; a fully padded input gives zeros. Inside ``softmoe.select_experts`` (which
        sets ``self.selector``) only each input's selected experts are computed, as in :meth:`forward_selected`.
        Every step runs on the backend :meth:`backend_for` names.
        """
        check_tokens(x, self.dim, mask, self.phi.dtype)
        backend = self._choose(x)
        x = self.slot_inputs(x)
        if self.selector is not None:
            return backend.select(self, x, mask, self.selector)
        dispatch, combine = backend.route(self, x, mask)
        return backend.mix(self, x, dispatch, combine)

    def forward_selected(
        self,
        x: torch.Tensor,
        selected: torch.Tensor,
        mask: torch.Tensor | None = None,
        renormalize: bool = False,
        check: bool | None = None,
        plan: str = "auto",
    ) -> torch.Tensor:
        """Soft MoE with only the experts ``selected`` (batch, k) int64 of each input; the others contribute nothing.

        Equals C Y^ where Y^ has zero rows for the slots of unselected experts (Algorithm 1's step 4); with
        ``renormalize`` each token's combine weights are rescaled to sum to 1 over the kept slots. An entry -1 is an
        unused place: inputs may keep different numbers of experts in one batch (as the adaptive strategies of
        :mod:`softmoe.selection` do). x: (batch, tokens, dim) -> (batch, tokens, d_out).

        ``plan`` (same output, different work; :mod:`softmoe.selection_plan`): "selected" runs each expert on the
        slots of the inputs that keep it, grouped by expert, and nothing for an unselected expert or unused place;
        "dense" runs every expert and gives the unselected slots zero combine weight; "auto" (the default) the
        cheaper of the two for this shape by the cost model (or timed, with autotuning on).

        ``check``: validate the values of ``selected`` (in range, no repeats). None (the default) checks them where
        that is free (CPU tensors outside torch.compile); True always (a host synchronization on a GPU); False never.
        """
        check_plan(plan)
        check_tokens(x, self.dim, mask, self.phi.dtype)
        validate = host_reads_are_free(selected) if check is None else check
        check_selected(selected, x.shape[0], self.num_experts, validate)
        backend = self._choose(x)
        x = self.slot_inputs(x)
        dispatch, combine = backend.route(self, x, mask)
        return backend.mix_selected(self, x, dispatch, combine, selected, renormalize, plan)

    def run_experts(self, slots: torch.Tensor) -> torch.Tensor:
        """Every expert on its own slots (:func:`experts_on_slots`): (batch, n*p, dim) -> (batch, n*p, d_out)."""
        return experts_on_slots(self.experts, slots, self.num_experts)

    def extra_repr(self) -> str:
        out = "" if self.out_dim == self.dim else f", out_dim={self.out_dim}"
        backend = "" if self.backend == "auto" else f", backend={self.backend!r}"
        return (
            f"dim={self.dim}, num_experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, "
            f"normalize={self.normalize!r}{out}{backend}"
        )
