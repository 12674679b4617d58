"""softmoe: Soft Mixture of Experts for PyTorch, and the science of "Beyond Parameter Count"."""

from softmoe.experts import MLPExperts, StackedExperts
from softmoe.layer import Routing, SoftMoE

__all__ = ["MLPExperts", "Routing", "SoftMoE", "StackedExperts"]
__version__ = "0.1.0"
