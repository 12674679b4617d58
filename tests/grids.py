"""Pairwise test grids: every pair of values of any two parameters in some case, not the full product.

The native kernels' tests cross shapes, instruction sets, thread counts, bias and the like. Their full product grew
to thousands of cases, most of which re-test pairs of values already seen together; faults in such kernels depend
on one value or on the interaction of two (a shape's tail with one instruction set, a thread count with one
layout), which a pairwise grid still meets.
"""

from __future__ import annotations

import itertools


def pairwise(**values: list) -> list[tuple]:
    """Rows (one value per parameter, in the keywords' order) that together hold every pair of values of any two
    parameters. Greedy and deterministic: each new row starts from the first pair not yet held and takes, parameter
    by parameter, the value that holds the most new pairs (ties to the earlier value).

    >>> rows = pairwise(a=[1, 2], b=["x", "y"], c=[True, False])
    >>> len(rows) < 8 and {(r[0], r[1]) for r in rows} == {(1, "x"), (1, "y"), (2, "x"), (2, "y")}
    True
    """
    names = list(values)
    options = [list(values[name]) for name in names]
    if len(names) < 2:
        return [(v,) for v in options[0]] if names else []
    missing = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(names)), 2)
        for a in range(len(options[i]))
        for b in range(len(options[j]))
    }
    rows = []
    while missing:
        i, a, j, b = min(missing)
        row: list[int | None] = [None] * len(names)
        row[i], row[j] = a, b
        for k in range(len(names)):
            if row[k] is None:
                row[k] = max(range(len(options[k])), key=lambda v: (_new_pairs(row, k, v, missing), -v))
        missing -= {
            (p, row[p], q, row[q]) for p, q in itertools.combinations(range(len(names)), 2)
        }
        rows.append(tuple(options[k][row[k]] for k in range(len(names))))
    return rows


def _new_pairs(row: list, k: int, v: int, missing: set) -> int:
    """How many pairs not yet held value v of parameter k would hold with the values already in the row."""
    return sum(
        (min(p, k), row[p] if p < k else v, max(p, k), v if p < k else row[p]) in missing
        for p in range(len(row))
        if p != k and row[p] is not None
    )
