"""Backends: the code that runs each step of a Soft MoE layer, chosen in one place.

A backend is an object (:class:`Backend`) with the layer's steps, for the inputs it supports:

    route(layer, x, mask)                dispatch D and combine C, each (batch, tokens, n*p), float32 or wider
    mix(layer, x, D, C)                  C f(D^T X) with every expert: (batch, tokens, d_out)
    select(layer, x, mask, selector)     the output with only each input's selected experts (Algorithm 1 and the
                                         other rules of softmoe.selection): the choice, then mix_selected
    mix_selected(layer, x, D, C, selected, renormalize, plan)
                                         the selected experts' mixing, on the plan of softmoe.selection_plan
    selected(layer, x, D, C, selected, renormalize)
                                         the "selected" plan: only the kept experts, on the slots of the inputs
                                         that keep them

``SoftMoE(backend=name)`` takes a name of :data:`BACKENDS`:

    "reference"  plain torch ops for every step: Definition 1 as written (Algorithm 1's choice by a sort, its
                 selected plan with every expert on every kept slot). Any experts, device and dtype, autocast,
                 torch.compile, torch.func transforms and forward-mode AD.
    "slots"      generic torch, MLP experts: the slot formulation in torch's batched products, its backward written
                 out in one autograd node; the selected plan in the experts' grouped product in torch's products
                 (``softmoe::grouped_mm``).
    "tokens"     generic torch, MLP experts: the exact token-space rewrite (no slot tensor is written).
    "cpu"        softmoe's native CPU ops (float32, MLP experts): routing and Algorithm 1's choice in one pass, the
                 fused mixing of small relu experts, the expert matmul for few rows through large weights, the
                 slot formulation's products in oneDNN where it outruns MKL, the selected plan in one call in
                 inference (else with each kept expert's product in the native kernel, oneDNN or MKL by its shape:
                 ``softmoe::native_grouped_mm``).
    "cuda"       CUDA, MLP experts: the Triton routing kernel in eager inference, grouped GEMM for selected experts.
    "auto"       the default: :func:`resolve` picks one of the above for each input, by the rules written there.

``layer.backend_for(x)`` says which backend runs for an input, why, and what runs each of its steps (a
:class:`BackendChoice`). A backend that cannot serve an input raises a ValueError saying why; "auto" never does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from softmoe.backends.base import Backend, autocast_on
from softmoe.backends.cpu import CpuBackend
from softmoe.backends.cuda import CudaBackend
from softmoe.backends.generic import ReferenceBackend, SlotsBackend, TokensBackend, token_space_is_cheaper
from softmoe.compat import transforms_active
from softmoe.experts import MLPExperts
from softmoe.kernels.build import native_available

if TYPE_CHECKING:
    from softmoe.layer import SoftMoE

__all__ = ["BACKENDS", "REGISTRY", "Backend", "BackendChoice", "check_backend", "choose", "explain", "resolve"]

REGISTRY: dict[str, Backend] = {
    backend.name: backend
    for backend in (ReferenceBackend(), SlotsBackend(), TokensBackend(), CpuBackend(), CudaBackend())
}
BACKENDS = ("auto", *REGISTRY)


class BackendChoice(NamedTuple):
    """The backend that runs for one input (a name of :data:`REGISTRY`), why, the backend itself, and what runs each
    of its steps for that input in the current mode ("route", "mix", "select"; in words, naming the ops)."""

    name: str
    reason: str
    backend: Backend
    steps: dict[str, str]


def check_backend(name: str) -> str:
    """``name`` if it names one of :data:`BACKENDS`, else a ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def choose(layer: SoftMoE, x: torch.Tensor) -> tuple[Backend, str]:
    """The backend for tokens x (batch, tokens, dim) of ``layer`` and why: the requested one where it can serve x
    (else a ValueError saying why), or for "auto" :func:`resolve`'s."""
    if layer.backend == "auto":
        return resolve(layer, x)
    backend = REGISTRY[layer.backend]
    why = backend.unsupported(layer, x)
    if why is not None:
        raise ValueError(f"backend {layer.backend!r} cannot run this input: {why}")
    return backend, "requested"


def explain(layer: SoftMoE, x: torch.Tensor) -> BackendChoice:
    """:func:`choose`'s backend for tokens x of ``layer``, why, and what runs each of its steps for x (the
    backend's :meth:`~Backend.steps`): what :meth:`SoftMoE.backend_for` returns."""
    backend, reason = choose(layer, x)
    return BackendChoice(backend.name, reason, backend, backend.steps(layer, x))


def resolve(layer: SoftMoE, x: torch.Tensor) -> tuple[Backend, str]:
    """The backend "auto" runs for tokens x (batch, tokens, dim) of ``layer``: the one place where softmoe decides.

    In order: plain torch ops where a torch.func transform, forward-mode AD or autocast is active, or for experts
    other than :class:`~softmoe.experts.MLPExperts`; "cuda" on CUDA; "cpu" for float32 CPU tensors where the
    native kernels are built; elsewhere the cheaper of the slot and token formulations by their cost model
    (:func:`~softmoe.backends.generic.token_space_is_cheaper`, constants in softmoe.tuning.TABLE).
    """

    def chosen(name: str, reason: str) -> tuple[Backend, str]:
        return REGISTRY[name], reason

    if transforms_active():
        return chosen("reference", "a torch.func transform or forward-mode AD is active: plain torch ops")
    if autocast_on(x):
        return chosen("reference", "autocast is on: plain torch ops")
    experts = layer.experts
    if not isinstance(experts, MLPExperts):
        return chosen("reference", f"{type(experts).__name__} experts run Definition 1 in plain torch ops")
    if x.is_cuda:
        return chosen("cuda", "CUDA tensors: Triton routing in eager inference, grouped GEMM for selected experts")
    native = ""
    if x.is_cpu and x.dtype == experts.weights()[0].dtype == torch.float32:
        if native_available():
            return chosen("cpu", "float32 CPU tensors: softmoe's native ops")
        native = " (the native ops are unavailable: softmoe.kernels.native_status() says why)"
    if token_space_is_cheaper(experts, x.shape[1], layer.slots_per_expert):
        return chosen("tokens", f"the cost model: the token-space formulation{native}")
    return chosen("slots", f"the cost model: the slot formulation{native}")
