"""Buffer capacity: how many tokens (or slots) each expert processes per group, as vmoe computes it.

vmoe's ``compute_capacity(num_tokens, num_experts, capacity_factor, ceil_or_round, multiple_of)`` (vmoe/moe.py)
evaluates ``num_tokens * capacity_factor / num_experts`` in plain Python float arithmetic, left to right, then takes
``math.ceil`` or ``round`` (half to even, as numpy and JAX round), raises when the result is below 1, and rounds it up
to a multiple of ``multiple_of``. For Token Choice vmoe passes ``num_tokens = T * k``. The float arithmetic is part
of the behaviour: ``100 * 1.1 / 10`` is 11.000000000000002, so its ceiling is 12, not 11.

The router study sets ``C = round(c * T / E)`` (``rounding="round"``, ``multiple_of=1``: the routers' defaults here);
vmoe's sparse-MoE default is ``rounding="ceil"``, ``multiple_of=4``.

Under ``torch.compile`` with dynamic shapes the number of tokens is a ``torch.SymInt`` (a symbol standing for the
batch size times the tokens per image), and :func:`buffer_capacity` returns a ``SymInt`` built from the SAME
expression: ``k * T`` is an integer product, ``* capacity_factor`` and ``/ num_experts`` are symbolic float
operations that PyTorch keeps as a tree in that order (``FloatTrueDiv(c * ToFloat(k * T), E)``, never folded into
``(k * c / E) * T``) and evaluates with Python floats, ``math.ceil`` / ``round`` become ``CeilToInt`` / ``RoundToInt``
(half to even) and the multiple / maximum use integer ``Mod`` and ``sym_min``. A compiled graph therefore sizes its
buffers for every batch size without recompiling, and with exactly the integers of the eager float computation
(``tests/test_routing_compile.py`` checks 100 * 1.1 / 10 and a few thousand other sizes).
"""

from __future__ import annotations

import math
from typing import overload

import torch

from softmoe.checks import check_positive_ints

ROUNDINGS = ("round", "ceil")


def check_capacity_factor(capacity_factor: float) -> float:
    """``capacity_factor`` if it is a finite number > 0 (int or float), else a ValueError."""
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)):
        raise ValueError(f"capacity_factor must be a number > 0, got {capacity_factor!r}")
    if not 0 < capacity_factor < math.inf:
        raise ValueError(f"capacity_factor must be a finite number > 0, got {capacity_factor!r}")
    return capacity_factor


@overload
def buffer_capacity(
    num_tokens: int,
    num_experts: int,
    capacity_factor: float = 1.0,
    *,
    k: int = 1,
    rounding: str = "round",
    multiple_of: int = 1,
    maximum: int | None = None,
) -> int: ...


@overload
def buffer_capacity(
    num_tokens: int | torch.SymInt,
    num_experts: int,
    capacity_factor: float = 1.0,
    *,
    k: int = 1,
    rounding: str = "round",
    multiple_of: int = 1,
    maximum: int | torch.SymInt | None = None,
) -> int | torch.SymInt: ...


def buffer_capacity(
    num_tokens: int | torch.SymInt,
    num_experts: int,
    capacity_factor: float = 1.0,
    *,
    k: int = 1,
    rounding: str = "round",
    multiple_of: int = 1,
    maximum: int | torch.SymInt | None = None,
) -> int | torch.SymInt:
    """vmoe's ``compute_capacity`` for ``k * num_tokens`` tokens, then clamped to ``maximum``.

    ``C = rounding(k * num_tokens * capacity_factor / num_experts)`` in float arithmetic in that order, a ValueError
    if C < 1, then C rounded up to a multiple of ``multiple_of`` and lowered to ``maximum``.

    A ``torch.SymInt`` ``num_tokens`` (or ``maximum``), as ``torch.compile`` passes sizes with dynamic shapes, gives a
    ``SymInt`` capacity that equals the int of the float computation for every value of the symbol (module doc).

    Args:
        num_tokens: T, the tokens of one routing group (an int or a SymInt).
        num_experts: E.
        capacity_factor: c (> 0).
        k: experts selected per token (Token Choice); 1 for Expert Choice and Soft MoE.
        rounding: "round" (the router study; Python's round-half-to-even) or "ceil" (vmoe's default).
        multiple_of: round the result up to a multiple of this (vmoe's default for sparse MoEs is 4; 1: no effect).
        maximum: the largest capacity returned (e.g. T for Expert Choice, where an expert cannot take more tokens
            than there are; an int or a SymInt), or None.
    """
    check_positive_ints(num_tokens=num_tokens, num_experts=num_experts, k=k, multiple_of=multiple_of)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    check_capacity_factor(capacity_factor)
    # Left to right, as vmoe: an int product, then two float operations (symbolic ones for a SymInt num_tokens).
    raw = k * num_tokens * capacity_factor / num_experts
    capacity = math.ceil(raw) if rounding == "ceil" else round(raw)  # ints (SymInts): round is half to even
    if capacity < 1:
        raise ValueError(
            f"num_tokens = {num_tokens}, num_experts = {num_experts}, capacity_factor = {capacity_factor!r} and "
            f"k = {k} give capacity {rounding}({raw!r}) = {capacity}; it must be >= 1"
        )
    capacity += -capacity % multiple_of
    if maximum is not None:
        # a symbolic min (no guard) for SymInts; Python's for ints (torch 2.9's dynamo cannot trace torch.sym_min of
        # two ints)
        plain = isinstance(capacity, int) and isinstance(maximum, int)
        capacity = min(capacity, maximum) if plain else torch.sym_min(capacity, maximum)
    return capacity
