"""Top-k and argmax with one tie rule on every device: among equal values the LOWEST index comes first.

This is ``jax.lax.top_k``'s rule, which vmoe's routers (and jaxopt's sparse simplex projection) rely on.
``torch.topk`` makes no promise about ties (its order among equal values may differ between devices and kernels),
so every top-k of the project goes through :func:`top_k`, a stable descending sort cut after k entries.
"""

from __future__ import annotations

import torch


def top_k(values: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of ``values`` along ``dim``, in decreasing order, ties to the lowest index.

    values (..., n, ...) -> (top values, their int64 indices), each of the same shape with ``n`` replaced by k.
    NaN counts as larger than every number (as in ``torch.sort``).
    """
    n = values.shape[dim]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an integer in [1, {n}] (the size of dim {dim}), got {k!r}")
    ordered, order = torch.sort(values, dim=dim, descending=True, stable=True)
    return ordered.narrow(dim, 0, k), order.narrow(dim, 0, k)


def first_argmax(values: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The maximum along ``dim`` and the lowest index holding it (the first NaN where there is one).

    values (..., n, ...) -> (maxima, int64 indices), each with ``dim`` removed. Costs two reductions, no sort.
    """
    if values.shape[dim] == 0:
        raise ValueError(f"first_argmax needs a non-empty dim {dim}, got shape {tuple(values.shape)}")
    best = values.amax(dim=dim, keepdim=True)
    hit = (values == best) | values.isnan()
    shape = [1] * values.dim()
    shape[dim] = values.shape[dim]
    positions = torch.arange(values.shape[dim], device=values.device).view(shape)
    index = torch.where(hit, positions, values.shape[dim]).amin(dim=dim)
    return best.squeeze(dim), index


def top_k_list(values: list[float], k: int) -> list[int]:
    """The indices of the k largest of ``values``, ascending, by :func:`top_k`'s rule (NaN largest, ties to the
    lowest index): the same choice on the host, for a few values already read there."""

    def descending(j: int) -> tuple[bool, float]:  # NaN (v != v) first, then the largest; sorted() is stable
        v = values[j]
        return (v == v, -v if v == v else 0.0)

    order = sorted(range(len(values)), key=descending)
    return sorted(order[:k])
