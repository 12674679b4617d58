"""The exhaustive best-subset oracle of "Beyond Parameter Count" section 4.2 (Table 1, Figure 5).

For each labelled input: does SOME subset of k experts predict the label, and which subsets do? Two exact paths:

- ``oracle_from_contributions``: when everything after the Soft MoE layer is linear (the paper's MNIST model), the
  logits of a subset S are ``bias + sum_{j in S} contribution_j``, so every expert's contribution is computed once
  and millions of subsets cost one gather-and-sum each. With the kept combine weights renormalized per token, the
  logits are ``bias + sum_m (sum_{j in S} contribution_mj) / (sum_{j in S} c_mj)`` over the tokens m, still exact.
- ``oracle_by_forward``: any model; it runs the model once per subset (inputs and subsets batched together) with
  the explicit-subset strategy of :func:`softmoe.select_experts`.

Both refuse, naming C(n, k) and the cap, when there are more subsets than ``max_subsets``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from softmoe.selection import select_experts, soft_moe_layers
from softmoe.topk import first_argmax

DEFAULT_MAX_SUBSETS = 1_000_000


def check_subset_count(num_experts: int, k: int, max_subsets: int) -> int:
    """C(n, k), or a ValueError naming it and the cap when it exceeds ``max_subsets``."""
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must lie in [1, {num_experts}], got {k}")
    count = math.comb(num_experts, k)
    if count > max_subsets:
        raise ValueError(
            f"C({num_experts}, {k}) = {count:,} subsets exceeds the cap max_subsets = {max_subsets:,}; "
            "raise the cap to run the exhaustive search anyway"
        )
    return count


def all_subsets(num_experts: int, k: int) -> torch.Tensor:
    """Every k-subset of range(n) in lexicographic order -> (C(n, k), k) int64."""
    return torch.tensor(list(itertools.combinations(range(num_experts), k)), dtype=torch.int64).view(-1, k)


@dataclass
class OracleResult:
    """Outcome of the exhaustive search over the ``subsets`` (S, k) for B inputs.

    solvable: (B,) bool, some subset predicts the label. correct_subsets: (B,) int64, how many do.
    best_subset: (B,) int64 index into ``subsets`` of the subset with the largest margin (true-class logit minus
    the best other logit; ties to the lower index); it predicts the label exactly when ``solvable``.
    reachable: (B, classes) bool, the classes that some subset predicts (the oracle's control: an oracle that can
    reach many classes, wrong ones included, says little about specialization by itself).
    """

    subsets: torch.Tensor
    solvable: torch.Tensor
    correct_subsets: torch.Tensor
    best_subset: torch.Tensor
    reachable: torch.Tensor

    @property
    def accuracy(self) -> float:
        """Best-k-subset accuracy: the fraction of inputs some subset predicts correctly."""
        return float(self.solvable.float().mean())

    @property
    def distinct_best_subsets(self) -> int:
        """How many different subsets are the best subset of a correctly predicted input (Figure 5)."""
        return int(self.best_subset[self.solvable].unique().numel())

    def reaches(self, labels: torch.Tensor) -> float:
        """The fraction of inputs for which some subset predicts ``labels`` (B,), e.g. a deliberately wrong label."""
        return float(self.reachable.gather(1, labels.view(-1, 1)).float().mean())

    @property
    def mean_reachable_classes(self) -> float:
        """The number of classes some subset predicts, averaged over the inputs."""
        return float(self.reachable.sum(dim=1).double().mean())


class _SubsetScan:
    """Accumulates, chunk by chunk of subsets, the per-input statistics of an :class:`OracleResult`."""

    def __init__(self, labels: torch.Tensor, classes: int) -> None:
        self.labels = labels
        self.reachable = torch.zeros(labels.shape[0], classes, dtype=torch.bool, device=labels.device)
        self.correct_subsets = torch.zeros_like(labels)
        self.best_margin = torch.full(labels.shape, -math.inf, dtype=torch.float64, device=labels.device)
        self.best_subset = torch.zeros_like(labels)

    def add(self, logits: torch.Tensor, first_subset: int) -> None:
        """logits (B, S_chunk, classes) of subsets first_subset .. first_subset + S_chunk - 1."""
        true = logits.gather(2, self.labels.view(-1, 1, 1).expand(-1, logits.shape[1], 1)).squeeze(2)
        others = logits.scatter(2, self.labels.view(-1, 1, 1).expand(-1, logits.shape[1], 1), -math.inf)
        margin = (true - others.amax(dim=2)).double()
        predicted = logits.argmax(dim=2)
        self.reachable.scatter_(1, predicted, True)
        self.correct_subsets += (predicted == self.labels.unsqueeze(1)).sum(dim=1)
        chunk_best, where = first_argmax(margin, dim=1)  # ties to the lower subset index on every device
        better = chunk_best > self.best_margin
        self.best_margin = torch.where(better, chunk_best, self.best_margin)
        self.best_subset = torch.where(better, where + first_subset, self.best_subset)

    def result(self, subsets: torch.Tensor) -> OracleResult:
        return OracleResult(subsets, self.correct_subsets > 0, self.correct_subsets, self.best_subset, self.reachable)


def oracle_from_contributions(
    contributions: torch.Tensor,
    bias: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    max_subsets: int = DEFAULT_MAX_SUBSETS,
    chunk_elements: int = 2**24,
    token_mass: torch.Tensor | None = None,
) -> OracleResult:
    """Exact oracle for a model whose logits are linear in the Soft MoE output.

    contributions: (B, n, classes), expert j's share of the logits of each input (computed once); or, to renormalize
    each token's kept combine weights (``select_experts(..., renormalize=True)``), (B, tokens, n, classes) per token
    with ``token_mass`` (B, tokens, n), each token's combine weight on each expert (summed over its slots).
    bias: (classes,), the logits with no expert. labels: (B,) int64.
    Subsets are scanned in chunks of about ``chunk_elements`` logits at a time.
    """
    batch, classes = contributions.shape[0], contributions.shape[-1]
    n = contributions.shape[-2]
    expected = (batch, n, classes) if token_mass is None else (batch, token_mass.shape[1], n, classes)
    if contributions.shape != expected or (token_mass is not None and token_mass.shape != expected[:3]):
        got = (
            tuple(contributions.shape) if token_mass is None else (tuple(contributions.shape), tuple(token_mass.shape))
        )
        raise ValueError(f"contributions must have shape {expected} (and token_mass {expected[:3]}), got {got}")
    if bias.shape != (classes,) or labels.shape != (batch,):
        raise ValueError(
            f"bias must have shape ({classes},) and labels ({batch},), "
            f"got {tuple(bias.shape)} and {tuple(labels.shape)}"
        )
    check_subset_count(n, k, max_subsets)
    subsets = all_subsets(n, k).to(contributions.device)
    scan = _SubsetScan(labels, classes)
    tokens = 1 if token_mass is None else token_mass.shape[1]
    step = max(1, chunk_elements // max(1, batch * classes * k * tokens))
    tiny = torch.finfo(contributions.dtype).tiny
    for start in range(0, subsets.shape[0], step):
        chunk = subsets[start : start + step]
        if token_mass is None:
            logits = contributions[:, chunk, :].sum(dim=2) + bias
        else:  # (B, tokens, S, classes) over each token's kept mass (B, tokens, S), summed over the tokens
            kept = token_mass[:, :, chunk].sum(dim=3).clamp_min(tiny)
            logits = (contributions[:, :, chunk, :].sum(dim=3) / kept.unsqueeze(-1)).sum(dim=1) + bias
        scan.add(logits, start)
    return scan.result(subsets)


@torch.no_grad()
def oracle_by_forward(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    max_subsets: int = DEFAULT_MAX_SUBSETS,
    rows_per_forward: int = 4096,
    renormalize: bool = False,
) -> OracleResult:
    """Exact oracle for any classifier with one SoftMoE layer: the model runs once per (input, subset) pair.

    inputs: (B, ...) model inputs; labels (B,) int64. Pairs are batched ``rows_per_forward`` at a time, each row
    with its own explicit expert subset (``renormalize`` as in :func:`softmoe.select_experts`).
    """
    layers = soft_moe_layers(model)
    if len(layers) != 1:
        raise ValueError(f"oracle_by_forward needs a model with exactly one SoftMoE layer, found {len(layers)}")
    n = layers[0].num_experts
    check_subset_count(n, k, max_subsets)
    subsets = all_subsets(n, k).to(inputs.device)
    batch = inputs.shape[0]
    scan: _SubsetScan | None = None
    per_forward = max(1, rows_per_forward // batch)
    for start in range(0, subsets.shape[0], per_forward):
        chunk = subsets[start : start + per_forward]
        keep = torch.zeros(batch, chunk.shape[0], n, dtype=torch.bool, device=inputs.device)
        keep.scatter_(2, chunk.unsqueeze(0).expand(batch, -1, -1), True)
        repeated = inputs.unsqueeze(1).expand(batch, chunk.shape[0], *inputs.shape[1:]).flatten(0, 1)
        with select_experts(model, strategy=keep.flatten(0, 1), renormalize=renormalize):
            logits = model(repeated)
        scan = scan or _SubsetScan(labels, logits.shape[-1])
        scan.add(logits.view(batch, chunk.shape[0], -1), start)
    assert scan is not None  # C(n, k) >= 1 subsets
    return scan.result(subsets)
