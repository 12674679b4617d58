"""Buffer capacity: how many tokens (or slots) each expert processes per group.

The router study (section 3.1) sets ``C = round(c * T / E)`` for every router: ``c`` is the capacity factor of the
Expert Choice routers and of Soft MoE, and for the Token Choice routers the number of selected experts ``k`` plays the
role of ``c`` (``C = round(k * T / E)``). The authors' sparse-MoE code (vmoe) uses
``ceil(k * T * c / E)`` instead, by default rounded up to a multiple of 4. Both are available here.
"""

from __future__ import annotations

import math
from fractions import Fraction

ROUNDINGS = ("round", "ceil")


def _exact(value: float | int) -> Fraction:
    """``value`` as the decimal the user wrote (1.1 -> 11/10), so that ceil(1.1 * 10) is 11, not 12."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number, got {value!r}")
    return Fraction(value) if isinstance(value, int) else Fraction(repr(float(value)))


def buffer_capacity(
    num_tokens: int,
    num_experts: int,
    capacity_factor: float = 1.0,
    *,
    k: int = 1,
    rounding: str = "round",
    multiple_of: int = 1,
    minimum: int = 1,
    maximum: int | None = None,
) -> int:
    """``C = rounding(capacity_factor * k * num_tokens / num_experts)``, then up to a multiple, then clamped.

    Args:
        num_tokens: T, the tokens of one routing group.
        num_experts: E.
        capacity_factor: c (> 0).
        k: experts selected per token (Token Choice); 1 for Expert Choice and Soft MoE.
        rounding: "round" (the router study; Python's round-half-to-even, as numpy and JAX round) or "ceil" (vmoe).
        multiple_of: round the result up to a multiple of this (vmoe's default for sparse MoEs is 4).
        minimum: the smallest capacity returned (default 1).
        maximum: the largest capacity returned (e.g. T for Expert Choice, where an expert cannot take more tokens
            than there are), or None.
    """
    for name, value in (("num_tokens", num_tokens), ("num_experts", num_experts), ("k", k), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    factor = _exact(capacity_factor)
    if factor <= 0:
        raise ValueError(f"capacity_factor must be > 0, got {capacity_factor!r}")
    raw = factor * k * num_tokens / num_experts
    capacity = math.ceil(raw) if rounding == "ceil" else round(raw)
    capacity = -(-capacity // multiple_of) * multiple_of
    capacity = max(minimum, capacity)
    if maximum is not None:
        capacity = min(capacity, maximum)
    return capacity
