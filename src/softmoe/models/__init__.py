"""Models built from SoftMoE layers: the paper's MNIST classifier, the (Soft MoE) ViT, the hybrid conv-transformer."""

from softmoe.models.hybrid import (
    HYBRID_CONFIGS,
    HybridConfig,
    HybridConvTransformer,
    astroformer_expert_hidden,
    hybrid,
)
from softmoe.models.mnist import SoftMoEClassifier
from softmoe.models.patches import patchify
from softmoe.models.vit import (
    VIT_SIZES,
    ViT,
    ViTSize,
    count_parameters,
    parse_vit_name,
    second_half,
    soft_moe_vit,
    vit,
)

__all__ = [
    "HYBRID_CONFIGS",
    "VIT_SIZES",
    "HybridConfig",
    "HybridConvTransformer",
    "SoftMoEClassifier",
    "ViT",
    "ViTSize",
    "astroformer_expert_hidden",
    "count_parameters",
    "hybrid",
    "parse_vit_name",
    "patchify",
    "second_half",
    "soft_moe_vit",
    "vit",
]
