"""Auxiliary losses for Softmax Token Choice (Appendix A of the router study; V-MoE).

Both are the squared coefficient of variation (population std / mean, squared) over experts, computed for each
routing group and averaged over the groups:

- importance: of each expert's summed *clean* softmax gate, ``sum_t softmax(x_t W)[r]``;
- load: of each expert's expected share of tokens under re-sampled noise,
  ``mean_t P(clean_logit[t, r] + noise > kth_largest(noisy_logits[t]))
  = mean_t Phi((clean_logit[t, r] - kth_largest(noisy_logits[t])) / noise_std)``, Phi the standard normal CDF.
"""

from __future__ import annotations

import torch

from softmoe.topk import top_k


def squared_cv(values: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """(std / mean)^2 along ``dim`` with the population std (ddof 0)."""
    mean = values.mean(dim=dim)
    var = values.var(dim=dim, correction=0)
    return var / mean.square().clamp_min(torch.finfo(values.dtype).tiny)


def importance_loss(gates: torch.Tensor) -> torch.Tensor:
    """gates (G, T, E) clean softmax probabilities -> scalar: mean over groups of CV(sum_t gates[:, t, :])^2."""
    return squared_cv(gates.sum(dim=1), dim=-1).mean()


def load_loss(clean_logits: torch.Tensor, noisy_logits: torch.Tensor, k: int, noise_std: float) -> torch.Tensor:
    """Clean and noisy logits (G, T, E), k selected experts, the noise's std (> 0) -> scalar load loss."""
    if noise_std <= 0:
        raise ValueError(f"the load loss needs noise_std > 0, got {noise_std}")
    threshold = top_k(noisy_logits, k)[0][..., -1:]  # the k-th largest noisy logit of each token
    prob = torch.special.ndtr((clean_logits - threshold) / noise_std)
    return squared_cv(prob.mean(dim=1), dim=-1).mean()
