"""Mini-batches of an :class:`ImageDataset`, in order or shuffled reproducibly (torch only, no DataLoader)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from softmoe.data.dataset import ImageDataset


def num_batches(num_examples: int, batch_size: int, drop_last: bool = False) -> int:
    """How many batches :func:`batches` yields."""
    return num_examples // batch_size if drop_last else -(-num_examples // batch_size)


def batches(
    dataset: ImageDataset,
    batch_size: int,
    shuffle: bool = False,
    generator: torch.Generator | None = None,
    *,
    drop_last: bool = False,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield ``(images, labels)`` batches covering ``dataset`` once (one epoch).

    Without ``shuffle`` the batches are in dataset order (slices: views, no copies). With ``shuffle`` the
    order is ``torch.randperm(len(dataset), generator=generator)``, drawn when this function is called (not
    on the first ``next``), so the same CPU generator state gives the same epoch; with ``generator=None`` the
    global torch RNG is used. The last batch is smaller unless ``drop_last``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    n = len(dataset)
    order = torch.randperm(n, generator=generator) if shuffle else None
    stop = num_batches(n, batch_size, drop_last) * batch_size
    images, labels = dataset.images, dataset.labels

    def epoch() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for start in range(0, stop, batch_size):
            end = min(start + batch_size, n)
            if order is None:
                yield images[start:end], labels[start:end]
            else:
                idx = order[start:end]
                yield images[idx], labels[idx]

    return epoch()
