"""The Triton kernel behind ``softmoe::routing_softmaxes`` on CUDA (:mod:`softmoe.kernels.routing_softmaxes`).

Imported only where the op runs its kernel, so that ``import softmoe`` never loads Triton; without Triton the
module defines no kernel (and the op never asks for one: ``KERNEL.available()``). One program per input
holds that input's (tokens x slots) logits (with ``NORMALIZE``, each token's row first divided by the L2 norm of its
token, read from the tokens in blocks of columns) and writes both softmaxes; with ``CHOOSE`` it also sums the combine
weights over tokens and each expert's slots, ranks the experts (NaN first, then the largest, ties to the lower
index: :func:`softmoe.topk.top_k`'s rule), zeroes the combine weights of the slots outside the k first and writes
their indices in ascending order. :func:`launch` runs it through Triton's JIT, which compiles it at the first
launch of a shape.
"""

from __future__ import annotations

import torch

from softmoe.kernels.routing_softmaxes import NORM_EPS, block_size

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the op takes torch's ops (KERNEL.available())
    triton = None


def routing_softmaxes_kernel(
    logits,
    x,
    dispatch,
    combine,
    selected,
    tokens,
    slots,
    slots_per_expert,
    num_experts,
    k,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHOOSE: tl.constexpr,
    NORMALIZE: tl.constexpr,
    DIM: tl.constexpr,
    EPS: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)[:, None]
    s = tl.arange(0, BLOCK_S)[None, :]
    inside = (t < tokens) & (s < slots)
    offsets = b.to(tl.int64) * tokens * slots + t * slots + s
    z = tl.load(logits + offsets, mask=inside, other=float("-inf"))
    if NORMALIZE:  # each token's row times rsqrt(sum x^2 + EPS), its sums over BLOCK_D columns of x at a time
        squares = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        rows = x + b.to(tl.int64) * tokens * DIM + t * DIM
        for start in range(0, DIM, BLOCK_D):
            d = start + tl.arange(0, BLOCK_D)[None, :]
            v = tl.load(rows + d, mask=(t < tokens) & (d < DIM), other=0.0).to(tl.float32)
            squares += v * v
        z = z * tl.rsqrt(tl.sum(squares, axis=1)[:, None] + EPS)

    e = tl.exp(z - tl.max(z, axis=0)[None, :])  # dispatch: softmax over the tokens
    # (the stores round to the outputs' dtype)
    tl.store(dispatch + offsets, e / tl.sum(e, axis=0)[None, :], mask=inside)
    e = tl.exp(z - tl.max(z, axis=1)[:, None])  # combine: softmax over the slots
    c = e / tl.sum(e, axis=1)[:, None]

    if CHOOSE:
        slot_sums = tl.sum(tl.where(inside, c, 0.0), axis=0)  # (BLOCK_S,)
        expert = tl.arange(0, BLOCK_E)
        owns = (tl.arange(0, BLOCK_S)[None, :] // slots_per_expert) == expert[:, None]  # (BLOCK_E, BLOCK_S)
        score = tl.sum(tl.where(owns, slot_sums[None, :], 0.0), axis=1)  # (BLOCK_E,)
        # Rows: expert e; columns: expert j. j goes before e: NaN before numbers, then larger, then lower index.
        nan_e, nan_j = (score != score)[:, None], (score != score)[None, :]
        num_e, num_j = (score == score)[:, None], (score == score)[None, :]
        s_e, s_j = score[:, None], score[None, :]
        lower = expert[None, :] < expert[:, None]
        ahead = (nan_j & num_e) | (nan_j & nan_e & lower) | (num_j & num_e & ((s_j > s_e) | ((s_j == s_e) & lower)))
        ahead = ahead & (expert[None, :] < num_experts)
        keep = (tl.sum(ahead.to(tl.int32), axis=1) < k) & (expert < num_experts)  # (BLOCK_E,)
        place = tl.sum((lower & keep[None, :]).to(tl.int32), axis=1)  # kept experts below e
        tl.store(selected + b.to(tl.int64) * k + place, expert.to(tl.int64), mask=keep)
        kept_slot = tl.sum((owns & keep[:, None]).to(tl.int32), axis=0) > 0  # (BLOCK_S,)
        c = tl.where(kept_slot[None, :], c, 0.0)
    tl.store(combine + offsets, c, mask=inside)


if triton is not None:
    routing_softmaxes_kernel = triton.jit(routing_softmaxes_kernel)


def launch(
    logits, dispatch, combine, selected, slots_per_expert: int, k: int, choose: bool, x=None, eps: float = NORM_EPS
) -> None:
    """Run the kernel over ``logits`` (batch, tokens, slots) float32 contiguous into the outputs (same shapes,
    dispatch and combine of one floating dtype, which the kernel rounds to; selected (batch, k) int64, not written
    unless ``choose``), one program per input, on the logits' device; with ``x`` (batch, tokens, dim) contiguous,
    each token's logits are first multiplied by ``rsqrt(sum(x^2) + eps)`` over its dim. Triton's JIT compiles the
    kernel at the first launch of a shape and caches it."""
    batch, tokens, slots = logits.shape
    device = logits.device.index
    if device is not None and device != torch.cuda.current_device():  # Triton launches on the current device
        # (None: CPU tensors in Triton's interpreter)
        with torch.cuda.device(device):
            return launch(logits, dispatch, combine, selected, slots_per_expert, k, choose, x, eps)
    if not choose:
        selected = dispatch  # (not written)
    normalize = x is not None
    if not normalize:
        x = logits  # (not read)
    num_experts = slots // slots_per_expert
    block_t, block_s = block_size(tokens), block_size(slots)
    # With Triton the name is rebound to triton.jit's kernel (launched by subscript), mypy knows only the function.
    routing_softmaxes_kernel[(batch,)](  # type: ignore[misc, valid-type]
        logits,
        x,
        dispatch,
        combine,
        selected,
        tokens,
        slots,
        slots_per_expert,
        num_experts,
        k,
        BLOCK_T=block_t,
        BLOCK_S=block_s,
        BLOCK_E=block_size(num_experts),
        BLOCK_D=max(16, min(64, 8192 // block_t)),
        CHOOSE=choose,
        NORMALIZE=normalize,
        DIM=x.shape[2] if normalize else 0,
        EPS=eps,
        num_warps=8 if block_t * block_s >= 8192 else 4,
    )
    return None
