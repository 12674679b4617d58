"""softmoe: Soft Mixture of Experts for PyTorch, and the science of "Beyond Parameter Count"."""

from softmoe.backends import BACKENDS, BackendChoice
from softmoe.experts import Experts, MLPExperts, StackedExperts
from softmoe.layer import Routing, SoftMoE, soft_moe_reference
from softmoe.selection import masked_reference_forward, select_experts

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "Experts",
    "MLPExperts",
    "Routing",
    "SoftMoE",
    "StackedExperts",
    "masked_reference_forward",
    "select_experts",
    "soft_moe_reference",
]
__version__ = "0.1.0"
