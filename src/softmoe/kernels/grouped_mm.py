"""``softmoe::grouped_mm``: rows sorted by expert, each expert's block times that expert's weight.

    x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32 (cumulative row counts: expert j owns rows
    ends[j-1]:ends[j]), optional bias (E, N) and activation -> out (rows, N) with
    out[ends[j-1]:ends[j]] = act(x[ends[j-1]:ends[j]] @ weight[j] + bias[j]); rows past ends[-1] belong to no
    expert: they are never read and their output (and gradient) is zero

``activation`` ("none", "gelu", "gelu_tanh" or "relu") is for inference, where a kernel can apply it to the product
while it is still in registers (softmoe::native_grouped_mm's); it has no backward (a ValueError where autograd would
need one).

An expert with no rows costs nothing. It is a registered custom op, so torch.compile keeps it as one node whatever
the (data-dependent) group sizes, and it never recompiles for a new pattern of sizes. Where it runs:

- CUDA, bfloat16, K and N multiples of 8, torch 2.8 or later: torch's grouped GEMM (``softmoe.compat.grouped_gemm``),
  no host synchronization, for the weight's gradient too;
- elsewhere one torch product per non-empty expert (the group sizes are read on the host: free on CPU, one
  synchronization on a GPU).

The "cpu" backend runs the same contract with softmoe's CPU kernels for each expert's product
(``softmoe::native_grouped_mm``, :mod:`softmoe.kernels.native_grouped_mm`); the "cuda" backend takes
``softmoe::skinny_grouped_mm`` for few rows (:mod:`softmoe.kernels.skinny_grouped_mm`: a Triton kernel). This op is
the generic one: torch's products only.

Differentiable in x, weight and bias (``softmoe::grouped_mm_weight_grad`` gives the weight's gradient;
:func:`register_grouped_autograd` registers the same backward for every op of this contract).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from softmoe.activations import ACTIVATIONS
from softmoe.compat import grouped_gemm, has_grouped_gemm

# A grouped product: (x, weight, ends, bias, activation) -> out, with this module's contract (grouped_mm,
# softmoe::native_grouped_mm and softmoe::skinny_grouped_mm).
GroupedProduct = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, str], torch.Tensor]


def finish(out: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(out + bias): out (rows, N), bias (N,) or None, activation "none" or a name of ACTIVATIONS."""
    if bias is not None:
        out = out + bias
    return out if activation == "none" else ACTIVATIONS[activation](out)


def uses_grouped_gemm(a: torch.Tensor, b: torch.Tensor, k: int, n: int) -> bool:
    """Whether torch's grouped GEMM serves products of ``a`` and ``b`` blocks with inner size ``k`` into ``n``
    columns: CUDA bfloat16 with k and n multiples of 8 (every block's start then aligned to 16 bytes)."""
    return a.is_cuda and a.dtype == b.dtype == torch.bfloat16 and k % 8 == 0 and n % 8 == 0 and has_grouped_gemm()


def check_grouped(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> None:
    """Raise a ValueError unless x (rows, K), weight (E, K, N), ends (E,) int32 and bias (E, N) fit together and
    ``activation`` is "none" or one of ACTIVATIONS."""
    if bias is not None and bias.shape != (weight.shape[0], weight.shape[2]):
        raise ValueError(f"bias must have shape {(weight.shape[0], weight.shape[2])}, got {tuple(bias.shape)}")
    if activation != "none" and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be 'none' or one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"grouped_mm takes x (rows, K) and weight (E, K, N), got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if ends.dtype != torch.int32 or ends.shape != (weight.shape[0],):
        raise ValueError(
            f"ends must be an int32 tensor of shape ({weight.shape[0]},), got {ends.dtype} {tuple(ends.shape)}"
        )


def _groups(ends: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows."""
    bounds = [0, *ends.tolist()]
    return [(j, bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1) if bounds[j + 1] > bounds[j]]


@torch.library.custom_op("softmoe::grouped_mm", mutates_args=())
def grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32, bias (E, N) -> (rows, N); see the module
    doc. ``activation`` (inference only) is applied to each owned row."""
    check_grouped(x, weight, ends, bias, activation)
    if uses_grouped_gemm(x, weight, weight.shape[1], weight.shape[2]):
        out = grouped_gemm(x.contiguous(), weight, ends)
        group = row_groups(ends, x.shape[0])  # no host read: rows past ends[-1] (group E) are zero
        if bias is not None:
            out = out + torch.cat([bias, bias.new_zeros(1, bias.shape[1])])[group]
        return torch.where((group < weight.shape[0]).unsqueeze(1), finish(out, None, activation), 0.0)
    return grouped_products(x, weight, ends, bias, activation, torch_product)


def torch_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x (rows, K) @ w (K, N) + bias (N,)) in torch's ops."""
    return finish(x @ w, bias, activation)


def grouped_products(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    product: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str], torch.Tensor],
) -> torch.Tensor:
    """The grouped product of the module doc with ``product`` (x_j, weight_j, bias_j, activation) -> out_j for each
    expert with rows, the group sizes read on the host; zero rows past ends[-1]."""
    out = x.new_empty(x.shape[0], weight.shape[2])
    groups = _groups(ends)
    for j, start, stop in groups:
        out[start:stop] = product(x[start:stop], weight[j], None if bias is None else bias[j], activation)
    out[groups[-1][2] if groups else 0 :] = 0.0
    return out


def grouped_fake(check: Callable[..., None]) -> GroupedProduct:
    """The fake (meta) implementation of an op with :func:`grouped_mm`'s contract whose arguments ``check`` checks
    (this module's, ``softmoe::native_grouped_mm`` and ``softmoe::skinny_grouped_mm``): the (rows, N) output in x's
    dtype."""

    def fake(
        x: torch.Tensor,
        weight: torch.Tensor,
        ends: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str = "none",
    ) -> torch.Tensor:
        check(x, weight, ends, bias, activation)
        return x.new_empty(x.shape[0], weight.shape[2])

    return fake


grouped_mm.register_fake(grouped_fake(check_grouped))


def row_groups(ends: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert owning each of ``rows`` rows -> (rows,) int64, E for the rows past ends[-1]; no host read."""
    return torch.searchsorted(ends, torch.arange(rows, device=ends.device, dtype=ends.dtype), right=True)


@torch.library.custom_op("softmoe::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor, experts: int) -> torch.Tensor:
    """The weight's gradient of :func:`grouped_mm`: x (rows, K), grad (rows, N) -> (experts, K, N); zero for an
    expert with no rows. On CUDA in bfloat16 one grouped GEMM over the row groups (no host synchronization)."""
    if uses_grouped_gemm(x, grad, x.shape[1], grad.shape[1]):
        return grouped_gemm(x.contiguous().t(), grad.contiguous(), ends)
    out = x.new_zeros(experts, x.shape[1], grad.shape[1])
    for j, start, stop in _groups(ends):
        out[j] = x[start:stop].t() @ grad[start:stop]
    return out


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor, experts: int) -> torch.Tensor:
    return x.new_empty(experts, x.shape[1], grad.shape[1])


def register_grouped_autograd(op, name: str) -> None:
    """Register the backward of ``op`` (called ``name``), a custom op with :func:`grouped_mm`'s contract (this module's,
    ``softmoe::native_grouped_mm`` and ``softmoe::skinny_grouped_mm``): x's gradient through ``op`` itself with
    the transposed weight (a view), the weight's through :func:`grouped_mm_weight_grad`, the bias's each expert's
    rows of the gradient summed. A fused activation has no backward: a ValueError where autograd would need one."""

    def setup_context(ctx, inputs, output) -> None:
        x, weight, ends, bias, activation = inputs
        if activation != "none":
            raise ValueError(
                f"{name}'s activation ({activation!r}) has no backward: apply it after the product "
                "when a gradient is needed"
            )
        ctx.save_for_backward(x, weight, ends)
        ctx.bias_needs_grad = bias is not None and bias.requires_grad

    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = op(grad, weight.transpose(1, 2), ends)
        if ctx.needs_input_grad[1]:
            grad_weight = grouped_mm_weight_grad(x, grad, ends, weight.shape[0])
        if ctx.bias_needs_grad:  # each expert's rows summed; the rows past ends[-1] (group E) dropped
            experts = weight.shape[0]
            grad_bias = grad.new_zeros(experts + 1, grad.shape[1]).index_add_(0, row_groups(ends, grad.shape[0]), grad)
            grad_bias = grad_bias[:experts]
        return grad_x, grad_weight, None, grad_bias, None

    op.register_autograd(backward, setup_context=setup_context)


register_grouped_autograd(grouped_mm, "grouped_mm")
