"""softmoe.kernels.soft_moe_routing (softmoe::soft_moe_routing, csrc/soft_moe_routing.h): a Soft MoE layer's
logits, dispatch and combine weights in one native call, forward and backward, every kernel variant the CPU runs
against the routing written in torch's ops in float64, and where the layer takes it."""

from __future__ import annotations

import pytest
import torch

from grids import pairwise
from reference import kernels_called, output_and_gradients, relative_error
from softmoe import SoftMoE
from softmoe.kernels import ISAS, cpu_isa
from softmoe.kernels.soft_moe_routing import native_routing_applies, soft_moe_routing
from softmoe.layer import soft_moe_logits
from softmoe.runtime import cpu_signature
from softmoe.tuning import TABLE, Measured, value

NORMALIZATIONS = ["router", "inputs", "none"]
# (batch, tokens, dim, slots): slots below every vector width, a whole AVX-512 vector plus a tail, one token, one
# slot, many tokens and slots (a ViT layer's routing, smaller), dims with a tail past the last vector, a dim past four
# AVX-512 vectors (the tokens' norms in four partial sums, then single vectors, then a tail). Up to
# SOFTMOE_ROUTING_SMALL_SLOTS (32) slots the kernel computes the products itself, up to 4 tokens at a time (2 with
# four AVX2 vectors of slots, 1-2 with five to eight SSE vectors): blocks of tokens with tails of 1-3 (1, 5, 6, 7, 30
# tokens), and 9, 13, 21, 29 and 32 slots (two to four AVX2 vectors, three to eight of 4 lanes, two AVX-512 vectors).
# Up to half a vector of slots (6 with AVX-512) the logits are dot products along dim, tokens in blocks by the slots:
# 1-6 slots, with dims of a tail only (7), whole vectors and tails (20, 33, the MNIST layer's 196) and 1-7 tokens.
# From 2^15 / dim slots on (168 at dim 196) the slot parameters are normalized by two threads, each its columns.
SHAPES = [(5, 4, 20, 6), (3, 17, 33, 37), (2, 1, 7, 1), (4, 30, 48, 16), (2, 64, 40, 128), (3, 5, 100, 40),
          (3, 7, 33, 9), (2, 6, 16, 13), (3, 7, 33, 29), (2, 5, 20, 21), (2, 6, 17, 32), (3, 5, 7, 2), (2, 7, 33, 3),
          (3, 4, 196, 2), (2, 6, 196, 4), (2, 3, 40, 5), (2, 3, 196, 203)]
SMALL_SLOTS = 32


def tolerance(t: torch.Tensor) -> float:
    """1e-5 relative, but 5e-5 for a scale's gradient (0-dim) in a layer: it sums every logit's gradient times the
    logit, with much cancellation, and float32 rounding leaves about 1e-5 of it in torch's routing too."""
    return 5e-5 if t.dim() == 0 else 1e-5


def assert_scale_gradient_close(got, x, phi, scale, normalize, upstream):
    """The scale's gradient is sum(G * logits) / scale (G the logits' gradient): within 1e-5 of sum(|G * logits|) /
    |scale|, the size of its terms, of the float64 value (a relative bound would fail wherever they cancel)."""
    xl, phil, scalel = leaves(x, phi, scale, dtype=torch.float64)
    logits = soft_moe_logits(xl, phil, scalel, normalize)
    outputs = (logits, logits.softmax(dim=1), logits.softmax(dim=-1))
    pairs = [(o, u.double()) for o, u in zip(outputs, upstream) if u is not None]
    grad_logits, grad_scale = torch.autograd.grad([o for o, _ in pairs], [logits, scalel], [u for _, u in pairs])
    terms = float((grad_logits * logits).abs().sum().detach() / scale.abs())
    assert abs(float(got) - float(grad_scale)) <= 1e-5 * terms


def torch_routing(x, phi, scale, normalize):
    """The layer's routing in torch's ops: (logits, dispatch over tokens, combine over slots)."""
    logits = soft_moe_logits(x, phi, scale, normalize)
    return logits, logits.softmax(dim=1), logits.softmax(dim=-1)


def routing_inputs(shape, normalize, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, tokens, dim, slots = shape
    x = torch.randn(batch, tokens, dim, generator=gen)
    if normalize == "inputs":  # the layer hands this normalization normalized tokens
        x = x / (x.norm(dim=-1, keepdim=True) + 1e-6)
    phi = torch.randn(dim, slots, generator=gen) / dim**0.5
    scale = torch.tensor(1.7) if normalize != "none" else None
    return x, phi, scale


def leaves(*tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


@pytest.mark.parametrize(
    "shape, normalize, threads, row_isa",
    pairwise(shape=SHAPES, normalize=NORMALIZATIONS, threads=[1, 2], row_isa=ISAS),
    indirect=["threads", "row_isa"],
)
def test_routing_and_its_gradients_match_float64(shape, normalize, threads, row_isa):
    assert_routing_matches_float64(shape, normalize)


@pytest.mark.parametrize("onednn", ["0", "1"])
@pytest.mark.parametrize("normalize", NORMALIZATIONS)
@pytest.mark.parametrize("shape", [(16, 32, 64, 256), (24, 50, 100, 72)], ids=str)
def test_products_in_onednn_or_mkl_match_float64(library, onednn, normalize, shape, monkeypatch):
    """Products of at least 2^24 FLOPs (the least that oneDNN takes), in each library as the tuning table says: the
    logits, x's gradient and phi's (whose contraction runs over the rows, handed to oneDNN transposed) all in oneDNN,
    or none. The second shape's 1200 rows of dim 100 leave partial blocks in both directions of that transpose."""
    cpus = ((cpu_signature()[0], 0, None),) if onednn == "1" else ()
    monkeypatch.setitem(TABLE, "onednn_cpus", Measured(cpus, "a test"))
    assert 2 * shape[0] * shape[1] * shape[2] * shape[3] >= value("onednn_min_product_flops")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert_routing_matches_float64(shape, normalize)
    ran = sum(event.count for event in prof.key_averages() if event.key == "mkldnn::_linear_pointwise")
    assert ran == (3 if onednn == "1" and torch.backends.mkldnn.is_available() else 0)


def assert_routing_matches_float64(shape, normalize):
    """The op's outputs and every gradient against torch's routing in float64; dispatch and combine sum to one."""
    x, phi, scale = routing_inputs(shape, normalize, seed=sum(shape))
    upstream = [torch.randn(shape[0], shape[1], shape[3]) for _ in range(3)]
    got_in = leaves(x, phi, scale)
    got = soft_moe_routing(*got_in, normalize)
    torch.autograd.backward(got, upstream)
    want_in = leaves(x, phi, scale, dtype=torch.float64)
    want = torch_routing(*want_in, normalize)
    torch.autograd.backward(want, [u.double() for u in upstream])
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5
    assert relative_error(got_in[0].grad, want_in[0].grad) < 1e-5
    assert relative_error(got_in[1].grad, want_in[1].grad) < 1e-5
    if scale is not None:
        assert_scale_gradient_close(got_in[2].grad, x, phi, scale, normalize, upstream)
    for row_sums, dim in ((got[1].sum(dim=1), 1), (got[2].sum(dim=-1), -1)):  # weights sum to one on their axis
        assert torch.allclose(row_sums, torch.ones_like(row_sums), atol=1e-6), dim


@pytest.mark.parametrize("used", [(0,), (1,), (2,), (1, 2)])
def test_outputs_left_unused_give_no_gradient(library, used):
    x, phi, scale = routing_inputs((3, 5, 12, 9), "router", seed=1)
    got_in, want_in = leaves(x, phi, scale), leaves(x, phi, scale, dtype=torch.float64)
    got, want = soft_moe_routing(*got_in, "router"), torch_routing(*want_in, "router")
    upstream = [torch.randn(3, 5, 9) for _ in used]
    torch.autograd.backward([got[i] for i in used], upstream)
    torch.autograd.backward([want[i] for i in used], [u.double() for u in upstream])
    assert relative_error(got_in[0].grad, want_in[0].grad) < 1e-5
    assert relative_error(got_in[1].grad, want_in[1].grad) < 1e-5
    upstream_all = [None, None, None]
    for i, u in zip(used, upstream):
        upstream_all[i] = u
    assert_scale_gradient_close(got_in[2].grad, x, phi, scale, "router", upstream_all)


@pytest.mark.parametrize("slots", [SMALL_SLOTS, SMALL_SLOTS + 1])
def test_small_routings_compute_their_products_in_the_kernel(library, slots):
    """Up to 32 slots the logits, x's gradient and phi's come from the routing's own passes (with MKL or oneDNN and a
    pass after them the op took up to 2x as long); from 33 up from torch's matmul or oneDNN."""
    x, phi, scale = routing_inputs((4, 5, 24, slots), "router", seed=5)
    upstream = [torch.randn(4, 5, slots) for _ in range(3)]
    called = kernels_called(lambda: torch.autograd.backward(soft_moe_routing(*leaves(x, phi, scale), "router"),
                                                            upstream))
    products = {"aten::mm", "aten::addmm", "aten::matmul", "mkldnn::_linear_pointwise"} & called
    assert "softmoe::soft_moe_routing_backward" in called
    assert bool(products) == (slots > SMALL_SLOTS), products


def test_outputs_left_unused_get_no_zero_gradients_written(library):
    """The layer never uses the logits: their gradient reaches the native backward as None (no zeros filled)."""
    x, phi, scale = routing_inputs((3, 5, 12, 9), "router", seed=1)
    _, dispatch, combine = soft_moe_routing(*leaves(x, phi, scale), "router")
    upstream = [torch.randn(3, 5, 9), torch.randn(3, 5, 9)]
    called = kernels_called(lambda: torch.autograd.backward([dispatch, combine], upstream))
    assert "softmoe::soft_moe_routing_backward" in called
    assert not {"aten::zeros", "aten::zero_", "aten::fill_"} & called


def test_a_zero_column_of_phi_takes_the_subgradient_of_the_norm(library):
    x, phi, scale = routing_inputs((2, 3, 8, 4), "inputs", seed=2)
    phi[:, 1] = 0.0
    got_in, want_in = leaves(x, phi, scale), leaves(x, phi, scale, dtype=torch.float64)
    upstream = torch.randn(2, 3, 4)
    torch.autograd.backward(soft_moe_routing(*got_in, "inputs")[2], upstream)
    torch.autograd.backward(torch_routing(*want_in, "inputs")[2], upstream.double())
    assert torch.isfinite(got_in[1].grad).all()
    assert relative_error(got_in[1].grad, want_in[1].grad) < 1e-5


def test_double_backward_differentiates_torch_ops(library):
    """A gradient penalty: the second derivative through the op equals torch's routing's (float64 reference)."""
    x, phi, scale = routing_inputs((2, 4, 6, 5), "router", seed=3)

    def penalty(routing, dtype):
        xl, phil, scalel = leaves(x, phi, scale, dtype=dtype)
        _, dispatch, combine = routing(xl, phil, scalel, "router")
        loss = (dispatch * torch.arange(5, dtype=dtype)).sum() + combine.square().sum()
        (grad_x,) = torch.autograd.grad(loss, xl, create_graph=True)
        return torch.autograd.grad(grad_x.square().sum(), [xl, phil, scalel])

    for got, want in zip(penalty(soft_moe_routing, torch.float32), penalty(torch_routing, torch.float64), strict=True):
        assert relative_error(got, want) < 1e-4


@pytest.mark.parametrize(("normalize", "onednn"), [("router", False), ("inputs", True), ("none", False)])
def test_opcheck(library, normalize, onednn):
    x, phi, scale = routing_inputs((2, 3, 10, 7), normalize, seed=4)
    x, phi = x.requires_grad_(), phi.requires_grad_()
    args = (x, phi, scale, normalize, cpu_isa(), onednn)
    torch.library.opcheck(torch.ops.softmoe.soft_moe_routing.default, args)
    logits, dispatch, combine, r = torch.ops.softmoe.soft_moe_routing(*args)
    grads = [torch.randn_like(logits), None, torch.randn_like(combine)]
    torch.library.opcheck(
        torch.ops.softmoe.soft_moe_routing_backward.default,
        (*grads, x.detach(), phi.detach(), scale, logits.detach(), dispatch.detach(), combine.detach(), r,
         normalize, cpu_isa(), onednn),
    )


def test_bad_arguments_are_refused(library):
    x, phi, scale = routing_inputs((2, 3, 10, 7), "router", seed=5)
    with pytest.raises(ValueError, match="normalize must be one of"):
        soft_moe_routing(x, phi, scale, "layer")
    with pytest.raises(ValueError, match="needs a scalar scale"):
        soft_moe_routing(x, phi, None, "router")
    with pytest.raises(ValueError, match=r"phi \(dim, slots\), got \(2, 3, 10\) and \(9, 7\)"):
        soft_moe_routing(x, phi[:9], scale, "router")


def native_routings(fn) -> int:
    """How many times ``fn()`` ran the native routing's forward (softmoe::soft_moe_routing), seen by torch's
    profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(event.count for event in prof.key_averages() if event.key == "softmoe::soft_moe_routing")


@pytest.mark.parametrize("normalize", NORMALIZATIONS)
def test_the_layer_takes_it_and_matches_its_float64_twin(library, normalize):
    torch.manual_seed(6)
    layer = SoftMoE(12, 5, slots_per_expert=2, expert_hidden=7, normalize=normalize)
    twin = SoftMoE(12, 5, slots_per_expert=2, expert_hidden=7, normalize=normalize, dtype=torch.float64)
    twin.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    x, g = torch.randn(3, 6, 12), torch.randn(3, 6, 12)
    assert layer.backend_for(x).steps["route"].startswith("softmoe::soft_moe_routing ")
    results = {}
    assert native_routings(lambda: results.update(got=output_and_gradients(layer, x, g))) == 1
    assert native_routings(lambda: results.update(want=output_and_gradients(twin, x.double(), g.double()))) == 0
    # (float64 keeps torch's ops)
    for got_t, want_t in zip(results["got"], results["want"], strict=True):
        assert relative_error(got_t, want_t) < tolerance(got_t)


def test_masks_and_noise_keep_torch_ops(library):
    torch.manual_seed(7)
    layer = SoftMoE(12, 4, noise_std=0.5)
    x = torch.randn(2, 5, 12)

    def noisy_and_masked():
        layer.train()
        layer(x)  # noisy logits
        layer.eval()
        layer(x, torch.tensor([[True] * 5, [True, True, False, False, False]]))  # a mask

    assert native_routings(noisy_and_masked) == 0
    assert native_routings(lambda: layer(x)) == 1
    assert not native_routing_applies(x.double(), layer.phi.reshape(12, 4).double(), None)
