"""Every private torch internal softmoe uses, each behind one function here.

torch does not promise to keep these. Each function has a test (tests/test_compat.py) that fails loudly when a
torch release changes or removes what it relies on, instead of softmoe silently taking another path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.autograd import forward_ad

__all__ = [
    "check",
    "grouped_gemm",
    "has_grouped_gemm",
    "onednn_linear_pointwise",
    "registered",
    "transforms_active",
]


def transforms_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jacrev, jvp, ...) is tracing the current call, or a forward-mode
    AD level is open (``torch.autograd.forward_ad``'s dual tensors, which require no grad): both need torch's own
    ops, since softmoe's custom ops and autograd Functions have no batching or forward-mode rules (a custom op drops
    a dual's tangent without a word)."""
    return torch._C._are_functorch_transforms_active() or forward_ad._current_level >= 0


def check(condition: bool, message: Callable[[], str]) -> None:
    """``torch._check``: a RuntimeError with ``message()`` unless ``condition`` holds. The ops' fake (meta) functions
    check their arguments with it: under torch.compile's symbolic shapes a condition on sizes becomes a guard or a
    runtime assertion instead of a data-dependent error."""
    torch._check(condition, message)


def onednn_linear_pointwise(
    x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, attr: str, algorithm: str
) -> torch.Tensor:
    """oneDNN's fused linear, ``attr(x @ weight_t.T + bias)`` (torch's private ``mkldnn._linear_pointwise``, the
    kernel torch.compile's CPU inference uses): x (..., K), weight_t (N, K), bias (N,) -> (..., N); ``attr`` is
    "none", "relu" or "gelu" and ``algorithm`` gelu's approximation ("none" or "tanh", else "")."""
    return torch.ops.mkldnn._linear_pointwise(x, weight_t, bias, attr, [], algorithm)


def has_grouped_gemm() -> bool:
    """Whether this torch has its grouped GEMM (``torch._grouped_mm``, private, since torch 2.8)."""
    return hasattr(torch, "_grouped_mm")


def grouped_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM (``torch._grouped_mm``): a (rows, K) @ b (E, K, N) with the row groups ending at
    ``offs`` (E,) int32 -> (rows, N); or a (K, rows) @ b (rows, N) -> (E, K, N), one product per group."""
    return torch._grouped_mm(a, b, offs=offs)


def registered(module: nn.Module, name: str):
    """``module.<name>``: a registered parameter or submodule looked up in the module's own dicts (``_parameters``,
    ``_modules``, private), where ``nn.Module.__getattr__`` searches three dicts per name (for the steps every call
    takes); anything else (a plain attribute, a parametrized tensor of torch.nn.utils.parametrize) as an attribute."""
    params, modules = module._parameters, module._modules
    if name in params:
        return params[name]
    return modules[name] if name in modules else getattr(module, name)
