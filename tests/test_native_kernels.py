"""softmoe.kernels' native kernels: their build and cache, and the batched expert matmuls (csrc/expert_matmul.c):
exactness, gradients, and where they run."""

from __future__ import annotations

import shutil

import pytest
import torch
from reference import output_and_gradients, ref_activation, relative_error

import softmoe.experts as experts_module
import softmoe.kernels as kernels
from softmoe import SoftMoE
from softmoe.experts import MLPExperts
from softmoe.kernels import expert_matmul, native_applies, native_library


def reference(x, w, b, g):
    """Output and gradients of x @ w + b with upstream gradient g, in float64 autograd."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    out = torch.bmm(x64, w64) + (0 if b64 is None else b64.unsqueeze(1))
    out.backward(g.double())
    return out.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad


# Rows 1..9 and 16 cover every register tile height (8 rows a tile with AVX-512, 4 without) and a second tile;
# N covers vector tails (15, 17, 47, 49), exact tiles (16, 48) and several tiles (100, 130); K includes 1 and
# values that are not multiples of the 32-row panel or of the 2-row dot-product tile.
SHAPES = [
    (1, 1, 1, 1),
    (1, 2, 7, 16),
    (2, 3, 33, 15),
    (3, 5, 64, 17),
    (1, 8, 40, 48),
    (2, 9, 65, 49),
    (1, 16, 96, 100),
    (4, 4, 3, 130),
    (2, 7, 129, 47),
]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "E{}xM{}xK{}xN{}".format(*s))
def test_expert_matmul_and_gradients_match_float64(library, shape, bias, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the thread count handed to the kernels
    experts, rows, k, n = shape
    torch.manual_seed(sum(shape))
    x = torch.randn(experts, rows, k, requires_grad=True)
    w = torch.randn(experts, k, n, requires_grad=True)
    b = torch.randn(experts, n, requires_grad=True) if bias else None
    g = torch.randn(experts, rows, n)
    out = expert_matmul(x, w, b)
    out.backward(g)
    want, gx, gw, gb = reference(x.detach(), w.detach(), None if b is None else b.detach(), g)
    assert out.shape == (experts, rows, n) and out.dtype == torch.float32
    assert relative_error(out, want) < 1e-5
    assert relative_error(x.grad, gx) < 1e-5
    assert relative_error(w.grad, gw) < 1e-5
    if bias:
        assert relative_error(b.grad, gb) < 1e-5


@pytest.mark.parametrize(
    "shape", [(0, 3, 5, 7), (2, 0, 5, 7), (2, 3, 0, 7), (2, 3, 5, 0)], ids=["experts", "rows", "K", "N"]
)
def test_empty_dimensions(library, shape):
    experts, rows, k, n = shape
    x = torch.randn(experts, rows, k, requires_grad=True)
    w = torch.randn(experts, k, n, requires_grad=True)
    b = torch.randn(experts, n, requires_grad=True)
    out = expert_matmul(x, w, b)
    out.backward(torch.ones_like(out))
    assert out.shape == (experts, rows, n)
    assert torch.equal(out, b.detach().unsqueeze(1).expand(experts, rows, n)) if k == 0 else out.numel() == 0
    assert torch.equal(x.grad, torch.zeros_like(x)) and torch.equal(w.grad, torch.zeros_like(w))
    assert torch.equal(b.grad, torch.full_like(b, float(rows)))


def test_weight_gradient_streams_into_aligned_rows_and_plain_stores_elsewhere(library):
    # N % 16 == 0 with a 64-byte aligned output takes non-temporal stores; N = 20 does not: both must be exact.
    torch.manual_seed(1)
    for n in (64, 20):
        x, g = torch.randn(3, 6, 50), torch.randn(3, 6, n)
        out = torch.full((3, 50, n), float("nan"))
        kernels._native_call("expert_matmul_tn", out, x, g, sizes=(3, 6, 50, n))
        assert relative_error(out, x.double().transpose(1, 2) @ g.double()) < 1e-5


def test_noncontiguous_inputs_and_accumulated_gradients(library):
    torch.manual_seed(2)
    x_t = torch.randn(2, 33, 6).transpose(1, 2)  # (2, 6, 33), not contiguous
    w = torch.randn(2, 33, 48, requires_grad=True)
    g = torch.randn(2, 6, 48)
    for _ in range(2):  # the second backward adds to w.grad
        expert_matmul(x_t, w).backward(g)
    want = 2 * (x_t.double().transpose(1, 2) @ g.double())
    assert relative_error(w.grad, want) < 1e-5
    assert relative_error(expert_matmul(x_t, w).detach(), x_t.double() @ w.double()) < 1e-5


def large_experts(activation="gelu", bias=True) -> MLPExperts:
    """4 experts of 64 x 4096 (262,144 weights each: the smallest the native kernels serve)."""
    torch.manual_seed(3)
    return MLPExperts(4, 64, 4096, activation, bias)


def test_native_applies_to_few_rows_through_large_float32_weights(library):
    w = torch.empty(4, 64, 4096)
    assert native_applies(torch.empty(4, 8, 64), w)
    assert native_applies(torch.empty(4, kernels.NATIVE_MIN_ROWS, 64), w)
    assert native_applies(torch.empty(4, kernels.NATIVE_MAX_ROWS, 64), w)
    assert not native_applies(torch.empty(4, 1, 64), w)  # one row: MKL's matrix-vector product is as fast
    assert not native_applies(torch.empty(4, kernels.NATIVE_MAX_ROWS + 1, 64), w)
    assert not native_applies(torch.empty(4, 8, 64), torch.empty(4, 64, 4095))  # below NATIVE_MIN_WEIGHT
    assert not native_applies(torch.empty(4, 8, 64, dtype=torch.float64), w.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not native_applies(torch.empty(4, 8, 64), w)


def count_native_calls(monkeypatch) -> list[int]:
    calls: list[int] = []

    def counted(x, weight, bias=None, activation=None):
        calls.append(x.shape[1])
        return kernels.expert_matmul(x, weight, bias, activation)

    monkeypatch.setattr(experts_module, "expert_matmul", counted)
    return calls


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_experts_take_the_native_kernels_and_match_float64(library, activation, bias, monkeypatch):
    experts = large_experts(activation, bias)
    calls = count_native_calls(monkeypatch)
    x = torch.randn(4, 8, 64, requires_grad=True)
    g = torch.randn(4, 8, 64)
    out = experts(x)
    out.backward(g)
    assert calls == [8, 8]  # both layers ran in the native kernels

    ref = MLPExperts(4, 64, 4096, activation, bias, dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in experts.state_dict().items()})
    x64 = x.detach().double().requires_grad_()
    want = ref(x64)
    want.backward(g.double())
    assert relative_error(out, want.detach()) < 1e-5
    assert relative_error(x.grad, x64.grad) < 1e-5
    for name, param in experts.named_parameters():
        assert relative_error(param.grad, getattr(ref, name).grad) < 1e-5, name


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "E{}xM{}xK{}xN{}".format(*s))
def test_fused_activation_matches_float64(library, shape, activation):
    experts, rows, k, n = shape
    torch.manual_seed(sum(shape))
    x, w, b = torch.randn(experts, rows, k), torch.randn(experts, k, n), torch.randn(experts, n)
    want = ref_activation(activation, torch.baddbmm(b.double().unsqueeze(1), x.double(), w.double()))
    with torch.no_grad():
        got = expert_matmul(x, w, b, activation)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_fused_activation_over_the_whole_float_range(library, activation):
    """The kernel's activation (gelu's erf and tanh built on its own exp) on values from -1e4 to 1e4 and a NaN,
    through a product with one input row of ones: within 3e-7 of float64 relative to max(1, |result|), NaN kept."""
    values = torch.cat([torch.linspace(-12.0, 12.0, 24001), torch.tensor([0.0, -88.0, -90.0, 100.0, -1e4, 1e4])])
    with torch.no_grad():
        got = expert_matmul(torch.ones(1, 1, 1), torch.cat([values, torch.tensor([float("nan")])]).view(1, 1, -1),
                            None, activation).view(-1)
    want = ref_activation(activation, values.double())
    assert ((got[:-1].double() - want).abs() / want.abs().clamp_min(1.0)).max().item() < 3e-7
    assert got[-1].isnan()


def test_fused_activation_is_for_inference_only(library):
    x, w = torch.randn(2, 4, 8), torch.randn(2, 8, 16, requires_grad=True)
    with pytest.raises(ValueError, match="no backward"):
        expert_matmul(x, w, None, "gelu")
    with torch.no_grad(), pytest.raises(ValueError, match="activation must be one of"):
        expert_matmul(x, w, None, "tanh")


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_mlp_experts_fuse_the_activation_in_inference(library, activation, monkeypatch):
    experts = large_experts(activation, True)
    x = torch.randn(4, 8, 64)
    seen = []

    def recorded(x, weight, bias=None, activation=None):
        seen.append(activation)
        return kernels.expert_matmul(x, weight, bias, activation)

    monkeypatch.setattr(experts_module, "expert_matmul", recorded)
    with torch.no_grad():
        inference = experts(x)
    training = experts(x)
    assert seen == [activation, None, None, None]  # inference: activation in the kernel; training: by torch after it
    assert relative_error(inference, training.detach().double()) < 1e-5


def test_mlp_experts_outside_the_native_range_use_torch(library, monkeypatch):
    experts = large_experts()
    calls = count_native_calls(monkeypatch)
    experts(torch.randn(4, 1, 64))
    experts(torch.randn(4, 17, 64))
    experts.double()(torch.randn(4, 8, 64, dtype=torch.float64))
    assert calls == []


def test_soft_moe_layer_is_the_same_with_and_without_native_kernels(library, monkeypatch):
    torch.manual_seed(4)
    layer = SoftMoE(64, 4, slots_per_expert=2, expert_hidden=4096)
    x = torch.randn(4, 10, 64)  # 4 inputs x 2 slots = 8 rows per expert
    g = torch.randn(4, 10, 64)
    calls = count_native_calls(monkeypatch)
    native = output_and_gradients(layer, x, g)
    assert calls == [8, 8]
    monkeypatch.setattr(experts_module, "native_applies", lambda x, weight, rows=None: False)
    plain = output_and_gradients(layer, x, g)
    assert len(calls) == 2
    for got, want in zip(native, plain):
        assert relative_error(got, want.double()) < 1e-5


def test_torch_func_transforms_use_torch(library, monkeypatch):
    experts = large_experts()
    calls = count_native_calls(monkeypatch)
    params = dict(experts.named_parameters())
    x = torch.randn(4, 8, 64)

    def loss(p):
        return torch.func.functional_call(experts, p, (x,)).square().sum()

    grads = torch.func.grad(loss)(params)
    assert calls == []
    assert set(grads) == set(params)


def test_build_failure_warns_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("SOFTMOE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", shutil.which("false") or "/bin/false")
    native_library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="building the native kernels failed"):
            assert native_library() is None
        assert not native_applies(torch.empty(4, 8, 64), torch.empty(4, 64, 4096))
        assert list(tmp_path.iterdir()) == []  # nothing half-written is left in the cache
        monkeypatch.setenv("SOFTMOE_NATIVE", "0")
        monkeypatch.delenv("CC")
        native_library.cache_clear()
        assert native_library() is None
    finally:
        native_library.cache_clear()


def test_build_goes_to_the_cache_directory(library, monkeypatch, tmp_path):
    monkeypatch.setenv("SOFTMOE_CACHE", str(tmp_path))
    native_library.cache_clear()
    try:
        assert native_library() is not None
        built = list(tmp_path.glob("softmoe_native-*.so"))
        assert len(built) == 1
        native_library.cache_clear()
        assert native_library() is not None  # reused, not rebuilt
        assert list(tmp_path.glob("softmoe_native-*.so")) == built
    finally:
        native_library.cache_clear()


def test_torch_compile_traces_torch_ops_and_matches_the_native_eager_result(library, monkeypatch):
    experts = large_experts()
    x = torch.randn(4, 8, 64)
    calls = count_native_calls(monkeypatch)
    with torch.no_grad():
        eager = experts(x)
        assert calls == [8, 8]
        compiled = torch.compile(experts, backend="eager", fullgraph=True)(x)
    assert calls == [8, 8]  # the compiled graph holds torch's batched matmuls, not the ctypes calls
    assert relative_error(compiled, eager.double()) < 1e-5
