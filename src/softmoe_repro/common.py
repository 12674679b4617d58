"""What every experiment shares: the equal-accuracy protocol, selection sweeps and their statistics, dataset
defaults, and number formatting for the report."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from softmoe.data import FASHION_MNIST_DIR, ImageDataset
from softmoe.selection import random_statistics, select_experts

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


def pick_preset(presets: dict, preset):
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
def selection_sweep(
    model: nn.Module,
    data: ImageDataset,
    ks: Iterable[int],
    random_seeds: int,
    accuracy: Callable[[nn.Module, ImageDataset], float],
) -> dict:
    """Test accuracy with all experts, then for each k with Algorithm 1 and with random selection over seeds.

    Every SoftMoE layer of ``model`` picks its own k experts per input. Times are wall seconds of one pass.
    """
    model.eval()
    started = time.perf_counter()
    all_experts = accuracy(model, data)
    result = {"all_experts": all_experts, "all_experts_seconds": time.perf_counter() - started, "per_k": {}}
    n = next(m.num_experts for m in model.modules() if hasattr(m, "num_experts") and hasattr(m, "selector"))
    for k in ks:
        started = time.perf_counter()
        with select_experts(model, k=k, strategy="combine"):
            algorithm1 = accuracy(model, data)
        seconds = time.perf_counter() - started
        randoms = []
        for seed in range(random_seeds):
            with select_experts(model, k=k, strategy="random", seed=seed):
                randoms.append(accuracy(model, data))
        result["per_k"][str(k)] = {
            "k": k,
            "fraction": k / n,
            "algorithm1": algorithm1,
            "algorithm1_seconds": seconds,
            "random": random_statistics(randoms, algorithm1),
        }
    return result


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
