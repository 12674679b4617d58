"""``softmoe::grouped_mm``: rows sorted by expert, each expert's block times that expert's weight.

    x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32 (cumulative row counts: expert j owns rows
    ends[j-1]:ends[j]) -> out (rows, N) with out[ends[j-1]:ends[j]] = x[ends[j-1]:ends[j]] @ weight[j]; rows past
    ends[-1] belong to no expert: they are never read and their output (and gradient) is zero

An expert with no rows costs nothing. It is a registered custom op, so torch.compile keeps it as one node whatever
the (data-dependent) group sizes, and it never recompiles for a new pattern of sizes. Where it runs:

- CUDA, bfloat16, K and N multiples of 8: torch's grouped GEMM (``torch._grouped_mm``), no host synchronization,
  for the weight's gradient too;
- elsewhere one product per non-empty expert (the group sizes are read on the host: free on CPU, one
  synchronization on a GPU). On CPU a large weight (K * N >= LARGE_WEIGHT) read by 1-3 rows takes one contiguous
  block of the weight per thread (1.2-1.5x MKL's rate); more rows take MKL on Intel CPUs and oneDNN on others
  (float32 inference): MKL's fast code paths are Intel's. Measured at 8-100 rows through 768 x 6144 and 768 x
  30720 weights: on an AMD EPYC oneDNN ran 1.5-2x MKL's rate, on an Intel Xeon (AVX-512) MKL ran 1.2-1.7x
  oneDNN's.

Differentiable in x and weight (``softmoe::grouped_mm_weight_grad`` gives the weight's gradient).
"""

from __future__ import annotations

import torch

from softmoe.kernels.build import cpu_isa
from softmoe.kernels.expert_matmul import native_applies
from softmoe.kernels.onednn import onednn_applies, onednn_linear
from softmoe.runtime import intel_cpu

# A weight of at least LARGE_WEIGHT elements run by few CPU rows takes the faster kernels above; fewer than
# BLAS_MIN_ROWS rows (where the native kernel does not serve them) take row blocks, more MKL or oneDNN.
LARGE_WEIGHT = 1 << 20
BLAS_MIN_ROWS = 4


def row_block_matmul(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    """x (rows, K) @ w (K, N) -> (rows, N), w cut into ``blocks`` contiguous blocks of K/blocks rows.

    The blocks (views of w, no copy) run as one batched matmul, which threaded BLAS spreads over its threads
    one matrix each, and their partial products are summed. Plain matmul when ``blocks`` does not divide K.
    """
    rows, k = x.shape
    if blocks == 1 or k % blocks or not w.is_contiguous():
        return x @ w
    return torch.bmm(x.reshape(rows, blocks, k // blocks).transpose(0, 1), w.view(blocks, k // blocks, -1)).sum(0)


def group_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (rows, K) @ w (K, N) with the fastest kernel for few rows through a large CPU weight (module doc)."""
    if x.device.type != "cpu" or w.numel() < LARGE_WEIGHT:
        return x @ w
    if w.is_contiguous() and native_applies(x[None], w[None]):
        return torch.ops.softmoe.expert_matmul(x[None], w[None], None, "none", cpu_isa())[0]
    if x.shape[0] < BLAS_MIN_ROWS:
        return row_block_matmul(x, w, torch.get_num_threads())
    if not intel_cpu() and onednn_applies(x, w):
        return onednn_linear(x, w)
    return x @ w


def uses_grouped_gemm(a: torch.Tensor, b: torch.Tensor, k: int, n: int) -> bool:
    """Whether torch's grouped GEMM serves products of ``a`` and ``b`` blocks with inner size ``k`` into ``n``
    columns: CUDA bfloat16 with k and n multiples of 8 (every block's start then aligned to 16 bytes)."""
    return a.is_cuda and a.dtype == b.dtype == torch.bfloat16 and k % 8 == 0 and n % 8 == 0


def check_grouped(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> None:
    """Raise a ValueError unless x (rows, K), weight (E, K, N) and ends (E,) int32 fit together."""
    if x.dim() != 2 or weight.dim() != 3 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"grouped_mm takes x (rows, K) and weight (E, K, N), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if ends.dtype != torch.int32 or ends.shape != (weight.shape[0],):
        raise ValueError(f"ends must be an int32 tensor of shape ({weight.shape[0]},), got {ends.dtype} "
                         f"{tuple(ends.shape)}")


def _groups(ends: torch.Tensor) -> list[tuple[int, int, int]]:
    """(expert, first row, end row) of every expert with rows."""
    bounds = [0, *ends.tolist()]
    return [(j, bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1) if bounds[j + 1] > bounds[j]]


@torch.library.custom_op("softmoe::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32 -> (rows, N); see the module doc."""
    check_grouped(x, weight, ends)
    if uses_grouped_gemm(x, weight, weight.shape[1], weight.shape[2]):
        out = torch._grouped_mm(x.contiguous(), weight, offs=ends)
        owned = torch.arange(x.shape[0], device=x.device) < ends[-1]  # no host read: rows past ends[-1] are zero
        return torch.where(owned.unsqueeze(1), out, 0.0)
    out = x.new_empty(x.shape[0], weight.shape[2])
    groups = _groups(ends)
    for j, start, stop in groups:
        out[start:stop] = group_product(x[start:stop], weight[j])
    out[groups[-1][2] if groups else 0 :] = 0.0
    return out


@grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    check_grouped(x, weight, ends)
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("softmoe::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor, experts: int) -> torch.Tensor:
    """The weight's gradient of :func:`grouped_mm`: x (rows, K), grad (rows, N) -> (experts, K, N); zero for an
    expert with no rows. On CUDA in bfloat16 one grouped GEMM over the row groups (no host synchronization)."""
    if uses_grouped_gemm(x, grad, x.shape[1], grad.shape[1]):
        return torch._grouped_mm(x.contiguous().t(), grad.contiguous(), offs=ends)
    out = x.new_zeros(experts, x.shape[1], grad.shape[1])
    for j, start, stop in _groups(ends):
        out[j] = x[start:stop].t() @ grad[start:stop]
    return out


@grouped_mm_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor, experts: int) -> torch.Tensor:
    return x.new_empty(experts, x.shape[1], grad.shape[1])


def _setup_context(ctx, inputs, output) -> None:
    x, weight, ends = inputs
    ctx.save_for_backward(x, weight, ends)


def _backward(ctx, grad: torch.Tensor):
    x, weight, ends = ctx.saved_tensors
    grad_x = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_x = grouped_mm(grad, weight.transpose(1, 2), ends)
    if ctx.needs_input_grad[1]:
        grad_weight = grouped_mm_weight_grad(x, grad, ends, weight.shape[0])
    return grad_x, grad_weight, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
