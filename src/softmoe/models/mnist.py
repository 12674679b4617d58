"""The paper's MNIST model (section 4.2, Appendix E.1): patches -> one Soft MoE layer -> flatten -> linear head.

A 28x28 image becomes 4 tokens of 14x14 = 196 features; the layer has n experts with one slot each, every expert a
one-hidden-layer ReLU MLP with ``round(4 * 196 / n)`` hidden units (at least 1), so the total expert size stays
about the same for every n (exactly for n dividing 784); the head is linear on the flattened layer output.
"""

from __future__ import annotations

import torch
from torch import nn

from softmoe.layer import SoftMoE
from softmoe.models.patches import patchify


def expert_hidden_for(dim: int, num_experts: int, budget_multiplier: int = 4) -> int:
    """Hidden units per expert so that all n experts together have about ``budget_multiplier * dim`` of them."""
    return max(1, round(budget_multiplier * dim / num_experts))


class SoftMoEClassifier(nn.Module):
    """images (batch, channels, height, width) -> class logits (batch, num_classes).

    Args:
        image_shape: (channels, height, width), e.g. (1, 28, 28) for MNIST or (1, 8, 8) for scikit-learn digits.
        num_experts: n. grid: the patch grid (default 2x2, the paper's four 14x14 patches on MNIST).
        num_classes: size of the head. normalize: the layer's L2 normalization (the paper's code used none).
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        num_experts: int,
        num_classes: int = 10,
        grid: tuple[int, int] = (2, 2),
        normalize: bool = False,
        identical_expert_init: bool = False,
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        if height % grid[0] or width % grid[1]:
            raise ValueError(f"a {grid[0]}x{grid[1]} patch grid must divide the image size {height}x{width}")
        self.image_shape, self.grid = tuple(image_shape), tuple(grid)
        self.tokens = grid[0] * grid[1]
        self.dim = channels * (height // grid[0]) * (width // grid[1])
        self.moe = SoftMoE(
            self.dim,
            num_experts,
            expert_hidden=expert_hidden_for(self.dim, num_experts),
            activation="relu",
            normalize=normalize,
            identical_expert_init=identical_expert_init,
        )
        self.head = nn.Linear(self.tokens * self.dim, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(patchify(images, self.grid)).flatten(1))

    def expert_logit_contributions(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert's exact share of the logits: (contributions (batch, n, classes), bias (classes,)).

        With the head linear, logits under any expert subset S (no renormalization) are
        ``bias + sum_{j in S} contributions[:, j]``; with all experts this is the forward pass.
        """
        tokens = patchify(images, self.grid)
        routing = self.moe.route(tokens)
        batch, m, n, p = routing.combine.shape
        slots = self.moe.dispatch_slots(tokens, routing.dispatch.reshape(batch, m, n * p))
        expert_out = self.moe.run_experts(slots).view(batch, n, p, self.dim)
        head = self.head.weight.view(-1, m, self.dim)
        per_slot_token = torch.einsum("bjpd,cmd->bjpmc", expert_out, head)
        contributions = torch.einsum("bmjp,bjpmc->bjc", routing.combine.to(per_slot_token.dtype), per_slot_token)
        return contributions, self.head.bias

    def expert_parameter_count(self) -> int:
        return sum(p.numel() for p in self.moe.experts.parameters())
