"""softmoe.topk: jax.lax.top_k's tie rule (the lowest index first) on every device, and the routers that rely on it."""

from __future__ import annotations

import pytest
import torch

from softmoe.routing import expert_choice_allocation, token_choice_allocation
from softmoe.topk import first_argmax, top_k

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float64]


def reference_top_k(row: list[float], k: int) -> tuple[list[float], list[int]]:
    """The k largest entries of a list, ties to the lower index, by selection: repeatedly take the first maximum."""
    left = list(range(len(row)))
    chosen = []
    for _ in range(k):
        best = left[0]
        for i in left[1:]:
            if row[i] > row[best]:
                best = i
        chosen.append(best)
        left.remove(best)
    return [row[i] for i in chosen], chosen


def tied_rows(generator: torch.Generator, rows: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows drawn from only 3 distinct values, so ties sit at many positions."""
    levels = torch.tensor([-0.5, 0.25, 1.0], dtype=dtype)
    return levels[torch.randint(0, 3, (rows, n), generator=generator)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_matches_the_slow_reference_with_ties_everywhere(device, dtype):
    values = tied_rows(torch.Generator().manual_seed(0), 40, 9, dtype)
    for k in (1, 2, 5, 9):
        got_values, got_index = top_k(values.to(device), k)
        assert got_values.dtype == dtype and got_index.dtype == torch.int64
        for row, v, i in zip(values.tolist(), got_values.cpu().tolist(), got_index.cpu().tolist()):
            assert (v, i) == reference_top_k(row, k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_all_equal_rows_and_k_equal_n(device, dtype):
    values = torch.full((3, 7), 0.5, dtype=dtype, device=device)
    assert top_k(values, 3)[1].tolist() == [[0, 1, 2]] * 3
    assert top_k(values, 7)[1].tolist() == [list(range(7))] * 3  # k = n: every index, in order
    row = torch.tensor([[2.0, 1.0, 2.0, 3.0, 1.0]], dtype=dtype, device=device)
    got_values, got_index = top_k(row, 5)
    assert got_index.tolist() == [[3, 0, 2, 1, 4]] and got_values.tolist() == [[3.0, 2.0, 2.0, 1.0, 1.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_along_another_dim(device):
    values = tied_rows(torch.Generator().manual_seed(1), 6, 5, torch.float64).to(device)  # (6, 5)
    got_values, got_index = top_k(values, 4, dim=0)  # per column
    assert got_index.shape == (4, 5)
    for column in range(5):
        expected = reference_top_k(values[:, column].tolist(), 4)
        assert (got_values[:, column].tolist(), got_index[:, column].tolist()) == expected


def test_top_k_rejects_bad_k():
    for k in (0, 4, 1.0, True):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 3\]"):
            top_k(torch.zeros(2, 3), k)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_first_argmax(device, dtype):
    values = tied_rows(torch.Generator().manual_seed(2), 30, 6, dtype).to(device)
    best, index = first_argmax(values, dim=1)
    for row, b, i in zip(values.tolist(), best.tolist(), index.tolist()):
        assert (b, i) == (max(row), row.index(max(row)))
    columns = first_argmax(values, dim=0)[1]
    assert columns.tolist() == [values[:, j].tolist().index(max(values[:, j].tolist())) for j in range(6)]
    with_nan = torch.tensor([[1.0, float("nan"), 3.0, float("nan")]], dtype=dtype, device=device)
    assert first_argmax(with_nan, dim=1)[1].tolist() == [1]  # NaN wins, as in torch.max and jnp.argmax
    with pytest.raises(ValueError, match="non-empty"):
        first_argmax(torch.zeros(2, 0), dim=1)


@pytest.mark.parametrize("device", DEVICES)
def test_token_choice_ties_go_to_the_lowest_expert(device):
    affinity = torch.tensor(
        [[[0.3, 0.3, 0.4], [0.25, 0.25, 0.25], [0.1, 0.5, 0.5]]], dtype=torch.float64, device=device
    )
    routing = token_choice_allocation(affinity, capacity=3, k=2)
    # K-major: first choices t0 -> e2, t1 -> e0, t2 -> e1; second choices t0 -> e0, t1 -> e1, t2 -> e2.
    assert routing.token_index.tolist() == [[[1, 0, -1], [2, 1, -1], [0, 2, -1]]]
    all_equal = torch.full((1, 5, 4), 0.25, device=device)
    assert token_choice_allocation(all_equal, capacity=5, k=1).token_index[0, :, 0].tolist() == [0, -1, -1, -1]


@pytest.mark.parametrize("device", DEVICES)
def test_expert_choice_ties_go_to_the_lowest_token(device):
    affinity = torch.tensor([[[0.5, 0.2], [0.7, 0.2], [0.5, 0.2], [0.5, 0.9]]], dtype=torch.float64, device=device)
    routing = expert_choice_allocation(affinity, capacity=3)
    assert routing.token_index.tolist() == [[[1, 0, 2], [3, 0, 1]]]
    all_equal = torch.full((2, 6, 3), 1 / 3, device=device)
    assert expert_choice_allocation(all_equal, capacity=4).token_index.tolist() == [[[0, 1, 2, 3]] * 3] * 2
