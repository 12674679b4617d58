"""softmoe: Soft Mixture of Experts for PyTorch, and the science of "Beyond Parameter Count"."""

from softmoe.experts import MLPExperts, StackedExperts
from softmoe.layer import Routing, SoftMoE
from softmoe.selection import masked_reference_forward, select_experts

__all__ = ["MLPExperts", "Routing", "SoftMoE", "StackedExperts", "masked_reference_forward", "select_experts"]
__version__ = "0.1.0"
