"""The router study's formulation and six routers (softmoe.routing) against hand-worked examples and slow references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from softmoe import SoftMoE
from softmoe.layer import l2_normalize
from softmoe.routing import (
    ROUTERS,
    DenseRouting,
    ExpertChoiceRouter,
    MoELayer,
    SoftMoERouter,
    SparseRouting,
    TokenChoiceRouter,
    buffer_capacity,
    dense_moe,
    expert_choice_allocation,
    importance_loss,
    load_loss,
    make_router,
    sinkhorn_plan,
    soft_moe_metrics,
    sparse_moe,
    sparse_plan,
    sparse_plan_columns,
    sparse_simplex_projection,
    squared_cv,
    token_choice_allocation,
)

F64 = torch.float64
# vmoe's moe_test.py example: 3 tokens, 3 experts, capacity 2, K = 2.
GOLDEN_GATES = torch.tensor([[0.4, 0.0, 0.2], [0.5, 0.1, 0.4], [0.3, 0.2, 0.6]], dtype=F64).unsqueeze(0)


def slots(routing: SparseRouting) -> list[list[tuple[int, float]]]:
    """Per expert, the (token, combine weight) pairs of its filled slots, in slot order (group 0)."""
    out = []
    for e in range(routing.num_experts):
        pairs = [
            (int(t), round(float(w), 6))
            for t, w in zip(routing.token_index[0, e], routing.combine[0, e])
            if int(t) >= 0
        ]
        out.append(pairs)
    return out


# ---------------------------------------------------------------- capacity


def test_capacity_round_and_ceil():
    assert buffer_capacity(196, 32, 1) == 6  # round(6.125)
    assert buffer_capacity(196, 32, 1, rounding="ceil") == 7
    assert buffer_capacity(196, 32, 2) == 12  # round(12.25)
    assert buffer_capacity(196, 32, 1, k=2) == 12  # Token Choice: C = round(k T / E)
    assert buffer_capacity(10, 4, 1) == 2  # round(2.5) = 2: round half to even, as numpy / JAX
    assert buffer_capacity(14, 4, 1) == 4  # round(3.5) = 4
    assert buffer_capacity(100, 10, 1.1, rounding="ceil") == 12  # vmoe: 100 * 1.1 / 10 = 11.000000000000002
    assert buffer_capacity(196, 32, 1, rounding="ceil", multiple_of=4) == 8  # vmoe's default for sparse MoEs
    assert buffer_capacity(16, 2, 4, maximum=16) == 16


def vmoe_compute_capacity(num_tokens, num_experts, capacity_factor, ceil_or_round, multiple_of):
    """vmoe's compute_capacity re-derived: float arithmetic in vmoe's order; None where vmoe raises."""
    value = num_tokens * capacity_factor / num_experts
    capacity = int(math.ceil(value)) if ceil_or_round == "ceil" else int(round(value))
    if capacity < 1:
        return None
    while capacity % multiple_of:
        capacity += 1
    return capacity


@pytest.mark.parametrize("rounding", ["round", "ceil"])
@pytest.mark.parametrize("multiple_of", [1, 4])
def test_capacity_is_vmoes_float_arithmetic(rounding, multiple_of):
    for tokens in (1, 3, 10, 30, 45, 50, 55, 64, 100, 196, 197):
        for experts in (1, 2, 8, 10, 32):
            for factor in (0.1, 0.25, 0.3, 0.7, 1, 1.0, 1.1, 1.25, 2, 2.2, 3.3):
                for k in (1, 2, 3):
                    # vmoe passes num_tokens = group_size * num_selected_experts.
                    expected = vmoe_compute_capacity(tokens * k, experts, factor, rounding, multiple_of)
                    args = (tokens, experts, factor)
                    kwargs = dict(k=k, rounding=rounding, multiple_of=multiple_of)
                    if expected is None:
                        with pytest.raises(ValueError, match=f"num_tokens = {tokens}, num_experts = {experts}"):
                            buffer_capacity(*args, **kwargs)
                    else:
                        assert buffer_capacity(*args, **kwargs) == expected, (args, kwargs)


def test_capacity_keeps_the_float_overshoot():
    # Exact arithmetic would give 11, 55, 60.5 -> 60 (half to even) and 31.5 -> 32; vmoe's floats do not.
    assert 100 * 1.1 / 10 == 11.000000000000002 and buffer_capacity(100, 10, 1.1, rounding="ceil") == 12
    assert 50 * 1.1 / 1 == 55.00000000000001 and buffer_capacity(50, 1, 1.1, rounding="ceil") == 56
    assert 55 * 1.1 / 1 == 60.50000000000001 and buffer_capacity(55, 1, 1.1) == 61
    assert 45 * 0.7 / 1 == 31.499999999999996 and buffer_capacity(45, 1, 0.7) == 31
    assert buffer_capacity(10, 1, 1.1, rounding="ceil") == 11  # 10 * 1.1 is exactly 11.0 in floats
    # Token Choice multiplies k * T first, as vmoe (num_tokens = group_size * k): (3 * 30) * 1.1 = 99.00000000000001
    # where 3 * (30 * 1.1) = 99, and (3 * 50) * 1.1 = 165 where 3 * (50 * 1.1) = 165.00000000000003.
    assert buffer_capacity(30, 1, 1.1, k=3, rounding="ceil") == 100
    assert buffer_capacity(50, 1, 1.1, k=3, rounding="ceil") == 165
    assert buffer_capacity(100, 10, 1.1, rounding="ceil", multiple_of=4) == 12
    assert buffer_capacity(100, 10, 1.1, rounding="ceil", multiple_of=5) == 15
    assert buffer_capacity(100, 10, 1.1, rounding="ceil", maximum=10) == 10


def test_capacity_below_one_is_an_error():
    with pytest.raises(ValueError, match=r"num_tokens = 1, num_experts = 8, capacity_factor = 1.0 and k = 1 .* = 0"):
        buffer_capacity(1, 8, 1.0, rounding="round")
    with pytest.raises(ValueError, match="it must be >= 1"):
        buffer_capacity(3, 32, 1)  # round(0.09375)
    with pytest.raises(ValueError, match="it must be >= 1"):
        buffer_capacity(1, 2, 1.0)  # round(0.5) = 0: half to even
    assert buffer_capacity(1, 8, 1.0, rounding="ceil") == 1
    assert buffer_capacity(3, 2, 1.0) == 2  # round(1.5) = 2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=0, num_experts=2), "num_tokens"),
        (dict(num_tokens=4, num_experts=2, capacity_factor=0), "capacity_factor"),
        (dict(num_tokens=4, num_experts=2, capacity_factor=math.inf), "capacity_factor"),
        (dict(num_tokens=4, num_experts=2, capacity_factor="1"), "capacity_factor"),
        (dict(num_tokens=4, num_experts=2, rounding="floor"), "rounding"),
        (dict(num_tokens=4, num_experts=2, k=0), "k must"),
        (dict(num_tokens=4, num_experts=2, multiple_of=0), "multiple_of"),
    ],
)
def test_capacity_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        buffer_capacity(**kwargs)


def test_routers_accept_small_capacity_factors():
    # The factor is validated on its own: a small c only fails for a group too small to give any expert a token.
    router = ExpertChoiceRouter(6, 4, capacity_factor=0.25)
    assert router.capacity(64) == 4
    with pytest.raises(ValueError, match="it must be >= 1"):
        router.capacity(4)
    with pytest.raises(ValueError, match="capacity_factor"):
        TokenChoiceRouter(6, 4, capacity_factor=-1.0)


# ---------------------------------------------------------------- golden examples


def test_golden_token_choice():
    # K-major: first choices t0->e0, t1->e0, t2->e2; then t0->e2 (slot 1), t1->e2 (full, dropped), t2->e0 (full).
    routing = token_choice_allocation(GOLDEN_GATES, capacity=2, k=2)
    assert slots(routing) == [[(0, 0.4), (1, 0.5)], [], [(2, 0.6), (0, 0.2)]]
    dispatch, combine = routing.to_dense()
    expected_dispatch = torch.zeros(1, 3, 3, 2, dtype=F64)
    expected_combine = torch.zeros(1, 3, 3, 2, dtype=F64)
    for e, pairs in enumerate([[(0, 0.4), (1, 0.5)], [], [(2, 0.6), (0, 0.2)]]):
        for c, (t, w) in enumerate(pairs):
            expected_dispatch[0, t, e, c] = 1
            expected_combine[0, t, e, c] = w
    torch.testing.assert_close(dispatch, expected_dispatch)
    torch.testing.assert_close(combine, expected_combine)
    assert routing.experts_per_token().tolist() == [[2, 1, 1]]


def test_golden_token_choice_batch_priority():
    # Priority by top-1 gate: t2 (.6), t1 (.5), t0 (.4). First choices t2->e2, t1->e0, t0->e0; second choices
    # t2->e0 (full, dropped), t1->e2 (slot 1), t0->e2 (full, dropped).
    routing = token_choice_allocation(GOLDEN_GATES, capacity=2, k=2, priority=GOLDEN_GATES.max(-1).values)
    assert slots(routing) == [[(1, 0.5), (0, 0.4)], [], [(2, 0.6), (1, 0.4)]]
    assert routing.experts_per_token().tolist() == [[1, 2, 1]]


def test_golden_token_choice_k1():
    routing = token_choice_allocation(GOLDEN_GATES, capacity=1, k=1)
    assert slots(routing) == [[(0, 0.4)], [], [(2, 0.6)]]  # t1 wants e0, which is full: dropped
    assert routing.experts_per_token().tolist() == [[1, 0, 1]]


def test_golden_expert_choice():
    # Each expert's top-2 tokens: e0 (.5 t1, .4 t0), e1 (.2 t2, .1 t1), e2 (.6 t2, .4 t1). Token 1 gets 3 experts.
    routing = expert_choice_allocation(GOLDEN_GATES, capacity=2)
    assert slots(routing) == [[(1, 0.5), (0, 0.4)], [(2, 0.2), (1, 0.1)], [(2, 0.6), (1, 0.4)]]
    assert routing.experts_per_token().tolist() == [[1, 3, 2]]


# ---------------------------------------------------------------- slow references


def algorithm1_reference(affinity, capacity, k, combine_from=None, priority=None):
    """Algorithm 1 of the paper, literally (loops), one group -> dense dispatch / combine (T, E, C)."""
    t_count, e_count = affinity.shape
    source = affinity if combine_from is None else combine_from
    dispatch = torch.zeros(t_count, e_count, capacity, dtype=affinity.dtype)
    combine = torch.zeros_like(dispatch)
    order = range(t_count) if priority is None else sorted(range(t_count), key=lambda t: -float(priority[t]))
    for i in range(k):
        for t in order:
            r = int(affinity[t].topk(k).indices[i])
            c = int(dispatch[:, r, :].count_nonzero())
            if c < capacity:
                dispatch[t, r, c] = 1
                combine[t, r, c] = source[t, r]
    return dispatch, combine


def algorithm2_reference(affinity, capacity, combine_from=None):
    """Algorithm 2 of the paper, literally: each expert's c-th best token goes to slot c."""
    t_count, e_count = affinity.shape
    source = affinity if combine_from is None else combine_from
    dispatch = torch.zeros(t_count, e_count, capacity, dtype=affinity.dtype)
    combine = torch.zeros_like(dispatch)
    for r in range(e_count):
        ranked = sorted(range(t_count), key=lambda t: -float(affinity[t, r]))
        for c in range(capacity):
            dispatch[ranked[c], r, c] = 1
            combine[ranked[c], r, c] = source[ranked[c], r]
    return dispatch, combine


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("bpr", [False, True])
def test_token_choice_matches_algorithm1(seed, k, bpr):
    gen = torch.Generator().manual_seed(seed)
    groups, tokens, experts = 3, 11, 4
    affinity = torch.rand(groups, tokens, experts, generator=gen, dtype=F64)
    combine_from = torch.rand(groups, tokens, experts, generator=gen, dtype=F64)
    priority = affinity.max(-1).values if bpr else None
    capacity = 2 + seed % 3
    routing = token_choice_allocation(affinity, capacity, k, combine_from, priority)
    routing.validate()
    dispatch, combine = routing.to_dense()
    for g in range(groups):
        ref_d, ref_c = algorithm1_reference(
            affinity[g], capacity, k, combine_from[g], None if priority is None else priority[g]
        )
        torch.testing.assert_close(dispatch[g], ref_d)
        torch.testing.assert_close(combine[g], ref_c)
    # Capacity is never exceeded (at most C tokens per expert) and no token gets more than k experts.
    assert int(dispatch.sum(dim=(1, 3)).max()) <= capacity
    assert int(routing.experts_per_token().max()) <= k


@settings(max_examples=25, deadline=None)
@given(
    tokens=st.integers(1, 9),
    experts=st.integers(1, 5),
    capacity=st.integers(1, 6),
    k=st.integers(1, 3),
    bpr=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_token_choice_any_shape(tokens, experts, capacity, k, bpr, seed):
    k = min(k, experts)
    affinity = torch.rand(1, tokens, experts, generator=torch.Generator().manual_seed(seed), dtype=F64)
    priority = affinity.max(-1).values if bpr else None
    routing = token_choice_allocation(affinity, capacity, k, priority=priority)
    routing.validate()
    ref_d, ref_c = algorithm1_reference(affinity[0], capacity, k, priority=None if priority is None else priority[0])
    dispatch, combine = routing.to_dense()
    torch.testing.assert_close(dispatch[0], ref_d)
    torch.testing.assert_close(combine[0], ref_c)


@pytest.mark.parametrize("seed", range(3))
def test_expert_choice_matches_algorithm2(seed):
    gen = torch.Generator().manual_seed(seed)
    affinity = torch.rand(2, 9, 3, generator=gen, dtype=F64)
    combine_from = torch.rand(2, 9, 3, generator=gen, dtype=F64)
    routing = expert_choice_allocation(affinity, 4, combine_from)
    routing.validate()
    dispatch, combine = routing.to_dense()
    for g in range(2):
        ref_d, ref_c = algorithm2_reference(affinity[g], 4, combine_from[g])
        torch.testing.assert_close(dispatch[g], ref_d)
        torch.testing.assert_close(combine[g], ref_c)
    assert dispatch.sum(dim=(1, 3)).eq(4).all()  # every expert exactly full


def test_validate_catches_malformed_routing():
    good = torch.tensor([[[0, 1], [2, -1]]])
    SparseRouting(good, torch.tensor([[[0.5, 0.5], [1.0, 0.0]]]), 3).validate()
    with pytest.raises(ValueError, match="in \\[-1, 3\\)"):
        SparseRouting(torch.tensor([[[0, 3]]]), torch.zeros(1, 1, 2), 3).validate()
    with pytest.raises(ValueError, match="empty slots"):
        SparseRouting(torch.tensor([[[0, -1]]]), torch.tensor([[[1.0, 0.2]]]), 3).validate()
    with pytest.raises(ValueError, match="two slots"):
        SparseRouting(torch.tensor([[[1, 1]]]), torch.ones(1, 1, 2), 3).validate()


# ---------------------------------------------------------------- optimal transport


def test_sinkhorn_meets_marginals():
    logits = torch.randn(3, 64, 8, generator=torch.Generator().manual_seed(0)) * 2
    plan = sinkhorn_plan(logits)  # the authors' 20 iterations
    assert plan.dtype == torch.float32 and bool((plan > 0).all())
    torch.testing.assert_close(plan.sum(-1), torch.ones(3, 64), atol=1e-4, rtol=0)
    torch.testing.assert_close(plan.sum(-2), torch.full((3, 8), 8.0), atol=1e-4, rtol=0)


def test_sinkhorn_equals_plain_sinkhorn_and_survives_large_logits():
    logits = torch.randn(1, 6, 3, generator=torch.Generator().manual_seed(1), dtype=F64)
    kernel = logits[0].exp()
    u, v = torch.ones(6, dtype=F64), torch.ones(3, dtype=F64)
    for _ in range(200):  # the textbook multiplicative iterations, fine at this scale
        u = 1 / (kernel @ v)
        v = 2 / (kernel.T @ u)
    torch.testing.assert_close(sinkhorn_plan(logits, 200)[0], u[:, None] * kernel * v[None, :])
    huge = sinkhorn_plan(logits * 500, 50)  # exp(500 * x) overflows in the multiplicative form
    assert bool(huge.isfinite().all())
    torch.testing.assert_close(huge.sum(-2), torch.full((1, 3), 2.0, dtype=F64))


def test_sparse_simplex_projection():
    values = torch.tensor([[0.9, 0.1, 0.5, 0.3], [3.0, 0.0, 0.0, 0.0]], dtype=F64)
    weights, index = sparse_simplex_projection(values, mass=1.0, k=2)
    # Row 0: top-2 (0.9, 0.5) -> tau = (1.4 - 1) / 2 = 0.2 -> (0.7, 0.3). Row 1: only 3.0 stays -> (1, 0).
    torch.testing.assert_close(weights, torch.tensor([[0.7, 0.3], [1.0, 0.0]], dtype=F64))
    assert index[0].tolist() == [0, 2] and index[1, 0] == 0
    # Against the textbook projection (all entries, k = n) at mass 2.
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(2), dtype=F64)
    weights, index = sparse_simplex_projection(x, 2.0, 7)
    dense = torch.zeros_like(x).scatter(-1, index, weights)
    for row, out in zip(x, dense):
        lo, hi = float(row.min()) - 2, float(row.max())
        for _ in range(200):  # bisection on the threshold
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if float((row - mid).clamp_min(0).sum()) > 2 else (lo, mid)
        torch.testing.assert_close(out, (row - lo).clamp_min(0), atol=1e-9, rtol=0)


def unit_sparse_projection_reference(x: list[float], nnz: int) -> list[float]:
    """jaxopt's projection onto the unit simplex with at most nnz nonzeros, written with plain Python lists."""
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))[:nnz]  # top-nnz, ties to the lower index
    top = [x[i] for i in order]
    cumsum = [sum(top[: j + 1]) for j in range(len(top))]
    size = sum(1 for j in range(len(top)) if 1 / (j + 1) + (top[j] - cumsum[j] / (j + 1)) > 0)
    out = [0.0] * len(x)
    for i, value in zip(order, top):
        out[i] = max(0.0, 1 / size + (value - cumsum[size - 1] / size))
    return out


def ksparse_plan_reference(sim: list[list[float]], nnz: int, alpha: list[float]) -> list[list[float]]:
    """P[:, r] = b * p_r with p_r the sparse projection of (alpha + sim[:, r]) / b, b = T / E, column by column."""
    tokens, experts = len(sim), len(sim[0])
    b = tokens / experts
    plan = [[0.0] * experts for _ in range(tokens)]
    for r in range(experts):
        p = unit_sparse_projection_reference([(alpha[t] + sim[t][r]) / b for t in range(tokens)], nnz)
        for t in range(tokens):
            plan[t][r] = b * p[t]
    return plan


def ksparse_solve_reference(sim, nnz, maxiter=20, tol=1e-3, lr=1e-2):
    """jaxopt OptaxSolver(optax.adam(lr), maxiter, tol) on the semi-dual of one group: the first step always, then
    steps while the previous gradient's norm exceeds tol. Returns (plan at the final prices, steps taken)."""
    tokens = len(sim)
    alpha, first, second = [0.0] * tokens, [0.0] * tokens, [0.0] * tokens
    steps, error = 0, math.inf
    for step in range(1, maxiter + 1):
        if step > 1 and not error > tol:
            break
        grad = [sum(row) - 1.0 for row in ksparse_plan_reference(sim, nnz, alpha)]
        error = math.sqrt(sum(g * g for g in grad))
        first = [0.9 * m + 0.1 * g for m, g in zip(first, grad)]
        second = [0.999 * v + 0.001 * g * g for v, g in zip(second, grad)]
        for t in range(tokens):
            m_hat, v_hat = first[t] / (1 - 0.9**step), second[t] / (1 - 0.999**step)
            alpha[t] -= lr * m_hat / (math.sqrt(v_hat) + 1e-8)
        steps += 1
    return ksparse_plan_reference(sim, nnz, alpha), steps


@pytest.mark.parametrize("tol", [1e-3, 0.5, 1.5])
def test_sparse_plan_matches_a_float64_rederivation(tol):
    sim = (torch.randn(6, 12, 4, generator=torch.Generator().manual_seed(3), dtype=F64) * 2).softmax(-1)
    plan = sparse_plan(sim, 3, tolerance=tol)
    steps = set()
    for g in range(6):
        expected, taken = ksparse_solve_reference(sim[g].tolist(), 3, tol=tol)
        steps.add(taken)
        torch.testing.assert_close(plan[g], torch.tensor(expected, dtype=F64), rtol=0, atol=1e-10)
    if tol > 1e-3:
        assert len(steps) > 1  # the groups stop independently
    else:
        assert steps == {20}


def test_sparse_plan_stops_after_one_step_when_balanced():
    # Tokens 0, 1 prefer expert 0 and tokens 2, 3 expert 1 by nearly equal margins: the plan at alpha = 0 is almost
    # balanced (gradient norm about 1e-4 < 1e-3), so only the first Adam step is taken. The second group needs all 20.
    near = torch.tensor([[0.9, 0.1], [0.9001, 0.0999], [0.1, 0.9], [0.0999, 0.9001]], dtype=F64)
    skewed = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]], dtype=F64)
    sim = torch.stack([near, skewed])
    plan = sparse_plan(sim, 2)
    for g in range(2):
        expected, taken = ksparse_solve_reference(sim[g].tolist(), 2)
        assert taken == (1, 20)[g]
        torch.testing.assert_close(plan[g], torch.tensor(expected, dtype=F64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("capacity", [8, 16, 100])
def test_sparse_plan_properties(capacity):
    utility = (torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(3)) * 2).softmax(-1)
    plan = sparse_plan(utility, capacity)
    assert plan.dtype == torch.float32 and bool((plan >= 0).all())
    assert int((plan > 0).sum(dim=1).max()) <= capacity
    torch.testing.assert_close(plan.sum(dim=1), torch.full((2, 8), 8.0))  # expert marginals T/E
    weights, index = sparse_plan_columns(utility, capacity)
    assert weights.shape == index.shape == (2, 8, min(capacity, 64))
    # Adam on the prices balances the tokens better than the plain projection at alpha = 0.
    start = sparse_plan(utility, capacity, max_iterations=0)
    assert (plan.sum(-1) - 1).abs().mean() < (start.sum(-1) - 1).abs().mean()


def test_sparse_router_matches_the_rederivation():
    torch.manual_seed(0)
    router = ExpertChoiceRouter(5, 4, capacity_factor=2.2, affinity="sparse").double()
    with torch.no_grad():
        router.gate.weight.mul_(6)  # peaked gates, so that the plan's columns have fewer than C nonzeros
    x = torch.randn(3, 16, 5, dtype=F64)
    routing = router(x)  # training mode: the sparse router has no noise
    capacity = buffer_capacity(16, 4, 2.2)
    probs = (x @ router.gate.weight.T).softmax(-1)
    assert routing.capacity == capacity == 9 and router.noise_std == 0.0
    routing.validate()
    zero_plan_picks = 0
    for g in range(3):
        plan, _ = ksparse_solve_reference(probs[g].tolist(), capacity)
        for r in range(4):
            # Every expert takes the top-C entries of its plan column, zeros included (ties to the lower token).
            chosen = sorted(range(16), key=lambda t: (-plan[t][r], t))[:capacity]
            assert routing.token_index[g, r].tolist() == chosen
            torch.testing.assert_close(routing.combine[g, r], probs[g, chosen, r])
            zero_plan_picks += sum(plan[t][r] == 0 for t in chosen)
    assert zero_plan_picks > 0  # some slots hold a token the plan gives 0: vmoe fills every slot
    assert bool(routing.filled().all())


# ---------------------------------------------------------------- auxiliary losses


def test_importance_loss_by_hand():
    gates = torch.tensor([[[0.9, 0.1], [0.7, 0.3]]], dtype=F64)
    # Sums over tokens (1.6, 0.4): mean 1, population std 0.6 -> CV^2 = 0.36.
    assert float(importance_loss(gates)) == pytest.approx(0.36)
    balanced = torch.tensor([[[0.75, 0.25], [0.25, 0.75]]], dtype=F64)
    assert float(importance_loss(balanced)) == pytest.approx(0.0)
    # Two groups: the mean of their losses.
    assert float(importance_loss(torch.cat([gates, balanced]))) == pytest.approx(0.18)
    assert float(squared_cv(torch.tensor([1.0, 3.0]))) == pytest.approx(0.25)


def test_load_loss_by_hand():
    clean = torch.tensor([[[1.0, 0.0, 0.5], [0.0, 2.0, 0.0]]], dtype=F64)
    noisy = torch.tensor([[[1.2, -0.1, 0.4], [0.3, 1.5, 0.2]]], dtype=F64)
    std = 0.5

    def phi(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    for k in (1, 2):
        thresholds = [sorted(row, reverse=True)[k - 1] for row in noisy[0].tolist()]
        loads = [
            sum(phi((clean[0, t, e].item() - thresholds[t]) / std) for t in range(2)) / 2 for e in range(3)
        ]
        mean = sum(loads) / 3
        var = sum((x - mean) ** 2 for x in loads) / 3
        assert float(load_loss(clean, noisy, k, std)) == pytest.approx(var / mean**2, rel=1e-9)
    with pytest.raises(ValueError, match="noise_std > 0"):
        load_loss(clean, noisy, 1, 0.0)


def test_token_choice_router_reports_its_losses():
    torch.manual_seed(0)
    router = TokenChoiceRouter(6, 4, k=2, importance_weight=0.1, load_weight=0.2).double().eval()
    x = torch.randn(2, 10, 6, dtype=F64)
    with torch.no_grad():
        routing = router(x)
        logits = x @ router.gate.weight.T
    # Eval mode is deterministic: vmoe reports the importance loss only (no load loss without noise).
    assert set(routing.auxiliary_losses) == {"importance"} and routing.auxiliary_weights == {"importance": 0.1}
    assert float(routing.auxiliary_losses["importance"]) == pytest.approx(float(importance_loss(logits.softmax(-1))))
    layer = MoELayer(6, router, 8).double()
    layer(x.view(4, 5, 6))  # groups: the whole batch (4 images of 5 tokens) = one group of 20 tokens
    torch.testing.assert_close(layer.auxiliary_loss, 0.1 * layer.auxiliary_losses["importance"])
    # Training mode: the load loss of the noisy logits (noise std 1 / E), with the same noise draw.
    router.train()
    torch.manual_seed(3)
    with torch.no_grad():
        routing = router(x)
    noisy = logits + seeded_noise(logits, 0.25, 3)
    assert float(routing.auxiliary_losses["load"]) == pytest.approx(float(load_loss(logits, noisy, 2, 0.25)))
    assert float(routing.auxiliary_losses["importance"]) == pytest.approx(float(importance_loss(logits.softmax(-1))))
    layer.train()
    layer(x.view(4, 5, 6))
    expected = 0.1 * layer.auxiliary_losses["importance"] + 0.2 * layer.auxiliary_losses["load"]
    torch.testing.assert_close(layer.auxiliary_loss, expected)
    # Without noise there is no load loss in training either; routers without auxiliary losses report 0.
    quiet = TokenChoiceRouter(6, 4, noise_std=0.0).double()
    assert set(quiet(x).auxiliary_losses) == {"importance"}
    ec = MoELayer(6, ExpertChoiceRouter(6, 4)).double()
    ec(x.view(4, 5, 6))
    assert float(ec.auxiliary_loss) == 0.0 and ec.auxiliary_losses == {}


def test_noisy_gating_only_in_training():
    torch.manual_seed(0)
    router = TokenChoiceRouter(6, 4, noise_std=4.0).double()
    x = torch.randn(1, 32, 6, dtype=F64)
    router.eval()
    first, second = router(x), router(x)
    assert torch.equal(first.token_index, second.token_index)
    router.train()
    draws = [router(x).combine for _ in range(3)]
    assert not torch.equal(draws[0], draws[1])
    # Combine weights are the (noisy) softmax probabilities of the chosen experts, never renormalized.
    assert bool((draws[0] < 1).all())


def seeded_noise(logits: torch.Tensor, std: float, seed: int) -> torch.Tensor:
    """The noise a router draws right after ``torch.manual_seed(seed)``: std * randn_like(logits)."""
    torch.manual_seed(seed)
    return std * torch.randn_like(logits)


@pytest.mark.parametrize("affinity", ["softmax", "sinkhorn"])
def test_expert_choice_noise_in_training(affinity):
    torch.manual_seed(0)
    router = ExpertChoiceRouter(6, 4, capacity_factor=1.0, affinity=affinity, noise_std=2.0).double()
    assert ExpertChoiceRouter(6, 4, affinity=affinity).noise_std == 1.0  # vmoe's default
    x = torch.randn(2, 12, 6, dtype=F64)
    logits = x @ router.gate.weight.T
    torch.manual_seed(7)
    routing = router(x)
    noisy = logits + seeded_noise(logits, 2.0 / 4, 7)  # std noise_std / E
    probs = noisy.softmax(-1)  # both the choice and the combine weights use the noisy logits
    choice = probs if affinity == "softmax" else sinkhorn_plan(noisy)
    expected = expert_choice_allocation(choice, 3, combine_from=probs)
    assert torch.equal(routing.token_index, expected.token_index)
    torch.testing.assert_close(routing.combine, expected.combine)
    router.eval()
    clean = logits.softmax(-1)
    expected = expert_choice_allocation(clean if affinity == "softmax" else sinkhorn_plan(logits), 3, clean)
    for _ in range(2):
        routing = router(x)
        assert torch.equal(routing.token_index, expected.token_index)
        torch.testing.assert_close(routing.combine, expected.combine)


def test_sparse_expert_choice_has_no_noise():
    assert ExpertChoiceRouter(6, 4, affinity="sparse").noise_std == 0.0
    assert ExpertChoiceRouter(6, 4, affinity="sparse", noise_std=0).noise_std == 0.0
    with pytest.raises(ValueError, match="adds no logit noise.*got 0.5"):
        ExpertChoiceRouter(6, 4, affinity="sparse", noise_std=0.5)
    with pytest.raises(ValueError, match="noise_std must be >= 0"):
        ExpertChoiceRouter(6, 4, noise_std=-1.0)
    torch.manual_seed(0)
    router = ExpertChoiceRouter(6, 4, affinity="sparse").train()
    x = torch.randn(2, 12, 6)
    assert torch.equal(router(x).token_index, router(x).token_index)


def test_sinkhorn_token_choice_noise_in_training():
    torch.manual_seed(0)
    router = TokenChoiceRouter(6, 4, k=2, affinity="sinkhorn", noise_std=3.0).double()
    x = torch.randn(2, 12, 6, dtype=F64)
    logits = x @ router.gate.weight.T
    torch.manual_seed(5)
    routing = router(x)
    # The plan is of the noisy logits (std noise_std / E); the combine weights are the CLEAN softmax.
    plan = sinkhorn_plan(logits + seeded_noise(logits, 3.0 / 4, 5))
    expected = token_choice_allocation(plan, 6, 2, combine_from=logits.softmax(-1))
    assert torch.equal(routing.token_index, expected.token_index)
    torch.testing.assert_close(routing.combine, expected.combine)
    assert routing.auxiliary_losses == {}
    router.eval()
    expected = token_choice_allocation(sinkhorn_plan(logits), 6, 2, combine_from=logits.softmax(-1))
    assert torch.equal(router(x).token_index, expected.token_index)


# ---------------------------------------------------------------- the MoE layer


def all_routers(dim=6, experts=4, c=1, tokens_per_image=5):
    return {name: make_router(name, dim, experts, c, tokens_per_image=tokens_per_image) for name in ROUTERS}


@pytest.mark.parametrize("c", [1, 2])
@pytest.mark.parametrize("name", list(ROUTERS))
def test_gather_scatter_equals_dense_reference(name, c):
    torch.manual_seed(0)
    layer = MoELayer(6, make_router(name, 6, 4, c, tokens_per_image=5), 8).double().train()
    x = torch.randn(4, 5, 6, dtype=F64)
    torch.manual_seed(1)
    out = layer(x)
    torch.manual_seed(1)  # the same noise draw for the reference
    [routing] = layer.route(x)
    groups = x.reshape(routing.groups, -1, 6)
    dispatch, combine = routing.to_dense()
    reference = dense_moe(groups, dispatch, combine, layer.experts).reshape_as(x)
    torch.testing.assert_close(out, reference)
    if isinstance(routing, SparseRouting):
        routing.validate()
        torch.testing.assert_close(sparse_moe(groups, routing, layer.experts).reshape_as(x), reference)


def test_dense_reference_is_equation_2():
    torch.manual_seed(0)
    layer = MoELayer(3, ExpertChoiceRouter(3, 2), 4).double()
    x = torch.randn(1, 4, 3, dtype=F64)
    dispatch, combine = torch.rand(1, 4, 2, 3, dtype=F64), torch.rand(1, 4, 2, 3, dtype=F64)
    expected = torch.zeros(4, 3, dtype=F64)
    for t in range(4):
        for r in range(2):
            for c in range(3):
                slot = (x[0] * dispatch[0, :, r, c, None]).sum(0)
                out = layer.experts(torch.zeros(2, 1, 3, dtype=F64).index_copy(0, torch.tensor([r]), slot.view(1, 1, 3)))
                expected[t] += combine[0, t, r, c] * out[r, 0]
    torch.testing.assert_close(dense_moe(x, dispatch, combine, layer.experts)[0], expected)


def test_dropped_tokens_get_zero_output():
    torch.manual_seed(0)
    router = TokenChoiceRouter(6, 4, k=1, capacity_factor=0.25)  # C = round(0.25 * 40 / 4) = 2 slots per expert
    layer = MoELayer(6, router, 8).eval()
    x = torch.randn(8, 5, 6)
    out = layer(x)
    [routing] = layer.route(x)
    assert routing.capacity == 2
    kept = routing.experts_per_token().view(8, 5)
    assert int((kept == 0).sum()) >= 40 - 8  # at most E * C = 8 tokens kept
    assert bool((out[kept == 0] == 0).all())
    assert bool((out[kept > 0].abs().sum(-1) > 0).all())
    stats = layer.last_stats  # detached float64 0-dim tensors: the forward never reads them back to the host
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 and v.dtype == F64 and not v.requires_grad
               for v in stats.values())
    assert float(stats["dropped"]) == int((kept == 0).sum()) / 40
    assert float(stats["fill"]) == int((kept > 0).sum()) / (4 * 2)  # every kept token fills one of the E * C slots


def test_groups_of_images():
    torch.manual_seed(0)
    router = ExpertChoiceRouter(6, 4, capacity_factor=1, noise_std=0.0)  # the same routing in both layers
    layer = MoELayer(6, router, 8, group_size=2).double()
    x = torch.randn(5, 3, 6, dtype=F64)  # groups: images (0, 1), (2, 3), and the remainder (4,)
    out = layer(x)
    parts = [x[0:2], x[2:4], x[4:5]]
    whole = MoELayer(6, router, 8).double()
    whole.experts.load_state_dict(layer.experts.state_dict())
    expected = torch.cat([whole(p) for p in parts])  # group_size None: each call is one group
    torch.testing.assert_close(out, expected)
    capacities = [r.capacity for r in layer.route(x)]
    assert capacities == [buffer_capacity(6, 4), buffer_capacity(3, 4)]


@pytest.mark.parametrize("name", list(ROUTERS))
def test_gradients_reach_the_gate(name):
    torch.manual_seed(0)
    layer = MoELayer(6, make_router(name, 6, 4, 2, tokens_per_image=5), 8).train()
    out = layer(torch.randn(4, 5, 6))
    (out.square().sum() + layer.auxiliary_loss).backward()
    params = [p for n, p in layer.router.named_parameters()]
    assert params and all(p.grad is not None and bool(p.grad.isfinite().all()) for p in params)
    assert any(float(p.grad.abs().sum()) > 0 for p in params)
    assert all(float(p.grad.abs().sum()) > 0 for p in layer.experts.parameters())


@pytest.mark.parametrize("normalize", [True, False])
def test_soft_moe_router_equals_the_layer(normalize):
    torch.manual_seed(0)
    soft = SoftMoE(6, 3, slots_per_expert=2, expert_hidden=5, normalize=normalize).double()
    with torch.no_grad():
        if soft.scale is not None:
            soft.scale.fill_(1.7)
    moe = MoELayer.from_soft_moe(soft)
    assert torch.equal(moe.router.phi, soft.phi) and torch.equal(moe.experts.weight2, soft.experts.weight2)
    x = torch.randn(4, 7, 6, dtype=F64)
    torch.testing.assert_close(moe(x), soft(x), rtol=1e-12, atol=1e-12)
    [routing] = moe.route(x)
    assert isinstance(routing, DenseRouting)
    reference = soft.route(x)
    torch.testing.assert_close(routing.dispatch, reference.dispatch)
    torch.testing.assert_close(routing.combine, reference.combine)
    # Per image: each image's output depends on that image only.
    torch.testing.assert_close(moe(x[1:2]), soft(x)[1:2])


def test_soft_moe_router_rejects_custom_experts():
    from torch import nn

    with pytest.raises(ValueError, match="default MLP experts"):
        MoELayer.from_soft_moe(SoftMoE(4, 2, expert=nn.Linear(4, 4)))


def test_sinkhorn_routers_combine_from_the_softmax():
    torch.manual_seed(0)
    x = torch.randn(1, 24, 6)
    for router in (TokenChoiceRouter(6, 4, k=2, affinity="sinkhorn"), ExpertChoiceRouter(6, 4, 2, affinity="sinkhorn"),
                   ExpertChoiceRouter(6, 4, 1, affinity="sparse")):
        routing = router.eval()(x)  # eval: no logit noise
        probs = router.gate(x).softmax(-1)
        filled = routing.token_index >= 0
        gathered = probs.transpose(1, 2).gather(-1, routing.token_index.clamp_min(0))
        torch.testing.assert_close(routing.combine[filled], gathered[filled])


def test_sparse_router_fills_every_slot():
    torch.manual_seed(0)
    router = ExpertChoiceRouter(6, 4, capacity_factor=1, affinity="sparse")
    routing = router(torch.randn(2, 32, 6))
    assert routing.capacity == 8
    routing.validate()
    assert bool(routing.filled().all())  # every expert processes exactly C tokens, as in vmoe


def test_make_router():
    routers = all_routers(c=2, tokens_per_image=16)
    assert routers["softmax_token_choice"].k == 2 and routers["softmax_token_choice"].capacity(64) == 32
    assert routers["sinkhorn_token_choice"].affinity == "sinkhorn"
    assert routers["softmax_expert_choice"].capacity(64) == 32
    assert routers["sparsity_constrained_expert_choice"].affinity == "sparse"
    assert routers["soft_moe"].slots_per_expert == 8 and routers["soft_moe"].per_image
    with pytest.raises(ValueError, match="unknown router"):
        make_router("hash", 6, 4)
    with pytest.raises(ValueError, match="tokens_per_image"):
        make_router("soft_moe", 6, 4)
    with pytest.raises(ValueError, match="integer c"):
        make_router("softmax_token_choice", 6, 4, 1.5)
    with pytest.raises(ValueError, match="affinity"):
        TokenChoiceRouter(6, 4, affinity="sparse")
    with pytest.raises(ValueError, match="k must"):
        TokenChoiceRouter(6, 4, k=5)
    with pytest.raises(ValueError, match="slots_per_expert"):
        SoftMoERouter(6, 4, 0)


# ---------------------------------------------------------------- Soft MoE router: noise and metrics


def soft_metrics_reference(dispatch, combine, mu):
    """vmoe's SoftRouter.get_metrics with loops: one (token or slot) pair at a time, plain Python floats."""
    dispatch, combine, mu = dispatch.detach(), combine.detach(), mu.detach()
    g_count, t_count, e_count, c_count = combine.shape
    slots = [(e, c) for e in range(e_count) for c in range(c_count)]

    def cosine(u, v):
        scale_u = 1 / math.sqrt(sum(a * a for a in u) + 1e-9)
        scale_v = 1 / math.sqrt(sum(b * b for b in v) + 1e-9)
        return sum(a * scale_u * b * scale_v for a, b in zip(u, v))

    def stats(prefix, vector_sets):
        # Off-diagonal min / max, the diagonal standing in as max(0, largest off-diagonal); mean over the
        # off-diagonal entries with every diagonal entry counted as 1.
        matrices = [[[cosine(u, v) for v in vectors] for u in vectors] for vectors in vector_sets]
        off = [m[i][j] for m in matrices for i in range(len(m)) for j in range(len(m)) if i != j]
        diagonal_value = max(max(off), 0.0)
        n, b = len(matrices[0]), len(matrices)
        total = sum(sum(row) for m in matrices for row in m)
        return {
            f"{prefix}_min": min(off + [diagonal_value]),
            f"{prefix}_max": diagonal_value,
            f"{prefix}_mean": (total - b * n) / (b * n * (n - 1)),
        }

    combine_rows = [[[float(combine[g, t, e, c]) for e, c in slots] for t in range(t_count)] for g in range(g_count)]
    dispatch_cols = [[[float(dispatch[g, t, e, c]) for t in range(t_count)] for e, c in slots] for g in range(g_count)]
    mu_cols = [[[float(mu[i, e, c]) for i in range(mu.shape[0])] for e, c in slots]]
    out = {
        "combine_weights_min_mean": sum(min(r) for rows in combine_rows for r in rows) / (g_count * t_count),
        "combine_weights_max_mean": sum(max(r) for rows in combine_rows for r in rows) / (g_count * t_count),
        "dispatch_weights_min_mean": sum(min(c) for cols in dispatch_cols for c in cols) / (g_count * len(slots)),
        "dispatch_weights_max_mean": sum(max(c) for cols in dispatch_cols for c in cols) / (g_count * len(slots)),
    }
    out.update(stats("combine_weights_similarity", combine_rows))
    out.update(stats("dispatch_weights_similarity", dispatch_cols))
    out.update(stats("mu_similarity", mu_cols))
    return out


def test_soft_moe_metrics_by_hand():
    # One group, 2 tokens, 1 expert with 2 slots. Combine rows (1, 0) and (0.6, 0.8): cosine 0.6. Dispatch columns
    # (0.5, 0.5) and (1, 0): cosine 1 / sqrt(2). Slot parameters (1, 0) and (-1, 0): cosine -1, and vmoe's masking
    # puts max(0, -1) = 0 on the diagonal, so mu_similarity_max is 0.
    combine = torch.tensor([[1.0, 0.0], [0.6, 0.8]], dtype=F64).view(1, 2, 1, 2)
    dispatch = torch.tensor([[0.5, 1.0], [0.5, 0.0]], dtype=F64).view(1, 2, 1, 2)
    mu = torch.tensor([[1.0, -1.0], [0.0, 0.0]], dtype=F64).view(2, 1, 2)
    golden = {
        "combine_weights_min_mean": 0.3, "combine_weights_max_mean": 0.9,
        "dispatch_weights_min_mean": 0.25, "dispatch_weights_max_mean": 0.75,
        "combine_weights_similarity_min": 0.6, "combine_weights_similarity_max": 0.6,
        "combine_weights_similarity_mean": 0.6,
        "dispatch_weights_similarity_min": 0.5**0.5, "dispatch_weights_similarity_max": 0.5**0.5,
        "dispatch_weights_similarity_mean": 0.5**0.5,
        "mu_similarity_min": -1.0, "mu_similarity_max": 0.0, "mu_similarity_mean": -1.0,
    }
    metrics = soft_moe_metrics(dispatch, combine, mu)
    assert set(metrics) == set(golden)
    for name, value in golden.items():
        assert metrics[name].dim() == 0
        assert float(metrics[name]) == pytest.approx(value, rel=1e-8, abs=1e-8), name
    reference = soft_metrics_reference(dispatch, combine, mu)
    for name, value in reference.items():
        assert float(metrics[name]) == pytest.approx(value, rel=1e-12, abs=1e-12), name


def test_soft_moe_router_metrics():
    torch.manual_seed(0)
    router = SoftMoERouter(4, 2, 3, metrics=True).double()
    x = torch.randn(2, 5, 4, dtype=F64)
    routing = router(x)
    assert routing.metrics and all(v.dim() == 0 and not v.requires_grad for v in routing.metrics.values())
    reference = soft_metrics_reference(routing.dispatch, routing.combine, l2_normalize(router.phi, dim=0))
    assert set(routing.metrics) == set(reference)
    for name, value in reference.items():
        assert float(routing.metrics[name]) == pytest.approx(value, rel=1e-10, abs=1e-12), name
    layer = MoELayer(4, router, 6).double()
    layer(x)
    assert set(layer.last_metrics) == set(reference)
    torch.testing.assert_close(layer.last_metrics["mu_similarity_mean"], routing.metrics["mu_similarity_mean"])
    assert SoftMoERouter(4, 2, 3)(x).metrics == {}
    sparse = MoELayer(4, ExpertChoiceRouter(4, 2))
    sparse(x.float())
    assert sparse.last_metrics == {}


def test_soft_moe_router_noise_is_not_divided_by_e():
    torch.manual_seed(0)
    router = SoftMoERouter(4, 2, 3, noise_std=0.7).double()
    x = torch.randn(2, 5, 4, dtype=F64)
    z = router.logits(x)
    torch.manual_seed(11)
    routing = router(x)
    noisy = (z + seeded_noise(z, 0.7, 11)).view(2, 5, 2, 3)  # noise_std * N(0, 1), as vmoe's SoftRouter.add_noise
    torch.testing.assert_close(routing.dispatch, noisy.softmax(dim=1))
    torch.testing.assert_close(routing.combine, noisy.flatten(2).softmax(dim=-1).view(2, 5, 2, 3))
    router.eval()
    torch.testing.assert_close(router(x).combine, z.softmax(dim=-1).view(2, 5, 2, 3))
    quiet = SoftMoERouter(4, 2, 3).double().train()  # default noise_std 0
    assert torch.equal(quiet(x).dispatch, quiet(x).dispatch)
    with pytest.raises(ValueError, match="noise_std must be >= 0"):
        SoftMoERouter(4, 2, 3, noise_std=-0.1)


def test_soft_moe_router_refuses_the_inputs_normalization():
    with pytest.raises(ValueError, match='"router" or "none", got "inputs"'):
        SoftMoERouter(4, 2, normalize="inputs")


# ---------------------------------------------------------------- experts with another output size


@pytest.mark.parametrize("name", list(ROUTERS))
def test_moe_layer_out_dim(name):
    torch.manual_seed(0)
    layer = MoELayer(6, make_router(name, 6, 4, 2, tokens_per_image=5), 8, out_dim=3).double().eval()
    assert layer.experts.weight2.shape == (4, 8, 3)
    x = torch.randn(4, 5, 6, dtype=F64)
    out = layer(x)
    assert out.shape == (4, 5, 3)
    [routing] = layer.route(x)
    dispatch, combine = routing.to_dense()
    expected = torch.zeros(routing.groups, dispatch.shape[1], 3, dtype=F64)
    groups = x.reshape(routing.groups, -1, 6)
    for g in range(routing.groups):  # equation (2), one (expert, slot) buffer at a time
        for r in range(4):
            for c in range(dispatch.shape[-1]):
                buffer = torch.zeros(4, 1, 6, dtype=F64)
                buffer[r, 0] = (groups[g] * dispatch[g, :, r, c, None]).sum(0)
                expected[g] += combine[g, :, r, c, None] * layer.experts(buffer)[r, 0]
    torch.testing.assert_close(out, expected.reshape(4, 5, 3))
    if isinstance(routing, SparseRouting):
        torch.testing.assert_close(sparse_moe(groups, routing, layer.experts).reshape(4, 5, 3), out)


def test_moe_layer_out_dim_from_soft_moe_and_mismatch():
    from softmoe.experts import MLPExperts

    torch.manual_seed(0)
    soft = SoftMoE(6, 3, slots_per_expert=2, expert_hidden=5, out_dim=4).double()
    moe = MoELayer.from_soft_moe(soft)
    x = torch.randn(2, 7, 6, dtype=F64)
    assert moe.out_dim == 4
    torch.testing.assert_close(moe(x), soft(x), rtol=1e-12, atol=1e-12)
    wrong = MoELayer(6, ExpertChoiceRouter(6, 4), experts=MLPExperts(4, 6, 8, out_dim=5), out_dim=3)
    with pytest.raises(ValueError, match="return 5 features per token, expected out_dim = 3"):
        wrong(torch.randn(2, 5, 6))
