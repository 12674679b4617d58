"""The hybrid C-C-C-T conv-transformer of the paper's CIFAR experiments: size, tokens, the dropped MoE residual, small
sizes on tiny inputs, and expert selection across both MoE layers equal to the masked reference."""

from __future__ import annotations

import pytest
import torch

from softmoe import masked_reference_forward, select_experts
from softmoe.models.hybrid import (
    HYBRID_CONFIGS,
    HybridConfig,
    HybridConvTransformer,
    RelativePositionBias,
    astroformer_expert_hidden,
    hybrid,
)
from softmoe.models.vit import count_parameters
from softmoe.selection import random_subsets, top_k_by_combine

# ---------------------------------------------------------------------------------------------------- paper size


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 8, 64, 128])
def test_paper_model_size(n):
    """Appendix E.2 / Table 6: 180M parameters, 150M in the experts of 2 Soft MoE layers (768 * 64 / n hidden)."""
    model = hybrid("astroformer-1", num_experts=n, num_classes=10, device="meta")
    hidden = astroformer_expert_hidden(768, n)
    assert hidden == 768 * 64 // n
    per_layer = n * (768 * hidden + hidden + hidden * 768 + 768)
    assert model.expert_parameter_count() == 2 * per_layer
    assert model.expert_parameter_count() / 1e6 == pytest.approx(151, abs=0.5)
    dense = hybrid("astroformer-1", num_experts=None, device="meta")
    mlp = 768 * 3072 + 3072 + 3072 * 768 + 768
    router = 768 * n + 1
    assert count_parameters(model) == count_parameters(dense) - 2 * mlp + 2 * (per_layer + router)
    assert count_parameters(model) / 1e6 == pytest.approx(180, abs=0.5)


@pytest.mark.slow
def test_paper_model_tokens_and_blocks():
    model = hybrid("astroformer-1", num_experts=16, device="meta")
    assert model.grid == (3, 3) and model.num_tokens == 9
    assert [len(stage) for stage in model.conv_stages] == [2, 6, 14]
    images = torch.empty(2, 3, 96, 96, device="meta")
    assert model.tokens(images).shape == (2, 9, 768)
    logits = model(images)
    assert logits.shape == (2, 10)
    logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    blocks = model.transformer.blocks
    assert len(blocks) == 2 and all(block.is_moe and not block.moe_residual for block in blocks)
    assert all(layer.num_experts == 16 and layer.experts.hidden == 3072 for layer in model.moe_layers())


def test_dropping_the_moe_residual():
    torch.manual_seed(0)
    kwargs = dict(num_experts=4, num_classes=3)
    no_residual = hybrid("tiny", **kwargs).eval()
    torch.manual_seed(0)
    with_residual = hybrid("tiny", moe_residual=True, **kwargs).eval()
    images = torch.rand(2, 3, 32, 32)
    for model in (no_residual, with_residual):
        block = model.transformer.blocks[0]
        x = torch.randn(2, model.num_tokens, model.dim)
        block.mlp.forward = lambda t, mask=None: torch.zeros_like(t)
        out = block(x)
        del block.mlp.forward
        if model is no_residual:
            assert torch.equal(out, torch.zeros_like(out))  # the block's output is the MoE output alone
        else:
            assert not torch.equal(out, torch.zeros_like(out))
        assert model(images).shape == (2, 3)


def test_dense_hybrid_has_no_moe_layer():
    model = hybrid("tiny", num_experts=None)
    assert model.moe_layers() == [] and model.expert_parameter_count() == 0
    with pytest.raises(ValueError, match="no SoftMoE layer"):
        with select_experts(model, k=1):
            pass


# ------------------------------------------------------------------------------------------------- small sizes


@pytest.mark.parametrize("name", ["small", "tiny"])
@pytest.mark.parametrize("channels, image", [(3, 32), (1, 28)])
def test_small_sizes_forward_backward(name, channels, image):
    torch.manual_seed(0)
    model = hybrid(name, num_experts=8, in_channels=channels, image_size=image, num_classes=7)
    assert model.grid == (4, 4)
    logits = model(torch.rand(2, channels, image, image))
    assert logits.shape == (2, 7)
    model.head.weight.data.normal_()
    model(torch.rand(2, channels, image, image)).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_bad_configs():
    with pytest.raises(ValueError, match="unknown hybrid size"):
        hybrid("astroformer-9")
    with pytest.raises(ValueError, match="one entry per conv stage"):
        HybridConvTransformer(HybridConfig(conv_widths=(8,), conv_depths=(1, 1)), device="meta")
    with pytest.raises(ValueError, match="multiple of head_dim"):
        HybridConvTransformer(HybridConfig(dim=100), device="meta")
    with pytest.raises(ValueError, match="images must have shape"):
        hybrid("tiny")(torch.rand(1, 3, 28, 28))


def test_relative_position_bias_depends_only_on_the_offset():
    bias_module = RelativePositionBias((3, 4), heads=2)
    with torch.no_grad():
        bias_module.table.normal_()
    bias = bias_module()
    assert bias.shape == (2, 12, 12)
    position = [(r, c) for r in range(3) for c in range(4)]
    for i, (ri, ci) in enumerate(position):
        for j, (rj, cj) in enumerate(position):
            for u, (ru, cu) in enumerate(position):
                for v, (rv, cv) in enumerate(position):
                    if (ri - rj, ci - cj) == (ru - rv, cu - cv):
                        assert torch.equal(bias[:, i, j], bias[:, u, v])
    assert len({tuple(bias[:, i, j].tolist()) for i in range(12) for j in range(12)}) == 5 * 7


# --------------------------------------------------------------------------------------- selection, both layers


@pytest.mark.parametrize("strategy", ["combine", "random"])
def test_selection_across_both_layers_equals_masked_reference(strategy):
    torch.manual_seed(0)
    model = hybrid("tiny", num_experts=8, num_classes=4, dtype=torch.float64).eval()
    with torch.no_grad():
        model.head.weight.normal_()
        for layer in model.moe_layers():
            layer.scale.fill_(4.0)
    images = torch.rand(4, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    k = 2
    generator = torch.Generator().manual_seed(5)

    def reference(layer):
        def forward(x, mask=None):
            if strategy == "combine":
                selected = top_k_by_combine(layer.route(x).combine, k)
            else:
                selected = random_subsets(x.shape[0], layer.num_experts, k, generator)
            return masked_reference_forward(layer, x, selected)

        return forward

    with torch.no_grad():
        with select_experts(model, k=k, strategy=strategy, seed=5) as layers:
            assert len(layers) == 2
            fast = model(images)
        for layer in model.moe_layers():
            layer.forward = reference(layer)
        slow = model(images)
        for layer in model.moe_layers():
            del layer.forward
        full = model(images)
    torch.testing.assert_close(fast, slow, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(fast, full)


def test_configs_are_consistent():
    for name, config in HYBRID_CONFIGS.items():
        assert len(config.downsample_stages) == len(config.conv_widths) + 1, name
