"""The Triton kernel behind ``softmoe::routing_softmaxes`` on CUDA (:mod:`softmoe.kernels.routing_softmaxes`).

Imported only where the op runs its kernel, so that ``import softmoe`` never loads Triton; without Triton the
module defines no kernel (and the op never asks for one: ``triton_available``). One program per input
holds that input's (tokens x slots) logits and writes both softmaxes; with ``CHOOSE`` it also sums the combine
weights over tokens and each expert's slots, ranks the experts (NaN first, then the largest, ties to the lower
index: :func:`softmoe.topk.top_k`'s rule), zeroes the combine weights of the slots outside the k first and writes
their indices in ascending order. :func:`launch` compiles it through Triton's JIT at the first launch of a shape and
calls the compiled kernel directly after that.
"""

from __future__ import annotations

import re

from softmoe.kernels.routing_softmaxes import block_size

try:
    import triton
    import triton.language as tl
except ImportError:  # the module still imports; the op takes torch's ops (triton_available)
    triton = None


def routing_softmaxes_kernel(
    logits, dispatch, combine, selected, tokens, slots, slots_per_expert, num_experts, k,
    BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, CHOOSE: tl.constexpr,
):
    b = tl.program_id(0)
    t = tl.arange(0, BLOCK_T)[:, None]
    s = tl.arange(0, BLOCK_S)[None, :]
    inside = (t < tokens) & (s < slots)
    offsets = b.to(tl.int64) * tokens * slots + t * slots + s
    z = tl.load(logits + offsets, mask=inside, other=float("-inf"))

    e = tl.exp(z - tl.max(z, axis=0)[None, :])  # dispatch: softmax over the tokens
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


# Whether a compiled kernel is called directly (below): from Triton 3.6, the version tested, its call takes every
# argument, the constexprs too (older launchers took fewer).
DIRECT_LAUNCH = triton is not None and tuple(int(n) for n in re.findall(r"\d+", triton.__version__)[:2]) >= (3, 6)
# The kernel compiled for each device, shape and alignment of the pointers (what Triton specializes it on), once
# launched: later launches call it directly, without the argument binding and cache lookup of Triton's JIT dispatch.
# Between a layer's other launches on an H200 machine, the JIT's launch cost 18-20 us of host time, the compiled
# kernel's 11-13 us, torch's two softmaxes 14 us (docs/performance.md).
_COMPILED: dict[tuple, object] = {}


def launch(logits, dispatch, combine, selected, slots_per_expert: int, k: int, choose: bool) -> None:
    """Run the kernel over ``logits`` (batch, tokens, slots) float32 contiguous into the outputs (same shapes;
    selected (batch, k) int64, not written unless ``choose``), one program per input, on the current device."""
    batch, tokens, slots = logits.shape
    num_experts = slots // slots_per_expert
    block_t, block_s, block_e = block_size(tokens), block_size(slots), block_size(num_experts)
    args = (logits, dispatch, combine, selected if choose else dispatch, tokens, slots, slots_per_expert,
            num_experts, k)
    key = (logits.device.index, *args[4:], choose, *(t.data_ptr() % 16 == 0 for t in args[:4]))
    compiled = _COMPILED.get(key)
    if compiled is not None:
        compiled[(batch, 1, 1)](*args, block_t, block_s, block_e, choose)
        return
    warps = 8 if block_t * block_s >= 8192 else 4
    compiled = routing_softmaxes_kernel[(batch,)](
        *args, BLOCK_T=block_t, BLOCK_S=block_s, BLOCK_E=block_e, CHOOSE=choose, num_warps=warps,
    )
    if compiled is not None and DIRECT_LAUNCH:  # None from Triton's interpreter, which compiles nothing
        _COMPILED[key] = compiled
