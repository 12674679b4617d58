"""Specialization made visible: class x expert shares, top images per expert, ViT dispatch maps (known answers on
constructed inputs), and the figures render."""

from __future__ import annotations

import pytest
import torch

from softmoe.data import ImageDataset
from softmoe.models.vit import ViT
from softmoe_repro.specialization import (
    class_expert_shares,
    decode_images,
    dispatch_maps,
    plot_class_experts,
    plot_dispatch,
    plot_top_images,
    routing_of,
    top_images,
)


def test_class_expert_shares_average_per_class():
    shares = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0], [0.25, 0.75]])
    labels = torch.tensor([0, 0, 1, 1])
    assert class_expert_shares(shares, labels, 3) == [[0.75, 0.25], [0.125, 0.875], [0.0, 0.0]]


def test_top_images_are_the_inputs_with_the_largest_share():
    shares = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4], [0.3, 0.7]])
    images = torch.linspace(0, 1, 4).view(4, 1, 1, 1).expand(4, 1, 2, 2).contiguous()
    data = ImageDataset(images, torch.tensor([3, 1, 2, 0]), 4, "four")
    top = top_images(shares, data, experts=2, per_expert=2)
    assert [entry["expert"] for entry in top] == [0, 1]  # mean shares 0.5 and 0.5: ties to the lower index
    assert top[0]["labels"] == [3, 2] and top[1]["labels"] == [1, 0]
    assert top[0]["shares"] == pytest.approx([0.9, 0.6])
    assert top[0]["images"] == {"shape": [2, 2], "hex": ["00000000", "aaaaaaaa"]}
    assert decode_images(top[1]["images"])[0].tolist() == [[85, 85], [85, 85]]


def small_vit():
    torch.manual_seed(0)
    return ViT(image_size=8, patch_size=2, in_channels=1, num_classes=3, dim=8, depth=1, heads=2, mlp_dim=8,
               classifier="gap", moe_blocks=(0,), num_experts=4, expert_hidden=4).eval()


def test_dispatch_maps_are_the_layers_dispatch_over_the_patch_grid():
    model = small_vit()
    data = ImageDataset(torch.rand(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1]), 3, "rand")
    maps = dispatch_maps(model, data, model.grid, images=2, slots=3)
    assert maps["experts"] == [0, 2, 3] and maps["labels"] == [0, 1]
    pixels = decode_images(maps["images"])
    assert len(pixels) == 2 and pixels[0].shape == (8, 8)
    assert pixels[1].tolist() == (data.images[1, 0] * 255).round().to(torch.uint8).tolist()
    layer = model.moe_layers()[0]
    dispatch = routing_of(model, layer, data.images[:2]).dispatch
    for b in range(2):
        for c, j in enumerate(maps["experts"]):
            weights = torch.tensor(maps["maps"][b][c])
            assert weights.shape == (4, 4)
            torch.testing.assert_close(weights.reshape(-1), dispatch[b, :, j, 0])
            assert float(weights.sum()) == pytest.approx(1.0)  # a slot's dispatch is a softmax over the tokens


def test_figures_render(tmp_path):
    pytest.importorskip("matplotlib")
    shares = torch.softmax(torch.randn(12, 4), dim=1)
    data = ImageDataset(torch.rand(12, 1, 8, 8), torch.arange(12) % 3, 3, "rand")
    paths = [
        plot_class_experts({"n = 4": class_expert_shares(shares, data.labels, 3)}, tmp_path / "a.png"),
        plot_top_images(top_images(shares, data, 2, 3), tmp_path / "b.png", "top"),
        plot_dispatch(dispatch_maps(small_vit(), data, (4, 4)), tmp_path / "c.png", "maps"),
    ]
    for path in paths:
        assert (tmp_path / path.split("/")[-1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
