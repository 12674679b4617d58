"""The routers under torch.compile: dynamic batch sizes, one graph, no host synchronization, the eager results.

Every router of the registry (plus Token Choice with Batch Priority Routing and vmoe-style "ceil" capacities with a
non-dyadic factor) is compiled with ``fullgraph=True`` (a data-dependent conversion such as ``float(tensor)`` or
``.item()``, or an op whose output size depends on the data, would fail it) and fed several batch sizes: outputs,
auxiliary losses and statistics equal eager ones, and the layer compiles once with ``dynamic=True`` (twice with the
default ``dynamic=None``: static shapes first, then dynamic ones). Most tests use the "eager" / "aot_eager"
backends, which trace exactly as inductor does but skip code generation; one test runs the default inductor backend.
The capacity of a symbolic number of tokens is checked against vmoe's float formula on a few thousand sizes.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch._dynamo
from torch._dynamo.backends.registry import lookup_backend

from softmoe.routing import (
    ROUTERS,
    ExpertChoiceRouter,
    MoELayer,
    TokenChoiceRouter,
    buffer_capacity,
    make_router,
)

DIM, EXPERTS, TOKENS = 6, 4, 5
BATCHES = (4, 6, 9)
FEW_ITERATIONS = {"sinkhorn_iterations": 2}  # tracing time grows with the unrolled solver loops; results do not care


def _registry_router(name: str, c: int, **options):
    def build():
        extra = dict(options)
        if "sinkhorn" in name:
            extra.update(FEW_ITERATIONS)
        if name.startswith("sparsity"):
            extra["sparse_iterations"] = 2
        return make_router(name, DIM, EXPERTS, c, tokens_per_image=TOKENS, **extra)

    return build


REGISTRY_CASES = {
    "softmax_token_choice_top1": _registry_router("softmax_token_choice", 1),
    "sinkhorn_token_choice_top2": _registry_router("sinkhorn_token_choice", 2),
    "softmax_expert_choice": _registry_router("softmax_expert_choice", 2),
    "sinkhorn_expert_choice": _registry_router("sinkhorn_expert_choice", 2),
    "sparsity_constrained_expert_choice": _registry_router("sparsity_constrained_expert_choice", 2),
    "soft_moe": _registry_router("soft_moe", 1),
}
VARIANT_CASES = {
    "softmax_token_choice_top2_bpr": _registry_router("softmax_token_choice", 2, batch_priority=True),
    # vmoe's sparse-MoE capacity: ceil(k T 1.1 / E) rounded up to a multiple of 4 (symbolic float ops and Mod).
    "token_choice_ceil_multiple_of_4": lambda: TokenChoiceRouter(
        DIM, EXPERTS, k=2, capacity_factor=1.1, rounding="ceil", multiple_of=4
    ),
    "expert_choice_ceil_multiple_of_4": lambda: ExpertChoiceRouter(
        DIM, EXPERTS, capacity_factor=1.1, rounding="ceil", multiple_of=4
    ),
}
CASES = {**REGISTRY_CASES, **VARIANT_CASES}
# The registry's routers in training and evaluation mode, the variants (top-2 with Batch Priority Routing, vmoe's
# ceil capacities) in training mode (evaluation only drops the noise, already covered by the registry's routers).
LAYER_RUNS = [(case, training) for case in REGISTRY_CASES for training in (True, False)]
LAYER_RUNS += [(case, True) for case in VARIANT_CASES]


def test_every_registry_router_is_covered():
    covered = {name for name in ROUTERS if any(case.startswith(name) for case in CASES)}
    assert covered == set(ROUTERS)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is handed (one per compilation of a frame) and passes
    them to a registered backend."""

    def __init__(self, backend: str = "eager") -> None:
        self.backend, self.graphs = lookup_backend(backend), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def _layer(case: str, training: bool) -> MoELayer:
    torch.manual_seed(0)
    return MoELayer(DIM, CASES[case](), 8).train(training)


def _run(layer: MoELayer, x: torch.Tensor, seed: int):
    """Output, total and per-name auxiliary losses and statistics of one forward with the noise seeded."""
    torch.manual_seed(seed)
    out = layer(x)
    return out, layer.auxiliary_loss, dict(layer.auxiliary_losses), dict(layer.last_stats)


def _assert_same(compiled, eager) -> None:
    out, loss, losses, stats = compiled
    ref_out, ref_loss, ref_losses, ref_stats = eager
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(loss, ref_loss)
    assert losses.keys() == ref_losses.keys() and stats.keys() == ref_stats.keys()
    for name in losses:
        torch.testing.assert_close(losses[name], ref_losses[name])
    for name in stats:
        assert stats[name].dtype == torch.float64 and stats[name].dim() == 0
        torch.testing.assert_close(stats[name], ref_stats[name], rtol=0, atol=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """A clean compilation cache around every test, and torch's structured-trace logger kept to its own handler:
    pytest's log capture attaches to it, and formatting and storing its large per-compilation-step records would
    make the compile tests a third slower."""
    logger = logging.getLogger("torch.__trace")
    handlers = logger.handlers[:]
    logger.handlers = [h for h in handlers if not type(h).__module__.startswith("_pytest")]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
    logger.handlers = handlers


# ---------------------------------------------------------------- capacity with symbolic sizes

CAPACITY_CONFIGS = [
    # (num_experts, capacity_factor, k, rounding, multiple_of)
    (10, 1.1, 1, "ceil", 1),  # 100 * 1.1 / 10 = 11.000000000000002 -> 12
    (1, 1.1, 3, "ceil", 1),
    (1, 0.7, 1, "round", 1),  # 45 * 0.7 = 31.499999999999996 -> 31
    (7, 1 / 3, 2, "round", 4),
    (32, 1.0, 1, "round", 1),  # round half to even: 16 / 32 = 0.5 -> 0 raises, 48 / 32 = 1.5 -> 2
    (4, 2.0, 1, "round", 1),
    (10, 1.1, 2, "ceil", 5),
]


def _eager_capacity(n, experts, factor, k, rounding, multiple_of):
    try:
        return buffer_capacity(n, experts, factor, k=k, rounding=rounding, multiple_of=multiple_of, maximum=n)
    except ValueError:
        return None


@pytest.mark.slow
@pytest.mark.parametrize("config", CAPACITY_CONFIGS, ids=lambda c: "-".join(map(str, c)))
def test_symbolic_capacity_equals_the_float_formula(config):
    """The capacity of a SymInt number of tokens is the int of vmoe's float formula for every size, in one graph."""
    experts, factor, k, rounding, multiple_of = config

    def sized(x):
        n = x.shape[0]
        return x.new_zeros(buffer_capacity(n, experts, factor, k=k, rounding=rounding, multiple_of=multiple_of,
                                           maximum=n))

    backend = CountingBackend()
    compiled = torch.compile(sized, backend=backend, dynamic=True, fullgraph=True)
    sizes = [n for n in range(2, 301) if _eager_capacity(n, *config) is not None]
    for n in sizes:
        assert compiled(torch.zeros(n)).shape[0] == _eager_capacity(n, *config), n
    assert backend.graphs == 1
    # A size whose capacity rounds to 0 fails the graph's guard and raises the eager ValueError (with fullgraph=True
    # dynamo reports any exception raised in the traced code as an Unsupported one).
    small = next((n for n in range(2, 301) if _eager_capacity(n, *config) is None), None)
    if small is not None:
        with pytest.raises(ValueError, match=f"num_tokens = {small}, .* it must be >= 1"):
            torch.compile(sized, backend="eager", dynamic=True)(torch.zeros(small))


# ---------------------------------------------------------------- the layer, every router


@pytest.mark.slow
@pytest.mark.parametrize(("case", "training"), LAYER_RUNS, ids=[f"{c}-{('eval', 'train')[t]}" for c, t in LAYER_RUNS])
def test_layer_compiles_once_for_every_batch_size(case, training):
    layer = _layer(case, training)
    backend = CountingBackend("eager")
    compiled = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)
    for i, batch in enumerate(BATCHES):
        x = torch.randn(batch, TOKENS, DIM)
        _assert_same(_run(compiled, x, seed=i), _run(layer, x, seed=i))
    assert backend.graphs == 1


@pytest.mark.slow
def test_default_dynamic_recompiles_once():
    """dynamic=None (the default): a static graph for the first batch size, then one dynamic graph for the rest
    (Sinkhorn Expert Choice: a static and a symbolic expert marginal T / E)."""
    layer = _layer("sinkhorn_expert_choice", training=False)
    backend = CountingBackend("eager")
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    for i, batch in enumerate(BATCHES):
        x = torch.randn(batch, TOKENS, DIM)
        _assert_same(_run(compiled, x, seed=i), _run(layer, x, seed=i))
    assert backend.graphs == 2


@pytest.mark.slow
def test_compiled_training_step_equals_eager():
    """aot_eager traces the backward too: the gradients of the gate and the experts equal eager ones (Softmax Token
    Choice top-2 with noise: the importance and load losses)."""
    case = "softmax_token_choice_top2_bpr"
    layer = _layer(case, training=True)
    twin = _layer(case, training=True)
    compiled = torch.compile(twin, backend=CountingBackend("aot_eager"), dynamic=True, fullgraph=True)
    for i, batch in enumerate(BATCHES[:3]):
        x = torch.randn(batch, TOKENS, DIM)
        results = []
        for model in (compiled, layer):
            model.zero_grad(set_to_none=True)
            result = _run(model, x, seed=i)
            (result[0].square().mean() + result[1]).backward()
            results.append(result)
        _assert_same(*results)
        for (name, p), q in zip(layer.named_parameters(), twin.parameters()):
            torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.slow
def test_groups_of_images_compile():
    """group_size: the groups and a remainder group; only a change in the remainder's presence recompiles."""
    torch.manual_seed(0)
    layer = MoELayer(DIM, ExpertChoiceRouter(DIM, EXPERTS, capacity_factor=2), 8, group_size=2).eval()
    backend = CountingBackend("eager")
    compiled = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)
    for batch in (4, 6, 5):
        x = torch.randn(batch, TOKENS, DIM)
        _assert_same(_run(compiled, x, seed=0), _run(layer, x, seed=0))
    assert backend.graphs == 2


@pytest.mark.slow
def test_inductor():
    """The default backend (inductor) for inference, on Token Choice top-2 with vmoe's "ceil" capacity at c = 1.1:
    one dynamic graph, the eager outputs, and the eager capacity where the float formula overshoots.

    Inductor sizes its buffers with the size expressions printed into its generated code; for T = 100 tokens
    (batch 20) the capacity is ceil(2 * 100 * 1.1 / 4) = ceil(55.00000000000001) = 56, not 55, which the fill
    statistic (filled slots / (E * C)) shows. No batch priority: inductor's C++ code generation (torch 2.13, g++ 12)
    failed on the vectorized bounds check of a gather by the identity order, which token_choice_allocation skips."""
    torch.manual_seed(0)
    router = TokenChoiceRouter(DIM, EXPERTS, k=2, capacity_factor=1.1, rounding="ceil")
    layer = MoELayer(DIM, router, 8).eval()
    assert 2 * 100 * 1.1 / 4 == 55.00000000000001 and router.capacity(100) == 56
    backend = CountingBackend("inductor")
    compiled = torch.compile(layer, backend=backend, dynamic=True, fullgraph=True)
    with torch.no_grad():
        for i, batch in enumerate((4, 20, 6)):
            x = torch.randn(batch, TOKENS, DIM)
            result = _run(compiled, x, seed=i)
            _assert_same(result, _run(layer, x, seed=i))
            [routing] = layer.route(x)
            slots = EXPERTS * router.capacity(batch * TOKENS)
            assert float(result[3]["fill"]) == int(routing.filled().sum()) / slots
    # One frame compiled once; inductor may restart dynamo's analysis once (specializing a Python float), which
    # hands the backend a second graph for the same compilation, never one per batch size.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert backend.graphs <= 2


# ---------------------------------------------------------------- no host synchronization in the forward


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_forward_never_reads_a_tensor_back(monkeypatch, training):
    """Eager mode: every conversion of a tensor to a Python number raises during the forward (a host sync on an
    accelerator); the statistics stay tensors."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("host synchronization in the forward")

    layers = {case: _layer(case, training) for case in CASES}
    xs = [torch.randn(batch, TOKENS, DIM) for batch in (3, 4)]
    with monkeypatch.context() as patch:
        for method in ("item", "tolist", "__float__", "__int__", "__index__", "__bool__"):
            patch.setattr(torch.Tensor, method, refuse)
        with pytest.raises(AssertionError, match="host synchronization"):
            float(torch.ones(()))  # the patch is in force
        for layer in layers.values():
            for x in xs:
                layer(x)
                assert all(isinstance(v, torch.Tensor) for v in layer.last_stats.values())
    for case, layer in layers.items():
        stats = layer.last_stats
        if case == "soft_moe":
            assert stats == {}
        else:
            assert set(stats) == {"dropped", "fill"}
            assert all(v.dtype == torch.float64 and v.dim() == 0 and not v.requires_grad for v in stats.values())
            assert 0 <= float(stats["dropped"]) <= 1 and 0 < float(stats["fill"]) <= 1
