"""``softmoe::routing_softmaxes``: a Soft MoE layer's two softmaxes, and Algorithm 1's choice, from its logits.

    softmoe::routing_softmaxes(Tensor logits, int slots_per_expert, int k, ScalarType? out_dtype=None,
                               Tensor? x=None, float eps=1e-6) -> (Tensor dispatch, Tensor combine, Tensor selected)
        logits (batch, tokens, slots) float32 or float64, optional tokens x (batch, tokens, dim): with x each token's
        logits are first multiplied by rsqrt(sum(x^2) + eps) over its dim (the router's normalization of the
        tokens applied to the product, (x / |x|) W = (x W) / |x|) ->
        dispatch (batch, tokens, slots)  softmax over the tokens
        combine (batch, tokens, slots)   softmax over the slots; with k > 0 zero on the slots of every expert
                                         outside the input's k chosen ones
                                         (both computed in the logits' dtype, then rounded to ``out_dtype``, a
                                         floating dtype, where given: the dtype a bfloat16 layer mixes in)
        selected (batch, k) int64        with k > 0 the k experts (of slots / slots_per_expert) with the largest
                                         combine weight summed over tokens and their slots (Algorithm 1 of "Beyond
                                         Parameter Count"; NaN first, ties to the lower index), ascending; (batch, 0)
                                         with k = 0

On a GPU an eager Soft MoE call is bound by the host's launches (docs/performance.md). In torch's ops Algorithm 1's
choice takes about sixteen kernels after the two softmaxes (a sum, two sorts, a mask from the indices, the masked
combine weights); on CUDA this op is one Triton kernel for all of it (:mod:`softmoe.kernels.routing_softmaxes_triton`),
which also divides each token's logits by the token's norm (the router's normalization: one RMS norm fewer) and
writes the weights in a bfloat16 layer's dtype (two casts fewer). The "cuda" backend takes it for Algorithm 1 in
eager inference (the plain forward keeps torch's softmaxes, where the op did not pay: docs/performance.md has the
measurements), always through the op.
Elsewhere, and on CUDA without Triton or with ``SOFTMOE_TRITON=0``, the op is torch's ops. Differentiable in the
logits and the tokens (the choice is a constant of the backward, as in the unfused path).
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.kernels.modes import eager_inference
from softmoe.kernels.triton_kernels import TritonKernel
from softmoe.selection_plan import kept_slots
from softmoe.topk import top_k

# The most values of one input's tiles the kernel holds at once: its tokens x slots (each rounded up to a power of
# two) and, where it chooses, its experts x slots; and the most experts it ranks (a square of them). Larger inputs
# take torch's ops.
MAX_TILE = 1 << 15
# The epsilon of the router's L2 normalization, ``v * rsqrt(sum(v^2) + NORM_EPS)`` (vmoe's; softmoe.layer's too).
NORM_EPS = 1e-6
MAX_RANKED_EXPERTS = 128
KERNEL = TritonKernel(
    "softmoe.kernels.routing_softmaxes_triton", "the routing kernel", "Algorithm 1 chooses its experts with torch's ops"
)


def fused_routing_applies(
    tokens: Tensor, phi: Tensor, scale: Tensor | None, slots_per_expert: int = 1, k: int = 0
) -> bool:
    """Whether a layer routing ``tokens`` (batch, tokens, dim) with ``phi`` (dim, slots) and ``scale`` takes this
    op for its softmaxes (and, with k > 0, Algorithm 1's choice) rather than torch's ops: eager inference on CUDA
    (:func:`~softmoe.kernels.modes.eager_inference`) where the op runs its kernel on the logits
    (:func:`kernel_applies`)."""
    if not (tokens.is_cuda and eager_inference("cuda", tokens, phi, scale)):
        return False
    dtype = torch.promote_types(torch.promote_types(tokens.dtype, phi.dtype), torch.float32)
    return kernel_applies((*tokens.shape[:2], phi.shape[1]), dtype, tokens.device, slots_per_expert, k)


def kernel_applies(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, slots_per_expert: int, k: int
) -> bool:
    """Whether the op runs the Triton kernel for logits of ``shape`` (batch, tokens, slots) and ``dtype`` on
    ``device``: float32 on CUDA, Triton available, one input's logits within MAX_TILE (tokens and slots rounded up
    to :func:`block_size`) and, where it chooses, at most MAX_RANKED_EXPERTS experts and experts x slots within
    MAX_TILE."""
    if not (device.type == "cuda" and dtype == torch.float32 and KERNEL.available()):
        return False
    _, tokens, slots = shape
    experts = slots // slots_per_expert
    if k and (experts > MAX_RANKED_EXPERTS or block_size(experts) * block_size(slots) > MAX_TILE):
        return False
    return block_size(tokens) * block_size(slots) <= MAX_TILE


def block_size(n: int) -> int:
    """The kernel's block along a dimension of size n: the power of two at least n, and at least 16."""
    return max(16, 1 << (n - 1).bit_length())


def check_routing_softmaxes(
    logits: Tensor,
    slots_per_expert: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    x: Tensor | None = None,
    eps: float = NORM_EPS,
) -> None:
    """Raise a ValueError unless logits (batch, tokens, slots) is float32 or float64, slots_per_expert and k fit
    its slots, ``out_dtype`` is None or a floating dtype and ``x`` None or floating (batch, tokens, dim) tokens on
    the logits' device with ``eps`` >= 0."""
    if logits.dim() != 3 or logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(
            f"routing_softmaxes takes logits (batch, tokens, slots) in float32 or float64, got "
            f"{logits.dtype} {tuple(logits.shape)}"
        )
    slots = logits.shape[2]
    if slots_per_expert < 1 or slots % slots_per_expert:
        raise ValueError(f"slots_per_expert must divide the {slots} slots, got {slots_per_expert}")
    if not 0 <= k <= slots // slots_per_expert:
        raise ValueError(f"k must lie in [0, {slots // slots_per_expert}] (0: no choice), got {k}")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be None or a floating dtype, got {out_dtype}")
    if x is not None and (
        x.dim() != 3 or x.shape[:2] != logits.shape[:2] or not x.is_floating_point() or x.device != logits.device
    ):
        raise ValueError(
            f"x must be floating tokens (batch, tokens, dim) = {tuple(logits.shape[:2])} + (dim,) on "
            f"{logits.device}, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    if x is not None and not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")


@torch.library.custom_op("softmoe::routing_softmaxes", mutates_args=())
def routing_softmaxes(
    logits: Tensor,
    slots_per_expert: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    x: Tensor | None = None,
    eps: float = NORM_EPS,
) -> tuple[Tensor, Tensor, Tensor]:
    """logits (batch, tokens, slots) -> (dispatch, combine, selected (batch, k)); see the module doc. The kernel where
    it applies (:func:`kernel_applies`) and can launch, else torch's ops."""
    check_routing_softmaxes(logits, slots_per_expert, k, out_dtype, x, eps)
    kernel = kernel_applies(logits.shape, logits.dtype, logits.device, slots_per_expert, k)
    if kernel and KERNEL.failure is None:
        logits = logits.contiguous()
        dispatch, combine = torch.empty_like(logits, dtype=out_dtype), torch.empty_like(logits, dtype=out_dtype)
        selected = logits.new_empty((logits.shape[0], k), dtype=torch.int64)
        try:
            KERNEL.module().launch(
                logits,
                dispatch,
                combine,
                selected,
                slots_per_expert,
                k,
                k > 0,
                None if x is None else x.contiguous(),
                eps,
            )
            return dispatch, combine, selected
        except Exception as error:  # e.g. no C compiler for Triton's launcher: torch's ops from now on
            KERNEL.launch_failed(error)
    return reference_routing_softmaxes(logits, slots_per_expert, k, out_dtype, x, eps)


def token_scale(x: Tensor, dtype: torch.dtype, eps: float) -> Tensor:
    """What the op multiplies each token's logits by: ``rsqrt(sum(x^2) + eps)`` over x's last dim, in ``dtype``:
    x (batch, tokens, dim) -> (batch, tokens, 1)."""
    return torch.rsqrt(x.to(dtype).square().sum(-1, keepdim=True) + eps)


def reference_routing_softmaxes(
    logits: Tensor,
    slots_per_expert: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    x: Tensor | None = None,
    eps: float = NORM_EPS,
) -> tuple[Tensor, Tensor, Tensor]:
    """The op in torch's ops (every device; the kernel's reference)."""
    batch, tokens, slots = logits.shape
    if x is not None:
        logits = logits * token_scale(x, logits.dtype, eps)
    dispatch, combine = logits.softmax(dim=1), logits.softmax(dim=-1)
    if k == 0:
        selected = logits.new_empty(batch, 0, dtype=torch.int64)
    else:
        experts = slots // slots_per_expert
        scores = combine.view(batch, tokens, experts, slots_per_expert).sum(dim=(1, 3))
        selected = top_k(scores, k, dim=1)[1].sort(dim=1).values
        combine = torch.where(kept_slots(selected, experts, slots_per_expert), combine, 0.0)
    if out_dtype is not None:
        dispatch, combine = dispatch.to(out_dtype), combine.to(out_dtype)
    return dispatch, combine, selected


@routing_softmaxes.register_fake
def _(
    logits: Tensor,
    slots_per_expert: int,
    k: int,
    out_dtype: torch.dtype | None = None,
    x: Tensor | None = None,
    eps: float = NORM_EPS,
) -> tuple[Tensor, Tensor, Tensor]:
    check_routing_softmaxes(logits, slots_per_expert, k, out_dtype, x, eps)
    shape = logits.shape  # both paths return contiguous tensors, whatever the logits' strides
    weights = logits.new_empty(shape, dtype=out_dtype)
    return weights, torch.empty_like(weights), logits.new_empty(shape[0], k, dtype=torch.int64)


def _setup_context(ctx, inputs, output) -> None:
    logits, slots_per_expert, _, _, x, eps = inputs
    ctx.save_for_backward(logits, x, output[2])
    ctx.slots_per_expert, ctx.eps = slots_per_expert, eps
    ctx.mark_non_differentiable(output[2])


def _backward(ctx, grad_dispatch: Tensor | None, grad_combine: Tensor | None, _grad_selected):
    """The softmaxes' gradients, in the logits' dtype (the softmaxes computed again from them, whatever dtype the
    op rounded its outputs to); the choice is constant: combine's gradient reaches only the kept slots, through the
    softmax over every slot. With tokens x, z = logits * r, r = rsqrt(sum x^2 + eps): dlogits = dz r and
    dx = -(sum over slots of dz logits) r^3 x."""
    logits, x, selected = ctx.saved_tensors
    r = None if x is None else token_scale(x, logits.dtype, ctx.eps)
    z = logits if r is None else logits * r
    grad = torch.zeros_like(z)
    if grad_dispatch is not None:
        dispatch, grad_dispatch = z.softmax(dim=1), grad_dispatch.to(z.dtype)
        grad = grad + dispatch * (grad_dispatch - (grad_dispatch * dispatch).sum(dim=1, keepdim=True))
    if grad_combine is not None:
        combine, grad_combine = z.softmax(dim=-1), grad_combine.to(z.dtype)
        if selected.shape[1]:
            keep = kept_slots(selected, z.shape[2] // ctx.slots_per_expert, ctx.slots_per_expert)
            grad_combine = torch.where(keep, grad_combine, 0.0)
        grad = grad + combine * (grad_combine - (grad_combine * combine).sum(dim=-1, keepdim=True))
    if r is None:
        return grad, None, None, None, None, None
    grad_x = -(grad * logits).sum(-1, keepdim=True) * r.pow(3) * x.to(z.dtype)
    return grad * r, None, None, None, grad_x.to(x.dtype), None


routing_softmaxes.register_autograd(_backward, setup_context=_setup_context)
