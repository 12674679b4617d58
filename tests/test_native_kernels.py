"""softmoe.kernels' native expert matmuls (softmoe::expert_matmul and its backward ops, csrc/expert_matmul.h):
exactness of every kernel variant the CPU runs, gradients, and where the layer takes them."""

from __future__ import annotations

import pytest
import torch

import softmoe.backends.cpu as cpu_backend
import softmoe.kernels as kernels
from grids import pairwise
from reference import output_and_gradients, ref_activation, relative_error
from softmoe import SoftMoE
from softmoe.kernels import ISAS, expert_matmul, native_applies, use_isa
from softmoe.tuning import value


def reference(x, w, b, g):
    """Output and gradients of x @ w + b with upstream gradient g, in float64 autograd."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    out = torch.bmm(x64, w64) + (0 if b64 is None else b64.unsqueeze(1))
    out.backward(g.double())
    return out.detach(), x64.grad, w64.grad, None if b64 is None else b64.grad


# Rows 1..9 and 16 cover every register tile height (8 rows a tile with AVX-512, 4 without) and a second tile;
# N covers vector tails (15, 17, 47, 49), exact tiles (16, 48) and several tiles (100, 130); K includes 1 and
# values that are not multiples of the 32-row panel or of the 2-row dot-product tile; with 200 rows the forward
# walks the columns in several blocks (OUT_BLOCK_BYTES of output each), the last one partial, then a vector tail;
# 9 rows through rows of 1100 floats (PACK_MIN_ROW_BYTES or more; 1001 are fewer) run in several passes, the later
# ones reading the tile the first copied; with AVX-512 a block is at most BLOCK_MAX_COLS (1008) columns wide, so
# 1100 and 2100 columns walk two and three blocks of several panels, the last one partial. 3 rows of 300 and 8 of 384 (one pass of at most NT_ONE_ROW_BYTES): the
# backward through the weight reads it one row at a time, an odd number of rows. One row streams the weight row
# after row: 300 rows of w split over the threads (ROW_SPLIT_MIN_ROWS), rows of 1030 floats (ROW_GROUP_MIN_BYTES or
# more) ROW_GROUP at a time with a vector tail and 131 rows (a remainder), more experts than threads.
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
    (1, 200, 33, 1001),
    (1, 9, 40, 1100),
    (2, 8, 70, 2100),
    (3, 3, 37, 300),
    (2, 8, 21, 384),
    (1, 1, 300, 37),
    (2, 1, 131, 1030),
    (5, 1, 70, 33),
]


@pytest.mark.parametrize(
    "shape, bias, threads, row_isa",
    pairwise(shape=SHAPES, bias=[True, False], threads=[1, 2, 3], row_isa=ISAS),
    indirect=["threads", "row_isa"],
)
def test_expert_matmul_and_gradients_match_float64(shape, bias, threads, row_isa):
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


def test_the_variants_agree(library):
    """Every variant the CPU runs gives the same product to rounding (they differ in vector width only)."""
    torch.manual_seed(7)
    x, w, b = torch.randn(3, 6, 70), torch.randn(3, 70, 90), torch.randn(3, 90)
    results = {}
    for isa in kernels.supported_isas():
        with use_isa(isa):
            results[isa] = expert_matmul(x, w, b)
    want = torch.baddbmm(b.double().unsqueeze(1), x.double(), w.double())
    assert set(results) >= {"portable"}
    for isa, got in results.items():
        assert relative_error(got, want) < 1e-5, isa


@pytest.mark.parametrize(
    "shape",
    [(0, 3, 5, 7), (2, 0, 5, 7), (2, 3, 0, 7), (2, 3, 5, 0), (0, 1, 5, 7), (2, 1, 0, 7), (2, 1, 5, 0)],
    ids=["experts", "rows", "K", "N", "experts-one-row", "K-one-row", "N-one-row"],
)
def test_empty_dimensions(isa, shape):
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


def test_weight_gradient_streams_into_aligned_rows_and_plain_stores_elsewhere(isa):
    # N % 16 == 0 in a 64-byte aligned output (torch's CPU allocations are) takes non-temporal stores; N = 20 does
    # not: both must be exact.
    torch.manual_seed(1)
    for n in (64, 20):
        x, g = torch.randn(3, 6, 50), torch.randn(3, 6, n)
        out = torch.ops.softmoe.expert_matmul_tn(x, g, isa)
        assert out.shape == (3, 50, n)
        assert relative_error(out, x.double().transpose(1, 2) @ g.double()) < 1e-5


def test_noncontiguous_inputs_and_accumulated_gradients(isa):
    torch.manual_seed(2)
    x_t = torch.randn(2, 33, 6).transpose(1, 2)  # (2, 6, 33), not contiguous
    w = torch.randn(2, 33, 48, requires_grad=True)
    g = torch.randn(2, 6, 48)
    for _ in range(2):  # the second backward adds to w.grad
        expert_matmul(x_t, w).backward(g)
    want = 2 * (x_t.double().transpose(1, 2) @ g.double())
    assert relative_error(w.grad, want) < 1e-5
    assert relative_error(expert_matmul(x_t, w).detach(), x_t.double() @ w.double()) < 1e-5


def test_large_weight_gradients_reuse_a_block_once_it_is_free(library):
    """A weight gradient of 32 MB or more comes from a block the extension keeps: the next step's gradient reuses
    it once the previous one was dropped (no fresh pages), never while any tensor still holds it, and the values
    are right in every case (set to None, accumulated into .grad, held across calls)."""
    torch.manual_seed(4)
    w = torch.randn(2, 2048, 2048, requires_grad=True)  # a 33.5 MB gradient
    x, g = torch.randn(2, 3, 2048), torch.randn(2, 3, 2048)
    want = (x.double().transpose(1, 2) @ g.double())

    expert_matmul(x, w).backward(g)
    first = w.grad.data_ptr()
    assert relative_error(w.grad, want) < 1e-5
    w.grad = None
    expert_matmul(x, w).backward(g)
    assert w.grad.data_ptr() == first  # the freed block came back
    expert_matmul(x, w).backward(g)  # accumulated: the new gradient is added into .grad, its block freed
    assert relative_error(w.grad, 2 * want) < 1e-5

    w.grad = None
    held = torch.autograd.grad(expert_matmul(x, w), w, g)[0]
    second = torch.autograd.grad(expert_matmul(2 * x, w), w, g)[0]  # `held` still holds its block
    assert held.data_ptr() != second.data_ptr()
    assert relative_error(held, want) < 1e-5 and relative_error(second, 2 * want) < 1e-5
    view = second[0, :4]
    del second
    third = torch.autograd.grad(expert_matmul(3 * x, w), w, g)[0]  # a view keeps a block in use too
    assert relative_error(view, 2 * want[0, :4]) < 1e-5
    assert relative_error(third, 3 * want) < 1e-5


def test_the_slot_formulations_large_weight_gradients_reuse_a_block_once_it_is_free(library):
    """The "cpu" backend's slot formulation puts its expert weight gradients (torch's products) into the same pool of
    blocks: reused once dropped, never while held, right in every case; a double backward (create_graph) keeps
    torch's own product."""
    torch.manual_seed(5)
    layer = SoftMoE(64, 4, slots_per_expert=2, expert_hidden=32768, backend="cpu")  # 33.5 MB gradients
    ref = SoftMoE(64, 4, slots_per_expert=2, expert_hidden=32768, backend="reference", dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    # 18 rows per expert: more than the native expert matmul takes with gradients
    x, g = torch.randn(9, 3, 64), torch.randn(9, 3, 64)
    assert layer.backend_for(x).backend.mixing(layer, x) == "slots"
    (ref(x.double()) * g.double()).sum().backward()
    w1, want = layer.experts.weight1, ref.experts.weight1.grad

    (layer(x) * g).sum().backward()
    first = w1.grad.data_ptr()
    assert relative_error(w1.grad, want) < 1e-5
    w1.grad = None
    (layer(x) * g).sum().backward()
    assert w1.grad.data_ptr() == first  # the freed block came back
    held = w1.grad
    w1.grad = None
    (layer(x) * 2 * g).sum().backward()
    assert w1.grad.data_ptr() != held.data_ptr()  # `held` still holds its block
    assert relative_error(held, want) < 1e-5 and relative_error(w1.grad, 2 * want) < 1e-5
    w1.grad = None
    grad = torch.autograd.grad((layer(x) * g).sum(), w1, create_graph=True)[0]
    assert grad.requires_grad and relative_error(grad, want) < 1e-5


def test_native_applies_to_few_rows_through_large_float32_weights(library):
    w = torch.empty(4, 64, 4096)
    assert native_applies(torch.empty(4, 8, 64), w)
    assert native_applies(torch.empty(4, 1, 64), w)  # one row: the weight streamed in memory order
    assert native_applies(torch.empty(4, value("native_max_rows"), 64), w)
    assert not native_applies(torch.empty(4, 0, 64), w)
    assert not native_applies(torch.empty(4, value("native_max_rows") + 1, 64), w)
    assert not native_applies(torch.empty(4, 8, 64), torch.empty(4, 64, 4095))  # below native_min_weight
    assert not native_applies(torch.empty(4, 8, 64, dtype=torch.float64), w.double())
    assert not native_applies(torch.empty(4, 8, 64, device="meta"), w.to("meta"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a custom op: autocast leaves its float32 inputs alone
        assert native_applies(torch.empty(4, 8, 64), w)
    seen = []

    def inside(t):
        seen.append(native_applies(torch.empty(4, 8, 64), w))
        return t.sum()

    torch.func.grad(inside)(torch.ones(3))  # the ops have no vmap rule: torch.func transforms keep torch's ops
    assert seen == [False]


def test_autocast_leaves_the_op_in_float32(library):
    torch.manual_seed(3)
    x, w = torch.randn(2, 8, 64), torch.randn(2, 64, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = expert_matmul(x, w)
    assert out.dtype == torch.float32
    assert relative_error(out, x.double() @ w.double()) < 1e-5


@pytest.mark.parametrize(
    "shape, activation, row_isa",
    pairwise(shape=SHAPES[1:], activation=["gelu", "gelu_tanh", "relu"], row_isa=ISAS),
    indirect=["row_isa"],
)
def test_fused_activation_matches_float64(shape, activation, row_isa):
    experts, rows, k, n = shape
    torch.manual_seed(sum(shape))
    x, w, b = torch.randn(experts, rows, k), torch.randn(experts, k, n), torch.randn(experts, n)
    want = ref_activation(activation, torch.baddbmm(b.double().unsqueeze(1), x.double(), w.double()))
    with torch.no_grad():
        got = expert_matmul(x, w, b, activation)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_fused_activation_over_the_whole_float_range(isa, activation):
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
    # The op itself, called directly with a fused activation while recording: its backward refuses.
    out = torch.ops.softmoe.expert_matmul(x, w, None, "relu", kernels.cpu_isa())
    with pytest.raises(RuntimeError, match="fused relu has no backward"):
        out.sum().backward()


# ---- the layer: SoftMoE(backend="cpu") and "auto" take the op where it applies --------------------------------


def count_native_calls(monkeypatch, recorded: list | None = None) -> list[int]:
    """The rows of every expert_matmul call the experts make (and its activation into ``recorded``)."""
    calls: list[int] = []

    def counted(x, weight, bias=None, activation=None):
        calls.append(x.shape[1])
        if recorded is not None:
            recorded.append(activation)
        return kernels.expert_matmul(x, weight, bias, activation)

    monkeypatch.setattr(cpu_backend, "expert_matmul", counted)
    return calls


def large_layer(activation="gelu", bias=True, backend="cpu", dtype=torch.float32) -> SoftMoE:
    """4 experts of 64 x 4096 (262,144 weights each: the smallest the native kernels serve), 2 slots each."""
    torch.manual_seed(3)
    return SoftMoE(64, 4, slots_per_expert=2, expert_hidden=4096, activation=activation, expert_bias=bias,
                   backend=backend, dtype=dtype)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_native_layer_takes_the_op_and_matches_float64(library, activation, bias, monkeypatch):
    layer = large_layer(activation, bias)
    calls = count_native_calls(monkeypatch)
    x, g = torch.randn(4, 10, 64), torch.randn(4, 10, 64)  # 4 inputs x 2 slots = 8 rows per expert
    got = output_and_gradients(layer, x, g)
    assert calls == [8, 8]  # both expert layers ran in the native op
    ref = large_layer(activation, bias, backend="reference", dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    want = output_and_gradients(ref, x.double(), g.double())
    for got_t, want_t in zip(got, want, strict=True):
        # The scale's gradient (0-dim) sums every logit's with much cancellation: float32 rounding leaves 1e-5 of
        # it (torch's routing 9.9e-6, the native one 1.9e-5, at relu with biases).
        assert relative_error(got_t, want_t) < (5e-5 if got_t.dim() == 0 else 1e-5)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
def test_native_layer_fuses_the_activation_in_inference(library, activation, monkeypatch):
    layer = large_layer(activation)
    x = torch.randn(4, 10, 64)
    seen: list = []
    count_native_calls(monkeypatch, seen)
    with torch.no_grad():
        inference = layer(x)
    training = layer(x)
    assert seen == [activation, None, None, None]  # inference: activation in the kernel; training: torch's after it
    assert relative_error(inference, training.detach().double()) < 1e-5


def mixing(layer: SoftMoE, x: torch.Tensor) -> str:
    """The mixing "auto" runs for x: the "cpu" backend's choice, else the backend's name."""
    choice = layer.backend_for(x)
    return choice.backend.mixing(layer, x)


def test_auto_takes_the_op_only_in_its_range(library, monkeypatch):
    layer = large_layer(backend="auto")
    calls = count_native_calls(monkeypatch)
    assert mixing(layer, torch.randn(4, 10, 64)) == "native"
    assert mixing(layer, torch.randn(9, 10, 64)) != "native"  # 18 rows per expert, in grad mode
    layer(torch.randn(9, 10, 64))
    layer.double()(torch.randn(4, 10, 64, dtype=torch.float64))
    assert calls == []


def test_auto_takes_the_op_for_more_rows_without_grad_mode(library, monkeypatch):
    """Where only the forward products run, the op serves up to native_forward_max_rows rows per expert; equal to
    the float64 layer there."""
    layer = large_layer(backend="auto")
    most = value("native_forward_max_rows") // layer.slots_per_expert  # inputs
    assert value("native_forward_max_rows") > value("native_max_rows")
    calls = count_native_calls(monkeypatch)
    x = torch.randn(9, 10, 64)  # 18 rows per expert
    with torch.no_grad():
        assert mixing(layer, torch.randn(most, 10, 64)) == "native"
        assert mixing(layer, torch.randn(most + 1, 10, 64)) != "native"
        got = layer(x)
    assert calls == [18, 18]
    ref = large_layer(backend="reference", dtype=torch.float64)
    ref.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    with torch.no_grad():
        assert relative_error(got, ref(x.double())) < 1e-5


def test_torch_func_transforms_use_torch(library, monkeypatch):
    layer = large_layer(backend="auto")
    calls = count_native_calls(monkeypatch)
    params = dict(layer.named_parameters())
    x = torch.randn(4, 10, 64)

    def loss(p):
        return torch.func.functional_call(layer, p, (x,)).square().sum()

    grads = torch.func.grad(loss)(params)
    assert calls == []
    assert set(grads) == set(params)


def test_torch_compile_of_the_native_layer_holds_the_op(library):
    """torch.compile traces the native layer into a graph that holds softmoe::expert_matmul (where the ctypes
    kernels of old were skipped), and the result is the eager one."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    torch._dynamo.reset()
    layer = large_layer()
    x = torch.randn(4, 10, 64)
    recorder = EagerAndRecordGraphs()
    with torch.no_grad():
        eager = layer(x)
        compiled = torch.compile(layer, backend=recorder, fullgraph=True)(x)
    targets = {str(node.target) for graph in recorder.graphs for node in graph.graph.nodes}
    assert "softmoe.expert_matmul" in targets
    assert relative_error(compiled, eager.double()) < 1e-6
