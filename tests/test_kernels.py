"""softmoe.kernels: oneDNN's linear for CPU inference and its batched products (softmoe.kernels.onednn), where the
layer takes them, and the package's exports."""

from __future__ import annotations

import copy
import importlib
import types

import pytest
import torch

import softmoe.kernels.onednn as onednn_module
from reference import kernels_called, output_and_gradients, ref_activation, relative_error
from softmoe import SoftMoE
from softmoe.kernels import batched_matmul, native_available, onednn_applies, onednn_linear, onednn_outruns_mkl
from softmoe.kernels.onednn import PROBE_SHAPE
from softmoe.runtime import cpu_signature
from softmoe.tuning import TABLE, Measured, autotune_enabled, set_autotune

ONEDNN = "mkldnn::_linear_pointwise"


@pytest.mark.parametrize("activation", [None, "gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_onednn_linear_equals_reference(activation, bias):
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 12), torch.randn(12, 9)
    b = torch.randn(9) if bias else None
    with torch.no_grad():
        out = onednn_linear(x, w, b, activation)
    h = x.double() @ w.double() + (b.double() if bias else 0)
    want = h if activation is None else ref_activation(activation, h)
    assert out.shape == (2, 5, 9) and out.dtype == torch.float32
    assert (out.double() - want).abs().max().item() < 1e-5


def test_onednn_applies_only_without_gradients_on_float32_cpu():
    x, w = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True)
    assert not onednn_applies(x, w)  # w needs a gradient
    assert onednn_applies(x, w.detach())
    with torch.no_grad():
        assert onednn_applies(x, w)
        assert not onednn_applies(x.double(), w.double())
        assert not onednn_applies(x, w.double())


def logits_and_gradients(layer: SoftMoE, x: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    logits = layer.route(x).logits
    weights = torch.linspace(-1.0, 1.0, logits.numel()).view_as(logits)
    grads = torch.autograd.grad((logits * weights).sum(), (x, layer.phi, layer.scale))
    return [logits.detach(), *grads]


def test_the_package_exports_what_the_layer_and_experts_import():
    import softmoe.kernels as kernels

    names = ["expert_matmul", "soft_moe_mixing", "native_applies", "native_mixing_applies", "onednn_applies",
             "onednn_linear", "needs_grad", "plain_eager_mode", "NATIVE_ACTIVATIONS", "MIXING_MAX_TOKENS",
             "native_available", "native_status", "cpu_isa", "use_isa", "supported_isas"]
    missing = [name for name in names if not hasattr(kernels, name)]
    assert missing == []
    assert set(kernels.__all__) >= set(names)
    assert not hasattr(kernels, "native_library")  # replaced by native_available / native_status
    assert kernels.onednn_linear is kernels.onednn.onednn_linear


def test_the_measured_thresholds_live_in_the_tuning_table_only():
    moved = {"expert_matmul": ["NATIVE_MAX_ROWS", "NATIVE_FORWARD_MAX_ROWS", "NATIVE_MIN_WEIGHT"],
             "grouped_mm": ["LARGE_WEIGHT"],
             "native_grouped_mm": ["LARGE_WEIGHT"],
             "onednn": ["ONEDNN_MIN_PRODUCT_FLOPS", "ONEDNN_MIN_BATCH_FLOPS", "ONEDNN_MARGIN"],
             "soft_moe_mixing": ["MIXING_MAX_WEIGHT_BYTES_PER_LANE"]}
    import softmoe.kernels as kernels

    for module, names in moved.items():
        module = importlib.import_module(f"softmoe.kernels.{module}")
        for name in names:
            assert not hasattr(module, name) and not hasattr(kernels, name)
            assert isinstance(TABLE[name.lower()], Measured) and TABLE[name.lower()].measured_on


def onednn_cpus(monkeypatch, this_cpu: bool) -> None:
    """softmoe.tuning.TABLE's "onednn_cpus" set so that oneDNN outruns MKL on this CPU (this_cpu), as the table
    would say of a CPU it names, or on no CPU (the rule itself is tested on its own)."""
    vendor, family, _ = cpu_signature()
    cpus = ((vendor, family, None),) if this_cpu else ()
    monkeypatch.setitem(TABLE, "onednn_cpus", Measured(cpus, "a test: this CPU" if this_cpu else "a test: no CPU"))


@pytest.fixture
def onednn_products(monkeypatch):
    """batched_matmul takes oneDNN for every product that may run there, on any CPU: oneDNN outruns MKL on this
    CPU (softmoe.tuning.TABLE's "onednn_cpus") and the FLOP minimums are 1."""
    onednn_cpus(monkeypatch, this_cpu=True)
    monkeypatch.setitem(TABLE, "onednn_min_product_flops", Measured(1, "a test"))
    monkeypatch.setitem(TABLE, "onednn_min_batch_flops", Measured(1, "a test"))


def test_batched_matmul_runs_onednn_and_equals_float64(onednn_products):
    torch.manual_seed(0)
    a, w, bias = torch.randn(3, 5, 12), torch.randn(3, 12, 9), torch.randn(3, 9)
    wt = torch.randn(3, 9, 12).transpose(1, 2)  # entries are transposed dense matrices (w.transpose(1, 2))
    strided_rows = a.transpose(0, 1).contiguous().transpose(0, 1)
    cases = [(a, w, None), (a, w, bias), (a, wt, None), (a[:, ::2], w, bias), (strided_rows, w, None),
             (a, w, torch.randn(9, 3).t()), (a, w, torch.randn(3, 1).expand(3, 9))]  # biases not contiguous
    for x, b, c in cases:
        assert ONEDNN in kernels_called(lambda x=x, b=b, c=c: batched_matmul(x, b, c))
        got = batched_matmul(x, b, c)
        want = torch.bmm(x.double(), b.double()) + (0 if c is None else c.double().unsqueeze(1))
        assert got.shape == want.shape and got.dtype == torch.float32 and got.is_contiguous()
        assert (got.double() - want).abs().max().item() < 1e-5
    for c in (torch.randn(1, 9), torch.randn(3, 1)):  # biases that broadcast: torch's baddbmm
        got = batched_matmul(a, w, c)
        assert (got.double() - (torch.bmm(a.double(), w.double()) + c.double().unsqueeze(1))).abs().max() < 1e-5


def test_batched_matmul_keeps_torch_where_onednn_may_not_run(onednn_products, monkeypatch):
    torch.manual_seed(0)
    a, w = torch.randn(3, 5, 12), torch.randn(3, 12, 9)

    def torch_only(fn) -> None:
        called = kernels_called(fn)
        assert ONEDNN not in called and called & {"aten::bmm", "aten::baddbmm"}

    torch_only(lambda: batched_matmul(a.double(), w.double()))
    torch_only(lambda: batched_matmul(a, w.requires_grad_(True)))  # a gradient to record
    w.requires_grad_(False)
    torch_only(lambda: batched_matmul(a, w, torch.randn(3, 9, requires_grad=True)))
    torch_only(lambda: batched_matmul(a.transpose(1, 2).contiguous().transpose(1, 2), w))  # rows not in unit stride
    torch_only(lambda: batched_matmul(a, torch.randn(12, 3, 9).transpose(0, 1)))  # entries not dense matrices
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch_only(lambda: batched_matmul(a, w))
    out = torch.func.vmap(lambda x: batched_matmul(x, w))(a.unsqueeze(0).expand(2, -1, -1, -1))
    assert (out - torch.bmm(a, w)).abs().max().item() < 1e-5
    monkeypatch.setitem(TABLE, "onednn_min_product_flops", Measured(2 * 5 * 12 * 9 + 1, "a test"))
    torch_only(lambda: batched_matmul(a, w))  # too small a product to pay for a oneDNN call
    monkeypatch.setitem(TABLE, "onednn_min_product_flops", Measured(1, "a test"))
    monkeypatch.setitem(TABLE, "onednn_min_batch_flops", Measured(3 * 2 * 5 * 12 * 9 + 1, "a test"))
    torch_only(lambda: batched_matmul(a, w))  # too little work in all
    monkeypatch.setitem(TABLE, "onednn_min_batch_flops", Measured(1, "a test"))
    onednn_cpus(monkeypatch, this_cpu=False)  # oneDNN slower than MKL on this CPU
    torch_only(lambda: batched_matmul(a, w))


@pytest.fixture
def fresh_probe():
    """onednn_outruns_mkl as in a new process with autotuning on: nothing timed yet. (The probe's answer is kept for
    the process, and only a new process forgets it publicly: the cache of the private _timed_choice is cleared
    instead of starting an interpreter per test.)"""
    onednn_module._timed_choice.cache_clear()
    previous = set_autotune(True)
    yield
    set_autotune(previous)
    onednn_module._timed_choice.cache_clear()


MKLDNN = torch.backends.mkldnn.is_available()


def ops_and_probe_runs(fn) -> tuple[set[str], int]:
    """The operators ``fn()`` ran and how many of them were the probe's products (PROBE_SHAPE's rows through its
    weight, in MKL or oneDNN: none unless the two were timed), seen by torch's profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    rows, inner, _ = PROBE_SHAPE
    probe = [event for event in prof.events() if event.name in ("aten::mm", ONEDNN)
             and event.input_shapes[:1] == [[rows, inner]]]
    return {event.name for event in prof.events()}, len(probe)


def probe_runs(fn) -> int:
    """How many of the probe's products ``fn()`` ran (:func:`ops_and_probe_runs`)."""
    return ops_and_probe_runs(fn)[1]


@pytest.mark.parametrize(("cpu", "onednn"), [
    (("AuthenticAMD", 26, True), True), (("AuthenticAMD", 25, False), True), (("AuthenticAMD", 25, True), True),
    (("AuthenticAMD", 23, False), False), (("GenuineIntel", 6, True), False), (("GenuineIntel", 6, False), False),
    (("", 0, False), False)])
def test_onednn_outruns_mkl_by_the_cpu_without_timing(cpu, onednn, monkeypatch):
    """By default nothing is timed: oneDNN on the CPUs the tuning table names (AMD's Zen 3, Zen 4 and Zen 5), MKL on
    Intel's and older AMD's."""
    # CI runs on one CPU: the others are simulated where the module reads the CPU's signature
    monkeypatch.setattr(onednn_module, "cpu_signature", lambda: cpu)
    assert not autotune_enabled()
    answers = []
    assert probe_runs(lambda: answers.append(onednn_outruns_mkl())) == 0  # nothing timed
    assert answers == [onednn and MKLDNN]


def fake_clock(seconds: list[float]):
    """A time.perf_counter that reads ``seconds[i]`` between the start and the end of the i-th timed run (each run
    reads the clock twice) and never goes back. (Real runs cannot be told apart by a chosen margin: the clock is
    simulated.)"""
    reads = []

    def perf_counter() -> float:
        runs, end = divmod(len(reads), 2)
        reads.append(runs)
        return sum(seconds[:runs]) + (seconds[runs] if end else 0.0)

    return perf_counter, reads


@pytest.mark.parametrize(("mkl_seconds", "onednn_seconds", "expected"),
                         [(1.0, 0.5, True), (1.0, 0.8, True), (1.0, 0.81, False), (1.0, 1.2, False)])
def test_onednn_outruns_mkl_where_timed_clearly_faster(mkl_seconds, onednn_seconds, expected, fresh_probe,
                                                       monkeypatch):
    """The probe takes the fastest of 3 timed runs of each library, MKL's first: oneDNN is chosen where it takes at
    most the table's onednn_margin (0.8) of MKL's time, and the choice is timed once per process."""
    perf_counter, reads = fake_clock([mkl_seconds] * 3 + [onednn_seconds] * 3)
    monkeypatch.setattr(onednn_module, "time", types.SimpleNamespace(perf_counter=perf_counter))
    answers = []
    # each library's product once untimed and 3 times timed
    assert probe_runs(lambda: answers.append(onednn_outruns_mkl())) == (8 if MKLDNN else 0)
    assert probe_runs(lambda: answers.append(onednn_outruns_mkl())) == 0  # timed once per process
    assert answers == [expected and MKLDNN] * 2
    assert len(reads) == (12 if MKLDNN else 0)  # 3 timed runs of each library, 2 clock reads each


def test_the_probe_times_both_libraries_on_its_own_float32_cpu_tensors(fresh_probe):
    """Whatever the caller's default dtype, autocast and generator: float32 products in both libraries, nothing
    cast, no random draw."""
    rng = torch.get_rng_state()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            called = kernels_called(onednn_outruns_mkl)
    finally:
        torch.set_default_dtype(previous)
    assert isinstance(onednn_outruns_mkl(), bool)
    assert torch.equal(torch.get_rng_state(), rng)
    if MKLDNN:
        assert {"aten::mm", ONEDNN} <= called and "aten::_to_copy" not in called


def test_products_that_cannot_take_onednn_never_time_it(fresh_probe, monkeypatch):
    """A vmapped layer, a float64 layer, products too small: torch's products, and no probe (it would time two
    products for nothing, and draw nothing under vmap's randomness rules)."""
    monkeypatch.setitem(TABLE, "onednn_min_product_flops", Measured(1, "a test"))
    monkeypatch.setitem(TABLE, "onednn_min_batch_flops", Measured(1, "a test"))
    torch.manual_seed(0)
    layer = SoftMoE(12, 4, 2, expert_hidden=10)  # under vmap: the reference backend, MLPExperts.forward
    x = torch.randn(3, 7, 12)
    outputs = {}

    def run():
        outputs["per_input"] = torch.func.vmap(layer)(x.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            outputs["want"] = copy.deepcopy(layer).double()(x.double())  # float64: torch's products

    called, probes = ops_and_probe_runs(run)
    assert probes == 0 and ONEDNN not in called and called & {"aten::bmm", "aten::baddbmm"}
    assert (outputs["per_input"].double() - outputs["want"]).abs().max().item() < 1e-5
    monkeypatch.setitem(TABLE, "onednn_min_batch_flops", Measured(1 << 40, "a test"))
    # too little work in all: the slot formulation in batched products, which the auto backend runs for this layer
    # too; on the slot backend with the routing in torch's ops (the native routing's products, which pass the
    # lowered per-product minimum, are tested with oneDNN in test_native_routing)
    with torch.no_grad():
        assert layer.backend_for(x).backend.mixing(layer, x) == "slots"
        layer.backend = "slots"
        called, probes = ops_and_probe_runs(lambda: outputs.update(got=layer(x)))
        assert probes == 0 and ONEDNN not in called and called & {"aten::bmm", "aten::baddbmm"}
        assert (outputs["got"].double() - outputs["want"]).abs().max().item() < 1e-5


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("slots_per_expert", [1, 2])
@pytest.mark.skipif(not native_available(), reason="the cpu backend needs the native build")
def test_the_cpu_backends_slot_formulation_with_onednn_products_matches_float64(
    activation, slots_per_expert, onednn_products
):
    """The "cpu" backend's slot formulation runs its expert products, forward and backward, in oneDNN (the "slots"
    backend in torch's): output and every gradient against the same layer in float64 (torch's products)."""
    torch.manual_seed(3)
    layer = SoftMoE(12, 4, slots_per_expert, expert_hidden=10, activation=activation, backend="cpu")
    x, grad = torch.randn(3, 9, 12), torch.randn(3, 9, 12)  # 9 tokens: not the fused kernel
    assert layer.backend_for(x).backend.mixing(layer, x) == "slots"
    out = layer(x.requires_grad_(True))
    assert ONEDNN in kernels_called(lambda: out.backward(grad))  # the backward's products too
    got = output_and_gradients(layer, x, grad)
    ref = copy.deepcopy(layer).double()
    ref.backend = "reference"
    want = output_and_gradients(ref, x.double(), grad.double())
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5
    with torch.no_grad():
        assert ONEDNN in kernels_called(lambda: layer(x))
        assert (layer(x).double() - want[0]).abs().max().item() < 1e-5
        layer.backend = "slots"
        assert ONEDNN not in kernels_called(lambda: layer(x))
        assert (layer(x).double() - want[0]).abs().max().item() < 1e-5
