"""The ViT and Soft MoE ViT: parameter counts (exact, on the meta device), MoE placement, shapes of every named size,
and expert selection across every MoE layer equal to the paper's masked computation, with the compute really skipped.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from softmoe import SoftMoE, masked_reference_forward, select_experts
from softmoe.models.vit import (
    LN_EPS,
    VIT_SIZES,
    ViT,
    count_parameters,
    parse_vit_name,
    second_half,
    soft_moe_vit,
    vit,
)
from softmoe.selection import random_subsets, soft_moe_layers, top_k_by_combine

# --------------------------------------------------------------------------------------------- parameter counts


def mlp_params(d: int, h: int) -> int:
    return d * h + h + h * d + d


def dense_vit_params(size, patch: int, image: int = 224, classes: int = 1000, channels: int = 3, token: bool = True):
    """The ViT parameter count by formula."""
    d, depth, h = size.dim, size.depth, size.mlp_dim
    tokens = (image // patch) ** 2 + (1 if token else 0)
    embed = channels * patch * patch * d + d
    block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + mlp_params(d, h)
    return embed + (d if token else 0) + tokens * d + depth * block + 2 * d + d * classes + classes


def soft_moe_layer_params(d: int, n: int, p: int, h: int) -> int:
    """phi (d, n, p) + scale + n experts."""
    return d * n * p + 1 + n * mlp_params(d, h)


def test_dense_vit_b16_has_86_567_656_parameters():
    model = vit("B/16", image_size=224, num_classes=1000, classifier="token", device="meta")
    assert count_parameters(model) == 86_567_656
    assert model.num_tokens == 197 and model.pos_embed.shape == (1, 197, 768)


@pytest.mark.parametrize("size", list(VIT_SIZES))
@pytest.mark.parametrize("token", [True, False], ids=["token", "gap"])
def test_dense_counts_by_formula(size, token):
    model = vit(f"{size}/16", classifier="token" if token else "gap", device="meta")
    assert count_parameters(model) == dense_vit_params(VIT_SIZES[size], 16, token=token)
    assert model.expert_parameter_count() == 0 and model.moe_layers() == []


@pytest.mark.parametrize(
    "name, n, p, hidden", [("S/16", 128, 1, None), ("B/16", 8, 2, 100), ("L/16", 128, 1, None), ("H/14", 64, 1, None)]
)
def test_soft_moe_counts_by_formula(name, n, p, hidden):
    size, patch = parse_vit_name(name)
    model = soft_moe_vit(name, num_experts=n, slots_per_expert=p, expert_hidden=hidden, device="meta")
    h = size.mlp_dim if hidden is None else hidden
    moe = size.depth // 2
    dense = dense_vit_params(size, patch, token=False)
    expected = dense - moe * mlp_params(size.dim, size.mlp_dim) + moe * soft_moe_layer_params(size.dim, n, p, h)
    assert count_parameters(model) == expected
    assert model.expert_parameter_count() == moe * n * mlp_params(size.dim, h)


def test_published_soft_moe_sizes():
    """The Soft MoE paper's totals: B/16 with 128 experts 3.7B, L/16 13.1B, H/14 27.3B parameters."""
    billions = {
        name: count_parameters(soft_moe_vit(name, num_experts=128, device="meta")) / 1e9
        for name in ("B/16", "L/16", "H/14")
    }
    assert billions["B/16"] == pytest.approx(3.7, abs=0.05)
    assert billions["L/16"] == pytest.approx(13.1, abs=0.05)
    assert billions["H/14"] == pytest.approx(27.3, abs=0.05)


@pytest.mark.parametrize("n", [2, 8, 128])
def test_paper_imagenet_model(n):
    """Beyond Parameter Count, E.2: ViT-B/16 with experts of hidden 768 * 64 / n in the last 6 blocks: 454M expert
    parameters, about 513M in all (ours: 512M, the difference being head/token details of the port they used)."""
    model = soft_moe_vit("B/16", num_experts=n, expert_hidden=768 * 64 // n, device="meta")
    assert model.expert_parameter_count() == 6 * n * mlp_params(768, 768 * 64 // n)
    assert model.expert_parameter_count() / 1e6 == pytest.approx(453.5, abs=0.5)
    assert count_parameters(model) / 1e6 == pytest.approx(512, abs=1.5)


# ------------------------------------------------------------------------------------------------ architecture


@pytest.mark.parametrize("size, first", [("Ti", 6), ("S", 6), ("B", 6), ("L", 12), ("H", 16)])
def test_moe_in_the_second_half_by_default(size, first):
    model = soft_moe_vit(f"{size}/16", num_experts=4, device="meta")
    depth = VIT_SIZES[size].depth
    assert model.moe_blocks == tuple(range(first, depth)) == second_half(depth)
    assert [block.is_moe for block in model.blocks] == [i >= first for i in range(depth)]
    assert len(soft_moe_layers(model)) == depth - first
    for layer in model.moe_layers():
        assert (layer.num_experts, layer.slots_per_expert, layer.normalize) == (4, 1, "router")
        assert layer.experts.hidden == VIT_SIZES[size].mlp_dim and layer.experts.activation == "gelu_tanh"
    assert model.classifier == "gap" and model.cls_token is None


def test_chosen_blocks_and_layer_norm_eps():
    model = soft_moe_vit("S/16", num_experts=4, moe_blocks=[1, 3, 11], device="meta")
    assert [i for i, block in enumerate(model.blocks) if block.is_moe] == [1, 3, 11]
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 2 * 12 + 1 and all(m.eps == LN_EPS == 1e-6 for m in norms)
    assert model.blocks[0].mlp.activation == "gelu_tanh"


def test_bad_configurations():
    with pytest.raises(ValueError, match="patch size"):
        vit("B/16", image_size=100)
    with pytest.raises(ValueError, match="classifier"):
        vit("S/16", classifier="cls", device="meta")
    with pytest.raises(ValueError, match="moe_blocks"):
        soft_moe_vit("S/16", moe_blocks=[12], device="meta")
    with pytest.raises(ValueError, match="size>/<patch"):
        parse_vit_name("X/16")
    with pytest.raises(ValueError, match="divisible by heads"):
        ViT(dim=10, heads=3, device="meta")
    model = vit("Ti/16", image_size=32, num_classes=3)
    with pytest.raises(ValueError, match="images must have shape"):
        model(torch.zeros(1, 3, 16, 16))


def test_names_are_case_insensitive():
    assert parse_vit_name("ti/8") == (VIT_SIZES["Ti"], 8)
    assert parse_vit_name(" B / 32 ") == (VIT_SIZES["B"], 32)


# ------------------------------------------------------------------------------------------------------ shapes


@pytest.mark.slow
@pytest.mark.parametrize("size", list(VIT_SIZES))
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_forward_backward_every_size_on_meta(size, moe):
    patch = 14 if size == "H" else 16
    factory = soft_moe_vit if moe else vit
    model = factory(f"{size}/{patch}", num_classes=1000, device="meta", **({"num_experts": 32} if moe else {}))
    images = torch.empty(2, 3, 224, 224, device="meta")
    logits = model(images)
    assert logits.shape == (2, 1000) and logits.is_meta
    logits.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


@pytest.mark.parametrize("classifier", ["token", "gap"])
def test_tiny_real_forward_backward(classifier):
    torch.manual_seed(0)
    model = ViT(
        image_size=(8, 12), patch_size=4, in_channels=2, num_classes=5, dim=16, depth=2, heads=2, mlp_dim=24,
        classifier=classifier, moe_blocks=(1,), num_experts=4, expert_hidden=8,
    )
    images = torch.rand(3, 2, 8, 12)
    logits = model(images)
    assert logits.shape == (3, 5) and model.num_tokens == 6 + (classifier == "token")
    assert torch.equal(logits, torch.zeros_like(logits))  # zero-initialized head
    model.head.weight.data.normal_()
    model(images).square().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.moe_layers()[0].phi.grad.abs().sum() > 0
    assert ViT(image_size=8, patch_size=4, num_classes=0, dim=16, depth=1, heads=2, mlp_dim=8)(
        torch.rand(2, 3, 8, 8)
    ).shape == (2, 16)


# ------------------------------------------------------------------------------------------ selection, all layers


def tiny_moe_vit(n=8, p=1, dtype=torch.float64):
    torch.manual_seed(0)
    model = ViT(
        image_size=8, patch_size=2, in_channels=1, num_classes=4, dim=12, depth=3, heads=2, mlp_dim=16,
        classifier="gap", moe_blocks=(1, 2), num_experts=n, slots_per_expert=p, expert_hidden=6, dtype=dtype,
    ).eval()
    with torch.no_grad():
        model.head.weight.normal_()
        for layer in model.moe_layers():
            layer.scale.fill_(4.0)  # far from uniform routing, so different subsets give different outputs
    return model


@contextmanager
def masked_reference(model: nn.Module, k: int, strategy: str, seed: int = 0):
    """Every SoftMoE layer computes the paper's way: all experts run, the unselected ones' outputs are zeroed."""
    generator = torch.Generator().manual_seed(seed)
    layers = soft_moe_layers(model)

    def reference(layer: SoftMoE):
        def forward(x, mask=None):
            if strategy == "combine":
                selected = top_k_by_combine(layer.route(x, mask).combine, k)
            else:
                selected = random_subsets(x.shape[0], layer.num_experts, k, generator)
            return masked_reference_forward(layer, x, selected, mask)

        return forward

    for layer in layers:
        layer.forward = reference(layer)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


@pytest.mark.parametrize("strategy", ["combine", "random"])
@pytest.mark.parametrize("k, p", [(1, 1), (2, 1), (4, 2)])
def test_selection_across_all_layers_equals_masked_reference(strategy, k, p):
    model = tiny_moe_vit(p=p)
    images = torch.rand(5, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(images)
        with select_experts(model, k=k, strategy=strategy, seed=7) as layers:
            assert len(layers) == 2 and all(layer.selector.k == k for layer in layers)
            fast = model(images)
        with masked_reference(model, k, strategy, seed=7):
            reference = model(images)
    torch.testing.assert_close(fast, reference, atol=1e-10, rtol=1e-10)
    assert not torch.allclose(fast, full)
    assert all(layer.selector is None for layer in model.moe_layers())


class WeightReads(TorchDispatchMode):
    """Records each op the dispatcher sees, while active, that reads one of ``weights`` (or a view of it), by the
    weight's name: (the op, its arguments)."""

    def __init__(self, weights: dict):
        super().__init__()
        self.storages = {weight.untyped_storage().data_ptr(): name for name, weight in weights.items()}
        self.reads = {name: [] for name in weights}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.untyped_storage().data_ptr() in self.storages:
                self.reads[self.storages[arg.untyped_storage().data_ptr()]].append((func.overloadpacket, args))
        return func(*args, **(kwargs or {}))


def test_each_layer_picks_its_own_experts_and_skips_the_others():
    """Each layer's experts run only in its grouped products (softmoe::grouped_mm), on the rows of the experts that
    layer chose for each input; no op reads an expert weight otherwise (as running all experts would)."""
    model = tiny_moe_vit(n=8, p=1)
    images = torch.rand(6, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    chosen, weights = {}, {}
    for index, layer in enumerate(model.moe_layers()):
        named = zip(("w1", "b1", "w2", "b2"), layer.experts.weights())
        weights.update({(index, name): weight for name, weight in named if weight is not None})

        def hook(module, args, output, index=index):
            chosen[index] = top_k_by_combine(module.route(args[0]).combine, 2)

        layer.register_forward_hook(hook)
    with torch.no_grad(), select_experts(model, k=2, plan="selected"), WeightReads(weights) as watched:
        model(images)
    assert all(op is torch.ops.softmoe.grouped_mm for reads in watched.reads.values() for op, _ in reads)
    for index in (0, 1):
        (_, (x, _, ends, _, _)), = watched.reads[index, "w1"]  # the first product: one per layer
        rows = torch.diff(ends.long(), prepend=ends.new_zeros(1).long())  # its rows per expert
        want = torch.bincount(chosen[index].reshape(-1), minlength=8)
        assert torch.equal(rows, want) and int(rows.sum()) == x.shape[0] == 6 * 2
        assert len(watched.reads[index, "w2"]) == 1
    assert not torch.equal(chosen[0], chosen[1])  # the two layers chose independently
