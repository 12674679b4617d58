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

:func:`soft_moe_routing` computes the routing (shared with ``softmoe.routing.SoftMoERouter``) and
:func:`soft_moe_reference` is the whole layer in plain torch ops; the mixing step ``C f(D^T X)`` runs on the
backend ``SoftMoE(backend=...)`` names (:mod:`softmoe.backends`), every one of which equals the reference.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from softmoe.backends import BackendChoice, check_backend
from softmoe.experts import Experts, MLPExperts, StackedExperts, autocast_device
from softmoe.kernels import cpu_isa, native_routing_applies, native_top_k_applies, needs_grad, onednn_applies
from softmoe.kernels import onednn_linear, top_k_combine
from softmoe.kernels import soft_moe_routing as native_routing
from softmoe.kernels import soft_moe_routing_top_k
from softmoe.kernels.modes import host_reads_are_free, transforms_active
from softmoe.kernels.routing_softmaxes import NORM_EPS, fused_routing_applies, fused_routing_softmaxes
from softmoe.selection_plan import (
    check_plan,
    counts_decide,
    kept_counts,
    mask_from_subsets,
    plan_costs,
    plans_are_timed,
    selected_plan_is_cheaper,
    slot_mask,
    timed_choice,
    timed_plan,
    timings_forgotten,
    worth_timing,
)

# Plans a layer remembers for Algorithm 1's calls (SoftMoE._top_k_plan) before it forgets them all: one per shape and
# setting (and kept counts where those decide), so only a stream of ever new batch sizes reaches it.
MAX_REMEMBERED_PLANS = 4096
NORMALIZATIONS = ("router", "inputs", "none")
# Inference inputs of at least this many elements compute their logits with oneDNN (see soft_moe_logits).
ONEDNN_MIN_TOKEN_ELEMENTS = 1 << 20
# Truncated normal on [-2 std, 2 std] has standard deviation 0.8796... std: LeCun init divides by it.
TRUNCATED_NORMAL_STD = 0.87962566103423978


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


def check_normalization(normalize: str | bool) -> str:
    """The normalization's name: one of :data:`NORMALIZATIONS`; True means "router" and False "none"."""
    if isinstance(normalize, bool):
        return "router" if normalize else "none"
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS} (or a bool), got {normalize!r}")
    return normalize


def soft_moe_logits(
    x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor | None, normalize: str = "router"
) -> torch.Tensor:
    """Logits of tokens x (batch, tokens, dim) and phi (dim, slots) -> (batch, tokens, slots), float32 or wider.

    ``normalize`` (see the module doc): "none" is X phi; "router" normalizes the tokens and the columns of phi with
    :func:`l2_normalize` and multiplies by ``scale``; "inputs" expects x already normalized by the layer
    (:meth:`SoftMoE.slot_inputs`) and normalizes the columns of phi with :func:`l2_normalize_outside_eps` times
    ``scale``. Computed outside autocast. For "router" the tokens' normalization is applied to the product,
    ``(x / |x|) phi = (x phi) / |x|``, which saves writing a normalized copy of the tokens
    (:class:`_NormalizedTokenLogits`, its forward called directly when no gradient is needed); on CUDA, where
    every op costs a kernel launch, both normalizations run as torch's fused RMS norm instead
    (:func:`rms_norm_logits`).
    """
    dtype = torch.promote_types(torch.promote_types(x.dtype, phi.dtype), torch.float32)
    with torch.autocast(device_type=autocast_device(x), enabled=False):
        tokens, phi = x.to(dtype), phi.to(dtype)
        if normalize == "none":
            return token_product(tokens, phi)
        if normalize == "inputs":
            return token_product(tokens, l2_normalize_outside_eps(phi, dim=0) * scale.to(dtype))
        if launch_bound(tokens):
            return rms_norm_logits(tokens, phi, scale.to(dtype))
        phi = l2_normalize(phi, dim=0) * scale.to(dtype)
        if needs_grad(tokens, phi):
            return _NormalizedTokenLogits.apply(tokens, phi)
        return _NormalizedTokenLogits.forward(tokens, phi)


def launch_bound(x: torch.Tensor) -> bool:
    """Whether ops on x are launches of device kernels that the host issues one by one, so that fewer ops beat
    fewer FLOPs: a CUDA tensor outside torch.func transforms (under torch.compile too, whose kernels fuse them)."""
    return x.device.type == "cuda" and not transforms_active()


def rms_norm_logits(x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The "router" logits ``(x / |x|) (scale * phi / |phi|)`` with both normalizations as RMS norms: x (..., dim),
    phi (dim, slots), scale () -> (..., slots).

    With v / |v| = v * rsqrt(sum v^2 + 1e-6) (:func:`l2_normalize`), ``rms_norm(v, eps=1e-6 / dim) = sqrt(dim) *
    v / |v|`` exactly, so the logits are ``rms_norm(x) @ rms_norm(phi^T, weight=scale / dim)^T``. On CUDA each
    RMS norm is one fused kernel, forward and backward: the logits took 7 kernels instead of the general path's 14
    on an H100 (docs/performance.md), and eager GPU layers are bound by their launches.
    """
    dim = x.shape[-1]
    return F.linear(F.rms_norm(x, (dim,), eps=NORM_EPS / dim), rms_norm_columns(phi, scale / dim))


def rms_norm_columns(phi: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """phi (dim, slots)'s columns as one fused RMS norm times ``weight`` (), transposed: (slots, dim), each row
    ``sqrt(dim) * weight * v * rsqrt(sum(v^2) + 1e-6)`` (:func:`l2_normalize`'s normalization)."""
    dim = phi.shape[0]
    return F.rms_norm(phi.t(), (dim,), weight.expand(dim), NORM_EPS / dim)


def router_products(x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The "router" logits before the tokens' normalization, ``x (scale * phi / |phi|)``: x (batch, tokens, dim),
    phi (dim, slots), scale () -> (batch, tokens, slots), float32 or wider; for calls where autocast is off (the
    routing op's path: eager inference). The op divides each token's row by its norm itself
    (``softmoe::routing_softmaxes``'s x): one kernel fewer than :func:`rms_norm_logits`."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, phi.dtype), torch.float32)
    weight = rms_norm_columns(phi.to(dtype), scale.to(dtype) / math.sqrt(x.shape[-1]))
    return F.linear(x.to(dtype), weight)


def add_logit_noise(logits: torch.Tensor, std: float) -> torch.Tensor:
    """``logits + std * N(0, 1)``, the noise drawn with ``torch.randn_like`` on the logits' device and dtype; the
    logits themselves when ``std`` is 0. The layer and the routers call it in training mode only."""
    if std == 0:
        return logits
    return logits + std * torch.randn_like(logits)


def token_product(tokens: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """tokens (..., dim) @ phi (dim, slots) -> (..., slots).

    phi enters as a (slots, dim) row-major matrix, the faster CPU operand layout; large inference inputs take
    oneDNN (:mod:`softmoe.kernels`, 2.5x faster for 100 x 197 tokens).
    """
    if tokens.numel() >= ONEDNN_MIN_TOKEN_ELEMENTS and onednn_applies(tokens, phi):
        return onednn_linear(tokens, phi)
    return F.linear(tokens, phi.t().contiguous())


class _NormalizedTokenLogits(torch.autograd.Function):
    """(x phi) * r with r = rsqrt(|x|^2 + 1e-6), for x (..., dim) and phi (dim, slots).

    The backward is written out: with L the logits and G their gradient, dL/dx = (G r) phi^T - (sum_slots G L) r^2 x
    and dL/dphi = x^T (G r). It passes over x twice (r again, and one fused update), where autograd's backward of
    the token norm takes four full-size passes (the norm, a division, a product, a mask of zero norms): a tenth of
    the layer's time with many small experts. Built from differentiable ops on the inputs and the saved output, it
    has correct second derivatives too.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        return token_product(x, phi) * _inverse_norm(x)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs, output)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, phi, logits = ctx.saved_tensors
        r = _inverse_norm(x)
        grad_product = grad * r
        grad_x = grad_phi = None
        if ctx.needs_input_grad[0]:
            coef = (grad * logits).sum(-1, keepdim=True) * r.square()
            grad_x = F.linear(grad_product, phi).addcmul_(x, coef, value=-1.0)
        if ctx.needs_input_grad[1]:
            grad_phi = x.reshape(-1, x.shape[-1]).t() @ grad_product.reshape(-1, grad_product.shape[-1])
        return grad_x, grad_phi


def _inverse_norm(x: torch.Tensor) -> torch.Tensor:
    """rsqrt(|x|^2 + 1e-6) over the last dim, keepdim."""
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1, keepdim=True).square() + NORM_EPS)


def check_tokens(
    x: torch.Tensor, dim: int, mask: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> None:
    """Raise a ValueError unless x is a floating (batch, tokens, dim) tensor and mask a bool (batch, tokens).

    With ``dtype`` (the layer's), x must have that dtype too, except under autocast, which casts for itself.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got dtype {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape (batch, tokens, dim={dim}), got rank {x.dim()} shape {tuple(x.shape)}")
    if x.shape[-1] != dim:
        raise ValueError(f"x must have feature size dim={dim}, got {x.shape[-1]} (shape {tuple(x.shape)})")
    if dtype is not None and x.dtype != dtype and not torch.is_autocast_enabled(autocast_device(x)):
        raise ValueError(f"x has dtype {x.dtype} but the layer's parameters are {dtype}; convert one of them")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.shape != x.shape[:2]:
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"mask must have shape (batch, tokens)={tuple(x.shape[:2])}, got {got}")
        if mask.dtype != torch.bool:
            raise ValueError(f"mask must be a bool tensor (True = real token), got dtype {mask.dtype}")


def check_selected(selected: torch.Tensor, batch: int, num_experts: int, values: bool = True) -> None:
    """Raise a ValueError unless ``selected`` is an int64 (batch, k) tensor of distinct expert indices per row,
    where -1 marks an unused place (an input that keeps fewer than k experts).

    ``values=False`` checks the dtype and shape only: the values' checks read them on the host (a synchronization
    on a GPU, a graph break under torch.compile).
    """
    if selected.dtype != torch.int64 or selected.dim() != 2 or selected.shape[0] != batch:
        raise ValueError(
            f"selected must be an int64 tensor of shape (batch={batch}, k), got {selected.dtype} {tuple(selected.shape)}"
        )
    if not values:
        return
    if selected.numel() and (int(selected.min()) < -1 or int(selected.max()) >= num_experts):
        raise ValueError(
            f"selected expert indices must lie in [0, {num_experts}) (or be -1, unused), got {selected.tolist()}"
        )
    ordered = selected.sort(dim=1).values
    if selected.shape[1] > 1 and bool(((ordered.diff(dim=1) == 0) & (ordered[:, 1:] >= 0)).any()):
        raise ValueError(f"selected must not repeat an expert within a row, got {selected.tolist()}")


def renormalized(combine: torch.Tensor) -> torch.Tensor:
    """Combine weights (batch, tokens, slots) rescaled to sum to 1 over the slots; a token with none stays zero."""
    return combine / combine.sum(-1, keepdim=True).clamp_min(torch.finfo(combine.dtype).tiny)


def truncated_lecun_normal_(tensor: torch.Tensor, fan_in: int) -> torch.Tensor:
    """LeCun normal truncated to two standard deviations, in place: std 1/sqrt(fan_in) after truncation (JAX's
    ``lecun_normal``, which vmoe uses for phi and the patch embedding)."""
    std = 1.0 / math.sqrt(fan_in) / TRUNCATED_NORMAL_STD
    return nn.init.trunc_normal_(tensor, std=std, a=-2 * std, b=2 * std)


def soft_moe_routing(
    tokens: torch.Tensor,
    phi: torch.Tensor,
    scale: torch.Tensor | None,
    normalize: str,
    noise_std: float = 0.0,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, dispatch and combine of the slot inputs ``tokens`` (batch, tokens, dim) with phi (dim, slots):
    each (batch, tokens, slots), float32 or wider. The routing of :class:`SoftMoE` and of
    ``softmoe.routing.SoftMoERouter``.

    ``noise_std * N(0, 1)`` is added to the logits when ``noise_std`` > 0 (the callers pass it in training only).
    Padded tokens (``mask`` False) get zero dispatch and zero combine weight. Without noise or mask, float32 CPU
    tensors take the native routing (:mod:`softmoe.kernels.soft_moe_routing`: one call forward, one backward; its
    products in oneDNN where that pays). Large inference inputs too: on an AMD EPYC Zen 5 their routing took
    0.52-0.91x the time of torch's ops with oneDNN's product (AVX-512; 0.80-1.03x with AVX2) at 8-256 slots,
    e.g. Table 3's layer at batch 100 (docs/performance.md).
    """
    if mask is None and noise_std == 0 and native_routing_applies(tokens, phi, scale):
        return native_routing(tokens, phi, scale, normalize)
    logits = add_logit_noise(soft_moe_logits(tokens, phi, scale, normalize), noise_std)
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
    -> (batch, m, d_out). The "reference" backend of :class:`SoftMoE`; every other backend equals it."""
    dim, n, p = phi.shape
    if normalize == "inputs":
        x = l2_normalize_outside_eps(x, dim=-1)
    _, dispatch, combine = soft_moe_routing(x, phi.reshape(dim, n * p), scale, normalize, mask=mask)
    return combine_slots(combine, experts_on_slots(experts, dispatch_slots(x, dispatch), n))


class ExpertSelector(Protocol):
    """What a layer consults, when set as ``layer.selector``, to pick each input's experts (see softmoe.selection).

    An optional attribute ``top_k`` (an int) says that :meth:`select` keeps each input's k experts of largest
    summed combine weight (Algorithm 1): the layer may then choose them itself instead, inside its routing kernel
    (eager CUDA inference) or in one native call after the routing (float32 CPU), without calling :meth:`select`."""

    renormalize: bool
    plan: str  # one of SELECTION_PLANS

    def select(self, combine: torch.Tensor) -> torch.Tensor:
        """combine (batch, tokens, n, p) -> selected experts (batch, k) int64."""
        ...


def _run_settings(device: torch.device) -> tuple[torch.dtype | None, tuple]:
    """What else a plan's speed on ``device`` depends on, beside the call's shapes: autocast's dtype (None when off)
    and the host's settings (on the CPU torch's threads and the native kernels' instruction set, else none)."""
    kind = device.type
    autocast = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    return autocast, (torch.get_num_threads(), cpu_isa()) if kind == "cpu" else ()


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
        backend: the code that computes the mixing step, one of :data:`softmoe.backends.BACKENDS` ("auto" by
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
        for name, value in (("dim", dim), ("num_experts", num_experts), ("slots_per_expert", slots_per_expert)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if expert_hidden is not None and (isinstance(expert_hidden, bool) or not isinstance(expert_hidden, int) or expert_hidden < 1):
            raise ValueError(f"expert_hidden must be an integer >= 1, got {expert_hidden!r}")
        if not noise_std >= 0:
            raise ValueError(f"noise_std must be >= 0, got {noise_std!r}")
        self.noise_std = noise_std
        self.dim, self.num_experts, self.slots_per_expert = dim, num_experts, slots_per_expert
        self.out_dim = dim if out_dim is None else out_dim
        self.normalize = check_normalization(normalize)
        self.backend = backend
        self.selector: ExpertSelector | None = None
        self._plans: dict[tuple, str] = {}  # plan "auto"'s plans for Algorithm 1's top k, by call (_top_k_plan)
        factory = {"device": device, "dtype": dtype}
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

    def backend_for(self, x: torch.Tensor) -> BackendChoice:
        """The backend that runs the mixing step for x (batch, tokens, dim) in the current mode, and why.

        A ValueError when the requested backend cannot serve x (e.g. "native" for a CUDA tensor).
        """
        return self._experts().choose_backend(self.backend, x, self.slots_per_expert)

    def _weights(self) -> tuple[torch.Tensor, torch.Tensor | None, Experts]:
        """(phi, scale, experts) looked up directly: nn.Module.__getattr__ costs 0.4-0.8 us a name, and a call looks
        up several (3 us of the paper's MNIST layer's 47 at batch 1 on the AMD EPYC Zen 5); a phi or scale under
        torch.nn.utils.parametrize (a property then) as an attribute."""
        params = self._parameters
        phi = params["phi"] if "phi" in params else self.phi
        scale = params["scale"] if "scale" in params else self.scale
        return phi, scale, self._experts()

    def _experts(self) -> Experts:
        """The experts, looked up directly as :meth:`_weights` says (without running a parametrization of phi)."""
        return self._modules["experts"]

    def route(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
        """Logits, dispatch and combine weights for x (batch, tokens, dim); each (batch, tokens, n, p), float32 or wider.

        ``dispatch`` sums to 1 over tokens for every slot; ``combine`` sums to 1 over the n*p slots of every
        token. Padded tokens (``mask`` False) get zero dispatch and zero combine weight. The slots are
        ``dispatch_slots(slot_inputs(x), dispatch)``.
        """
        phi, scale, _ = self._weights()
        check_tokens(x, self.dim, mask, phi.dtype)
        shape = (*x.shape[:2], self.num_experts, self.slots_per_expert)
        logits, dispatch, combine = self._route_flat(self.slot_inputs(x), mask, phi, scale)
        return Routing(logits.view(shape), dispatch.view(shape), combine.view(shape))

    def slot_inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens the slots are built from, (batch, tokens, dim): x itself, or for ``normalize="inputs"`` the
        normalized tokens ``x / (|x| + 1e-6)`` (:func:`l2_normalize_outside_eps`), which then replace x."""
        return l2_normalize_outside_eps(x, dim=-1) if self.normalize == "inputs" else x

    def _route_flat(
        self, tokens: torch.Tensor, mask: torch.Tensor | None, phi: torch.Tensor, scale: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`soft_moe_routing` of the slot inputs ``tokens`` with the slots flattened: each (batch, tokens, n*p);
        phi and scale as :meth:`_weights` gives them."""
        noise = self.noise_std if self.training else 0.0
        return soft_moe_routing(tokens, phi.reshape(self.dim, self.num_slots), scale, self.normalize, noise, mask)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: (batch, tokens, dim), mask: optional bool (batch, tokens), True for real tokens -> (batch, tokens, d_out).

        Padded tokens get a zero output; a fully padded input gives zeros. Inside ``softmoe.select_experts`` (which
        sets ``self.selector``) only each input's selected experts are computed, as in :meth:`forward_selected`.
        The mixing step runs on the backend :meth:`backend_for` names.
        """
        phi, scale, experts = self._weights()
        check_tokens(x, self.dim, mask, phi.dtype)
        x = self.slot_inputs(x)
        plain = mask is None and not (self.training and self.noise_std > 0)
        if self.selector is None:
            # bfloat16 / float16 eager CUDA inference: the routing op's kernel writes the weights in x's dtype
            # (1.03-1.17x the speed of torch's softmaxes and casts on an H200 machine; float32 keeps torch's)
            if plain and self._narrow_weights(x, False) and \
                    fused_routing_applies(x, flat := phi.reshape(self.dim, self.num_slots), scale):
                dispatch, combine, _ = self._fused_routing(x, flat, scale, 0, False)
            else:
                _, dispatch, combine = self._route_flat(x, mask, phi, scale)
            return self._mix(x, dispatch, combine)
        k = getattr(self.selector, "top_k", None)
        flat = phi.reshape(self.dim, self.num_slots)
        plain = plain and isinstance(k, int) and k >= 1
        if plain and fused_routing_applies(x, flat, scale, self.slots_per_expert, k):
            # Algorithm 1 in one kernel with the softmaxes (eager CUDA inference); combine comes back zero outside
            # the kept slots
            dispatch, combine, selected = self._fused_routing(x, flat, scale, k, self.selector.renormalize)
            return self._selected_forward(x, dispatch, combine, selected, self.selector.renormalize,
                                          self.selector.plan, combine_is_kept=True)
        if plain and x.is_cpu:
            # CPU inference: Algorithm 1's choice made in the native routing's pass (combine zero outside the kept
            # slots); where the mixing skips the unkept experts itself (the dense plan runs only the kept ones), it
            # takes the kept slots as bits and the kept experts are not listed
            backend = self.backend_for(x).name if self.selector.plan != "selected" else None
            direct = backend is not None and self._mix_skips_unkept(backend, x)
            routed = soft_moe_routing_top_k(x, flat, scale, self.normalize, self.slots_per_expert, k,
                                            with_selected=not direct)
            if routed is not None:
                dispatch, combine, slots, selected = routed
                if direct:
                    combine = renormalized(combine) if self.selector.renormalize else combine
                    return experts.mix(backend, x, dispatch, combine, self.slots_per_expert, kept_combine=True,
                                       kept_slots=slots)
                return self._selected_forward(x, dispatch, combine, selected, self.selector.renormalize,
                                              self.selector.plan, combine_is_kept=True, backend=backend)
        _, dispatch, combine = self._route_flat(x, mask, phi, scale)
        if plain and native_top_k_applies(combine):
            # Algorithm 1's choice and the kept combine weights in one native call (CPU with gradients recorded or
            # the dispatcher watched).
            combine, selected = top_k_combine(combine, self.slots_per_expert, k)
            return self._selected_forward(x, dispatch, combine, selected, self.selector.renormalize,
                                          self.selector.plan, combine_is_kept=True)
        selected = self.selector.select(combine.view(*x.shape[:2], self.num_experts, self.slots_per_expert))
        return self._selected_forward(x, dispatch, combine, selected, self.selector.renormalize, self.selector.plan)

    def _fused_routing(
        self, x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor | None, k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch and combine (batch, tokens, n*p) and Algorithm 1's k experts (batch, k) of x from the routing op
        (:func:`~softmoe.kernels.routing_softmaxes.fused_routing_softmaxes`: eager CUDA inference, where
        :func:`fused_routing_applies`), phi (dim, n*p) flat; combine zero outside the kept experts' slots. With the
        "router" normalization the op normalizes the tokens itself (one kernel fewer); where the mixing casts the
        weights to x's narrower dtype anyway it writes them in that dtype (two kernels fewer:
        :meth:`_narrow_weights`)."""
        if self.normalize == "router":
            logits, tokens = router_products(x, phi, scale), x
        else:
            logits, tokens = soft_moe_logits(x, phi, scale, self.normalize), None
        out_dtype = x.dtype if self._narrow_weights(x, renormalize) else None
        return fused_routing_softmaxes(logits, self.slots_per_expert, k, out_dtype, tokens)

    def _narrow_weights(self, x: torch.Tensor, renormalize: bool) -> bool:
        """Whether the routing op may write dispatch and combine in x's dtype: bfloat16 or float16 tokens whose
        mixing casts the weights to it anyway (the default experts, :class:`~softmoe.experts.MLPExperts` itself; not
        stacked experts or a bank of the user's own, whose outputs may be wider, nor for a renormalization, which
        sums the weights first)."""
        return x.dtype in (torch.bfloat16, torch.float16) and not renormalize and type(self._experts()) is MLPExperts

    def _mix(
        self, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, kept_combine: bool = False,
        backend: str | None = None,
    ) -> torch.Tensor:
        """C f(D^T X) with every expert, on the backend :meth:`backend_for` names (``backend``: that name, where the
        caller has it); ``kept_combine``: combine is zero outside each input's kept experts (the dense plan), which
        the backend may use to skip work."""
        backend = backend or self.backend_for(x).name
        if backend == "reference":
            return combine_slots(combine, self.run_experts(dispatch_slots(x, dispatch)))
        experts = self._experts()
        if kept_combine:  # by keyword, and only then: experts written for the five-argument mix keep working
            return experts.mix(backend, x, dispatch, combine, self.slots_per_expert, kept_combine=True)
        return experts.mix(backend, x, dispatch, combine, self.slots_per_expert)

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

        ``plan`` (same output, different work; see :mod:`softmoe.selection_plan`): "selected" runs each expert
        on the slots of the inputs that keep it, grouped by expert, and nothing for an unselected (input, expert)
        pair or an unused place; "dense" runs every expert as the plain forward does and gives the unselected
        slots zero combine weight; "auto" (the default) takes the one the cost model finds cheaper for this shape.

        ``check``: validate the values of ``selected`` (in range, no repeats). None (the default) checks them where
        that is free (CPU tensors outside torch.compile); True always (a host synchronization on a GPU); False never.
        """
        check_plan(plan)
        phi, scale, _ = self._weights()
        check_tokens(x, self.dim, mask, phi.dtype)
        values = host_reads_are_free(selected) if check is None else check
        check_selected(selected, x.shape[0], self.num_experts, values)
        x = self.slot_inputs(x)
        _, dispatch, combine = self._route_flat(x, mask, phi, scale)
        return self._selected_forward(x, dispatch, combine, selected, renormalize, plan)

    def selected_plan_is_cheaper(self, x: torch.Tensor, selected: torch.Tensor) -> bool:
        """Whether plan "auto" runs only the ``selected`` (batch, k) experts (plan "selected") rather than them all
        (plan "dense") for x (batch, tokens, dim): in eval mode on eager CUDA (and on an eager CPU for a close call)
        the plan timed faster for this shape once it has been timed (:func:`softmoe.selection_plan.timed_plan`;
        before its first call, the cost model's answer, which the timing may overturn), else
        :func:`softmoe.selection_plan.selected_plan_is_cheaper` on this layer's
        :func:`~softmoe.selection_plan.plan_costs`, the pairs and experts in use counted where host reads are free;
        never where the experts' mixing skips the unkept experts' work itself (the fused small-expert kernel in
        inference: the dense plan then runs only the kept experts)."""
        if self._mix_skips_unkept(None, x):
            return False
        kept = kept_counts(selected, self.num_experts)
        return self._auto_plan(x, selected, kept, self._flops_per_row())[0] == "selected"

    def parameters_per_expert(self) -> float:
        """The experts' parameter count over n (a multiply-add per parameter per row: the cost of one row)."""
        return sum(t.numel() for t in self._expert_tensors()) / self.num_experts

    def _flops_per_row(self) -> float:
        """The FLOPs of one row through one expert (a multiply-add per parameter): the cost model's unit."""
        return 2 * self.parameters_per_expert()

    def _expert_tensors(self) -> list[torch.Tensor]:
        """The experts' parameters, each once: cheaper per call than ``parameters()`` (1 us against 3 for
        MLPExperts)."""
        tensors = {id(t): t for module in self.experts.modules() for t in module._parameters.values() if t is not None}
        return list(tensors.values())

    def _plan_costs(
        self, x: torch.Tensor, selected: torch.Tensor, kept: tuple[int, int] | None, flops_per_row: float
    ) -> tuple[float, float]:
        return plan_costs(x.shape[0], selected.shape[1], self.num_experts, self.slots_per_expert, flops_per_row,
                          x.device, kept)

    def _top_k_plan(self, x: torch.Tensor, selected: torch.Tensor, runs: Callable[[], dict]) -> str:
        """Plan "auto"'s plan for Algorithm 1's top k (batch * k pairs, no unused place; ``runs`` as for
        :meth:`_auto_plan`), remembered per layer for the call's shape and settings, and where the experts in use
        can change it (:func:`softmoe.selection_plan.counts_decide`) for their counts too: a repeated call then
        costs a lookup (and the count) instead of the cost model and the timing's key (15-20 us a call on the AMD
        EPYC Zen 5, where the plain MNIST layer's call takes 50-100). A plan remembered for experts since replaced
        or reshaped in place is only slower, never wrong: both plans give the same output."""
        key = known = None
        if not torch.compiler.is_compiling() and not transforms_active():
            device = x.device
            autocast, host = _run_settings(device)
            key = (tuple(x.shape), selected.shape[1], x.dtype, device, self.training, self._backend,
                   id(self._experts()), autocast, torch.are_deterministic_algorithms_enabled(), timings_forgotten(),
                   *host)
            plans = self.__dict__.setdefault("_plans", {})  # (a layer pickled before it had them: none)
            if len(plans) > MAX_REMEMBERED_PLANS:
                plans.clear()
            known = plans.get(key)  # a plan, or "counted": look it up with the counts
            if known in ("selected", "dense"):
                return known
        flops = self._flops_per_row()
        # batch * k pairs of k to min(n, batch * k) experts in use, counted (1-20 us a call on the CPU) only where
        # that can change the call; then the plan is remembered for the counts too
        batch, k = selected.shape
        fewest, most = (batch * k, k), (batch * k, min(self.num_experts, batch * k))
        counted = known == "counted" or (fewest != most and host_reads_are_free(selected) and counts_decide(
            self._plan_costs(x, selected, fewest, flops), self._plan_costs(x, selected, most, flops)))
        kept = kept_counts(selected, self.num_experts) if counted else most
        if counted and key is not None:
            plans[key] = "counted"
            key = (*key, kept)
            plan = plans.get(key)
            if plan is not None:
                return plan
        plan, settled = self._auto_plan(x, selected, kept, flops, runs)
        if key is not None and settled:
            plans[key] = plan
        return plan

    def _auto_plan(
        self, x: torch.Tensor, selected: torch.Tensor, kept: tuple[int, int] | None, flops_per_row: float,
        runs: Callable[[], dict[str, Callable[[], object]]] | None = None,
    ) -> tuple[str, bool]:
        """The plan ("selected" or "dense") that plan "auto" runs for this call, and whether that is settled for the
        call's shape (not where a timing it wants was not done: a later call may time it), ``kept`` the call's
        :func:`~softmoe.selection_plan.kept_counts`: the plan timed faster for its shape where timing decides, i.e.
        in eval mode (timing runs the experts again: a training forward would draw their dropout anew), where
        :func:`softmoe.selection_plan.plans_are_timed`, for a call :func:`softmoe.selection_plan.worth_timing` (on
        the CPU a close one, judged with this call's kept counts: a shape timed once does not overrule the cost
        model for a batch that keeps far fewer or more experts), the shape timed now where ``runs`` (a function
        giving the plans' calls by name) is given, else only an earlier timing counts. Otherwise the cost model's
        answer."""
        costs, settled = None, True
        if not self.training and plans_are_timed(x.device):
            # eager CUDA times every shape without the cost model's costs (host time per call)
            if x.device.type != "cpu" or worth_timing(costs := self._plan_costs(x, selected, kept, flops_per_row)):
                key = self._plan_key(x, selected)
                choice = timed_choice(key) if runs is None else timed_plan(key, runs(), x.device)
                if choice is not None:
                    return choice, True
                settled = False
        costs = costs or self._plan_costs(x, selected, kept, flops_per_row)
        return "selected" if selected_plan_is_cheaper(costs, x.device) else "dense", settled

    def _plan_key(self, x: torch.Tensor, selected: torch.Tensor) -> tuple:
        """What the plans' times depend on, for :func:`softmoe.selection_plan.timed_plan`: the device, dtype and
        shapes, autocast, the backend, the experts' kind and weights' shapes (not which experts are kept); on the
        CPU also torch's threads and the native kernels' instruction set."""
        weights = tuple(t.shape for t in self._expert_tensors())
        autocast, host = _run_settings(x.device)
        return (x.device, x.dtype, tuple(x.shape), selected.shape[1], self.num_experts, self.slots_per_expert,
                autocast, self.backend, type(self.experts), weights, *host)

    def _selected_forward(
        self,
        x: torch.Tensor,
        dispatch: torch.Tensor,
        combine: torch.Tensor,
        selected: torch.Tensor,
        renormalize: bool,
        plan: str,
        combine_is_kept: bool = False,
        backend: str | None = None,
    ) -> torch.Tensor:
        """Algorithm 1's mixing on the ``plan`` given or found cheaper; ``combine_is_kept``: combine is already
        zero on the slots of unselected experts (the dense plan then needs no mask); ``backend``: the one
        :meth:`backend_for` names, where the caller has it."""
        keep = None if combine_is_kept or plan == "selected" else mask_from_subsets(selected, self.num_experts)
        if plan == "auto" and x.device.type == "cpu":  # (where a mixing skips them: the fused native kernel)
            backend = backend or self.backend_for(x).name
            if self._mix_skips_unkept(backend, x, dispatch, combine):
                plan = "dense"  # the mixing itself runs only the kept experts' work
        if plan == "auto":
            def runs() -> dict[str, Callable[[], torch.Tensor]]:  # the plans' calls, for a timing
                return {"dense": lambda: self._dense_plan(x, dispatch, combine, keep, renormalize),
                        "selected": lambda: self._selected_plan(x, dispatch, combine, selected, renormalize)}

            if combine_is_kept:
                plan = self._top_k_plan(x, selected, runs)
            else:
                plan = self._auto_plan(x, selected, kept_counts(selected, self.num_experts), self._flops_per_row(),
                                       runs)[0]
        if plan == "selected":
            return self._selected_plan(x, dispatch, combine, selected, renormalize)
        return self._dense_plan(x, dispatch, combine, keep, renormalize, backend)

    def _mix_skips_unkept(
        self, backend: str | None, x: torch.Tensor, dispatch: torch.Tensor | None = None,
        combine: torch.Tensor | None = None,
    ) -> bool:
        """Whether the experts' mixing of x on ``backend`` (None: :meth:`backend_for`'s; one that cannot serve x
        skips nothing) skips the unkept experts' work by itself (the optional ``mix_skips_unkept`` of an expert bank,
        e.g. :meth:`softmoe.experts.MLPExperts.mix_skips_unkept`; such a bank's ``mix`` also takes the routing's kept
        slots as bits, ``kept_slots``)."""
        skips = getattr(self._experts(), "mix_skips_unkept", None)
        if skips is None:
            return False
        if backend is None:
            try:
                backend = self.backend_for(x).name
            except ValueError:
                return False
        return skips(backend, x, dispatch, combine)

    def _dense_plan(
        self, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, keep: torch.Tensor | None,
        renormalize: bool, backend: str | None = None
    ) -> torch.Tensor:
        """Every expert, the unselected ones' combine weights zeroed: keep (batch, n) bool, None where combine is
        zero there already; ``backend`` as for :meth:`_mix`."""
        p = self.slots_per_expert
        if keep is not None:
            combine = torch.where(slot_mask(keep, p), combine, 0.0)
        return self._mix(x, dispatch, renormalized(combine) if renormalize else combine, kept_combine=True,
                         backend=backend)

    def _selected_plan(
        self, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, selected: torch.Tensor,
        renormalize: bool
    ) -> torch.Tensor:
        """Only the kept experts, on the slots of the inputs that keep them, grouped by expert."""
        batch, tokens, d = x.shape
        p = self.slots_per_expert
        k = selected.shape[1]
        # Unused places (-1) take expert 0's slots; the experts give them zero outputs, so only a renormalization
        # needs to leave their combine weights out.
        index = selected.clamp_min(0)
        slot_index = (index.unsqueeze(-1) * p + torch.arange(p, device=x.device)).reshape(batch, 1, k * p)
        slot_index = slot_index.expand(batch, tokens, k * p)
        kept_dispatch = dispatch.gather(2, slot_index)
        kept_combine = combine.gather(2, slot_index)
        if renormalize:
            used = (selected >= 0).repeat_interleave(p, dim=1).unsqueeze(1)  # (batch, 1, k * p)
            kept_combine = renormalized(torch.where(used, kept_combine, 0.0))
        slots = dispatch_slots(x, kept_dispatch).view(batch * k, p, d)
        expert_out = self.experts.forward_selected(slots, selected.reshape(batch * k))
        return combine_slots(kept_combine, expert_out.view(batch, k * p, self.out_dim))

    def dispatch_slots(self, x: torch.Tensor, dispatch: torch.Tensor) -> torch.Tensor:
        """slots = D^T X (:func:`dispatch_slots`): (batch, tokens, dim), (batch, tokens, n*p) -> (batch, n*p, dim)."""
        return dispatch_slots(x, dispatch)

    def run_experts(self, slots: torch.Tensor) -> torch.Tensor:
        """Every expert on its own slots (:func:`experts_on_slots`): (batch, n*p, dim) -> (batch, n*p, d_out)."""
        return experts_on_slots(self.experts, slots, self.num_experts)

    def combine_slots(self, combine: torch.Tensor, expert_out: torch.Tensor) -> torch.Tensor:
        """output = C Y~ (:func:`combine_slots`): (batch, tokens, n*p), (batch, n*p, d_out) -> (batch, tokens, d_out)."""
        return combine_slots(combine, expert_out)

    def extra_repr(self) -> str:
        out = "" if self.out_dim == self.dim else f", out_dim={self.out_dim}"
        backend = "" if self.backend == "auto" else f", backend={self.backend!r}"
        return (
            f"dim={self.dim}, num_experts={self.num_experts}, slots_per_expert={self.slots_per_expert}, "
            f"normalize={self.normalize!r}{out}{backend}"
        )
