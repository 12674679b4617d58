"""Expert selection (softmoe.selection, SoftMoE.forward_selected): Algorithm 1 of "Beyond Parameter Count".

The fast path (only the selected experts run) must equal the paper's masked dense computation (all experts run,
unselected expert rows zeroed), for every strategy, k, p, renormalization and padding; unselected experts must not
run at all; the selection rules must be exactly Algorithm 1 (ties to the lower expert index), a uniform random
draw, or an explicit mask; select_experts must install and restore per-layer selectors; bad arguments must raise.
"""

from __future__ import annotations

import re
import unittest.mock
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from reference import GROUPED_PRODUCTS, kernels_called
from softmoe import SoftMoE, masked_reference_forward, select_experts
from softmoe.backends import Backend
from softmoe.experts import MLPExperts
from softmoe.kernels import native_available
from softmoe.selection import (
    NoBetterThanRandomWarning,
    Selector,
    combine_scores,
    experts_by_budget,
    experts_by_mass,
    mask_from_subsets,
    measure_share_uniformity,
    random_subsets,
    resolve_k,
    share_uniformity,
    soft_moe_layers,
    subsets_from_mask,
    top_k_by_combine,
)
from softmoe.topk import top_k
from softmoe.tuning import TABLE, Measured, value

DIM, HIDDEN, N, BATCH, TOKENS = 6, 12, 8, 3, 5
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


# ----------------------------------------------------------------------------------------------------- helpers


def make_layer(p=1, dtype=torch.float32, custom=False, n=N, seed=0):
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, DIM)) if custom else None
    layer = SoftMoE(DIM, n, slots_per_expert=p, expert_hidden=HIDDEN, expert=expert, dtype=dtype)
    with torch.no_grad():  # phi is tiny at init; make the routing far from uniform so selections are meaningful
        layer.scale.fill_(4.0)
    return layer


def make_input(dtype=torch.float32, batch=BATCH, tokens=TOKENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, tokens, DIM, generator=g, dtype=dtype)


def padding_mask(batch=BATCH, tokens=TOKENS):
    """Row 0: all real; row 1: two padded tokens (at both ends); row 2 (if any): fully padded."""
    mask = torch.ones(batch, tokens, dtype=torch.bool)
    if batch > 1:
        mask[1, 0] = False
        mask[1, -1] = False
    if batch > 2:
        mask[2] = False
    return mask


def random_mask(batch, n, k, seed=3):
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch, n, generator=g)
    return mask_from_subsets(keys.argsort(dim=1)[:, :k], n)


def naive_top_k(layer, x, mask, k):
    """Algorithm 1 written out per input with Python sorting: C_sum over tokens and slots, k largest, ties low."""
    combine = layer.route(x, mask).combine
    out = []
    for b in range(x.shape[0]):
        scores = combine[b].sum(dim=(0, 2)).tolist()
        order = sorted(range(layer.num_experts), key=lambda j: (-scores[j], j))
        out.append(sorted(order[:k]))
    return torch.tensor(out, dtype=torch.int64)


def selected_for(strategy, layer, x, mask, k, seed=5):
    n = layer.num_experts
    if strategy == "combine":
        return top_k_by_combine(layer.route(x, mask).combine, k)
    if strategy == "random":
        return random_subsets(x.shape[0], n, k, torch.Generator().manual_seed(seed))
    return subsets_from_mask(random_mask(x.shape[0], n, k, seed), n)


def strategy_arg(strategy, batch, n, k, seed=5):
    return random_mask(batch, n, k, seed) if strategy == "mask" else strategy


@pytest.fixture(autouse=True)
def _restore_mix_selected():
    """capture_selections wraps the backends' shared mix_selected: put it back after each test."""
    original = Backend.mix_selected
    yield
    Backend.mix_selected = original


def capture_selections(layers):
    """Record the experts each layer's forward selects (per layer, per call), whether its selector's ``select``
    chose them or the backend's own kernel did (Algorithm 1 on a float32 CPU layer: softmoe::top_k_combine).

    A wrapper of Backend.mix_selected, which every backend's Algorithm 1 goes through: the experts a backend chooses
    itself are the values of its ops' outputs (softmoe::soft_moe_routing_top_k, softmoe::top_k_combine), which no
    public observation shows (the profiler records shapes and scalar arguments, and wrapping ``layer.selector`` sees
    only the choices the selector makes)."""
    records = {id(layer): [] for layer in layers}
    original = Backend.mix_selected

    def mix_selected(self, layer, x, dispatch, combine, selected, *args, **kwargs):
        if id(layer) in records:
            records[id(layer)].append(selected.clone())
        return original(self, layer, x, dispatch, combine, selected, *args, **kwargs)

    Backend.mix_selected = mix_selected
    return records


def ops_run(fn):
    """``fn()``'s result and the operators it ran, in order, each with its input shapes (torch's profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    return result, [(event.name, event.input_shapes) for event in prof.events()]


class ExpertWork(NamedTuple):
    """What torch's profiler saw of a forward's expert work (:func:`expert_work`)."""

    grouped: list[tuple[tuple, int, list[tuple[int, int]]]]  # each grouped product: (weight shape, rows, blocks)
    slots: list[tuple[int, int, int]]  # the slot tensors built, D^T X
    whole: list[str]  # the ops that took an MLP bank's stacked weight whole, outside the grouped products


def in_grouped_product(event) -> bool:
    """Whether a profiler event ran inside a grouped product (GROUPED_PRODUCTS)."""
    while event.cpu_parent is not None:
        event = event.cpu_parent
        if event.name in GROUPED_PRODUCTS:
            return True
    return False


def expert_blocks(grouped) -> list[tuple[int, int]]:
    """(expert, rows) of each block of rows a grouped product (GROUPED_PRODUCTS' event) ran, in order: the
    entry of the weight it read (weight[j]) and the rows it took (x[start:stop]) before it."""
    x_shape, weight_shape = grouped.input_shapes[0], grouped.input_shapes[1]
    blocks, rows = [], None
    for event in sorted(grouped.cpu_children, key=lambda event: event.time_range.start):
        if event.name == "aten::slice" and event.input_shapes[0] == x_shape and event.concrete_inputs[1] == 0:
            start, stop = event.concrete_inputs[2:4]
            rows = stop - start
        elif event.name == "aten::select" and event.input_shapes[0] == weight_shape and event.concrete_inputs[1] == 0:
            blocks.append((event.concrete_inputs[2], rows))
    return blocks


def expert_work(layers, tokens, fn):
    """``fn()``'s result and the expert work it ran, seen by torch's profiler (record_shapes), for ``layers`` whose
    inputs have the shape ``tokens`` (batch, tokens, dim):

    - ``grouped``: each grouped product (GROUPED_PRODUCTS: the selected plan runs an MLP bank's two layers as
      two of them), as its weight's shape, its rows and its blocks (:func:`expert_blocks`);
    - ``slots``: the shape of each slot tensor built, D^T X (a torch.bmm by the tokens);
    - ``whole``: the ops outside the grouped products that took the stacked weights of the layers' MLP experts
      (every expert run: the plain forward's batched products, the token-space rewrite, the native kernels).
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    stacked = [list(weight.shape) for layer in layers if isinstance(layer.experts, MLPExperts)
               for weight in (layer.experts.weight1, layer.experts.weight2)]
    work = ExpertWork([], [], [])
    for event in prof.events():
        shapes = event.input_shapes
        if event.name in GROUPED_PRODUCTS:
            work.grouped.append((tuple(shapes[1]), shapes[0][0], expert_blocks(event)))
        elif in_grouped_product(event):
            continue
        elif event.name == "aten::bmm" and shapes[1] == list(tokens):
            work.slots.append((shapes[0][0], shapes[0][1], shapes[1][2]))
        elif any(shape in stacked for shape in shapes):
            work.whole.append(event.name)
    return result, work


def expert_flops(layer, fn):
    """``fn()``'s result and, counted by torch's FLOP counter by module, the FLOPs of ``layer``'s custom experts
    (the template every copy runs, under vmap: each group of rows through the module) and those of any module but
    the layer and the template (the bank's forward, every expert on its slots; 0 where it did not run)."""
    with FlopCounterMode(display=False) as counter:
        result = fn()
    flops = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    template = type(layer.experts.template).__name__  # its submodules counted as "template.name"
    elsewhere = sum(count for name, count in flops.items()
                    if name not in ("Global", type(layer).__name__) and name.split(".")[0] != template)
    return result, flops.get(template, 0), elsewhere


def template_flops_per_group(layer) -> int:
    """The FLOPs of one group of p slot rows through make_layer's custom expert (its two Linear layers)."""
    return 2 * 2 * layer.slots_per_expert * DIM * HIDDEN


def independent_reference(layer, x, selected, mask=None, renormalize=False):
    """The masked Soft MoE of Algorithm 1 computed per input with explicit per-expert MLPs (MLPExperts only)."""
    routing = layer.route(x, mask)
    ex = layer.experts
    outputs = []
    for b in range(x.shape[0]):
        d_b = routing.dispatch[b].to(x.dtype)  # (m, n, p)
        c_b = routing.combine[b].to(x.dtype)
        keep = torch.zeros(layer.num_experts, dtype=torch.bool)
        keep[selected[b]] = True
        c_kept = c_b * keep[None, :, None]
        if renormalize:
            total = c_kept.sum(dim=(1, 2), keepdim=True)
            c_kept = torch.where(total > 0, c_kept / torch.where(total > 0, total, 1), 0)
        out = torch.zeros_like(x[b])
        for j in selected[b].tolist():
            slots = d_b[:, j, :].T @ x[b]  # (p, d)
            y = F.gelu(slots @ ex.weight1[j] + ex.bias1[j]) @ ex.weight2[j] + ex.bias2[j]
            out = out + c_kept[:, j, :] @ y
        outputs.append(out)
    return torch.stack(outputs)


# ------------------------------------------------------------- 1. fast path equals the masked dense reference


def k_values(n=N):
    return [1, n // 4, n // 2, n]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("k", k_values())
@pytest.mark.parametrize("strategy", ["combine", "random", "mask"])
def test_fast_path_equals_masked_reference(strategy, k, p, renormalize, padded, dtype):
    layer = make_layer(p, dtype)
    x = make_input(dtype)
    mask = padding_mask() if padded else None
    tol = TOL[dtype]
    with torch.no_grad():
        # forward_selected with the strategy's subsets
        selected = selected_for(strategy, layer, x, mask, k)
        assert selected.shape == (BATCH, k)
        fast = layer.forward_selected(x, selected, mask, renormalize=renormalize)
        ref = masked_reference_forward(layer, x, selected, mask, renormalize=renormalize)
        assert fast.dtype == dtype and fast.shape == x.shape
        torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
        if padded:  # padded tokens and the fully padded input give exactly zero
            assert torch.all(fast[~mask] == 0)

        # the select_experts context manager on a model
        model = nn.Sequential(layer)
        arg = strategy_arg(strategy, BATCH, N, k)
        with select_experts(model, k=k, strategy=arg, renormalize=renormalize, seed=11) as layers:
            assert layers == [layer]
            records = capture_selections(layers)
            out = layer(x, mask)
        (chosen,) = records[id(layer)]
        assert chosen.shape == (BATCH, k) and chosen.dtype == torch.int64
        if strategy == "combine":
            assert torch.equal(chosen, naive_top_k(layer, x, mask, k))
        elif strategy == "mask":
            assert torch.equal(mask_from_subsets(chosen, N), arg)
        ref_ctx = masked_reference_forward(layer, x, chosen, mask, renormalize=renormalize)
        torch.testing.assert_close(out, ref_ctx, atol=tol, rtol=tol)
        assert layer.selector is None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("k", [1, N // 2, N])
@pytest.mark.parametrize("strategy", ["combine", "random", "mask"])
def test_fast_path_equals_masked_reference_custom_expert(strategy, k, p, renormalize, padded, dtype):
    layer = make_layer(p, dtype, custom=True)
    assert type(layer.experts).__name__ == "StackedExperts"
    x = make_input(dtype)
    mask = padding_mask() if padded else None
    tol = TOL[dtype]
    with torch.no_grad():
        selected = selected_for(strategy, layer, x, mask, k)
        fast = layer.forward_selected(x, selected, mask, renormalize=renormalize)
        ref = masked_reference_forward(layer, x, selected, mask, renormalize=renormalize)
        torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
        with select_experts(nn.Sequential(layer), k=k, strategy=strategy_arg(strategy, BATCH, N, k),
                            renormalize=renormalize) as layers:
            records = capture_selections(layers)
            out = layer(x, mask)
        ref_ctx = masked_reference_forward(layer, x, records[id(layer)][0], mask, renormalize=renormalize)
        torch.testing.assert_close(out, ref_ctx, atol=tol, rtol=tol)


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("p", [1, 2])
def test_masked_reference_matches_independent_per_input_computation(p, renormalize):
    """Guards the reference itself: an explicit per-input, per-expert loop of Algorithm 1's step 4."""
    layer = make_layer(p, torch.float64)
    x = make_input(torch.float64)
    mask = padding_mask()
    selected = torch.tensor([[1, 6, 3], [0, 7, 2], [4, 5, 6]])  # unsorted rows are allowed
    with torch.no_grad():
        expected = independent_reference(layer, x, selected, mask, renormalize)
        torch.testing.assert_close(masked_reference_forward(layer, x, selected, mask, renormalize), expected,
                                   atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(layer.forward_selected(x, selected, mask, renormalize), expected,
                                   atol=1e-12, rtol=1e-12)


def test_forward_selected_does_not_depend_on_row_order():
    layer = make_layer(2, torch.float64)
    x = make_input(torch.float64)
    selected = torch.tensor([[5, 0, 3], [2, 7, 1], [6, 4, 0]])
    with torch.no_grad():
        a = layer.forward_selected(x, selected)
        b = layer.forward_selected(x, selected.sort(dim=1).values)
        c = layer.forward_selected(x, selected.flip(1))
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(a, c, atol=1e-12, rtol=1e-12)


def test_renormalized_combine_weights_of_kept_slots_sum_to_one():
    """With renormalize a constant expert output c gives c exactly for every real token (weights sum to 1)."""
    layer = make_layer(2, torch.float64)
    with torch.no_grad():
        layer.experts.weight2.zero_()
        const = torch.arange(N * DIM, dtype=torch.float64).view(N, DIM) / 10
        layer.experts.bias2.copy_(const[0].expand(N, DIM))  # every expert outputs const[0]
        x = make_input(torch.float64)
        mask = padding_mask()
        selected = torch.tensor([[0, 3], [2, 5], [1, 7]])
        out = layer.forward_selected(x, selected, mask, renormalize=True)
        raw = layer.forward_selected(x, selected, mask, renormalize=False)
    torch.testing.assert_close(out[mask], const[0].expand(int(mask.sum()), DIM))
    assert torch.all(out[~mask] == 0)
    # Without renormalization the kept weights sum to less than one (the paper's semantics).
    assert torch.all(raw[mask][:, 1:].abs() < const[0][1:].abs())


# --------------------------------------------------------------------------------- 2. k = n and "all" = plain


@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("custom", [False, True], ids=["mlp", "custom"])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_k_equal_n_equals_plain_forward(strategy, p, custom, renormalize, padded):
    layer = make_layer(p, custom=custom)
    x = make_input()
    mask = padding_mask() if padded else None
    with torch.no_grad():
        plain = layer(x, mask)
        with select_experts(layer, k=N, strategy=strategy, renormalize=renormalize):
            selected_out = layer(x, mask)
        with select_experts(layer, k=1.0, strategy=strategy, renormalize=renormalize):  # fraction 1.0 = all n
            fraction_out = layer(x, mask)
        everything = torch.arange(N).expand(BATCH, N)
        direct = layer.forward_selected(x, everything, mask, renormalize=renormalize)
    for out in (selected_out, fraction_out, direct):
        torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_k_equal_n_equals_plain_forward_when_plain_uses_token_space(strategy):
    """Few tokens and many slots: the plain forward takes MLPExperts' token-space rewrite; selection must agree."""
    layer = make_layer(p=4)
    x = make_input(tokens=1)
    choice = layer.backend_for(x)
    assert (choice.backend.mixing(layer, x)) == "tokens"
    with torch.no_grad():
        plain = layer(x)
        with select_experts(layer, k=N, strategy=strategy):
            out = layer(x)
    torch.testing.assert_close(out, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("custom", [False, True], ids=["mlp", "custom"])
def test_strategy_all_is_the_plain_forward(custom):
    """The same output and the same operators, in order and with the same shapes, as the plain forward: strategy
    "all" does not take the selection path."""
    layer = make_layer(2, custom=custom)
    x = make_input()
    mask = padding_mask()
    with torch.no_grad():
        plain, plain_ops = ops_run(lambda: layer(x, mask))
        with select_experts(nn.Sequential(layer), strategy="all") as layers:
            assert layers == [layer] and layer.selector is None
            out, ops = ops_run(lambda: layer(x, mask))
        with select_experts(layer, k=3, strategy="all"):  # k is ignored for "all"
            assert layer.selector is None
            out_k, ops_k = ops_run(lambda: layer(x, mask))
    assert torch.equal(out, plain)
    assert torch.equal(out_k, plain)
    assert ops == ops_k == plain_ops


# ------------------------------------------------------------------------------------- 3. batch independence


@pytest.mark.parametrize("custom", [False, True], ids=["mlp", "custom"])
@pytest.mark.parametrize("strategy", ["combine", "mask"])
def test_batch_independence_under_selection(strategy, custom):
    dtype = torch.float64
    layer = make_layer(2, dtype, custom=custom)
    batch, k = 4, 3
    x = make_input(dtype, batch=batch)
    mask = torch.ones(batch, TOKENS, dtype=torch.bool)
    mask[2, 3:] = False
    other = make_input(dtype, batch=batch, seed=99)
    x2 = x.clone()
    x2[1:] = other[1:] * 3.0
    mask2 = mask.clone()
    mask2[1:, 1] = False
    fixed = random_mask(batch, N, k, seed=7)
    arg = fixed if strategy == "mask" else strategy
    with torch.no_grad():
        with select_experts(layer, k=k, strategy=arg):
            out1 = layer(x, mask)
            out2 = layer(x2, mask2)
        arg_alone = fixed[:1] if strategy == "mask" else strategy
        with select_experts(layer, k=k, strategy=arg_alone):
            alone = layer(x[:1], mask[:1])
    torch.testing.assert_close(out1[0], out2[0], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out1[:1], alone, atol=1e-12, rtol=1e-12)
    assert not torch.allclose(out1[1:], out2[1:])  # the other examples did change


# ------------------------------------------------------------------------ 4. unselected experts do not run


def expected_counts(selected, n, p):
    return torch.bincount(selected.reshape(-1), minlength=n) * p


def blocks_of(counts) -> list[tuple[int, int]]:
    """The blocks (expert, rows) of a grouped product that runs ``counts`` rows per expert: the experts with rows,
    in order."""
    return [(j, rows) for j, rows in enumerate(counts.tolist()) if rows > 0]


@pytest.mark.parametrize("entry", ["forward_selected", "select_experts"])
@pytest.mark.parametrize("p", [1, 2])
def test_unselected_experts_do_not_run_mlp(p, entry):
    """One run of the selected experts on the batch * k * p slot rows built for them (no others): both layers of
    the MLP as grouped products, each reading only the kept experts' weights, each on its own rows; no expert runs
    anywhere else (the plain forward's products, the token-space rewrite)."""
    layer = make_layer(p)
    x = make_input(batch=4)
    # experts 3 and 6 are chosen by nobody; expert 0 by every input
    selected = torch.tensor([[0, 1], [0, 2], [0, 5], [0, 7]])
    keep = mask_from_subsets(selected, N)

    def run():
        if entry == "forward_selected":
            return layer.forward_selected(x, selected, plan="selected")
        with select_experts(layer, strategy=keep, plan="selected"):
            return layer(x)

    with torch.no_grad():
        out, work = expert_work([layer], x.shape, run)
        torch.testing.assert_close(out, masked_reference_forward(layer, x, selected), atol=1e-5, rtol=1e-5)
    counts = expected_counts(selected, N, p)
    assert counts.tolist() == [4 * p, p, p, 0, 0, p, 0, p]
    experts = layer.experts
    assert work.grouped == [(tuple(experts.weight1.shape), 4 * 2 * p, blocks_of(counts)),
                            (tuple(experts.weight2.shape), 4 * 2 * p, blocks_of(counts))]
    assert work.slots == [(4, 2 * p, DIM)]  # batch * k * p slot rows built, no more
    assert work.whole == []


@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_unselected_experts_do_not_run_custom_expert(strategy):
    """Custom experts gather the parameters of the selected experts only: the module runs on the batch * k groups
    of p slot rows built for them (torch's FLOP counter), the bank's forward (every expert) never, and NaN in every
    unselected expert's parameters cannot reach the output, which stays what it was before the poisoning (the
    paper's masked forward)."""
    p, k, batch = 2, 2, 3
    layer = make_layer(p, custom=True)
    x = make_input(batch=batch)
    with torch.no_grad(), select_experts(layer, k=k, strategy=strategy, seed=4, plan="selected") as layers:
        records = capture_selections(layers)
        before, flops, elsewhere = expert_flops(layer, lambda: layer(x))
    (selected,) = records[id(layer)]
    assert flops == batch * k * template_flops_per_group(layer) and elsewhere == 0
    torch.testing.assert_close(before, masked_reference_forward(layer, x, selected), atol=1e-5, rtol=1e-5)
    unused = [j for j in range(N) if j not in selected.unique().tolist()]
    assert unused
    with torch.no_grad():
        for _, value in layer.experts.named_parameters():
            value[unused] = float("nan")
        with select_experts(layer, k=k, strategy=strategy, seed=4, plan="selected") as layers:
            records = capture_selections(layers)
            after, work = expert_work([layer], x.shape, lambda: layer(x))
    assert torch.equal(records[id(layer)][0], selected)
    assert work.slots == [(batch, k * p, DIM)]
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_unselected_experts_do_not_run_multi_layer_model():
    model = TwoLayerModel()
    x = make_input(batch=4)
    with torch.no_grad(), select_experts(model, k=0.25, plan="selected") as layers:
        records = capture_selections(layers)
        _, work = expert_work(layers, x.shape, lambda: model(x))
    grouped, built = [], []  # layer by layer: both layers of its MLP, the slot tensor built
    for layer in (model.moe_a, model.moe_b):
        (selected,) = records[id(layer)]
        k = layer.num_experts // 4
        assert selected.shape == (4, k)
        blocks = blocks_of(expected_counts(selected, layer.num_experts, layer.slots_per_expert))
        rows = 4 * k * layer.slots_per_expert
        grouped += [(tuple(weight.shape), rows, blocks) for weight in (layer.experts.weight1, layer.experts.weight2)]
        built.append((4, k * layer.slots_per_expert, DIM))
    assert work.grouped == grouped
    assert work.slots == built
    assert work.whole == []


# ------------------------------------------------------------------------- 5. hand-worked Algorithm 1 example


def test_algorithm1_by_hand_p1():
    combine = torch.tensor(
        [
            [  # input 0: C_sum = [0.875, 1.0, 0.625, 0.5]
                [0.5, 0.25, 0.125, 0.125],
                [0.25, 0.25, 0.25, 0.25],
                [0.125, 0.5, 0.25, 0.125],
            ],
            [  # input 1: C_sum = [0.5, 1.0, 0.5, 1.0]: ties 1 vs 3 and 0 vs 2
                [0.25, 0.25, 0.25, 0.25],
                [0.0, 0.5, 0.0, 0.5],
                [0.25, 0.25, 0.25, 0.25],
            ],
        ]
    ).unsqueeze(-1)  # (batch 2, tokens 3, n 4, p 1)
    assert torch.equal(combine_scores(combine), torch.tensor([[0.875, 1.0, 0.625, 0.5], [0.5, 1.0, 0.5, 1.0]]))
    expected = {
        1: [[1], [1]],
        2: [[0, 1], [1, 3]],
        3: [[0, 1, 2], [0, 1, 3]],
        4: [[0, 1, 2, 3], [0, 1, 2, 3]],
    }
    for k, rows in expected.items():
        got = top_k_by_combine(combine, k)
        assert got.dtype == torch.int64
        assert got.tolist() == rows, k
        assert Selector("combine", k).select(combine).tolist() == rows


def test_algorithm1_by_hand_p2():
    # Units of 1/16; each token's 8 slot weights sum to 16. Layout per token: (e0s0, e0s1, e1s0, e1s1, ..., e3s1).
    units = torch.tensor(
        [
            [  # input 0: expert 0 owns the largest single slot, but expert 1 has the largest sum over its slots
                [6, 0, 5, 5, 0, 0, 0, 0],
                [4, 0, 2, 2, 2, 2, 2, 2],
                [4, 0, 2, 2, 4, 0, 2, 2],
            ],
            [  # input 1: uniform, every expert ties
                [2, 2, 2, 2, 2, 2, 2, 2],
                [2, 2, 2, 2, 2, 2, 2, 2],
                [2, 2, 2, 2, 2, 2, 2, 2],
            ],
        ],
        dtype=torch.float32,
    )
    combine = (units / 16).view(2, 3, 4, 2)
    assert torch.equal(combine.sum(dim=(2, 3)), torch.ones(2, 3))
    scores = combine_scores(combine)
    assert torch.equal(scores, torch.tensor([[0.875, 1.125, 0.5, 0.5], [0.75, 0.75, 0.75, 0.75]]))
    assert top_k_by_combine(combine, 1).tolist() == [[1], [0]]
    assert top_k_by_combine(combine, 2).tolist() == [[0, 1], [0, 1]]
    assert top_k_by_combine(combine, 3).tolist() == [[0, 1, 2], [0, 1, 2]]  # 2 beats 3 on the tie
    assert top_k_by_combine(combine, 4).tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    # Per slot (not per expert), the single best slot would be expert 0's: Algorithm 1 must sum the slots.
    assert combine.sum(dim=1).flatten(1).argmax(dim=1)[0] // 2 == 0


def test_algorithm1_tie_break_is_not_by_position_in_a_descending_topk():
    """Many exact ties, in shuffled positions: always the lowest indices among the tied."""
    n = 16
    scores = torch.zeros(1, 1, n, 1)
    scores[0, 0, [3, 9, 12, 14]] = 0.25  # four tied winners, then twelve tied zeros
    for k in range(1, n + 1):
        zeros = [j for j in range(n) if j not in (3, 9, 12, 14)]
        want = sorted(([3, 9, 12, 14] + zeros)[:k])
        assert top_k_by_combine(scores, k).tolist() == [want]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda p: st.tuples(
            st.just(p),
            st.integers(1, 10).flatmap(
                lambda n: st.tuples(
                    st.just(n),
                    st.integers(1, n),
                    st.lists(st.integers(0, 3), min_size=2 * 3 * n * p, max_size=2 * 3 * n * p),
                )
            ),
        )
    )
)
def test_algorithm1_matches_a_python_sort_with_many_ties(case):
    """Small integer weights (lots of exact ties): top-k by C_sum, ties to the lower index, ascending output."""
    p, (n, k, values) = case
    combine = torch.tensor(values, dtype=torch.float64).view(2, 3, n, p) / 8
    got = top_k_by_combine(combine, k)
    for b in range(2):
        sums = [sum(values[((b * 3 + t) * n + j) * p + s] for t in range(3) for s in range(p)) for j in range(n)]
        want = sorted(sorted(range(n), key=lambda j: (-sums[j], j))[:k])
        assert got[b].tolist() == want


def test_combine_strategy_on_a_layer_is_algorithm1_on_its_combine_weights():
    layer = make_layer(2)
    x = make_input(batch=6)
    mask = padding_mask(batch=6)
    with torch.no_grad(), select_experts(layer, k=3) as layers:
        records = capture_selections(layers)
        layer(x, mask)
    assert torch.equal(records[id(layer)][0], naive_top_k(layer, x, mask, 3))
    # the fully padded input has C_sum = 0 everywhere: ties resolve to experts 0, 1, 2
    assert records[id(layer)][0][2].tolist() == [0, 1, 2]


# ----------------------------------------------------------------------------------------- 6. random strategy


def test_random_subsets_reproducible_distinct_and_seed_dependent():
    a = random_subsets(50, N, 3, torch.Generator().manual_seed(123))
    b = random_subsets(50, N, 3, torch.Generator().manual_seed(123))
    c = random_subsets(50, N, 3, torch.Generator().manual_seed(124))
    assert a.dtype == torch.int64 and a.shape == (50, 3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    for rows in (a, c):
        assert torch.all((rows >= 0) & (rows < N))
        assert torch.all(rows.diff(dim=1) > 0)  # ascending, hence distinct
        assert torch.equal(mask_from_subsets(rows, N).sum(1), torch.full((50,), 3))


@pytest.mark.parametrize("n,k", [(8, 1), (8, 2), (8, 6), (5, 3)])
def test_random_subsets_roughly_uniform(n, k):
    draws = 20000
    rows = random_subsets(draws, n, k, torch.Generator().manual_seed(0))
    freq = torch.bincount(rows.reshape(-1), minlength=n).double() / draws
    assert torch.all((freq - k / n).abs() < 0.03), freq.tolist()
    # pairs are uniform too (not, say, always contiguous blocks)
    if k == 2:
        pair = rows[:, 0] * n + rows[:, 1]
        pair_freq = torch.bincount(pair, minlength=n * n).double() / draws
        valid = torch.tensor([i * n + j for i in range(n) for j in range(i + 1, n)])
        assert torch.all((pair_freq[valid] - 1 / len(valid)).abs() < 0.012)


def test_random_strategy_in_select_experts_is_seeded():
    model = TwoLayerModel()
    x = make_input(batch=16)

    def run(**kwargs):
        with torch.no_grad(), select_experts(model, k=0.5, strategy="random", **kwargs) as layers:
            records = capture_selections(layers)
            out = model(x)
            out_again = model(x)  # the generator advances between calls
        sel = [torch.cat(records[id(layer)]) for layer in layers]
        return out, out_again, sel

    out1, again1, sel1 = run(seed=7)
    out2, again2, sel2 = run(seed=7)
    out3, _, sel3 = run(seed=8)
    out4, again4, sel4 = run(generator=torch.Generator().manual_seed(7))
    assert torch.equal(out1, out2) and torch.equal(again1, again2)
    assert all(torch.equal(s, t) for s, t in zip(sel1, sel2))
    assert not torch.equal(out1, out3)
    assert any(not torch.equal(s, t) for s, t in zip(sel1, sel3))
    assert not torch.equal(out1, again1)
    assert torch.equal(out1, out4) and torch.equal(again1, again4)  # seed=s is the same as manual_seed(s)
    for s, layer in zip(sel1, (model.moe_a, model.moe_b)):
        assert s.shape[1] == layer.num_experts // 2
        assert torch.all(s.sort(dim=1).values.diff(dim=1) > 0)


# ------------------------------------------------------------------------------------------ 7. whole model


class TwoLayerModel(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.moe_a = SoftMoE(DIM, 4, slots_per_expert=2, expert_hidden=HIDDEN, dtype=dtype)
        self.mid = nn.Linear(DIM, DIM, dtype=dtype)
        self.moe_b = SoftMoE(DIM, 8, slots_per_expert=1, expert_hidden=HIDDEN, dtype=dtype)
        for layer in (self.moe_a, self.moe_b):
            with torch.no_grad():
                layer.scale.fill_(4.0)

    def forward(self, x, mask=None):
        h = x + self.moe_a(x, mask)
        h = torch.tanh(self.mid(h))
        return h + self.moe_b(h, mask)


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("container", ["custom", "sequential"])
def test_whole_model_each_layer_equals_its_masked_reference(container, renormalize):
    dtype = torch.float64
    if container == "custom":
        model = TwoLayerModel(dtype)
        layers_expected = [model.moe_a, model.moe_b]
        mask = padding_mask(batch=4)
        call = lambda x: model(x, mask)  # noqa: E731
    else:
        torch.manual_seed(0)
        model = nn.Sequential(
            SoftMoE(DIM, 4, expert_hidden=HIDDEN, dtype=dtype), nn.Tanh(),
            SoftMoE(DIM, 8, slots_per_expert=2, expert_hidden=HIDDEN, dtype=dtype),
        )
        layers_expected = [model[0], model[2]]
        mask = None
        call = model
    x = make_input(dtype, batch=4)
    seen = {}

    def hook(module, args, output):
        seen[id(module)] = (args[0].detach().clone(), output.detach().clone())

    handles = [layer.register_forward_hook(hook) for layer in layers_expected]
    try:
        with torch.no_grad(), select_experts(model, k=0.5, renormalize=renormalize) as layers:
            assert layers == layers_expected
            assert [layer.selector.k for layer in layers] == [2, 4]  # half of each layer's own n
            records = capture_selections(layers)
            out = call(x)
    finally:
        for handle in handles:
            handle.remove()
    assert out.shape == x.shape
    for layer in layers_expected:
        inp, got = seen[id(layer)]
        k = layer.num_experts // 2
        (selected,) = records[id(layer)]
        want_sel = naive_top_k(layer, inp, mask, k)
        assert torch.equal(selected, want_sel)
        ref = masked_reference_forward(layer, inp, want_sel, mask, renormalize=renormalize)
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
        assert layer.selector is None


def test_fraction_rounds_per_layer():
    model = nn.Sequential(SoftMoE(DIM, 3), SoftMoE(DIM, 10), SoftMoE(DIM, 16))
    with select_experts(model, k=0.5) as layers:
        # round(1.5) -> 2 (Python rounds halves to even), 5, 8
        assert [layer.selector.k for layer in layers] == [round(1.5), 5, 8]
    with select_experts(model, k=2) as layers:  # an int is the same count in every layer
        assert [layer.selector.k for layer in layers] == [2, 2, 2]
    assert resolve_k(0.25, 16) == 4 and resolve_k(1.0, 7) == 7 and resolve_k(7, 7) == 7 and resolve_k(0.07, 16) == 1


def test_selectors_restored_after_block_and_after_exception():
    model = TwoLayerModel()
    x = make_input()
    with torch.no_grad():
        plain = model(x)
    sentinel = Selector("combine", 1)
    model.moe_b.selector = sentinel
    with select_experts(model, k=0.5) as layers:
        assert all(isinstance(layer.selector, Selector) for layer in layers)
        assert model.moe_b.selector is not sentinel
        with select_experts(model, k=1, strategy="random"):  # nesting
            assert [layer.selector.k for layer in layers] == [1, 1]
        assert [layer.selector.k for layer in layers] == [2, 4]
    assert model.moe_a.selector is None and model.moe_b.selector is sentinel
    model.moe_b.selector = None

    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with select_experts(model, k=0.25):
            assert model.moe_a.selector is not None and model.moe_b.selector is not None
            model(x)
            raise Boom
    assert model.moe_a.selector is None and model.moe_b.selector is None
    with torch.no_grad():
        assert torch.equal(model(x), plain)


def test_failed_validation_installs_nothing():
    model = nn.Sequential(SoftMoE(DIM, 8), SoftMoE(DIM, 4))
    with pytest.raises(ValueError, match=r"\[1, 4\].*got 6"):
        with select_experts(model, k=6):  # valid for the first layer, not for the second
            pass
    assert all(layer.selector is None for layer in soft_moe_layers(model))


# ------------------------------------------------------------------------------------------------- 8. errors


@pytest.mark.parametrize(
    "k,pattern",
    [
        (0, r"k must lie in \[1, 8\].*got 0"),
        (-2, r"k must lie in \[1, 8\].*got -2"),
        (9, r"k must lie in \[1, 8\].*got 9"),
        (0.0, r"fractional k must lie in \(0, 1\], got 0\.0"),
        (1.5, r"fractional k must lie in \(0, 1\], got 1\.5"),
        (-0.1, r"fractional k must lie in \(0, 1\], got -0\.1"),
        (0.05, r"k = 0\.05 of 8 experts rounds to 0"),
        (True, r"k must be an int.*got True"),
        ("2", r"k must be an int.*got '2'"),
    ],
)
@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_bad_k(k, pattern, strategy):
    layer = make_layer()
    with pytest.raises(ValueError, match=pattern):
        with select_experts(layer, k=k, strategy=strategy):
            pass
    assert layer.selector is None
    with pytest.raises(ValueError, match=pattern):
        resolve_k(k, N)


@pytest.mark.parametrize(
    "mask,pattern",
    [
        (torch.ones(BATCH, N - 1, dtype=torch.bool), r"shape \(batch, 8\), got \(3, 7\)"),
        (torch.ones(N, dtype=torch.bool), r"shape \(batch, 8\), got \(8,\)"),
        (torch.ones(1, BATCH, N, dtype=torch.bool), r"shape \(batch, 8\), got \(1, 3, 8\)"),
        (torch.tensor([[True] * 2 + [False] * 6, [True] * 3 + [False] * 5]), r"same k >= 1.*counts \[2, 3\]"),
        (torch.zeros(2, N, dtype=torch.bool), r"same k >= 1.*counts \[0, 0\]"),
        (torch.ones(BATCH, N, dtype=torch.int64), r"bool tensor.*torch\.int64 \(3, 8\)"),
        (torch.ones(BATCH, N), r"bool tensor.*torch\.float32 \(3, 8\)"),
    ],
    ids=["cols", "rank1", "rank3", "uneven", "empty", "int", "float"],
)
def test_bad_mask(mask, pattern):
    layer = make_layer()
    with pytest.raises(ValueError, match=pattern):
        with select_experts(layer, strategy=mask):
            pass
    assert layer.selector is None


def test_mask_batch_mismatch_at_forward_and_k_mismatch():
    layer = make_layer()
    keep = random_mask(2, N, 3)
    with select_experts(layer, strategy=keep):
        with pytest.raises(ValueError, match=r"expert mask must have shape \(3, 8\), got \(2, 8\)"):
            layer(make_input(batch=3))
    assert layer.selector is None
    with pytest.raises(ValueError, match=r"k = 2 does not match the 3 experts"):
        with select_experts(layer, k=2, strategy=keep):
            pass
    with select_experts(layer, k=3, strategy=keep):  # a matching k is accepted
        assert layer.selector.k == 3


@pytest.mark.parametrize("strategy", ["topk", "Combine", "", 3, None])
def test_unknown_strategy(strategy):
    layer = make_layer()
    with pytest.raises(ValueError, match=r"strategy must be one of .*'combine'.*got " + re.escape(repr(strategy))):
        with select_experts(layer, k=2, strategy=strategy):
            pass


@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_strategy_without_k(strategy):
    layer = make_layer()
    with pytest.raises(ValueError, match=rf"strategy '{strategy}' needs k.*\[1, 8\]"):
        with select_experts(layer, strategy=strategy):
            pass


@pytest.mark.parametrize(
    "selected,pattern",
    [
        (torch.tensor([[0, 1], [2, 2], [3, 4]]), r"must not repeat an expert"),
        (torch.tensor([[5, 1, 5], [0, 1, 2], [3, 4, 6]]), r"must not repeat an expert"),
        (torch.tensor([[0, 8], [1, 2], [3, 4]]), r"indices must lie in \[0, 8\) \(or be -1, unused\), got \[\[0, 8\]"),
        (torch.tensor([[0, -2], [1, 2], [3, 4]]), r"indices must lie in \[0, 8\) \(or be -1, unused\), got \[\[0, -2\]"),
        (torch.tensor([[0, 1], [1, 2]]), r"shape \(batch=3, k\), got torch\.int64 \(2, 2\)"),
        (torch.tensor([[0, 1], [1, 2], [3, 4]], dtype=torch.int32), r"int64.*got torch\.int32 \(3, 2\)"),
        (torch.tensor([0, 1, 2]), r"shape \(batch=3, k\), got torch\.int64 \(3,\)"),
    ],
    ids=["repeat", "repeat-unsorted", "too-big", "negative", "batch", "int32", "rank1"],
)
def test_forward_selected_rejects_bad_selections(selected, pattern):
    layer = make_layer()
    with pytest.raises(ValueError, match=pattern):
        layer.forward_selected(make_input(), selected)


def test_model_without_soft_moe_layer():
    with pytest.raises(ValueError, match=r"Sequential contains no SoftMoE layer"):
        with select_experts(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()), k=1):
            pass


# ---------------------------------------------------------------------------------------------- 9. gradients


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("custom", [False, True], ids=["mlp", "custom"])
def test_gradients_reach_phi_and_only_selected_experts(custom, renormalize):
    dtype = torch.float64
    layer = make_layer(2, dtype, custom=custom)
    x = make_input(dtype).requires_grad_(True)
    mask = padding_mask()
    selected = torch.tensor([[0, 2], [2, 5], [5, 0]])  # experts 1, 3, 4, 6, 7 unused
    unused = [1, 3, 4, 6, 7]
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=dtype)

    def grads(fn):
        layer.zero_grad(set_to_none=True)
        x.grad = None
        (fn() * target).sum().backward()
        out = {name: param.grad.clone() for name, param in layer.named_parameters()}
        out["x"] = x.grad.clone()
        return out

    fast = grads(lambda: layer.forward_selected(x, selected, mask, renormalize=renormalize))
    with select_experts(layer, strategy=mask_from_subsets(selected, N), renormalize=renormalize):
        ctx = grads(lambda: layer(x, mask))
    ref = grads(lambda: masked_reference_forward(layer, x, selected, mask, renormalize=renormalize))

    assert fast["phi"].abs().sum() > 0 and fast["x"].abs().sum() > 0
    if layer.scale is not None:
        assert fast["scale"].abs() > 0
    expert_params = [name for name, _ in layer.experts.named_parameters()]
    assert expert_params
    for name in expert_params:
        g = fast["experts." + name]
        assert g.shape[0] == N
        for j in range(N):
            if j in unused:
                assert torch.count_nonzero(g[j]) == 0, (name, j)
            else:
                assert g[j].abs().sum() > 0, (name, j)
    for key in fast:
        torch.testing.assert_close(fast[key], ref[key], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ctx[key], ref[key], atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("k", [2, 6])
@pytest.mark.parametrize("batch", [1, 12])  # one row per expert (row blocks) and several (oneDNN in inference)
def test_fast_path_with_large_expert_kernels_equals_masked_reference(k, batch, monkeypatch):
    """The kernels softmoe::native_grouped_mm uses for large weights on several CPU threads keep Algorithm 1 exact:
    the selected plan with every weight counting as large for the native kernel (one row: its stream; 12 rows: its
    column split) and oneDNN, with and without gradients (the one-call plan in inference, the grouped products
    with them)."""
    monkeypatch.setitem(TABLE, "large_weight", Measured(1, "a test"))
    monkeypatch.setitem(TABLE, "native_min_weight", Measured(1, "a test"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.manual_seed(0)
        layer = SoftMoE(12, 8, expert_hidden=32, activation="gelu_tanh").eval()
        x = torch.randn(batch, 10, 12)
        selected = top_k_by_combine(layer.route(x).combine, k)
        with torch.no_grad():
            ref = masked_reference_forward(layer, x, selected)
            fast = layer.forward_selected(x, selected, plan="selected")
        trained = layer.forward_selected(x, selected, plan="selected")
        called = kernels_called(lambda: layer.forward_selected(x, selected, plan="selected"))
    finally:
        torch.set_num_threads(threads)
    assert (fast - ref).abs().max().item() < 1e-5 and (trained.detach() - ref).abs().max().item() < 1e-5
    if native_available():
        assert {"softmoe::native_grouped_mm", "softmoe::expert_matmul"} <= called


# --------------------------------------------------------------- 9. adaptive strategies: per-input expert counts


def shares_combine(shares):
    """A combine tensor (batch, 1 token, n, 1 slot) whose per-expert sums are the given rows of shares."""
    return torch.tensor(shares, dtype=torch.float64)[:, None, :, None]


def test_mass_golden_values():
    combine = shares_combine([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]])
    assert experts_by_mass(combine, 0.7, 1, 4).tolist() == [[1, 3, -1, -1], [0, 1, 2, -1]]  # ties: low index
    assert experts_by_mass(combine, 0.85, 1, 4).tolist() == [[1, 2, 3, -1], [0, 1, 2, 3]]
    assert experts_by_mass(combine, 0.85, 1, 2).tolist() == [[1, 3], [0, 1]]  # k_max caps
    assert experts_by_mass(combine, 0.4, 2, 4).tolist() == [[1, 3, -1, -1], [0, 1, -1, -1]]  # k_min floors
    assert experts_by_mass(combine, 1.0, 1, 4).tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_budget_gives_spread_inputs_more_experts():
    peaked, spread = [0.85, 0.05, 0.05, 0.05], [0.3, 0.25, 0.25, 0.2]
    combine = shares_combine([peaked, spread, peaked, spread])
    chosen = experts_by_budget(combine, 2.5, 1, 4)  # 10 experts in all over 4 inputs
    counts = (chosen >= 0).sum(dim=1).tolist()
    assert sum(counts) == 10 and counts == [1, 4, 1, 4]
    assert chosen.tolist()[0] == [0, -1, -1, -1]
    assert (experts_by_budget(combine, 2.5, 2, 3) >= 0).sum(dim=1).tolist() == [2, 3, 2, 3]  # bounds hold
    assert (experts_by_budget(combine, 1, 1, 4) >= 0).sum(dim=1).tolist() == [1, 1, 1, 1]
    assert (experts_by_budget(combine, 4, 1, 4) >= 0).sum(dim=1).tolist() == [4, 4, 4, 4]


def adaptive_layer(p, dtype=torch.float64):
    layer = make_layer(p, dtype)
    with torch.no_grad():
        layer.scale.fill_(12.0)  # peaked routing: the inputs need different numbers of experts
    return layer


@pytest.mark.parametrize("renormalize", [False, True], ids=["raw", "renorm"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("custom", [False, True], ids=["mlp", "custom"])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("setting", [("mass", 0.6), ("mass", 0.9), ("budget", 3)], ids=["mass0.6", "mass0.9", "budget3"])
def test_adaptive_fast_path_equals_masked_reference(setting, p, custom, padded, renormalize):
    strategy, value = setting
    layer = make_layer(p, torch.float64, custom=custom) if custom else adaptive_layer(p)
    with torch.no_grad():
        layer.scale.fill_(12.0)
    mask = padding_mask(6) if padded else None
    kwargs = {"tau": value} if strategy == "mass" else {"k": value}
    for seed in range(1, 6):  # the first inputs whose rows keep different numbers of experts (random weights differ
        x = make_input(torch.float64, batch=6, seed=seed)  # between torch versions)
        with torch.no_grad(), select_experts(layer, strategy=strategy, renormalize=renormalize, **kwargs) as layers:
            records = capture_selections(layers)
            out = layer(x, mask)
        selected = records[id(layer)][0]
        counts = (selected >= 0).sum(dim=1)
        if len(set(counts.tolist())) > 1:
            break
    assert len(set(counts.tolist())) > 1, f"the inputs should keep different numbers of experts: {counts.tolist()}"
    reference = masked_reference_forward(layer, x, selected, mask, renormalize)
    torch.testing.assert_close(out, reference, atol=1e-10, rtol=1e-10)
    if strategy == "budget":
        assert int(counts.sum()) == value * 6


def test_adaptive_selection_skips_the_work_of_dropped_experts():
    p = 2
    layer = adaptive_layer(p)
    x = make_input(torch.float64, batch=6)
    with torch.no_grad(), select_experts(layer, strategy="mass", tau=0.7, plan="selected") as layers:
        records = capture_selections(layers)
        _, work = expert_work([layer], x.shape, lambda: layer(x))
    selected = records[id(layer)][0]
    kept = selected[selected >= 0]
    blocks = blocks_of(torch.bincount(kept, minlength=N) * p)
    assert kept.numel() < selected.numel()  # some places are unused ...
    assert [run_blocks for _, _, run_blocks in work.grouped] == [blocks] * 2  # ... and no product reads them
    assert sum(rows for _, rows in blocks) == p * kept.numel()
    assert work.whole == []


@pytest.mark.parametrize("custom", [False, True], ids=["mlp", "custom"])
def test_tau_one_is_every_expert_and_tau_near_zero_is_k_min(custom):
    layer = make_layer(2, torch.float64, custom=custom)
    x = make_input(torch.float64, batch=5)
    with torch.no_grad():
        plain = layer(x)
        with select_experts(layer, strategy="mass", tau=1.0, plan="selected") as layers:
            records = capture_selections(layers)
            every = layer(x)
        assert (records[id(layer)][0] >= 0).all()
        torch.testing.assert_close(every, plain, atol=1e-10, rtol=1e-10)
        for k_min in (1, 3):
            with select_experts(layer, strategy="mass", tau=1e-9, k_min=k_min, plan="selected") as layers:
                records = capture_selections(layers)
                fewest = layer(x)
            selected = records[id(layer)][0]
            assert (selected >= 0).sum(dim=1).tolist() == [k_min] * 5
            assert torch.equal(selected[:, :k_min], top_k_by_combine(layer.route(x).combine, k_min))
            torch.testing.assert_close(fewest, masked_reference_forward(layer, x, selected), atol=1e-10, rtol=1e-10)


def test_adaptive_selection_gradients():
    layer = adaptive_layer(1)
    x = make_input(torch.float64, batch=4).requires_grad_()
    selected = torch.tensor([[0, 3, -1], [2, -1, -1], [1, 4, 6], [5, -1, -1]])

    def fast(x):
        return layer.forward_selected(x, selected)

    def reference(x):
        return masked_reference_forward(layer, x, selected)

    torch.autograd.gradcheck(fast, (x,))
    target = torch.randn(4, TOKENS, DIM, dtype=torch.float64)
    (g_fast,) = torch.autograd.grad((fast(x) * target).sum(), x)
    (g_ref,) = torch.autograd.grad((reference(x) * target).sum(), x)
    torch.testing.assert_close(g_fast, g_ref, atol=1e-10, rtol=1e-10)


def test_unused_places_are_checked_like_indices():
    layer = make_layer()
    x = make_input()
    layer.forward_selected(x, torch.tensor([[0, -1], [-1, -1], [3, 1]]))  # -1 may repeat; a row may keep nothing
    with pytest.raises(ValueError, match=r"must lie in \[0, 8\) \(or be -1, unused\)"):
        layer.forward_selected(x, torch.tensor([[0, -2], [1, 2], [3, 1]]))
    with pytest.raises(ValueError, match="must not repeat"):
        layer.forward_selected(x, torch.tensor([[0, 0], [1, -1], [3, 1]]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strategy="mass"), r"needs tau, a combine-mass share in \(0, 1\], got None"),
        (dict(strategy="mass", tau=0.0), r"got 0.0"),
        (dict(strategy="mass", tau=1.5), r"got 1.5"),
        (dict(strategy="mass", tau=True), r"got True"),
        (dict(strategy="mass", tau=0.5, k_min=0), r"1 <= k_min <= k_max <= 8, got k_min=0, k_max=8"),
        (dict(strategy="mass", tau=0.5, k_max=9), r"got k_min=1, k_max=9"),
        (dict(strategy="mass", tau=0.5, k_min=4, k_max=3), r"got k_min=4, k_max=3"),
        (dict(strategy="mass", tau=0.5, k_min=1.5), r"k_min must be an int, got 1.5"),
        (dict(strategy="budget"), r"needs k, the average experts per input"),
        (dict(strategy="budget", k=6, k_max=4), r"the average k = 6 experts must lie in \[k_min, k_max\] = \[1, 4\]"),
        (dict(strategy="budget", k=1.5), r"a fractional k must lie in \(0, 1\], got 1.5"),
    ],
)
def test_bad_adaptive_settings_name_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        with select_experts(make_layer(), **kwargs):
            pass


def test_custom_experts_leave_unused_places_out_on_cpu():
    layer = make_layer(2, torch.float64, custom=True)
    x = make_input(torch.float64, batch=3)
    selected = torch.tensor([[0, 3, -1], [2, -1, -1], [1, 4, 6]])
    with torch.no_grad():
        out, flops, elsewhere = expert_flops(layer, lambda: layer.forward_selected(x, selected, plan="selected"))
    # of the 9 places, only the 6 used ones run through the experts (torch's FLOP counter)
    assert flops == 6 * template_flops_per_group(layer) and elsewhere == 0
    torch.testing.assert_close(out, masked_reference_forward(layer, x, selected), atol=1e-10, rtol=1e-10)


def sorts_and_top_ks(fn):
    """``fn()``'s result and the (operator, first input's shape) of every torch.sort and torch.topk it ran."""
    result, ops = ops_run(fn)
    return result, {(name, tuple(shapes[0])) for name, shapes in ops if name in ("aten::sort", "aten::topk")}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("path", ["topk", "sort", "host"])
def test_algorithm1_fast_top_k_equals_the_stable_rule(seed, path):
    """top_k_by_combine sorts on the host up to TABLE's "host_topk_max_scores" scores on CPU, takes torch.topk from
    "topk_min_scores" unless the k-th and (k+1)-th scores tie, and sorts with torch between; with planted boundary ties
    (values from a few levels), NaNs and distinct values every path keeps the same experts as the stable sort's
    rule. The number of scores (inputs x experts) picks the path; the profiler shows the one that ran."""
    host_most, topk_least = value("host_topk_max_scores"), value("topk_min_scores")
    n = 8
    batch = {"host": host_most // n, "sort": host_most // n + 1, "topk": topk_least // n}[path]
    assert host_most < (host_most // n + 1) * n < topk_least
    g = torch.Generator().manual_seed(seed)
    for levels in (3, 1000, None):  # few levels: many ties, also at the boundary; None: distinct values
        shape = (batch, 5, n, 1)
        combine = torch.rand(shape, generator=g) if levels is None else torch.randint(0, levels, shape, generator=g)
        combine = combine.double()
        if seed % 2:
            combine[0, 0, 3, 0] = float("nan")
            combine[1, :, 5, 0] = float("nan")
        for k in range(1, n + 1):
            want = top_k(combine_scores(combine), k, dim=1)[1].sort(dim=1).values
            got, ran = sorts_and_top_ks(lambda combine=combine, k=k: top_k_by_combine(combine, k))
            assert torch.equal(got, want)
            stable_sort = ("aten::sort", (batch, n)) in ran  # of the scores (the top-k's order is (batch, k))
            if path == "host":
                assert ran == set(), k
            elif path == "sort" or k == n:  # (every expert kept: nothing for torch.topk to leave out)
                assert stable_sort and ("aten::topk", (batch, n)) not in ran, k
            else:
                assert ("aten::topk", (batch, n)) in ran, k
                if levels is None:  # no tie between the k-th and the (k+1)-th: no sort after it
                    assert not stable_sort, k


# ------------------------------------------------------------------------- uniform combine shares


def test_share_uniformity_golden_values():
    # combine (batch 3, tokens 2, n 4, p 1); each input's C_sum over tokens, normalized over experts, gives its shares
    combine = torch.zeros(3, 2, 4, 1, dtype=torch.float64)
    combine[0] = 0.25  # uniform: entropy 1, top-k holds k / n of the mass
    combine[1, :, 2] = 1.0  # one expert: entropy 0, top-k holds everything
    combine[2, 0, :, 0] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # shares (0.5, 0.25, 0.25, 0): 1.5 of 2 bits
    combine[2, 1, :, 0] = torch.tensor([0.5, 0.0, 0.5, 0.0])
    one = share_uniformity(combine[:1], 2)
    assert (one.entropy, one.kept_mass_ratio, one.half_mass_ratio, one.k, one.num_experts) == (
        pytest.approx(1.0), pytest.approx(1.0), pytest.approx(1.0), 2, 4)
    assert one.nearly_uniform
    assert "nearly uniform" in one.message() and "1.000x" in one.message() and "no better than random" in one.message()
    peaked = share_uniformity(combine[1:2], 1)
    assert peaked.entropy == pytest.approx(0.0, abs=1e-12) and peaked.kept_mass_ratio == pytest.approx(4.0)
    assert peaked.half_mass_ratio == pytest.approx(2.0) and not peaked.nearly_uniform
    mixed = share_uniformity(combine[2:], 1)
    assert mixed.entropy == pytest.approx(0.75) and mixed.kept_mass_ratio == pytest.approx(2.0)
    assert mixed.half_mass_ratio == pytest.approx(1.5)  # the top two hold 0.75 of the mass, a random two 0.5
    everything = share_uniformity(combine, 0.25)  # k as a fraction of n; the means over the inputs
    assert everything.k == 1 and everything.entropy == pytest.approx((1.0 + 0.0 + 0.75) / 3)
    assert everything.kept_mass_ratio == pytest.approx((0.25 + 1.0 + 0.5) / 3 * 4)
    assert everything.half_mass_ratio == pytest.approx((0.5 + 1.0 + 0.75) / 3 * 2)
    # just inside and just outside the threshold: the top half keeps 0.505 / 0.515 of the mass
    for top, uniform in ((0.505, True), (0.515, False)):
        close = torch.tensor([top / 2, top / 2, (1 - top) / 2, (1 - top) / 2], dtype=torch.float64).view(1, 1, 4, 1)
        assert share_uniformity(close, 2).nearly_uniform == uniform
    assert not share_uniformity(torch.ones(2, 3, 1, 1), 1).nearly_uniform  # one expert: nothing to choose
    padded = torch.cat([combine[1:2], torch.zeros(1, 2, 4, 1, dtype=torch.float64)])  # a fully padded input
    assert share_uniformity(padded, 1) == share_uniformity(combine[1:2], 1)


def uniform_and_peaked_layers():
    torch.manual_seed(0)
    uniform = SoftMoE(DIM, N, 1, expert_hidden=HIDDEN).eval()
    with torch.no_grad():
        uniform.phi.zero_()  # every logit 0: every expert the same combine weight
    peaked = SoftMoE(DIM, N, 1, expert_hidden=HIDDEN).eval()
    with torch.no_grad():
        peaked.scale.fill_(50.0)
    return uniform, peaked


def test_select_experts_says_once_when_shares_are_nearly_uniform():
    uniform, peaked = uniform_and_peaked_layers()
    x = torch.randn(BATCH, TOKENS, DIM)
    with torch.no_grad():
        _, plain_ops = ops_run(lambda: uniform(x))  # no check installed yet
    model = nn.Sequential(uniform, uniform)  # two visits of the layer, one warning
    with pytest.warns(NoBetterThanRandomWarning, match="nearly uniform") as caught:
        with torch.no_grad(), select_experts(model, k=2):
            model(x)
            model(x)
    assert len([w for w in caught if issubclass(w.category, NoBetterThanRandomWarning)]) == 1
    assert "which 2 experts Algorithm 1 keeps" in str(caught[0].message)
    assert "no better than random selection" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoBetterThanRandomWarning)
        # the check is gone after the block, and after its first batch: the plain forward's operators, no warning
        # (a check left behind would route the batch again and warn: the layer's shares are uniform)
        with torch.no_grad():
            _, ops = ops_run(lambda: uniform(x))
        assert ops == plain_ops
        # once per layer: a later block neither checks nor warns again (its first batch runs what its second does)
        with torch.no_grad(), select_experts(uniform, k=2):
            _, first = ops_run(lambda: uniform(x))
            _, second = ops_run(lambda: uniform(x))
        assert first == second
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoBetterThanRandomWarning)
        with torch.no_grad(), select_experts(peaked, k=2):
            peaked(x)
        with torch.no_grad(), select_experts(uniform, k=2, strategy="random"):  # only Algorithm 1 is concerned
            uniform(x)
    assert not measure_share_uniformity(peaked, x, 2)[0].nearly_uniform
    # where reading the shares on the host is unwelcome (CUDA's sync debug mode, a graph capture) the check waits
    # for a later batch: nothing read, no warning, the layer not marked checked
    fresh, _ = uniform_and_peaked_layers()
    with torch.no_grad(), select_experts(fresh, k=2):
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoBetterThanRandomWarning)
            with unittest.mock.patch("softmoe.selection.may_synchronize", lambda device: False):
                _, waiting = ops_run(lambda: fresh(x))
        with pytest.warns(NoBetterThanRandomWarning, match="nearly uniform"):
            _, checked = ops_run(lambda: fresh(x))  # a batch where reading is welcome: checked (routed twice)
        _, after = ops_run(lambda: fresh(x))
    assert waiting == after != checked
    (flat,) = measure_share_uniformity(uniform, x, 2)
    assert flat.entropy == pytest.approx(1.0) and flat.half_mass_ratio == pytest.approx(1.0) and flat.k == 2
