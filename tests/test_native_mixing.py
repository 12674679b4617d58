"""softmoe.kernels.soft_moe_mixing (softmoe::soft_moe_mixing, csrc/soft_moe_small.h): the whole Soft MoE mixing of
small relu experts in one native pass, every kernel variant the CPU runs against a float64 reference written slot by
slot, and where the layer takes it."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import softmoe.backends.cpu as cpu_backend
import softmoe.kernels as kernels
from grids import pairwise
from reference import kernels_called, output_and_gradients, ref_activation, relative_error
from softmoe import SoftMoE
from softmoe.kernels import MIXING_MAX_TOKENS, cpu_isa, native_mixing_applies, soft_moe_mixing
from softmoe.kernels.build import ISAS, LANES
from softmoe.kernels.soft_moe_mixing import LAYOUTS, layout_costs
from softmoe.tuning import TABLE, Measured, value



def mixing_reference(x, dispatch, combine, w1, b1, w2, b2):
    """C relu-MLP(D^T X) one slot at a time: x (B, M, D), dispatch / combine (B, M, S) -> (B, M, D)."""
    slots, experts = dispatch.shape[2], w1.shape[0]
    out = torch.zeros_like(x)
    for s in range(slots):
        j = s // (slots // experts)
        slot = torch.einsum("bt,btd->bd", dispatch[:, :, s], x)
        hidden = slot @ w1[j] + (0 if b1 is None else b1[j])
        y = ref_activation("relu", hidden) @ w2[j] + (0 if b2 is None else b2[j])
        out = out + combine[:, :, s, None] * y[:, None, :]
    return out


def random_inputs(batch, tokens, dim, experts, slots_per_expert, hidden, bias, seed=0):
    """float32 leaves (x, dispatch, combine, w1, b1, w2, b2) with routing weights that are softmaxes, as in a layer."""
    gen = torch.Generator().manual_seed(seed)
    slots = experts * slots_per_expert
    x = torch.randn(batch, tokens, dim, generator=gen)
    logits = torch.randn(batch, tokens, slots, generator=gen)
    w1 = torch.randn(experts, dim, hidden, generator=gen) / dim**0.5
    w2 = torch.randn(experts, hidden, dim, generator=gen) / hidden**0.5
    b1 = torch.randn(experts, hidden, generator=gen) if bias else None
    b2 = torch.randn(experts, dim, generator=gen) if bias else None
    tensors = (x, logits.softmax(1), logits.softmax(2), w1, b1, w2, b2)
    return [None if t is None else t.requires_grad_() for t in tensors]


# (batch, tokens, dim, experts, slots per expert, hidden): partial last group of inputs for every lane count (37 =
# 2 x 16 + 5 = 4 x 8 + 5 = 9 x 4 + 1), fewer inputs than vector lanes, five groups (two group blocks), one token,
# the most tokens, hidden sizes that are one block of 8 units, blocks plus a tail, several slots per expert, and full
# groups with more slots than a routing chunk (64) in runs of 16 (transposed in registers) and a tail, and the
# largest hidden size served, with full blocks of groups (64 inputs) and a dim with a tail chunk; weight gradients
# as outer products (hidden >= 16; with AVX2 from 12, where AVX-512 still sums lanes) with a partial tile of units
# (17), dim chunks of every width plus a tail (70),
# a second block of one partial group (83 inputs); slots two at a time (4 tokens, hidden <= 6, AVX-512) with an odd
# number of slots (the last one alone), and pairs within one expert and across two (3 slots per expert); two groups
# side by side in the backward pass (AVX2, from 20 hidden units) with 3 tokens and whole blocks of 6 units, a block of
# groups in two pairs and one of a group alone (37 inputs: 5 groups of 8), and at 20 units with a partial last
# group (27).
SHAPES = [
    (37, 4, 20, 6, 1, 2),
    (64, 4, 21, 2, 1, value("mixing_max_weight_bytes_per_lane") * 16 // (8 * 21)),
    (16, 4, 33, 5, 2, 8),
    (5, 3, 7, 3, 3, 9),
    (70, MIXING_MAX_TOKENS, 12, 2, 1, 6),
    (9, 1, 5, 4, 1, 1),
    (40, 5, 16, 7, 1, 19),
    (48, 4, 10, 45, 2, 3),
    (83, 4, 70, 3, 1, 17),
    (33, 4, 19, 7, 1, 5),
    (20, 4, 24, 3, 3, 4),
    (1, 4, 20, 9, 1, 7),  # fewer inputs than threads: the pairs split across them
    (2, 4, 13, 6, 2, 5),
    (45, 4, 26, 3, 1, 12),
    (37, 3, 18, 3, 1, 24),
    (27, 4, 15, 2, 2, 20),
]


@pytest.mark.parametrize(
    "shape, bias, threads, row_isa, keep_outputs",
    pairwise(shape=SHAPES, bias=[True, False], threads=[1, 2, 3], row_isa=ISAS, keep_outputs=[True, False]),
    indirect=["threads", "row_isa"],
)
def test_mixing_and_all_gradients_match_float64(shape, bias, threads, row_isa, keep_outputs):
    """The op forward and backward, the slots' outputs kept for the backward or computed again."""
    assert_matches_float64(shape, bias, keep_outputs)


def assert_matches_float64(shape, bias, keep_outputs=None):
    """The mixing and every gradient against float64 autograd of the reference: through the entry point, or with
    ``keep_outputs`` through the op itself (the records it keeps for the backward chosen)."""
    inputs = random_inputs(*shape, bias=bias, seed=sum(shape))
    if keep_outputs is None:
        out = soft_moe_mixing(*inputs)
    else:
        out = torch.ops.softmoe.soft_moe_mixing(*inputs, keep_outputs, kernels.cpu_isa())[0]
    grad = torch.randn_like(out)
    out.backward(grad)
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    want = mixing_reference(*leaves)
    want.backward(grad.double())
    assert relative_error(out, want) < 1e-5
    for got, ref in zip(inputs, leaves):
        if got is not None:
            assert relative_error(got.grad, ref.grad) < 1e-5


@pytest.mark.parametrize("threads", [2, 3], indirect=True)
def test_the_threads_scratch_serves_larger_and_smaller_calls_in_turn(isa, threads):
    """Each thread keeps its scratch memory from call to call (csrc/bindings.cpp, softmoe_scratch), the partial sums
    of the input gradient included: calls that need more of it, then less, then more again, each exact."""
    small, large = (20, 4, 8, 3, 1, 4), (83, 4, 70, 6, 1, 17)
    for shape in (small, large, small, large):
        assert_matches_float64(shape, bias=True)


def kept_combine_inputs(shape, seed):
    """Inputs without gradients whose combine weights are zero outside a random subset of experts per input, as
    Algorithm 1's dense plan leaves them (some inputs keep none)."""
    x, dispatch, combine, w1, b1, w2, b2 = (t.detach() for t in random_inputs(*shape, bias=True, seed=seed))
    batch, experts, p = shape[0], shape[3], shape[4]
    keep = torch.rand(batch, experts, generator=torch.Generator().manual_seed(seed)) < 0.4
    combine = torch.where(keep.repeat_interleave(p, dim=1)[:, None, :], combine, 0.0)
    return x, dispatch, combine, w1, b1, w2, b2


def inference_mixing(inputs, layout, kept_combine, kept_slots=None):
    """softmoe::soft_moe_mixing_inference with the work laid out as ``layout`` says (a key of LAYOUTS): with
    ``kept_combine`` the kept slots found from the nonzero combine weights or given as bits, else every slot."""
    isa = kernels.cpu_isa()
    return torch.ops.softmoe.soft_moe_mixing_inference(*inputs, kept_combine, kept_slots, LAYOUTS[layout],
                                                       layout_costs(isa), isa)


def kept_mixing(inputs, layout, kept_slots=None):
    return inference_mixing(inputs, layout, True, kept_slots)


def slot_words(kept: torch.Tensor) -> torch.Tensor:
    """bool (batch, slots) -> the kept slots as bits, (batch, ceil(slots / 64)) int64, bit s % 64 of word s // 64."""
    batch, slots = kept.shape
    padded = torch.zeros(batch, (slots + 63) // 64 * 64, dtype=torch.int64)
    padded[:, :slots] = kept.long()
    return (padded.view(batch, -1, 64) << torch.arange(64)).sum(-1)  # distinct bits: the sum is their OR


@pytest.mark.parametrize(
    "shape, layout, threads, row_isa",
    pairwise(shape=SHAPES, layout=["as they come", *LAYOUTS], threads=[1, 2, 3], row_isa=ISAS),
    indirect=["threads", "row_isa"],
)
def test_inference_skips_idle_slots_and_matches_float64(shape, layout, threads, row_isa):
    """In inference, with a kept combine the work is laid out as groups of inputs
    that keep the same slots (the slots whose combine weights are zero for a whole group skipped), as the rows of
    each expert (its inputs up to 8 at a time, vectors along hidden and dim: partial blocks of rows and of vectors,
    hidden and dim below, at and above one vector) or as each input's kept experts one at a time, as the op finds
    cheaper or as forced: the output is exact in every layout, and the same with the kept slots given
    as bits."""
    inputs = kept_combine_inputs(shape, seed=sum(shape))
    with torch.no_grad():
        out = soft_moe_mixing(*inputs) if layout == "as they come" else kept_mixing(inputs, layout)
    assert relative_error(out, mixing_reference(*(t.double() for t in inputs))) < 1e-5
    if layout != "as they come":
        words = slot_words(inputs[2].ne(0).any(dim=1))
        assert torch.equal(kept_mixing(inputs, layout, words), out)
        with pytest.raises(RuntimeError, match=r"kept_slots must have shape \[\d+, \d+\], got \[\d+, \d+\]"):
            kept_mixing(inputs, layout, torch.cat([words, words], dim=1))


# Layout costs (softmoe.tuning.TABLE's "mixing_layout_costs" order) under which each layout is the cheapest by far:
# groups of inputs with free moves and dear pairs and rows, pairs with free slots, rows with free blocks and rows.
DEAR = 1e30
CHEAPEST = {
    "by inputs": (0.0, 0.0, DEAR, DEAR, DEAR, DEAR, DEAR, DEAR),
    "by pairs": (DEAR, 0.0, 0.0, 0.0, DEAR, DEAR, DEAR, DEAR),
    "by rows": (DEAR, 0.0, DEAR, DEAR, 0.0, 0.0, 0.0, 0.0),
}


@pytest.mark.parametrize("layout", list(CHEAPEST))
def test_the_layout_follows_the_tables_costs(layout, monkeypatch):
    """The mixing's inference takes the layout TABLE's "mixing_layout_costs" make cheapest: with each layout made
    the cheapest, the output equals that layout forced to the bit (the layouts differ in their last bits here). A
    list of costs of another length is refused by the op."""
    inputs = kept_combine_inputs((6, 4, 12, 16, 1, 24), seed=3)
    costs = {isa: CHEAPEST[layout] for isa in LANES}
    monkeypatch.setitem(TABLE, "mixing_layout_costs", Measured(costs, "a test"))
    with torch.no_grad():
        auto, forced = soft_moe_mixing(*inputs, kept_combine=True), kept_mixing(inputs, layout)
        others = [kept_mixing(inputs, other) for other in CHEAPEST if other != layout]
    assert torch.equal(auto, forced) and not any(torch.equal(auto, other) for other in others)
    isa = cpu_isa()
    with pytest.raises(RuntimeError, match="layout_costs must hold 8 costs, got 2"):
        torch.ops.softmoe.soft_moe_mixing_inference(*inputs, True, None, LAYOUTS["auto"], [1.0, 2.0], isa)


@pytest.mark.parametrize(
    "shape, layout, threads, row_isa",
    pairwise(shape=SHAPES, layout=list(LAYOUTS), threads=[1, 2, 3], row_isa=ISAS),
    indirect=["threads", "row_isa"],
)
def test_inference_lays_out_every_slot_and_matches_float64(shape, layout, threads, row_isa):
    """Inference without Algorithm 1 lays the work out as for a kept combine with every slot kept (groups of lanes,
    the rows of each expert or each input's experts one at a time) where some thread would have no full group of
    lanes, as the op finds cheaper or as forced, and skips nothing: exact in every layout."""
    inputs = tuple(t.detach() for t in random_inputs(*shape, bias=True, seed=sum(shape)))
    with torch.no_grad():
        out = inference_mixing(inputs, layout, False)
    assert relative_error(out, mixing_reference(*(t.double() for t in inputs))) < 1e-5


def test_inference_runs_no_expert_that_a_group_of_inputs_does_not_keep(isa):
    """An expert with a NaN bias, kept by every third input: run for a group, it makes every output of the group NaN
    (its outputs enter the combine at weight 0). With kept_combine (48 inputs: two full groups of those that do not
    keep it at every lane count; or the rows of each expert, or each input's experts) the others' outputs stay finite
    and exact; without it (nothing skipped) they do not, nor with gradients (the op: every slot runs, its records are
    kept)."""
    x, dispatch, combine, w1, b1, w2, b2 = (t.detach() for t in random_inputs(48, 4, 8, 4, 1, 3, bias=True))
    b2[3] = math.nan
    users = torch.arange(48) % 3 == 2
    combine[:, :, 3] = torch.where(users[:, None], combine[:, :, 3], 0.0)
    inputs = (x, dispatch, combine, w1, b1, w2, b2)
    with torch.no_grad():
        grouped = soft_moe_mixing(*inputs, kept_combine=True)
        by_layout = [kept_mixing(inputs, layout) for layout in ("by inputs", "by rows", "by pairs")]
        as_they_come = soft_moe_mixing(*inputs)
    others = ~users
    rows = [t[others].double() for t in (x, dispatch, combine)]
    want = mixing_reference(*rows, w1.double(), b1.double(), w2.double(), b2.nan_to_num().double())
    for out in (grouped, *by_layout):
        assert out[users].isnan().all() and out[others].isfinite().all()
        assert relative_error(out[others], want) < 1e-5
    assert as_they_come[others].isnan().all()
    few = tuple(t[:3] for t in inputs[:3]) + inputs[3:]  # every slot laid out below a group of lanes per thread
    for layout in LAYOUTS:  # and run in every layout: NaN times a zero weight reaches every input, as in torch
        every = inference_mixing(few, layout, False)
        assert every.isnan().all(), layout
    assert soft_moe_mixing(x.requires_grad_(), *inputs[1:], kept_combine=True).isnan().all()


@pytest.mark.parametrize("threads", [1], indirect=True)
def test_groups_run_side_by_side_only_where_both_keep_the_slot(isa, threads):
    """The forward pass runs two groups of lanes side by side with AVX2 (each weight broadcast once for both). 16
    inputs, the first 8 keeping an expert with a NaN bias: with 8 lanes (and 4) they fill whole groups, and the other
    group beside them, which keeps nothing of that expert, must not run it: its outputs stay finite and exact. With
    16 lanes the users share their one group with the others, whose outputs it makes NaN (a slot runs for a whole
    group)."""
    x, dispatch, combine, w1, b1, w2, b2 = (t.detach() for t in random_inputs(16, 4, 8, 4, 1, 3, bias=True))
    b2[3] = math.nan
    users = torch.arange(16) < 8
    combine[:, :, 3] = torch.where(users[:, None], combine[:, :, 3], 0.0)
    inputs = (x, dispatch, combine, w1, b1, w2, b2)
    with torch.no_grad():
        out = kept_mixing(inputs, "by inputs")
    assert out[users].isnan().all()
    if 8 % LANES[isa]:
        assert out[~users].isnan().all()
    else:
        rows = [t[~users].double() for t in (x, dispatch, combine)]
        want = mixing_reference(*rows, w1.double(), b1.double(), w2.double(), b2.nan_to_num().double())
        assert relative_error(out[~users], want) < 1e-5


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:`torch.jit:DeprecationWarning")
def test_a_trace_computes_on_the_inputs_it_is_given(library):
    """torch.jit.trace records the ops: a layer traced under no_grad computes on new inputs, not on the traced ones."""
    x = torch.randn(3, 4, 24)
    layer = SoftMoE(24, 8, expert_hidden=5, activation="relu").eval()
    with torch.no_grad():
        traced = torch.jit.trace(layer, x, check_trace=False)
        other = torch.randn(3, 4, 24)
        torch.testing.assert_close(traced(other), layer(other))


class OpRecorder(TorchDispatchMode):
    """A dispatch mode that lets every op through and records its name."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_the_profiler_and_dispatch_modes_see_the_ops_in_inference(library):
    """The layer's inference calls are the ops, which the profiler and a TorchDispatchMode see."""
    layer = SoftMoE(24, 8, expert_hidden=5, activation="relu").eval()
    x = torch.randn(3, 4, 24)
    with torch.no_grad():
        assert {"softmoe::soft_moe_routing", "softmoe::soft_moe_mixing_inference"} <= kernels_called(lambda: layer(x))
        with OpRecorder() as recorder:
            layer(x)
    assert {"softmoe.soft_moe_routing", "softmoe.soft_moe_mixing_inference"} <= recorder.ops


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_eager_training_runs_the_ops_forward_and_backward(library, threads):
    """In eager training the routing and the mixing are the ops, differentiated by their C++ autograd with their
    backward ops: a dispatch mode sees all four, its outputs and gradients equal, bit for bit, those of a plain
    call, and a profiler started after the forward still sees the backward ops."""
    torch.manual_seed(8)
    layer = SoftMoE(24, 8, expert_hidden=70, activation="relu")  # 70 hidden units: the outputs are kept too
    x, grad = torch.randn(21, 4, 24), torch.randn(21, 4, 24)
    plain = output_and_gradients(layer, x, grad)
    with OpRecorder() as recorder:
        watched = output_and_gradients(layer, x, grad)
    ops = {f"softmoe.soft_moe_{op}{part}" for op in ("routing", "mixing") for part in ("", "_backward")}
    assert ops <= recorder.ops
    for got, want in zip(plain, watched, strict=True):
        assert torch.equal(got, want)
    out = layer(x)
    assert {"softmoe::soft_moe_routing_backward", "softmoe::soft_moe_mixing_backward"} <= kernels_called(
        lambda: out.backward(grad))


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_and_retained_graphs_through_the_ops(library, reentrant):
    """torch.utils.checkpoint (both implementations: saved-tensor hooks, and a re-run forward under enable_grad)
    and a graph backpropagated twice with retain_graph give the gradients of one plain backward pass, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(9)
    layer = SoftMoE(24, 8, expert_hidden=70, activation="relu")
    x, grad = torch.randn(10, 4, 24), torch.randn(10, 4, 24)
    want = output_and_gradients(layer, x, grad)
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out = checkpoint(layer, leaf, use_reentrant=reentrant)
    out.backward(grad)
    assert torch.equal(out.detach(), want[0]) and torch.equal(leaf.grad, want[1])
    for p, w in zip(layer.parameters(), want[2:], strict=True):
        assert torch.equal(p.grad, w)
    layer.zero_grad(set_to_none=True)
    leaf = x.clone().requires_grad_()
    out = layer(leaf)
    out.backward(grad, retain_graph=True)
    out.backward(grad)
    assert torch.equal(leaf.grad, 2 * want[1])


def test_empty_batch(isa):
    x, dispatch, combine, w1, b1, w2, b2 = random_inputs(0, 4, 8, 3, 1, 2, bias=True)
    out = soft_moe_mixing(x, dispatch, combine, w1, b1, w2, b2)
    assert out.shape == (0, 4, 8)
    out.sum().backward()
    for weight in (w1, b1, w2, b2):
        assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_too_many_tokens_is_refused(library):
    inputs = random_inputs(3, MIXING_MAX_TOKENS + 1, 8, 2, 1, 2, bias=True)
    with pytest.raises(ValueError, match=f"1..{MIXING_MAX_TOKENS} tokens, got {MIXING_MAX_TOKENS + 1}"):
        soft_moe_mixing(*inputs)
    with pytest.raises(RuntimeError, match=f"1..{MIXING_MAX_TOKENS} tokens, got {MIXING_MAX_TOKENS + 1}"):
        torch.ops.softmoe.soft_moe_mixing(*inputs, False, kernels.cpu_isa())  # the op checks too


def count_mixing_calls(monkeypatch) -> list[tuple[int, ...]]:
    calls = []

    def counted(x, *rest, **options):
        calls.append(tuple(x.shape))
        return soft_moe_mixing(x, *rest, **options)

    monkeypatch.setattr(cpu_backend, "soft_moe_mixing", counted)
    return calls


def test_layer_takes_the_fused_pass_and_matches_float64_with_a_mask(library, monkeypatch):
    torch.manual_seed(5)
    layer = SoftMoE(24, 12, slots_per_expert=2, expert_hidden=5, activation="relu")
    x = torch.randn(19, 4, 24)
    mask = torch.ones(19, 4, dtype=torch.bool)
    mask[3, 2:] = False
    mask[7] = False  # a fully padded input
    grad = torch.randn(19, 4, 24)
    calls = count_mixing_calls(monkeypatch)
    assert layer.backend_for(x).name == "cpu"  # "auto" takes the fused pass
    got = output_and_gradients(layer, x, grad, mask)
    assert calls == [(19, 4, 24)]
    want = output_and_gradients(layer.double(), x.double(), grad.double(), mask)  # float64: torch's ops
    assert len(calls) == 1
    for got_t, want_t in zip(got, want):
        assert relative_error(got_t, want_t) < 1e-5
    out = got[0]
    assert torch.equal(out[3, 2:], torch.zeros(2, 24)) and torch.equal(out[7], torch.zeros(4, 24))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_the_layer_adds_the_input_gradients_in_place(library, threads):
    """The input gradient from the fused backward is a tensor of its own, so autograd adds the routing's share to
    it in place: no out-of-place add of two input-sized tensors (a view of the per-thread partial sums got one)."""
    layer = SoftMoE(40, 16, expert_hidden=6, activation="relu", backend="cpu")
    x = torch.randn(24, 4, 40, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x).sum().backward()
    sums = {e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")
            and [list(s) for s in e.input_shapes[:2]] == [[24, 4, 40]] * 2}
    assert sums == {"aten::add_"}


def test_layer_is_the_same_with_and_without_the_fused_pass(library, monkeypatch):
    torch.manual_seed(6)
    layer = SoftMoE(196, 64, expert_hidden=12, activation="relu", backend="cpu")  # the paper's MNIST layer
    x, grad = torch.randn(32, 4, 196), torch.randn(32, 4, 196)
    calls = count_mixing_calls(monkeypatch)
    fused = output_and_gradients(layer, x, grad)
    layer.backend = "reference"
    plain = output_and_gradients(layer, x, grad)
    assert len(calls) == 1
    for got, want in zip(fused, plain):
        assert relative_error(got, want) < 1e-5


def test_the_fused_pass_applies_only_where_it_serves(library):
    x = torch.randn(2, 4, 8)
    largest = value("mixing_max_weight_bytes_per_lane") * LANES[cpu_isa()] // 64  # weights of 2 x 8 x hidden floats
    assert native_mixing_applies(x, largest, "relu")
    assert not native_mixing_applies(x, largest + 1, "relu")
    assert not native_mixing_applies(x, 4, "gelu")
    assert not native_mixing_applies(torch.randn(2, MIXING_MAX_TOKENS + 1, 8), 4, "relu")
    assert not native_mixing_applies(x.double(), 4, "relu")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a custom op: autocast leaves its float32 inputs alone
        assert native_mixing_applies(x, 4, "relu")
    seen = []

    def inside(t):
        seen.append(native_mixing_applies(x, 4, "relu"))
        return t.sum()

    torch.func.grad(inside)(torch.ones(3))  # the ops have no vmap rule: torch.func transforms keep torch's ops
    assert seen == [False]


def test_the_weights_per_lane_decide_with_each_variant(isa):
    """At dim 196 experts of 1000 hidden units (1.5 MiB of weights) are fused with 16 lanes only, of 500 (766 KiB)
    with 8 or 16, of 250 (383 KiB) with every variant (112 KiB per lane)."""
    lanes = LANES[isa]
    for hidden, least_lanes in ((1000, 16), (500, 8), (250, 4)):
        assert native_mixing_applies(torch.randn(2, 4, 196), hidden, "relu") == (lanes >= least_lanes), hidden


def test_the_backward_writes_no_zeros_for_the_saved_pre_activations(library):
    """saved is an output without a gradient: autograd must not fill a zero gradient for it (800 KB per call at the
    paper's MNIST layer, n = 8) before the backward runs."""
    out = soft_moe_mixing(*random_inputs(33, 4, 12, 3, 1, 9, bias=True))
    called = kernels_called(lambda: out.backward(torch.randn_like(out)))
    assert "softmoe::soft_moe_mixing_backward" in called
    assert not {"aten::zeros", "aten::zero_", "aten::fill_"} & called


def test_native_off_means_torch(library, monkeypatch):
    monkeypatch.setenv("SOFTMOE_NATIVE", "0")
    kernels.build._reset()
    try:
        assert not native_mixing_applies(torch.randn(2, 4, 8), 4, "relu")
        assert kernels.native_status() == "SOFTMOE_NATIVE=0: the native kernels are turned off"
        assert kernels.cpu_isa() is None
        with pytest.raises(RuntimeError, match="unavailable: SOFTMOE_NATIVE=0"):
            soft_moe_mixing(*random_inputs(3, 2, 8, 2, 1, 2, bias=True))
    finally:
        kernels.build._reset()  # loaded again, with the environment restored, on the next use


def test_autocast_leaves_the_op_in_float32(library):
    inputs = random_inputs(9, 4, 8, 3, 1, 5, bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = soft_moe_mixing(*inputs)
    assert out.dtype == torch.float32
    leaves = [t.detach().double() for t in inputs]
    assert relative_error(out, mixing_reference(*leaves)) < 1e-5


def test_a_broadcast_upstream_gradient_is_read_while_alive(isa):
    """out.sum().backward() hands the backward an expanded (stride-0) gradient; its contiguous copy must live until
    the kernel has read it (a temporary freed early was reused by the kernel's scratch memory: NaN gradients)."""
    for seed in range(5):
        inputs = random_inputs(33, 2, 10, 2, 1, 4, bias=True, seed=seed)
        soft_moe_mixing(*inputs).sum().backward()
        leaves = [t.detach().double().requires_grad_() for t in inputs]
        mixing_reference(*leaves).sum().backward()
        for got, ref in zip(inputs, leaves):
            assert relative_error(got.grad, ref.grad) < 1e-5


def saved_shape_read_by_the_backward(inputs) -> tuple[int, ...]:
    """The shape of the saved record that soft_moe_mixing's forward left and its backward op read."""
    out = soft_moe_mixing(*inputs)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward(torch.randn_like(out))
    (shapes,) = {tuple(map(tuple, e.input_shapes)) for e in prof.events() if e.name == "softmoe::soft_moe_mixing_backward"}
    return shapes[7]


def test_the_outputs_are_kept_from_the_set_hidden_size_up(isa):
    """From TABLE["mixing_keep_outputs_min_hidden"] hidden units up the forward saves the slots' outputs (dim 12) after the
    pre-activations and the backward reads them; below, only the pre-activations."""
    least, lanes = value("mixing_keep_outputs_min_hidden"), LANES[isa]
    for hidden, width in ((least - 1, least - 1), (least, least + 12)):
        shape = saved_shape_read_by_the_backward(random_inputs(33, 4, 12, 3, 1, hidden, bias=True))
        assert shape == ((33 + lanes - 1) // lanes, 3, width, lanes), hidden


def test_no_records_are_kept_without_a_backward(library):
    """Under no_grad (inference) the mixing keeps no records for a backward: the inference op runs, watched or not,
    and gives what the training op gives."""
    inputs = [t.detach() for t in random_inputs(33, 4, 12, 3, 1, value("mixing_keep_outputs_min_hidden"),
                                                  bias=True)]
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = soft_moe_mixing(*inputs)
    names = {e.name for e in prof.events()}
    assert "softmoe::soft_moe_mixing_inference" in names and "softmoe::soft_moe_mixing" not in names
    trained, _ = torch.ops.softmoe.soft_moe_mixing(*inputs, True, cpu_isa())
    torch.testing.assert_close(out, trained, rtol=1e-6, atol=1e-6)


def test_a_saved_record_of_another_width_is_refused(library):
    x, dispatch, combine, w1, b1, w2, b2 = (t.detach() for t in random_inputs(20, 4, 8, 3, 1, 5, bias=True))
    out, saved = torch.ops.softmoe.soft_moe_mixing(x, dispatch, combine, w1, b1, w2, b2, True, cpu_isa())
    assert saved.shape[2] == 5 + 8
    with pytest.raises(RuntimeError, match=r"saved must have shape \[\d+, 3, 5, \d+\], got \[\d+, 3, 12, "):
        torch.ops.softmoe.soft_moe_mixing_backward(out, x, dispatch, combine, w1, w2, b2, saved[:, :, 1:], cpu_isa())


def test_inconsistent_inputs_are_refused(library):
    x, dispatch, combine, w1, b1, w2, b2 = (t.detach() for t in random_inputs(4, 3, 8, 2, 2, 3, bias=True))
    with pytest.raises(ValueError, match="float32 CPU tensors, got x torch.float64"):
        soft_moe_mixing(x.double(), dispatch, combine, w1, b1, w2, b2)
    with pytest.raises(ValueError, match=r"combine must have shape \(4, 3, 4\), got \(4, 3, 5\)"):
        soft_moe_mixing(x, dispatch, torch.zeros(4, 3, 5), w1, b1, w2, b2)
    with pytest.raises(ValueError, match=r"weight2 must have shape \(2, 3, 8\)"):
        soft_moe_mixing(x, dispatch, combine, w1, b1, w2.transpose(1, 2), b2)
    with pytest.raises(ValueError, match="the 3 slots must be a positive multiple of the 2 experts"):
        soft_moe_mixing(x, dispatch[..., :3], combine[..., :3], w1, b1, w2, b2)


def test_frozen_biases_get_no_gradient_and_the_rest_stays_exact(isa):
    inputs = random_inputs(20, 4, 8, 3, 1, 2, bias=True)
    inputs[4].requires_grad_(False)
    inputs[6].requires_grad_(False)
    soft_moe_mixing(*inputs).sum().backward()
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    mixing_reference(*leaves).sum().backward()
    assert inputs[4].grad is None and inputs[6].grad is None
    for got, ref in zip(inputs[:4] + inputs[5:6], leaves[:4] + leaves[5:6]):
        assert relative_error(got.grad, ref.grad) < 1e-5
