"""``softmoe::soft_moe_mixing``: the whole Soft MoE mixing of many small relu experts in one native pass
(``csrc/soft_moe_small.h``).

The paper's MNIST layer (4 tokens, n = 8..512 experts of 98..2 hidden units) is, in torch's ops, a chain of thin
matmuls that write (batch, slots, dim) tensors; the fused kernel keeps every slot in cache (docs/performance.md
has the measurements).

Two custom ops, each with a fake (meta) implementation; the forward's autograd formula calls the backward op:

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

:func:`soft_moe_mixing` is the Python entry point (input checks, the variant of
:func:`~softmoe.kernels.cpu_isa`). The backward op has no autograd formula: no double backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from softmoe.kernels.build import LANES, native_available, native_module, required_isa
from softmoe.kernels.modes import (
    direct_autograd_ok,
    direct_call_ok,
    direct_function,
    needs_grad,
    transforms_active,
)

# The fused kernel serves inputs of at most MIXING_MAX_TOKENS tokens (their routing weights stay in registers) and
# experts whose two weight matrices (2 dim hidden floats) take at most MIXING_MAX_WEIGHT_BYTES_PER_LANE per vector
# lane of the kernel variant (1.75 MiB with AVX-512's 16 lanes, 896 KiB with AVX2's 8): each group of `lanes`
# inputs streams every expert's weights (and, backward, their gradients) through a core's cache, so their traffic
# per input is the weights' size over the lanes. Beyond that the fused kernel no longer beats the slot backend's
# batched products (docs/performance.md has the measurements).
MIXING_MAX_TOKENS = 8
MIXING_MAX_WEIGHT_BYTES_PER_LANE = 112 << 10
# From this many hidden units up the forward pass keeps the slots' outputs (batch * slots * dim floats) for the
# backward pass, which otherwise runs each slot's second layer again (hidden * dim multiply-adds per input and slot,
# a fifth of the backward's). Below it writing, holding (100 MB at the layer's n = 512) and reading the outputs
# costs more than computing them again: the larger saved record is fresh memory every step in a default process
# (docs/performance.md has the measurements).
MIXING_KEEP_OUTPUTS_MIN_HIDDEN = 64


def _saved_shape(x: Tensor, dispatch: Tensor, weight1: Tensor, keep_outputs: bool, isa: str) -> tuple:
    if isa not in LANES:
        raise ValueError(f"isa must be one of {tuple(LANES)}, got {isa!r}")
    lanes = LANES[isa]
    width = weight1.shape[2] + (x.shape[2] if keep_outputs else 0)
    return ((x.shape[0] + lanes - 1) // lanes, dispatch.shape[2], width, lanes)


@torch.library.custom_op("softmoe::soft_moe_mixing", mutates_args=(), device_types="cpu")
def soft_moe_mixing_op(
    x: Tensor, dispatch: Tensor, combine: Tensor, weight1: Tensor, bias1: Tensor | None, weight2: Tensor,
    bias2: Tensor | None, keep_outputs: bool, isa: str,
) -> tuple[Tensor, Tensor]:
    """The fused mixing with the ``isa`` variant of the native kernel: (out, saved) (see the module docstring)."""
    return _run_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa)


def _run_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa) -> tuple[Tensor, Tensor]:
    """The op's code, called directly where no dispatcher is needed (:data:`_DirectMixing`)."""
    out, saved = native_module().soft_moe_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs,
                                                 False, isa)
    return out, saved


@soft_moe_mixing_op.register_fake
def _(x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa):
    torch._check(x.dim() == 3 and dispatch.dim() == 3 and weight1.dim() == 3, lambda: "bad soft_moe_mixing inputs")
    return x.new_empty(x.shape), x.new_empty(_saved_shape(x, dispatch, weight1, keep_outputs, isa))


def _setup_mixing(ctx, inputs, output) -> None:
    x, dispatch, combine, weight1, bias1, weight2, bias2, keep_outputs, isa = inputs
    _, saved = output
    ctx.save_for_backward(x, dispatch, combine, weight1, weight2, bias2, saved)
    ctx.mark_non_differentiable(saved)
    ctx.set_materialize_grads(False)  # no zeros written for saved's gradient (800 KB at the MNIST layer's n = 8)
    ctx.isa = isa


def _backward_mixing(ctx, grad: Tensor, _grad_saved: Tensor | None):
    x, dispatch, combine, weight1, weight2, bias2, saved = ctx.saved_tensors
    inputs = (grad, x, dispatch, combine, weight1, weight2, bias2, saved)
    # the backward op's code directly, unless something watches the dispatcher or create_graph records gradients
    # (the backward op has no formula: that raises, as through the op)
    backward = _run_mixing_backward if direct_call_ok("cpu", *inputs) else torch.ops.softmoe.soft_moe_mixing_backward
    grads = list(backward(*inputs, ctx.isa))
    for i, needed in enumerate(ctx.needs_input_grad[:7]):
        if not needed:  # e.g. an absent or frozen bias
            grads[i] = None
    return (*grads, None, None)


soft_moe_mixing_op.register_autograd(_backward_mixing, setup_context=_setup_mixing)
# The same formula around the op's code, for eager calls (softmoe.kernels.modes.direct_autograd_ok).
_DirectMixing = direct_function("DirectSoftMoEMixing", _run_mixing, _setup_mixing, _backward_mixing)


@torch.library.custom_op("softmoe::soft_moe_mixing_backward", mutates_args=(), device_types="cpu")
def soft_moe_mixing_backward_op(
    grad: Tensor, x: Tensor, dispatch: Tensor, combine: Tensor, weight1: Tensor, weight2: Tensor,
    bias2: Tensor | None, saved: Tensor, isa: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of softmoe::soft_moe_mixing (see the module docstring)."""
    return _run_mixing_backward(grad, x, dispatch, combine, weight1, weight2, bias2, saved, isa)


def _run_mixing_backward(grad, x, dispatch, combine, weight1, weight2, bias2, saved, isa) -> tuple[Tensor, ...]:
    """The backward op's code, called directly where no dispatcher is needed (:func:`_backward_mixing`)."""
    return tuple(
        native_module().soft_moe_mixing_backward(grad, x, dispatch, combine, weight1, weight2, bias2, saved, isa)
    )


@soft_moe_mixing_backward_op.register_fake
def _(grad, x, dispatch, combine, weight1, weight2, bias2, saved, isa):
    experts, _, hidden = weight1.shape
    return (
        x.new_empty(x.shape), dispatch.new_empty(dispatch.shape), combine.new_empty(combine.shape),
        weight1.new_empty(weight1.shape), x.new_empty(experts, hidden), weight2.new_empty(weight2.shape),
        x.new_empty(experts, x.shape[2]),
    )


@torch.library.custom_op("softmoe::soft_moe_mixing_inference", mutates_args=(), device_types="cpu")
def soft_moe_mixing_inference_op(
    x: Tensor, dispatch: Tensor, combine: Tensor, weight1: Tensor, bias1: Tensor | None, weight2: Tensor,
    bias2: Tensor | None, kept_combine: bool, kept_slots: Tensor | None, isa: str,
) -> Tensor:
    """The fused mixing without a backward pass (no records kept): with ``kept_combine`` only the kept slots run
    (``kept_slots``: them as bits, or None to find them from combine), else every slot, each laid out per call the
    cheapest way (see :func:`soft_moe_mixing`). No backward."""
    return _run_inference(x, dispatch, combine, weight1, bias1, weight2, bias2, kept_combine, kept_slots, isa)


def _run_inference(x, dispatch, combine, weight1, bias1, weight2, bias2, kept_combine, kept_slots, isa) -> Tensor:
    return native_module().soft_moe_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, False, kept_combine,
                                           isa, kept_slots=kept_slots, every_slot=not kept_combine)[0]


@soft_moe_mixing_inference_op.register_fake
def _(x, dispatch, combine, weight1, bias1, weight2, bias2, kept_combine, kept_slots, isa):
    return x.new_empty(x.shape)


# ---- the Python entry point and where it applies ----------------------------------------------------------------


def native_mixing_applies(x: Tensor, hidden: int, activation: str) -> bool:
    """Whether :func:`soft_moe_mixing` serves x (batch, tokens, dim) with relu experts of ``hidden`` units: float32
    CPU, 1..MIXING_MAX_TOKENS tokens, no torch.func transform active (the ops have no vmap rule), the kernels built,
    and an expert's weights (2 dim hidden floats) of at most MIXING_MAX_WEIGHT_BYTES_PER_LANE per vector lane of the
    variant :func:`~softmoe.kernels.cpu_isa` names. Eager, torch.compile and autocast all qualify."""
    return (
        activation == "relu"
        and x.is_cpu
        and x.dtype == torch.float32
        and 1 <= x.shape[1] <= MIXING_MAX_TOKENS
        and not transforms_active()
        and native_available()
        and 8 * x.shape[2] * hidden <= MIXING_MAX_WEIGHT_BYTES_PER_LANE * LANES[required_isa()]
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
    (experts, hidden, dim), bias2 (experts, dim) -> (batch, tokens, dim). No (batch, slots, dim) tensor is written:
    each thread takes 16 (AVX-512; two groups of 8 with AVX2) inputs at a time, one per vector lane, and runs
    dispatch, both expert layers and the combine of a slot back to back in its cache. In inference (no gradient to
    record: ``softmoe::soft_moe_mixing_inference``, its code called directly where nothing watches the dispatcher)
    it keeps no records and, with fewer inputs than a
    group of lanes per thread or with ``kept_combine``, lays the work out per call in the cheapest of three ways the
    kernel counts: groups of inputs (with ``kept_combine``, those that keep the same slots, a slot run for a group
    where one of its inputs keeps it), the rows of each expert (its inputs, 8 at a time with AVX-512 and 4 with AVX2,
    vectors along hidden and dim: each weight vector serves them all), or each input's experts one at a time with
    vectors along dim and hidden (small batches, where a group of lanes is mostly empty). With ``kept_combine`` (combine zero outside the slots of each input's kept experts: Algorithm 1's
    dense plan) only the kept slots run; ``kept_slots`` (the kept slots as bits, as
    :func:`~softmoe.kernels.soft_moe_routing_top_k` gives them with that combine) saves finding them from its nonzero
    weights. Finite outputs are the same either way; with ``kept_combine`` an expert whose outputs are not finite
    adds NaN (its output times a zero weight) only to the inputs that run it. Only where
    :func:`native_mixing_applies`; other dtypes, devices, more than MIXING_MAX_TOKENS tokens or inconsistent shapes
    raise a ValueError. Runs ``softmoe::soft_moe_mixing`` with the variant :func:`~softmoe.kernels.cpu_isa` names.
    """
    isa = required_isa()
    tensors = (x, dispatch, combine, weight1, bias1, weight2, bias2)
    if not needs_grad(*tensors):
        # inference: with kept_combine only the kept experts run (no backward reads the records of the others); the
        # op's code directly where nothing watches the dispatcher, else the op: the same kernel either way. The
        # kernel checks the same as _check_mixing_inputs, whose clearer errors are only needed where it refuses.
        direct = direct_call_ok("cpu", *tensors)
        mixing = _run_inference if direct else torch.ops.softmoe.soft_moe_mixing_inference
        if not direct:
            _check_mixing_inputs(*tensors)
        try:
            return mixing(*tensors, kept_combine, kept_slots if kept_combine else None, isa)
        except RuntimeError:
            _check_mixing_inputs(*tensors)
            raise
    _check_mixing_inputs(x, dispatch, combine, weight1, bias1, weight2, bias2)
    # the outputs are kept only for a backward pass: none under no_grad or for inputs without gradients
    keep = weight1.shape[2] >= MIXING_KEEP_OUTPUTS_MIN_HIDDEN and needs_grad(
        x, dispatch, combine, weight1, bias1, weight2, bias2
    )
    # eager training: the op's code and formula without the dispatcher; torch.compile and the like see the op
    mixing = _DirectMixing.apply if direct_autograd_ok("cpu", *tensors) else torch.ops.softmoe.soft_moe_mixing
    out, _ = mixing(*tensors, keep, isa)
    return out


def _check_mixing_inputs(x, dispatch, combine, weight1, bias1, weight2, bias2) -> None:
    # (tuples, and torch.Size compared as it is: this runs on every eager call)
    tensors = (("x", x), ("dispatch", dispatch), ("combine", combine), ("weight1", weight1), ("bias1", bias1),
               ("weight2", weight2), ("bias2", bias2))
    for name, t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            raise ValueError(f"soft_moe_mixing takes float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    if x.dim() != 3 or weight1.dim() != 3:
        raise ValueError(f"x must be (batch, tokens, dim) and weight1 (experts, dim, hidden), got "
                         f"{tuple(x.shape)} and {tuple(weight1.shape)}")
    (batch, tokens, dim), (experts, _, hidden) = x.shape, weight1.shape
    slots = dispatch.shape[-1] if dispatch.dim() == 3 else -1
    expected = (("dispatch", dispatch, (batch, tokens, slots)), ("combine", combine, (batch, tokens, slots)),
                ("weight1", weight1, (experts, dim, hidden)), ("bias1", bias1, (experts, hidden)),
                ("weight2", weight2, (experts, hidden, dim)), ("bias2", bias2, (experts, dim)))
    for name, t, shape in expected:
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if slots < 1 or slots % experts:
        raise ValueError(f"the {slots} slots must be a positive multiple of the {experts} experts")
    if not 1 <= tokens <= MIXING_MAX_TOKENS:
        raise ValueError(f"the native Soft MoE kernel takes 1..{MIXING_MAX_TOKENS} tokens, got {tokens}")
