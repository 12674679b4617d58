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

    softmoe::soft_moe_routing(Tensor x, Tensor phi, Tensor? scale, str normalize, str isa, bool onednn)
            -> (Tensor logits, Tensor dispatch, Tensor combine, Tensor r)
        x (batch, tokens, dim), phi (dim, slots), scale () (None for "none") -> logits, dispatch, combine
        (batch, tokens, slots) and r (batch, tokens), the tokens' inverse norms the backward reads (ones unless
        "router"; not differentiable)
    softmoe::soft_moe_routing_backward(Tensor? grad_logits, Tensor? grad_dispatch, Tensor? grad_combine, Tensor x,
                                       Tensor phi, Tensor? scale, Tensor logits, Tensor dispatch, Tensor combine,
                                       Tensor r, str normalize, str isa, bool onednn) -> (Tensor, Tensor, Tensor)
        the gradients of x, phi and scale (zero for "none")
    softmoe::soft_moe_routing_top_k(Tensor x, Tensor phi, Tensor? scale, str normalize, int slots_per_expert, int k,
                                    bool with_selected, str isa, bool onednn) -> (Tensor, Tensor, Tensor, Tensor)
        inference's routing with Algorithm 1's choice in the same pass (:func:`soft_moe_routing_top_k`); no backward

``isa`` names the kernel variant, ``onednn`` whether the products larger than the kernel's own run in oneDNN
rather than MKL (both chosen by the entry points below). The CPU kernels are C++ (``csrc/bindings.cpp``), and so is
the routing's autograd (``csrc/autograd.cpp``): eager calls pay no Python beyond the op's call.

The normalizations are the layer's (``softmoe.layer``): "router" (vmoe's: tokens and phi's columns normalized,
epsilon inside the rsqrt), "inputs" (phi's columns divided by their norm plus 1e-6; the tokens arrive normalized)
and "none". A double backward (``create_graph=True``) recomputes the routing with torch's ops and differentiates
those (``softmoe::soft_moe_routing_torch_grads``), so gradient penalties work as with torch's path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.checks import NORMALIZATIONS
from softmoe.kernels.build import native_available, required_isa
from softmoe.kernels.modes import needs_grad, transforms_active
from softmoe.kernels.onednn import onednn_pays
from softmoe.kernels.top_k_combine import check_choice

# The ops' schemas; their CPU kernels (csrc/bindings.cpp) and the routing's autograd (csrc/autograd.cpp) register
# when the native extension loads.
_LIBRARY = torch.library.Library("softmoe", "FRAGMENT")
_LIBRARY.define(
    "soft_moe_routing(Tensor x, Tensor phi, Tensor? scale, str normalize, str isa, bool onednn) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "soft_moe_routing_backward(Tensor? grad_logits, Tensor? grad_dispatch, Tensor? grad_combine, Tensor x, "
    "Tensor phi, Tensor? scale, Tensor logits, Tensor dispatch, Tensor combine, Tensor r, str normalize, "
    "str isa, bool onednn) -> (Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "soft_moe_routing_top_k(Tensor x, Tensor phi, Tensor? scale, str normalize, int slots_per_expert, "
    "int k, bool with_selected, str isa, bool onednn) -> (Tensor, Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "soft_moe_routing_torch_grads(Tensor? grad_logits, Tensor? grad_dispatch, Tensor? grad_combine, "
    "Tensor x, Tensor phi, Tensor? scale, str normalize) -> (Tensor, Tensor, Tensor)"
)


@torch.library.register_fake("softmoe::soft_moe_routing")
def _(x, phi, scale, normalize, isa, onednn):
    shape = (*x.shape[:2], phi.shape[1])
    return x.new_empty(shape), x.new_empty(shape), x.new_empty(shape), x.new_empty(x.shape[:2])


@torch.library.register_fake("softmoe::soft_moe_routing_backward")
def _(grad_logits, grad_dispatch, grad_combine, x, phi, scale, logits, dispatch, combine, r, normalize, isa, onednn):
    return x.new_empty(x.shape), phi.new_empty(phi.shape), x.new_empty(())


@torch.library.register_fake("softmoe::soft_moe_routing_top_k")
def _(x, phi, scale, normalize, slots_per_expert, k, with_selected, isa, onednn):
    shape = (*x.shape[:2], phi.shape[1])
    words = (phi.shape[1] + 63) // 64
    return (
        x.new_empty(shape),
        x.new_empty(shape),
        x.new_empty((x.shape[0], words), dtype=torch.int64),
        x.new_empty((x.shape[0], k if with_selected else 0), dtype=torch.int64),
    )


def _torch_routing_grads(grad_logits, grad_dispatch, grad_combine, x, phi, scale, normalize):
    """The gradients of x, phi and scale (zeros for "none") through the routing recomputed in torch's ops,
    themselves differentiable: the routing's double backward (``create_graph=True``), so that gradient penalties
    work as with torch's path."""
    from softmoe.layer import soft_moe_logits  # the layer module imports this one

    inputs = (x, phi, scale)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    with torch.enable_grad():
        logits = soft_moe_logits(x, phi, scale, normalize)
        outputs = (logits, logits.softmax(dim=1), logits.softmax(dim=-1))
        pairs = [(o, g) for o, g in zip(outputs, (grad_logits, grad_dispatch, grad_combine)) if g is not None]
        found = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True, allow_unused=True
            )
        )
    result = [next(found) if t is not None and t.requires_grad else None for t in inputs]
    grads = [torch.zeros_like(t) if g is None and t is not None else g for t, g in zip(inputs, result)]
    return grads[0], grads[1], grads[2] if scale is not None else x.new_zeros(())


_LIBRARY.impl("soft_moe_routing_torch_grads", _torch_routing_grads, "CompositeImplicitAutograd")


def _products_in_onednn(x: Tensor, phi: Tensor) -> bool:
    """Whether the routing's products (the logits x phi_n, backward the gradients of x and phi_n; all of x's rows
    against phi's columns) run in oneDNN (an argument of the ops, as ``isa`` is)."""
    batch, tokens, dim = x.shape
    return onednn_pays(2 * batch * tokens * dim * phi.shape[1])


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
    logits, dispatch, combine, _ = torch.ops.softmoe.soft_moe_routing.default(
        x, phi, scale, normalize, isa, _products_in_onednn(x, phi)
    )
    return logits, dispatch, combine


def soft_moe_routing_top_k(
    x: Tensor,
    phi: Tensor,
    scale: Tensor | None,
    normalize: str,
    slots_per_expert: int,
    k: int,
    with_selected: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None] | None:
    """Inference's routing with Algorithm 1's choice made in the same native pass, each input's combine weights
    still in cache: (dispatch, combine zero outside the slots of the kept experts, the kept slots as bits (batch,
    ceil(slots / 64)) int64, bit s % 64 of word s // 64 set for each slot s of a kept expert, the kept experts (batch,
    k) int64 ascending, or None without ``with_selected``), what :func:`soft_moe_routing` then
    :func:`~softmoe.kernels.top_k_combine` give (arguments as theirs; the bits are what
    :func:`~softmoe.kernels.soft_moe_mixing` takes as ``kept_slots``). Runs ``softmoe::soft_moe_routing_top_k``.
    None where it does not
    serve: :func:`native_routing_applies` false, or a gradient to record (the op has no backward). A ValueError for
    a k outside [1, n] or slots that are not n * slots_per_expert."""
    if not native_routing_applies(x, phi, scale) or needs_grad(x, phi, scale):
        return None
    isa, scale = _checked(x, phi, scale, normalize)
    check_choice("phi", phi.shape[1], slots_per_expert, k)
    dispatch, combine, slots, selected = torch.ops.softmoe.soft_moe_routing_top_k.default(
        x, phi, scale, normalize, slots_per_expert, k, with_selected, isa, _products_in_onednn(x, phi)
    )
    return dispatch, combine, slots, selected if with_selected else None


def _checked(x: Tensor, phi: Tensor, scale: Tensor | None, normalize: str) -> tuple[str, Tensor | None]:
    """The variant to run and the scale the kernel takes (None for "none"), after checking the arguments."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if normalize != "none" and (scale is None or scale.numel() != 1):
        raise ValueError(f'normalize="{normalize}" needs a scalar scale, got {scale!r}')
    if x.dim() != 3 or phi.dim() != 2 or x.shape[2] != phi.shape[0]:
        raise ValueError(
            f"x must be (batch, tokens, dim) and phi (dim, slots), got {tuple(x.shape)} and {tuple(phi.shape)}"
        )
    return required_isa(), scale if normalize != "none" else None
