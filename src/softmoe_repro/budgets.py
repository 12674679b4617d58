"""Beyond Algorithm 1: accuracy against the expert compute actually run, and budgets calibrated to a tolerated drop.

For one trained model: test accuracy, the fraction of the expert FLOPs run (``softmoe.calibration``) and the
measured time per example on this host for all experts, Algorithm 1 at every k, the adaptive "mass" strategy over a
grid of tau, and random subsets; then the cheapest Algorithm 1 and "mass" settings within :data:`MAX_DROP` points of
all experts on the validation split (``softmoe.calibration.calibrate``), with their test accuracy. The time per
example is the best of :data:`TIMING_REPEATS` forward passes over the first :data:`TIMING_BATCH` test images.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from softmoe.calibration import DEFAULT_TAUS, calibrate, evaluate_setting
from softmoe.data import Splits
from softmoe.selection import random_statistics, select_experts, soft_moe_layers
from softmoe.train import accuracy

MAX_DROP = 1.0  # points of validation accuracy
RANDOM_SEEDS = 3
TIMING_BATCH = 256
TIMING_REPEATS = 3
STYLES = {  # strategy -> (label, matplotlib format)
    "algorithm1": ("Algorithm 1 (every k)", "-o"),
    "mass": ("adaptive mass (tau grid)", "-^"),
    "random": ("random subsets (mean ± σ)", "--s"),
}


def random_ks(n: int) -> list[int]:
    """The k of the random baseline: every k < n up to n = 8, else n/16, n/8, n/4, n/2 and 3n/4 (at least 1)."""
    if n <= 8:
        return list(range(1, n))
    return sorted({max(1, n * a // b) for a, b in ((1, 16), (1, 8), (1, 4), (1, 2), (3, 4))})


@torch.no_grad()
def microseconds_per_example(model: nn.Module, images: torch.Tensor, **selection) -> float:
    """The best of :data:`TIMING_REPEATS` forward passes of ``images`` under ``selection`` (none: all experts)."""
    best = float("inf")
    for _ in range(TIMING_REPEATS + 1):  # the first pass warms up
        with select_experts(model, **selection) if selection else nullcontext():
            started = time.perf_counter()
            model(images)
            best = min(best, time.perf_counter() - started)
    return 1e6 * best / images.shape[0]


def _point(setting, microseconds: float) -> dict:
    return {
        "value": setting.value,
        "test_accuracy": setting.accuracy,
        "expert_fraction": setting.expert_fraction,
        "us_per_example": microseconds,
    }


@torch.no_grad()
def budget_study(model: nn.Module, splits: Splits, ks: list[int] | None = None) -> dict:
    """The accuracy / compute points and the calibrated settings of one model (every SoftMoE layer has n experts)."""
    model.eval()
    test = splits.test
    n = soft_moe_layers(model)[0].num_experts
    ks = ks or list(range(1, n))
    images = test.images[:TIMING_BATCH]
    points: dict[str, Any] = {
        "all": _point(evaluate_setting(model, test, "all"), microseconds_per_example(model, images)),
        "algorithm1": [],
        "mass": [],
        "random": [],
    }
    for k in ks:
        setting = evaluate_setting(model, test, "combine", k)
        points["algorithm1"].append(_point(setting, microseconds_per_example(model, images, k=k)))
    for tau in DEFAULT_TAUS:
        setting = evaluate_setting(model, test, "mass", tau)
        points["mass"].append(_point(setting, microseconds_per_example(model, images, strategy="mass", tau=tau)))
    for k in random_ks(n):
        accuracies = []
        for seed in range(RANDOM_SEEDS):
            with select_experts(model, k=k, strategy="random", seed=seed):
                accuracies.append(accuracy(model, test))
        stats = random_statistics(accuracies)
        points["random"].append(
            {
                "value": k,
                "test_accuracy": stats["mean"],
                "std": stats["std"],
                "expert_fraction": k / n,
                "us_per_example": microseconds_per_example(model, images, k=k, strategy="random"),
            }
        )
    calibrated = {
        strategy: calibrate(model, splits.val, MAX_DROP, strategy=strategy, test=test).to_json()
        for strategy in ("combine", "mass")
    }
    return {
        "num_experts": n,
        "max_drop": MAX_DROP,
        "random_seeds": RANDOM_SEEDS,
        "points": points,
        "calibrated": calibrated,
    }


def plot(studies: dict[str, dict], path: str | Path, title: str) -> str:
    """One figure for a model family: per model (``studies``: label -> :func:`budget_study`), test accuracy against
    the fraction of expert FLOPs run (top row) and against the measured time per example (bottom row)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(studies)
    fig, axes = plt.subplots(2, len(labels), figsize=(4.2 * len(labels), 7), squeeze=False)
    for column, label in enumerate(labels):
        points = studies[label]["points"]
        top, bottom = axes[0][column], axes[1][column]
        for strategy, (name, fmt) in STYLES.items():
            rows = points[strategy]
            if not rows:
                continue
            xs = [r["expert_fraction"] for r in rows]
            ys = [100 * r["test_accuracy"] for r in rows]
            if strategy == "random":
                top.errorbar(xs, ys, yerr=[100 * r["std"] for r in rows], fmt=fmt, alpha=0.6, label=name, ms=4)
            else:
                top.plot(xs, ys, fmt, label=name, ms=4)
            bottom.plot(
                [r["us_per_example"] for r in rows],
                ys,
                fmt[-1],
                label=name,
                ms=4,
                alpha=0.6 if strategy == "random" else 1.0,
            )
        full = points["all"]
        top.plot([1.0], [100 * full["test_accuracy"]], "k*", ms=12, label="all experts")
        bottom.plot([full["us_per_example"]], [100 * full["test_accuracy"]], "k*", ms=12, label="all experts")
        top.set_title(label)
        top.set_xlabel("fraction of expert FLOPs run")
        bottom.set_xlabel("measured µs per example (this host)")
        for ax in (top, bottom):
            ax.set_ylabel("test accuracy (%)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def _setting(calibrated: dict) -> str:
    chosen = calibrated["chosen"]
    if chosen["strategy"] == "all":
        return "all experts"
    return f"k = {chosen['value']}" if chosen["strategy"] == "combine" else f"tau = {chosen['value']}"


def table(studies: dict[str, dict]) -> list[str]:
    """Markdown rows of the calibrated settings of every model."""
    lines = [
        "| model | strategy | setting | val acc (%) | test acc (%) | all experts test (%) | expert FLOPs run |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, study in studies.items():
        for strategy, calibrated in study["calibrated"].items():
            lines.append(
                f"| {label} | {'Algorithm 1' if strategy == 'combine' else 'adaptive mass'} | {_setting(calibrated)} | "
                f"{100 * calibrated['chosen']['accuracy']:.2f} | {100 * calibrated['test_accuracy']:.2f} | "
                f"{100 * calibrated['reference_test_accuracy']:.2f} | "
                f"{100 * calibrated['chosen']['expert_fraction']:.1f} % |"
            )
    return lines


def findings(studies: dict[str, dict]) -> list[str]:
    """Where the adaptive strategy needs less expert compute than Algorithm 1 for the same tolerated drop, and
    where it does not, computed from the calibrated settings."""
    helps: list[str] = []
    ties: list[str] = []
    hurts: list[str] = []
    for label, study in studies.items():  # compared as printed, to 0.1 percentage point
        a1 = round(100 * study["calibrated"]["combine"]["chosen"]["expert_fraction"], 1)
        mass = round(100 * study["calibrated"]["mass"]["chosen"]["expert_fraction"], 1)
        entry = f"{label} ({mass:.1f} % vs {a1:.1f} %)"
        (helps if mass < a1 else hurts if mass > a1 else ties).append(entry)
    drop = next(iter(studies.values()))["max_drop"] if studies else MAX_DROP
    out = [
        f"Within {drop:g} point{'s' if drop != 1 else ''} of all experts on the validation split, the adaptive mass "
        f"strategy runs less expert compute than Algorithm 1 for {len(helps)} of {len(studies)} models"
        + (f": {', '.join(helps)}" if helps else "")
        + "."
    ]
    if hurts:
        out.append(
            "It needs more for " + ", ".join(hurts) + f" (Algorithm 1 is tried at every k, the mass strategy "
            f"at {len(DEFAULT_TAUS)} values of tau)."
        )
    if ties:
        out.append("Both need the same compute for " + ", ".join(ties) + ".")
    for label, study in studies.items():
        points = study["points"]
        full = points["all"]["us_per_example"]
        faster = [p for p in points["algorithm1"] if p["us_per_example"] < full]
        times = [p["us_per_example"] for p in points["algorithm1"]]
        verdict = (
            f"Algorithm 1 is faster than all experts at k = {', '.join(str(p['value']) for p in faster)}"
            if faster
            else "Algorithm 1 is not faster than all experts at any k"
        )
        out.append(
            f"Measured time, {label}: all experts {full:.1f} µs per example, Algorithm 1 {min(times):.1f} to "
            f"{max(times):.1f} µs; {verdict}."
        )
    out.append(
        f"Times per example (bottom row of the figure) are the best of {TIMING_REPEATS} passes over "
        f"{TIMING_BATCH} test images on this shared CPU host: they show the trend, not precise speed-ups."
    )
    return out
