"""Algorithm 1's two plans (softmoe.selection_plan): the same output, and the cost model that picks between them."""

from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch
from torch import nn

import softmoe.selection_plan as plans
from reference import GROUPED_PRODUCTS
from softmoe import SoftMoE, select_experts
from softmoe.kernels import ISAS, supported_isas, use_isa
from softmoe.selection import masked_reference_forward
from softmoe.selection_plan import plan_costs
from softmoe.tuning import TABLE, Measured, autotune_enabled, set_autotune, value

F64 = torch.float64
CPU = torch.device("cpu")


def selected_runs(layer, fn):
    """``fn()``'s result and the groups (one per (input, kept expert) pair) of each selected-plan run of ``layer``'s
    experts it made: that plan runs the MLP experts as grouped products (GROUPED_PRODUCTS, the first on rows of
    the experts' input, seen by the profiler); the dense plan runs none."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        result = fn()
    first = list(layer.experts.weight1.shape)
    return result, [event.input_shapes[0][0] // layer.slots_per_expert for event in prof.events()
                    if event.name in GROUPED_PRODUCTS and event.input_shapes[1] == first]


@contextlib.contextmanager
def kernels_running(monkeypatch, isa):
    """The native kernels' variant ``isa`` for the block, through softmoe.kernels.use_isa. A CPU without it (CI's
    may lack AVX-512), or isa None (no native kernels, which no switch turns off in a process that has them), is
    simulated: the cost model's cpu_isa() answers ``isa``."""
    if isa is not None and isa in supported_isas():
        with use_isa(isa):
            yield
    else:
        with monkeypatch.context() as simulated:
            simulated.setattr(plans, "cpu_isa", lambda: isa)
            yield


def close_calls(monkeypatch, margin=0.63):
    """softmoe.tuning.TABLE's plan constants set so that this file's Algorithm 1 calls (8 experts, 1 slot, k = 2 of
    batch 2 or 3) are close ones, which autotuning times on the CPU: no cost per expert in use, so the selected
    plan's cost is its share of rows, 0.5 (batch 2) and 0.625 (batch 3) of the dense plan's at every row floor,
    within TIMING_BAND of ``margin`` (where both run selected). margin=6.3 makes them clear calls instead."""
    monkeypatch.setitem(TABLE, "plan_call_flops", Measured(0.0, "a test"))
    monkeypatch.setitem(TABLE, "plan_margin", Measured({"cpu": margin, "cuda": 0.4}, "a test"))


@pytest.fixture
def fresh_timings():
    """No plan timed before the test, and none kept after it (softmoe.selection_plan.forget_timed_plans)."""
    plans.forget_timed_plans()
    yield
    plans.forget_timed_plans()


def cheaper(*shape, kept=None):
    """The cost model's answer for (batch, k, n, p, flops per row, device) and the kept counts."""
    return plans.selected_plan_is_cheaper(plan_costs(*shape, kept=kept), shape[-1])


def make_layer(n=8, p=1, custom=False, seed=0):
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(12, 20), nn.GELU(), nn.Linear(20, 12)) if custom else None
    layer = SoftMoE(12, n, slots_per_expert=p, expert_hidden=20, expert=expert, dtype=F64)
    with torch.no_grad():
        layer.scale.fill_(4.0)
    return layer


@pytest.mark.parametrize("custom", [False, True])
@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("renormalize", [False, True])
def test_both_plans_equal_the_masked_reference(custom, p, renormalize):
    """Fixed k, unused places (-1) and padded tokens: "selected", "dense" and "auto" all give the paper's output."""
    layer = make_layer(p=p, custom=custom)
    x = torch.randn(3, 5, 12, dtype=F64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, -2:] = False
    selected = torch.tensor([[0, 3, 5], [2, -1, -1], [7, 1, -1]])
    want = masked_reference_forward(layer, x, selected, mask, renormalize)
    for plan in ("selected", "dense", "auto"):
        got = layer.forward_selected(x, selected, mask, renormalize, plan=plan)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


def test_both_plans_have_the_same_gradients():
    layer = make_layer()
    x = torch.randn(4, 6, 12, dtype=F64, requires_grad=True)
    selected = torch.tensor([[0, 1], [2, 7], [5, 3], [6, 4]])
    grads = []
    for plan in ("selected", "dense"):
        out = layer.forward_selected(x, selected, plan=plan)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *layer.parameters()]))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_the_dense_plan_runs_every_expert_and_the_selected_plan_only_the_kept():
    layer = make_layer()
    x = torch.randn(2, 5, 12, dtype=F64)
    with torch.no_grad(), select_experts(layer, k=2, plan="dense"):
        _, runs = selected_runs(layer, lambda: layer(x))
    assert runs == []  # the plain forward's mixing, every expert
    with torch.no_grad(), select_experts(layer, k=2, plan="selected"):
        _, runs = selected_runs(layer, lambda: layer(x))
    assert runs == [4]  # one run, on the 2 x 2 kept (input, expert) pairs


def test_cost_model_golden_values(monkeypatch):
    """Hand-worked: F = 1 (it cancels but for CALL_FLOPS, which F = 1e9 makes negligible), the floor 16 (AVX-512's
    16 lanes), ROW_OVERHEAD 2, margin 0.85, n = 8 experts, p = 1 (dense at batch 1, 4 and 16: 8 * (16 + 2) = 144).

    batch 1, k = 2: selected max(2, 2 * 16) + 2 * 2 = 36 against 144: 0.25 -> selected.
    batch 1, k = 6: 96 + 12 = 108: 0.75 -> selected; k = 7: 112 + 14 = 126: 0.875 -> dense.
    batch 4, k = 2, six experts in use: 96 + 12 = 108: 0.75 -> selected; every expert in use: 128 + 16 = 144: 1.0
    -> dense (the bound when the experts in use are not counted: min(8, 4 * 2) = 8).
    batch 16, k = 1, six experts in use: 108: 0.75 -> selected; k = 2 (eight): 144: 1.0 -> dense.
    batch 100, k = 6: max(600, 128) + 16 = 616 against 8 * (100 + 2) = 816: 0.755 -> selected; k = 7: 716: 0.877
    -> dense.
    """
    with kernels_running(monkeypatch, "avx512"):
        assert (plans.row_floor("cpu"), value("plan_row_overhead")["cpu"], value("plan_margin")["cpu"]) == (16, 2, 0.85)
        f = 1e9
        assert cheaper(1, 2, 8, 1, f, CPU)
        assert cheaper(1, 6, 8, 1, f, CPU)
        assert not cheaper(1, 7, 8, 1, f, CPU)
        assert cheaper(4, 2, 8, 1, f, CPU, kept=(8, 6))
        assert not cheaper(4, 2, 8, 1, f, CPU, kept=(8, 8))
        assert not cheaper(4, 2, 8, 1, f, CPU)
        assert cheaper(16, 1, 8, 1, f, CPU, kept=(16, 6))
        assert not cheaper(16, 2, 8, 1, f, CPU, kept=(32, 8))
        assert cheaper(100, 6, 8, 1, f, CPU)
        assert not cheaper(100, 7, 8, 1, f, CPU)


def test_cost_model_golden_values_with_avx2(monkeypatch):
    """As above with AVX2's floor of 8 rows (dense at batch 16: 8 * (16 + 2) = 144, at batch 4: 8 * (8 + 2) = 80).

    batch 16, k = 1, all eight experts in use: max(16, 8 * 8) + 16 = 80: 0.56 -> selected (a floor of 16 would give
    144: dense; measured on an AMD EPYC Zen 5, AVX2, the selected plan ran 1.89x as fast as all experts);
    k = 5: 80 + 16 = 96: 0.67 -> selected; k = 7: 112 + 16 = 128: 0.89 -> dense.
    batch 4, k = 3, eight in use: max(12, 64) + 16 = 80 against 80: dense.
    Without the native kernels the floor stays ROW_FLOOR's 16.
    """
    f = 1e9
    with kernels_running(monkeypatch, "avx2"):
        assert plans.row_floor("cpu") == 8 and plans.row_floor("cuda") == 0
        assert cheaper(16, 1, 8, 1, f, CPU, kept=(16, 8))
        assert cheaper(16, 5, 8, 1, f, CPU, kept=(80, 8))
        assert not cheaper(16, 7, 8, 1, f, CPU, kept=(112, 8))
        assert not cheaper(4, 3, 8, 1, f, CPU, kept=(12, 8))
    with kernels_running(monkeypatch, None):
        assert plans.row_floor("cpu") == value("plan_row_floor")["cpu"] == 16
        assert not cheaper(16, 1, 8, 1, f, CPU, kept=(16, 8))


def test_small_experts_run_dense_because_each_group_costs_a_call():
    """The paper's MNIST layer (n = 128 experts of hidden 6 on 196 dims): a group's bookkeeping (CALL_FLOPS) is
    worth thousands of its rows, so even k = 1 runs dense; a Table 3 expert (768 x 6144) at k = 1 runs selected."""
    mnist = 2 * (196 * 6 + 6 * 196)
    assert not cheaper(256, 1, 128, 1, mnist, CPU)
    table3 = 2 * (768 * 6144 * 2)
    assert cheaper(256, 1, 8, 1, table3, CPU)


def test_eager_cuda_runs_dense():
    assert not cheaper(1, 1, 8, 1, 1e9, torch.device("cuda"))


def test_compiled_cuda_selects_where_it_was_measured_faster():
    """Table 3's layer (8 experts of 768 -> 30720 -> 768, one slot each) compiled on an H100: the selected plan ran
    1.16-1.23x as fast as all experts at batch 1, k = 2, but not faster at k = 4 or 6, nor at batch 100. (The cost
    model's answers under torch.compile, which takes them while it traces.)"""
    cuda, table3 = torch.device("cuda"), 2 * (768 * 30720 * 2)

    @torch.compile(backend="eager", fullgraph=True)
    def compiled():
        return [cheaper(batch, k, 8, 1, table3, cuda) for batch in (1, 100) for k in (2, 4, 6)]

    assert compiled() == [True, False, False, False, False, False]
    assert not cheaper(1, 2, 8, 1, table3, cuda)  # eager: the dense plan


def test_timed_plan_takes_the_faster_run_and_remembers_it(monkeypatch, fresh_timings):
    """Each run is called once untimed and TIMED_ROUNDS times timed, between synchronizations, without gradients;
    the faster wins and is remembered per key (the same key is not timed again); forgetting times it anew."""
    syncs, calls = [], {"dense": 0, "selected": 0}
    # A spy: on the CPU a synchronization does nothing that could be observed (a GPU's would wait for its queue).
    monkeypatch.setattr(plans, "synchronize", syncs.append)

    def run(name, seconds):
        def call():
            assert not torch.is_grad_enabled()
            calls[name] += 1
            time.sleep(seconds)
        return call

    slow_dense = {"dense": run("dense", 0.004), "selected": run("selected", 0.0)}
    assert plans.timed_plan("key", slow_dense, CPU) == "selected"
    assert calls == {"dense": plans.TIMED_ROUNDS + 1, "selected": plans.TIMED_ROUNDS + 1}
    assert syncs == [CPU] * 4 * (plans.TIMED_ROUNDS + 1)
    slow_selected = {"dense": run("dense", 0.0), "selected": run("selected", 0.004)}
    assert plans.timed_plan("key", slow_selected, CPU) == "selected"  # remembered, not timed again
    assert calls["dense"] == plans.TIMED_ROUNDS + 1 and plans.timed_choice("key") == "selected"
    assert plans.timed_plan("other", slow_selected, CPU) == "dense"
    plans.forget_timed_plans()
    assert plans.timed_choice("key") is None
    assert plans.timed_plan("key", slow_selected, CPU) == "dense"


@pytest.mark.parametrize("ratio, chosen", [(0.95, "selected"), (0.975, "dense"), (1.05, "dense")])
def test_a_timed_plan_beats_the_default_only_by_the_margin(monkeypatch, fresh_timings, ratio, chosen):
    """Each call advances a fake clock by its plan's time: "selected" in `ratio` of "dense"'s time wins only at
    ratio <= TIMED_MARGIN (0.97). (Real runs cannot be timed to within these 2.5%: the clock is simulated.)"""
    clock = [0.0]
    monkeypatch.setattr(plans, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    def advance(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds)

    assert plans.timed_plan("key", {"dense": advance(1.0), "selected": advance(ratio)}, CPU) == chosen


@pytest.fixture
def autotune():
    """Autotuning on for one test (softmoe.tuning.set_autotune), off again after it."""
    previous = set_autotune(True)
    yield
    set_autotune(previous)


def record_timings(monkeypatch, plan: str) -> list:
    """Replace timed_plan with a stand-in that records each key it is asked for and answers ``plan``: which plan a
    real timing finds faster cannot be chosen, and these tests need each answer."""
    keys = []

    def timed_plan(key, runs, device):
        keys.append(key)
        return plan

    monkeypatch.setattr(plans, "timed_plan", timed_plan)
    return keys


@pytest.mark.parametrize("case", ["default", "training"])
def test_a_close_call_is_not_timed_by_default_nor_in_training(monkeypatch, case):
    """Autotuning is off unless turned on: plan "auto" is the cost model's, untimed, even for a close call, and the
    same in every process. With it on, a training layer is not timed either: timing runs the experts again, which in
    training would draw their dropout anew. (Timing would run the selected plan TIMED_ROUNDS + 1 more times.)"""
    if case == "default":
        assert not autotune_enabled()
        assert not plans.plans_are_timed(CPU) and not plans.plans_are_timed(torch.device("cuda"))
    else:
        previous = set_autotune(True)
    try:
        close_calls(monkeypatch)  # the selected plan's cost 0.625 of the dense one's against a margin of 0.63
        layer = make_layer().train(case == "training")
        x, selected = torch.randn(3, 5, 12, dtype=F64), torch.tensor([[0, 3], [2, 7], [7, 1]])
        assert plans.worth_timing(plan_costs(3, 2, 8, 1, plans.flops_per_row(layer.experts), CPU, kept=(6, 5)))
        with torch.no_grad():
            got, runs = selected_runs(layer, lambda: layer.forward_selected(x, selected))
            torch.testing.assert_close(got, masked_reference_forward(layer, x, selected), atol=1e-12, rtol=1e-12)
        assert runs == [6]  # the cost model's selected plan, once: nothing timed
        cheaper, runs = selected_runs(layer, lambda: plans.auto_plan(layer, x, selected) == "selected")
        assert cheaper and runs == []
    finally:
        if case == "training":
            set_autotune(previous)


@pytest.mark.parametrize("faster", ["dense", "selected"])
def test_auto_runs_the_plan_timed_faster_where_plans_are_timed(monkeypatch, autotune, faster):
    """With autotuning on and close calls (worth timing), "auto" runs the plan the timing names, with gradients, and
    the layer reports it; another batch size is another key."""
    close_calls(monkeypatch)
    keys = record_timings(monkeypatch, faster)
    layer = make_layer().eval()
    x = torch.randn(3, 5, 12, dtype=F64, requires_grad=True)
    selected = torch.tensor([[0, 3], [2, 7], [7, 1]])
    got, runs = selected_runs(layer, lambda: layer.forward_selected(x, selected))
    assert len(runs) == (faster == "selected") and (plans.auto_plan(layer, x, selected) == "selected") is (faster == "selected")
    torch.testing.assert_close(got, masked_reference_forward(layer, x, selected), atol=1e-12, rtol=1e-12)
    got.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    with torch.no_grad():
        layer.forward_selected(x[:2], selected[:2])
    assert len(set(keys)) == 2


def test_plans_are_timed_eagerly_on_cuda_and_cpu(autotune):
    cuda = torch.device("cuda")
    assert plans.plans_are_timed(CPU) and plans.plans_are_timed(cuda)
    assert not plans.plans_are_timed(torch.device("meta"))
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not plans.plans_are_timed(cuda) and not plans.plans_are_timed(CPU)  # the plans round differently
    finally:
        torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    assert plans.plans_are_timed(CPU)

    @torch.compile(backend="eager", fullgraph=True)
    def compiled():
        return plans.plans_are_timed(cuda), plans.plans_are_timed(CPU)

    assert compiled() == (False, False)


def test_only_close_calls_are_worth_timing_on_the_cpu():
    """On the CPU the shapes whose selected cost lies within a factor TIMING_BAND of MARGIN times the dense one."""
    band, margin = plans.TIMING_BAND, value("plan_margin")["cpu"]
    for ratio, worth in ((1.0, True), (band * 0.99, True), (1.01 / band, True), (band * 1.01, False),
                         (0.99 / band, False), (0.2, False), (3.0, False)):
        assert plans.worth_timing((ratio * margin * 10.0, 10.0)) is worth, ratio


@pytest.mark.parametrize("close", [False, True])
def test_the_cpu_times_close_calls_and_leaves_clear_ones_to_the_cost_model(monkeypatch, autotune, fresh_timings,
                                                                           close):
    """Eager CPU with autotuning on, plan "auto": a close call is timed once (each plan TIMED_ROUNDS + 1 times, then
    the faster runs), a clear one runs the cost model's plan untimed; the output is Algorithm 1's either way."""
    close_calls(monkeypatch, 0.63 if close else 6.3)  # the selected plan's cost 0.625 of the dense one's
    layer = make_layer().eval()
    x = torch.randn(3, 5, 12, dtype=F64)
    selected = torch.tensor([[0, 3], [2, 7], [7, 1]])
    with torch.no_grad():
        got, runs = selected_runs(layer, lambda: layer.forward_selected(x, selected))
    torch.testing.assert_close(got, masked_reference_forward(layer, x, selected), atol=1e-12, rtol=1e-12)
    chose_selected = plans.auto_plan(layer, x, selected) == "selected"  # (for a timed shape, the timing's answer)
    if close:
        assert len(runs) == plans.TIMED_ROUNDS + 1 + chose_selected
    else:
        assert chose_selected and runs == [6]  # the cost model's selected plan, once
    with torch.no_grad():
        _, runs = selected_runs(layer, lambda: layer.forward_selected(x, selected))
    assert len(runs) == chose_selected  # not timed again


def test_a_timed_shape_does_not_overrule_the_cost_model_for_a_clear_call(monkeypatch, autotune):
    """The timing key is the shape; the kept counts vary from batch to batch (-1 places, adaptive strategies). A
    close call (7 of 8 experts kept per input) is timed; a later batch of that shape keeping 1 of 8 is a clear
    call: the cost model's selected plan runs, not the plan timed for the close one."""
    keys = record_timings(monkeypatch, "dense")
    torch.manual_seed(0)
    layer = SoftMoE(128, 8, slots_per_expert=2, expert_hidden=1024).eval()
    x = torch.randn(64, 3, 128)
    most = torch.arange(8).repeat(64, 1)
    most[:, 7] = -1  # 7 of 8 kept: selected cost 1.2x the margin's, a close call
    few = torch.full((64, 8), -1)
    few[:, 0] = torch.arange(64) % 8  # 1 of 8 kept: 0.33x, a clear one
    with torch.no_grad():
        _, runs = selected_runs(layer, lambda: layer.forward_selected(x, most))
        assert len(keys) == 1 and runs == [] and plans.auto_plan(layer, x, most) == "dense"
        got, runs = selected_runs(layer, lambda: layer.forward_selected(x, few))
        torch.testing.assert_close(got, masked_reference_forward(layer, x, few), rtol=1e-5, atol=1e-5)
    assert runs == [64 * 8] and len(keys) == 2 and plans.auto_plan(layer, x, few) == "selected"  # (the second: "most")


def timed(layer, x, selected) -> bool:
    """Whether asking ``layer`` for its plan timed the plans (each TIMED_ROUNDS + 1 times): the first call with a
    new key (the shape, its settings and host) does, later ones with that key do not."""
    _, runs = selected_runs(layer, lambda: plans.auto_plan(layer, x, selected) == "selected")
    return len(runs) == plans.TIMED_ROUNDS + 1


def test_the_cpu_plan_key_tells_threads_and_instruction_sets_apart(monkeypatch, autotune, fresh_timings):
    close_calls(monkeypatch)
    layer = make_layer().eval()
    x, selected = torch.randn(2, 5, 12, dtype=F64), torch.tensor([[0, 1], [2, 3]])
    assert timed(layer, x, selected)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert timed(layer, x, selected)  # another key
    finally:
        torch.set_num_threads(threads)
    assert not timed(layer, x, selected)  # the first key again
    other = next(isa for isa in (*supported_isas(), *ISAS) if isa != plans.cpu_isa())  # one this CPU runs, if any
    with kernels_running(monkeypatch, other):
        assert timed(layer, x, selected)


def test_a_plan_that_runs_out_of_memory_loses(fresh_timings):
    calls = []

    def out_of_memory():
        calls.append("selected")
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert plans.timed_plan("key", {"dense": lambda: None, "selected": out_of_memory}, CPU) == "dense"
    assert calls == ["selected"]  # not run again once it ran out of memory
    with pytest.raises(torch.OutOfMemoryError, match="every plan of Algorithm 1 ran out of device memory"):
        plans.timed_plan("other", {"dense": out_of_memory, "selected": out_of_memory}, CPU)


def test_the_plan_key_tells_autocast_backends_and_expert_sizes_apart(monkeypatch, autotune):
    close_calls(monkeypatch)
    keys = record_timings(monkeypatch, "dense")  # (the swapped weight below could not run: keys, not timings)
    layer, wide = make_layer().eval(), SoftMoE(12, 8, expert_hidden=40, dtype=F64).eval()
    x, selected = torch.randn(2, 5, 12, dtype=F64), torch.tensor([[0, 1], [2, 3]])
    layer.backend = "slots"
    for model in (layer, layer, wide):
        plans.auto_plan(model, x, selected)
    assert keys[0] == keys[1] != keys[2]
    layer.backend = "tokens"  # (which runs under autocast)
    plans.auto_plan(layer, x, selected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plans.auto_plan(layer, x, selected)
    layer.experts.weight1 = nn.Parameter(torch.zeros(8, 12, 30, dtype=F64))  # a swapped weight of another shape
    plans.auto_plan(layer, x, selected)
    assert len(set(keys)) == 5


def test_a_shape_is_not_timed_where_synchronizing_is_unwelcome(monkeypatch, fresh_timings):
    """CUDA's sync debug mode set or a CUDA graph being captured: an untimed key gives None (the layer then takes
    the cost model's plan), a timed one its plan, without synchronizing. (CUDA simulated: CI has none.)"""
    slow = {"dense": lambda: time.sleep(0.004), "selected": lambda: None}
    assert plans.timed_plan("timed", slow, CPU) == "selected"
    monkeypatch.setattr(plans, "synchronize", lambda device: pytest.fail("synchronized"))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())  # no CUDA here
    runs = {"dense": lambda: None, "selected": lambda: None}
    for debug_mode, capturing in ((2, False), (0, True)):
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: debug_mode)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        assert not plans.may_synchronize(torch.device("cuda"))
        assert plans.timed_plan("untimed", runs, torch.device("cuda")) is None
        assert plans.timed_plan("timed", runs, torch.device("cuda")) == "selected"
    assert plans.timed_choice("untimed") is None


def test_auto_follows_the_cost_model(monkeypatch):
    layer = make_layer()
    x = torch.randn(2, 5, 12, dtype=F64)
    selected = torch.tensor([[0, 1], [1, 0]])
    for cheaper in (True, False):
        monkeypatch.setitem(TABLE, "plan_margin", Measured({"cpu": 1e9 if cheaper else 0.0, "cuda": 0.4}, "a test"))
        assert (plans.auto_plan(layer, x, selected) == "selected") is cheaper


def test_the_layer_counts_the_experts_in_use_on_cpu():
    """8 experts of 64 -> 4096 -> 64 (F = 2 * 528,448 FLOPs per row, so CALL_FLOPS = 1e7 is 9.5 rows), batch 4,
    k = 2: the 4 inputs agreeing on 2 experts cost max(8, 32) + 4 + 19 = 55 rows against 8 * 18 = 144 (selected);
    spread over all 8: 128 + 16 + 76 = 220 (dense)."""
    layer = SoftMoE(64, 8, expert_hidden=4096)
    x = torch.randn(4, 3, 64)
    assert plans.auto_plan(layer, x, torch.tensor([[2, 5]] * 4)) == "selected"
    assert plans.auto_plan(layer, x, torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])) == "dense"


def test_a_bad_plan_is_a_value_error():
    layer = make_layer()
    x = torch.randn(2, 5, 12, dtype=F64)
    with pytest.raises(ValueError, match=r"plan must be one of \('auto', 'selected', 'dense'\), got 'fast'"):
        layer.forward_selected(x, torch.tensor([[0], [1]]), plan="fast")
    with pytest.raises(ValueError, match="plan must be one of"):
        with select_experts(layer, k=1, plan="fast"):
            pass


@pytest.mark.parametrize("host", [True, False], ids=["host", "torch"])
def test_kept_counts_in_python_and_in_torch_agree_beside_the_mask(host):
    """Small selections (at most TABLE's "host_count_max_places" places) are counted in Python, larger ones with torch's
    bincount; both give the pairs kept and the experts in use (unused places -1 counted nowhere), as the mask says."""
    selected = torch.tensor([[0, 3, -1], [3, 5, 6], [-1, -1, 1], [6, 0, 3]])
    copies = 1 if host else value("host_count_max_places") // selected.numel() + 1
    selected = selected.repeat(copies, 1)
    assert (selected.numel() <= value("host_count_max_places")) is host
    want = torch.zeros(len(selected), 8, dtype=torch.bool)
    for b, row in enumerate(selected.tolist()):
        for j in row:
            if j >= 0:
                want[b, j] = True
    assert torch.equal(plans.mask_from_subsets(selected, 8), want)
    kept = (9 * copies, 5)  # 0, 1, 3, 5, 6
    assert plans.kept_counts(selected, 8) == (int(want.sum()), int(want.any(0).sum())) == kept
    assert plans.kept_counts(selected.t().contiguous().t(), 8) == kept  # a strided view
    assert plans.kept_counts(torch.zeros(0, 2, dtype=torch.int64), 8) == (0, 0)


def test_counts_decide_only_between_the_bands_edges():
    """The experts in use matter to the CPU's call only where the selected plan's costs at the fewest and at the
    most of them do not both lie above the timing band, or both below it."""
    margin, band = value("plan_margin")["cpu"], plans.TIMING_BAND
    dense = 100.0

    def costs(ratio):  # selected / (margin * dense)
        return ratio * margin * dense, dense

    assert not plans.counts_decide(costs(band * 1.1), costs(band * 3))  # dense either way
    assert not plans.counts_decide(costs(0.1), costs(0.9 / band))  # selected either way
    assert plans.counts_decide(costs(0.5), costs(2.0))  # selected at the fewest, dense at the most
    assert plans.counts_decide(costs(1.0), costs(1.0))  # a close call: timed on the counts' word


_TWO_PROCESSES = """
import sys, torch, softmoe
torch.manual_seed(0)
layer = softmoe.SoftMoE(64, 8, expert_hidden=4096).eval()
x = torch.randn(4, 3, 64)
with torch.no_grad(), softmoe.select_experts(layer, k=3):
    out = layer(x)
torch.save(out, sys.argv[1])
"""


@pytest.mark.slow
def test_algorithm1_gives_the_same_bits_in_another_process(tmp_path):
    """Nothing is timed by default, so a call whose plans are close gives the same bits in every process."""
    import subprocess
    import sys

    outputs = []
    for i in range(2):
        path = tmp_path / f"out{i}.pt"
        subprocess.run([sys.executable, "-c", _TWO_PROCESSES, str(path)], check=True)
        outputs.append(torch.load(path))
    assert torch.equal(outputs[0], outputs[1])


def test_every_backend_names_what_runs_each_step():
    from softmoe.backends import REGISTRY

    layer = make_layer()
    x = torch.randn(2, 5, 12, dtype=F64)
    for name in ("reference", "slots", "tokens"):
        steps = REGISTRY[name].steps(layer, x)
        assert set(steps) == {"route", "mix", "select"} and all(steps.values()), name
    float32 = SoftMoE(12, 8, expert_hidden=16)
    choice = float32.backend_for(x.float())
    assert set(choice.backend.steps(float32, x.float())) == {"route", "mix", "select"}
