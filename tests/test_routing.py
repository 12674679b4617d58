"""The router study's formulation and six routers (softmoe.routing) against hand-worked examples and slow references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from softmoe import SoftMoE
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
    sparse_moe,
    sparse_plan,
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
    assert buffer_capacity(10, 1, 1.1, rounding="ceil") == 11  # not 12 from 1.1 * 10 = 11.000000000000002
    assert buffer_capacity(196, 32, 1, rounding="ceil", multiple_of=4) == 8  # vmoe's default for sparse MoEs
    assert buffer_capacity(3, 32, 1) == 1  # at least 1
    assert buffer_capacity(16, 2, 4, maximum=16) == 16


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=0, num_experts=2), "num_tokens"),
        (dict(num_tokens=4, num_experts=2, capacity_factor=0), "capacity_factor"),
        (dict(num_tokens=4, num_experts=2, rounding="floor"), "rounding"),
        (dict(num_tokens=4, num_experts=2, k=0), "k must"),
    ],
)
def test_capacity_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        buffer_capacity(**kwargs)


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


@pytest.mark.parametrize("capacity", [8, 16])
def test_sparse_plan_has_at_most_c_nonzeros_per_column(capacity):
    utility = (torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(3)) * 2).softmax(-1)
    plan = sparse_plan(utility, capacity)
    assert bool((plan >= 0).all())
    assert int((plan > 0).sum(dim=1).max()) <= capacity
    torch.testing.assert_close(plan.sum(dim=1), torch.full((2, 8), 8.0))  # expert marginals T/E exactly
    # The semi-dual iterations balance tokens much better than plain expert choice (alpha = 0).
    start = sparse_plan(utility, capacity, iterations=0)
    error, start_error = (plan.sum(-1) - 1).abs().mean(), (start.sum(-1) - 1).abs().mean()
    assert error < 0.5 * start_error


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
    assert float(routing.auxiliary_losses["importance"]) == pytest.approx(float(importance_loss(logits.softmax(-1))))
    # In eval mode there is no noise: the load loss uses the clean logits as the noisy ones, std 1/E.
    assert float(routing.auxiliary_losses["load"]) == pytest.approx(float(load_loss(logits, logits, 2, 0.25)))
    layer = MoELayer(6, router, 8).double()
    layer(x.view(4, 5, 6))  # groups: the whole batch (4 images of 5 tokens) = one group of 20 tokens
    expected = 0.1 * layer.auxiliary_losses["importance"] + 0.2 * layer.auxiliary_losses["load"]
    torch.testing.assert_close(layer.auxiliary_loss, expected)
    # Routers without auxiliary losses report 0.
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
    assert layer.last_stats["dropped"] == pytest.approx(float((kept == 0).float().mean()))


def test_groups_of_images():
    torch.manual_seed(0)
    router = ExpertChoiceRouter(6, 4, capacity_factor=1)
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
        routing = router(x)
        probs = router.gate(x).softmax(-1)
        filled = routing.token_index >= 0
        gathered = probs.transpose(1, 2).gather(-1, routing.token_index.clamp_min(0))
        torch.testing.assert_close(routing.combine[filled], gathered[filled])


def test_sparse_router_respects_capacity():
    torch.manual_seed(0)
    router = ExpertChoiceRouter(6, 4, capacity_factor=1, affinity="sparse")
    routing = router(torch.randn(2, 32, 6))
    assert routing.capacity == 8
    routing.validate()
    assert int(routing.filled().sum(-1).max()) <= 8


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
