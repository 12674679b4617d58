"""``softmoe::expert_matmul``: batched matmuls for experts that see few rows each (``csrc/expert_matmul.h``).

A ViT-S Soft MoE layer sends 8 rows through each 384 x 1536 weight, a product bound by memory bandwidth that MKL's
batched matmul reads well below what the memory delivers; these kernels stream the weights close to it
(docs/performance.md has the measurements).

Three custom ops, each with a fake (meta) implementation and an autograd formula (``csrc/autograd.cpp``), so that
torch.compile, ``torch.library.opcheck`` and double backward see them like torch's own ops (they run on float32 CPU
tensors):

    softmoe::expert_matmul(Tensor x, Tensor weight, Tensor? bias, str activation, str isa) -> Tensor
        activation(x @ weight + bias): x (E, rows, K), weight (E, K, N), bias (E, N) -> (E, rows, N); activation
        "none", "gelu", "gelu_tanh" or "relu" (the last three without a backward: inference only)
    softmoe::expert_matmul_nt(Tensor grad, Tensor weight, str isa) -> Tensor
        grad @ weight^T: grad (E, rows, N), weight (E, K, N) -> (E, rows, K)   (the gradient of x)
    softmoe::expert_matmul_tn(Tensor x, Tensor grad, str isa) -> Tensor
        x^T @ grad: x (E, rows, K), grad (E, rows, N) -> (E, K, N)   (the gradient of weight, written with
        non-temporal stores)

``isa`` names the kernel variant ("avx512", "avx2" or "portable", see :mod:`softmoe.kernels.build`); the
gradients of each op are the other two (and a sum for the bias), so the ops are differentiable to any order.
:func:`expert_matmul` is the Python entry point, which passes :func:`~softmoe.kernels.cpu_isa`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.compat import check
from softmoe.kernels.build import native_available, native_module, required_isa
from softmoe.kernels.modes import needs_grad, plain_eager_mode, transforms_active
from softmoe.tuning import value

# The activations expert_matmul can apply to its output (ACT_* of csrc/expert_matmul.h).
NATIVE_ACTIVATIONS = ("gelu", "gelu_tanh", "relu")


def _check_fake(x: Tensor, weight: Tensor, rows_of: str) -> None:
    check(x.dim() == 3 and weight.dim() == 3, lambda: f"{rows_of} and weight must be 3-dimensional")
    check(x.dtype == weight.dtype == torch.float32, lambda: "softmoe's native ops take float32 tensors")
    check(x.shape[0] == weight.shape[0], lambda: "x and weight must have the same number of experts")


# The ops' schemas; their CPU kernels (csrc/bindings.cpp) and autograd (csrc/autograd.cpp) register when the native
# extension loads.
_LIBRARY = torch.library.Library("softmoe", "FRAGMENT")
_LIBRARY.define("expert_matmul(Tensor x, Tensor weight, Tensor? bias, str activation, str isa) -> Tensor")
_LIBRARY.define("expert_matmul_nt(Tensor grad, Tensor weight, str isa) -> Tensor")
_LIBRARY.define("expert_matmul_tn(Tensor x, Tensor grad, str isa) -> Tensor")


def _check_bias(bias: Tensor | None, weight: Tensor) -> None:
    if bias is not None:
        check(bias.shape == (weight.shape[0], weight.shape[2]), lambda: "bias must have shape (E, N)")


@torch.library.register_fake("softmoe::expert_matmul")
def _(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, isa: str) -> Tensor:
    _check_fake(x, weight, "x")
    check(x.shape[2] == weight.shape[1], lambda: "x (E, rows, K) needs weight (E, K, N)")
    _check_bias(bias, weight)
    return x.new_empty(x.shape[0], x.shape[1], weight.shape[2])


@torch.library.register_fake("softmoe::expert_matmul_nt")
def _(grad: Tensor, weight: Tensor, isa: str) -> Tensor:
    _check_fake(grad, weight, "grad")
    check(grad.shape[2] == weight.shape[2], lambda: "grad (E, rows, N) needs weight (E, K, N)")
    return grad.new_empty(grad.shape[0], grad.shape[1], weight.shape[1])


@torch.library.register_fake("softmoe::expert_matmul_tn")
def _(x: Tensor, grad: Tensor, isa: str) -> Tensor:
    _check_fake(x, grad, "x")
    check(x.shape[1] == grad.shape[1], lambda: "x (E, rows, K) needs grad (E, rows, N)")
    return x.new_empty(x.shape[0], x.shape[2], grad.shape[2])


# ---- the Python entry point and where it applies ----------------------------------------------------------------


def reusable_empty(shape: tuple[int, ...], like: Tensor) -> Tensor:
    """An uninitialized tensor of ``shape`` (dtype and device of ``like``) for a large result made again at every
    step, such as a weight gradient. For float32 CPU tensors in plain eager mode with the native build: a block of the
    extension's pool (``csrc/bindings.cpp``, ``reusable_empty``: 32 MB or more, handed out again only once nothing
    else holds it), which spares the fresh pages glibc would map and fault in each time; else ``like.new_empty``."""
    if like.device.type == "cpu" and like.dtype == torch.float32 and plain_eager_mode("cpu") and native_available():
        return native_module().reusable_empty(list(shape))
    return like.new_empty(shape)


def native_applies(x: Tensor, weight: Tensor, rows: int | None = None, max_rows: int | None = None) -> bool:
    """Whether :func:`expert_matmul` serves x (E, rows, K) @ weight (E, K, N): float32 CPU tensors,
    1 to ``max_rows`` rows, at least softmoe.tuning.TABLE's "native_min_weight" weight elements
    per expert, no torch.func transform active (the ops have no vmap rule) and the kernels built. Eager,
    torch.compile and autocast all qualify. ``rows`` overrides x.shape[1], for a caller asking before it has built x;
    ``max_rows`` (by default the table's "native_max_rows", the bound for forward and backward together) is for
    callers that run only the forward product ("native_forward_max_rows")."""
    rows = x.shape[1] if rows is None else rows
    max_rows = value("native_max_rows") if max_rows is None else max_rows
    return (
        x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and 1 <= rows <= max_rows
        and weight.shape[1] * weight.shape[2] >= value("native_min_weight")
        and not transforms_active()
        and native_available()
    )


def expert_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None) -> Tensor:
    """x (E, rows, K) @ weight (E, K, N) (+ bias (E, N)) -> (E, rows, N) with the native kernels, differentiable.

    For experts that see few rows (about 8 in a ViT-S Soft MoE layer) the product is bound by memory bandwidth:
    the kernels stream each weight once, where MKL's batched matmul reads it more slowly; the backward uses the
    same kernels (g @ w^T, x^T @ g, the weight gradient written with non-temporal stores). Only where
    :func:`native_applies`; runs ``softmoe::expert_matmul`` with the variant :func:`~softmoe.kernels.cpu_isa` names.

    ``activation`` ("gelu", "gelu_tanh" or "relu") is applied to the product inside the kernel while its output is
    still in cache (gelu's erf to about 2e-7); that output has no backward, so it is for inference only: a
    ValueError when a gradient would be needed.
    """
    if activation is not None:
        if activation not in NATIVE_ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(NATIVE_ACTIVATIONS)} or None, got {activation!r}")
        if needs_grad(x, weight, bias):
            raise ValueError("a fused activation has no backward: call expert_matmul without it when training")
    isa = required_isa()
    return torch.ops.softmoe.expert_matmul(x, weight, bias, activation or "none", isa)
