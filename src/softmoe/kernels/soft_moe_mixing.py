"""``softmoe::soft_moe_mixing``: the whole Soft MoE mixing of many small relu experts in one native pass
(``csrc/soft_moe_small.h``).

The paper's MNIST layer (4 tokens, n = 8..512 experts of 98..2 hidden units) is, in torch's ops, a chain of thin
matmuls that write (batch, slots, dim) tensors; the fused kernel keeps every slot in cache (docs/performance.md
has the measurements).

Three ops, each with a fake (meta) implementation; the forward's autograd (C++, ``csrc/autograd.cpp``, like the
CPU kernels: an eager call pays no Python beyond the op's call) calls the backward op:

    softmoe::soft_moe_mixing(Tensor x, Tensor dispatch, Tensor combine, Tensor weight1, Tensor? bias1,
                             Tensor weight2, Tensor? bias2, bool keep_outputs, str isa) -> (Tensor out, Tensor saved)
        out (batch, tokens, dim); saved (ceil(batch / lanes), slots, hidden (+ dim with keep_outputs), lanes),
        what the backward reads: the pre-activations, then with keep_outputs the slots' outputs, which the
        backward would otherwise compute again (lanes: 16, 8 or 4, those of the ``isa`` variant; not
        differentiable)
    softmoe::soft_moe_mixing_backward(Tensor grad, Tensor x, Tensor dispatch, Tensor combine, Tensor weight1,
                                      Tensor weight2, Tensor? bias2, Tensor saved, str isa)
            -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)
        the gradients of x, dispatch, combine, weight1, bias1 (experts, hidden), weight2 and bias2 (experts, dim)
        (the bias gradients are computed whether or not the layer has biases)
    softmoe::soft_moe_mixing_inference(Tensor x, Tensor dispatch, Tensor combine, Tensor weight1, Tensor? bias1,
                                       Tensor weight2, Tensor? bias2, bool kept_combine, Tensor? kept_slots,
                                       int layout, float[] layout_costs, str isa) -> Tensor
        the mixing without records for a backward (no autograd): with ``kept_combine`` only the kept slots run
        (``kept_slots`` them as bits, or None to find them from combine), else every slot; ``layout`` one of
        :data:`LAYOUTS` (0: the kernel counts the cheapest per call from ``layout_costs``, the variant's entry of
        softmoe.tuning.TABLE's "mixing_layout_costs"; see :func:`soft_moe_mixing`)

:func:`soft_moe_mixing` is the Python entry point (input checks, the variant of
:func:`~softmoe.kernels.cpu_isa`). The backward op has no autograd formula: no double backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.compat import check
from softmoe.kernels.build import LANES, native_available, required_isa
from softmoe.kernels.modes import needs_grad, transforms_active
from softmoe.tuning import value

# The fused kernel serves inputs of at most MIXING_MAX_TOKENS tokens (their routing weights stay in registers) and
# experts whose weights fit softmoe.tuning.TABLE's "mixing_max_weight_bytes_per_lane".
MIXING_MAX_TOKENS = 8


# The work's layouts in inference (the ``layout`` argument of softmoe::soft_moe_mixing_inference; LANES_* in
# csrc/bindings.cpp): 0 lets the kernel count the cheapest per call.
LAYOUTS = {"auto": 0, "by inputs": 1, "by rows": 2, "by pairs": 3}

# The ops' schemas; their CPU kernels (csrc/bindings.cpp) and the mixing's autograd (csrc/autograd.cpp) register when
# the native extension loads.
_LIBRARY = torch.library.Library("softmoe", "FRAGMENT")
_LIBRARY.define(
    "soft_moe_mixing(Tensor x, Tensor dispatch, Tensor combine, Tensor weight1, Tensor? bias1, "
    "Tensor weight2, Tensor? bias2, bool keep_outputs, str isa) -> (Tensor, Tensor)"
)
_LIBRARY.define(
    "soft_moe_mixing_backward(Tensor grad, Tensor x, Tensor dispatch, Tensor combine, Tensor weight1, "
    "Tensor weight2, Tensor? bias2, Tensor saved, str isa) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "soft_moe_mixing_inference(Tensor x, Tensor dispatch, Tensor combine, Tensor weight1, Tensor? bias1, "
    "Tensor weight2, Tensor? bias2, bool kept_combine, Tensor? kept_slots, int layout, float[] layout_costs, "
    "str isa) -> Tensor"
)


def _saved_shape(x: Tensor, dispatch: Tensor, weight1: Tensor, keep_outputs: bool, isa: str) -> tuple:
    if isa not in LANES:
        raise ValueError(f"isa must be one of {tuple(LANES)}, got {isa!r}")
    lanes = LANES[isa]
    width = weight1.shape[2] + (x.shape[2] if keep_outputs else 0)
    return ((x.shape[0] + lanes - 1) // lanes, dispatch.shape[2], width, lanes)


@torch.library.register_fake("softmoe::soft_moe_mixing")
def _(x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa):
    check(x.dim() == 3 and dispatch.dim() == 3 and weight1.dim() == 3, lambda: "bad soft_moe_mixing inputs")
    return x.new_empty(x.shape), x.new_empty(_saved_shape(x, dispatch, weight1, keep_outputs, isa))


@torch.library.register_fake("softmoe::soft_moe_mixing_backward")
def _(grad, x, dispatch, combine, weight1, weight2, bias2, saved, isa):
    experts, _, hidden = weight1.shape
    return (
        x.new_empty(x.shape),
        dispatch.new_empty(dispatch.shape),
        combine.new_empty(combine.shape),
        weight1.new_empty(weight1.shape),
        x.new_empty(experts, hidden),
        weight2.new_empty(weight2.shape),
        x.new_empty(experts, x.shape[2]),
    )


@torch.library.register_fake("softmoe::soft_moe_mixing_inference")
def _(x, dispatch, combine, weight1, bias1, weight2, bias2, kept_combine, kept_slots, layout, layout_costs, isa):
    return x.new_empty(x.shape)


# ---- the Python entry point and where it applies ----------------------------------------------------------------


def native_mixing_applies(x: Tensor, hidden: int, activation: str) -> bool:
    """Whether :func:`soft_moe_mixing` serves x (batch, tokens, dim) with relu experts of ``hidden`` units: float32
    CPU, 1..MIXING_MAX_TOKENS tokens, no torch.func transform active (the ops have no vmap rule), the kernels built,
    and an expert's weights (2 dim hidden floats) of at most softmoe.tuning.TABLE's
    "mixing_max_weight_bytes_per_lane" per vector lane of the variant :func:`~softmoe.kernels.cpu_isa` names. Eager,
    torch.compile and autocast all qualify."""
    return (
        activation == "relu"
        and x.is_cpu
        and x.dtype == torch.float32
        and 1 <= x.shape[1] <= MIXING_MAX_TOKENS
        and not transforms_active()
        and native_available()
        and 8 * x.shape[2] * hidden <= value("mixing_max_weight_bytes_per_lane") * LANES[required_isa()]
    )


def soft_moe_mixing(
    x: Tensor,
    dispatch: Tensor,
    combine: Tensor,
    weight1: Tensor,
    bias1: Tensor | None,
    weight2: Tensor,
    bias2: Tensor | None,
    kept_combine: bool = False,
    kept_slots: Tensor | None = None,
) -> Tensor:
    """The Soft MoE mixing C relu-MLP(D^T X) of small experts in one native pass, differentiable in every input.

    x (batch, tokens, dim); dispatch, combine (batch, tokens, slots) with slots = experts * slots_per_expert, slot s
    belonging to expert s // slots_per_expert; weight1 (experts, dim, hidden), bias1 (experts, hidden), weight2
    (experts, hidden, dim), bias2 (experts, dim) -> (batch, tokens, dim). No (batch, slots, dim) tensor is written: each
    thread takes 16 (AVX-512; two groups of 8 with AVX2) inputs at a time, one per vector lane, and runs dispatch, both
    expert layers and the combine of a slot back to back in its cache. In inference (no gradient to record:
    ``softmoe::soft_moe_mixing_inference``) it keeps no records and, with fewer inputs than a group of lanes per thread
    or with ``kept_combine``, lays the work out per call in the cheapest of three ways the kernel counts: groups of
    inputs (with ``kept_combine``, those that keep the same slots, a slot run for a group where one of its inputs keeps
    it), the rows of each expert (its inputs, 8 at a time with AVX-512 and 4 with AVX2, vectors along hidden and dim:
    each weight vector serves them all), or each input's experts one at a time with vectors along dim and hidden (small
    batches, where a group of lanes is mostly empty). With ``kept_combine`` (combine zero outside the slots of each
    input's kept experts: Algorithm 1's dense plan) only the kept slots run; ``kept_slots`` (the kept slots as bits, as
    :func:`~softmoe.kernels.soft_moe_routing_top_k` gives them with that combine) saves finding them from its nonzero
    weights. Finite outputs are the same either way; with ``kept_combine`` an expert whose outputs are not finite adds
    NaN (its output times a zero weight) only to the inputs that run it. Only where :func:`native_mixing_applies`; other
    dtypes, devices, more than MIXING_MAX_TOKENS tokens or inconsistent shapes raise a ValueError. Runs
    ``softmoe::soft_moe_mixing`` with the variant :func:`~softmoe.kernels.cpu_isa` names.
    """
    isa = required_isa()
    tensors = (x, dispatch, combine, weight1, bias1, weight2, bias2)
    if not needs_grad(*tensors):
        # inference: with kept_combine only the kept experts run (no backward reads the records of the others). The
        # kernel checks the same as _check_mixing_inputs, whose clearer errors are only needed where it refuses.
        try:
            return torch.ops.softmoe.soft_moe_mixing_inference.default(
                *tensors, kept_combine, kept_slots if kept_combine else None, LAYOUTS["auto"], layout_costs(isa), isa
            )
        except RuntimeError:
            _check_mixing_inputs(*tensors)
            raise
    _check_mixing_inputs(*tensors)
    # the outputs are kept only for a backward pass
    keep = weight1.shape[2] >= value("mixing_keep_outputs_min_hidden")
    out, _ = torch.ops.softmoe.soft_moe_mixing.default(*tensors, keep, isa)
    return out


def layout_costs(isa: str) -> list[float]:
    """The inference layouts' costs for the ``isa`` variant (the op's ``layout_costs``): softmoe.tuning.TABLE's
    "mixing_layout_costs"."""
    return list(value("mixing_layout_costs")[isa])


def _check_mixing_inputs(x, dispatch, combine, weight1, bias1, weight2, bias2) -> None:
    # (tuples, and torch.Size compared as it is: this runs on every eager call)
    tensors = (
        ("x", x),
        ("dispatch", dispatch),
        ("combine", combine),
        ("weight1", weight1),
        ("bias1", bias1),
        ("weight2", weight2),
        ("bias2", bias2),
    )
    for name, t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            raise ValueError(f"soft_moe_mixing takes float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    if x.dim() != 3 or weight1.dim() != 3:
        raise ValueError(
            f"x must be (batch, tokens, dim) and weight1 (experts, dim, hidden), got "
            f"{tuple(x.shape)} and {tuple(weight1.shape)}"
        )
    (batch, tokens, dim), (experts, _, hidden) = x.shape, weight1.shape
    slots = dispatch.shape[-1] if dispatch.dim() == 3 else -1
    expected = (
        ("dispatch", dispatch, (batch, tokens, slots)),
        ("combine", combine, (batch, tokens, slots)),
        ("weight1", weight1, (experts, dim, hidden)),
        ("bias1", bias1, (experts, hidden)),
        ("weight2", weight2, (experts, hidden, dim)),
        ("bias2", bias2, (experts, dim)),
    )
    for name, t, shape in expected:
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if slots < 1 or slots % experts:
        raise ValueError(f"the {slots} slots must be a positive multiple of the {experts} experts")
    if not 1 <= tokens <= MIXING_MAX_TOKENS:
        raise ValueError(f"the native Soft MoE kernel takes 1..{MIXING_MAX_TOKENS} tokens, got {tokens}")
