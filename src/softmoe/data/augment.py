"""Batch augmentation in plain torch, reproducible from a ``torch.Generator``: random crop with padding, horizontal
flip, and mixup.

All functions take a batch of images (batch, channels, height, width) and draw every random number from the
generator they are given (CPU generators; the images may live on any device), so an epoch's augmentation is a
function of the generator's seed alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def _check_images(images: torch.Tensor) -> None:
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"images must have shape (batch, channels, height, width), got {got}")


def random_crop(
    images: torch.Tensor, padding: int, generator: torch.Generator | None = None, fill: float = 0.0
) -> torch.Tensor:
    """Pad every side by ``padding`` (constant ``fill``) and cut a random crop of the original size per image.

    Offsets are uniform in [0, 2 * padding] for rows and columns independently; ``padding=0`` returns the input.
    """
    _check_images(images)
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"padding must be an int >= 0, got {padding!r}")
    if padding == 0:
        return images
    batch, _, height, width = images.shape
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding), value=fill)
    offsets = torch.randint(0, 2 * padding + 1, (batch, 2), generator=generator).to(images.device)
    rows = offsets[:, :1] + torch.arange(height, device=images.device)  # (batch, height)
    cols = offsets[:, 1:] + torch.arange(width, device=images.device)  # (batch, width)
    index = torch.arange(batch, device=images.device)[:, None, None]
    cropped = padded.permute(0, 2, 3, 1)[index, rows[:, :, None], cols[:, None, :]]  # (batch, height, width, C)
    return cropped.permute(0, 3, 1, 2).contiguous()


def random_flip(images: torch.Tensor, generator: torch.Generator | None = None, p: float = 0.5) -> torch.Tensor:
    """Mirror each image left-right with probability ``p``."""
    _check_images(images)
    flip = (torch.rand(images.shape[0], generator=generator) < p).to(images.device)
    return torch.where(flip[:, None, None, None], images.flip(-1), images)


@dataclass(frozen=True)
class Augment:
    """The standard small-image augmentation: random crop with ``crop_padding`` (0: none), then a random flip."""

    crop_padding: int = 0
    flip: bool = False

    @property
    def enabled(self) -> bool:
        return self.crop_padding > 0 or self.flip

    def __call__(self, images: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        if self.crop_padding:
            images = random_crop(images, self.crop_padding, generator)
        if self.flip:
            images = random_flip(images, generator)
        return images


def sample_beta(alpha: float, generator: torch.Generator | None = None) -> float:
    """One draw of Beta(alpha, alpha), reproducible from ``generator`` (which seeds a NumPy generator)."""
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    return float(np.random.default_rng(seed).beta(alpha, alpha))


def mixup(
    images: torch.Tensor, labels: torch.Tensor, alpha: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Mixup (Zhang et al.): ``lam * x + (1 - lam) * x[perm]`` with lam ~ Beta(alpha, alpha) for the whole batch.

    Returns (mixed images, labels, labels[perm], lam); train on ``lam * loss(labels) + (1 - lam) * loss(labels[perm])``.
    """
    _check_images(images)
    lam = sample_beta(alpha, generator)
    perm = torch.randperm(images.shape[0], generator=generator).to(images.device)
    mixed = images.mul(lam).add_(images[perm], alpha=1.0 - lam)
    return mixed, labels, labels[perm], lam
