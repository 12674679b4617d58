"""The paper's MNIST model (section 4.2, Appendix E.1): patches -> one Soft MoE layer -> flatten -> linear head.

A 28x28 image becomes 4 tokens of 14x14 = 196 features (row-major patches); the layer has n experts with one slot
each, every expert a one-hidden-layer ReLU MLP whose hidden size shrinks as n grows so that the total expert size
stays about 4 * 196 hidden units; the head is linear on the flattened layer output. Two variants
(:data:`MNIST_MODELS`):

- ``"authors"``: the model of the authors' code (beyond-param-count, mnist_experiments), which produced the paper's
  numbers: pixels ``(x - 0.1307) / 0.3081``; ``normalize="inputs"`` (tokens and phi divided by their norm plus
  1e-6, the normalized tokens replace X, a learnable scale); phi ~ U[-1, 1]; experts and head without biases;
  hidden ``int(196 * (4 / n))`` (truncated: n = 512 gives 1); weights drawn in the code's order from the seed (head,
  phi, then each expert's two layers), as ``nn.Linear`` draws them.
- ``"definition1"``: Definition 1 as the paper's text writes it: equation (1) routing without normalization, pixels
  in [0, 1], biases, phi from the layer's truncated normal, hidden ``round(196 * 4 / n)``.
- ``"authors-scale10"``: the authors' model with the router's learnable scale starting at 10 instead of 1, a
  control: it starts the combine weights far from uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from softmoe.experts import MLPExperts
from softmoe.layer import SoftMoE, dispatch_slots
from softmoe.models.patches import patchify


@dataclass(frozen=True)
class MNISTModel:
    """What distinguishes the MNIST model variants.

    normalize: the layer's normalization ("inputs", "router" or "none"). bias: biases in the experts and the head.
    hidden: "truncate" (``int(dim * (4 / n))``, the authors') or "round" (``round(4 * dim / n)``); at least 1.
    phi_init: "uniform" (U[-1, 1], the authors') or "lecun" (the layer's truncated normal).
    pixel_mean, pixel_std: the images (in [0, 1]) enter as ``(x - pixel_mean) / pixel_std``.
    scale_init: the router's learnable scale at initialization (1 in both codes; a control sets it larger).
    """

    normalize: str
    bias: bool
    hidden: str
    phi_init: str
    pixel_mean: float = 0.0
    pixel_std: float = 1.0
    scale_init: float = 1.0


MNIST_MODELS = {
    "authors": MNISTModel(
        "inputs", bias=False, hidden="truncate", phi_init="uniform", pixel_mean=0.1307, pixel_std=0.3081
    ),
    "definition1": MNISTModel("none", bias=True, hidden="round", phi_init="lecun"),
    "authors-scale10": MNISTModel(
        "inputs",
        bias=False,
        hidden="truncate",
        phi_init="uniform",
        pixel_mean=0.1307,
        pixel_std=0.3081,
        scale_init=10.0,
    ),
}
"""The MNIST model variants by name: the authors' code and Definition 1 as written (see the module doc)."""

EXPERT_BUDGET = 4
"""All n experts together have about EXPERT_BUDGET * dim hidden units (Appendix E.1: 196 * 4 / n each)."""


def mnist_model(model: str | MNISTModel) -> MNISTModel:
    """The variant called ``model`` (a key of :data:`MNIST_MODELS`), or ``model`` itself."""
    if isinstance(model, MNISTModel):
        return model
    if model not in MNIST_MODELS:
        raise ValueError(f"unknown MNIST model {model!r}; choose one of {sorted(MNIST_MODELS)}")
    return MNIST_MODELS[model]


def expert_hidden_for(dim: int, num_experts: int, rounding: str = "truncate") -> int:
    """Hidden units per expert so that all n experts together have about ``4 * dim`` of them (at least 1).

    "truncate" is the authors' ``int(dim * (4 / n))``; "round" rounds ``4 * dim / n`` to the nearest integer.
    """
    if rounding == "truncate":
        return max(1, int(dim * (EXPERT_BUDGET / num_experts)))
    if rounding == "round":
        return max(1, round(EXPERT_BUDGET * dim / num_experts))
    raise ValueError(f"rounding must be 'truncate' or 'round', got {rounding!r}")


class SoftMoEClassifier(nn.Module):
    """images (batch, channels, height, width) with pixels in [0, 1] -> class logits (batch, num_classes).

    Args:
        image_shape: (channels, height, width), e.g. (1, 28, 28) for MNIST or (1, 8, 8) for scikit-learn digits.
        num_experts: n. num_classes: size of the head. grid: the patch grid (default 2x2, the paper's four 14x14
            patches on MNIST).
        model: "authors" (default), "definition1" or an :class:`MNISTModel` (see the module doc).
        identical_expert_init: start every expert from the same weights.
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        num_experts: int,
        num_classes: int = 10,
        grid: tuple[int, int] = (2, 2),
        model: str | MNISTModel = "authors",
        identical_expert_init: bool = False,
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % grid[0] or width % grid[1]:
            raise ValueError(f"a {grid[0]}x{grid[1]} patch grid must divide the image size {height}x{width}")
        self.config = mnist_model(model)
        # tuple() loses the length of the grid, (rows, cols) as typed (a list from the CLI too)
        self.image_shape, self.grid = tuple(image_shape), cast(tuple[int, int], tuple(grid))
        self.tokens = grid[0] * grid[1]
        self.dim = channels * (height // grid[0]) * (width // grid[1])
        seed_state = torch.random.get_rng_state()
        self.moe = SoftMoE(
            self.dim,
            num_experts,
            expert_hidden=expert_hidden_for(self.dim, num_experts, self.config.hidden),
            activation="relu",
            normalize=self.config.normalize,
            expert_bias=self.config.bias,
            identical_expert_init=identical_expert_init,
        )
        self.head = nn.Linear(self.tokens * self.dim, num_classes, bias=self.config.bias)
        if self.config.phi_init == "uniform":
            torch.random.set_rng_state(seed_state)
            self._authors_init(identical_expert_init)
        if self.moe.scale is not None:
            with torch.no_grad():
                self.moe.scale.fill_(self.config.scale_init)

    @torch.no_grad()
    def _authors_init(self, identical_experts: bool) -> None:
        """Redraw the weights from torch's global generator in the order of the authors' code, which the caller
        has rewound to where construction began: the head (``nn.Linear``'s init), phi as ``2 * U[0, 1) - 1`` of shape
        (dim, n), then expert by expert its first and second layer, each like an ``nn.Linear`` of (out, in)
        weights (stored here transposed). Seeded alike, both codes start from the same weights."""
        nn.init.kaiming_uniform_(self.head.weight, a=math.sqrt(5))
        if self.head.bias is not None:
            bound = 1 / math.sqrt(self.head.in_features)
            nn.init.uniform_(self.head.bias, -bound, bound)
        self.moe.phi.copy_((2 * torch.rand(self.dim, self.moe.num_slots) - 1).view_as(self.moe.phi))
        experts = self.moe.experts
        assert isinstance(experts, MLPExperts)  # the layer is built without a custom expert: the default bank
        for j in range(1 if identical_experts else experts.num_experts):
            for weight, bias in ((experts.weight1, experts.bias1), (experts.weight2, experts.bias2)):
                fan_in, fan_out = weight.shape[1:]
                layer = torch.empty(fan_out, fan_in)
                nn.init.kaiming_uniform_(layer, a=math.sqrt(5))
                weight[j] = layer.t()
                if bias is not None:
                    bias[j].uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))
        if identical_experts:
            for param in experts.parameters():
                param.copy_(param[:1].expand_as(param))

    def tokenize(self, images: torch.Tensor) -> torch.Tensor:
        """images (batch, channels, height, width) in [0, 1] -> tokens (batch, tokens, dim), pixels normalized."""
        pixels = (images - self.config.pixel_mean) / self.config.pixel_std
        return patchify(pixels, self.grid)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.tokenize(images)).flatten(1))

    def expert_logit_contributions(
        self, images: torch.Tensor, per_token: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each expert's exact share of the logits: (contributions (batch, n, classes), bias (classes,)).

        With the head linear, logits under any expert subset S (no renormalization) are
        ``bias + sum_{j in S} contributions[:, j]``; with all experts this is the forward pass. A head without
        bias gives a zero bias. ``per_token``: (contributions (batch, tokens, n, classes), bias, each token's combine
        weight on each expert (batch, tokens, n)), what the renormalized oracle needs
        (:func:`softmoe.oracle.oracle_from_contributions`).
        """
        tokens = self.tokenize(images)
        routing = self.moe.route(tokens)
        batch, m, n, p = routing.combine.shape
        slots = dispatch_slots(self.moe.slot_inputs(tokens), routing.dispatch.reshape(batch, m, n * p))
        expert_out = self.moe.run_experts(slots).view(batch, n, p, self.dim)
        head = self.head.weight.view(-1, m, self.dim)
        per_slot_token = torch.einsum("bjpd,cmd->bjpmc", expert_out, head)
        combine = routing.combine.to(per_slot_token.dtype)
        bias = self.head.bias if self.head.bias is not None else per_slot_token.new_zeros(per_slot_token.shape[-1])
        if per_token:
            return torch.einsum("bmjp,bjpmc->bmjc", combine, per_slot_token), bias, combine.sum(dim=3)
        return torch.einsum("bmjp,bjpmc->bjc", combine, per_slot_token), bias

    def expert_parameter_count(self) -> int:
        return sum(p.numel() for p in self.moe.experts.parameters())
