"""Tests of the SoftMoE layer against a slow reference written from Definition 1 / equation (1).

The layer's mixing step runs on one of its backends (``SoftMoE(backend=...)``, see softmoe.backends). In float64 on
CPU "auto" picks, by a cost model, the slot formulation ("slots") or the exact token-space rewrite ("tokens").
Every parity test runs on shapes where each of these is chosen, asserts which one ``layer.backend_for`` names, and
checks with a spy that it is the one actually run; other tests set the backend explicitly.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import softmoe.backends
from reference import kernels_called, ref_activation
from softmoe import MLPExperts, Routing, SoftMoE, StackedExperts, select_experts
from softmoe.backends import REGISTRY
from softmoe.backends.cuda import rms_norm_logits
from softmoe.backends.generic import token_space_mixing
from softmoe.kernels import native_available
from softmoe.layer import combine_slots, dispatch_slots, l2_normalize, soft_moe_logits, soft_moe_reference
from softmoe.runtime import cpu_signature
from softmoe.tuning import TABLE, Measured

F64 = torch.float64
EPS = 1e-6
PARITY_TOL = 1e-10

# Shapes where each code path is chosen for TOKENS tokens (asserted in every test that uses them):
# many experts with a tiny hidden size and few tokens -> token space; few experts with a big hidden size -> slots.
TOKENS = 5
PATH_CONFIGS = {
    "tokens": dict(dim=8, num_experts=6, expert_hidden=2),
    "slots": dict(dim=6, num_experts=3, expert_hidden=24),
}
# Tiny shapes for gradcheck (3 tokens, 2 slots per expert).
GRAD_TOKENS = 3
GRAD_CONFIGS = {
    "tokens": dict(dim=4, num_experts=4, slots_per_expert=2, expert_hidden=1),
    "slots": dict(dim=3, num_experts=2, slots_per_expert=2, expert_hidden=6),
}


# ----------------------------------------------------------------------------------------------------------------
# The slow, obviously correct reference: explicit Python loops over examples, tokens, experts and slots.
# ----------------------------------------------------------------------------------------------------------------




def ref_normalize(v: torch.Tensor) -> torch.Tensor:
    """v / sqrt(sum(v^2) + 1e-6) for a single vector (vmoe's, normalize="router")."""
    return v / torch.sqrt((v * v).sum() + EPS)


def ref_normalize_outside(v: torch.Tensor) -> torch.Tensor:
    """v / (sqrt(sum(v^2)) + 1e-6) for a single vector (the "Beyond Parameter Count" code, normalize="inputs")."""
    return v / (math.sqrt(float((v * v).sum())) + EPS)


def ref_slot_inputs(layer: SoftMoE, x: torch.Tensor) -> torch.Tensor:
    """The tokens the slots are built from, token by token: the normalized ones replace x for "inputs"."""
    x = x.detach().to(F64).clone()
    if layer.normalize == "inputs":
        for b in range(x.shape[0]):
            for m in range(x.shape[1]):
                x[b, m] = ref_normalize_outside(x[b, m])
    return x


def is_real(mask: torch.Tensor | None, b: int, m: int) -> bool:
    return mask is None or bool(mask[b, m])


def reference_routing(layer: SoftMoE, x: torch.Tensor, mask: torch.Tensor | None = None) -> Routing:
    """Logits, dispatch and combine from equation (1), each (batch, tokens, n, p), computed entry by entry."""
    x = ref_slot_inputs(layer, x)
    phi = layer.phi.detach().to(F64)
    batch, tokens, _ = x.shape
    n, p = layer.num_experts, layer.slots_per_expert
    logits = torch.zeros(batch, tokens, n, p, dtype=F64)
    for b in range(batch):
        for m in range(tokens):
            token = x[b, m]
            if layer.normalize == "router":
                token = ref_normalize(token)
            for j in range(n):
                for s in range(p):
                    column = phi[:, j, s]
                    if layer.normalize == "router":
                        column = ref_normalize(column) * layer.scale.detach().to(F64)
                    elif layer.normalize == "inputs":
                        column = ref_normalize_outside(column) * layer.scale.detach().to(F64)
                    logits[b, m, j, s] = torch.dot(token, column)
    dispatch = torch.zeros_like(logits)
    combine = torch.zeros_like(logits)
    for b in range(batch):
        # Dispatch: for each slot (j, s), a softmax over the real tokens of example b.
        for j in range(n):
            for s in range(p):
                real = [m for m in range(tokens) if is_real(mask, b, m)]
                if not real:
                    continue
                top = max(logits[b, m, j, s] for m in real)
                denominator = sum(torch.exp(logits[b, m, j, s] - top) for m in real)
                for m in real:
                    dispatch[b, m, j, s] = torch.exp(logits[b, m, j, s] - top) / denominator
        # Combine: for each real token m, a softmax over all n*p slots jointly.
        for m in range(tokens):
            if not is_real(mask, b, m):
                continue
            top = max(logits[b, m, j, s] for j in range(n) for s in range(p))
            denominator = sum(torch.exp(logits[b, m, j, s] - top) for j in range(n) for s in range(p))
            for j in range(n):
                for s in range(p):
                    combine[b, m, j, s] = torch.exp(logits[b, m, j, s] - top) / denominator
    return Routing(logits, dispatch, combine)


def mlp_expert_fn(experts: MLPExperts):
    """f_j(v) = act(v W1_j + b1_j) W2_j + b2_j for one vector v, from the stacked weights."""

    def f(j: int, v: torch.Tensor) -> torch.Tensor:
        h = v @ experts.weight1[j].detach().to(F64)
        if experts.bias1 is not None:
            h = h + experts.bias1[j].detach().to(F64)
        y = ref_activation(experts.activation, h) @ experts.weight2[j].detach().to(F64)
        if experts.bias2 is not None:
            y = y + experts.bias2[j].detach().to(F64)
        return y

    return f


def reference_forward(layer: SoftMoE, x: torch.Tensor, mask: torch.Tensor | None = None, expert_fn=None):
    """output = C Y~ with Y~[j, s] = f_j((D^T X)[j, s]), all by loops; the slots are built from the raw tokens
    ("router", "none") or from the normalized tokens that replace them ("inputs")."""
    if expert_fn is None:
        expert_fn = mlp_expert_fn(layer.experts)
    _, dispatch, combine = reference_routing(layer, x, mask)
    x = ref_slot_inputs(layer, x)
    batch, tokens, dim = x.shape
    n, p = layer.num_experts, layer.slots_per_expert
    out = torch.zeros(batch, tokens, layer.out_dim, dtype=F64)
    for b in range(batch):
        expert_out = {}
        for j in range(n):
            for s in range(p):
                slot = torch.zeros(dim, dtype=F64)
                for m in range(tokens):
                    slot = slot + dispatch[b, m, j, s] * x[b, m]
                expert_out[j, s] = expert_fn(j, slot)
        for m in range(tokens):
            row = torch.zeros(layer.out_dim, dtype=F64)
            for j in range(n):
                for s in range(p):
                    row = row + combine[b, m, j, s] * expert_out[j, s]
            out[b, m] = row
    return out


# ----------------------------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------------------------


def make_layer(path: str, slots_per_expert: int = 1, seed: int = 0, sharpen: bool = True, **overrides) -> SoftMoE:
    """A float64 layer whose shape makes ``path`` the chosen code path for TOKENS tokens.

    With ``sharpen`` phi is redrawn with a large std and ``scale`` set away from 1, so that routing is far from
    uniform and any mistake in a softmax axis, the normalization or the scale shows up in the output.
    """
    torch.manual_seed(seed)
    kwargs = {**PATH_CONFIGS[path], "slots_per_expert": slots_per_expert, "dtype": F64, **overrides}
    layer = SoftMoE(**kwargs)
    if sharpen:
        with torch.no_grad():
            layer.phi.normal_(0.0, 1.0)
            if layer.scale is not None:
                layer.scale.fill_(2.5)
    return layer


def make_mask(batch: int, tokens: int, seed: int = 1) -> torch.Tensor:
    """A bool mask with some padding in every example but at least one real token each."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, tokens, generator=gen) > 0.4
    mask[:, 0] = True
    mask[:, -1] = False
    return mask


def assert_ran(layer: SoftMoE, x: torch.Tensor, path: str) -> None:
    """The backend that runs ``layer``'s forward of x in the current mode is ``path`` (layer.backend_for, which the
    forward asks)."""
    ran = layer.backend_for(x).name
    assert ran == path, f"expected the {path} backend to run, ran {ran}"


def assert_path_chosen(layer: SoftMoE, tokens: int, path: str) -> None:
    """"auto" runs the ``path`` formulation for the shape: as that backend (float64), or as the "cpu" backend's
    mixing (float32, where the native ops serve), whose tests then run ``path`` itself."""
    x = torch.zeros(2, tokens, layer.dim, dtype=layer.phi.dtype)
    choice = layer.backend_for(x)
    ran = choice.backend.mixing(layer, x)
    assert ran == path, f"shape does not select the {path} formulation"


def force_path(layer: SoftMoE, path: str) -> None:
    layer.backend = path


# ----------------------------------------------------------------------------------------------------------------
# 1. Parity with the reference (both code paths)
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tokens", "slots"])
@pytest.mark.parametrize("normalize", ["router", "inputs", "none"])
@pytest.mark.parametrize("slots_per_expert", [1, 3])
@pytest.mark.parametrize("expert_bias", [True, False])
@pytest.mark.parametrize("use_mask", [False, True])
def test_forward_matches_reference(path, normalize, slots_per_expert, expert_bias, use_mask):
    activation = ["gelu", "gelu_tanh", "relu"][(slots_per_expert + expert_bias + 2 * use_mask) % 3]
    layer = make_layer(path, slots_per_expert, normalize=normalize, expert_bias=expert_bias, activation=activation)
    assert_path_chosen(layer, TOKENS, path)
    torch.manual_seed(1)
    x = torch.randn(2, TOKENS, layer.dim, dtype=F64) * 2.0
    mask = make_mask(2, TOKENS) if use_mask else None
    with torch.no_grad():
        out = layer(x, mask)
        assert_ran(layer, x, path)
    expected = reference_forward(layer, x, mask)
    assert out.shape == x.shape and out.dtype == F64
    assert (out - expected).abs().max().item() < PARITY_TOL
    if mask is not None:
        assert torch.all(out[~mask] == 0)


@pytest.mark.parametrize("path", ["tokens", "slots"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_forward_matches_reference_every_activation(path, activation):
    layer = make_layer(path, 2, activation=activation)
    assert_path_chosen(layer, TOKENS, path)
    torch.manual_seed(2)
    x = torch.randn(3, TOKENS, layer.dim, dtype=F64)
    mask = make_mask(3, TOKENS, seed=5)
    with torch.no_grad():
        out = layer(x, mask)
        assert_ran(layer, x, path)
    assert (out - reference_forward(layer, x, mask)).abs().max().item() < PARITY_TOL


@pytest.mark.parametrize("path", ["tokens", "slots"])
def test_paths_agree_on_same_layer(path, monkeypatch):
    """Forcing the other path on the same layer and input gives the same output and the same gradients."""
    layer = make_layer(path, 2)
    torch.manual_seed(3)
    x = torch.randn(2, TOKENS, layer.dim, dtype=F64, requires_grad=True)
    mask = make_mask(2, TOKENS)
    results = {}
    for forced in ("tokens", "slots"):
        force_path(layer, forced)
        layer.zero_grad()
        x.grad = None
        out = layer(x, mask)
        (out * torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)).sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        results[forced] = (out.detach(), grads)
    out_t, grads_t = results["tokens"]
    out_s, grads_s = results["slots"]
    assert (out_t - out_s).abs().max().item() < PARITY_TOL
    for g_t, g_s in zip(grads_t, grads_s, strict=True):
        assert (g_t - g_s).abs().max().item() < 1e-9


@pytest.mark.parametrize("normalize", ["router", "inputs", "none"])
@pytest.mark.parametrize("slots_per_expert", [1, 3])
@pytest.mark.parametrize("use_mask", [False, True])
def test_route_matches_reference(normalize, slots_per_expert, use_mask):
    layer = make_layer("slots", slots_per_expert, normalize=normalize)
    torch.manual_seed(4)
    x = torch.randn(2, TOKENS, layer.dim, dtype=F64) * 3.0
    mask = make_mask(2, TOKENS) if use_mask else None
    with torch.no_grad():
        routing = layer.route(x, mask)
    expected = reference_routing(layer, x, mask)
    assert isinstance(routing, Routing)
    shape = (2, TOKENS, layer.num_experts, slots_per_expert)
    for name in ("logits", "dispatch", "combine"):
        got, want = getattr(routing, name), getattr(expected, name)
        assert got.shape == shape, name
        assert got.dtype == F64, name
        assert (got - want).abs().max().item() < PARITY_TOL, name


def test_slots_use_raw_tokens_not_normalized():
    """With normalize=True the slots are D^T X of the raw tokens: scaling every token by c scales the slots by c."""
    layer = make_layer("slots", 2)
    torch.manual_seed(5)
    x = torch.randn(1, TOKENS, layer.dim, dtype=F64)
    with torch.no_grad():
        dispatch = layer.route(x).dispatch.flatten(2)
        dispatch_scaled = layer.route(3.0 * x).dispatch.flatten(2)
        slots = dispatch_slots(x, dispatch)
        slots_scaled = dispatch_slots(3.0 * x, dispatch_scaled)
    # Normalization makes the routing (nearly) invariant to the token scale...
    assert (dispatch - dispatch_scaled).abs().max().item() < 1e-5
    # ...while the slots follow the raw tokens.
    assert (slots_scaled - 3.0 * slots).abs().max().item() < 1e-4
    assert slots.abs().max().item() > 0.1


# ----------------------------------------------------------------------------------------------------------------
# 2. Properties
# ----------------------------------------------------------------------------------------------------------------

# Small, fast and reproducible: the same examples on every run.
FAST = settings(max_examples=25, deadline=None, derandomize=True)

small_shapes = st.fixed_dictionaries(
    {
        "batch": st.integers(1, 3),
        "tokens": st.integers(1, 6),
        "dim": st.integers(1, 5),
        "num_experts": st.integers(1, 4),
        "slots_per_expert": st.integers(1, 3),
        "hidden": st.integers(1, 6),
        "normalize": st.booleans(),
        "seed": st.integers(0, 2**31 - 1),
    }
)


def build_from(shape: dict, dtype=F64) -> tuple[SoftMoE, torch.Tensor]:
    torch.manual_seed(shape["seed"])
    layer = SoftMoE(
        shape["dim"],
        shape["num_experts"],
        shape["slots_per_expert"],
        expert_hidden=shape["hidden"],
        normalize=shape["normalize"],
        dtype=dtype,
    )
    with torch.no_grad():
        layer.phi.normal_(0.0, 1.0)
    x = torch.randn(shape["batch"], shape["tokens"], shape["dim"], dtype=dtype) * 2.0
    return layer, x


def random_mask(data, batch: int, tokens: int) -> torch.Tensor:
    rows = data.draw(
        st.lists(st.lists(st.booleans(), min_size=tokens, max_size=tokens), min_size=batch, max_size=batch)
    )
    return torch.tensor(rows, dtype=torch.bool).reshape(batch, tokens)


@pytest.mark.slow
@FAST
@given(shape=small_shapes, use_mask=st.booleans(), data=st.data())
def test_dispatch_and_combine_are_normalized(shape, use_mask, data):
    layer, x = build_from(shape)
    mask = random_mask(data, shape["batch"], shape["tokens"]) if use_mask else None
    with torch.no_grad():
        logits, dispatch, combine = layer.route(x, mask)
    assert torch.all(dispatch >= 0) and torch.all(combine >= 0)
    dispatch_sums = dispatch.sum(dim=1)  # (batch, n, p): over tokens, per slot
    combine_sums = combine.sum(dim=(2, 3))  # (batch, tokens): over all n*p slots, per token
    real = torch.ones(shape["batch"], shape["tokens"], dtype=torch.bool) if mask is None else mask
    for b in range(shape["batch"]):
        if real[b].any():
            assert torch.allclose(dispatch_sums[b], torch.ones_like(dispatch_sums[b]), atol=1e-12)
        else:
            assert torch.all(dispatch_sums[b] == 0)
    assert torch.allclose(combine_sums[real], torch.ones_like(combine_sums[real]), atol=1e-12)
    assert torch.all(combine[~real] == 0) and torch.all(dispatch[~real] == 0)
    assert torch.isfinite(logits).all()


@FAST
@given(shape=small_shapes, data=st.data())
def test_batch_independence(shape, data):
    """Changing the other examples of a batch (and their masks) leaves one example's output unchanged."""
    layer, x = build_from({**shape, "batch": max(shape["batch"], 2)})
    batch = x.shape[0]
    mask = random_mask(data, batch, shape["tokens"])
    other = x.clone()
    other[1:] = torch.randn_like(other[1:]) * 5.0
    other_mask = mask.clone()
    other_mask[1:] = ~other_mask[1:]
    with torch.no_grad():
        out = layer(x, mask)
        out_other = layer(other, other_mask)
        alone = layer(x[:1], mask[:1])
    assert torch.allclose(out[0], out_other[0], atol=1e-12, rtol=0)
    assert torch.allclose(out[0], alone[0], atol=1e-12, rtol=0)


@FAST
@given(shape=small_shapes, use_mask=st.booleans(), data=st.data())
def test_token_permutation_equivariance(shape, use_mask, data):
    layer, x = build_from(shape)
    mask = random_mask(data, shape["batch"], shape["tokens"]) if use_mask else None
    perm = torch.tensor(data.draw(st.permutations(list(range(shape["tokens"])))), dtype=torch.long)
    with torch.no_grad():
        out = layer(x, mask)
        out_perm = layer(x[:, perm], None if mask is None else mask[:, perm])
    assert torch.allclose(out_perm, out[:, perm], atol=1e-12, rtol=0)


@FAST
@given(shape=small_shapes, data=st.data())
def test_token_space_rewrite_equals_slot_formulation(shape, data):
    """The two code paths agree on arbitrary small shapes, whichever one the cost model picks."""
    layer, x = build_from(shape)
    mask = random_mask(data, shape["batch"], shape["tokens"])
    real = mask.unsqueeze(-1)
    with torch.no_grad():
        routing = layer.route(x, mask)
        dispatch, combine = routing.dispatch.flatten(2), routing.combine.flatten(2)
        slots_out = combine_slots(combine, layer.run_experts(dispatch_slots(x, dispatch)))
        token_out = token_space_mixing(layer.experts, x, routing.dispatch, routing.combine)
        out = layer(x, mask)
    assert torch.allclose(slots_out, token_out, atol=1e-11, rtol=0)
    assert torch.allclose(out, slots_out, atol=1e-11, rtol=0)
    assert torch.all(out.masked_select(~real) == 0)


@pytest.mark.parametrize("path", ["tokens", "slots"])
def test_padded_token_values_do_not_matter(path):
    layer = make_layer(path, 2)
    torch.manual_seed(6)
    x = torch.randn(2, TOKENS, layer.dim, dtype=F64)
    mask = make_mask(2, TOKENS)
    changed = x.clone()
    changed[~mask] = torch.randn_like(changed[~mask]) * 100.0
    with torch.no_grad():
        assert torch.allclose(layer(x, mask), layer(changed, mask), atol=1e-12, rtol=0)
        # ...and a mask of all True is the same as no mask.
        full = torch.ones(2, TOKENS, dtype=torch.bool)
        assert torch.allclose(layer(x, full), layer(x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("use_mask", [False, True])
def test_single_expert_single_slot_gives_one_row(use_mask):
    torch.manual_seed(7)
    layer = SoftMoE(6, 1, 1, expert_hidden=10, dtype=F64)
    x = torch.randn(2, 7, 6, dtype=F64)
    mask = make_mask(2, 7) if use_mask else None
    with torch.no_grad():
        out = layer(x, mask)
    for b in range(2):
        real = torch.arange(7) if mask is None else mask[b].nonzero().flatten()
        rows = out[b, real]
        assert torch.allclose(rows, rows[:1].expand_as(rows), atol=1e-13, rtol=0)
        assert rows.abs().max() > 0
        if mask is not None:
            assert torch.all(out[b, ~mask[b]] == 0)
    # The common row is f(slot) with slot = the dispatch-weighted mean of the real tokens.
    assert (out - reference_forward(layer, x, mask)).abs().max().item() < PARITY_TOL


# ----------------------------------------------------------------------------------------------------------------
# 3. Gradients
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tokens", "slots"])
@pytest.mark.parametrize("normalize", ["router", "inputs", "none"])
def test_gradcheck(path, normalize):
    torch.manual_seed(8)
    layer = SoftMoE(**GRAD_CONFIGS[path], normalize=normalize, activation="gelu_tanh", dtype=F64)
    assert_path_chosen(layer, GRAD_TOKENS, path)
    with torch.no_grad():
        layer.phi.normal_(0.0, 1.0)
    names = [name for name, _ in layer.named_parameters()]
    params = [param.detach().clone().requires_grad_(True) for _, param in layer.named_parameters()]
    x = torch.randn(2, GRAD_TOKENS, layer.dim, dtype=F64, requires_grad=True)
    mask = torch.tensor([[True, True, True], [True, False, True]])

    def fn(x, *params):
        return torch.func.functional_call(layer, dict(zip(names, params, strict=True)), (x,), {"mask": mask})

    # Every Jacobian entry with respect to the input; all parameters through random projections (fast mode).
    assert torch.autograd.gradcheck(lambda x: fn(x, *params), (x,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-6, fast_mode=True)
    # ...and the full Jacobian for the router parameters (phi and scale) alone.
    router = [i for i, name in enumerate(names) if name in ("phi", "scale")]

    def fn_router(*router_params):
        full = list(params)
        for i, value in zip(router, router_params, strict=True):
            full[i] = value
        return fn(x, *full)

    assert torch.autograd.gradcheck(fn_router, tuple(params[i] for i in router), eps=1e-6, atol=1e-6)


def small_norm_logits_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 x (2, 3, 6), phi (6, 5), scale and their "router" logits (x / |x|) (scale * phi / |phi|) written out:
    a zero token, and a token and a column so small that the epsilon weighs (a wrong epsilon moves them by 1e-3 or
    more)."""
    torch.manual_seed(4)
    x = torch.randn(2, 3, 6, dtype=F64)
    x[0, 1] = 0.0
    x[1, 0] *= 1e-3
    phi = torch.randn(6, 5, dtype=F64)
    phi[:, 2] *= 1e-3
    scale = torch.tensor(1.3, dtype=F64)
    return x, phi, scale, l2_normalize(x, dim=-1) @ (l2_normalize(phi, dim=0) * scale)


def test_rms_norm_logits_equal_the_router_logits_with_their_gradients():
    """CUDA's form of the "router" logits (two RMS norms, eps 1e-6 / dim) against the logits written out, in
    float64 (:func:`small_norm_logits_case`); first and second derivatives."""
    x, phi, scale, want = small_norm_logits_case()
    got = rms_norm_logits(x, phi, scale)
    assert (got - want).abs().max().item() < 1e-13
    args = tuple(t.clone().requires_grad_() for t in (x, phi, scale))
    assert torch.autograd.gradcheck(rms_norm_logits, args, eps=1e-6, atol=1e-6)
    assert torch.autograd.gradgradcheck(rms_norm_logits, args, eps=1e-6, atol=1e-6)


def test_cudas_logits_equal_the_general_ones_with_every_gradient():
    """The "router" logits as the "cuda" backend computes them (two RMS norms), in float64 on the CPU, against
    soft_moe_logits: values and the gradients of x, phi and scale."""
    torch.manual_seed(6)
    layer = SoftMoE(12, 4, 2, expert_hidden=10, dtype=F64)
    x = torch.randn(3, 5, 12, dtype=F64, requires_grad=True)
    phi = layer.phi.reshape(12, 8)
    want = soft_moe_logits(x, phi, layer.scale, "router")
    got = rms_norm_logits(x, phi, layer.scale)
    assert (got - want).abs().max().item() < 1e-12
    grad = torch.randn_like(want)
    inputs = [x, layer.phi, layer.scale]
    for g, expected in zip(torch.autograd.grad(got, inputs, grad), torch.autograd.grad(want, inputs, grad),
                           strict=True):
        assert (g - expected).abs().max().item() < 1e-12


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_logits_on_cuda_take_the_fused_rms_norm(dtype):
    """On CUDA the "cuda" backend's "router" logits (:func:`rms_norm_logits`, in float32 as the backend computes
    them) run as torch's fused RMS norm (one kernel per normalization) and equal the float64 logits of the same
    (rounded) inputs, gradients included; in float64 on CUDA they equal the small-norm case's logits and the plain
    logits' second derivative checks out there. (The scale's gradient sums terms of both signs: rounding the inputs
    to bf16 alone moves it by 15%.)"""
    torch.manual_seed(5)
    x64, phi64 = torch.randn(4, 7, 16, dtype=F64), torch.randn(16, 6, dtype=F64)
    scale64 = torch.tensor(0.8, dtype=F64)
    x64, phi64, scale64 = (t.to(dtype).double() for t in (x64, phi64, scale64))
    leaves64 = [t.clone().requires_grad_() for t in (x64, phi64, scale64)]
    want = soft_moe_logits(*leaves64)
    grad = torch.randn(want.shape, dtype=F64)
    want_grads = torch.autograd.grad(want, leaves64, grad)
    leaves = [t.to("cuda", dtype).requires_grad_() for t in (x64, phi64, scale64)]
    def fused() -> torch.Tensor:
        return rms_norm_logits(*(t.float() for t in leaves))

    assert "aten::_fused_rms_norm" in kernels_called(fused)
    got = fused()
    assert got.dtype == torch.float32
    got_grads = torch.autograd.grad(got, leaves, grad.to("cuda", torch.float32))
    gradient_tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 gradients are rounded to bf16
    for g, w, tolerance in zip((got, *got_grads), (want, *want_grads), (1e-5, *[gradient_tolerance] * 3), strict=True):
        assert ((g.double().cpu() - w).abs().max() / w.abs().max()).item() < tolerance
    *small, small_want = small_norm_logits_case()
    assert (rms_norm_logits(*(t.cuda() for t in small)).cpu() - small_want).abs().max().item() < 1e-12
    cuda64 = tuple(t.detach().to("cuda").requires_grad_() for t in leaves64)
    assert torch.autograd.gradgradcheck(soft_moe_logits, cuda64, eps=1e-6, atol=1e-6)


def test_normalized_logits_backward_with_a_zero_token_and_under_torch_func():
    """The hand-written backward of the normalized logits: gradcheck and gradgradcheck (a zero token included) and
    per-sample gradients through torch.func.vmap(torch.func.grad(...)) equal to those of each sample alone."""
    torch.manual_seed(3)
    x = torch.randn(2, 3, 5, dtype=F64)
    x[1, 2] = 0.0
    x.requires_grad_(True)
    phi = torch.randn(5, 4, dtype=F64, requires_grad=True)
    scale = torch.tensor(1.7, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(soft_moe_logits, (x, phi, scale), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradgradcheck(soft_moe_logits, (x, phi, scale), eps=1e-6, atol=1e-6)

    def loss(sample, phi):
        return soft_moe_logits(sample.unsqueeze(0), phi, scale).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=1), in_dims=(0, None))(x.detach(), phi.detach())
    for i in range(2):
        (want,) = torch.autograd.grad(loss(x[i].detach(), phi), phi)
        assert (per_sample[i] - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("slots_per_expert", [1, 3])
@pytest.mark.parametrize("expert_bias", [True, False])
def test_slot_path_in_one_autograd_node_equals_the_composed_one(activation, slots_per_expert, expert_bias):
    """MLPExperts.forward_through_slots (backward written out) against the layer's dispatch / run_experts / combine
    in float64 autograd: output and every gradient (x, phi, scale, all expert weights), with a mask."""
    torch.manual_seed(11)
    layer = SoftMoE(6, 3, slots_per_expert, expert_hidden=5, activation=activation, expert_bias=expert_bias,
                    dtype=F64)
    force_path(layer, "slots")
    x = torch.randn(4, 5, 6, dtype=F64)
    mask = make_mask(4, 5)
    grad = torch.randn(4, 5, 6, dtype=F64)

    def run() -> list[torch.Tensor]:
        x_leaf = x.clone().requires_grad_(True)
        out = layer(x_leaf, mask)
        params = [p for p in layer.parameters()]
        grads = torch.autograd.grad(out, [x_leaf, *params], grad)
        return [out.detach(), *grads]

    one_node = run()
    assert_ran(layer, x, "slots")
    assert len(one_node) == 2 + len(list(layer.parameters()))
    force_path(layer, "reference")
    composed = run()
    for got, want in zip(one_node, composed, strict=True):
        assert (got - want).abs().max().item() < 1e-12


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_slot_path_in_one_autograd_node_has_second_derivatives(activation):
    """Double backward through MLPExperts.forward_through_slots equals the composed path's (a gradient penalty)."""
    torch.manual_seed(12)
    layer = SoftMoE(6, 3, 2, expert_hidden=5, activation=activation, dtype=F64)
    force_path(layer, "slots")
    x = torch.randn(4, 5, 6, dtype=F64)

    def penalty_grads() -> list[torch.Tensor]:
        x_leaf = x.clone().requires_grad_(True)
        (grad_x,) = torch.autograd.grad(layer(x_leaf).square().sum(), x_leaf, create_graph=True)
        return list(torch.autograd.grad(grad_x.square().sum(), [x_leaf, *layer.parameters()]))

    one_node = penalty_grads()
    assert_ran(layer, x, "slots")
    force_path(layer, "reference")
    for got, want in zip(one_node, penalty_grads(), strict=True):
        assert (got - want).abs().max().item() < 1e-10


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # (torch's jvp rules)
@pytest.mark.parametrize("plan", [None, "dense", "selected"])
def test_forward_mode_ad_in_inference_keeps_its_tangents(monkeypatch, plan):
    """Forward-mode AD (dual tensors require no grad) must reach only torch's ops: softmoe's custom ops drop a
    dual's tangent without a word and its autograd Functions have no jvp, and oneDNN's linear drops it too. The
    float32 layer's jvp (native kernels built, oneDNN taken wherever it may run; Algorithm 1 with either plan)
    equals central differences of a float64 copy (gelu experts: relu's kinks would break the differences)."""
    vendor, family, _ = cpu_signature()  # oneDNN outruns MKL on this CPU, as the table would say
    monkeypatch.setitem(TABLE, "onednn_cpus", Measured(((vendor, family, None),), "a test: this CPU"))
    torch.manual_seed(13)
    layer = SoftMoE(256, 4, expert_hidden=512).eval()  # products of 134 MFLOP: oneDNN's size
    exact = SoftMoE(256, 4, expert_hidden=512, dtype=F64).eval()
    exact.load_state_dict(layer.state_dict())
    x, tangent = torch.randn(512, 8, 256), torch.randn(512, 8, 256)
    fwd = torch.autograd.forward_ad
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if plan is not None:
            stack.enter_context(select_experts(layer, k=2, plan=plan))
            stack.enter_context(select_experts(exact, k=2, plan=plan))
        h = 1e-6
        x64, t64 = x.double(), tangent.double()
        want = (exact(x64 + h * t64) - exact(x64 - h * t64)) / (2 * h)
        with fwd.dual_level():
            got = fwd.unpack_dual(layer(fwd.make_dual(x, tangent))).tangent
    assert got is not None
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-4


def test_the_layer_module_reads_as_the_math():
    """softmoe.layer imports nothing from softmoe.kernels nor the backends at import time, tests no device, dtype or
    expert type, and SoftMoE.forward is at most 25 lines with one branch (selection or not)."""
    tree = ast.parse(inspect.getsource(softmoe.layer))
    top_level = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    modules = {node.module for node in top_level if isinstance(node, ast.ImportFrom)}
    modules |= {alias.name for node in top_level if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in modules if m.startswith(("softmoe.kernels", "softmoe.backends"))}, modules
    attributes = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not attributes & {"is_cuda", "is_cpu", "is_mps", "bfloat16", "float16", "MLPExperts"}
    words = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not words & {"cpu", "cuda", "mps", "avx512", "avx2"}
    tested = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and getattr(node.func, "id", "") in
              ("isinstance", "type")]
    assert not tested, [ast.unparse(node) for node in tested]
    forward = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "forward")
    body = forward.body[1:] if ast.get_docstring(forward) else forward.body
    assert forward.end_lineno - forward.lineno + 1 <= 25
    branches = (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.BoolOp, ast.Match)
    assert sum(isinstance(n, branches) for stmt in body for n in ast.walk(stmt)) == 1


def test_backend_for_names_the_ops_each_step_runs():
    """backend_for(x).steps says what runs each step for x, and the ops it names are the ones that run: the native
    routing and fused mixing where the "cpu" backend serves, plain torch ops (no softmoe op) on "reference"."""
    torch.manual_seed(0)
    small = SoftMoE(16, 4, expert_hidden=32, activation="relu").eval()
    large = SoftMoE(64, 2, 4, expert_hidden=4096).eval()  # 8 rows per expert through 64 x 4096 weights
    noisy = SoftMoE(16, 4, expert_hidden=32, activation="relu", noise_std=0.5)  # training: routing in torch ops
    frozen = SoftMoE(16, 4, expert_hidden=32, activation="relu").eval()  # only the scale learns
    frozen.phi.requires_grad_(False)
    frozen.experts.requires_grad_(False)
    seen = set()
    layers = ((small, torch.randn(3, 5, 16)), (large, torch.randn(2, 6, 64)), (noisy, torch.randn(3, 5, 16)),
              (frozen, torch.randn(3, 5, 16)))
    for layer, x in layers:
        for name in ("reference", "slots", "tokens", *(("cpu",) if native_available() else ())):
            for grad in (False, True):
                layer.backend = name
                with torch.set_grad_enabled(grad):
                    choice = layer.backend_for(x)
                    ran = {op for op in kernels_called(lambda: layer(x)) if op.startswith("softmoe::")}  # noqa: B023
                assert (choice.name, choice.reason, choice.backend) == (name, "requested", REGISTRY[name])
                assert set(choice.steps) == {"route", "mix", "select"} and all(choice.steps.values())
                named = {op.rstrip(",") for step in ("route", "mix") for op in choice.steps[step].split() if "::" in op}
                assert named == ran, (name, grad, choice.steps, ran)
                seen |= named
    if native_available():
        ops = ("soft_moe_routing", "soft_moe_mixing", "soft_moe_mixing_inference", "expert_matmul")
        assert {f"softmoe::{op}" for op in ops} <= seen


def test_auto_backend_rules_and_reasons(monkeypatch):
    """"auto" takes the native ops for float32 CPU tensors (mixing by their cost model: here the slot formulation,
    and the native expert matmul for few rows through large weights), the cost model's formulation for float64,
    "reference" under torch.func transforms, autocast and for custom experts; each choice with its reason."""
    layer = SoftMoE(8, 4, 3, expert_hidden=16)
    x = torch.randn(3, 5, 8)
    choice = layer.backend_for(x)
    expected = "cpu" if native_available() else "slots"
    assert choice.name == expected and choice.reason and choice.backend is REGISTRY[expected]
    if native_available():
        assert choice.backend.mixing(layer, x) == "slots"
    assert SoftMoE(8, 4, 3, expert_hidden=16, dtype=F64).backend_for(x.double()).name == "slots"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer.backend_for(x).name == "reference"
    seen = []
    torch.func.grad(lambda t: seen.append(layer.backend_for(x).name) or t.sum())(torch.ones(2))
    assert seen == ["reference"]
    assert SoftMoE(8, 4, expert=nn.Linear(8, 8)).backend_for(x).name == "reference"
    large = SoftMoE(64, 2, 8, expert_hidden=4096)  # 8 rows per expert through 64 x 4096 weights
    x = torch.randn(1, 64, 64)
    if native_available():
        assert large.backend_for(x).backend.mixing(large, x) == "native"
    monkeypatch.setattr(softmoe.backends, "native_available", lambda: False)
    choice = layer.backend_for(torch.randn(3, 5, 8))
    assert choice.name in ("slots", "tokens") and "native ops are unavailable" in choice.reason


def test_explicit_backends_that_cannot_run_say_why():
    x = torch.randn(2, 5, 8, dtype=F64)
    layer = SoftMoE(8, 4, dtype=F64, backend="cpu")
    with pytest.raises(ValueError, match=r"backend 'cpu' cannot run this input: the native ops take float32 CPU"):
        layer(x)
    layer.backend = "cuda"
    with pytest.raises(ValueError, match=r"backend 'cuda' cannot run this input: it runs CUDA tensors"):
        layer(x)
    layer.backend = "slots"
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="autocast is on"):
        layer(x.float().to(F64))
    custom = SoftMoE(8, 4, expert=nn.Linear(8, 8), dtype=F64, backend="tokens")
    with pytest.raises(ValueError, match=r"backend .tokens. cannot run this input: it runs MLPExperts, not Stacked"):
        custom(x)
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'reference', 'slots', 'tokens', 'cpu', "
                                         r"'cuda'\)"):
        SoftMoE(8, 4, backend="fast")
    with pytest.raises(ValueError, match="backend must be one of"):
        layer.backend = "native"
    assert "backend='slots'" in repr(layer)


@pytest.mark.parametrize("normalize", ["router", "inputs", "none"])
@pytest.mark.parametrize("backend", ["reference", "slots", "tokens"])
def test_every_backend_matches_definition_1_in_float64(backend, normalize):
    """Every backend, set explicitly, equals the loop reference and soft_moe_reference (output and gradients)."""
    torch.manual_seed(31)
    layer = SoftMoE(6, 4, 2, expert_hidden=5, normalize=normalize, dtype=F64, backend=backend)
    x = torch.randn(3, 5, 6, dtype=F64, requires_grad=True)
    mask = make_mask(3, 5)
    out = layer(x, mask)
    assert (out - reference_forward(layer, x.detach(), mask)).abs().max().item() < PARITY_TOL
    want = soft_moe_reference(x, layer.phi, layer.scale, layer.experts, normalize, mask)
    weights = torch.randn_like(out)
    got_grads = torch.autograd.grad((out * weights).sum(), [x, *layer.parameters()])
    want_grads = torch.autograd.grad((want * weights).sum(), [x, *layer.parameters()])
    for got, expected in zip(got_grads, want_grads, strict=True):
        assert (got - expected).abs().max().item() < PARITY_TOL


def test_the_reference_backend_runs_torch_ops_only(monkeypatch):
    """backend="reference" runs no softmoe op and no oneDNN product in any step, on float32 CPU tensors whose products
    oneDNN takes elsewhere (the tuning table set so that it pays for every product here): the forward, its backward,
    Algorithm 1 on each plan with and without gradients, an adaptive strategy; its selected plan equals the masked
    reference in float64, output and gradients. The slot and token formulations are torch's ops too: their mixing,
    and their selected plan, whose grouped products (softmoe::grouped_mm, torch's products inside) take no native
    kernel or oneDNN even where every weight counts as large for the "cpu" backend's."""
    from softmoe.kernels.onednn import batched_matmul
    from softmoe.selection import masked_reference_forward

    vendor, family, _ = cpu_signature()
    monkeypatch.setitem(TABLE, "onednn_cpus", Measured(((vendor, family, None),), "a test: this CPU"))
    monkeypatch.setitem(TABLE, "onednn_min_product_flops", Measured(0, "a test: every product"))
    monkeypatch.setitem(TABLE, "onednn_min_batch_flops", Measured(0, "a test: every product"))
    monkeypatch.setitem(TABLE, "large_weight", Measured(1, "a test: every weight"))
    monkeypatch.setitem(TABLE, "native_min_weight", Measured(1, "a test: every weight"))

    def own_ops(run) -> set[str]:
        return {op for op in kernels_called(run) if op.startswith(("softmoe::", "mkldnn::"))}

    torch.manual_seed(33)
    layer = SoftMoE(16, 4, 2, expert_hidden=32, backend="reference")
    x = torch.randn(5, 6, 16)
    with torch.no_grad():
        weight = layer.experts.weight1
        onednn = own_ops(lambda: batched_matmul(torch.randn(4, 10, 16), weight))
    assert onednn == ({"mkldnn::_linear_pointwise"} if torch.backends.mkldnn.is_available() else set())

    def step():
        layer.zero_grad(set_to_none=True)
        layer(x.detach().requires_grad_()).sum().backward()

    def inference():
        with torch.no_grad():
            layer(x)

    assert own_ops(step) == set() and own_ops(inference) == set()
    for generic in ("slots", "tokens"):  # the formulations' mixing: torch's products too
        layer.backend = generic
        assert own_ops(step) == set() and own_ops(inference) == set(), generic
        with select_experts(layer, k=2, plan="selected"):
            assert own_ops(inference) == {"softmoe::grouped_mm"}, generic
            assert own_ops(step) == {"softmoe::grouped_mm", "softmoe::grouped_mm_weight_grad"}, generic
    if native_available():  # where the "cpu" backend's grouped product takes the native kernel
        layer.backend = "cpu"
        with select_experts(layer, k=2, plan="selected"):
            assert "softmoe::expert_matmul" in own_ops(step)
    layer.backend = "reference"
    for plan in ("auto", "dense", "selected"):
        with select_experts(layer, k=2, plan=plan):
            assert own_ops(step) == set() and own_ops(inference) == set(), plan
    with select_experts(layer, k=0.5, strategy="mass", tau=0.6, plan="selected"):
        assert own_ops(inference) == set()

    ref = SoftMoE(16, 4, 2, expert_hidden=32, backend="reference", dtype=F64)
    x64 = torch.randn(5, 6, 16, dtype=F64, requires_grad=True)
    selected = torch.tensor([[0, 3], [1, 2], [2, -1], [0, 1], [3, 0]])
    got = ref.forward_selected(x64, selected, plan="selected")
    want = masked_reference_forward(ref, x64, selected)
    assert (got - want).abs().max().item() < PARITY_TOL
    grad = torch.randn_like(got)
    leaves = [x64, *ref.parameters()]
    for g, w in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad), strict=True):
        assert (g - w).abs().max().item() < PARITY_TOL


@pytest.mark.parametrize("path", ["tokens", "slots"])
def test_gradients_reach_every_parameter(path):
    layer = make_layer(path, 2, dtype=torch.float32, sharpen=False)
    torch.manual_seed(9)
    x = torch.randn(2, TOKENS, layer.dim, requires_grad=True)
    mask = make_mask(2, TOKENS)
    assert_path_chosen(layer, TOKENS, path)
    out = layer(x, mask)
    (out * torch.randn_like(out)).sum().backward()
    assert layer.phi.grad is not None and layer.phi.grad.abs().sum() > 0
    assert layer.scale.grad is not None and layer.scale.grad.abs() > 0
    experts = layer.experts
    for name in ("weight1", "bias1", "weight2", "bias2"):
        grad = getattr(experts, name).grad
        assert grad is not None, name
        for j in range(layer.num_experts):
            assert grad[j].abs().sum() > 0, f"expert {j} got no gradient in {name}"
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert torch.all(x.grad[~mask] == 0)


# ----------------------------------------------------------------------------------------------------------------
# 4. Fully padded sequences
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tokens", "slots"])
@pytest.mark.parametrize("padded_values", ["zeros", "random"])
def test_fully_padded_sequence_gives_zeros(path, padded_values):
    layer = make_layer(path, 2, dtype=torch.float32)
    torch.manual_seed(10)
    x = torch.randn(3, TOKENS, layer.dim)
    mask = make_mask(3, TOKENS)
    mask[0] = False
    if padded_values == "zeros":
        x[~mask] = 0.0
    x.requires_grad_(True)
    assert_path_chosen(layer, TOKENS, path)
    out = layer(x, mask)
    assert torch.isfinite(out).all()
    assert torch.all(out[0] == 0)
    assert torch.all(out[~mask] == 0)
    assert out[1:][mask[1:]].abs().sum() > 0
    routing = layer.route(x, mask)
    assert torch.all(routing.dispatch[0] == 0) and torch.all(routing.combine[0] == 0)
    assert torch.isfinite(routing.dispatch).all() and torch.isfinite(routing.combine).all()
    (out * torch.randn_like(out)).sum().backward()
    for name, param in [("x", x), *layer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert torch.all(x.grad[0] == 0)
    assert torch.all(x.grad[~mask] == 0)


@pytest.mark.parametrize("path", ["tokens", "slots"])
def test_whole_batch_padded(path):
    layer = make_layer(path, 1, dtype=torch.float32)
    x = torch.zeros(2, TOKENS, layer.dim, requires_grad=True)
    mask = torch.zeros(2, TOKENS, dtype=torch.bool)
    out = layer(x, mask)
    assert torch.all(out == 0) and not torch.isnan(out).any()
    out.sum().backward()
    for name, param in [("x", x), *layer.named_parameters()]:
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert torch.all(param.grad == 0), name


# ----------------------------------------------------------------------------------------------------------------
# 5. Custom experts (StackedExperts, torch.func.vmap)
# ----------------------------------------------------------------------------------------------------------------

TORCH_ACTIVATIONS = {"gelu": lambda: nn.GELU(), "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "relu": nn.ReLU}


def mlp_module(dim: int, hidden: int, activation: str = "gelu") -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), TORCH_ACTIVATIONS[activation](), nn.Linear(hidden, dim))


@pytest.mark.parametrize("path", ["tokens", "slots"])
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_custom_expert_matches_builtin_mlp(path, activation):
    builtin = make_layer(path, 2, activation=activation)
    cfg = PATH_CONFIGS[path]
    torch.manual_seed(11)
    custom = SoftMoE(
        cfg["dim"], cfg["num_experts"], 2, expert=mlp_module(cfg["dim"], cfg["expert_hidden"], activation), dtype=F64
    )
    assert isinstance(custom.experts, StackedExperts)
    assert custom.backend_for(torch.zeros(1, TOKENS, cfg['dim'], dtype=F64)).name == "reference"  # custom experts
    assert_path_chosen(builtin, TOKENS, path)
    mlp = builtin.experts
    with torch.no_grad():
        custom.phi.copy_(builtin.phi)
        custom.scale.copy_(builtin.scale)
        custom.experts.get_parameter("0__weight").copy_(mlp.weight1.transpose(1, 2))
        custom.experts.get_parameter("0__bias").copy_(mlp.bias1)
        custom.experts.get_parameter("2__weight").copy_(mlp.weight2.transpose(1, 2))
        custom.experts.get_parameter("2__bias").copy_(mlp.bias2)
    torch.manual_seed(12)
    x = torch.randn(2, TOKENS, cfg["dim"], dtype=F64)
    mask = make_mask(2, TOKENS)
    with torch.no_grad():
        expected = builtin(x, mask)
        got = custom(x, mask)
        assert_ran(builtin, x, path)
    assert (got - expected).abs().max().item() < PARITY_TOL


class ScaledResidual(nn.Module):
    """A non-MLP expert with a parameter-free buffer: x + tanh(x A) * gain + shift."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)
        self.gain = nn.Parameter(torch.randn(dim))
        self.register_buffer("shift", torch.linspace(-1, 1, dim))

    def forward(self, x):
        return x + torch.tanh(self.proj(x)) * self.gain + self.shift


def test_custom_expert_matches_reference_loop():
    torch.manual_seed(13)
    dim, n, p = 5, 3, 2
    template = ScaledResidual(dim).double()
    layer = SoftMoE(dim, n, p, expert=template, dtype=F64)
    with torch.no_grad():
        layer.phi.normal_(0.0, 1.0)
    stacked = layer.experts

    def expert_fn(j, v):
        params, buffers = stacked.expert_state(j)
        return torch.func.functional_call(template, (params, buffers), (v.unsqueeze(0),)).squeeze(0).detach()

    x = torch.randn(2, 4, dim, dtype=F64)
    mask = torch.tensor([[True, False, True, True], [False, True, True, False]])
    with torch.no_grad():
        out = layer(x, mask)
    assert (out - reference_forward(layer, x, mask, expert_fn)).abs().max().item() < PARITY_TOL


def test_custom_expert_does_not_use_template_weights():
    """The layer owns its stacked copies: later changes to the user's module do not change the layer."""
    torch.manual_seed(14)
    template = mlp_module(4, 8)
    layer = SoftMoE(4, 3, expert=template)
    x = torch.randn(2, 5, 4)
    with torch.no_grad():
        before = layer(x)
        for param in template.parameters():
            param.zero_()
        after = layer(x)
    assert torch.equal(before, after)
    grads = torch.autograd.grad(layer(x).sum(), list(layer.experts.parameters()))
    for g in grads:
        for j in range(3):
            assert g[j].abs().sum() > 0


def _pairwise(values: torch.Tensor):
    return [(i, j) for i in range(values.shape[0]) for j in range(i + 1, values.shape[0])]


def test_custom_expert_copies_independent_by_default():
    torch.manual_seed(15)
    layer = SoftMoE(6, 4, expert=mlp_module(6, 12))
    names = [name for name, _ in layer.experts.named_parameters()]
    assert sorted(names) == ["0__bias", "0__weight", "2__bias", "2__weight"]
    for name, value in layer.experts.named_parameters():
        assert value.shape[0] == 4, name
        for i, j in _pairwise(value):
            assert not torch.allclose(value[i], value[j]), f"{name}: experts {i} and {j} start equal"


def test_custom_expert_copies_identical_with_identical_init():
    torch.manual_seed(16)
    template = mlp_module(6, 12)
    layer = SoftMoE(6, 4, expert=template, identical_expert_init=True)
    template_params = dict(template.named_parameters())
    for name, value in layer.experts.named_parameters():
        for j in range(4):
            assert torch.equal(value[j], value[0]), name
        assert torch.equal(value[0], template_params[name.replace("__", ".")].detach()), name


@pytest.mark.parametrize("identical", [False, True])
def test_mlp_expert_init_independence(identical):
    torch.manual_seed(17)
    layer = SoftMoE(6, 4, expert_hidden=12, identical_expert_init=identical)
    for name in ("weight1", "bias1", "weight2", "bias2"):
        value = getattr(layer.experts, name)
        for i, j in _pairwise(value):
            assert torch.equal(value[i], value[j]) is identical, f"{name}: experts {i}, {j}"


# ----------------------------------------------------------------------------------------------------------------
# 6. Initialization
# ----------------------------------------------------------------------------------------------------------------


def test_identical_init_makes_all_mlp_expert_slices_equal():
    torch.manual_seed(18)
    experts = MLPExperts(5, 7, 9, identical_init=True)
    for name in ("weight1", "bias1", "weight2", "bias2"):
        value = getattr(experts, name)
        assert value[0].abs().sum() > 0, name
        for j in range(1, 5):
            assert torch.equal(value[j], value[0]), name


def test_phi_init_std_and_truncation():
    torch.manual_seed(19)
    dim, n, p = 256, 64, 2
    layer = SoftMoE(dim, n, p, expert_hidden=1)
    phi = layer.phi.detach()
    target_std = 1.0 / math.sqrt(dim * n)  # fan_in = dim * num_experts, independent of p
    assert phi.shape == (dim, n, p)
    assert abs(phi.std().item() / target_std - 1.0) < 0.03
    assert abs(phi.mean().item()) < 0.02 * target_std * 2
    # Truncated at +-2 std of the underlying normal, whose std is target_std / 0.8796 (std of a +-2 sigma
    # truncated standard normal).
    underlying_std = target_std / 0.87962566103423978
    bound = 2.0 * underlying_std
    assert phi.abs().max().item() <= bound * (1 + 1e-6)
    assert phi.abs().max().item() > 0.98 * bound  # the tails are actually used, up to the bound
    # The unit scale starts at 1.
    assert layer.scale.item() == 1.0


def test_phi_init_depends_on_num_experts():
    torch.manual_seed(20)
    small = SoftMoE(128, 4, 4, expert_hidden=1).phi.detach().std().item()
    large = SoftMoE(128, 64, 1, expert_hidden=1).phi.detach().std().item()
    assert abs(small / (1 / math.sqrt(128 * 4)) - 1) < 0.05
    assert abs(large / (1 / math.sqrt(128 * 64)) - 1) < 0.05


# ----------------------------------------------------------------------------------------------------------------
# 7. Mixed precision and torch.compile
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["tokens", "slots"])
def test_autocast_bfloat16(path):
    layer = make_layer(path, 2, dtype=torch.float32)
    assert_path_chosen(layer, TOKENS, path)
    torch.manual_seed(21)
    x = torch.randn(2, TOKENS, layer.dim)
    mask = make_mask(2, TOKENS)
    with torch.no_grad():
        reference = layer(x, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            routing = layer.route(x, mask)
            out = layer(x, mask)
            routing_bf16_input = layer.route(x.bfloat16(), mask)
    for name, tensor in routing._asdict().items():
        assert tensor.dtype == torch.float32, name
    for name, tensor in routing_bf16_input._asdict().items():
        assert tensor.dtype == torch.float32, name
    real = mask.unsqueeze(-1)
    sums = routing.combine.sum(dim=(2, 3))[mask]
    assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)
    # The float32 routing under autocast is the float32 routing without it.
    assert torch.allclose(routing.dispatch, layer.route(x, mask).dispatch, atol=1e-6)
    assert out.shape == x.shape and torch.isfinite(out).all()
    err = (out.float() - reference).abs().max().item()
    assert err < 0.03 * reference.abs().max().item()
    assert torch.all(out.masked_select(~real) == 0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
def test_torch_compile_matches_eager():
    layer = make_layer("slots", 2, dtype=torch.float32)
    torch.manual_seed(22)
    x = torch.randn(2, TOKENS, layer.dim)
    mask = make_mask(2, TOKENS)
    compiled = torch.compile(layer)
    with torch.no_grad():
        expected = layer(x, mask)
        got = compiled(x, mask)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# 8. Bad inputs
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def small_layer() -> SoftMoE:
    torch.manual_seed(23)
    return SoftMoE(8, 3, 2, expert_hidden=4)


@pytest.mark.parametrize("method", ["forward", "route"])
def test_wrong_rank_raises(small_layer, method):
    call = getattr(small_layer, method)
    with pytest.raises(ValueError, match=r"dim=8.*rank 2.*\(5, 8\)"):
        call(torch.randn(5, 8))
    with pytest.raises(ValueError, match=r"dim=8.*rank 4"):
        call(torch.randn(1, 2, 5, 8))


@pytest.mark.parametrize("method", ["forward", "route"])
def test_wrong_feature_size_raises(small_layer, method):
    with pytest.raises(ValueError, match=r"dim=8, got 7"):
        getattr(small_layer, method)(torch.randn(2, 5, 7))


@pytest.mark.parametrize("method", ["forward", "route"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool])
def test_non_floating_input_raises(small_layer, method, dtype):
    x = torch.ones(2, 5, 8, dtype=dtype)
    with pytest.raises(ValueError, match=rf"floating.*{dtype}"):
        getattr(small_layer, method)(x)


@pytest.mark.parametrize("method", ["forward", "route"])
def test_mask_wrong_shape_raises(small_layer, method):
    x = torch.randn(2, 5, 8)
    call = getattr(small_layer, method)
    with pytest.raises(ValueError, match=r"\(2, 5\), got \(2, 4\)"):
        call(x, torch.ones(2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(2, 5\), got \(2, 5, 1\)"):
        call(x, torch.ones(2, 5, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"\(2, 5\), got list"):
        call(x, [[True] * 5] * 2)


@pytest.mark.parametrize("method", ["forward", "route"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_non_bool_mask_raises(small_layer, method, dtype):
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=rf"bool.*{dtype}"):
        getattr(small_layer, method)(x, torch.ones(2, 5, dtype=dtype))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(dim=4, num_experts=0), r"num_experts must be an integer >= 1, got 0"),
        (dict(dim=4, num_experts=-3), r"num_experts must be an integer >= 1, got -3"),
        (dict(dim=4, num_experts=2, slots_per_expert=0), r"slots_per_expert must be an integer >= 1, got 0"),
        (dict(dim=0, num_experts=2), r"dim must be an integer >= 1, got 0"),
        (dict(dim=4, num_experts=2.0), r"num_experts must be an integer >= 1, got 2\.0"),
        (dict(dim=4, num_experts=2, expert_hidden=0), r"expert_hidden must be an integer >= 1, got 0"),
        (dict(dim=4, num_experts=2, expert_hidden=2.5), r"expert_hidden must be an integer >= 1, got 2\.5"),
        (dict(dim=4, num_experts=2, normalize="rms"), r"normalize must be one of .*router.*inputs.*none.*got .rms."),
        (dict(dim=4, num_experts=2, activation="swish"), r"gelu.*gelu_tanh.*relu.*got 'swish'"),
    ],
)
def test_bad_constructor_arguments_raise(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SoftMoE(**kwargs)


def test_valid_inputs_do_not_raise(small_layer):
    """The checks reject only bad inputs: float64/bfloat16 inputs and bool masks pass."""
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, dtype=torch.bool)
    assert small_layer(x, mask).shape == (2, 5, 8)
    assert small_layer.double()(x.double(), mask).dtype == F64


def test_logit_noise_only_in_training():
    """noise_std adds noise_std * N(0, 1) to the logits in training (vmoe's SoftRouter.add_noise), none in eval."""
    layer = SoftMoE(6, 3, expert_hidden=4, noise_std=0.5, dtype=F64)
    x = torch.randn(2, 5, 6, dtype=F64)
    quiet = SoftMoE(6, 3, expert_hidden=4, dtype=F64)
    quiet.load_state_dict(layer.state_dict())
    layer.eval()
    assert torch.equal(layer(x), quiet(x))
    layer.train()
    torch.manual_seed(7)
    noisy = layer(x)
    torch.manual_seed(7)
    noise = 0.5 * torch.randn(2, 5, 3, dtype=F64)
    logits = quiet.route(x).logits.reshape(2, 5, 3) + noise
    expected = reference_forward_from_logits(quiet, x, logits)
    assert (noisy - expected).abs().max().item() < PARITY_TOL
    with pytest.raises(ValueError, match=r"noise_std must be >= 0, got -1"):
        SoftMoE(6, 3, noise_std=-1)


def reference_forward_from_logits(layer: SoftMoE, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """C f(D^T X) for given logits (batch, tokens, n) with one slot per expert, by loops over experts."""
    dispatch, combine = logits.softmax(dim=1), logits.softmax(dim=-1)
    f = mlp_expert_fn(layer.experts)
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for j in range(layer.num_experts):
            y = f(j, dispatch[b, :, j] @ x[b])
            out[b] += combine[b, :, j, None] * y
    return out


@pytest.mark.parametrize("path", ["tokens", "slots"])
@pytest.mark.parametrize("normalize", ["router", "inputs"])
def test_out_dim_matches_reference_and_selection(path, normalize, monkeypatch):
    """Experts with an output size other than dim: (batch, tokens, dim) -> (batch, tokens, out_dim), both paths,
    and the selected-experts path against the masked dense reference."""
    from softmoe.selection import masked_reference_forward

    layer = make_layer(path, 2, normalize=normalize, out_dim=5)
    force_path(layer, path)
    torch.manual_seed(8)
    x = torch.randn(3, TOKENS, layer.dim, dtype=F64)
    with torch.no_grad():
        out = layer(x)
        assert out.shape == (3, TOKENS, 5)
        assert (out - reference_forward(layer, x)).abs().max().item() < PARITY_TOL
        selected = torch.tensor([[0, 2], [1, 2], [0, 1]])
        fast = layer.forward_selected(x, selected)
        assert (fast - masked_reference_forward(layer, x, selected)).abs().max().item() < PARITY_TOL


def test_inputs_normalization_is_scale_free_and_finite_at_a_zero_token():
    """normalize="inputs": the normalized tokens replace X, so scaling an input changes nothing; a zero token gives
    finite outputs and gradients (its normalized value is 0, with a zero subgradient)."""
    layer = make_layer("slots", 2, normalize="inputs")
    torch.manual_seed(9)
    x = torch.randn(2, TOKENS, layer.dim, dtype=F64)
    with torch.no_grad():
        assert (layer(7.0 * x) - layer(x)).abs().max().item() < 1e-6  # only the 1e-6 of the norm differs
    x[0, 1] = 0.0
    x.requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()


class _Shifted(nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return t + 0.25


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32 (native paths)"])
@pytest.mark.parametrize("normalize", ["router", "inputs", "none"])
def test_a_parametrized_phi_and_scale_serve_every_path(normalize, dtype):
    """The layer looks phi, scale and the experts up without nn.Module's __getattr__ on every call; under
    torch.nn.utils.parametrize (phi and scale then properties; a parametrization that turns phi's columns, so the
    normalized logits change too) the plain forward, route() and Algorithm 1 use the parametrized values."""
    from torch.nn.utils import parametrize

    from softmoe import masked_reference_forward
    from softmoe.selection import top_k_by_combine

    torch.manual_seed(0)
    layer = SoftMoE(12, 6, expert_hidden=10, activation="relu", normalize=normalize, dtype=dtype).eval()
    plain = SoftMoE(12, 6, expert_hidden=10, activation="relu", normalize=normalize, dtype=dtype).eval()
    plain.load_state_dict(layer.state_dict())
    with torch.no_grad():
        plain.phi.add_(0.25)
        parametrize.register_parametrization(layer, "phi", _Shifted())
        if normalize != "none":
            plain.scale.add_(0.25)
            parametrize.register_parametrization(layer, "scale", _Shifted())
    x = torch.randn(5, 7, 12, dtype=dtype)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert not torch.allclose(plain(x), SoftMoE.forward(_unshifted(layer, plain), x), **tol)  # it shows
        torch.testing.assert_close(layer(x), plain(x), **tol)
        torch.testing.assert_close(layer.route(x).combine, plain.route(x).combine, **tol)
        selected = top_k_by_combine(plain.route(x).combine, 2)
        with select_experts(layer, k=2):
            got = layer(x)
        torch.testing.assert_close(got, masked_reference_forward(plain, x, selected), **tol)


def _unshifted(layer: SoftMoE, plain: SoftMoE) -> SoftMoE:
    """A copy of ``plain`` with the parametrized layer's original (unshifted) phi and scale."""
    other = SoftMoE(12, 6, expert_hidden=10, activation="relu", normalize=plain.normalize, dtype=plain.phi.dtype).eval()
    other.load_state_dict(plain.state_dict())
    with torch.no_grad():
        other.phi.copy_(layer.parametrizations.phi.original)
        if plain.scale is not None:
            other.scale.copy_(layer.parametrizations.scale.original)
    return other
