"""What every backend shares: the generic steps, written once in torch ops, which a backend overrides where its
kernels serve (see :mod:`softmoe.backends`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from softmoe.experts import MLPExperts
from softmoe.kernels.grouped_mm import GroupedProduct, grouped_mm
from softmoe.layer import combine_slots, dispatch_slots, experts_on_slots, soft_moe_routing
from softmoe.selection_plan import choose_plan, kept_slots

if TYPE_CHECKING:
    from softmoe.layer import SoftMoE
    from softmoe.selection import ExpertSelector


def autocast_on(x: torch.Tensor) -> bool:
    """Whether autocast is enabled for x's device type ("meta" counts as "cpu")."""
    return torch.is_autocast_enabled("cpu" if x.is_cpu or x.is_meta else x.device.type)


def logit_noise(layer: SoftMoE) -> float:
    """The std of the noise the layer's routing adds to its logits now: ``noise_std`` in training mode, else 0."""
    return layer.noise_std if layer.training else 0.0


def algorithm1_k(layer: SoftMoE, mask: torch.Tensor | None, selector: ExpertSelector) -> int | None:
    """k where a backend may make the selector's choice itself: Algorithm 1 with a fixed k >= 1 (``top_k``), no
    mask and no logit noise; else None (the selector's ``select`` chooses)."""
    k = selector.top_k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1 or mask is not None:
        return None
    return None if logit_noise(layer) > 0 else k


class Backend:
    """The layer's steps in torch ops (module doc of :mod:`softmoe.backends`); subclasses replace some of them."""

    name = "generic"

    def unsupported(self, layer: SoftMoE, x: torch.Tensor) -> str | None:
        """Why this backend cannot run tokens x (batch, tokens, dim) of ``layer``, or None where it can."""
        return None

    def route(self, layer: SoftMoE, x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dispatch and combine (batch, tokens, n*p) of the slot inputs x (batch, tokens, dim)."""
        phi, scale, _ = layer.weights()
        _, dispatch, combine = soft_moe_routing(x, phi, scale, layer.normalize, logit_noise(layer), mask)
        return dispatch, combine

    def mix(
        self, layer: SoftMoE, x: torch.Tensor, dispatch: torch.Tensor, combine: torch.Tensor, kept: bool = False
    ) -> torch.Tensor:
        """C f(D^T X) with every expert: (batch, tokens, d_out). ``kept``: combine is zero outside the slots of
        each input's kept experts (Algorithm 1's dense plan), which a backend may use to skip work."""
        slots = dispatch_slots(x, dispatch)
        return combine_slots(combine, experts_on_slots(layer.experts, slots, layer.num_experts))

    def select(
        self, layer: SoftMoE, x: torch.Tensor, mask: torch.Tensor | None, selector: ExpertSelector
    ) -> torch.Tensor:
        """The output with only the experts ``selector`` picks for each input (:meth:`ExpertSelector.select`)."""
        dispatch, combine = self.route(layer, x, mask)
        shape = (*x.shape[:2], layer.num_experts, layer.slots_per_expert)
        selected = selector.select(combine.view(shape))
        return self.mix_selected(layer, x, dispatch, combine, selected, selector.renormalize, selector.plan)

    def mix_selected(
        self,
        layer: SoftMoE,
        x: torch.Tensor,
        dispatch: torch.Tensor,
        combine: torch.Tensor,
        selected: torch.Tensor,
        renormalize: bool,
        plan: str,
        combine_is_kept: bool = False,
    ) -> torch.Tensor:
        """Algorithm 1's mixing: only the ``selected`` (batch, k) experts of each input (-1: an unused place), on
        ``plan`` (for "auto" :meth:`plan`'s); ``combine_is_kept``: combine is zero outside them already."""
        if plan == "auto":
            plan = self.plan(layer, x, dispatch, combine, selected, renormalize, top_k=combine_is_kept)
        if plan == "selected":
            return self.selected(layer, x, dispatch, combine, selected, renormalize)
        if not combine_is_kept:
            combine = kept_combine(layer, combine, selected, renormalize)
        elif renormalize:
            combine = renormalized(combine)
        return self.mix(layer, x, dispatch, combine, kept=True)

    def plan(
        self,
        layer: SoftMoE,
        x: torch.Tensor,
        dispatch: torch.Tensor,
        combine: torch.Tensor,
        selected: torch.Tensor,
        renormalize: bool,
        top_k: bool = False,
    ) -> str:
        """The plan "auto" runs: :func:`softmoe.selection_plan.choose_plan` (the cost model, or with autotuning on
        the plans timed); ``top_k``: ``selected`` is Algorithm 1's top k, every place used."""

        def runs() -> dict:
            masked = kept_combine(layer, combine, selected, renormalize)
            return {
                "dense": lambda: self.mix(layer, x, dispatch, masked, kept=True),
                "selected": lambda: self.selected(layer, x, dispatch, combine, selected, renormalize),
            }

        return choose_plan(layer, x, selected, self.name, runs, top_k)

    def selected(
        self,
        layer: SoftMoE,
        x: torch.Tensor,
        dispatch: torch.Tensor,
        combine: torch.Tensor,
        selected: torch.Tensor,
        renormalize: bool,
    ) -> torch.Tensor:
        """Algorithm 1's selected plan (:func:`selected_plan`) with the grouped product :meth:`selected_product`
        names: (batch, tokens, d_out)."""
        product = self.selected_product(layer, x, selected)
        return selected_plan(layer, x, dispatch, combine, selected, renormalize, product)

    def selected_product(self, layer: SoftMoE, x: torch.Tensor, selected: torch.Tensor) -> GroupedProduct | None:
        """The grouped product MLPExperts run their layers through in the selected plan for tokens x keeping the
        experts ``selected`` (batch, k): ``softmoe::grouped_mm`` (torch's products); None: every expert on every
        group in torch's batched products (:meth:`~softmoe.experts.MLPExperts.forward_selected`). Other experts
        run their own ``forward_selected``."""
        return grouped_mm

    def mixing(self, layer: SoftMoE, x: torch.Tensor) -> str:
        """The formulation of the mixing that runs for x: "reference", "slots", "tokens", or on the "cpu" backend
        "fused" (the one-pass small-expert kernel) and "native" (the slot formulation with its expert matmul)."""
        return "reference"

    def steps(self, layer: SoftMoE, x: torch.Tensor) -> dict[str, str]:
        """What runs each step for x, in words (for :meth:`SoftMoE.backend_for`)."""
        return {
            "route": "torch ops",
            "mix": "torch ops: slots, every expert, combine",
            "select": "the selector on the combine weights; the selected plan in torch ops and softmoe::grouped_mm "
            "(torch's products per expert)",
        }


def renormalized(combine: torch.Tensor) -> torch.Tensor:
    """Combine weights (batch, tokens, slots) rescaled to sum to 1 over the slots; a token with none stays zero."""
    return combine / combine.sum(-1, keepdim=True).clamp_min(torch.finfo(combine.dtype).tiny)


def kept_combine(layer: SoftMoE, combine: torch.Tensor, selected: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """combine (batch, tokens, n*p) with the slots of the experts not ``selected`` (batch, k) zeroed; with
    ``renormalize`` each token's weights rescaled to sum to 1 over the kept slots."""
    kept = torch.where(kept_slots(selected, layer.num_experts, layer.slots_per_expert), combine, 0.0)
    return renormalized(kept) if renormalize else kept


def selected_plan(
    layer: SoftMoE,
    x: torch.Tensor,
    dispatch: torch.Tensor,
    combine: torch.Tensor,
    selected: torch.Tensor,
    renormalize: bool,
    product: GroupedProduct | None,
) -> torch.Tensor:
    """Only the kept experts, on the slots of the inputs that keep them, grouped by expert
    (:meth:`~softmoe.experts.Experts.forward_selected`); ``product``: what MLPExperts run their layers through
    (:meth:`Backend.selected_product`)."""
    batch, tokens, d = x.shape
    p, k = layer.slots_per_expert, selected.shape[1]
    # Unused places (-1) take expert 0's slots; the experts give them zero outputs, so only a renormalization needs to
    # leave their combine weights out.
    index = selected.clamp_min(0)
    slot_index = (index.unsqueeze(-1) * p + torch.arange(p, device=x.device)).reshape(batch, 1, k * p)
    slot_index = slot_index.expand(batch, tokens, k * p)
    kept_dispatch, kept_combine = dispatch.gather(2, slot_index), combine.gather(2, slot_index)
    if renormalize:
        used = (selected >= 0).repeat_interleave(p, dim=1).unsqueeze(1)  # (batch, 1, k * p)
        kept_combine = renormalized(torch.where(used, kept_combine, 0.0))
    slots = dispatch_slots(x, kept_dispatch).view(batch * k, p, d)
    experts, expert = layer.experts, selected.reshape(batch * k)
    if isinstance(experts, MLPExperts):
        expert_out = experts.forward_selected(slots, expert, product)
    else:
        expert_out = experts.forward_selected(slots, expert)
    return combine_slots(kept_combine, expert_out.view(batch, k * p, -1))
