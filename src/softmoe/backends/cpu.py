"""The "cpu" backend: softmoe's native CPU ops for float32 tensors and MLP experts (see :mod:`softmoe.kernels`).

route         ``softmoe::soft_moe_routing``: logits, dispatch and combine in one pass (torch ops with a mask or
              logit noise)
mix           ``softmoe::soft_moe_mixing``, the whole mixing of small relu experts in one pass, where it serves;
              else the token formulation where its cost model finds it cheaper; else the slot formulation with
              ``softmoe::expert_matmul`` for few rows through large weights, or with batched matmuls (oneDNN's where
              they outrun MKL on this CPU; the weight gradients in blocks of the native pool, reused step to step)
select        Algorithm 1's choice in the routing's own pass in inference, or ``softmoe::top_k_combine`` after it
plan          plan "auto" for Algorithm 1: in inference with the fused mixing the dense plan (the kernel skips the
              unkept experts itself); where the selected plan runs in one call, that plan (it does a part of the
              dense plan's work and nothing more); else the cost model (softmoe.selection_plan)
selected      the selected plan in one call (``softmoe::selected_mixing``) in inference, where the expert matmul
              serves every kept expert's rows (:func:`fused_selected_serves`); else the plan in torch ops with the
              experts' layers in ``softmoe::native_grouped_mm`` (each expert's product in the native expert matmul,
              oneDNN or MKL by its shape)
"""

from __future__ import annotations

import torch

from softmoe.backends.base import algorithm1_k, kept_combine, logit_noise, renormalized
from softmoe.backends.generic import SlotsBackend, TokensBackend, expert_rows, slot_rows, token_space_is_cheaper
from softmoe.kernels import native_available, native_status
from softmoe.kernels.expert_matmul import NATIVE_ACTIVATIONS, expert_matmul, native_applies, reusable_empty
from softmoe.kernels.modes import needs_grad
from softmoe.kernels.native_grouped_mm import native_grouped_mm, native_serves
from softmoe.kernels.onednn import batched_matmul
from softmoe.kernels.selected_mixing import selected_mixing
from softmoe.kernels.soft_moe_mixing import native_mixing_applies, soft_moe_mixing
from softmoe.kernels.soft_moe_routing import soft_moe_routing, soft_moe_routing_top_k
from softmoe.kernels.top_k_combine import top_k_combine
from softmoe.tuning import value

_TOKENS = TokensBackend()


def fused_mixing_serves(layer, x: torch.Tensor) -> bool:
    """Whether ``softmoe::soft_moe_mixing`` runs the layer's mixing of x: relu experts that keep the dimension,
    few tokens, weights small enough (:func:`~softmoe.kernels.soft_moe_mixing.native_mixing_applies`)."""
    experts = layer.experts
    return experts.out_dim == experts.dim and native_mixing_applies(x, experts.hidden, experts.activation)


def skips_unkept(layer, x: torch.Tensor, *routing: torch.Tensor) -> bool:
    """Whether the mixing of x with a kept combine runs only the kept experts' work: the fused mixing in inference
    (``softmoe::soft_moe_mixing_inference`` lays the kept slots out)."""
    return fused_mixing_serves(layer, x) and not needs_grad(x, *routing, *layer.experts.weights())


def fused_selected_serves(layer, x: torch.Tensor) -> bool:
    """Whether ``softmoe::selected_mixing`` runs Algorithm 1's selected plan for tokens x in inference: the experts'
    activation is one the expert matmul applies, and the expert matmul serves the rows of every expert (at most
    batch x slots per expert: every input keeps it) through both layers, each expert's product in one call that
    splits its work over the threads itself (for more than one row by columns, a weight taller than wide too)."""
    experts = layer.experts
    weight1, _, weight2, _ = experts.weights()
    most = x.shape[0] * layer.slots_per_expert
    return (
        experts.activation in NATIVE_ACTIVATIONS and native_serves(x, weight1, most) and native_serves(x, weight2, most)
    )


def selected_in_one_call(layer, x: torch.Tensor, *routing: torch.Tensor) -> bool:
    """Whether the selected plan runs in one call of ``softmoe::selected_mixing``: in inference, where
    :func:`fused_selected_serves`."""
    return not needs_grad(x, *routing, *layer.experts.weights()) and fused_selected_serves(layer, x)


class CpuBackend(SlotsBackend):
    name = "cpu"
    # the slot formulation's batched products in oneDNN where it outruns MKL on this CPU, its weight gradients in
    # blocks of the native pool reused from step to step
    matmul = staticmethod(batched_matmul)
    gradient_buffer = staticmethod(reusable_empty)

    def unsupported(self, layer, x):
        why = super().unsupported(layer, x)
        if why is not None:
            return why
        if not (x.is_cpu and x.dtype == layer.experts.weights()[0].dtype == torch.float32):
            return f"the native ops take float32 CPU tensors, got {x.dtype} on {x.device}"
        if not native_available():
            return native_status()
        return None

    def route(self, layer, x, mask):
        if mask is not None or logit_noise(layer) > 0:
            return super().route(layer, x, mask)
        phi, scale, _ = layer.weights()
        _, dispatch, combine = soft_moe_routing(x, phi, scale, layer.normalize)
        return dispatch, combine

    def mixing(self, layer, x: torch.Tensor) -> str:
        """The mixing that runs for x: "fused", "tokens", "native" (the slot formulation with the native expert
        matmul) or "slots" (by capability, then the token formulation's cost model, then the rows per expert)."""
        if fused_mixing_serves(layer, x):
            return "fused"
        experts, (batch, tokens, _) = layer.experts, x.shape
        if token_space_is_cheaper(experts, tokens, layer.slots_per_expert):
            return "tokens"
        # without grad mode only the forward products run: the native kernel serves more rows there
        most = value("native_max_rows" if torch.is_grad_enabled() else "native_forward_max_rows")
        if native_applies(x, experts.weight1, batch * layer.slots_per_expert, max_rows=most):
            return "native"
        return "slots"

    def mix(self, layer, x, dispatch, combine, kept=False):
        mixing = self.mixing(layer, x)
        if mixing == "tokens":
            return _TOKENS.mix(layer, x, dispatch, combine)
        if mixing == "slots":
            return super().mix(layer, x, dispatch, combine)
        experts, p = layer.experts, layer.slots_per_expert
        weight1, bias1, weight2, bias2 = experts.weights()
        if mixing == "fused":
            return soft_moe_mixing(x, dispatch, combine, weight1, bias1, weight2, bias2, kept_combine=kept)
        rows = expert_rows(torch.bmm(dispatch.transpose(1, 2), x), layer.num_experts, p)
        if needs_grad(rows, weight1, bias1):
            h = experts.act(expert_matmul(rows, weight1, bias1))
        else:  # inference: the activation applied inside the kernel
            h = expert_matmul(rows, weight1, bias1, experts.activation)
        y = slot_rows(expert_matmul(h, weight2, bias2), x.shape[0], p)
        return batched_matmul(combine, y)

    def select(self, layer, x, mask, selector):
        k = algorithm1_k(layer, mask, selector)
        if k is None:
            return super().select(layer, x, mask, selector)
        phi, scale, experts = layer.weights()
        p, renormalize, plan = layer.slots_per_expert, selector.renormalize, selector.plan
        # inference: Algorithm 1's choice in the routing's pass; where the fused mixing skips the unkept experts
        # itself it takes the kept slots as bits, and the kept experts are not listed
        direct = plan != "selected" and skips_unkept(layer, x)
        routed = soft_moe_routing_top_k(x, phi, scale, layer.normalize, p, k, with_selected=not direct)
        if routed is not None:
            dispatch, combine, slots, selected = routed
            if direct:
                combine = renormalized(combine) if renormalize else combine
                return soft_moe_mixing(x, dispatch, combine, *experts.weights(), kept_combine=True, kept_slots=slots)
            return self.mix_selected(layer, x, dispatch, combine, selected, renormalize, plan, combine_is_kept=True)
        # with gradients recorded: the routing, then the choice in one native call
        dispatch, combine = self.route(layer, x, mask)
        combine, selected = top_k_combine(combine, p, k)
        return self.mix_selected(layer, x, dispatch, combine, selected, renormalize, plan, combine_is_kept=True)

    def selected_product(self, layer, x, selected):
        return native_grouped_mm  # (the "cpu" backend serves MLPExperts only)

    def selected(self, layer, x, dispatch, combine, selected, renormalize):
        if not selected_in_one_call(layer, x, dispatch, combine):
            return super().selected(layer, x, dispatch, combine, selected, renormalize)
        if renormalize:
            combine = kept_combine(layer, combine, selected, renormalize)
        experts = layer.experts
        return selected_mixing(
            x, dispatch, combine, selected, experts.weights(), layer.slots_per_expert, experts.activation
        )

    def plan(self, layer, x, dispatch, combine, selected, renormalize, top_k=False):
        if skips_unkept(layer, x, dispatch, combine):
            return "dense"  # the fused mixing runs only the kept experts' work
        if selected_in_one_call(layer, x, dispatch, combine):
            # the kept experts' products, each expert's weights read once, and nothing the dense plan does not do
            return "selected"
        return super().plan(layer, x, dispatch, combine, selected, renormalize, top_k)

    def steps(self, layer, x):
        phi, scale, experts = layer.weights()
        inference = not needs_grad(x, phi, scale, *experts.weights())
        fused = "softmoe::soft_moe_mixing_inference" if inference else "softmoe::soft_moe_mixing"
        mixing = {
            "fused": f"{fused}, every step of the small experts in one pass",
            "tokens": "the token-space rewrite (its cost model)",
            "native": "the slot formulation with softmoe::expert_matmul",
            "slots": "the slot formulation in batched matmuls (oneDNN's where they outrun MKL on this CPU)",
        }[self.mixing(layer, x)]
        plan = (
            "softmoe::selected_mixing in inference, else torch ops" if fused_selected_serves(layer, x) else "torch ops"
        )
        return {
            "route": "torch ops (logit noise in training)"
            if logit_noise(layer) > 0
            else "softmoe::soft_moe_routing (torch ops with a mask)",
            "mix": mixing,
            "select": f"Algorithm 1 in the routing's pass (inference) or softmoe::top_k_combine; the selected plan in "
            f"{plan} and softmoe::native_grouped_mm",
        }
