"""The "cuda" backend: MLP experts on CUDA, where an eager call is bound by the host's kernel launches.

route         the "router" logits as two fused RMS norms and a product (7 kernels where the formula takes 14)
mix           the slot formulation (the "slots" backend)
select        Algorithm 1's choice and both softmaxes in ``softmoe::routing_softmaxes``' Triton kernel (eager
              inference), which also normalizes the tokens and writes a bfloat16 layer's weights in its dtype
mix_selected  the selected experts (plan "selected") in ``softmoe::skinny_grouped_mm``'s Triton kernel for at most
              softmoe.tuning.TABLE's "skinny_max_rows" rows (batch x k x slots per expert: Algorithm 1 at small
              batches, bound by reading the kept experts' weights), else ``softmoe::grouped_mm`` (torch's grouped
              GEMM in bfloat16)
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F

from softmoe.backends.base import algorithm1_k, logit_noise
from softmoe.backends.generic import SlotsBackend
from softmoe.experts import MLPExperts
from softmoe.kernels.grouped_mm import GroupedProduct, grouped_mm
from softmoe.kernels.routing_softmaxes import fused_routing_applies, routing_softmaxes
from softmoe.kernels.skinny_grouped_mm import skinny_applies, skinny_grouped_mm
from softmoe.layer import NORM_EPS, routing_dtype, routing_from_logits, soft_moe_logits
from softmoe.tuning import value


def rms_norm_logits(x: torch.Tensor, phi: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The "router" logits ``(x / |x|) (scale * phi / |phi|)`` with both normalizations as RMS norms: x (..., dim),
    phi (dim, slots), scale () -> (..., slots).

    With v / |v| = v * rsqrt(sum v^2 + 1e-6), ``rms_norm(v, eps=1e-6 / dim) = sqrt(dim) * v / |v|`` exactly, so the
    logits are ``rms_norm(x) @ rms_norm(phi^T, weight=scale / dim)^T``; on CUDA each RMS norm is one fused kernel,
    forward and backward."""
    dim = x.shape[-1]
    return F.linear(F.rms_norm(x, (dim,), eps=NORM_EPS / dim), rms_norm_columns(phi, scale / dim))


def rms_norm_columns(phi: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """phi (dim, slots)'s columns as one fused RMS norm times ``weight`` (), transposed: (slots, dim), each row
    ``sqrt(dim) * weight * v * rsqrt(sum(v^2) + 1e-6)``."""
    dim = phi.shape[0]
    return F.rms_norm(phi.t(), (dim,), weight.expand(dim), NORM_EPS / dim)


class CudaBackend(SlotsBackend):
    name = "cuda"

    def unsupported(self, layer, x):
        why = super().unsupported(layer, x)
        if why is None and not x.is_cuda:
            return f"it runs CUDA tensors, got a tensor on {x.device}"
        return why

    def logits(self, layer, x: torch.Tensor) -> torch.Tensor:
        phi, scale, _ = layer.weights()
        if layer.normalize != "router":
            return soft_moe_logits(x, phi, scale, layer.normalize)
        dtype = routing_dtype(x, phi)
        with torch.autocast("cuda", enabled=False):
            return rms_norm_logits(x.to(dtype), phi.to(dtype), scale.to(dtype))

    def route(self, layer, x, mask):
        _, dispatch, combine = routing_from_logits(self.logits(layer, x), logit_noise(layer), mask)
        return dispatch, combine

    def fused_routing(
        self, layer, x: torch.Tensor, k: int, out_dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch and combine (batch, tokens, n*p) and Algorithm 1's k experts (batch, k) from the routing op, with
        combine zero outside the kept experts' slots. With the "router" normalization the op normalizes the tokens
        itself (one kernel fewer)."""
        phi, scale, _ = layer.weights()
        if layer.normalize == "router":
            dtype = routing_dtype(x, phi)
            weight = rms_norm_columns(phi.to(dtype), scale.to(dtype) / math.sqrt(x.shape[-1]))
            logits, tokens = F.linear(x.to(dtype), weight), x
        else:
            logits, tokens = soft_moe_logits(x, phi, scale, layer.normalize), None
        return routing_softmaxes(logits, layer.slots_per_expert, k, out_dtype, tokens)

    def select(self, layer, x, mask, selector):
        k = algorithm1_k(layer, mask, selector)
        phi, scale, _ = layer.weights()
        if k is None or not fused_routing_applies(x, phi, scale, layer.slots_per_expert, k):
            return super().select(layer, x, mask, selector)
        renormalize = selector.renormalize
        narrow = x.dtype in (torch.bfloat16, torch.float16) and not renormalize
        dispatch, combine, selected = self.fused_routing(layer, x, k, x.dtype if narrow else None)
        return self.mix_selected(
            layer, x, dispatch, combine, selected, renormalize, selector.plan, combine_is_kept=True
        )

    def selected_product(self, layer, x: torch.Tensor, selected: torch.Tensor) -> GroupedProduct:
        """softmoe::skinny_grouped_mm where :func:`skinny_applies` to the selected plan's rows (batch x k x slots
        per expert), else softmoe::grouped_mm."""
        rows = selected.shape[0] * selected.shape[1] * layer.slots_per_expert
        return skinny_grouped_mm if self.skinny_serves(layer, x, rows) else grouped_mm

    def skinny_serves(self, layer, x: torch.Tensor, rows: int) -> bool:
        """Whether the selected plan's products of ``rows`` rows of tokens x run in softmoe::skinny_grouped_mm."""
        weight = cast(MLPExperts, layer.experts).weights()[0]  # ("cuda" serves MLPExperts only)
        return skinny_applies(rows, x.dtype, weight.dtype, x.device)

    def steps(self, layer, x):
        # The most k whose selected plan's rows (batch x k x slots per expert) the skinny kernel takes.
        most_k = min(layer.num_experts, value("skinny_max_rows") // max(1, x.shape[0] * layer.slots_per_expert))
        if most_k and self.skinny_serves(layer, x, x.shape[0] * most_k * layer.slots_per_expert):
            upto = "every k" if most_k == layer.num_experts else f"k <= {most_k}"
            products = f"softmoe::skinny_grouped_mm (Triton) for {upto}, else softmoe::grouped_mm"
        else:
            products = "softmoe::grouped_mm"
        return {
            "route": "fused RMS norms",
            "mix": "the slot formulation in batched matmuls",
            "select": "Algorithm 1 in the Triton routing kernel (eager inference); the selected plan's expert products "
            f"in {products}",
        }
