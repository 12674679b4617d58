"""softmoe.kernels: oneDNN's linear for CPU inference (softmoe.kernels.onednn), where the layer takes it, and the
package's exports."""

from __future__ import annotations

import pytest
import torch
from reference import kernels_called, ref_activation

import softmoe.layer as layer_module
from softmoe import SoftMoE
from softmoe.kernels import onednn_applies, onednn_linear

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


def test_large_logits_take_onednn_and_match(monkeypatch):
    torch.manual_seed(0)
    layer = SoftMoE(16, 4, slots_per_expert=2)
    x = torch.randn(3, 7, 16)
    mkl = logits_and_gradients(layer, x)
    monkeypatch.setattr(layer_module, "ONEDNN_MIN_TOKEN_ELEMENTS", 1)
    monkeypatch.setattr(layer_module, "native_routing_applies", lambda *args: False)
    with torch.no_grad():
        assert ONEDNN in kernels_called(lambda: layer.route(x))
        assert (layer.route(x).logits - mkl[0]).abs().max().item() < 1e-5
    # Training too: the product runs inside an autograd Function whose backward is written out.
    assert ONEDNN in kernels_called(lambda: logits_and_gradients(layer, x))
    for got, want in zip(logits_and_gradients(layer, x), mkl, strict=True):
        assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())


def test_the_package_exports_what_the_layer_and_experts_import():
    import softmoe.kernels as kernels

    names = ["expert_matmul", "soft_moe_mixing", "native_applies", "native_mixing_applies", "onednn_applies",
             "onednn_linear", "needs_grad", "plain_eager_mode", "NATIVE_ACTIVATIONS", "MIXING_MAX_TOKENS",
             "MIXING_MAX_HIDDEN", "NATIVE_MIN_ROWS", "NATIVE_MAX_ROWS", "NATIVE_MIN_WEIGHT", "native_available",
             "native_status", "cpu_isa", "use_isa", "supported_isas"]
    missing = [name for name in names if not hasattr(kernels, name)]
    assert missing == []
    assert set(kernels.__all__) >= set(names)
    assert not hasattr(kernels, "native_library")  # replaced by native_available / native_status
    assert kernels.onednn_linear is kernels.onednn.onednn_linear
