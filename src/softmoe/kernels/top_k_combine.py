"""``softmoe::top_k_combine``: Algorithm 1's choice of experts from a layer's combine weights, in one native call
(``csrc/top_k_combine.h``), for the CPU.

    softmoe::top_k_combine(Tensor combine, int slots_per_expert, int k, str isa) -> (Tensor kept, Tensor selected)
        combine (batch, tokens, n * p) -> kept (batch, tokens, n * p): combine with the slots of the experts not
        selected zeroed; selected (batch, k) int64: per input the k experts of largest summed combine weight (over
        tokens and the expert's p slots), ascending (NaN largest, ties to the lower index: softmoe.topk.top_k's rule;
        the sums in float64); ``isa`` the kernel variant that runs it

The "cpu" backend makes Algorithm 1's choice with it (or in the routing's pass);
``softmoe.selection.top_k_by_combine`` makes the same choice in torch's ops, its sums in float64 too. In torch's ops
the choice and the dense plan's mask were a sum, a sort or a host read, a mask built from the choice and a
``torch.where``, several ops where this is one (docs/performance.md has the measurements). The op has a fake and a
C++ autograd registration (``csrc/autograd.cpp``: ``kept``'s gradient is the upstream gradient on the kept slots;
``selected`` is not differentiable), so it composes with torch.compile and autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.compat import check
from softmoe.kernels.build import required_isa

# The op's schema; its CPU kernel (csrc/bindings.cpp) and autograd (csrc/autograd.cpp) register when the native
# extension loads.
_LIBRARY = torch.library.Library("softmoe", "FRAGMENT")
_LIBRARY.define("top_k_combine(Tensor combine, int slots_per_expert, int k, str isa) -> (Tensor, Tensor)")


@torch.library.register_fake("softmoe::top_k_combine")
def _(combine: Tensor, slots_per_expert: int, k: int, isa: str) -> tuple[Tensor, Tensor]:
    check(
        combine.dim() == 3 and combine.dtype == torch.float32,
        lambda: "combine must be a (batch, tokens, slots) float32 tensor",
    )
    check(
        slots_per_expert >= 1 and combine.shape[2] % slots_per_expert == 0,
        lambda: "slots must be a whole number of experts of slots_per_expert >= 1 slots",
    )
    check(1 <= k <= combine.shape[2] // slots_per_expert, lambda: "k must lie in [1, the experts]")
    kept = combine.new_empty(combine.shape)
    return kept, combine.new_empty((combine.shape[0], k), dtype=torch.int64)


def check_choice(name: str, slots: int, slots_per_expert: int, k: int) -> None:
    """A ValueError unless the ``slots`` of ``name`` are whole experts of ``slots_per_expert`` and k lies in [1, n]."""
    if (
        isinstance(slots_per_expert, bool)
        or not isinstance(slots_per_expert, int)
        or slots_per_expert < 1
        or slots % slots_per_expert
    ):
        raise ValueError(f"{name}'s {slots} slots are not a whole number of experts of {slots_per_expert!r} slots")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= slots // slots_per_expert:
        raise ValueError(f"k must be an integer in [1, {slots // slots_per_expert}] (the experts), got {k!r}")


def top_k_combine(combine: Tensor, slots_per_expert: int, k: int) -> tuple[Tensor, Tensor]:
    """Algorithm 1 on combine (batch, tokens, n * p): (combine with the unselected experts' slots zeroed, the
    selected experts (batch, k) int64 ascending), by ``softmoe::top_k_combine`` with the variant
    :func:`~softmoe.kernels.cpu_isa` names, for float32 CPU tensors outside torch.func transforms (the op has no vmap
    rule; the "cpu" backend's inputs); a ValueError for a k outside [1, n] or slots that are not n * p."""
    check_choice("combine", combine.shape[-1], slots_per_expert, k)
    return torch.ops.softmoe.top_k_combine.default(combine, slots_per_expert, k, required_isa())
