"""Vision Transformer (ViT) and its Soft MoE variant (Puigcerver et al.; section 4.4 of "Beyond Parameter Count").

images (batch, channels, height, width)
  -> patch embedding (a conv with kernel = stride = patch size)          (batch, patches, dim)
  -> [class token] + learned position embeddings
  -> depth pre-norm blocks:  x = x + Attn(LN(x));  x = x + MLP(LN(x))   (MLP -> SoftMoE in the chosen blocks)
  -> final LayerNorm -> class token or global average pooling (GAP) -> linear head

Every LayerNorm has eps 1e-6; attention is ``F.scaled_dot_product_attention``. Named sizes (width, depth, MLP size,
heads) are those of the ViT papers; a name is ``"<size>/<patch>"`` such as ``"B/16"`` or ``"S/4"``:

    Ti: 192, 12, 768, 3     S: 384, 12, 1536, 6     B: 768, 12, 3072, 12
    L: 1024, 24, 4096, 16   H: 1280, 32, 5120, 16

The Soft MoE ViT of the authors (:func:`soft_moe_vit`): Soft MoE layers replace the MLPs of the second half of the
blocks (S and B: last 6 of 12; L: last 12 of 24; H: last 16 of 32), one slot per expert, expert hidden size = the
ViT's MLP size, GELU (tanh approximation) in the experts, L2-normalized routing, GAP classifier.

Every module takes ``device`` and ``dtype``; with ``device="meta"`` paper-scale models (billions of parameters)
build instantly without memory, so parameter counts and shapes can be checked anywhere.

Expert selection (Algorithm 1, random subsets) applies to every SoftMoE layer of a model at once with
:func:`softmoe.select_experts`; each layer picks its own k experts per input and skips the others.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from softmoe.experts import FactoryKwargs, activation_fn
from softmoe.initializers import truncated_lecun_normal_
from softmoe.layer import SoftMoE

LN_EPS = 1e-6
CLASSIFIERS = ("token", "gap")


class ViTSize(NamedTuple):
    """Width (token dim), number of blocks, MLP hidden size and attention heads of a named ViT."""

    dim: int
    depth: int
    mlp_dim: int
    heads: int


VIT_SIZES: dict[str, ViTSize] = {
    "Ti": ViTSize(192, 12, 768, 3),
    "S": ViTSize(384, 12, 1536, 6),
    "B": ViTSize(768, 12, 3072, 12),
    "L": ViTSize(1024, 24, 4096, 16),
    "H": ViTSize(1280, 32, 5120, 16),
}

_NAME = re.compile(r"^\s*(Ti|S|B|L|H)\s*/\s*(\d+)\s*$", re.IGNORECASE)


def parse_vit_name(name: str) -> tuple[ViTSize, int]:
    """``"B/16"`` -> (the B size, patch 16). Sizes are case-insensitive ("ti/16", "TI/16", "Ti/16")."""
    match = _NAME.match(name) if isinstance(name, str) else None
    if match is None or int(match.group(2)) < 1:
        raise ValueError(f"a ViT name is '<size>/<patch>' with size in {sorted(VIT_SIZES)}, e.g. 'B/16'; got {name!r}")
    size = next(key for key in VIT_SIZES if key.lower() == match.group(1).lower())
    return VIT_SIZES[size], int(match.group(2))


def second_half(depth: int) -> tuple[int, ...]:
    """The authors' MoE placement: the last ``depth // 2`` blocks (0-based indices)."""
    return tuple(range(depth - depth // 2, depth))


def _pair(value: int | tuple[int, int]) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    height, width = value
    return (int(height), int(width))


class MLP(nn.Module):
    """The dense ViT MLP: Linear(dim, hidden) -> activation -> Linear(hidden, dim)."""

    def __init__(
        self, dim: int, hidden: int, activation: str = "gelu_tanh", dropout: float = 0.0, device=None, dtype=None
    ) -> None:
        super().__init__()
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.fc1 = nn.Linear(dim, hidden, **factory)
        self.fc2 = nn.Linear(hidden, dim, **factory)
        self.act = activation_fn(activation)
        self.activation = activation
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(self.dropout(self.act(self.fc1(x)))))


class Attention(nn.Module):
    """Multi-head self-attention on (batch, tokens, dim) with ``F.scaled_dot_product_attention``.

    ``bias``, if given to :meth:`forward`, is an additive attention bias broadcastable to (batch, heads, tokens,
    tokens) (the hybrid model's relative position bias).
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, device=None, dtype=None) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be divisible by heads {heads}")
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, **factory)
        self.proj = nn.Linear(dim, dim, **factory)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if bias is not None:
            bias = bias.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.dropout(self.proj(out.transpose(1, 2).reshape(batch, tokens, dim)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + Attn(LN(x))`` then ``x + F(LN(x))`` with F an MLP or a SoftMoE layer.

    With ``moe_residual=False`` (only meaningful for a SoftMoE block) the second step is ``F(LN(x))``, without the
    residual around the MoE: the variant the paper used for its CIFAR hybrid (Appendix E.2).
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp: nn.Module,
        dropout: float = 0.0,
        moe_residual: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS, **factory)
        self.attn = Attention(dim, heads, dropout, **factory)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS, **factory)
        self.mlp = mlp
        self.moe_residual = moe_residual
        self.dropout = nn.Dropout(dropout) if isinstance(mlp, SoftMoE) else nn.Identity()

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, SoftMoE)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bias)
        update = self.dropout(self.mlp(self.norm2(x)))
        return x + update if self.moe_residual else update


def init_transformer_weights(module: nn.Module) -> None:
    """The big_vision ViT initialization for one module: Xavier-uniform linear weights, zero biases (MLP biases
    normal with std 1e-6), unit LayerNorms. Meta tensors are left alone."""
    if isinstance(module, nn.Linear) and not module.weight.is_meta:
        nn.init.xavier_uniform_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, MLP) and not module.fc1.weight.is_meta:
        nn.init.normal_(module.fc1.bias, std=1e-6)
        nn.init.normal_(module.fc2.bias, std=1e-6)
    elif isinstance(module, nn.LayerNorm) and module.weight is not None and not module.weight.is_meta:
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


class ViT(nn.Module):
    """Vision Transformer, dense or Soft MoE: images (batch, C, H, W) -> logits (batch, num_classes).

    Args:
        image_size: H and W (an int or a pair); each must be divisible by ``patch_size``.
        patch_size: side of the square patches (an int or a pair).
        in_channels, num_classes: input channels and classes (``num_classes=0`` gives the pooled features).
        dim, depth, heads, mlp_dim: width, blocks, attention heads and MLP hidden size.
        classifier: ``"token"`` (a learned class token, read out after the final LayerNorm) or ``"gap"`` (mean of
            the final tokens).
        moe_blocks: 0-based indices of the blocks whose MLP is a SoftMoE layer (``()``: a dense ViT).
        num_experts, slots_per_expert, expert_hidden: the SoftMoE layers' n, p and expert hidden size
            (default ``mlp_dim``).
        moe_activation, moe_normalize, identical_expert_init: passed to every SoftMoE layer.
        moe_residual: keep the residual around the SoftMoE layers (default); see :class:`Block`.
        mlp_activation: activation of the dense MLPs (``"gelu_tanh"``, like the authors' JAX code, or ``"gelu"``).
        dropout: dropout after attention, MLP and MoE outputs (default 0).
    """

    def __init__(
        self,
        *,
        image_size: int | tuple[int, int] = 224,
        patch_size: int | tuple[int, int] = 16,
        in_channels: int = 3,
        num_classes: int = 1000,
        dim: int = 768,
        depth: int = 12,
        heads: int = 12,
        mlp_dim: int = 3072,
        classifier: str = "token",
        moe_blocks: tuple[int, ...] | list[int] = (),
        num_experts: int = 128,
        slots_per_expert: int = 1,
        expert_hidden: int | None = None,
        moe_activation: str = "gelu_tanh",
        moe_normalize: bool = True,
        moe_residual: bool = True,
        identical_expert_init: bool = False,
        mlp_activation: str = "gelu_tanh",
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        image_hw, patch_hw = _pair(image_size), _pair(patch_size)
        if min(patch_hw) < 1 or image_hw[0] % patch_hw[0] or image_hw[1] % patch_hw[1]:
            raise ValueError(f"patch size {patch_hw} must divide the image size {image_hw}")
        if classifier not in CLASSIFIERS:
            raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {classifier!r}")
        for name, value in (("dim", dim), ("depth", depth), ("heads", heads), ("mlp_dim", mlp_dim)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        moe_blocks = tuple(sorted({int(i) for i in moe_blocks}))
        if any(not 0 <= i < depth for i in moe_blocks):
            raise ValueError(f"moe_blocks must be block indices in [0, {depth}), got {moe_blocks}")
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.image_size, self.patch_size = image_hw, patch_hw
        self.grid = (image_hw[0] // patch_hw[0], image_hw[1] // patch_hw[1])
        self.num_patches = self.grid[0] * self.grid[1]
        self.dim, self.depth, self.classifier = dim, depth, classifier
        self.moe_blocks = moe_blocks

        self.patch_embed = nn.Conv2d(in_channels, dim, kernel_size=patch_hw, stride=patch_hw, **factory)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim, **factory)) if classifier == "token" else None
        self.num_tokens = self.num_patches + (1 if classifier == "token" else 0)
        self.pos_embed = nn.Parameter(torch.empty(1, self.num_tokens, dim, **factory))
        self.dropout = nn.Dropout(dropout)
        blocks = []
        for i in range(depth):
            if i in moe_blocks:
                mlp: nn.Module = SoftMoE(
                    dim,
                    num_experts,
                    slots_per_expert,
                    expert_hidden=mlp_dim if expert_hidden is None else expert_hidden,
                    activation=moe_activation,
                    normalize=moe_normalize,
                    identical_expert_init=identical_expert_init,
                    **factory,
                )
            else:
                mlp = MLP(dim, mlp_dim, mlp_activation, dropout, **factory)
            blocks.append(Block(dim, heads, mlp, dropout, moe_residual if i in moe_blocks else True, **factory))
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim, eps=LN_EPS, **factory)
        self.head = nn.Linear(dim, num_classes, **factory) if num_classes > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Patch embedding LeCun-normal, position embeddings normal(0.02), class token and head zero, blocks as
        :func:`init_transformer_weights`; SoftMoE layers keep their own initialization."""
        if self.pos_embed.is_meta:
            return
        # SoftMoE layers hold no nn.Linear, MLP or LayerNorm: they keep their own initialization.
        self.blocks.apply(init_transformer_weights)
        weight = self.patch_embed.weight
        fan_in = weight.shape[1] * weight.shape[2] * weight.shape[3]
        truncated_lecun_normal_(weight, fan_in)
        assert self.patch_embed.bias is not None  # the patch embedding is built with a bias (Conv2d's default)
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)
        init_transformer_weights(self.norm)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def moe_layers(self) -> list[SoftMoE]:
        """The SoftMoE layers, in block order."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, SoftMoE)]

    def expert_parameter_count(self) -> int:
        """Parameters inside the experts of every SoftMoE layer (not the routers' phi and scale)."""
        return sum(p.numel() for layer in self.moe_layers() for p in layer.experts.parameters())

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """Patch tokens plus class token and position embeddings: (batch, num_tokens, dim)."""
        if images.dim() != 4 or tuple(images.shape[2:]) != self.image_size:
            raise ValueError(
                f"images must have shape (batch, channels, {self.image_size[0]}, {self.image_size[1]}), "
                f"got {tuple(images.shape)}"
            )
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        return self.dropout(x + self.pos_embed.to(x.dtype))

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The pooled representation (batch, dim) fed to the head."""
        x = self.tokens(images)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x[:, 0] if self.classifier == "token" else x.mean(dim=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def vit(
    name: str = "B/16",
    *,
    image_size: int | tuple[int, int] = 224,
    num_classes: int = 1000,
    classifier: str = "token",
    **kwargs,
) -> ViT:
    """A dense ViT by name, e.g. ``vit("B/16")`` (86,567,656 parameters with the class token, 224 px, 1000
    classes). Further keyword arguments go to :class:`ViT` (``in_channels``, ``device="meta"``, ...)."""
    size, patch = parse_vit_name(name)
    return ViT(
        image_size=image_size,
        patch_size=patch,
        num_classes=num_classes,
        dim=size.dim,
        depth=size.depth,
        heads=size.heads,
        mlp_dim=size.mlp_dim,
        classifier=classifier,
        **kwargs,
    )


def soft_moe_vit(
    name: str = "B/16",
    *,
    num_experts: int = 128,
    slots_per_expert: int = 1,
    expert_hidden: int | None = None,
    moe_blocks: tuple[int, ...] | list[int] | None = None,
    image_size: int | tuple[int, int] = 224,
    num_classes: int = 1000,
    classifier: str = "gap",
    **kwargs,
) -> ViT:
    """The authors' Soft MoE ViT by name: SoftMoE layers in the second half of the blocks (``moe_blocks`` to
    choose others), one slot per expert, expert hidden = the ViT's MLP size, GELU tanh experts, GAP classifier.

    ``soft_moe_vit("B/16", num_experts=n, expert_hidden=768 * 64 // n)`` is the paper's ImageNet model
    (about 513M parameters, 454M of them in experts).
    """
    depth = parse_vit_name(name)[0].depth
    return vit(
        name,
        image_size=image_size,
        num_classes=num_classes,
        classifier=classifier,
        moe_blocks=second_half(depth) if moe_blocks is None else moe_blocks,
        num_experts=num_experts,
        slots_per_expert=slots_per_expert,
        expert_hidden=expert_hidden,
        **kwargs,
    )


def count_parameters(model: nn.Module) -> int:
    """Total number of parameter elements (works on the meta device)."""
    return sum(p.numel() for p in model.parameters())
