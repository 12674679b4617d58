"""softmoe::top_k_combine: Algorithm 1's choice from the combine weights in one native call, against the torch
formulation (top_k_by_combine and the dense plan's mask); the same choice made inside the native routing's pass
(soft_moe_routing_top_k); and the layer's CPU paths through them."""

from __future__ import annotations

import collections
import contextlib
import math

import pytest
import torch

import softmoe.backends.cpu as cpu_backend
from softmoe import SoftMoE, masked_reference_forward, select_experts
from softmoe.kernels import cpu_isa, native_available, soft_moe_routing, soft_moe_routing_top_k
from softmoe.kernels.top_k_combine import top_k_combine
from softmoe.selection import top_k_by_combine
from softmoe.selection_plan import kept_slots
from softmoe.tuning import TABLE, Measured

pytestmark = pytest.mark.skipif(not native_available(), reason="native kernels not built")


@contextlib.contextmanager
def softmoe_ops():
    """The softmoe ops the block runs, seen by torch's profiler: {name ("top_k_combine"): [each call's arguments,
    the int and bool ones by value, the others None]}, filled when the block ends."""
    calls = collections.defaultdict(list)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        yield calls
    for event in prof.events():
        if event.name.startswith("softmoe::"):
            calls[event.name.removeprefix("softmoe::")].append(tuple(event.concrete_inputs))


class WatchedSelector:
    """A layer's selector (``layer.selector``, the ExpertSelector protocol) whose select() calls are counted: a
    backend that chooses itself never calls it."""

    def __init__(self, selector):
        self.selector, self.calls = selector, 0
        self.renormalize, self.plan, self.top_k = selector.renormalize, selector.plan, selector.top_k

    def select(self, combine):
        self.calls += 1
        return self.selector.select(combine)


def watch_selector(layer) -> WatchedSelector:
    """Wrap the selector select_experts gave ``layer`` (restored when its block ends)."""
    layer.selector = WatchedSelector(layer.selector)
    return layer.selector


def torch_top_k_combine(combine: torch.Tensor, p: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: the selector's choice (its sums in float64, as the kernel's) and torch.where's mask."""
    batch, tokens, slots = combine.shape
    selected = top_k_by_combine(combine.double().view(batch, tokens, slots // p, p), k)
    return torch.where(kept_slots(selected, slots // p, p), combine, 0.0), selected


SHAPES = [((1, 1, 1), 1, 1), ((3, 5, 8), 1, 1), ((3, 5, 8), 1, 7), ((4, 197, 8), 1, 2), ((6, 4, 12), 3, 2),
          ((5, 4, 128), 1, 32), ((2, 7, 260), 2, 129), ((70, 4, 16), 1, 4), ((9, 3, 30), 5, 6),
          ((64, 4, 256), 1, 64), ((40, 4, 33), 1, 33),  # threads split the inputs; every expert kept
          ((5, 4, 256), 1, 250), ((7, 3, 200), 2, 90), ((6, 4, 130), 1, 100)]  # most kept: runs, few zeroed


@pytest.mark.parametrize("shape, p, k", SHAPES)
def test_the_op_equals_the_selector_and_the_mask(isa, shape, p, k):
    torch.manual_seed(sum(shape) + p + k)
    combine = torch.randn(shape).softmax(dim=-1)
    kept, selected = top_k_combine(combine, p, k)
    want_kept, want_selected = torch_top_k_combine(combine, p, k)
    assert selected.dtype == torch.int64 and selected.shape == (shape[0], k)
    assert torch.equal(selected, want_selected)
    assert torch.equal(kept, want_kept)  # kept values copied, the rest exactly zero


def test_ties_go_to_the_lower_expert_and_nan_comes_first():
    combine = torch.full((3, 4, 6), 1.0 / 6)
    combine[1, 2, 4] = math.nan  # expert 4's sum is NaN: kept first
    combine[2, :, 5] = 0.5  # expert 5 leads; the rest tie
    kept, selected = top_k_combine(combine, 1, 2)
    assert selected.tolist() == [[0, 1], [0, 4], [0, 5]]
    assert torch.isnan(kept[1, 2, 4]) and torch.equal(kept[0, :, 2:], torch.zeros(4, 4))
    _, pairs = top_k_combine(combine, 2, 1)  # experts of two slots: (0, 1), (2, 3), (4, 5)
    assert pairs.tolist() == [[0], [2], [2]]


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("slots", [16, 24, 136])
def test_many_ties_signed_zeros_infinities_and_nans_rank_as_the_selector_ranks(isa, p, slots):
    """The kernel ranks by a key per expert (no sort): up to 16 experts by counting ranks, beyond by a selection of
    the k-th largest key; sums drawn from a few values (+0 and -0 equal, infinities, NaNs from inf - inf and NaN
    entries) tie in many ways, at every k, on every kernel variant."""
    gen = torch.Generator().manual_seed(p)
    values = torch.tensor([0.0, -0.0, 0.25, 0.25, 1.0, math.inf, -math.inf, math.nan])
    combine = values[torch.randint(len(values), (16, 2, slots), generator=gen)]
    for k in range(1, slots // p + 1):
        kept, selected = top_k_combine(combine, p, k)
        want_kept, want_selected = torch_top_k_combine(combine, p, k)
        assert torch.equal(selected, want_selected), k
        assert torch.equal(kept.isnan(), want_kept.isnan()) and torch.equal(kept.nan_to_num(), want_kept.nan_to_num())


def test_a_strided_combine_is_read_as_its_values():
    torch.manual_seed(1)
    combine = torch.randn(8, 5, 4).softmax(dim=-1).transpose(0, 1)  # (5, 8, 4), not contiguous
    kept, selected = top_k_combine(combine, 1, 2)
    want_kept, want_selected = torch_top_k_combine(combine.contiguous(), 1, 2)
    assert torch.equal(selected, want_selected) and torch.equal(kept, want_kept)


def test_opcheck_and_the_gradient_reaches_the_kept_slots_only():
    torch.manual_seed(2)
    combine = torch.randn(4, 3, 6).softmax(dim=-1).requires_grad_()
    torch.library.opcheck(torch.ops.softmoe.top_k_combine.default, (combine, 2, 2, cpu_isa()))
    kept, selected = top_k_combine(combine, 2, 2)
    assert not selected.requires_grad
    upstream = torch.randn_like(kept)
    (grad,) = torch.autograd.grad(kept, combine, upstream)
    assert torch.equal(grad, torch.where(kept_slots(selected, 3, 2), upstream, 0.0))


def test_bad_arguments_are_value_errors():
    combine = torch.rand(2, 3, 6)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 3\] \(the experts\), got 4"):
        top_k_combine(combine, 2, 4)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 6\] \(the experts\), got 0"):
        top_k_combine(combine, 1, 0)
    with pytest.raises(ValueError, match="6 slots are not a whole number of experts of 4 slots"):
        top_k_combine(combine, 4, 1)


# (batch, tokens, dim, experts, slots per expert, k, normalize): the kernel's own products (<= 32 slots) and MKL's or
# oneDNN's (more), the rank path (<= 16 experts) and the bisection, k = 1 and k = n, experts of several slots, one
# token, threads splitting the inputs (the last).
ROUTING_SHAPES = [(5, 4, 20, 8, 1, 3, "router"), (3, 1, 7, 6, 2, 6, "inputs"), (4, 3, 12, 40, 1, 1, "none"),
                  (2, 5, 9, 30, 3, 17, "router"), (6, 4, 16, 300, 1, 77, "router"), (64, 4, 196, 64, 1, 16, "router")]


@pytest.mark.parametrize("batch, tokens, dim, n, p, k, normalize", ROUTING_SHAPES)
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_the_routing_makes_the_same_choice_in_its_pass(isa, threads, batch, tokens, dim, n, p, k, normalize):
    """soft_moe_routing_top_k gives exactly what the routing then the op give: dispatch, the kept combine (zeros
    elsewhere) and the kept experts, with the kept slots as bits; without the list of kept experts the rest the
    same."""
    torch.manual_seed(batch + n + k)
    x, phi, scale = torch.randn(batch, tokens, dim), torch.randn(dim, n * p), torch.tensor(2.5)
    with torch.no_grad():
        _, dispatch, combine = soft_moe_routing(x, phi, scale, normalize)
        want_kept, want_selected = top_k_combine(combine, p, k)
        got = soft_moe_routing_top_k(x, phi, scale, normalize, p, k)
        unlisted = soft_moe_routing_top_k(x, phi, scale, normalize, p, k, with_selected=False)
    assert got is not None and unlisted is not None
    assert torch.equal(got[0], dispatch) and torch.equal(got[1], want_kept) and torch.equal(got[3], want_selected)
    assert torch.equal(got[3], torch_top_k_combine(combine, p, k)[1])
    slots = n * p
    assert got[2].dtype == torch.int64 and got[2].shape == (batch, (slots + 63) // 64)
    bits = (got[2].unsqueeze(-1) >> torch.arange(64)) & 1  # (batch, words, 64), bit s % 64 of word s // 64
    kept_slot = torch.zeros(batch, bits[0].numel(), dtype=torch.int64)
    kept_slot[:, :slots] = kept_slots(want_selected, n, p).view(batch, slots).long()
    assert torch.equal(bits.view(batch, -1), kept_slot)  # the words' bits past the slots clear
    assert all(torch.equal(a, b) for a, b in zip(unlisted[:3], got[:3])) and unlisted[3] is None


def test_the_routing_with_the_choice_checks_its_arguments_and_declines_what_it_cannot_serve():
    x, phi, scale = torch.randn(2, 3, 8), torch.randn(8, 6), torch.tensor(1.0)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 6\]"):
            soft_moe_routing_top_k(x, phi, scale, "router", 1, 7)
        with pytest.raises(ValueError, match="6 slots are not a whole number of experts of 4 slots"):
            soft_moe_routing_top_k(x, phi, scale, "router", 4, 1)
        with pytest.raises(ValueError, match="normalize must be one of"):
            soft_moe_routing_top_k(x, phi, scale, "rms", 1, 1)
        assert soft_moe_routing_top_k(x.double(), phi.double(), scale.double(), "router", 1, 2) is None
    assert soft_moe_routing_top_k(x, phi.requires_grad_(), scale, "router", 1, 2) is None  # a gradient to record


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("plan", ["auto", "dense", "selected"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("grad", [False, True])
def test_the_layer_runs_algorithm1_through_the_ops_on_the_cpu(p, plan, renormalize, grad):
    """A float32 CPU layer with strategy "combine": in inference the routing chooses in its pass, with gradients
    recorded the op does (the selector's select() is never called), and every plan equals the paper's masked
    forward, as the selector's choice does."""
    torch.manual_seed(3)
    layer = SoftMoE(12, 6, slots_per_expert=p, expert_hidden=20).eval()
    with torch.no_grad():
        layer.scale.fill_(4.0)
    x = torch.randn(5, 7, 12)
    with torch.no_grad():
        selected = top_k_by_combine(layer.route(x).combine.double(), 2)
        want = masked_reference_forward(layer, x, selected, renormalize=renormalize)
    with torch.set_grad_enabled(grad), select_experts(layer, k=2, plan=plan, renormalize=renormalize):
        selector = watch_selector(layer)
        with softmoe_ops() as ops:
            got = layer(x)
    assert selector.calls == 0
    assert [args[4:6] for args in ops["soft_moe_routing_top_k"]] == ([] if grad else [(p, 2)])  # in its pass
    assert [args[1:3] for args in ops["top_k_combine"]] == ([(p, 2)] if grad else [])  # (that records no gradient)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("batch", [1, 37])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("renormalize", [False, True])
def test_algorithm1_on_the_fused_small_experts_equals_the_masked_forward(batch, k, renormalize):
    """The paper's kind of layer (4 tokens, small relu experts: the fused native mixing): in inference the dense
    plan runs the mixing with the inputs grouped by their kept experts and idle slots skipped, exactly; the routing
    hands it the kept slots as bits and lists the kept experts only for plan "selected"."""
    torch.manual_seed(batch + k)
    layer = SoftMoE(20, 8, expert_hidden=6, activation="relu").eval()
    x = torch.randn(batch, 4, 20)
    assert layer.backend_for(x).name == "cpu"
    with torch.no_grad():
        selected = top_k_by_combine(layer.route(x).combine.double(), k)
        want = masked_reference_forward(layer, x, selected, renormalize=renormalize)
        with softmoe_ops() as ops:
            for plan in ("auto", "dense", "selected"):
                with select_experts(layer, k=k, plan=plan, renormalize=renormalize):
                    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    assert [args[6] for args in ops["soft_moe_routing_top_k"]] == [False, False, True]  # with_selected


def test_algorithm1_on_the_fused_small_experts_takes_the_dense_plan_without_the_cost_model(monkeypatch):
    """Where the fused mixing itself skips the unkept experts' work (inference), plan "auto" is the dense plan and
    the cost model and its timings are not consulted; with gradients (the op keeps every slot) they are. Here the
    cost model would always answer the selected plan (a margin of 1e9), whose grouped products
    (softmoe::native_grouped_mm on the "cpu" backend) show where it was followed."""
    monkeypatch.setitem(TABLE, "plan_margin", Measured({"cpu": 1e9, "cuda": 1e9}, "a test"))
    torch.manual_seed(5)
    layer = SoftMoE(20, 8, expert_hidden=6, activation="relu").eval()
    x = torch.randn(40, 4, 20)
    with select_experts(layer, k=3):
        with torch.no_grad():
            assert cpu_backend.skips_unkept(layer, x)
            with softmoe_ops() as inference:
                layer(x)
        assert inference["soft_moe_mixing_inference"] and not inference["native_grouped_mm"]  # the dense plan
        assert not cpu_backend.skips_unkept(layer, x)  # grad mode, parameters that require grad
        with softmoe_ops() as training:
            layer(x)
    assert training["native_grouped_mm"]  # the cost model's selected plan
    layer.experts.requires_grad_(False)  # frozen experts, a router that learns: the mixing records a gradient
    dispatch = layer.route(x).dispatch.flatten(2)
    assert dispatch.requires_grad and not cpu_backend.skips_unkept(layer, x, dispatch)
    assert cpu_backend.skips_unkept(layer, x)


def test_the_fused_path_takes_parametrized_expert_weights():
    """An expert weight under torch.nn.utils.parametrize (no longer a registered parameter) still serves the
    fused path's checks and Algorithm 1 equals the masked forward."""
    torch.manual_seed(6)
    layer = SoftMoE(20, 8, expert_hidden=6, activation="relu", expert_bias=False).eval()
    torch.nn.utils.parametrize.register_parametrization(layer.experts, "weight1", torch.nn.Identity())
    x = torch.randn(30, 4, 20)
    with torch.no_grad():
        assert cpu_backend.skips_unkept(layer, x)
        selected = top_k_by_combine(layer.route(x).combine.double(), 2)
        want = masked_reference_forward(layer, x, selected)
        with select_experts(layer, k=2):
            torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)


def test_gradients_flow_through_the_layers_choice():
    """Training through Algorithm 1 on the CPU (the op's autograd): the same gradients as the selector's path."""
    torch.manual_seed(4)
    layer = SoftMoE(12, 6, expert_hidden=20)
    x = torch.randn(3, 5, 12, requires_grad=True)

    def gradients():
        with select_experts(layer, k=3):
            selector = watch_selector(layer)
            with softmoe_ops() as ops:
                out = layer(x)
        return torch.autograd.grad(out.square().sum(), (x, layer.phi, layer.experts.weight1)), selector, ops

    through_op, selector, ops = gradients()
    assert selector.calls == 0 and len(ops["top_k_combine"]) == 1  # the layer's own choice, by the op
    layer.backend = "slots"  # torch's ops: the selector chooses
    through_selector, selector, _ = gradients()
    assert selector.calls == 1
    for got, want in zip(through_op, through_selector, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_the_selector_chooses_as_the_layer_on_float32_cpu_tensors():
    """top_k_by_combine sums in float64 as the op does, so a selector's select() and the layer agree even where
    float32 sums would tie: here the experts' sums are 1 and 1 + 2^-24."""
    combine = torch.tensor([[[1.0, 1.0], [0.0, 2.0**-24]]])
    assert combine.sum(dim=1).tolist() == [[1.0, 1.0]]  # tied in float32
    assert top_k_combine(combine, 1, 1)[1].tolist() == [[1]]
    assert top_k_by_combine(combine.unsqueeze(-1), 1).tolist() == [[1]]
    assert top_k_by_combine(combine.double().unsqueeze(-1), 1).tolist() == [[1]]


@pytest.mark.parametrize("case", ["mask", "noise", "float64"])
def test_masks_noise_and_float64_choose_through_the_selector(case):
    """The selector chooses, once, in torch's ops (top_k_by_combine); the layer runs neither op besides."""
    torch.manual_seed(5)
    dtype = torch.float64 if case == "float64" else torch.float32
    layer = SoftMoE(12, 6, expert_hidden=20, noise_std=0.5 if case == "noise" else 0.0, dtype=dtype)
    layer.train(case == "noise")
    x = torch.randn(3, 5, 12, dtype=dtype)
    mask = torch.ones(3, 5, dtype=torch.bool) if case == "mask" else None
    with torch.no_grad(), select_experts(layer, k=2):
        selector = watch_selector(layer)
        with softmoe_ops() as ops:
            layer(x, mask)
    assert selector.calls == 1
    assert not ops["top_k_combine"] and not ops["soft_moe_routing_top_k"]


def test_the_layers_choice_compiles_with_the_op_in_its_graph():
    torch.manual_seed(6)
    layer = SoftMoE(12, 6, expert_hidden=20).eval()
    x = torch.randn(3, 5, 12)

    def run(x):
        with select_experts(layer, k=2, plan="dense"):
            return layer(x)

    targets = []

    def backend(graph_module, example_inputs):
        targets.extend(str(node.target) for node in graph_module.graph.nodes)
        return graph_module.forward

    with torch.no_grad():
        eager = run(x)
        compiled = torch.compile(run, fullgraph=True, backend=backend)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    # the algorithm eager inference runs: the choice in the routing's pass
    assert any("soft_moe_routing_top_k" in target for target in targets)
