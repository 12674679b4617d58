"""The paper's MNIST suite (sections 4.2 and 4.4, Appendix E.1): train n = 2..512, then Algorithm 1 vs random
selection (Figures 1, 2a; Table 10) and the best-subset oracle (Table 1, Figure 5).

Model (:data:`softmoe.models.mnist.MNIST_MODELS`): "authors" (the authors' code, the default) or "definition1".
Protocol (:data:`PROTOCOLS`): "authors" (the authors' code: no shuffling, a first epoch without optimizer steps,
the model of the last epoch; the default) or "equal-accuracy" (the paper's text: shuffled epochs, every n compared
at the epoch closest to a common validation accuracy). Other pairs than the default write their own
``mnist_suite_<model>_<protocol>.json`` and train in their own ``runs/<model>_<protocol>`` folders.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import NamedTuple
from pathlib import Path

import torch
from tqdm.auto import tqdm

from softmoe.checkpoint import write_json
from softmoe.data import Splits, load_dataset, portable_spec
from softmoe.distributed import LOCAL, DistContext
from softmoe_repro.common import (
    equal_accuracy_epochs,
    mean_std_pct,
    model_table,
    num,
    pct,
    pick_preset,
    selection_sweep,
)
from softmoe.models import SoftMoEClassifier
from softmoe.models.mnist import mnist_model
from softmoe.oracle import (
    DEFAULT_MAX_SUBSETS,
    check_subset_count,
    oracle_from_contributions,
)
from softmoe.runs import load_epoch
from softmoe.train import TrainConfig, accuracy, train_classifier
from softmoe_repro import budgets
from softmoe_repro.budgets import budget_study
from softmoe_repro.specialization import plot_class_experts, plot_top_images, specialization

PAPER_EXPERTS = (2, 4, 8, 16, 32, 64, 128, 256, 512)


class Protocol(NamedTuple):
    """How the models are trained (the data order and the first epoch) and which epoch of each is evaluated."""

    shuffle: bool
    frozen_first_epoch: bool
    epoch: str  # "last" or "equal-accuracy"
    description: str


PROTOCOLS = {
    "authors": Protocol(
        False, True, "last",
        "the authors' code: the training set in stored order every epoch (no shuffling), a first epoch of forward "
        "passes without optimizer steps, every model evaluated at its last epoch",
    ),
    "equal-accuracy": Protocol(
        True, False, "equal-accuracy",
        "the paper's text: shuffled epochs; the common target is the best validation accuracy every model reaches, "
        "and each n uses its epoch closest to it",
    ),
}
DEFAULT_VARIANT = ("authors", "authors")


@dataclass(frozen=True)
class SuitePreset:
    """Everything that defines one run of the suite (``train`` gives epochs, batch, lr and seed; the protocol sets
    the data order and the first epoch)."""

    name: str
    dataset: str
    experts: tuple[int, ...] = PAPER_EXPERTS
    model: str = "authors"
    protocol: str = "authors"
    train: TrainConfig = field(default_factory=TrainConfig)
    random_seeds: int = 10
    oracle_fraction: float = 0.25
    max_subsets: int = DEFAULT_MAX_SUBSETS
    grid: tuple[int, int] = (2, 2)
    limit_examples: int | None = None
    budget_experts: tuple[int, ...] = (8, 32, 128)
    specialization_experts: tuple[int, ...] = (8, 32)


PRESETS = {
    "default": SuitePreset("default", "mnist5k"),
    "paper": SuitePreset("paper", "mnist5k", max_subsets=20_000_000),
    "smoke": SuitePreset(
        "smoke", "digits", experts=(2, 4, 8), train=TrainConfig(epochs=3), random_seeds=3, limit_examples=600,
        budget_experts=(4, 8), specialization_experts=(4, 8),
    ),
}


def suite_file(model: str, protocol: str) -> str:
    """The JSON file of one (model, protocol) pair: mnist_suite.json for the default pair."""
    return "mnist_suite.json" if (model, protocol) == DEFAULT_VARIANT else f"mnist_suite_{model}_{protocol}.json"


def training_config(preset: SuitePreset) -> TrainConfig:
    """The preset's recipe with its protocol's data order and first epoch."""
    protocol = PROTOCOLS[preset.protocol]
    return replace(preset.train, shuffle=protocol.shuffle, frozen_first_epoch=protocol.frozen_first_epoch)


def chosen_epochs(histories: dict[int, list[dict]], protocol: str) -> tuple[float | None, dict[int, int]]:
    """(the common validation target or None, {n: the epoch evaluated}) under the protocol."""
    if PROTOCOLS[protocol].epoch == "last":
        return None, {n: len(h) for n, h in histories.items()}
    return equal_accuracy_epochs(histories)


def selection_ks(num_experts: int) -> list[int]:
    """Every k < n for n <= 16, else k in {n/2, n/4, n/8}; always k >= 1."""
    if num_experts <= 16:
        return list(range(1, num_experts))
    return sorted({num_experts // d for d in (2, 4, 8) if num_experts // d >= 1}, reverse=True)


def evaluate_selection(model: SoftMoEClassifier, splits: Splits, preset: SuitePreset) -> dict:
    """All-experts, Algorithm 1 and random-selection test accuracies of one model for every k of the suite."""
    ks = selection_ks(model.moe.num_experts)
    return selection_sweep(model, splits.test, ks, preset.random_seeds, accuracy)


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


def run_suite(
    preset: SuitePreset | str = "default",
    out_dir: str | Path = "results/mnist",
    dataset: str | None = None,
    progress: bool = True,
    dist: DistContext | None = None,
    model: str | None = None,
    protocol: str | None = None,
) -> dict | None:
    """Train every n (resuming what a previous run finished), evaluate, write the suite's JSON (:func:`suite_file`);
    return it. ``dataset``, ``model`` and ``protocol`` override the preset's.

    Under torchrun (``dist`` from ``softmoe.distributed.setup_distributed``) every rank trains its share of each
    batch; rank 0 alone evaluates and writes, and the other ranks return None.
    """
    dist = dist or LOCAL
    preset = pick_preset(PRESETS, preset)
    overrides = {"dataset": dataset, "model": model, "protocol": protocol}
    preset = replace(preset, **{key: value for key, value in overrides.items() if value is not None})
    mnist_model(preset.model)  # a ValueError naming the choices
    if preset.protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {preset.protocol!r}; choose one of {sorted(PROTOCOLS)}")
    out_dir = Path(out_dir)
    runs = out_dir / "runs" / f"{preset.model}_{preset.protocol}"
    limit = preset.limit_examples
    splits = load_dataset(preset.dataset).limit(limit, limit, limit)
    image_shape = splits.train.image_shape
    train_config = training_config(preset)

    def factory(n: int):
        return lambda: SoftMoEClassifier(image_shape, n, splits.train.num_classes, preset.grid, preset.model)

    def description(n: int) -> dict:  # what run.json records: enough for `softmoe evaluate` to rebuild the model
        return {
            "dataset": portable_spec(preset.dataset),
            "image_shape": list(image_shape),
            "num_experts": n,
            "num_classes": splits.train.num_classes,
            "grid": list(preset.grid),
            "model": preset.model,
            "limit_examples": limit,
        }

    histories = {}
    for n in tqdm(preset.experts, desc="models", disable=not progress or not dist.is_main):
        _, histories[n] = train_classifier(
            factory(n), splits, train_config, runs / f"n{n:03d}", progress, f"n={n}", dist, model_config=description(n)
        )
    if not dist.is_main:
        return None
    target, chosen = chosen_epochs(histories, preset.protocol)
    models = {}
    for n in tqdm(preset.experts, desc="evaluate", disable=not progress):
        torch.manual_seed(preset.train.seed)
        model = load_epoch(factory(n)(), runs / f"n{n:03d}", chosen[n]).eval()
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
        if n in preset.budget_experts:
            models[str(n)]["budgets"] = budget_study(model, splits)
        if n in preset.specialization_experts:
            models[str(n)]["specialization"] = specialization(model, splits.test)
    results = {
        "preset": {**asdict(preset), "train": asdict(train_config)},
        "model": {"name": preset.model, **asdict(mnist_model(preset.model))},
        "protocol": {"name": preset.protocol, **PROTOCOLS[preset.protocol]._asdict()},
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
    write_json(out_dir / suite_file(preset.model, preset.protocol), results)
    return results


MODEL_DESCRIPTIONS = {
    "authors": "the authors' code: pixels (x - 0.1307) / 0.3081, tokens and phi divided by their norm plus 1e-6 "
    "with a learnable scale, the slots built from the normalized tokens, phi ~ U[-1, 1], experts and head without "
    "biases, hidden int(196 * 4 / n)",
    "definition1": "Definition 1 as the paper's text writes it: equation (1) routing (no normalization), pixels in "
    "[0, 1], biases, phi truncated normal, hidden round(196 * 4 / n)",
}

PAPER_TABLE1 = {
    "best": {4: 94.69, 8: 99.90, 16: 100.00},
    "random": {4: (46.57, 0.44), 8: (51.95, 0.46), 16: (58.94, 0.34)},
}
PAPER_TABLE10 = {
    0.5: {2: 25.79, 4: 33.61, 8: 22.95, 16: 25.39, 32: 23.33, 64: 26.47, 128: 22.98, 256: 10.19, 512: 18.70},
    0.25: {4: 0.00, 8: 16.33, 16: 45.83, 32: 38.89, 64: 49.00, 128: 37.15, 256: 31.33, 512: 29.44},
    0.125: {8: 11.81, 16: 28.24, 32: 46.78, 64: 38.78, 128: 50.46, 256: 42.34, 512: 66.90},
}
FRACTIONS = (0.5, 0.25, 0.125)


def cell(models: dict, n: int, fraction: float) -> dict | None:
    """The selection record of model n at k = round(fraction * n), or None when absent or k < 1."""
    k = round(fraction * n)
    model = models.get(str(n))
    return None if model is None or k < 1 else model["selection"]["per_k"].get(str(k))


def write_plots(results: dict, out_dir: str | Path) -> dict[str, str]:
    """Figure 1/2a (accuracy against n), Figure 5 (distinct best subsets) and the training curves, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = results["models"]
    ns = sorted(int(n) for n in models)
    paths = {}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [100 * models[str(n)]["selection"]["all_experts"] for n in ns], "k-o", label="all experts")
    for fraction, color in zip(FRACTIONS, ("tab:blue", "tab:orange", "tab:green")):
        cells = [(n, cell(models, n, fraction)) for n in ns]
        cells = [(n, c) for n, c in cells if c is not None]
        if not cells:
            continue
        xs = [n for n, _ in cells]
        label = f"k = n/{round(1 / fraction)}"
        ax.plot(xs, [100 * c["algorithm1"] for _, c in cells], "-o", color=color, label=f"Algorithm 1, {label}")
        ax.errorbar(
            xs,
            [100 * c["random"]["mean"] for _, c in cells],
            yerr=[100 * c["random"]["std"] for _, c in cells],
            fmt="--s",
            color=color,
            alpha=0.6,
            label=f"random, {label}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("number of experts n (expert parameters fixed)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"Algorithm 1 vs random selection ({results['data']['name']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    paths["selection"] = str(out_dir / "fig_selection_vs_n.png")
    fig.savefig(paths["selection"], dpi=120)
    plt.close(fig)

    oracle = [(n, models[str(n)]["oracle"]) for n in ns if "distinct_best_subsets" in models[str(n)]["oracle"]]
    if oracle:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([str(n) for n, _ in oracle], [o["distinct_best_subsets"] for _, o in oracle], label="distinct best subsets")
        ax.plot([str(n) for n, _ in oracle], [o["distinct_cap"] for _, o in oracle], "r_", ms=30, mew=2, label="cap min(N, C(n,k))")
        ax.set_yscale("log")
        ax.set_xlabel("number of experts n")
        ax.set_ylabel("distinct best k = n/4 subsets")
        ax.legend()
        fig.tight_layout()
        paths["distinct_subsets"] = str(out_dir / "fig_distinct_best_subsets.png")
        fig.savefig(paths["distinct_subsets"], dpi=120)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n in ns:
        history = models[str(n)]["history"]
        ax.plot([e["epoch"] for e in history], [100 * e["val_accuracy"] for e in history], label=f"n={n}")
    if results["equal_accuracy_target"] is not None:
        ax.axhline(100 * results["equal_accuracy_target"], color="k", ls=":", label="common target")
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation accuracy (%)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    paths["training"] = str(out_dir / "fig_training_curves.png")
    fig.savefig(paths["training"], dpi=120)
    plt.close(fig)

    studies = {f"n = {n}": models[str(n)]["budgets"] for n in ns if "budgets" in models[str(n)]}
    if studies:
        paths["budgets"] = budgets.plot(
            studies, out_dir / "fig_budgets.png", f"accuracy against expert compute ({results['data']['name']})"
        )
    special = [n for n in ns if "specialization" in models[str(n)]]
    if special:
        tables = {f"n = {n}": models[str(n)]["specialization"]["class_expert_shares"] for n in special}
        paths["class_experts"] = plot_class_experts(tables, out_dir / "fig_class_experts.png")
        n = special[-1]
        paths["top_images"] = plot_top_images(
            models[str(n)]["specialization"]["top_images"], out_dir / "fig_expert_top_images.png",
            f"n = {n}: the test images that weight each expert most (label, share)",
        )
    return paths


def markdown(results: dict, plots: dict[str, str]) -> str:
    """The report section of the suite, our numbers beside the paper's, with an honest comparison."""
    models = results["models"]
    ns = sorted(int(n) for n in models)
    data, preset = results["data"], results["preset"]
    model, protocol = results["model"], results["protocol"]
    target = results["equal_accuracy_target"]
    chosen = (
        f"Common validation target {pct(target)}%; each n uses its epoch closest to it."
        if target is not None
        else "Each n is evaluated at its last epoch."
    )
    lines = [
        "## MNIST suite: expert specialization and Algorithm 1 (sections 4.2 and 4.4)",
        "",
        f"Data: `{data['name']}` ({data['train']:,} train / {data['val']:,} validation / {data['test']:,} test). "
        f"The paper used the full MNIST (60,000 / 10,000). Recipe: Adam, lr {preset['train']['lr']}, batch "
        f"{preset['train']['batch_size']}, {preset['train']['epochs']} epochs, seed {preset['train']['seed']}; random "
        f"selection over {preset['random_seeds']} seeds.",
        "",
        f"Every table of this section comes from the model `{model['name']}` and the protocol `{protocol['name']}`. "
        f"Model: {MODEL_DESCRIPTIONS.get(model['name'], model['name'])}. Protocol: {protocol['description']}. "
        f"{chosen} The paper's models all sat at about 97.5% test accuracy on the full MNIST.",
        "",
        "Random selection: mean ± σ over the seeds, σ the sample standard deviation (ddof = 1), as in the authors' "
        "scripts; Table 10 divides Algorithm 1's lead over the mean by that σ.",
        "",
        *model_table(models, "test acc (%)", lambda m: m["test_accuracy"]),
    ]
    lines += ["", "### Table 1: best and random k = n/4 subsets", "", "| n | best k-subset (ours) | best (paper) | random (ours) | random (paper) |", "|---|---|---|---|---|"]
    for n in (4, 8, 16):
        if str(n) not in models:
            continue
        oracle = models[str(n)]["oracle"]
        quarter = cell(models, n, 0.25)
        best = pct(oracle.get("best_subset_accuracy")) if "best_subset_accuracy" in oracle else "skipped"
        rnd = mean_std_pct(quarter["random"]) if quarter else "–"
        pm, ps = PAPER_TABLE1["random"][n]
        lines.append(f"| {n} | {best} | {PAPER_TABLE1['best'][n]:.2f} | {rnd} | {pm:.2f} ± {ps:.2f} |")
    lines += ["", "### Figures 1 and 2a: accuracy against n", "", f"![accuracy against n]({Path(plots['selection']).name})", ""]
    lines += ["| n | all experts | " + " | ".join(f"Alg. 1 k=n/{round(1 / f)} | random k=n/{round(1 / f)}" for f in FRACTIONS) + " |"]
    lines += ["|---|---|" + "---|---|" * len(FRACTIONS)]
    for n in ns:
        row = [str(n), pct(models[str(n)]["selection"]["all_experts"])]
        for f in FRACTIONS:
            record = cell(models, n, f)
            row += [pct(record["algorithm1"]), mean_std_pct(record["random"])] if record else ["–", "–"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "### Table 10: standard deviations by which Algorithm 1 beats random selection", ""]
    lines += ["| k | " + " | ".join(f"n={n} (ours / paper)" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for f in FRACTIONS:
        row = [f"n/{round(1 / f)}"]
        for n in ns:
            record = cell(models, n, f)
            ours = num(record["random"]["stds_above_random"]) if record else "–"
            row.append(f"{ours} / {num(PAPER_TABLE10[f].get(n))}")
        lines.append("| " + " | ".join(row) + " |")
    if "distinct_subsets" in plots:
        lines += ["", "### Figure 5: distinct best k = n/4 subsets", "", f"![distinct best subsets]({Path(plots['distinct_subsets']).name})", ""]
        lines += ["| n | k | C(n, k) | distinct best subsets | cap |", "|---|---|---|---|---|"]
        for n in ns:
            o = models[str(n)]["oracle"]
            distinct = o.get("distinct_best_subsets", "skipped (over the cap)")
            count = f"{o['subsets']:,}" if o["subsets"] < 10**12 else f"{float(o['subsets']):.2e}"
            lines.append(f"| {n} | {o['k']} | {count} | {distinct} | {o.get('distinct_cap', '–')} |")
    lines += ["", f"![training curves]({Path(plots['training']).name})", "", "### How our numbers compare", ""]
    lines += [f"- {finding}" for finding in findings(results)]
    lines += beyond_algorithm1(results, plots)
    return "\n".join(lines) + "\n"


def beyond_algorithm1(results: dict, plots: dict[str, str]) -> list[str]:
    """The report's sections on calibrated budgets and specialization (not in the paper), where present."""
    models = results["models"]
    ns = sorted(int(n) for n in models)
    studies = {f"n = {n}": models[str(n)]["budgets"] for n in ns if "budgets" in models[str(n)]}
    lines = []
    if studies and "budgets" in plots:
        drop = next(iter(studies.values()))["max_drop"]
        lines += [
            "", "### Beyond Algorithm 1: accuracy against the expert compute run (not in the paper)", "",
            f"![accuracy against expert compute]({Path(plots['budgets']).name})", "",
            "Each point is one selection on the test split: all experts, Algorithm 1 at every k, the adaptive "
            "`mass` strategy (the fewest experts holding a share tau of each input's combine mass) over a grid of "
            "tau, and random subsets; x is the fraction of the expert FLOPs actually run (top) or the measured time "
            "per example (bottom). The table gives the cheapest setting of each strategy within "
            f"{drop:g} point{'s' if drop != 1 else ''} of all experts on the validation split (`softmoe calibrate`), "
            "and its test accuracy.",
            "", *budgets.table(studies), "",
        ]
        lines += [f"- {finding}" for finding in budgets.findings(studies)]
    special = [n for n in ns if "specialization" in models[str(n)]]
    if special and "class_experts" in plots:
        lines += [
            "", "### Specialization made visible (not in the paper)", "",
            f"![class x expert shares]({Path(plots['class_experts']).name})", "",
            "Mean share of each expert in Algorithm 1's score per class (test split): a bright cell is an expert that "
            "a class relies on. " + "; ".join(
                f"n = {n}: shares from {100 * min(map(min, table)):.2f} % to {100 * max(map(max, table)):.2f} % "
                f"(uniform: {100 / n:.2f} %)"
                for n, table in ((n, models[str(n)]["specialization"]["class_expert_shares"]) for n in special)
            ) + ".", "",
            f"![top images per expert]({Path(plots['top_images']).name})", "",
            "For the experts with the largest mean share, the test images that weight them most.",
        ]
    return lines


def findings(results: dict) -> list[str]:
    """Plain statements, computed from the results, of what reproduces and by how much it differs."""
    models = results["models"]
    ns = sorted(int(n) for n in models)
    out = []
    cells = [(n, f, cell(models, n, f)) for n in ns for f in FRACTIONS]
    cells = [(n, f, c) for n, f, c in cells if c is not None]
    wins = sum(c["algorithm1"] > c["random"]["mean"] for _, _, c in cells)
    out.append(
        f"Algorithm 1 beats the random mean in {wins} of {len(cells)} (n, k) cells "
        "(the paper: in every cell of Table 10 except n = 4, k = 1, where it ties)."
    )
    large = [n for n in ns if n >= 64]
    if large:
        gaps = {n: models[str(n)]["selection"]["all_experts"] - cell(models, n, 0.5)["algorithm1"] for n in large}
        worst = max(gaps.values())
        out.append(
            f"For n >= 64, Algorithm 1 with k = n/2 is within {100 * worst:.2f} points of all experts "
            f"(the paper: 'nearly the same'; per n: {', '.join(f'{n}: {100 * g:.2f}' for n, g in gaps.items())})."
        )
    small = [n for n in ns if n <= 8 and cell(models, n, 0.5)]
    if small:
        gaps = {n: models[str(n)]["selection"]["all_experts"] - cell(models, n, 0.5)["algorithm1"] for n in small}
        out.append(
            "For n <= 8, k = n/2 loses "
            + ", ".join(f"{100 * g:.2f} points at n = {n}" for n, g in gaps.items())
            + " (the paper: 'poor performance when n <= 8')."
        )
    for n in (4, 8, 16):
        oracle = models.get(str(n), {}).get("oracle", {})
        if "best_subset_accuracy" in oracle:
            diff = 100 * oracle["best_subset_accuracy"] - PAPER_TABLE1["best"][n]
            out.append(f"Best k = n/4 subset at n = {n}: {pct(oracle['best_subset_accuracy'])}% vs the paper's {PAPER_TABLE1['best'][n]:.2f}% ({diff:+.2f} points).")
    trend = [models[str(n)]["oracle"].get("distinct_best_subsets") for n in ns if "distinct_best_subsets" in models[str(n)]["oracle"]]
    if len(trend) > 1:
        grows = all(a <= b for a, b in zip(trend, trend[1:]))
        out.append(f"Distinct best subsets {'grow' if grows else 'do not grow monotonically'} with n ({trend}); the paper: they grow.")
    return out
