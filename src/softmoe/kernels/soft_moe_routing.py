"""``softmoe::soft_moe_routing``: a Soft MoE layer's logits, dispatch and combine weights in one native call
(``csrc/soft_moe_routing.h``), forward and backward.

In torch's ops the routing is some fifteen small ops forward (the norms of phi's columns and of the tokens, the
product, two softmaxes) and twice as many, with as many autograd nodes, backward. Inside a layer call, right after
the expert products, each op's code and data come back from memory, and with small layers (the paper's MNIST layer:
256 x 4 tokens of dim 196, 2-512 slots) those fixed costs are most of the routing's time. Here, up to 32 slots,
the product x phi_n and, backward, the products giving the gradients of x and phi run in the kernel's own passes
over each input (for so few slots MKL's separate products cost more than the passes they join); with more slots
they are torch's matmuls (MKL), or oneDNN's where :func:`softmoe.kernels.onednn.onednn_pays`; everything else is
one pass over each input's logits (docs/performance.md has the measurements).

    softmoe::soft_moe_routing(Tensor x, Tensor phi, Tensor? scale, str normalize, str isa)
            -> (Tensor logits, Tensor dispatch, Tensor combine, Tensor r)
        x (batch, tokens, dim), phi (dim, slots), scale () (None for "none") -> logits, dispatch, combine
        (batch, tokens, slots) and r (batch, tokens), the tokens' inverse norms the backward reads (ones unless
        "router"; not differentiable)
    softmoe::soft_moe_routing_backward(Tensor? grad_logits, Tensor? grad_dispatch, Tensor? grad_combine, Tensor x,
                                       Tensor phi, Tensor? scale, Tensor logits, Tensor dispatch, Tensor combine,
                                       Tensor r, str normalize, str isa) -> (Tensor, Tensor, Tensor)
        the gradients of x, phi and scale (zero for "none")

The normalizations are the layer's (``softmoe.layer``): "router" (vmoe's: tokens and phi's columns normalized,
epsilon inside the rsqrt), "inputs" (phi's columns divided by their norm plus 1e-6; the tokens arrive normalized)
and "none". A double backward (``create_graph=True``) recomputes the routing with torch's ops and differentiates
those, so gradient penalties work as with torch's path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.kernels.build import native_available, native_module, required_isa
from softmoe.kernels.modes import direct_autograd_ok, direct_call_ok, direct_function, needs_grad, transforms_active
from softmoe.kernels.onednn import onednn_pays
from softmoe.kernels.top_k_combine import check_choice

# The layer's normalize argument -> the kernel's mode (ROUTING_* in bindings.cpp).
ROUTING_MODES = {"none": 0, "router": 1, "inputs": 2}


@torch.library.custom_op("softmoe::soft_moe_routing", mutates_args=(), device_types="cpu")
def soft_moe_routing_op(
    x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str, isa: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The routing with the ``isa`` variant of the native kernel: (logits, dispatch, combine, r)."""
    return _run_routing(x, phi, scale, normalize, isa)


def _run_routing(
    x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str, isa: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The op's code, called directly where no dispatcher is needed (:func:`soft_moe_routing`,
    :data:`_DirectRouting`)."""
    return native_module().soft_moe_routing(x, phi, scale, ROUTING_MODES[normalize], isa, _products_in_onednn(x, phi))


def _products_in_onednn(x: Tensor, phi: Tensor) -> bool:
    """Whether the routing's products (the logits x phi_n, backward the gradients of x and phi_n; all of x's rows
    against phi's columns) run in oneDNN: decided when the op runs, as for softmoe.kernels.batched_matmul."""
    batch, tokens, dim = x.shape
    return onednn_pays(2 * batch * tokens * dim * phi.shape[1])


@soft_moe_routing_op.register_fake
def _(x, phi, scale, normalize, isa):
    shape = (*x.shape[:2], phi.shape[1])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape), x.new_empty(x.shape[:2])


def _setup_routing(ctx, inputs, output) -> None:
    x, phi, scale, normalize, isa = inputs
    logits, dispatch, combine, r = output
    ctx.save_for_backward(x, phi, scale, logits, dispatch, combine, r)
    ctx.mark_non_differentiable(r)
    ctx.set_materialize_grads(False)  # an output left unused (the layer's logits) gets None, not zeros
    ctx.normalize, ctx.isa = normalize, isa


def _backward_routing(ctx, grad_logits, grad_dispatch, grad_combine, _grad_r):
    x, phi, scale, logits, dispatch, combine, r = ctx.saved_tensors
    if torch.is_grad_enabled():  # a double backward: differentiate torch's ops
        grads = _torch_routing_grads(x, phi, scale, ctx.normalize, (grad_logits, grad_dispatch, grad_combine))
    else:
        inputs = (grad_logits, grad_dispatch, grad_combine, x, phi, scale, logits, dispatch, combine, r)
        # the backward op's code directly unless something watches the dispatcher
        direct = direct_call_ok("cpu", *inputs)
        backward = _run_routing_backward if direct else torch.ops.softmoe.soft_moe_routing_backward
        grads = backward(*inputs, ctx.normalize, ctx.isa)
    grad_x, grad_phi, grad_scale = grads
    needed = ctx.needs_input_grad
    return (grad_x if needed[0] else None, grad_phi if needed[1] else None,
            grad_scale.reshape(scale.shape) if scale is not None and needed[2] else None, None, None)


def _torch_routing_grads(x, phi, scale, normalize, grads):
    """The gradients of x, phi, scale through the routing recomputed in torch's ops, themselves differentiable."""
    from softmoe.layer import soft_moe_logits  # the layer module imports this one

    inputs = (x, phi, scale)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    with torch.enable_grad():
        logits = soft_moe_logits(x, phi, scale, normalize)
        outputs = (logits, logits.softmax(dim=1), logits.softmax(dim=-1))
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
                                         allow_unused=True))
    result = [next(found) if t is not None and t.requires_grad else None for t in inputs]
    return [torch.zeros_like(t) if g is None and t is not None else g for t, g in zip(inputs, result)]


soft_moe_routing_op.register_autograd(_backward_routing, setup_context=_setup_routing)
# The same formula around the op's code, for eager calls (softmoe.kernels.modes.direct_autograd_ok).
_DirectRouting = direct_function("DirectSoftMoERouting", _run_routing, _setup_routing, _backward_routing)


@torch.library.custom_op("softmoe::soft_moe_routing_backward", mutates_args=(), device_types="cpu")
def soft_moe_routing_backward_op(
    grad_logits: Tensor | None, grad_dispatch: Tensor | None, grad_combine: Tensor | None, x: Tensor, phi: Tensor,
    scale: Tensor | None, logits: Tensor, dispatch: Tensor, combine: Tensor, r: Tensor, normalize: str, isa: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of softmoe::soft_moe_routing's x, phi and scale (see the module docstring)."""
    return _run_routing_backward(grad_logits, grad_dispatch, grad_combine, x, phi, scale, logits, dispatch, combine,
                                 r, normalize, isa)


def _run_routing_backward(
    grad_logits, grad_dispatch, grad_combine, x, phi, scale, logits, dispatch, combine, r, normalize, isa
) -> tuple[Tensor, Tensor, Tensor]:
    """The backward op's code, called directly where no dispatcher is needed (:func:`_backward_routing`)."""
    grad_x, grad_phi, grad_scale = native_module().soft_moe_routing_backward(
        grad_logits, grad_dispatch, grad_combine, x, phi, scale, logits, dispatch, combine, r,
        ROUTING_MODES[normalize], isa, _products_in_onednn(x, phi),
    )
    return grad_x, grad_phi, grad_scale


@soft_moe_routing_backward_op.register_fake
def _(grad_logits, grad_dispatch, grad_combine, x, phi, scale, logits, dispatch, combine, r, normalize, isa):
    return x.new_empty(x.shape), phi.new_empty(phi.shape), x.new_empty(())


def native_routing_applies(x: Tensor, phi: Tensor, scale: Tensor | None) -> bool:
    """Whether :func:`soft_moe_routing` serves tokens x (batch, tokens, dim) with phi (dim, slots): float32 CPU
    tensors (scale too), no torch.func transform active (the ops have no vmap rule) and the kernels built."""
    return (
        x.is_cpu
        and phi.is_cpu
        and x.dtype == phi.dtype == torch.float32
        and (scale is None or scale.dtype == torch.float32)
        and not transforms_active()
        and native_available()
    )


def soft_moe_routing(x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str) -> tuple[Tensor, Tensor, Tensor]:
    """Logits, dispatch and combine (each (batch, tokens, slots)) of tokens x (batch, tokens, dim) with phi (dim,
    slots) and ``scale`` (a 0-dim tensor; None for "none"), normalized as ``normalize`` says ("router", "inputs"
    or "none", as :func:`softmoe.layer.soft_moe_logits`), in one native call; differentiable in x, phi and scale.
    Only where :func:`native_routing_applies`."""
    isa, scale = _checked(x, phi, scale, normalize)
    if direct_call_ok("cpu", x, phi, scale):  # inference: the op's code without the dispatcher's host time
        route = _run_routing
    elif direct_autograd_ok("cpu", x, phi, scale):  # eager training: the same, with the op's formula
        route = _DirectRouting.apply
    else:  # torch.compile, autocast, the profiler and the like see the op
        route = torch.ops.softmoe.soft_moe_routing
    logits, dispatch, combine, _ = route(x, phi, scale, normalize, isa)
    return logits, dispatch, combine


def soft_moe_routing_top_k(
    x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str, slots_per_expert: int, k: int,
    with_selected: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """Inference's routing with Algorithm 1's choice made in the same native pass, each input's combine weights
    still in cache: (dispatch, combine zero outside the slots of the kept experts, the kept slots as bits (batch,
    ceil(slots / 64)) int64, bit s % 64 of word s // 64 set for each slot s of a kept expert, the kept experts (batch,
    k) int64 ascending, or None without ``with_selected``), what :func:`soft_moe_routing` then
    :func:`~softmoe.kernels.top_k_combine` give (arguments as theirs; the bits are what
    :func:`~softmoe.kernels.soft_moe_mixing` takes as ``kept_slots``). Runs ``softmoe::soft_moe_routing_top_k`` (its
    code called directly where nothing watches the dispatcher: the same kernel either way). None where it does not
    serve: :func:`native_routing_applies` false, or a gradient to record (the op has no backward). A ValueError for
    a k outside [1, n] or slots that are not n * slots_per_expert."""
    if not native_routing_applies(x, phi, scale) or needs_grad(x, phi, scale):
        return None
    isa, scale = _checked(x, phi, scale, normalize)
    check_choice("phi", phi.shape[1], slots_per_expert, k)
    inputs = (x, phi, scale, normalize, slots_per_expert, k, with_selected, isa)
    route = _run_routing_top_k if direct_call_ok("cpu", x, phi, scale) else torch.ops.softmoe.soft_moe_routing_top_k
    dispatch, combine, slots, selected = route(*inputs)
    return dispatch, combine, slots, selected if with_selected else None


@torch.library.custom_op("softmoe::soft_moe_routing_top_k", mutates_args=(), device_types="cpu")
def soft_moe_routing_top_k_op(
    x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str, slots_per_expert: int, k: int, with_selected: bool,
    isa: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Inference's routing with Algorithm 1's choice (:func:`soft_moe_routing_top_k`): (dispatch, combine, kept slots
    as bits, selected (batch, k), or (batch, 0) without ``with_selected``). No backward."""
    return _run_routing_top_k(x, phi, scale, normalize, slots_per_expert, k, with_selected, isa)


def _run_routing_top_k(x, phi, scale, normalize, slots_per_expert, k, with_selected, isa):
    dispatch, combine, slots, selected = native_module().soft_moe_routing_top_k(
        x, phi, scale, ROUTING_MODES[normalize], isa, _products_in_onednn(x, phi), slots_per_expert, k, with_selected)
    return dispatch, combine, slots, selected if with_selected else x.new_empty((x.shape[0], 0), dtype=torch.int64)


@soft_moe_routing_top_k_op.register_fake
def _(x, phi, scale, normalize, slots_per_expert, k, with_selected, isa):
    shape = (*x.shape[:2], phi.shape[1])
    words = (phi.shape[1] + 63) // 64
    return (x.new_empty(shape), x.new_empty(shape), x.new_empty((x.shape[0], words), dtype=torch.int64),
            x.new_empty((x.shape[0], k if with_selected else 0), dtype=torch.int64))


def _checked(x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str) -> tuple[str, Tensor | None]:
    """The variant to run and the scale the kernel takes (None for "none"), after checking the arguments."""
    if normalize not in ROUTING_MODES:
        raise ValueError(f"normalize must be one of {tuple(ROUTING_MODES)}, got {normalize!r}")
    if normalize != "none" and (scale is None or scale.numel() != 1):
        raise ValueError(f'normalize="{normalize}" needs a scalar scale, got {scale!r}')
    if x.dim() != 3 or phi.dim() != 2 or x.shape[2] != phi.shape[0]:
        raise ValueError(f"x must be (batch, tokens, dim) and phi (dim, slots), got {tuple(x.shape)} and "
                         f"{tuple(phi.shape)}")
    return required_isa(), scale if normalize != "none" else None
