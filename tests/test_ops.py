"""softmoe's native kernels as PyTorch ops (torch.ops.softmoe.*): torch.library.opcheck, torch.compile, autograd to
the second order, the choice of kernel variant (ISA), and the extension's build, cache and failure modes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

import softmoe.kernels as kernels
from grids import pairwise
from reference import relative_error
from softmoe.kernels import ISAS, build, expert_matmul, soft_moe_mixing, use_isa
from softmoe.kernels.soft_moe_mixing import layout_costs

OPS = torch.ops.softmoe


def supported(isa: str) -> None:
    if isa not in kernels.supported_isas():
        pytest.skip(f"this CPU lacks {isa} (it runs {', '.join(kernels.supported_isas())})")


@pytest.fixture(params=ISAS)
def isa(request, library):
    """Each kernel variant's name in turn (a variant this CPU lacks is skipped)."""
    supported(request.param)
    return request.param


def matmul_inputs(shape, bias, seed=0):
    experts, rows, k, n = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(experts, rows, k, generator=gen, requires_grad=True)
    w = torch.randn(experts, k, n, generator=gen, requires_grad=True)
    b = torch.randn(experts, n, generator=gen, requires_grad=True) if bias else None
    return x, w, b


def mixing_inputs(batch, tokens, dim, experts, slots_per_expert, hidden, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = experts * slots_per_expert
    logits = torch.randn(batch, tokens, slots, generator=gen)
    tensors = [
        torch.randn(batch, tokens, dim, generator=gen), logits.softmax(1), logits.softmax(2),
        torch.randn(experts, dim, hidden, generator=gen) / dim**0.5,
        torch.randn(experts, hidden, generator=gen) if bias else None,
        torch.randn(experts, hidden, dim, generator=gen) / hidden**0.5,
        torch.randn(experts, dim, generator=gen) if bias else None,
    ]
    return [None if t is None else t.requires_grad_() for t in tensors]


def detached(tensors):
    return [None if t is None else t.detach() for t in tensors]


# ---- torch.library.opcheck: schema, fake tensors, autograd registration, AOT dispatch with dynamic shapes --------

# (experts, rows, K, N): vector tails in N (15, 17, 47), several tiles, K not a multiple of the 32-row panel.
MATMUL_SHAPES = [(1, 1, 1, 1), (2, 3, 33, 15), (3, 5, 40, 47), (2, 9, 65, 100)]
# (batch, tokens, dim, experts, slots per expert, hidden): partial groups of inputs for every lane count, several
# slots per expert, hidden sizes with a tail block.
MIXING_SHAPES = [(37, 4, 20, 6, 1, 2), (5, 3, 7, 3, 3, 9), (17, 1, 12, 2, 2, 19)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, bias, row_isa", pairwise(shape=MATMUL_SHAPES, bias=[True, False], row_isa=ISAS), indirect=["row_isa"]
)
def test_opcheck_expert_matmul(shape, bias, row_isa):
    isa = row_isa
    x, w, b = matmul_inputs(shape, bias)
    torch.library.opcheck(OPS.expert_matmul.default, (x, w, b, "none", isa))
    # A fused activation has no backward: checked on inputs that need no gradient.
    torch.library.opcheck(OPS.expert_matmul.default, (*detached((x, w, b)), "gelu", isa))


@pytest.mark.slow
@pytest.mark.parametrize("shape", MATMUL_SHAPES, ids=lambda s: "E{}xM{}xK{}xN{}".format(*s))
def test_opcheck_expert_matmul_backward_ops(isa, shape):
    x, w, _ = matmul_inputs(shape, False)
    g = torch.randn(shape[0], shape[1], shape[3], requires_grad=True)
    torch.library.opcheck(OPS.expert_matmul_nt.default, (g, w, isa))
    torch.library.opcheck(OPS.expert_matmul_tn.default, (x, g, isa))


@pytest.mark.parametrize("shape", MIXING_SHAPES, ids=lambda s: "B{}xM{}xD{}xn{}xp{}xH{}".format(*s))
def test_opcheck_the_inference_ops(isa, shape):
    """The ops inference runs (no backward, no records): the fused mixing with every slot and with a kept combine,
    and the routing with Algorithm 1's choice; each equal to what the training ops give."""
    x, dispatch, combine, w1, b1, w2, b2 = detached(mixing_inputs(*shape, bias=True))
    torch.library.opcheck(OPS.soft_moe_mixing_inference.default, (x, dispatch, combine, w1, b1, w2, b2, False, None,
                                                                   0, layout_costs(isa), isa))
    want, _ = OPS.soft_moe_mixing(x, dispatch, combine, w1, b1, w2, b2, False, isa)
    got = OPS.soft_moe_mixing_inference(x, dispatch, combine, w1, b1, w2, b2, False, None, 0, layout_costs(isa), isa)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    experts, p = w1.shape[0], dispatch.shape[2] // w1.shape[0]
    phi, scale = torch.randn(x.shape[2], experts * p), torch.tensor(2.0)
    args = (x, phi, scale, "router", p, 1, True, isa, False)
    torch.library.opcheck(OPS.soft_moe_routing_top_k.default, args)
    dispatch, kept, slots, selected = OPS.soft_moe_routing_top_k(*args)
    assert selected.shape == (x.shape[0], 1) and slots.dtype == torch.int64
    torch.library.opcheck(OPS.soft_moe_mixing_inference.default, (x, dispatch, kept, w1, b1, w2, b2, True, slots,
                                                                   0, layout_costs(isa), isa))
    masked = OPS.soft_moe_mixing(x, dispatch, kept, w1, b1, w2, b2, False, isa)[0]
    got = OPS.soft_moe_mixing_inference(x, dispatch, kept, w1, b1, w2, b2, True, slots, 0, layout_costs(isa), isa)
    torch.testing.assert_close(got, masked, rtol=1e-5, atol=1e-5)


def test_a_gradient_through_an_inference_op_raises(isa):
    """The inference ops have no backward: a gradient asked of an input that requires one raises (never a silent
    None); without one they run as usual."""
    x, dispatch, combine, w1, b1, w2, b2 = detached(mixing_inputs(*MIXING_SHAPES[0], bias=True))
    experts, p = w1.shape[0], dispatch.shape[2] // w1.shape[0]
    phi, scale = torch.randn(x.shape[2], experts * p), torch.tensor(2.0)
    leaf = x.clone().requires_grad_()
    calls = {
        "soft_moe_mixing_inference": lambda t: OPS.soft_moe_mixing_inference(
            t, dispatch, combine, w1, b1, w2, b2, False, None, 0, layout_costs(isa), isa
        ),
        "soft_moe_routing_top_k": lambda t: OPS.soft_moe_routing_top_k(t, phi, scale, "router", p, 1, True, isa, False)[1],
        "selected_mixing": lambda t: OPS.selected_mixing(
            t, dispatch, combine, torch.zeros(x.shape[0], 1, dtype=torch.int64), w1, b1, w2, b2, p, "relu", isa
        ),
    }
    for name, call in calls.items():
        out = call(leaf)
        with pytest.raises(RuntimeError, match="not implemented"):
            torch.autograd.grad(out.sum(), leaf)
        assert torch.equal(call(x), out.detach()), name


@pytest.mark.slow
@pytest.mark.parametrize(
    "shape, bias, keep, row_isa",
    pairwise(shape=MIXING_SHAPES, bias=[True, False], keep=[True, False], row_isa=ISAS),
    indirect=["row_isa"],
)
def test_opcheck_soft_moe_mixing(shape, bias, keep, row_isa):
    isa = row_isa
    inputs = mixing_inputs(*shape, bias=bias)
    torch.library.opcheck(OPS.soft_moe_mixing.default, (*inputs, keep, isa))
    x, dispatch, combine, w1, b1, w2, b2 = detached(inputs)
    out, saved = OPS.soft_moe_mixing(x, dispatch, combine, w1, b1, w2, b2, keep, isa)
    lanes = build.LANES[isa]
    width = w1.shape[2] + (x.shape[2] if keep else 0)
    assert saved.shape == ((x.shape[0] + lanes - 1) // lanes, dispatch.shape[2], width, lanes)
    torch.library.opcheck(OPS.soft_moe_mixing_backward.default,
                          (torch.randn_like(out), x, dispatch, combine, w1, w2, b2, saved, isa))


def test_fake_tensors_need_no_kernels(library):
    """The ops' shapes on the meta device (what torch.compile traces with): no native code runs."""
    x, w = torch.empty(4, 8, 64, device="meta"), torch.empty(4, 64, 100, device="meta")
    assert OPS.expert_matmul(x, w, None, "none", "portable").shape == (4, 8, 100)
    assert OPS.expert_matmul_nt(torch.empty(4, 8, 100, device="meta"), w, "portable").shape == (4, 8, 64)
    assert OPS.expert_matmul_tn(x, torch.empty(4, 8, 100, device="meta"), "portable").shape == (4, 64, 100)
    inputs = [None if t is None else t.detach().to("meta") for t in mixing_inputs(37, 4, 20, 6, 1, 2, bias=True)]
    out, saved = OPS.soft_moe_mixing(*inputs, False, "avx2")
    assert out.shape == (37, 4, 20) and saved.shape == (5, 6, 2, 8)
    assert OPS.soft_moe_mixing(*inputs, True, "avx512")[1].shape == (3, 6, 2 + 20, 16)
    with pytest.raises(RuntimeError, match="x .E, rows, K. needs weight .E, K, N."):
        OPS.expert_matmul(x, torch.empty(4, 63, 100, device="meta"), None, "none", "portable")


# ---- autograd through the registrations ------------------------------------------------------------------------


def test_expert_matmul_is_twice_differentiable(isa):
    """First and second derivatives through the ops' autograd formulas (each op's gradient is one of the others)
    against float64 autograd of torch.baddbmm."""
    with use_isa(isa):
        x, w, b = matmul_inputs((3, 5, 33, 47), True, seed=4)
        g = torch.randn(3, 5, 47, requires_grad=True)
        out = expert_matmul(x, w, b)
        gx, gw, gb = torch.autograd.grad(out, (x, w, b), g, create_graph=True)
        second = torch.autograd.grad((gx.square().sum() + (gw * w).sum() + gb.sum()), (x, w, g))
    x64, w64, b64, g64 = (t.detach().double().requires_grad_() for t in (x, w, b, g))
    out64 = torch.baddbmm(b64.unsqueeze(1), x64, w64)
    gx64, gw64, gb64 = torch.autograd.grad(out64, (x64, w64, b64), g64, create_graph=True)
    second64 = torch.autograd.grad((gx64.square().sum() + (gw64 * w64).sum() + gb64.sum()), (x64, w64, g64))
    for got, want in zip((out, gx, gw, gb, *second), (out64, gx64, gw64, gb64, *second64), strict=True):
        assert relative_error(got.detach(), want.detach()) < 1e-5


def test_mixing_gradients_through_the_registration_match_float64(isa):
    """torch.autograd.grad on the op (the registered formula calls softmoe::soft_moe_mixing_backward) for each
    input alone, against float64 autograd of the formula, with a strided upstream gradient."""
    from test_native_mixing import mixing_reference

    inputs = mixing_inputs(21, 4, 10, 3, 2, 5, bias=True, seed=2)
    leaves64 = [t.detach().double().requires_grad_() for t in inputs]
    out64 = mixing_reference(*leaves64)
    upstream = torch.randn(21, 10, 4).transpose(1, 2)  # not contiguous
    want = torch.autograd.grad(out64, leaves64, upstream.double())
    with use_isa(isa):
        out = soft_moe_mixing(*inputs)
        assert relative_error(out, out64) < 1e-5
        for i, leaf in enumerate(inputs):
            (got,) = torch.autograd.grad(soft_moe_mixing(*inputs), leaf, upstream)
            assert relative_error(got, want[i]) < 1e-5, i
    with pytest.raises(RuntimeError):  # the backward op has no formula of its own: no double backward
        grads = torch.autograd.grad(soft_moe_mixing(*inputs), inputs[0], upstream, create_graph=True)
        grads[0].sum().backward()


def differentiable_op_calls(isa):
    """(name, op, arguments) of each differentiable op, tensors first-class arguments with fixed values."""
    gen = torch.Generator().manual_seed(6)
    mixing = detached(mixing_inputs(9, 3, 8, 3, 2, 5, bias=True, seed=6))
    combine = torch.randn(9, 3, 6, generator=gen).softmax(-1)
    x, w, b = detached(matmul_inputs((2, 3, 7, 5), True, seed=6))
    return [
        ("soft_moe_routing", OPS.soft_moe_routing,
         [torch.randn(9, 3, 8, generator=gen), torch.randn(8, 6, generator=gen), torch.tensor(1.3), "router", isa,
          False]),
        ("soft_moe_mixing", OPS.soft_moe_mixing, [*mixing, True, isa]),
        ("expert_matmul", OPS.expert_matmul, [x, w, b, "none", isa]),
        ("expert_matmul_nt", OPS.expert_matmul_nt, [torch.randn(2, 3, 5, generator=gen), w, isa]),
        ("expert_matmul_tn", OPS.expert_matmul_tn, [x, torch.randn(2, 3, 5, generator=gen), isa]),
        ("top_k_combine", OPS.top_k_combine, [combine, 2, 2, isa]),
    ]


def test_each_input_alone_records_its_gradient_and_no_input_records_nothing(isa):
    """Each differentiable op's Autograd kernel records a node where any one tensor input requires grad (that input
    then gets the gradient it gets with all of them requiring grad) and none where no input does or grad mode is
    off (there the op runs below autograd at once): the same outputs, bit for bit, every way."""
    for name, op, args in differentiable_op_calls(isa):
        places = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()]
        outputs = op(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        upstream = torch.randn_like(outputs[0])
        with torch.no_grad():
            unrecorded = op(*args)
        unrecorded = unrecorded if isinstance(unrecorded, tuple) else (unrecorded,)
        for out, plain, again in zip(outputs, unrecorded, op(*args) if len(outputs) > 1 else (op(*args),)):
            assert out.grad_fn is None and plain.grad_fn is None and again.grad_fn is None, name
            assert torch.equal(out, plain), name
        every = [a.detach().requires_grad_() if i in places else a for i, a in enumerate(args)]
        first = op(*every)
        first = first[0] if isinstance(first, tuple) else first
        want = torch.autograd.grad(first, [every[i] for i in places], upstream)
        for place, grad in zip(places, want, strict=True):
            alone = [a.detach().requires_grad_() if i == place else a for i, a in enumerate(args)]
            out = op(*alone)
            out = out[0] if isinstance(out, tuple) else out
            assert out.grad_fn is not None, (name, place)
            assert torch.equal(out, outputs[0]), (name, place)
            (got,) = torch.autograd.grad(out, alone[place], upstream)
            assert relative_error(got, grad) < 1e-6, (name, place)


def test_a_forward_mode_tangent_is_refused_not_dropped(isa):
    """A dual tensor (torch.autograd.forward_ad) into a differentiable op, under no_grad too, raises torch's error for
    a Function without a forward-mode formula: its tangent is not silently lost."""
    from torch.autograd import forward_ad

    for name, op, args in differentiable_op_calls(isa):
        with forward_ad.dual_level(), torch.no_grad():
            dual = forward_ad.make_dual(args[0], torch.ones_like(args[0]))
            with pytest.raises(RuntimeError, match="jvp is not implemented"):
                op(dual, *args[1:])


# ---- torch.compile ---------------------------------------------------------------------------------------------


class GraphRecorder:
    """A torch.compile backend that keeps each graph it is given and runs it as traced (eagerly)."""

    def __init__(self):
        self.graphs = []

    def __call__(self, graph_module, example_inputs):
        self.graphs.append(graph_module)
        return graph_module.forward


def graph_targets(recorder: GraphRecorder) -> set[str]:
    """The graphs' targets, operators named without the overload ("softmoe.soft_moe_mixing")."""
    return {str(node.target).removesuffix(".default") for graph in recorder.graphs for node in graph.graph.nodes}


@pytest.mark.slow
def test_compiled_expert_matmul_holds_the_op_and_matches_eager(library):
    torch.compiler.reset()

    def f(x, w, b):
        assert kernels.native_applies(x, w)  # traced: the ops are visible to torch.compile
        return torch.nn.functional.gelu(expert_matmul(x, w, b)).sum(-1)

    torch.manual_seed(0)
    x, w, b = torch.randn(4, 8, 64), torch.randn(4, 64, 4096, requires_grad=True), torch.randn(4, 4096)
    recorder = GraphRecorder()
    compiled = torch.compile(f, backend=recorder, fullgraph=True)
    got = compiled(x, w, b)
    assert "softmoe.expert_matmul" in graph_targets(recorder)
    want = f(x, w, b)
    assert torch.equal(got, want)
    # Through AOT autograd (fake tensors, the registered backward), forward and backward.
    grad = torch.randn_like(want)
    (want_w,) = torch.autograd.grad(want, w, grad)
    aot = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w, b)
    (got_w,) = torch.autograd.grad(aot, w, grad)
    assert relative_error(aot, want) < 1e-6 and relative_error(got_w, want_w) < 1e-6
    with torch.no_grad():  # inference: the fused activation
        fused = torch.compile(lambda x, w, b: expert_matmul(x, w, b, "relu"), backend=recorder, fullgraph=True)
        assert torch.equal(fused(x, w, b), expert_matmul(x, w, b).relu())


@pytest.mark.slow
def test_compiled_soft_moe_mixing_holds_the_op_and_matches_eager(library):
    torch.compiler.reset()

    def f(*inputs):
        return soft_moe_mixing(*inputs) * 2.0

    inputs = mixing_inputs(37, 4, 20, 6, 1, 3, bias=True, seed=1)
    recorder = GraphRecorder()
    got = torch.compile(f, backend=recorder, fullgraph=True)(*inputs)
    assert "softmoe.soft_moe_mixing" in graph_targets(recorder)
    want = f(*inputs)
    assert torch.equal(got, want)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, inputs, grad)
    aot = torch.compile(f, backend="aot_eager", fullgraph=True)(*inputs)
    for got_g, want_g in zip(torch.autograd.grad(aot, inputs, grad), want_grads, strict=True):
        assert relative_error(got_g, want_g) < 1e-6


def test_inductor_runs_both_ops_forward_and_backward(library):
    torch.compiler.reset()

    def matmul(x, w, b):
        return expert_matmul(x, w, b).relu()

    def mixing(*inputs):
        return soft_moe_mixing(*inputs).square()

    for fn, inputs in ((matmul, matmul_inputs((3, 5, 33, 47), True)), (mixing, mixing_inputs(9, 4, 8, 3, 1, 5, True))):
        want = fn(*inputs)
        grad = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, inputs, grad)
        got = torch.compile(fn, fullgraph=True)(*inputs)
        assert relative_error(got, want) < 1e-5
        for got_g, want_g in zip(torch.autograd.grad(got, inputs, grad), want_grads, strict=True):
            assert relative_error(got_g, want_g) < 1e-5


def test_compiled_code_follows_use_isa(library):
    """torch.compile guards on the variant use_isa asks for: another variant recompiles, and runs that variant."""
    torch.compiler.reset()
    recorder = GraphRecorder()
    compiled = torch.compile(lambda x, w: expert_matmul(x, w), backend=recorder, fullgraph=True)
    x, w = torch.randn(2, 3, 20), torch.randn(2, 20, 30)
    compiled(x, w)
    with use_isa("portable"):
        out = compiled(x, w)
    compiled(x, w)
    assert len(recorder.graphs) == 2
    isas = [node.args[4] for graph in recorder.graphs for node in graph.graph.nodes
            if str(node.target) == "softmoe.expert_matmul"]
    assert isas == [kernels.supported_isas()[0], "portable"]
    assert relative_error(out, x.double() @ w.double()) < 1e-5


# ---- the kernel variant (ISA) -----------------------------------------------------------------------------------


def test_the_default_variant_is_the_best_the_cpu_runs(library):
    supported_isas = kernels.supported_isas()
    assert supported_isas[-1] == "portable" and set(supported_isas) <= set(ISAS)
    assert list(supported_isas) == [isa for isa in ISAS if isa in supported_isas]  # best first
    if not os.environ.get("SOFTMOE_ISA"):
        assert kernels.cpu_isa() == supported_isas[0]
        assert kernels.native_status() == f"native kernels built for {supported_isas[0]}"
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2 " in flags and " fma " in flags:
        assert "avx2" in supported_isas
    if all(f" {flag} " in flags for flag in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
        assert "avx512" in supported_isas


def test_the_build_holds_every_variant_with_its_lanes(library):
    module = build.extension()
    if sys.platform.startswith("linux") and os.uname().machine in ("x86_64", "AMD64"):
        assert list(module.built_isas()) == list(ISAS)
    for isa in kernels.supported_isas():
        assert module.lanes(isa) == build.LANES[isa]  # as compiled (SOFTMOE_LANES of the variant unit)


def test_use_isa_nests_and_restores(library):
    default = kernels.cpu_isa()
    with use_isa("portable") as isa:
        assert isa == "portable" and kernels.cpu_isa() == "portable"
        with use_isa(default):
            assert kernels.cpu_isa() == default
        assert kernels.cpu_isa() == "portable"
    assert kernels.cpu_isa() == default
    with pytest.raises(ValueError, match="isa must be one of"):
        with use_isa("sse9"):
            pass


def test_a_variant_the_cpu_lacks_is_refused(library):
    missing = [isa for isa in ISAS if isa not in kernels.supported_isas()]
    if not missing:
        pytest.skip("this CPU runs every variant")
    x, w = torch.randn(2, 3, 4), torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match=f"cannot run the {missing[0]} kernels: this CPU supports"):
        with use_isa(missing[0]):
            pass
    with pytest.raises(RuntimeError, match=f"this CPU cannot run the {missing[0]} kernels"):
        OPS.expert_matmul(x, w, None, "none", missing[0])  # the binding checks the CPU before it calls a variant
    with pytest.raises(RuntimeError, match="no sse9 kernels in this build"):
        OPS.expert_matmul(x, w, None, "none", "sse9")


@pytest.fixture
def reload_state():
    """Loads the native state afresh for the test (reading SOFTMOE_ISA / SOFTMOE_NATIVE), and again after it."""
    build._reset()
    yield
    build._reset()


def test_softmoe_isa_picks_a_variant(library, reload_state, monkeypatch):
    monkeypatch.setenv("SOFTMOE_ISA", "portable")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.cpu_isa() == "portable"
    assert kernels.native_status() == "native kernels built for portable (SOFTMOE_ISA=portable)"
    with torch.no_grad():
        x, w = torch.randn(2, 3, 40), torch.randn(2, 40, 30)
        assert relative_error(expert_matmul(x, w), x.double() @ w.double()) < 1e-5


def test_softmoe_isa_the_cpu_lacks_warns_and_takes_the_best(library, reload_state, monkeypatch):
    best = kernels.supported_isas()[0]
    missing = [isa for isa in ISAS if isa not in kernels.supported_isas()]
    if not missing:
        pytest.skip("this CPU runs every variant")
    build._reset()
    monkeypatch.setenv("SOFTMOE_ISA", missing[0])
    with pytest.warns(UserWarning, match=f"SOFTMOE_ISA={missing[0]} but this CPU lacks {missing[0]}: the native "
                                         f"kernels run {best}"):
        assert kernels.cpu_isa() == best
    assert kernels.native_available()


def test_an_unknown_softmoe_isa_warns_and_takes_the_best(library, reload_state, monkeypatch):
    best = kernels.supported_isas()[0]
    build._reset()
    monkeypatch.setenv("SOFTMOE_ISA", "sse9")
    with pytest.warns(UserWarning, match="SOFTMOE_ISA='sse9' is not one of avx512, avx2, portable"):
        assert kernels.cpu_isa() == best


# ---- the build: cache, key, concurrency, failures -----------------------------------------------------------------


REPORT = """
    import json, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
        import softmoe.kernels as k
        first, second = k.native_available(), k.native_available()
        applies = k.native_applies(torch.empty(4, 8, 64), torch.empty(4, 64, 4096))
        try:
            k.expert_matmul(torch.randn(2, 3, 4), torch.randn(2, 4, 5))
            error = None
        except RuntimeError as e:
            error = str(e)
    print(json.dumps({"available": [first, second], "applies": applies, "status": k.native_status(),
                      "isa": k.cpu_isa(), "compiled": k.compiled_in_this_process(), "error": error,
                      "warnings": [str(w.message) for w in caught if "softmoe" in str(w.message)]}))
"""


@pytest.fixture(scope="module")
def reports(library, tmp_path_factory) -> dict:
    """REPORT's results in fresh interpreters, run side by side (each mostly imports torch): "reuse" with the
    suite's cache, "no compiler", "failing" (a compiler that fails) and "off" (SOFTMOE_NATIVE=0) with caches of their
    own; and the built library's modification time before and after ("mtime")."""
    root = tmp_path_factory.mktemp("reports")
    failing = root / "failing-c++"
    failing.write_text("#!/bin/sh\necho 'error: this compiler fails' >&2\nexit 1\n")
    failing.chmod(0o755)
    (root / "off").mkdir()
    library_file = build.library_file(build.build_key())
    before = library_file.stat().st_mtime_ns
    environments = {
        "reuse": {"SOFTMOE_CACHE": str(build.native_cache_dir())},
        "no compiler": {"CXX": "/nonexistent/c++", "SOFTMOE_CACHE": str(root / "none")},
        "failing": {"CXX": str(failing), "SOFTMOE_CACHE": str(root / "failing")},
        "off": {"SOFTMOE_NATIVE": "0", "SOFTMOE_CACHE": str(root / "off")},
    }
    processes = {
        name: subprocess.Popen([sys.executable, "-c", textwrap.dedent(REPORT)], env={**os.environ, **env}, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for name, env in environments.items()
    }
    results: dict = {"root": root}
    for name, process in processes.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, (name, err)
        results[name] = json.loads(out.strip().splitlines()[-1])
    results["mtime"] = (before, library_file.stat().st_mtime_ns)
    return results


@pytest.mark.slow
def test_a_second_process_reuses_the_build(library, reports):
    directory = build.build_directory(build.build_key())
    assert (directory / "complete").exists() and build.library_file(build.build_key()).exists()
    report = reports["reuse"]
    assert report["available"] == [True, True] and report["applies"] and report["error"] is None
    assert report["compiled"] is False and report["warnings"] == []
    before, after = reports["mtime"]
    assert after == before


def test_the_key_follows_every_source(tmp_path):
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    assert build.build_key(copy) == build.build_key()
    for name in ("bindings.cpp", "soft_moe_small.h", "expert_matmul_avx2.cpp", "variant.h"):
        source = copy / name
        original = source.read_bytes()
        source.write_bytes(original + b"\n")
        assert build.build_key(copy) != build.build_key(), name
        source.write_bytes(original)
    assert build.build_key(copy) == build.build_key()


def test_a_new_key_builds_and_a_complete_build_is_imported(library, reload_state, monkeypatch, tmp_path):
    """A key with no complete build in the cache (an empty one) runs the build, here a compile that fails (the
    fault: torch's cpp_extension.load raising the compiler's error), with one warning naming its first error."""
    monkeypatch.setenv("SOFTMOE_CACHE", str(tmp_path))
    key = build.build_key()
    builds = []

    def failing_compile(**kwargs):
        builds.append((kwargs["build_directory"], kwargs["name"]))
        raise RuntimeError("Error building extension 'softmoe'\nkernels.cpp:1:1: error: stand-in")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_compile)
    with pytest.warns(UserWarning, match="native CPU kernels are unavailable.*stand-in"):
        assert not kernels.native_available()
    assert builds == [(str(tmp_path / f"native-{key}"), build.module_name(key))]
    assert not (tmp_path / f"native-{key}" / "complete").exists()
    assert kernels.native_status() == (f"building the native kernels in {tmp_path / f'native-{key}'} failed: "
                                       "kernels.cpp:1:1: error: stand-in")
    assert kernels.cpu_isa() is None and kernels.supported_isas() == ()


@pytest.mark.slow
def test_without_a_compiler_the_ops_are_unavailable_with_one_warning(reports):
    report = reports["no compiler"]
    assert report["available"] == [False, False] and not report["applies"] and report["isa"] is None
    assert report["status"].startswith("no C++ compiler: '/nonexistent/c++'")
    assert len(report["warnings"]) == 1 and "no C++ compiler" in report["warnings"][0]
    assert report["error"].startswith("softmoe's native kernels are unavailable: no C++ compiler")


@pytest.mark.slow
def test_a_failing_build_leaves_no_complete_build(reports):
    report = reports["failing"]
    assert report["available"] == [False, False]
    assert report["status"].startswith("building the native kernels in ") and "failed" in report["status"]
    assert len(report["warnings"]) == 1
    assert not list((reports["root"] / "failing").glob("native-*/complete"))


@pytest.mark.slow
def test_native_off_means_no_build_and_no_warning(reports):
    report = reports["off"]
    assert report["available"] == [False, False] and report["warnings"] == []
    assert report["status"] == "SOFTMOE_NATIVE=0: the native kernels are turned off"
    assert list((reports["root"] / "off").iterdir()) == []


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="watches the file lock in /proc/locks (Linux)")
def test_a_first_use_waits_for_a_build_under_way_and_imports_it(library, tmp_path):
    """A process that finds another building (the build's file lock held: here by the test, which stands for the
    builder) waits for the lock, then imports that build instead of building its own; the builder's part, building
    under the lock and marking the build complete, is what every first use in an empty cache does (the other tests
    of this section)."""
    import fcntl

    key = build.build_key()
    target = tmp_path / build.build_directory(key).name
    with open(tmp_path / f"native-{key}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        environment = {**os.environ, "SOFTMOE_CACHE": str(tmp_path)}
        process = subprocess.Popen([sys.executable, "-c", textwrap.dedent(REPORT)], env=environment, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        inode = os.fstat(lock.fileno()).st_ino
        deadline = time.monotonic() + 120
        while not any(" -> " in line and f":{inode} " in line for line in Path("/proc/locks").read_text()
                      .splitlines()):  # the process waits for the lock
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.05)
        shutil.copytree(build.build_directory(key), target)  # the builder's work, then the lock released
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    report = json.loads(out.strip().splitlines()[-1])
    assert report["available"] == [True, True] and report["error"] is None and report["compiled"] is False
    assert (target / "complete").exists() and len(list(tmp_path.glob("native-*/complete"))) == 1
