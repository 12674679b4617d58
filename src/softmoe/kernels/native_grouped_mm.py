"""``softmoe::native_grouped_mm``: :mod:`softmoe.kernels.grouped_mm`'s contract with softmoe's CPU kernels.

    softmoe::native_grouped_mm(Tensor x, Tensor weight, Tensor ends, Tensor? bias=None, str activation="none")
        -> Tensor

The same arguments, results (to rounding) and backward as ``softmoe::grouped_mm``; what differs is the kernel of each
expert's product, chosen per group by its shape. On the CPU a large weight (K * N at least softmoe.tuning.TABLE's
"large_weight") read by up to its "native_forward_max_rows" rows through a contiguous float32 weight takes softmoe's
native expert matmul (bias and activation applied in its registers); other products of a large weight take oneDNN
where it pays on this CPU (float32 inference; :func:`softmoe.kernels.onednn.onednn_pays`: enough FLOPs, on a CPU
where oneDNN outruns MKL), else torch's product (MKL), as everything off the CPU does.
``benchmarks/bench_products.py --isa avx512,avx2`` compares the kernels (docs/performance.md has the measurements).

The "cpu" backend runs Algorithm 1's selected plan through it (:meth:`softmoe.backends.Backend.selected_product`).
"""

from __future__ import annotations

import torch

from softmoe.kernels.build import cpu_isa
from softmoe.kernels.expert_matmul import native_applies
from softmoe.kernels.grouped_mm import (
    check_grouped,
    finish,
    grouped_fake,
    grouped_products,
    register_grouped_autograd,
    torch_product,
)
from softmoe.kernels.onednn import onednn_applies, onednn_linear, onednn_pays
from softmoe.tuning import value


@torch.library.custom_op("softmoe::native_grouped_mm", mutates_args=())
def native_grouped_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    ends: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """x (rows, K) sorted by expert, weight (E, K, N), ends (E,) int32, bias (E, N) -> (rows, N); each expert's
    product in the kernel :func:`group_product` picks (module doc)."""
    check_grouped(x, weight, ends, bias, activation)
    return grouped_products(x, weight, ends, bias, activation, group_product)


native_grouped_mm.register_fake(grouped_fake(check_grouped))
register_grouped_autograd(native_grouped_mm, "native_grouped_mm")


def group_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """act(x (rows, K) @ w (K, N) + bias (N,)) with the fastest kernel for few rows through a large CPU weight
    (module doc); the native kernel and oneDNN apply bias and activation themselves."""
    if native_serves(x, w[None], x.shape[0]):
        return native_product(x, w, bias, activation)
    large = x.device.type == "cpu" and w.numel() >= value("large_weight")
    if large and onednn_applies(x, w) and onednn_pays(2 * x.shape[0] * w.numel()):
        return onednn_linear(x, w, bias, None if activation == "none" else activation)
    return torch_product(x, w, bias, activation)


def native_serves(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """Whether :func:`group_product` runs ``rows`` rows of x (rows, K) through each weight of ``weight`` (E, K, N) in
    the native expert matmul (module doc)."""
    return (
        x.device.type == "cpu"
        and weight.shape[1] * weight.shape[2] >= value("large_weight")
        and weight.is_contiguous()
        and native_applies(x[None], weight, rows=rows, max_rows=value("native_forward_max_rows"))
    )


def native_product(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """act(x (rows, K) @ w (K, N) + bias (N,)) in the native expert matmul (float32 CPU, w contiguous).

    The kernel splits one row's product by the weight's rows (K) over the threads itself, more rows by columns; for
    those a weight taller than wide is split by rows instead, so that each thread streams one contiguous part of it,
    bias and activation then applied to the summed product."""
    if splits_itself(x.shape[0], w):
        b = None if bias is None else bias[None]
        return torch.ops.softmoe.expert_matmul(x[None], w[None], b, activation, cpu_isa())[0]
    return finish(row_block_matmul(x, w, torch.get_num_threads()), bias, activation)


def splits_itself(rows: int, w: torch.Tensor) -> bool:
    """Whether the native kernel alone runs ``rows`` rows through w (..., K, N) as :func:`native_product` would: one
    row, or a weight no taller than wide."""
    return rows == 1 or w.shape[-2] <= w.shape[-1]


def row_block_matmul(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    """x (rows, K) @ w (K, N) -> (rows, N) in the native expert matmul (float32 CPU, w contiguous), w cut into
    ``blocks`` contiguous blocks of K/blocks rows.

    The blocks (views of w, no copy) run as one batched product, which the kernel spreads over its threads one block
    each, each streaming its own contiguous part of w, and their partial products are summed. One block when
    ``blocks`` does not divide K.
    """
    rows, k = x.shape
    if k % blocks:
        blocks = 1
    xb, wb = x.reshape(rows, blocks, k // blocks).transpose(0, 1), w.view(blocks, k // blocks, -1)
    return torch.ops.softmoe.expert_matmul(xb.contiguous(), wb, None, "none", cpu_isa()).sum(0)
