"""``softmoe::selected_mixing``: Algorithm 1's selected plan for inference in one native call, for the CPU.

    softmoe::selected_mixing(Tensor x, Tensor dispatch, Tensor combine, Tensor selected, Tensor w1, Tensor? b1,
                             Tensor w2, Tensor? b2, int slots_per_expert, str activation, str isa) -> Tensor
        x (B, T, D) the slot inputs, dispatch and combine (B, T, n * p), selected (B, k) int64 (-1: an unused
        place), an MLP bank's w1 (n, D, H), b1 (n, H), w2 (n, H, O), b2 (n, O) -> (B, T, O):
        C_kept act(D_kept^T X W1_e + b1_e) W2_e + b2_e, summed over each input's kept experts e

The selected plan of :func:`softmoe.backends.base.selected_plan` (the kept slots gathered, D^T X, the experts'
products grouped by expert, C Y), each step the same product, here in one call: at batch 1 the plan's dozens of
torch ops, whose code and data the weights' stream evicts from the caches, cost about as much as reading the kept
experts' weights (docs/performance.md has the measurements). The experts' products run in the native expert matmul
(``csrc/expert_matmul.h``), each expert's weights read once for all the inputs that keep it. No backward (a
gradient takes the differentiable selected plan); a fake registration for torch.compile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.compat import check
from softmoe.kernels.build import required_isa

# The op's schema; its CPU kernel (csrc/bindings.cpp) registers when the native extension loads.
_LIBRARY = torch.library.Library("softmoe", "FRAGMENT")
_LIBRARY.define(
    "selected_mixing(Tensor x, Tensor dispatch, Tensor combine, Tensor selected, Tensor w1, Tensor? b1, Tensor w2, "
    "Tensor? b2, int slots_per_expert, str activation, str isa) -> Tensor"
)


@torch.library.register_fake("softmoe::selected_mixing")
def _(x, dispatch, combine, selected, w1, b1, w2, b2, slots_per_expert, activation, isa):
    check(x.dim() == 3 and w1.dim() == 3 and w2.dim() == 3, lambda: "x, w1 and w2 must be 3-dimensional")
    n, dim, hidden = w1.shape
    check(x.shape[2] == dim and w2.shape[:2] == (n, hidden), lambda: "x (B, T, D) needs w1 (n, D, H), w2 (n, H, O)")
    check(
        dispatch.shape == combine.shape == (*x.shape[:2], n * slots_per_expert),
        lambda: "dispatch and combine must be (batch, tokens, n * slots_per_expert)",
    )
    check(
        selected.dim() == 2 and selected.shape[0] == x.shape[0] and selected.dtype == torch.int64,
        lambda: "selected must be an int64 (batch, k) tensor",
    )
    check(b1 is None or b1.shape == (n, hidden), lambda: "b1 must be (n, H)")
    check(b2 is None or b2.shape == (n, w2.shape[2]), lambda: "b2 must be (n, O)")
    return x.new_empty(x.shape[0], x.shape[1], w2.shape[2])


def selected_mixing(
    x: Tensor,
    dispatch: Tensor,
    combine: Tensor,
    selected: Tensor,
    weights: tuple[Tensor, Tensor | None, Tensor, Tensor | None],
    slots_per_expert: int,
    activation: str,
) -> Tensor:
    """The op (module doc) with the variant :func:`~softmoe.kernels.cpu_isa` names; ``weights``: an MLP bank's
    (w1, b1, w2, b2)."""
    w1, b1, w2, b2 = weights
    return torch.ops.softmoe.selected_mixing.default(
        x, dispatch, combine, selected, w1, b1, w2, b2, slots_per_expert, activation, required_isa()
    )
