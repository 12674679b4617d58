"""What every experiment shares: the equal-accuracy protocol, selection sweeps and their statistics (the paired test
of Algorithm 1 against random selection), dataset defaults, and number formatting for the report."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any, TypeVar, cast

import torch
from torch import nn

from softmoe.data import FASHION_MNIST_DIR, ImageDataset, batches
from softmoe.selection import random_statistics, select_experts

ALPHA = 0.01
"""The significance level at which a claim "holds" (Algorithm 1 beats random selection in a cell)."""

FALLBACK_DATASET = "mnist5k"


def default_vision_dataset() -> tuple[str, str | None]:
    """("fashion-mnist", None) when Debian's dataset-fashion-mnist is installed, else (mnist5k, a notice saying so)."""
    if FASHION_MNIST_DIR.is_dir():
        return "fashion-mnist", None
    notice = (
        f"Fashion-MNIST not found at {FASHION_MNIST_DIR} (apt-get install dataset-fashion-mnist, or pass "
        f"--dataset fashion-mnist:DIR); falling back to the embedded {FALLBACK_DATASET} digits"
    )
    return FALLBACK_DATASET, notice


PresetT = TypeVar("PresetT")


def pick_preset(presets: Mapping[str, PresetT], preset: PresetT | str) -> PresetT:
    """``presets[preset]`` for a name, the preset itself otherwise; a ValueError listing the names if unknown."""
    if not isinstance(preset, str):
        return preset
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
    return presets[preset]


def equal_accuracy_epochs(histories: dict[int, list[dict]]) -> tuple[float, dict[int, int]]:
    """The paper's protocol: compare every n at (about) the same accuracy.

    The common target is the highest validation accuracy that every model reaches (the minimum over n of each
    model's best epoch); each n then uses its epoch whose validation accuracy is closest to the target (ties to
    the earlier epoch). Returns (target, {n: epoch}).
    """
    if not histories or any(not h for h in histories.values()):
        raise ValueError("every model needs at least one finished epoch")
    target = min(max(e["val_accuracy"] for e in h) for h in histories.values())
    chosen = {
        n: min(h, key=lambda e: (abs(e["val_accuracy"] - target), e["epoch"]))["epoch"] for n, h in histories.items()
    }
    return target, chosen


@torch.no_grad()
def correct_predictions(
    model: nn.Module, data: ImageDataset, batch_size: int = 1024, bf16: bool = False
) -> torch.Tensor:
    """Whether ``model`` (in eval mode, on the CPU, under the caller's selection) predicts each example of ``data``
    right: (N,) bool; ``bf16``: under bfloat16 autocast."""
    model.eval()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
    parts = []
    for images, labels in batches(data, batch_size):
        with autocast:
            parts.append(model(images).argmax(dim=1) == labels)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bool)


@torch.no_grad()
def selection_sweep(
    model: nn.Module,
    data: ImageDataset,
    ks: Iterable[int],
    random_seeds: int,
    correct: Callable[[nn.Module, ImageDataset], torch.Tensor] = correct_predictions,
    renormalize: bool = False,
) -> tuple[dict, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Test accuracy with all experts, then for each k with Algorithm 1 and with random selection over seeds.

    Every SoftMoE layer of ``model`` picks its own k experts per input (``renormalize``: the kept combine weights
    rescaled, as :func:`softmoe.select_experts`). ``correct`` gives the per-example outcome (N,) bool of one pass.
    Returns (the record, {k: (Algorithm 1's outcome per example as 0/1 floats, the fraction of the random seeds
    right on each example)}), the latter for :func:`paired_test`. Times are wall seconds of one pass.
    """
    model.eval()
    started = time.perf_counter()
    all_experts = float(correct(model, data).double().mean())
    result: dict[str, Any] = {
        "all_experts": all_experts,
        "all_experts_seconds": time.perf_counter() - started,
        "per_k": {},
    }
    outcomes = {}
    # The first SoftMoE layer's n (an int attribute, which nn.Module's attribute types do not know).
    n = next(cast(int, m.num_experts) for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "selector"))
    for k in ks:
        started = time.perf_counter()
        with select_experts(model, k=k, strategy="combine", renormalize=renormalize):
            algorithm1 = correct(model, data).double()
        seconds = time.perf_counter() - started
        randoms = []
        for seed in range(random_seeds):
            with select_experts(model, k=k, strategy="random", seed=seed, renormalize=renormalize):
                randoms.append(correct(model, data).double())
        result["per_k"][str(k)] = {
            "k": k,
            "fraction": k / n,
            "algorithm1": float(algorithm1.mean()),
            "algorithm1_seconds": seconds,
            "random": random_statistics([float(r.mean()) for r in randoms], float(algorithm1.mean())),
        }
        outcomes[k] = (algorithm1, torch.stack(randoms).mean(dim=0))
    return result, outcomes


def paired_test(
    first: torch.Tensor, second: torch.Tensor, flips: int = 10_000, resamples: int = 2_000, seed: int = 0
) -> dict:
    """Is ``first`` better than ``second`` on the same examples? Both (N,) per-example scores in [0, 1] (a 0/1
    outcome, or the fraction of seeds right on the example).

    The per-example differences d = first - second give: their mean (in accuracy, so 0.01 is one point); a
    99 % percentile bootstrap interval over the examples (``resamples`` draws); and the two-sided p-value of the
    paired sign-flip randomization test (each d's sign flipped at random, ``flips`` times: p = (1 + count of flipped
    means at least as far from 0) / (1 + flips), so p >= 1 / (1 + flips)). Seeded: the same inputs give the same
    numbers. The test assumes nothing but independent examples.
    """
    if first.shape != second.shape or first.dim() != 1 or first.numel() == 0:
        raise ValueError(
            f"need two score vectors of one shape (N,), N >= 1, got {tuple(first.shape)} and {tuple(second.shape)}"
        )
    d = (first.double() - second.double()).cpu()
    count = d.numel()
    generator = torch.Generator().manual_seed(seed)
    means = torch.cat(
        [
            d[torch.randint(count, (min(250, resamples - start), count), generator=generator)].mean(dim=1)
            for start in range(0, resamples, 250)
        ]
    )
    low, high = torch.quantile(means, torch.tensor([0.005, 0.995], dtype=torch.float64)).tolist()
    moved = d[d != 0]
    observed = abs(float(moved.sum()))
    beyond = 0
    for start in range(0, flips, 1000):
        signs = torch.randint(0, 2, (min(1000, flips - start), moved.numel()), generator=generator).double() * 2 - 1
        beyond += int(((signs @ moved).abs() >= observed - 1e-9).sum())
    return {
        "difference": float(d.mean()),
        "ci99": [low, high],
        "p_value": (1 + beyond) / (1 + flips),
        "examples": count,
    }


def holds(test: dict) -> bool:
    """Whether a :func:`paired_test` shows the first better at :data:`ALPHA`."""
    return test["difference"] > 0 and test["p_value"] < ALPHA


def mean_sd(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation with ddof = 1; 0 for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def model_table(models: dict, last_header: str, last_value: Callable[[dict], float]) -> list[str]:
    """Markdown rows describing each trained model of a suite ({str(n): record}), with one accuracy column."""
    lines = [
        f"| n | expert hidden | parameters | expert parameters | epoch | val acc (%) | {last_header} |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted(int(key) for key in models):
        m = models[str(n)]
        lines.append(
            f"| {n} | {m['expert_hidden']} | {m['parameters']:,} | {m['expert_parameters']:,} | {m['epoch']} | "
            f"{pct(m['val_accuracy'])} | {pct(last_value(m))} |"
        )
    return lines


def pct(value: float | None) -> str:
    """A fraction as a percentage with two decimals, or an en dash for a missing value."""
    return "–" if value is None else f"{100 * value:.2f}"


def num(value: float | None) -> str:
    """A number with two decimals, or an en dash for a missing value."""
    return "–" if value is None else f"{value:.2f}"


def mean_std_pct(stats: dict) -> str:
    """'mean ± std' of a random_statistics dict, in percent."""
    return f"{100 * stats['mean']:.2f} ± {100 * stats['std']:.2f}"
