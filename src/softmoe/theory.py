"""Theorem 1 of "Beyond Parameter Count" made checkable: a single-expert Soft MoE cannot represent ``||X||_2``.

The proof (Appendix B) builds, for every size ``a > 0``, two inputs A and B of shape (m, d) whose norms differ by a
constant times ``a`` while the one slot the expert sees, ``D(X)^T X``, is (asymptotically) the same. With one expert
and one slot the combine matrix C is a column of ones, so every output token equals ``f(slot)`` and

    ||sMoE(A) - sMoE(B)||_F  =  sqrt(m) ||f(D(A)^T A) - f(D(B)^T B)||_2  <=  sqrt(m) L_f ||D(A)^T A - D(B)^T B||_2,

which tends to 0 for ANY Lipschitz expert f, whereas a good approximation of ``||X||_2`` (up to max(1, t/20)) would
need predictions that differ by about ``(sqrt(2) - 1) a`` (or ``(1 - 1/sqrt(2)) a``). Here:

- :func:`theorem1_witness` builds the proof's pair (A, B) for a given layer and size ``a``;
- :func:`witness_gaps` / :func:`witness_table` measure, on the real layer, the norm gap ``|t(A) - t(B)|`` (linear in
  ``a``), the slot gap and the output gap (both tending to 0);
- :func:`single_expert_collapse` shows that with a single slot every output token is the same vector.

Norms: ``t(X) = ||X||_2`` is the Frobenius norm of X (the Euclidean norm of the flattened input, as in Appendix C);
for the witnesses, which have a single non-zero column, it equals the spectral norm too.
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch

from softmoe.experts import FactoryKwargs
from softmoe.layer import SoftMoE, dispatch_slots

# Share of the mass that the normalized-routing witness B puts on its second token (see theorem1_witness).
SPLIT = 0.05

CASE_POSITIVE = "phi>0"
CASE_NEGATIVE = "phi<0"
CASE_ZERO = "phi=0"
CASE_NORMALIZED = "normalized"

# |t(A) - t(B)| / a for each construction.
NORM_GAP_SLOPE = {
    CASE_POSITIVE: math.sqrt(2.0) - 1.0,
    CASE_NEGATIVE: math.sqrt(2.0) - 1.0,
    CASE_ZERO: 1.0 - 1.0 / math.sqrt(2.0),
    CASE_NORMALIZED: math.hypot(1.0 - SPLIT, SPLIT) - 1.0 / math.sqrt(2.0),
}


class Witness(NamedTuple):
    """A pair of inputs of the proof of Theorem 1.

    A, B: (num_tokens, dim) tensors in the layer's dtype and device.
    a: the size. case: which construction was used (``"phi>0"``, ``"phi<0"``, ``"phi=0"`` or ``"normalized"``).
    coord: the feature coordinate c that carries the input (the proof's "first entry"); token, partner: the two
    token rows that are non-zero.
    """

    A: torch.Tensor
    B: torch.Tensor
    a: float
    case: str
    coord: int
    token: int
    partner: int


class Collapse(NamedTuple):
    """Result of :func:`single_expert_collapse`.

    output: (batch, tokens, dim) the layer's output; expert_output: (batch, dim) ``f(D(X)^T X)``, the expert's output
    on the only slot; max_token_spread: max over the batch, tokens and features of ``|output[b, i] - output[b, 0]|``
    (0 up to rounding); max_expert_gap: max of ``|output[b, i] - expert_output[b]|``.
    """

    output: torch.Tensor
    expert_output: torch.Tensor
    max_token_spread: float
    max_expert_gap: float


def _check_single_expert(layer: SoftMoE) -> None:
    if not isinstance(layer, SoftMoE):
        raise ValueError(f"layer must be a softmoe.SoftMoE, got {type(layer).__name__}")
    if layer.num_experts != 1 or layer.slots_per_expert != 1:
        raise ValueError(
            "Theorem 1 is about a single expert with a single slot; got "
            f"num_experts={layer.num_experts}, slots_per_expert={layer.slots_per_expert}"
        )


def theorem1_witness(
    layer: SoftMoE,
    a: float,
    num_tokens: int = 2,
    *,
    token: int = 0,
    partner: int | None = None,
    coord: int | None = 0,
) -> Witness:
    """The proof's witness pair (A, B), each of shape (num_tokens, layer.dim), for the size ``a > 0``.

    Args:
        layer: a single-expert, single-slot :class:`~softmoe.SoftMoE` (anything else raises ValueError).
        a: the size of the non-zero entries; ``|t(A) - t(B)|`` is ``NORM_GAP_SLOPE[case] * a``.
        num_tokens: m >= 2, the number of tokens of A and B.
        token, partner: the two distinct token rows that carry the input (the proof's rows 1 and 2); partner
            defaults to ``(token + 1) % num_tokens``.
        coord: the feature coordinate c used as the proof's "first entry" (default 0, exactly the proof), or None
            for the coordinate with the largest ``|phi_c|`` (relabelling features changes nothing in the proof, and
            the slot gap decays like ``a * exp(-a |phi_c|)``, so this converges fastest).

    Equation (1), ``layer.normalize`` "none": logits are ``X phi``; the three cases of Appendix B on ``phi_c``
    (all entries below are zero except those listed; e_c the c-th feature):

    - ``phi_c > 0``: A[token] = a e_c, A[partner] = -a e_c; B[token] = a e_c. The logit a*phi_c of ``token`` dominates
      both dispatch softmaxes, so both slots tend to a e_c (the gap is about a exp(-a phi_c)), while
      t(A) - t(B) = (sqrt(2) - 1) a.
    - ``phi_c < 0``: the same with every sign flipped (A[token] = -a e_c, A[partner] = a e_c, B[token] = -a e_c): the
      proof's "completely symmetric" case, the logit -a*phi_c > 0 again dominates.
    - ``phi_c == 0`` (exactly): B[token] = a e_c; A[token] = A[partner] = (a/2) e_c. All logits are 0, dispatch is
      uniform 1/m, and both slots equal (a/m) e_c exactly, while t(B) - t(A) = (1 - 1/sqrt(2)) a.

    Normalized routing (``layer.normalize`` "router", vmoe's default, logits = scale * <x_i/|x_i|, phi/|phi|>):
    the proof's first two cases do not carry over, because a logit no longer grows with ``a`` (it is bounded by
    ``|scale|``), so dispatch never concentrates and the slots of A and B stay a constant fraction of ``a`` apart.
    But the logits depend on the token *directions* only, and the slot is still built from the raw tokens, which
    gives a witness for every phi: A[token] = A[partner] = (a/2) e_c; B[token] = (1 - SPLIT) a e_c,
    B[partner] = SPLIT a e_c (SPLIT = 0.05). The two non-zero tokens of A and of B point the same way, so all four
    get the same logit, the dispatch weights of A and B are equal, and both slots are w a e_c (w the common weight),
    while t(B) - t(A) = (hypot(1 - SPLIT, SPLIT) - 1/sqrt(2)) a ~ 0.244 a. The only deviation is the 1e-6 inside the
    normalization's rsqrt, which changes a logit by O(1e-6 / (SPLIT a)^2), so the slot gap is O(1/a) -> 0. This is
    the proof's case ``phi_c = 0`` with "same logit" in place of "zero logit"; the rest of the proof (equations (2)
    to (4), which only use C = ones and the Lipschitz bounds) is unchanged, so it witnesses Theorem 1 for the
    normalized layer as well. (The paper's remark that normalization makes the theorem inapplicable is about
    normalizing the *input* X; our layer normalizes only inside the router.)
    """
    _check_single_expert(layer)
    if layer.normalize == "inputs":
        raise ValueError(
            "Theorem 1 does not apply to a layer that normalizes its input tokens (normalize='inputs'): every token "
            "then has norm about 1, so no two inputs differ in norm by a (the paper, section 3, 'Normalizing Input')"
        )
    if not isinstance(num_tokens, int) or num_tokens < 2:
        raise ValueError(f"num_tokens must be an integer >= 2 (Theorem 1 needs m >= 2), got {num_tokens!r}")
    a = float(a)
    if not math.isfinite(a) or a <= 0:
        raise ValueError(f"a must be a finite positive number, got {a}")
    partner = (token + 1) % num_tokens if partner is None else partner
    for name, value in (("token", token), ("partner", partner)):
        if not 0 <= value < num_tokens:
            raise ValueError(f"{name} must be in [0, {num_tokens}), got {value}")
    if token == partner:
        raise ValueError(f"token and partner must differ, got {token} twice")
    phi = layer.phi.detach()[:, 0, 0]
    if coord is None:
        coord = int(phi.abs().argmax())
    if not 0 <= coord < layer.dim:
        raise ValueError(f"coord must be in [0, {layer.dim}), got {coord}")

    factory: FactoryKwargs = {"dtype": layer.phi.dtype, "device": layer.phi.device}
    A = torch.zeros(num_tokens, layer.dim, **factory)
    B = torch.zeros(num_tokens, layer.dim, **factory)
    if layer.normalize == "router":
        case = CASE_NORMALIZED
        A[token, coord] = A[partner, coord] = a / 2
        B[token, coord] = (1 - SPLIT) * a
        B[partner, coord] = SPLIT * a
    else:
        phi_c = float(phi[coord])
        if phi_c == 0.0:
            case = CASE_ZERO
            B[token, coord] = a
            A[token, coord] = A[partner, coord] = a / 2
        else:
            case = CASE_POSITIVE if phi_c > 0 else CASE_NEGATIVE
            sign = 1.0 if phi_c > 0 else -1.0
            A[token, coord] = sign * a
            A[partner, coord] = -sign * a
            B[token, coord] = sign * a
    return Witness(A, B, a, case, coord, token, partner)


def _analysis_copy(layer: SoftMoE, dtype: torch.dtype | None) -> SoftMoE:
    """The layer itself, or an eval-mode copy converted to ``dtype``."""
    if dtype is None or dtype == layer.phi.dtype:
        return layer
    return copy.deepcopy(layer).to(dtype).eval()


@torch.no_grad()
def witness_gaps(layer: SoftMoE, witness: Witness, dtype: torch.dtype | None = torch.float64) -> dict:
    """Measure one witness on the layer: a dict with

    - ``a``, ``case``;
    - ``norm_gap``: ``|t(A) - t(B)|`` (Frobenius norms), linear in a;
    - ``slot_gap``: ``||D(A)^T A - D(B)^T B||_2``, what the expert is shown, tending to 0;
    - ``output_gap``: ``||sMoE(A) - sMoE(B)||_F`` over the (m, d) outputs, tending to 0 for any continuous expert.

    The layer is evaluated on a copy converted to ``dtype`` (float64 by default, so that the limits are not hidden
    by float32 rounding at large a; None uses the layer as it is).
    """
    _check_single_expert(layer)
    model = _analysis_copy(layer, dtype)
    x = torch.stack([witness.A, witness.B]).to(model.phi.dtype)
    routing = model.route(x)
    slots = dispatch_slots(model.slot_inputs(x), routing.dispatch.flatten(2))
    out = model(x)
    return {
        "a": witness.a,
        "case": witness.case,
        "norm_gap": abs(float(x[0].norm() - x[1].norm())),
        "slot_gap": float((slots[0] - slots[1]).norm()),
        "output_gap": float((out[0] - out[1]).norm()),
    }


def witness_table(
    layer: SoftMoE,
    sizes,
    num_tokens: int = 2,
    *,
    token: int = 0,
    partner: int | None = None,
    coord: int | None = 0,
    dtype: torch.dtype | None = torch.float64,
) -> list[dict]:
    """:func:`witness_gaps` for the witness of every size a in ``sizes``: a list of dicts with keys
    ``a, case, norm_gap, slot_gap, output_gap`` (plain floats and strings, JSON-serializable).

    The other arguments are those of :func:`theorem1_witness` and :func:`witness_gaps`.
    """
    _check_single_expert(layer)
    model = _analysis_copy(layer, dtype)
    rows = []
    for a in sizes:
        witness = theorem1_witness(model, a, num_tokens, token=token, partner=partner, coord=coord)
        rows.append(witness_gaps(model, witness, dtype=None))
    return rows


@torch.no_grad()
def single_expert_collapse(layer: SoftMoE, x: torch.Tensor) -> Collapse:
    """Run a single-slot layer on x (batch, tokens, dim) and show that every output token is ``f(D(X)^T X)``.

    With n = 1 expert and p = 1 slot the combine softmax is over one slot, so C(X) is a column of ones and
    ``sMoE(X) = 1 f(D(X)^T X)``: all m output tokens are the same vector, whatever the expert. Raises ValueError
    for any other layer.
    """
    _check_single_expert(layer)
    out = layer(x)
    routing = layer.route(x)
    slots = dispatch_slots(layer.slot_inputs(x), routing.dispatch.flatten(2))
    expert_out = layer.run_experts(slots)[:, 0]
    spread = (out - out[:, :1]).abs().amax() if out.numel() else out.new_zeros(())
    gap = (out - expert_out.unsqueeze(1)).abs().amax() if out.numel() else out.new_zeros(())
    return Collapse(out, expert_out, float(spread), float(gap))
