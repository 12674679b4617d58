"""torch.compile over the Soft MoE layer and Algorithm 1: full graphs, no recompilation for new selections, the
softmoe custom ops kept in the graph, and outputs equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch._inductor.compile_fx import compile_fx

from reference import GROUPED_PRODUCTS
from softmoe import SoftMoE, select_experts
from softmoe.kernels import native_available, native_status
from softmoe.models.vit import ViT


class Recorder:
    """A torch.compile backend that keeps every graph it is given, then compiles it with inductor (or not)."""

    def __init__(self, inductor: bool = False) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inductor = inductor

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return compile_fx(gm, example_inputs) if self.inductor else gm.forward

    def ops(self) -> set[str]:
        """The operators called in the graphs, by name without the overload ("softmoe.grouped_mm", "aten.mm")."""
        names = {str(node.target) for gm in self.graphs for node in gm.graph.nodes if node.op == "call_function"}
        return {name.removesuffix(".default") for name in names}


def small_moe_vit() -> ViT:
    torch.manual_seed(0)
    return ViT(
        image_size=16, patch_size=4, in_channels=3, num_classes=10, dim=32, depth=2, heads=2, mlp_dim=64,
        classifier="gap", moe_blocks=(1,), num_experts=8, slots_per_expert=1, expert_hidden=64,
    ).eval()


@pytest.mark.slow
@pytest.mark.parametrize(
    "selection",
    [dict(k=2, plan="selected"), dict(strategy="mass", tau=0.3, plan="selected"),
     dict(strategy="budget", k=3, plan="selected"), dict(k=2)],
    ids=["algorithm1", "mass", "budget", "algorithm1-auto"],
)
def test_algorithm1_on_a_soft_moe_vit_compiles_once_with_fullgraph(selection):
    """select_experts inference compiled with fullgraph (inductor): 20 random inputs, each with its own pattern of
    selected experts (and, for the adaptive strategies, of expert counts), take at most 2 compilations and give
    eager's outputs; the selected plan keeps the grouped products in the graph, the auto plan (dense for this small
    model, decided from shapes alone under compile) does not."""
    model = small_moe_vit()
    eager = copy.deepcopy(model)  # watched by a hook that records each input's selection (a host read)
    patterns = set()

    def record(layer, args, output):
        patterns.add(repr(layer.selector.select(layer.route(args[0]).combine).tolist()))

    eager.moe_layers()[0].register_forward_hook(record)
    recorder = Recorder(inductor=True)
    compiled = torch.compile(model, backend=recorder, fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad(), select_experts(model, **selection), select_experts(eager, **selection):
        for _ in range(20):
            images = torch.randn(4, 3, 16, 16, generator=generator)
            torch.testing.assert_close(compiled(images), eager(images), atol=1e-5, rtol=1e-5)
    assert len(recorder.graphs) <= 2
    grouped = {name.replace("::", ".") for name in GROUPED_PRODUCTS}
    assert bool(grouped & recorder.ops()) == (selection.get("plan") == "selected")
    assert len(patterns) > 1  # the inputs really did select different experts


@pytest.mark.slow
@pytest.mark.parametrize(
    "custom, backend, plan",
    [(False, "auto", "auto"), (True, "auto", "auto"), (False, "reference", "selected")],
    ids=["mlp", "custom", "mlp-reference-selected"],
)
def test_forward_selected_compiles_with_fullgraph_and_matches_eager(custom, backend, plan):
    torch.manual_seed(2)
    expert = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)) if custom else None
    layer = SoftMoE(8, 6, 2, expert_hidden=16, expert=expert, backend=backend).eval()
    recorder = Recorder()
    compiled = torch.compile(layer.forward_selected, backend=recorder, fullgraph=True)
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed))
            selected = torch.randperm(6, generator=torch.Generator().manual_seed(seed))[:2].sort().values.expand(3, 2)
            want = layer.forward_selected(x, selected, plan=plan)
            torch.testing.assert_close(compiled(x, selected.contiguous(), plan=plan), want)
    assert len(recorder.graphs) == 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "slots", "tokens"])
def test_every_torch_backend_compiles_with_fullgraph(backend):
    torch.manual_seed(3)
    layer = SoftMoE(8, 4, 2, expert_hidden=16, backend=backend)
    x = torch.randn(3, 5, 8, requires_grad=True)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    got = compiled(x)
    want = layer(x)
    torch.testing.assert_close(got, want)
    (grad_got,) = torch.autograd.grad(got.square().sum(), x)
    (grad_want,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(grad_got, grad_want)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, tokens, op",
    [
        (dict(dim=196, num_experts=32, expert_hidden=24, activation="relu"), 4, "softmoe.soft_moe_mixing_inference"),
        (dict(dim=64, num_experts=2, slots_per_expert=8, expert_hidden=4096), 64, "softmoe.expert_matmul"),
    ],
    ids=["fused-mixing", "expert-matmul"],
)
def test_compiled_layer_keeps_the_native_op_in_its_graph(kwargs, tokens, op):
    """Under torch.compile the "auto" backend still picks the native ops, which stay in the graph as custom ops
    (inference runs the same op as eager inference), forward and backward; the routing's too."""
    if not native_available():
        pytest.skip(native_status())
    torch.manual_seed(4)
    layer = SoftMoE(**kwargs)
    x = torch.randn(2, tokens, kwargs["dim"])
    assert layer.backend_for(x).name == "cpu"
    recorder = Recorder()
    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)
    assert op in recorder.ops(), sorted(recorder.ops())
    assert "softmoe.soft_moe_routing" in recorder.ops(), sorted(recorder.ops())
    x.requires_grad_()
    (got,) = torch.autograd.grad(compiled(x).square().sum(), x)
    (want,) = torch.autograd.grad(layer(x).square().sum(), x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
