"""softmoe.compat: each private torch internal softmoe relies on still behaves as softmoe expects. A failure here
means a torch release changed one of them: fix softmoe.compat, not the callers."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.autograd import forward_ad
from torch.nn.utils import parametrize

from softmoe.compat import (
    check,
    grouped_gemm,
    has_grouped_gemm,
    onednn_linear_pointwise,
    registered,
    transforms_active,
)


def test_transforms_active_sees_vmap_grad_and_forward_mode_ad():
    assert not transforms_active()
    seen = []
    torch.func.vmap(lambda t: seen.append(transforms_active()) or t)(torch.ones(2, 3))
    torch.func.grad(lambda t: seen.append(transforms_active()) or t.sum())(torch.ones(2))
    with forward_ad.dual_level():
        seen.append(transforms_active())
    assert seen == [True, True, True]
    assert not transforms_active()


def test_check_raises_the_message_and_becomes_a_guard_under_compile():
    """check raises a RuntimeError with its message where the condition fails; inside a compiled function with
    dynamic shapes a condition on sizes does not break the graph, and still raises when an input breaks it."""
    check(True, lambda: "never built")
    with pytest.raises(RuntimeError, match="rows must match"):
        check(False, lambda: "rows must match")

    def rows_match(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        check(a.shape[0] == b.shape[0], lambda: "rows must match")
        return a + b.sum()

    compiled = torch.compile(rows_match, backend="eager", fullgraph=True, dynamic=True)
    assert torch.equal(compiled(torch.ones(3), torch.ones(3)), torch.full((3,), 4.0))
    with pytest.raises(RuntimeError):
        compiled(torch.ones(3), torch.ones(5))


def test_onednn_linear_pointwise_is_a_fused_linear():
    if not torch.backends.mkldnn.is_available():  # softmoe asks first and keeps torch's products then
        pytest.skip("this torch has no oneDNN")
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 12), torch.randn(7, 12), torch.randn(7)
    for attr, algorithm, act in (("none", "", lambda t: t), ("relu", "", torch.relu),
                                 ("gelu", "none", torch.nn.functional.gelu),
                                 ("gelu", "tanh", lambda t: torch.nn.functional.gelu(t, approximate="tanh"))):
        got = onednn_linear_pointwise(x, w, b, attr, algorithm)
        torch.testing.assert_close(got, act(x @ w.t() + b), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_is_one_product_per_row_group():
    assert has_grouped_gemm()  # the supported torch versions all have it (softmoe falls back without a word)
    torch.manual_seed(0)
    x, w = torch.randn(8, 8), torch.randn(3, 8, 16)  # (rows of 16-byte multiples, as the kernel needs)
    ends = torch.tensor([4, 4, 8], dtype=torch.int32)
    want = torch.cat([x[:4] @ w[0], x[4:8] @ w[2]])
    torch.testing.assert_close(grouped_gemm(x, w, ends), want, rtol=1e-5, atol=1e-5)
    g = torch.randn(8, 16)
    grads = grouped_gemm(x.t().contiguous(), g, ends)
    torch.testing.assert_close(grads[0], x[:4].t() @ g[:4], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[1], torch.zeros(8, 16), rtol=0, atol=0)


def test_registered_reads_parameters_and_submodules_from_the_modules_dicts():
    layer = nn.Linear(3, 4)
    holder = nn.Sequential(layer)
    assert registered(layer, "weight") is layer.weight and "weight" in layer._parameters
    assert registered(holder, "0") is layer and "0" in holder._modules
    assert registered(nn.Linear(3, 4, bias=False), "bias") is None  # registered as None
    assert registered(layer, "in_features") == 3  # a plain attribute
    parametrize.register_parametrization(layer, "weight", nn.Identity())
    assert torch.equal(registered(layer, "weight"), layer.weight)  # computed by its parametrization
