"""softmoe::selected_mixing: Algorithm 1's selected plan for inference in one native call (CPU)."""

from __future__ import annotations

import pytest
import torch

import softmoe
from softmoe import selection_plan
from softmoe.activations import ACTIVATIONS
from softmoe.kernels import native_available
from softmoe.selection import masked_reference_forward
from softmoe.tuning import TABLE, Measured

pytestmark = pytest.mark.skipif(not native_available(), reason="softmoe's native kernels are not built here")
OPS = torch.ops.softmoe
F64 = torch.float64


def reference(x, dispatch, combine, selected, w1, b1, w2, b2, p, activation):
    """The plan written out in float64, input by input and place by place."""
    x, dispatch, combine, w1, w2 = (t.double() for t in (x, dispatch, combine, w1, w2))
    out = torch.zeros(x.shape[0], x.shape[1], w2.shape[2], dtype=F64)
    for b in range(x.shape[0]):
        for e in selected[b].tolist():
            if e < 0:
                continue
            kept = slice(e * p, (e + 1) * p)
            hidden = dispatch[b, :, kept].T @ x[b] @ w1[e] + (0 if b1 is None else b1[e].double())
            y = ACTIVATIONS[activation](hidden) @ w2[e] + (0 if b2 is None else b2[e].double())
            out[b] += combine[b, :, kept] @ y
    return out


def inputs(batch, tokens, dim, n, p, hidden, out_dim, selected, bias, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(batch, tokens, dim)
    dispatch, combine = torch.rand(batch, tokens, n * p), torch.rand(batch, tokens, n * p)
    w1, w2 = torch.randn(n, dim, hidden) / dim**0.5, torch.randn(n, hidden, out_dim) / hidden**0.5
    b1, b2 = (torch.randn(n, hidden), torch.randn(n, out_dim)) if bias else (None, None)
    return x, dispatch, combine, torch.tensor(selected), w1, b1, w2, b2


# (batch, tokens, dim, experts, slots per expert, hidden, out_dim, selected): one input; experts kept by several
# inputs, in any order, with unused places (-1); several slots per expert; vector tails in every size.
CASES = [
    (1, 5, 16, 4, 1, 40, 16, [[2, 0]]),
    (3, 7, 20, 5, 2, 33, 47, [[1, 4, -1], [4, 1, 0], [-1, -1, 3]]),
    (2, 4, 24, 3, 3, 17, 9, [[0, 1, 2], [2, -1, 0]]),
    (2, 3, 8, 6, 1, 65, 8, [[-1], [-1]]),
]


@pytest.mark.parametrize("case", CASES, ids=["one-input", "shared-experts", "three-slots", "none-kept"])
@pytest.mark.parametrize("activation", ["gelu", "relu", "gelu_tanh"])
@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_equals_the_plan_in_float64(isa, case, activation, threads):
    batch, tokens, dim, n, p, hidden, out_dim, selected = case
    for bias in (True, False):
        args = inputs(batch, tokens, dim, n, p, hidden, out_dim, selected, bias)
        got = OPS.selected_mixing(*args, p, activation, isa)
        want = reference(*args, p, activation)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got.double() - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())


def test_empty_batches_and_tokens_and_strided_inputs(isa):
    """No input, no token: zeros of the right shape; inputs through strides give the contiguous inputs' result."""
    x, dispatch, combine, selected, *weights = inputs(2, 3, 8, 4, 1, 16, 8, [[0, 3], [2, 0]], True)
    for batch, tokens in ((0, 3), (2, 0)):
        args = (x[:batch, :tokens], dispatch[:batch, :tokens], combine[:batch, :tokens], selected[:batch])
        out = OPS.selected_mixing(*args, *weights, 1, "relu", isa)
        assert out.shape == (batch, tokens, 8) and not out.any()
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, dispatch, combine)]
    assert not any(t.is_contiguous() for t in strided)
    torch.testing.assert_close(
        OPS.selected_mixing(*strided, selected, *weights, 1, "relu", isa),
        OPS.selected_mixing(x, dispatch, combine, selected, *weights, 1, "relu", isa),
        rtol=0,
        atol=0,
    )


def test_rejects_bad_selections():
    args = inputs(2, 3, 8, 4, 1, 16, 8, [[0, 4], [1, 2]], True)
    with pytest.raises(RuntimeError, match=r"selected experts must lie in \[-1, 4\), got 4"):
        OPS.selected_mixing(*args, 1, "gelu", softmoe.kernels.cpu_isa())
    x, dispatch, combine, selected, *weights = inputs(2, 3, 8, 4, 1, 16, 8, [[0, 1], [1, 2]], True)
    with pytest.raises(RuntimeError, match="selected must be an int64 CPU tensor"):
        OPS.selected_mixing(x, dispatch, combine, selected.int(), *weights, 1, "gelu", softmoe.kernels.cpu_isa())
    with pytest.raises(ValueError, match="activation must be one of"):
        OPS.selected_mixing(x, dispatch, combine, selected, *weights, 1, "tanh", softmoe.kernels.cpu_isa())


def test_opcheck(isa):
    args = inputs(3, 7, 20, 5, 2, 33, 47, CASES[1][-1], True)
    torch.library.opcheck(OPS.selected_mixing.default, (*args, 2, "gelu", isa))


@pytest.fixture
def every_weight_large(monkeypatch):
    """Every expert weight counts as large enough for the native expert matmul (softmoe.tuning.TABLE)."""
    monkeypatch.setitem(TABLE, "large_weight", Measured(1, "a test"))
    monkeypatch.setitem(TABLE, "native_min_weight", Measured(1, "a test"))


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("strategy", ["combine", "mass"])
def test_the_layer_takes_it_in_inference(every_weight_large, renormalize, strategy):
    """Under select_experts (plan "selected"), a float32 CPU layer in inference runs the selected plan in this op
    where the expert matmul serves its products (one input here: one row per expert), unused places included
    ("mass" keeps a different number of experts per input), and equals the paper's masked forward in float64."""
    torch.manual_seed(4)
    layer = softmoe.SoftMoE(12, 6, expert_hidden=20).eval()
    x = torch.randn(1, 5, 12)
    kwargs = {"tau": 0.5, "k_max": 4} if strategy == "mass" else {"k": 2}
    with torch.no_grad(), softmoe.select_experts(layer, strategy=strategy, renormalize=renormalize, plan="selected",
                                                 **kwargs):
        chosen = layer.selector.select(layer.route(x).combine)
        assert "softmoe::selected_mixing" in ops_called(lambda: layer(x))
        out = layer(x)
    assert (chosen < 0).any() == (strategy == "mass")  # "mass" leaves places unused here
    want = masked_reference_forward(layer.double(), x.double(), chosen, renormalize=renormalize)
    assert (out.double() - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("expert_bias", [True, False])
@pytest.mark.parametrize("hidden, out_dim", [(12, 16), (20, 8)])
def test_the_layer_takes_it_for_a_batch(every_weight_large, expert_bias, hidden, out_dim):
    """A batch of inputs keeping shared experts, 2 slots per expert, experts that widen (dim 8 -> 12 -> 16) or whose
    down-projection is taller than wide (8 -> 20 -> 8, its rows split by columns): the kernel serves every expert's
    rows, and the layer equals the paper's masked forward in float64; a masked input and normalized inputs change
    nothing of that."""
    torch.manual_seed(7)
    layer = softmoe.SoftMoE(
        8, 6, 2, expert_hidden=hidden, out_dim=out_dim, expert_bias=expert_bias, normalize="inputs"
    ).eval()
    x, mask = torch.randn(5, 4, 8), torch.ones(5, 4, dtype=torch.bool)
    mask[1, 2:] = False
    with torch.no_grad(), softmoe.select_experts(layer, k=3, plan="selected"):
        chosen = layer.selector.select(layer.route(x, mask).combine)
        assert "softmoe::selected_mixing" in ops_called(lambda: layer(x, mask))
        out = layer(x, mask)
    assert out.shape == (5, 4, out_dim) and len(set(chosen.flatten().tolist())) < chosen.numel()
    want = masked_reference_forward(layer.double(), x.double(), chosen, mask)
    assert (out.double() - want).abs().max().item() < 1e-5


def test_plan_auto_takes_it_wherever_it_serves(every_weight_large):
    """Plan "auto" runs the selected plan in one call wherever the op serves (it does a part of the dense plan's
    work and nothing more), here 5 of 6 experts at batch 3, where the cost model would take the dense plan (each
    expert in use costs the plan's bookkeeping in torch's ops); with a gradient it is the cost model's again."""
    torch.manual_seed(8)
    layer = softmoe.SoftMoE(12, 6, expert_hidden=20).eval()
    x = torch.randn(3, 5, 12)
    with softmoe.select_experts(layer, k=5):
        chosen = layer.selector.select(layer.route(x).combine)
        assert not selection_plan.selected_plan_is_cheaper(
            selection_plan.plan_costs(3, 5, 6, 1, selection_plan.flops_per_row(layer.experts), x.device),
            x.device,
        )
        with torch.no_grad():
            assert selection_plan.auto_plan(layer, x, chosen) == "selected"
            assert "softmoe::selected_mixing" in ops_called(lambda: layer(x))
            out = layer(x)
        assert selection_plan.auto_plan(layer, x, chosen) == "dense"
    want = masked_reference_forward(layer.double(), x.double(), chosen)
    assert (out.double() - want).abs().max().item() < 1e-5


def test_not_taken_where_a_gradient_is_needed_or_the_kernel_would_not_serve(every_weight_large, monkeypatch):
    """A gradient takes the differentiable plan; so do more rows per expert than the expert matmul takes (batch x
    slots per expert above softmoe.tuning.TABLE's "native_forward_max_rows")."""
    torch.manual_seed(5)
    layer = softmoe.SoftMoE(12, 6, expert_hidden=20).eval()
    monkeypatch.setitem(TABLE, "native_forward_max_rows", Measured(2, "a test"))
    with softmoe.select_experts(layer, k=2, plan="selected"):
        x = torch.randn(1, 5, 12)
        assert "softmoe::selected_mixing" not in ops_called(lambda: layer(x).sum().backward())
        with torch.no_grad():
            assert "softmoe::selected_mixing" in ops_called(lambda: layer(torch.randn(2, 5, 12)))
            assert "softmoe::selected_mixing" not in ops_called(lambda: layer(torch.randn(3, 5, 12)))


def test_compiled_with_fullgraph_once_for_every_selection(every_weight_large):
    """Under torch.compile (fullgraph) the layer keeps the op in its graph: 20 inputs of one input each, each with its
    own choice of experts, take one compilation and give eager's outputs."""
    torch.manual_seed(6)
    layer = softmoe.SoftMoE(12, 6, expert_hidden=20).eval()
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    chosen = set()
    with torch.no_grad(), softmoe.select_experts(layer, k=2, plan="selected"):
        for _ in range(20):
            x = torch.randn(1, 5, 12)
            chosen.add(tuple(layer.selector.select(layer.route(x).combine).flatten().tolist()))
            torch.testing.assert_close(compiled(x), layer(x))
    assert len(graphs) == 1 and len(chosen) > 1
    ops = {str(node.target) for node in graphs[0].graph.nodes}
    assert "softmoe.selected_mixing.default" in ops, sorted(ops)
