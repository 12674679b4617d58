"""``softmoe::skinny_grouped_mm``: :mod:`softmoe.kernels.grouped_mm`'s product in a Triton kernel for few rows.

    softmoe::skinny_grouped_mm(Tensor x, Tensor weight, Tensor ends, Tensor? bias=None, str activation="none")
        -> Tensor
    x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32 (cumulative row counts: expert j owns rows
    ends[j-1]:ends[j]), optional bias (E, N) and activation -> out (rows, N) with
    out[ends[j-1]:ends[j]] = act(x[ends[j-1]:ends[j]] @ weight[j] + bias[j]); rows past ends[-1] belong to no
    expert: they are never read and their output (and gradient) is zero

The contract of ``softmoe::grouped_mm`` (a drop-in: same arguments, same results to rounding, the same backward),
for x, weight and bias of one dtype, bfloat16, float16 or float32 (accumulated in float32; float32 products in
IEEE float32, not TF32), the output in that dtype. ``activation`` ("none", "gelu", "gelu_tanh" or "relu") is for
inference and has no backward, as there.

Algorithm 1 at batch 1 runs its kept experts on a handful of rows, so its products are bound by reading the kept
experts' weights; the kernel (:mod:`softmoe.kernels.skinny_grouped_mm_triton`) is built to stream them: each
program reads the row groups from ``ends`` itself (no host synchronization, CUDA-graph safe), an expert with no rows
costs no read of its weight, and where the output has too few column blocks to occupy the GPU, K is split among
programs whose float32 partial products a second kernel sums in a fixed order (no atomics: the same bits every
run). :func:`skinny_config` chooses the tiles and the split from the shapes and the GPU's SM count.

It runs on CUDA, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set before anything imports Triton:
Triton reads it when it decorates its own functions too; the test suite sets it where there is no GPU), and needs
Triton; elsewhere it raises a ValueError. The "cuda" backend takes it for the selected plan's two expert products
where :func:`skinny_applies` (at most softmoe.tuning.TABLE's "skinny_max_rows" rows); a failed launch (Triton finds no
C compiler for its launcher, say) warns once, leaves softmoe::grouped_mm's computation to the op and the backend's
choice to grouped_mm for the rest of the process.

Differentiable in x, weight and bias: x's gradient through this op with the transposed weight (a view: the kernel
reads the weight through its strides), the weight's through ``softmoe::grouped_mm_weight_grad``.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple

import torch

from softmoe.kernels.grouped_mm import check_grouped, grouped_fake, grouped_mm, register_grouped_autograd
from softmoe.kernels.triton_kernels import TritonKernel
from softmoe.tuning import value

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The kernel's tiles: rows of a block (a power of two from 16, tl.dot's least, up to MAX_BLOCK_M), BLOCK_N columns,
# and BLOCK_K rows of the weight such that a weight tile holds WEIGHT_TILE_BYTES (128 rows of a 16-bit weight, 64
# of a float32 one); small dimensions take the power of two that covers them.
MAX_BLOCK_M = 64
BLOCK_N = 64
WEIGHT_TILE_BYTES = 16 << 10
# K is split until there are PROGRAMS_PER_SM programs per SM with rows (enough loads in flight to cover the memory's
# latency), each keeping at least MIN_K_STEPS BLOCK_K steps (for the loads of one to overlap the next).
PROGRAMS_PER_SM = 4
MIN_K_STEPS = 4
KERNEL = TritonKernel(
    "softmoe.kernels.skinny_grouped_mm_triton",
    "the skinny grouped GEMM kernel",
    "the selected experts' products run in softmoe::grouped_mm",
)


class SkinnyConfig(NamedTuple):
    """The kernel's tiles (rows, columns, K), its split of K (split_k ranges of k_per_split) and Triton's launch
    settings."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    num_warps: int
    num_stages: int


def tile(size: int, most: int) -> int:
    """The power of two at least ``size`` and at least 16, at most ``most``."""
    return min(most, max(16, 1 << (size - 1).bit_length()))


def skinny_config(rows: int, k: int, n: int, experts: int, dtype: torch.dtype, sms: int) -> SkinnyConfig:
    """The tiles and split of K for ``rows`` rows of x (rows, k) through weights (experts, k, n) of ``dtype`` on a
    GPU of ``sms`` SMs (1 in Triton's interpreter, which runs one program at a time).

    At most min(experts, rows) experts own rows, each with ceil(n / block_n) column blocks; K is split into the
    fewest ranges that give PROGRAMS_PER_SM programs per SM, no range shorter than MIN_K_STEPS steps of block_k."""
    block_n = tile(n, BLOCK_N)
    block_k = tile(k, WEIGHT_TILE_BYTES // (BLOCK_N * dtype.itemsize))
    steps = -(-k // block_k)
    tiles = min(experts, rows) * -(-n // block_n)
    split = max(1, min(-(-PROGRAMS_PER_SM * sms // max(tiles, 1)), steps // MIN_K_STEPS))
    k_per_split = max(1, -(-steps // split)) * block_k  # (at least one step: K may be 0)
    return SkinnyConfig(
        block_m=tile(rows, MAX_BLOCK_M),
        block_n=block_n,
        block_k=block_k,
        split_k=max(1, -(-k // k_per_split)),
        k_per_split=k_per_split,
        num_warps=4,
        num_stages=3,
    )


@torch.compiler.assume_constant_result  # (torch.compile takes the answer as it is when it traces)
def kernel_usable() -> bool:
    """Whether the backend may take the kernel: Triton installed and not turned off (``SOFTMOE_TRITON=0``), and no
    launch of it failed in this process."""
    return KERNEL.available()


def skinny_applies(rows: int, dtype: torch.dtype, weight_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the "cuda" backend runs the selected plan's products of ``rows`` rows (groups x rows per group, a
    static shape: no host read) of ``dtype`` through weights of ``weight_dtype`` on ``device`` in this op rather
    than softmoe::grouped_mm: CUDA, one dtype of DTYPES, at most TABLE's "skinny_max_rows" rows, the kernel usable."""
    return (
        device.type == "cuda"
        and dtype == weight_dtype
        and dtype in DTYPES
        and rows <= value("skinny_max_rows")
        and kernel_usable()
    )


def check_skinny(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> None:
    """:func:`~softmoe.kernels.grouped_mm.check_grouped`'s checks, and x, weight and bias of one dtype of DTYPES on
    one device with ends (a ValueError otherwise)."""
    check_grouped(x, weight, ends, bias, activation)
    dtypes = {x.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1 or x.dtype not in DTYPES:
        raise ValueError(
            f"skinny_grouped_mm takes x, weight and bias of one dtype of {[str(d) for d in DTYPES]}, got "
            f"{sorted(str(d) for d in dtypes)}"
        )
    devices = {x.device, weight.device, ends.device} | ({bias.device} if bias is not None else set())
    if len(devices) > 1:
        raise ValueError(f"skinny_grouped_mm takes tensors on one device, got {sorted(map(str, devices))}")


def check_kernel_runs(device: torch.device) -> None:
    """Raise a ValueError unless the kernel runs on ``device`` (CUDA, or the CPU in Triton's interpreter) and Triton
    is installed."""
    if device.type != "cuda" and not (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError(
            f"skinny_grouped_mm: the Triton kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1; got "
            f"tensors on {device}"
        )
    if importlib.util.find_spec("triton") is None:
        raise ValueError("skinny_grouped_mm needs Triton, which is not installed")


@torch.library.custom_op("softmoe::skinny_grouped_mm", mutates_args=())
def skinny_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32, bias (E, N) -> (rows, N); see the module
    doc. ``activation`` (inference only) is applied to each owned row."""
    check_skinny(x, weight, ends, bias, activation)
    check_kernel_runs(x.device)
    if KERNEL.failure is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        config = skinny_config(x.shape[0], weight.shape[1], weight.shape[2], weight.shape[0], x.dtype, sms)
        try:
            return KERNEL.module().launch(x, weight, ends, bias, activation, config)
        except Exception as error:  # e.g. no C compiler for Triton's launcher: grouped_mm from now on
            KERNEL.launch_failed(error)
    return grouped_mm(x, weight, ends, bias, activation)


skinny_grouped_mm.register_fake(grouped_fake(check_skinny))
register_grouped_autograd(skinny_grouped_mm, "skinny_grouped_mm")
