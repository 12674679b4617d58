"""Expert budgets calibrated to an accuracy target: the cheapest selection that stays within a tolerated drop.

For a trained model and a validation split, :func:`calibrate` evaluates every setting of one strategy of
:mod:`softmoe.selection` (k = 1..n for Algorithm 1, a grid of mass shares tau for the adaptive "mass" strategy),
measures each setting's accuracy and the fraction of the expert FLOPs it actually runs, and returns the setting
with the least expert compute whose validation accuracy is within ``max_drop`` points of all experts (or at least
an absolute ``target``), with its test accuracy when a test split is given.

    result = calibrate(model, splits.val, max_drop=1.0, strategy="mass", test=splits.test)
    result.chosen.value, result.chosen.expert_fraction, result.test_accuracy

The expert-FLOP fraction counts the (input, expert) pairs each layer runs, weighted by the layer's expert cost
(slots per expert times parameters per expert), over what running every expert of every layer costs.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch import nn

from softmoe.data import ImageDataset
from softmoe.layer import SoftMoE
from softmoe.selection import (
    ADAPTIVE,
    NoBetterThanRandomWarning,
    ShareUniformity,
    measure_share_uniformity,
    select_experts,
    soft_moe_layers,
)
from softmoe.selection_plan import flops_per_row
from softmoe.train import accuracy

CALIBRATED = ("combine", "mass")
RANDOM_SEEDS = 3
"""Seeds of the random subsets that Algorithm 1's chosen k is compared with on the validation split."""
DEFAULT_TAUS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, 1.0)


@dataclass(frozen=True)
class Setting:
    """One evaluated selection: ``strategy`` "all", "combine" (``value`` = k) or "mass" (``value`` = tau), its
    accuracy on the split and the fraction of the expert FLOPs it ran (1.0 for all experts)."""

    strategy: str
    value: int | float | None
    accuracy: float
    expert_fraction: float


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` found: the chosen setting, the all-experts reference, every setting tried (on the
    validation split), the accuracy required, test accuracies when a test split was given, and how uniform each
    layer's combine shares are on the validation split's first batch (:class:`~softmoe.selection.ShareUniformity`,
    for Algorithm 1's chosen k, else k = n/4)."""

    strategy: str
    required_accuracy: float
    reference: Setting
    chosen: Setting
    settings: tuple[Setting, ...]
    test_accuracy: float | None = None
    reference_test_accuracy: float | None = None
    uniformity: tuple[ShareUniformity, ...] = ()
    random_accuracy: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


def _pair_cost(layer: SoftMoE) -> float:
    """The FLOPs of one (input, expert) pair of ``layer``: its slots through one expert."""
    return layer.slots_per_expert * flops_per_row(layer.experts)


class _CountingSelector:
    """Wraps a layer's selector and adds up the (input, expert) pairs it keeps and could have kept, as tensors
    (no host read per batch)."""

    def __init__(self, selector) -> None:
        self.inner, self.renormalize, self.plan = selector, selector.renormalize, selector.plan
        self.top_k = None  # every call goes through select, which counts
        self.kept = self.possible = 0

    def select(self, combine: torch.Tensor) -> torch.Tensor:
        selected = self.inner.select(combine)
        self.kept = self.kept + (selected >= 0).sum()
        self.possible += combine.shape[0] * combine.shape[2]
        return selected


@contextmanager
def counted_selection(model: nn.Module, **selection) -> Iterator[list[_CountingSelector]]:
    """``select_experts(model, **selection)`` whose layers count the pairs they run (one counter per layer)."""
    with select_experts(model, **selection) as layers:
        counters = [_CountingSelector(layer.selector) for layer in layers]
        for layer, counter in zip(layers, counters):
            layer.selector = counter
        yield counters


def evaluate_setting(
    model: nn.Module,
    data: ImageDataset,
    strategy: str,
    value: int | float | None = None,
    batch_size: int = 1024,
    k_min: int = 1,
    k_max: int | None = None,
    renormalize: bool = False,
) -> Setting:
    """Accuracy of ``model`` on ``data`` under one selection ("all", or a strategy of :mod:`softmoe.selection` with
    ``value`` its k or tau), and the fraction of the expert FLOPs it ran."""
    if strategy == "all":
        return Setting("all", None, accuracy(model, data, batch_size), 1.0)
    selection = {"tau": value} if strategy == "mass" else {"k": value}
    if strategy in ADAPTIVE:
        selection.update(k_min=k_min, k_max=k_max)
    layers = soft_moe_layers(model)
    with counted_selection(model, strategy=strategy, renormalize=renormalize, **selection) as counters:
        correct = accuracy(model, data, batch_size)
    costs = [_pair_cost(layer) for layer in layers]
    ran = sum(float(c.kept) * cost for c, cost in zip(counters, costs))
    total = sum(c.possible * cost for c, cost in zip(counters, costs))
    return Setting(strategy, value, correct, ran / total if total else 1.0)


def _grid(model: nn.Module, strategy: str, grid: Sequence[int | float] | None) -> list[int | float]:
    if grid is not None:
        if not grid:
            raise ValueError("the calibration grid is empty")
        return list(grid)
    if strategy == "mass":
        return list(DEFAULT_TAUS)
    sizes = sorted({layer.num_experts for layer in soft_moe_layers(model)})
    if len(sizes) != 1:
        raise ValueError(
            f"the model's SoftMoE layers have different numbers of experts {sizes}: pass grid= (k values "
            "as fractions of n, e.g. [0.125, 0.25, 0.5])"
        )
    return list(range(1, sizes[0] + 1))


def choose(settings: Sequence[Setting], required_accuracy: float) -> Setting | None:
    """The setting with the least expert fraction among those reaching ``required_accuracy`` (ties: the more
    accurate, then the earlier), or None."""
    feasible = [s for s in settings if s.accuracy >= required_accuracy]
    return min(feasible, key=lambda s: (s.expert_fraction, -s.accuracy), default=None)


@torch.no_grad()
def calibrate(
    model: nn.Module,
    val: ImageDataset,
    max_drop: float | None = None,
    *,
    target: float | None = None,
    strategy: str = "combine",
    grid: Sequence[int | float] | None = None,
    test: ImageDataset | None = None,
    batch_size: int = 1024,
    k_min: int = 1,
    k_max: int | None = None,
) -> Calibration:
    """The cheapest setting of ``strategy`` whose validation accuracy is within ``max_drop`` points (percentage
    points, >= 0) of all experts', or at least ``target`` (an accuracy in [0, 1]); give exactly one of the two.

    Args:
        model: a model with SoftMoE layers (evaluated in eval mode; the caller's device).
        val, test: the validation split (required, non-empty) and optionally a test split scored for the chosen
            setting and for all experts.
        strategy: "combine" (Algorithm 1, ``grid`` of k values, default 1..n) or "mass" (the adaptive strategy,
            ``grid`` of tau values, default :data:`DEFAULT_TAUS`, with ``k_min``/``k_max``).
    Warns:
        NoBetterThanRandomWarning: once, when some layer's combine shares on the validation split are nearly uniform,
            or else when random subsets of Algorithm 1's chosen k score at least as well on the validation split.
    Raises:
        ValueError: no or both targets, a negative drop, a target outside [0, 1], an empty split, an unknown
            strategy, or a target that even all experts miss on the validation split.
    """
    if (max_drop is None) == (target is None):
        raise ValueError(
            f"give exactly one of max_drop (points) and target (an accuracy), got max_drop={max_drop!r}, "
            f"target={target!r}"
        )
    if max_drop is not None and not (math.isfinite(max_drop) and max_drop >= 0):
        raise ValueError(f"max_drop must be a finite number of accuracy points >= 0, got {max_drop!r}")
    if target is not None and not 0 <= target <= 1:
        raise ValueError(f"target must be an accuracy in [0, 1], got {target!r}")
    if strategy not in CALIBRATED:
        raise ValueError(f"strategy must be one of {CALIBRATED}, got {strategy!r}")
    if len(val) == 0:
        raise ValueError(f"the validation split of {val.name} is empty: calibration needs examples")
    if test is not None and len(test) == 0:
        raise ValueError(f"the test split of {test.name} is empty")
    values = _grid(model, strategy, grid)
    reference = evaluate_setting(model, val, "all", batch_size=batch_size)
    required = reference.accuracy - max_drop / 100 if max_drop is not None else target
    assert required is not None  # exactly one of max_drop and target is given (checked above)
    if reference.accuracy < required:
        raise ValueError(
            f"the target accuracy {required:.4f} is out of reach: even all experts reach only "
            f"{reference.accuracy:.4f} on the validation split"
        )
    with warnings.catch_warnings():  # said once below, for the whole calibration, not once per setting
        warnings.simplefilter("ignore", NoBetterThanRandomWarning)
        settings = tuple(evaluate_setting(model, val, strategy, v, batch_size, k_min, k_max) for v in values)
        chosen = choose((reference, *settings), required)
        assert chosen is not None  # the reference (all experts) reaches the required accuracy (checked above)
        chosen_k = chosen.value if chosen.strategy == "combine" else None  # Algorithm 1's k, its setting's value
        random_accuracy = None
        if chosen_k is not None and any(chosen_k < layer.num_experts for layer in soft_moe_layers(model)):
            random_accuracy = _random_accuracy(model, val, chosen_k, batch_size)
        test_accuracy = reference_test = None
        if test is not None:
            reference_test = accuracy(model, test, batch_size)
            test_accuracy = evaluate_setting(
                model, test, chosen.strategy, chosen.value, batch_size, k_min, k_max
            ).accuracy
    was_training = model.training
    k = chosen_k if chosen_k is not None else 0.25
    uniformity = tuple(measure_share_uniformity(model.eval(), val.images[:batch_size], k))
    model.train(was_training)
    uniform = [u for u in uniformity if u.nearly_uniform]
    if uniform:
        warnings.warn(uniform[0].message(), NoBetterThanRandomWarning, stacklevel=2)
    elif random_accuracy is not None and chosen.accuracy <= random_accuracy:
        warnings.warn(
            f"on the validation split Algorithm 1 with k = {chosen.value} reaches {100 * chosen.accuracy:.2f} %, "
            f"random subsets of the same size {100 * random_accuracy:.2f} % (mean of {RANDOM_SEEDS} seeds): its "
            "choice of experts is no better than random here",
            NoBetterThanRandomWarning,
            stacklevel=2,
        )
    return Calibration(
        strategy, required, reference, chosen, settings, test_accuracy, reference_test, uniformity, random_accuracy
    )


def _random_accuracy(model: nn.Module, data: ImageDataset, k: int | float, batch_size: int) -> float:
    """The accuracy of random k-subsets on ``data``, the mean over :data:`RANDOM_SEEDS` seeds."""
    accuracies = []
    for seed in range(RANDOM_SEEDS):
        with select_experts(model, k=k, strategy="random", seed=seed):
            accuracies.append(accuracy(model, data, batch_size))
    return sum(accuracies) / len(accuracies)
