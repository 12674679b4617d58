"""The layer and Algorithm 1 on every device at hand (CPU always, CUDA where there is one): outputs against a float64
CPU computation, the backend "auto" picks, selection drawn and run on the input's device."""

from __future__ import annotations

import copy

import pytest
import torch

from softmoe import SoftMoE, masked_reference_forward, select_experts, selection_plan
from softmoe.selection import top_k_by_combine
from softmoe.selection_plan import forget_timed_plans
from softmoe.tuning import set_autotune

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# float32 and bfloat16 against float64: relative error of the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def layer_pair(device: str, dtype: torch.dtype, **kwargs) -> tuple[SoftMoE, SoftMoE]:
    """A layer on ``device`` in ``dtype`` and the same weights in float64 on the CPU."""
    torch.manual_seed(0)
    exact = SoftMoE(16, 8, 2, expert_hidden=32, dtype=torch.float64, **kwargs).eval()
    return copy.deepcopy(exact).to(device=device, dtype=dtype), exact


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_layer_forward_and_backward_on_device(device, dtype):
    layer, exact = layer_pair(device, dtype)
    x64 = torch.randn(4, 10, 16, dtype=torch.float64)
    x = x64.to(device=device, dtype=dtype).requires_grad_()
    out = layer(x)
    choice = layer.backend_for(x)
    if device != "cpu":
        assert choice.name == "cuda" and set(choice.steps) == {"route", "mix", "select"}
    assert out.device.type == device and out.dtype == dtype
    assert relative(out.detach(), exact(x64)) < TOLERANCE[dtype]
    out.float().square().sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all() for p in layer.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("device", DEVICES)
def test_algorithm1_on_device_equals_the_masked_reference(device, dtype):
    layer, exact = layer_pair(device, dtype)
    x64 = torch.randn(5, 10, 16, dtype=torch.float64)
    selected = top_k_by_combine(exact.route(x64).combine, 3)
    with torch.no_grad():
        got = layer.forward_selected(x64.to(device=device, dtype=dtype), selected.to(device))
        want = masked_reference_forward(exact, x64, selected)
    assert got.device.type == device
    assert relative(got, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_random_subsets_are_drawn_on_the_inputs_device(device):
    layer, _ = layer_pair(device, torch.float32)
    x = torch.randn(6, 10, 16, device=device)
    seen = []
    layer.register_forward_hook(lambda module, args, out: seen.append(module.selector.generators))
    with torch.no_grad(), select_experts(layer, k=2, strategy="random", seed=3):
        first = layer(x)
    with torch.no_grad(), select_experts(layer, k=2, strategy="random", seed=3):
        again = layer(x)
    assert list(seen[0]) == [x.device]
    assert torch.equal(first, again)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_selection_on_cuda_never_waits_for_the_host(strategy):
    """Algorithm 1 in bf16 (dims multiples of 8: torch's grouped GEMM), forward and backward, with CUDA's sync
    debug mode set to raise on any synchronizing call."""
    layer, _ = layer_pair("cuda", torch.bfloat16)
    x = torch.randn(6, 10, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    previous = torch.cuda.get_sync_debug_mode()
    forget_timed_plans()
    tuning = set_autotune(False)
    try:
        for timed in (False, True):  # the cost model's plan, then with autotuning the plan timed faster
            if timed:
                set_autotune(True)
                with torch.no_grad(), select_experts(layer, k=3, strategy=strategy, seed=0):
                    layer(x)  # times both plans: synchronizes
                assert len(selection_plan._TIMED_PLANS) == 1
            torch.cuda.set_sync_debug_mode("error")
            try:
                with select_experts(layer, k=3, strategy=strategy, seed=0):
                    out = layer(x)
                out.float().square().sum().backward()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            assert torch.isfinite(x.grad).all() and torch.isfinite(layer.experts.weight1.grad).all()
    finally:
        set_autotune(tuning)
        forget_timed_plans()


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_algorithm1_on_eager_cuda_times_its_plans_once_per_shape(dtype):
    """With autotuning on, plan "auto" on eager CUDA times both plans at the first call of a shape, then runs the
    faster: every call equals the masked reference, and a second batch size is a second shape."""
    layer, exact = layer_pair("cuda", dtype)
    forget_timed_plans()
    previous = set_autotune(True)
    try:
        for batch, shapes in ((5, 1), (5, 1), (3, 2)):
            x64 = torch.randn(batch, 10, 16, dtype=torch.float64)
            selected = top_k_by_combine(exact.route(x64).combine, 3)
            with torch.no_grad():
                got = layer.forward_selected(x64.to(device="cuda", dtype=dtype), selected.to("cuda"))
                want = masked_reference_forward(exact, x64, selected)
            assert relative(got, want) < TOLERANCE[dtype]
            assert len(selection_plan._TIMED_PLANS) == shapes
            assert set(selection_plan._TIMED_PLANS.values()) <= {"dense", "selected"}
    finally:
        set_autotune(previous)
        forget_timed_plans()


@cuda
def test_algorithm1_compiles_on_cuda_with_fullgraph_and_matches_eager():
    layer, _ = layer_pair("cuda", torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad(), select_experts(layer, k=3):
        for _ in range(4):
            x = torch.randn(5, 10, 16, device="cuda", dtype=torch.bfloat16, generator=generator)
            torch.testing.assert_close(compiled(x), layer(x), atol=2e-2, rtol=2e-2)
