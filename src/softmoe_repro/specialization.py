"""Specialization made visible: which experts each class uses, which inputs weight an expert most, and where a
ViT's slots look.

- :func:`class_expert_shares`: per class, the mean share of each expert in Algorithm 1's score (the combine weights
  summed over tokens and slots, normalized over experts), for one SoftMoE layer;
- :func:`top_images`: for a few experts, the test images that give them the largest share;
- :func:`dispatch_maps`: for a few images and slots of a ViT's first MoE layer, the dispatch weights over the patches.

Everything is stored in the experiments' JSON (images as hex strings of their 0-255 pixels, :func:`encode_images`),
so ``softmoe report`` can redraw the figures without the data.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from softmoe.data import ImageDataset
from softmoe.layer import Routing, SoftMoE
from softmoe.selection import combine_shares, soft_moe_layers


@torch.no_grad()
def routing_of(model: nn.Module, layer: SoftMoE, images: torch.Tensor) -> Routing:
    """The routing of ``layer`` when ``model`` runs on ``images`` (its input captured by a forward pre-hook)."""
    captured = {}

    def capture(_module, args):
        captured["x"] = args[0]

    handle = layer.register_forward_pre_hook(capture)
    try:
        model.eval()
        model(images)
    finally:
        handle.remove()
    return layer.route(captured["x"])


@torch.no_grad()
def expert_shares(model: nn.Module, data: ImageDataset, batch_size: int = 1024) -> torch.Tensor:
    """Each input's share of the combine mass per expert in the model's first SoftMoE layer -> (inputs, n)."""
    layer = soft_moe_layers(model)[0]
    parts = [combine_shares(routing_of(model, layer, images).combine) for images in data.images.split(batch_size)]
    return torch.cat(parts)


def encode_images(images: torch.Tensor) -> dict:
    """Images (k, C, H, W) in [0, 1] -> {"shape": (H, W) or (H, W, 3), "hex": one string of 0-255 bytes per image}."""
    scaled = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    scaled = scaled[:, 0] if scaled.shape[1] != 3 else scaled.permute(0, 2, 3, 1)
    return {
        "shape": list(scaled.shape[1:]),
        "hex": [bytes(image.contiguous().flatten().tolist()).hex() for image in scaled],
    }


def decode_images(encoded: dict) -> list:
    """The inverse of :func:`encode_images`: a list of uint8 numpy arrays of ``encoded["shape"]``."""
    import numpy as np

    return [np.frombuffer(bytes.fromhex(text), dtype=np.uint8).reshape(encoded["shape"]) for text in encoded["hex"]]


def class_expert_shares(shares: torch.Tensor, labels: torch.Tensor, num_classes: int) -> list[list[float]]:
    """Mean share per (class, expert) -> a num_classes x n list (a class with no example gets zeros)."""
    table = torch.zeros(num_classes, shares.shape[1], dtype=torch.float64)
    table.index_add_(0, labels, shares.double())
    counts = torch.bincount(labels, minlength=num_classes).clamp_min(1).double()
    return (table / counts[:, None]).tolist()


def top_images(shares: torch.Tensor, data: ImageDataset, experts: int = 4, per_expert: int = 8) -> list[dict]:
    """For the ``experts`` experts with the largest mean share, the ``per_expert`` images that weight each most."""
    chosen = shares.mean(dim=0).topk(min(experts, shares.shape[1])).indices.tolist()
    out = []
    for j in chosen:
        order = shares[:, j].topk(min(per_expert, shares.shape[0])).indices
        out.append(
            {
                "expert": j,
                "shares": shares[order, j].tolist(),
                "labels": data.labels[order].tolist(),
                "images": encode_images(data.images[order]),
            }
        )
    return out


@torch.no_grad()
def specialization(model: nn.Module, data: ImageDataset) -> dict:
    """The class x expert shares and the top images of a few experts, for the model's first SoftMoE layer."""
    shares = expert_shares(model, data)
    return {
        "class_expert_shares": class_expert_shares(shares, data.labels, data.num_classes),
        "top_images": top_images(shares, data),
    }


@torch.no_grad()
def dispatch_maps(model: nn.Module, data: ImageDataset, grid: tuple[int, int], images: int = 3, slots: int = 4) -> dict:
    """For the first ``images`` test images and ``slots`` slots spread over the first MoE layer's experts, the
    dispatch weights over the patches (each a ``grid`` map; a class token, if any, is left out)."""
    layer = soft_moe_layers(model)[0]
    batch = data.images[:images]
    dispatch = routing_of(model, layer, batch).dispatch  # (images, tokens, n, p)
    patches = grid[0] * grid[1]
    dispatch = dispatch[:, -patches:]  # the patch tokens (after a class token)
    n = layer.num_experts
    experts = sorted({round(i * (n - 1) / max(1, slots - 1)) for i in range(slots)})
    maps = [[dispatch[b, :, j, 0].reshape(grid).tolist() for j in experts] for b in range(batch.shape[0])]
    return {"experts": experts, "labels": data.labels[:images].tolist(), "images": encode_images(batch), "maps": maps}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_class_experts(
    tables: dict[str, list[list[float]]], path: str | Path, class_names: list[str] | None = None
) -> str:
    """Heatmaps of class x expert shares, one per model (``tables``: label -> table)."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(tables), figsize=(4.5 * len(tables), 3.8), squeeze=False)
    for ax, (label, table) in zip(axes[0], tables.items()):
        image = ax.imshow(table, aspect="auto", cmap="viridis")
        ax.set_title(label)
        ax.set_xlabel("expert")
        ax.set_ylabel("class")
        ax.set_yticks(range(len(table)))
        if class_names:
            ax.set_yticklabels(class_names, fontsize=6)
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle("mean share of each expert in Algorithm 1's score, per class")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_top_images(top: list[dict], path: str | Path, title: str) -> str:
    """One row per expert: the images that weight it most, with their label and share."""
    plt = _plt()
    pictures = [decode_images(entry["images"]) for entry in top]
    columns = max(len(row) for row in pictures)
    fig, axes = plt.subplots(len(top), columns, figsize=(1.3 * columns, 1.5 * len(top)), squeeze=False)
    for row, entry in enumerate(top):
        for col in range(columns):
            ax = axes[row][col]
            ax.axis("off")
            if col < len(pictures[row]):
                ax.imshow(pictures[row][col], cmap="gray", vmin=0, vmax=255)
                ax.set_title(f"{entry['labels'][col]} ({entry['shares'][col]:.2f})", fontsize=6)
        axes[row][0].text(
            -0.15,
            0.5,
            f"expert {entry['expert']}",
            transform=axes[row][0].transAxes,
            ha="right",
            va="center",
            fontsize=7,
        )
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_dispatch(maps: dict, path: str | Path, title: str) -> str:
    """Each image, then one overlay per slot: the slot's dispatch weights over the patches."""
    plt = _plt()
    pictures = decode_images(maps["images"])
    rows, columns = len(pictures), 1 + len(maps["experts"])
    fig, axes = plt.subplots(rows, columns, figsize=(1.7 * columns, 1.8 * rows), squeeze=False)
    for b, picture in enumerate(pictures):
        axes[b][0].imshow(picture, cmap="gray", vmin=0, vmax=255)
        axes[b][0].set_title(f"label {maps['labels'][b]}", fontsize=7)
        height, width = len(picture), len(picture[0])
        for c, (expert, weights) in enumerate(zip(maps["experts"], maps["maps"][b]), start=1):
            axes[b][c].imshow(picture, cmap="gray", vmin=0, vmax=255)
            axes[b][c].imshow(weights, cmap="magma", alpha=0.6, extent=(0, width, height, 0), interpolation="nearest")
            axes[b][c].set_title(f"slot of expert {expert}", fontsize=7)
        for ax in axes[b]:
            ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
