"""Models built from SoftMoE layers."""

from softmoe.models.mnist import SoftMoEClassifier
from softmoe.models.patches import patchify

__all__ = ["SoftMoEClassifier", "patchify"]
