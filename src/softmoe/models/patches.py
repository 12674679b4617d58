"""Cutting images into non-overlapping patch tokens."""

from __future__ import annotations

import torch


def patchify(images: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """Split images into a grid of equal patches, row-major, each flattened channel-first.

    images: (batch, channels, height, width) with height and width divisible by the grid
    -> tokens (batch, grid_h * grid_w, channels * (height // grid_h) * (width // grid_w)).
    """
    if images.dim() != 4:
        raise ValueError(f"images must have shape (batch, channels, height, width), got {tuple(images.shape)}")
    batch, channels, height, width = images.shape
    rows, cols = grid
    if rows < 1 or cols < 1 or height % rows or width % cols:
        raise ValueError(f"a {rows}x{cols} patch grid must divide the image size {height}x{width}")
    ph, pw = height // rows, width // cols
    patches = images.reshape(batch, channels, rows, ph, cols, pw).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(batch, rows * cols, channels * ph * pw)
