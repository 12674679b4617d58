"""The Triton kernels behind ``softmoe::skinny_grouped_mm`` (:mod:`softmoe.kernels.skinny_grouped_mm`).

Imported only when the op runs (softmoe itself imports Triton nowhere else); without Triton the module still imports
and defines no kernel (the op says Triton is missing before it gets here).

A product of few rows through large weights is bound by reading the weights, so the grid is cut along the weight: one
program per (expert, BLOCK_N columns, one of SPLIT_K ranges of K). Each program reads its expert's row range from
``ends`` itself (no host synchronization: CUDA graphs can capture it), does nothing where the expert owns no rows (its
row loop is empty: a skipped expert costs a launch slot, not a read of its weight), and streams its BLOCK_K x BLOCK_N
tiles of the weight once for all the expert's rows (BLOCK_M covers them all in the op's skinny range), accumulating in
float32. The weight is read through its strides, so a transposed view (the backward's ``weight.transpose(1, 2)``) needs
no copy. Nothing is added atomically, so a result never depends on the order programs run in: with one K range the
program applies bias and activation and writes the output; with SPLIT_K ranges each writes its float32 partial product
and a second kernel sums the partials in a fixed order before the bias and activation.
"""

from __future__ import annotations

import torch

from softmoe.kernels.skinny_grouped_mm import SkinnyConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the op checks for Triton before it launches anything
    triton = None


def _row_range(ends, expert):
    """Expert ``expert``'s rows [start, stop), from the cumulative row counts ``ends``."""
    start = tl.load(ends + expert - 1, mask=expert > 0, other=0)
    return start, tl.load(ends + expert)


def _finish(acc, bias, expert, cols, n, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """act(acc + bias[expert]) for a (rows, BLOCK_N) float32 block of the columns ``cols``."""
    if HAS_BIAS:
        acc += tl.load(bias + expert * n + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "relu":
        acc = tl.maximum(acc, 0.0)
    elif ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))  # (1 / sqrt(2))
    elif ACTIVATION == "gelu_tanh":  # 0.5 (1 + tanh(z)) = sigmoid(2 z), z = sqrt(2 / pi) (acc + 0.044715 acc^3)
        acc = acc * tl.sigmoid(1.5957691216057308 * (acc + 0.044715 * acc * acc * acc))  # (2 sqrt(2 / pi))
    return acc


def skinny_grouped_mm_kernel(
    x,
    weight,
    ends,
    bias,
    out,
    n,
    k,
    k_per_split,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    WIDEN: tl.constexpr,
    FINISH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """One (expert, column block, K range) of x @ weight[expert] over the expert's rows. With FINISH ``out`` is the
    (rows, n) output (bias and activation applied), else the (SPLIT_K, rows, n) float32 partial products."""
    expert, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, stop = _row_range(ends, expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, k)
    w = weight + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn
    out += split.to(tl.int64) * stride_split
    for m in range(start, stop, BLOCK_M):
        rows = (m + tl.arange(0, BLOCK_M)).to(tl.int64)
        owned = rows[:, None] < stop
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_begin, k_end, BLOCK_K):
            ks = kk + tl.arange(0, BLOCK_K)
            a = x + rows[:, None] * stride_xm + ks[None, :] * stride_xk
            a = tl.load(a, mask=owned & (ks[None, :] < k_end), other=0.0)
            b = tl.load(w + ks[:, None] * stride_wk, mask=(ks[:, None] < k_end) & (cols[None, :] < n), other=0.0)
            if WIDEN:  # Triton's interpreter multiplies bfloat16 operands' raw bits (triton-lang/triton#11584)
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if FINISH:
            acc = _finish(acc, bias, expert, cols, n, HAS_BIAS, ACTIVATION)
        tl.store(out + rows[:, None] * n + cols[None, :], acc, mask=owned & (cols[None, :] < n))


def sum_partials_kernel(
    partial,
    ends,
    bias,
    out,
    n,
    split_k,
    stride_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,
):
    """One (expert, column block) of the output: the ``split_k`` partial products summed in order, then bias and
    activation."""
    expert, tile = tl.program_id(0), tl.program_id(1)
    start, stop = _row_range(ends, expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    for m in range(start, stop, BLOCK_M):
        rows = (m + tl.arange(0, BLOCK_M)).to(tl.int64)
        inside = (rows[:, None] < stop) & (cols[None, :] < n)
        offsets = rows[:, None] * n + cols[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for split in range(split_k):  # in order: the same bits whatever order the programs ran in
            acc += tl.load(partial + split * stride_split + offsets, mask=inside, other=0.0)
        tl.store(out + offsets, _finish(acc, bias, expert, cols, n, HAS_BIAS, ACTIVATION), mask=inside)


if triton is not None:
    _row_range = triton.jit(_row_range)
    _finish = triton.jit(_finish)
    skinny_grouped_mm_kernel = triton.jit(skinny_grouped_mm_kernel)
    sum_partials_kernel = triton.jit(sum_partials_kernel)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    config: SkinnyConfig,
) -> torch.Tensor:
    """act(x @ weight[j] + bias[j]) over each expert j's rows (the op's contract, arguments checked) with the
    kernels' tiles and split of K from ``config``, on x's device (CUDA, or the CPU in Triton's interpreter)."""
    device = x.device.index
    if device is not None and device != torch.cuda.current_device():  # Triton launches on the current device
        # (None: CPU tensors in Triton's interpreter)
        with torch.cuda.device(device):
            return launch(x, weight, ends, bias, activation, config)
    rows, k = x.shape
    experts, _, n = weight.shape
    out = x.new_zeros(rows, n)  # the rows past ends[-1] stay zero: no program owns them
    if out.numel() == 0 or experts == 0:
        return out
    split, tiles = config.split_k, triton.cdiv(n, config.block_n)
    target = out if split == 1 else x.new_empty(split, rows, n, dtype=torch.float32)
    # Both kernels' epilogue: bias (a tensor of the output when there is none, not read) and activation.
    epilogue = {"HAS_BIAS": bias is not None, "ACTIVATION": activation}
    bias, ends = out if bias is None else bias.contiguous(), ends.contiguous()
    # bfloat16 products widened to float32 (exactly) where the interpreter runs them; float32 ones in IEEE float32.
    widen = x.dtype == torch.bfloat16 and x.device.type == "cpu"
    # With Triton the names are rebound to triton.jit's kernels (launched by subscript), mypy knows the functions.
    skinny_grouped_mm_kernel[(experts, tiles, split)](  # type: ignore[misc, valid-type]
        x,
        weight,
        ends,
        bias,
        target,
        n,
        k,
        config.k_per_split,
        *x.stride(),
        *weight.stride(),
        rows * n,
        BLOCK_M=config.block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        PRECISION="ieee" if x.dtype == torch.float32 or widen else "tf32",  # (16-bit: tensor cores either way)
        WIDEN=widen,
        FINISH=split == 1,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **epilogue,
    )
    if split > 1:
        sum_partials_kernel[(experts, tiles)](  # type: ignore[misc, valid-type]
            target, ends, bias, out, n, split, rows * n, BLOCK_M=config.block_m, BLOCK_N=config.block_n, **epilogue
        )
    return out
