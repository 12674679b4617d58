"""softmoe.kernels: oneDNN's linear for CPU inference, and where the layer takes it."""

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


def test_large_inference_logits_take_onednn_and_match(monkeypatch):
    torch.manual_seed(0)
    layer = SoftMoE(16, 4, slots_per_expert=2)
    x = torch.randn(3, 7, 16)
    with torch.no_grad():
        mkl = layer.route(x).logits
        monkeypatch.setattr(layer_module, "ONEDNN_MIN_TOKEN_ELEMENTS", 1)
        assert ONEDNN in kernels_called(lambda: layer.route(x))
        onednn = layer.route(x).logits
    assert (onednn - mkl).abs().max().item() < 1e-5
    assert ONEDNN not in kernels_called(lambda: layer.route(x))  # training: the differentiable path
