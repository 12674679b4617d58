"""The in-memory dataset types every loader returns: :class:`ImageDataset` and :class:`Splits`."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ImageDataset:
    """A labelled image classification set held in memory.

    Attributes:
        images: float32 tensor of shape (N, C, H, W), values in [0, 1].
        labels: int64 tensor of shape (N,), values in [0, num_classes).
        num_classes: the number of classes of the whole dataset (not only those present in this split).
        name: the dataset's name, e.g. ``"mnist5k"`` or ``"cifar10"`` (the same for its train/val/test).
    """

    images: torch.Tensor
    labels: torch.Tensor
    num_classes: int
    name: str

    def __post_init__(self) -> None:
        images, labels = self.images, self.labels
        if not isinstance(images, torch.Tensor) or images.dtype != torch.float32 or images.dim() != 4:
            raise ValueError(
                f"{self.name}: images must be a float32 tensor of shape (N, C, H, W), got {_describe(images)}"
            )
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
            raise ValueError(f"{self.name}: labels must be an int64 tensor of shape (N,), got {_describe(labels)}")
        if images.shape[0] != labels.shape[0]:
            raise ValueError(f"{self.name}: {images.shape[0]} images but {labels.shape[0]} labels")
        if not isinstance(self.num_classes, int) or self.num_classes < 1:
            raise ValueError(f"{self.name}: num_classes must be a positive int, got {self.num_classes!r}")
        if labels.numel():
            lo, hi = int(labels.min()), int(labels.max())
            if lo < 0 or hi >= self.num_classes:
                raise ValueError(f"{self.name}: labels must lie in [0, {self.num_classes}), found range [{lo}, {hi}]")
        if images.numel():
            lo_f, hi_f = float(images.min()), float(images.max())
            if not (lo_f >= 0.0 and hi_f <= 1.0):  # also rejects NaN
                raise ValueError(f"{self.name}: image values must lie in [0, 1], found range [{lo_f}, {hi_f}]")

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(C, H, W) of one image."""
        c, h, w = self.images.shape[1:]
        return (c, h, w)

    def subset(self, indices: torch.Tensor | np.ndarray | slice) -> ImageDataset:
        """The examples at ``indices`` (a slice gives views, an index array gives copies), same classes and name."""
        if isinstance(indices, np.ndarray):
            indices = torch.from_numpy(indices.astype(np.int64, copy=False))
        return ImageDataset(self.images[indices], self.labels[indices], self.num_classes, self.name)

    def concat(self, other: ImageDataset) -> ImageDataset:
        """This set's examples followed by ``other``'s (a copy), for two splits of one dataset."""
        if (other.name, other.num_classes, other.image_shape) != (self.name, self.num_classes, self.image_shape):
            raise ValueError(
                f"cannot join {other.name} ({other.num_classes} classes, images {other.image_shape}) to "
                f"{self.name} ({self.num_classes} classes, images {self.image_shape})"
            )
        return ImageDataset(
            torch.cat([self.images, other.images]), torch.cat([self.labels, other.labels]), self.num_classes, self.name
        )


@dataclass(frozen=True)
class Splits:
    """The train / validation / test splits of one dataset. Unpacks as ``train, val, test = splits``."""

    train: ImageDataset
    val: ImageDataset
    test: ImageDataset

    def __iter__(self) -> Iterator[ImageDataset]:
        return iter((self.train, self.val, self.test))

    def limit(self, train: int | None = None, val: int | None = None, test: int | None = None) -> Splits:
        """The first ``train`` / ``val`` / ``test`` examples of each split (None keeps a split whole)."""

        def first(part: ImageDataset, count: int | None) -> ImageDataset:
            return part if count is None else part.subset(slice(0, count))

        return Splits(first(self.train, train), first(self.val, val), first(self.test, test))

    def fingerprint(self) -> str:
        """A SHA-256 of every split's images and labels (hex, 16 digits): the data's identity, whatever its path."""
        digest = hashlib.sha256()
        for part in self:
            for tensor in (part.images, part.labels):
                digest.update(str(tuple(tensor.shape)).encode())
                digest.update(tensor.contiguous().numpy().data)
        return digest.hexdigest()[:16]


def from_uint8(images: np.ndarray, labels: np.ndarray, num_classes: int, name: str) -> ImageDataset:
    """Build an :class:`ImageDataset` from uint8 images (N, C, H, W) in 0..255 and integer labels (N,)."""
    if images.dtype != np.uint8:
        raise TypeError(f"expected uint8 images, got {images.dtype}")
    pixels = torch.from_numpy(np.asarray(images, dtype=np.float32))  # a fresh, writable float32 copy
    pixels.div_(255.0)
    return ImageDataset(pixels, torch.from_numpy(np.array(labels, dtype=np.int64)), num_classes, name)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} tensor of shape {tuple(t.shape)}"
    return type(t).__name__
