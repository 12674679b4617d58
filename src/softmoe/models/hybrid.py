"""The hybrid conv-transformer of the paper's CIFAR experiments: Astroformer-1 style "C-C-C-T" with Soft MoE.

"Beyond Parameter Count", Appendix E.2: an Astroformer-1 backbone (a CoAtNet-like network) whose three
convolutional stages take a 96x96 image down to a 768 x 3 x 3 map; its 9 positions are the tokens of a transformer
stage of 2 blocks whose MLPs are Soft MoE layers with n experts of hidden size 768 * 64 / n, and **no residual
around the Soft MoE layers** (the paper's fix for a network that otherwise ignored its experts).

Layout (each stage halves the resolution in its first block):

    stem:   conv3x3 stride 2 -> BatchNorm -> GELU -> conv3x3                      (stem_width channels)
    C x 3:  MBConv blocks: pre-BatchNorm, 1x1 expand (x4 of the output width) -> BN, GELU -> depthwise 3x3
            (stride) -> BN, GELU -> squeeze-excitation (1/4 of the output width, SiLU) -> 1x1 project; shortcut
            identity or (2x2 average pool + 1x1 conv)
    T:      2x2 average pool + 1x1 conv to ``dim``, flatten to tokens, pre-norm blocks (LayerNorm eps 1e-6, multi-head
            attention with a learned relative position bias, heads of size ``head_dim``) with an MLP or SoftMoE
    head:   mean over tokens -> LayerNorm -> [Linear to head_hidden -> tanh] -> Linear

Sizes (:data:`HYBRID_CONFIGS`): ``"astroformer-1"`` (96 px, stem 64, stages 96/192/384 with 2/6/14 blocks, T stage
768 wide with 2 blocks, a 768-wide tanh pre-logits layer: the published Astroformer-1 widths and depths) and small
ones for CPU runs. This is our own
reading of the architecture, not a port of the Astroformer code: the transition into the T stage is a separate pool +
projection, and the final norm/pool/head is the plain one above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from softmoe.experts import FactoryKwargs
from softmoe.layer import SoftMoE
from softmoe.models.vit import LN_EPS, MLP, Block, init_transformer_weights


def _downsampled(size: int) -> int:
    """Spatial size after one stride-2 stage (3x3 conv with padding 1, or 2x2 ceil-mode pooling)."""
    return (size + 1) // 2


class SqueezeExcite(nn.Module):
    """Channel attention: x * sigmoid(W2 silu(W1 mean_hw(x)))."""

    def __init__(self, channels: int, reduced: int, device=None, dtype=None) -> None:
        super().__init__()
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.reduce = nn.Conv2d(channels, reduced, 1, **factory)
        self.expand = nn.Conv2d(reduced, channels, 1, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.expand(F.silu(self.reduce(x.mean(dim=(2, 3), keepdim=True))))
        return x * torch.sigmoid(scale)


class Downsample(nn.Module):
    """2x2 average pooling (ceil mode, so odd sizes round up) then an optional 1x1 conv to ``out_channels``."""

    def __init__(self, in_channels: int, out_channels: int, pool: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(2, 2, ceil_mode=True) if pool else nn.Identity()
        self.proj = (
            nn.Conv2d(in_channels, out_channels, 1, device=device, dtype=dtype)
            if in_channels != out_channels
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.pool(x))


class MBConv(nn.Module):
    """Pre-norm inverted-bottleneck block with squeeze-excitation; see the module docstring."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        stride: int = 1,
        expand_ratio: int = 4,
        se_ratio: float = 0.25,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        mid = out_channels * expand_ratio
        if stride == 1 and in_channels == out_channels:
            self.shortcut: nn.Module = nn.Identity()
        else:
            self.shortcut = Downsample(in_channels, out_channels, pool=stride == 2, **factory)
        self.pre_norm = nn.BatchNorm2d(in_channels, **factory)
        self.expand = nn.Conv2d(in_channels, mid, 1, bias=False, **factory)
        self.norm1 = nn.BatchNorm2d(mid, **factory)
        self.depthwise = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid, bias=False, **factory)
        self.norm2 = nn.BatchNorm2d(mid, **factory)
        self.se = SqueezeExcite(mid, max(1, int(out_channels * se_ratio)), **factory)
        self.project = nn.Conv2d(mid, out_channels, 1, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = self.shortcut(x)
        x = F.gelu(self.norm1(self.expand(self.pre_norm(x))))
        x = self.se(F.gelu(self.norm2(self.depthwise(x))))
        return shortcut + self.project(x)


class RelativePositionBias(nn.Module):
    """A learned bias per head for every relative offset on a (height, width) token grid -> (heads, N, N)."""

    def __init__(self, grid: tuple[int, int], heads: int, device=None, dtype=None) -> None:
        super().__init__()
        self.grid = grid
        self.table = nn.Parameter(torch.zeros(heads, (2 * grid[0] - 1) * (2 * grid[1] - 1), device=device, dtype=dtype))

    def forward(self) -> torch.Tensor:
        height, width = self.grid
        device = self.table.device
        rows = torch.arange(height, device=device).repeat_interleave(width)
        cols = torch.arange(width, device=device).repeat(height)
        dr = rows[:, None] - rows[None, :] + height - 1
        dc = cols[:, None] - cols[None, :] + width - 1
        return self.table[:, dr * (2 * width - 1) + dc]


class TransformerStage(nn.Module):
    """Blocks on the tokens of a (height, width) grid, sharing :class:`Block` with the ViT, each with its own
    relative position bias."""

    def __init__(self, blocks: list[Block], grid: tuple[int, int], heads: int, rel_pos: bool, device=None, dtype=None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.biases = nn.ModuleList(
            [RelativePositionBias(grid, heads, device=device, dtype=dtype) for _ in blocks] if rel_pos else []
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, self.biases[i]() if len(self.biases) else None)
        return x


@dataclass(frozen=True)
class HybridConfig:
    """Sizes of a :class:`HybridConvTransformer` (see :data:`HYBRID_CONFIGS`)."""

    image_size: int = 96
    stem_width: int = 64
    conv_widths: tuple[int, ...] = (96, 192, 384)
    conv_depths: tuple[int, ...] = (2, 6, 14)
    dim: int = 768
    depth: int = 2
    head_dim: int = 32
    mlp_ratio: int = 4
    stem_stride: int = 2
    head_hidden: int | None = 768
    """Width of the tanh pre-logits layer of the head (None: a single linear layer)."""
    downsample_stages: tuple[bool, ...] = (True, True, True, True)
    """Whether each conv stage and (last entry) the transition into the T stage halve the resolution."""


HYBRID_CONFIGS: dict[str, HybridConfig] = {
    # The paper's model: 96x96 -> 48 (stem) -> 24 -> 12 -> 6 (C stages) -> 3x3 tokens of width 768.
    "astroformer-1": HybridConfig(),
    # CPU sizes: 32x32 -> 16 (stem) -> 8 -> 4 -> 4 -> 4x4 = 16 tokens (28x28 gives 14 -> 7 -> 4: also 16 tokens).
    "small": HybridConfig(
        image_size=32,
        stem_width=32,
        conv_widths=(48, 64, 96),
        conv_depths=(1, 1, 2),
        dim=128,
        depth=2,
        head_hidden=None,
        downsample_stages=(True, True, False, False),
    ),
    "tiny": HybridConfig(
        image_size=32,
        stem_width=16,
        conv_widths=(16, 24, 32),
        conv_depths=(1, 1, 1),
        dim=64,
        depth=2,
        head_hidden=None,
        downsample_stages=(True, True, False, False),
    ),
}


def astroformer_expert_hidden(dim: int, num_experts: int, multiplier: int = 64) -> int:
    """The paper's expert size for n experts: ``dim * multiplier / n`` hidden units (768 * 64 / n), at least 1."""
    return max(1, dim * multiplier // num_experts)


class HybridConvTransformer(nn.Module):
    """C-C-C-T conv-transformer: images (batch, C, H, W) -> logits (batch, num_classes).

    Args:
        config: the sizes (a :class:`HybridConfig`).
        in_channels, num_classes: input channels and classes.
        num_experts: n for Soft MoE layers in place of every T-stage MLP; ``None`` keeps dense MLPs.
        slots_per_expert, expert_hidden: p and the expert hidden size (default ``dim * 64 // n``, the paper's).
        moe_residual: keep the residual around the Soft MoE layers; the paper dropped it (``False``, the default
            here when ``num_experts`` is set).
        moe_activation, moe_normalize, identical_expert_init: passed to every SoftMoE layer.
        rel_pos: learned relative position bias in attention (default True).
        dropout: dropout in the T stage (default 0).
    """

    def __init__(
        self,
        config: HybridConfig | None = None,
        *,
        in_channels: int = 3,
        num_classes: int = 10,
        num_experts: int | None = None,
        slots_per_expert: int = 1,
        expert_hidden: int | None = None,
        moe_residual: bool = False,
        moe_activation: str = "gelu",
        moe_normalize: bool = True,
        identical_expert_init: bool = False,
        rel_pos: bool = True,
        dropout: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        config = HybridConfig() if config is None else config
        stages_ok = len(config.conv_widths) == len(config.conv_depths) == len(config.downsample_stages) - 1
        if not stages_ok:
            raise ValueError(
                "conv_widths and conv_depths need one entry per conv stage and downsample_stages one more, got "
                f"{config.conv_widths}, {config.conv_depths}, {config.downsample_stages}"
            )
        if config.dim % config.head_dim:
            raise ValueError(f"dim {config.dim} must be a multiple of head_dim {config.head_dim}")
        if config.stem_stride not in (1, 2):
            raise ValueError(f"stem_stride must be 1 or 2, got {config.stem_stride}")
        factory: FactoryKwargs = {"device": device, "dtype": dtype}
        self.config = config
        self.image_size = config.image_size
        self.dim = config.dim
        size = config.image_size
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, config.stem_width, 3, stride=config.stem_stride, padding=1, bias=False, **factory),
            nn.BatchNorm2d(config.stem_width, **factory),
            nn.GELU(),
            nn.Conv2d(config.stem_width, config.stem_width, 3, padding=1, **factory),
        )
        if config.stem_stride == 2:
            size = _downsampled(size)
        stages: list[nn.Module] = []
        channels = config.stem_width
        for width, depth, down in zip(config.conv_widths, config.conv_depths, config.downsample_stages):
            mbconvs = [
                MBConv(channels if i == 0 else width, width, 2 if (down and i == 0) else 1, **factory)
                for i in range(depth)
            ]
            stages.append(nn.Sequential(*mbconvs))
            channels = width
            size = _downsampled(size) if down else size
        self.conv_stages = nn.Sequential(*stages)
        self.to_tokens = Downsample(channels, config.dim, pool=config.downsample_stages[-1], **factory)
        size = _downsampled(size) if config.downsample_stages[-1] else size
        self.grid = (size, size)
        self.num_tokens = size * size
        heads = config.dim // config.head_dim
        mlp_dim = config.mlp_ratio * config.dim
        blocks = []
        for _ in range(config.depth):
            if num_experts is None:
                mlp: nn.Module = MLP(config.dim, mlp_dim, "gelu", dropout, **factory)
                residual = True
            else:
                hidden = astroformer_expert_hidden(config.dim, num_experts) if expert_hidden is None else expert_hidden
                mlp = SoftMoE(
                    config.dim,
                    num_experts,
                    slots_per_expert,
                    expert_hidden=hidden,
                    activation=moe_activation,
                    normalize=moe_normalize,
                    identical_expert_init=identical_expert_init,
                    **factory,
                )
                residual = moe_residual
            blocks.append(Block(config.dim, heads, mlp, dropout, residual, **factory))
        self.transformer = TransformerStage(blocks, self.grid, heads, rel_pos, **factory)
        self.norm = nn.LayerNorm(config.dim, eps=LN_EPS, **factory)
        if config.head_hidden:
            self.pre_logits: nn.Module = nn.Sequential(nn.Linear(config.dim, config.head_hidden, **factory), nn.Tanh())
            features = config.head_hidden
        else:
            self.pre_logits = nn.Identity()
            features = config.dim
        self.head = nn.Linear(features, num_classes, **factory) if num_classes > 0 else nn.Identity()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Convs: normal with std sqrt(2 / fan_out) (EfficientNet style), zero biases; transformer as the ViT's;
        zero head. SoftMoE layers keep their own initialization."""
        if self.norm.weight.is_meta:
            return
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                fan_out = module.kernel_size[0] * module.kernel_size[1] * module.out_channels // module.groups
                nn.init.normal_(module.weight, std=math.sqrt(2.0 / fan_out))
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.transformer.blocks.apply(init_transformer_weights)
        self.pre_logits.apply(init_transformer_weights)
        init_transformer_weights(self.norm)
        if isinstance(self.head, nn.Linear):
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)

    def moe_layers(self) -> list[SoftMoE]:
        """The SoftMoE layers, in block order."""
        return [block.mlp for block in self.transformer.blocks if isinstance(block.mlp, SoftMoE)]

    def expert_parameter_count(self) -> int:
        """Parameters inside the experts of every SoftMoE layer (not the routers' phi and scale)."""
        return sum(p.numel() for layer in self.moe_layers() for p in layer.experts.parameters())

    def tokens(self, images: torch.Tensor) -> torch.Tensor:
        """The T stage's input tokens (batch, grid_h * grid_w, dim), row-major."""
        if images.dim() != 4 or tuple(images.shape[2:]) != (self.image_size, self.image_size):
            raise ValueError(
                f"images must have shape (batch, channels, {self.image_size}, {self.image_size}), "
                f"got {tuple(images.shape)}"
            )
        x = self.to_tokens(self.conv_stages(self.stem(images)))
        return x.flatten(2).transpose(1, 2)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """The representation (batch, features) fed to the last linear layer."""
        return self.pre_logits(self.norm(self.transformer(self.tokens(images)).mean(dim=1)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


def hybrid(
    name: str = "astroformer-1",
    *,
    num_experts: int | None = None,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int | None = None,
    **kwargs,
) -> HybridConvTransformer:
    """A hybrid model by size name (:data:`HYBRID_CONFIGS`), e.g. the paper's CIFAR model
    ``hybrid("astroformer-1", num_experts=n, num_classes=10)`` (Soft MoE in both T blocks, expert hidden
    768 * 64 / n, no residual around the MoE). ``image_size`` overrides the size's input resolution; other keyword
    arguments go to :class:`HybridConvTransformer`."""
    if name not in HYBRID_CONFIGS:
        raise ValueError(f"unknown hybrid size {name!r}; choose one of {sorted(HYBRID_CONFIGS)}")
    config = HYBRID_CONFIGS[name]
    if image_size is not None:
        config = replace(config, image_size=image_size)
    return HybridConvTransformer(
        config, in_channels=in_channels, num_classes=num_classes, num_experts=num_experts, **kwargs
    )


def hybrid_config_dict(config: HybridConfig) -> dict:
    """A JSON-serializable view of a config."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config).items()}
