"""The paper's MNIST suite (sections 4.2 and 4.4, Appendix E.1): train n = 2..512, compare at equal accuracy,
then Algorithm 1 vs random selection (Figures 1, 2a; Table 10) and the best-subset oracle (Table 1, Figure 5).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from softmoe.checkpoint import write_json
from softmoe.data import Splits, load_dataset
from softmoe.models import SoftMoEClassifier
from softmoe.oracle import DEFAULT_MAX_SUBSETS, check_subset_count, oracle_from_contributions
from softmoe.selection import select_experts
from softmoe.train import TrainConfig, accuracy, load_epoch, train_classifier

PAPER_EXPERTS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class SuitePreset:
    """Everything that defines one run of the suite."""

    name: str
    dataset: str
    experts: tuple[int, ...] = PAPER_EXPERTS
    train: TrainConfig = field(default_factory=TrainConfig)
    random_seeds: int = 10
    oracle_fraction: float = 0.25
    max_subsets: int = DEFAULT_MAX_SUBSETS
    grid: tuple[int, int] = (2, 2)
    limit_examples: int | None = None


PRESETS = {
    "default": SuitePreset("default", "mnist5k"),
    "paper": SuitePreset("paper", "mnist5k", max_subsets=20_000_000),
    "smoke": SuitePreset(
        "smoke", "digits", experts=(2, 4, 8), train=TrainConfig(epochs=2), random_seeds=3, limit_examples=600
    ),
}


def selection_ks(num_experts: int) -> list[int]:
    """Every k < n for n <= 16, else k in {n/2, n/4, n/8}; always k >= 1."""
    if num_experts <= 16:
        return list(range(1, num_experts))
    return sorted({num_experts // d for d in (2, 4, 8) if num_experts // d >= 1}, reverse=True)


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


def random_statistics(accuracies: list[float], algorithm1: float) -> dict:
    """Mean and (population) std of the random-selection accuracies, and Algorithm 1's lead in stds (Table 10)."""
    mean = statistics.fmean(accuracies)
    std = statistics.pstdev(accuracies) if len(accuracies) > 1 else 0.0
    lead = (algorithm1 - mean) / std if std > 0 else None
    return {"accuracies": accuracies, "mean": mean, "std": std, "stds_above_random": lead}


@torch.no_grad()
def evaluate_selection(model: SoftMoEClassifier, splits: Splits, preset: SuitePreset) -> dict:
    """All-experts, Algorithm 1 and random-selection test accuracies of one model for every k of the suite."""
    n = model.moe.num_experts
    per_k = {}
    for k in selection_ks(n):
        with select_experts(model, k=k, strategy="combine"):
            algorithm1 = accuracy(model, splits.test)
        randoms = []
        for seed in range(preset.random_seeds):
            with select_experts(model, k=k, strategy="random", seed=seed):
                randoms.append(accuracy(model, splits.test))
        per_k[str(k)] = {"k": k, "fraction": k / n, "algorithm1": algorithm1, "random": random_statistics(randoms, algorithm1)}
    return {"all_experts": accuracy(model, splits.test), "per_k": per_k}


@torch.no_grad()
def evaluate_oracle(model: SoftMoEClassifier, splits: Splits, preset: SuitePreset) -> dict:
    """Best-k-subset accuracy and the number of distinct best subsets at k = oracle_fraction * n (Table 1, Fig. 5)."""
    n = model.moe.num_experts
    k = max(1, round(preset.oracle_fraction * n))
    record = {"k": k, "subsets": math.comb(n, k)}
    try:
        check_subset_count(n, k, preset.max_subsets)
    except ValueError as error:
        return {**record, "skipped": str(error)}
    model.eval()
    parts = [model.expert_logit_contributions(images) for images in splits.test.images.split(512)]
    contributions = torch.cat([c for c, _ in parts])
    result = oracle_from_contributions(contributions, parts[0][1], splits.test.labels, k, preset.max_subsets)
    return {
        **record,
        "best_subset_accuracy": result.accuracy,
        "distinct_best_subsets": result.distinct_best_subsets,
        "distinct_cap": min(len(splits.test), math.comb(n, k)),
    }


def limited(splits: Splits, limit: int | None) -> Splits:
    """At most ``limit`` examples of each split (for the smoke preset)."""
    if limit is None:
        return splits
    return Splits(*(part.subset(slice(0, limit)) for part in splits))


def run_suite(
    preset: SuitePreset | str = "default",
    out_dir: str | Path = "results/mnist",
    dataset: str | None = None,
    progress: bool = True,
) -> dict:
    """Train every n (resuming what a previous run finished), evaluate, write ``mnist_suite.json``; return it."""
    if isinstance(preset, str):
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        preset = PRESETS[preset]
    if dataset is not None:
        preset = replace(preset, dataset=dataset)
    out_dir = Path(out_dir)
    splits = limited(load_dataset(preset.dataset), preset.limit_examples)
    image_shape = splits.train.image_shape

    def factory(n: int):
        return lambda: SoftMoEClassifier(image_shape, n, splits.train.num_classes, grid=preset.grid)

    histories = {}
    for n in tqdm(preset.experts, desc="models", disable=not progress):
        _, histories[n] = train_classifier(
            factory(n), splits, preset.train, out_dir / "runs" / f"n{n:03d}", progress, f"n={n}"
        )
    target, chosen = equal_accuracy_epochs(histories)
    models = {}
    for n in tqdm(preset.experts, desc="evaluate", disable=not progress):
        torch.manual_seed(preset.train.seed)
        model = load_epoch(factory(n)(), out_dir / "runs" / f"n{n:03d}", chosen[n]).eval()
        chosen_metrics = histories[n][chosen[n] - 1]
        models[str(n)] = {
            "num_experts": n,
            "expert_hidden": model.moe.experts.hidden,
            "parameters": sum(p.numel() for p in model.parameters()),
            "expert_parameters": model.expert_parameter_count(),
            "epoch": chosen[n],
            "val_accuracy": chosen_metrics["val_accuracy"],
            "test_accuracy": chosen_metrics["test_accuracy"],
            "history": histories[n],
            "selection": evaluate_selection(model, splits, preset),
            "oracle": evaluate_oracle(model, splits, preset),
        }
    results = {
        "preset": {**asdict(preset), "train": asdict(preset.train)},
        "data": {
            "name": preset.dataset,
            "train": len(splits.train),
            "val": len(splits.val),
            "test": len(splits.test),
            "image_shape": list(image_shape),
        },
        "equal_accuracy_target": target,
        "models": models,
    }
    write_json(out_dir / "mnist_suite.json", results)
    return results
