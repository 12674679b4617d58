"""The MNIST suite's headline numbers side by side for every (model, protocol) pair run into one results folder.

``softmoe reproduce mnist --model definition1 --protocol equal-accuracy`` writes
``mnist_suite_definition1_equal-accuracy.json`` beside the default ``mnist_suite.json``; this section shows how far
the numbers move with the model and the protocol.
"""

from __future__ import annotations

from softmoe_repro.mnist_suite import FRACTIONS, PAPER_TABLE1, cell
from softmoe_repro.common import mean_std_pct, pct


def write_plots(variants: dict, out_dir) -> dict[str, str]:
    """No plots: the section is one table."""
    return {}


def _row(results: dict) -> list[str]:
    models = results["models"]
    ns = sorted(int(n) for n in models)
    accuracies = [models[str(n)]["test_accuracy"] for n in ns]
    row = [f"`{results['model']['name']}`", f"`{results['protocol']['name']}`"]
    row.append(f"{pct(min(accuracies))}-{pct(max(accuracies))}")
    for n in PAPER_TABLE1["best"]:
        oracle = models.get(str(n), {}).get("oracle", {})
        quarter = cell(models, n, 0.25)
        best = pct(oracle["best_subset_accuracy"]) if "best_subset_accuracy" in oracle else "–"
        row.append(f"{best} / {mean_std_pct(quarter['random']) if quarter else '–'}")
    cells = [c for n in ns for f in FRACTIONS if (c := cell(models, n, f)) is not None]
    row.append(f"{sum(c['algorithm1'] > c['random']['mean'] for c in cells)} of {len(cells)}")
    large = [models[str(n)]["selection"]["all_experts"] - cell(models, n, 0.5)["algorithm1"] for n in ns if n >= 64]
    row.append(f"{100 * max(large):.2f}" if large else "–")
    return row


def markdown(variants: dict, plots: dict[str, str]) -> str:
    """A table with one row per (model, protocol) pair found in the folder."""
    lines = [
        "## The MNIST suite under each model and protocol",
        "",
        "Where the numbers move with the model (`authors`: the authors' code; `definition1`: equation (1) as the "
        "paper writes it) and the protocol (`authors`: the authors' training loop, last epoch; `equal-accuracy`: "
        "the paper's text). Each row is a full run of the suite on the same data with this code.",
        "",
        "| model | protocol | test acc (%) over n | n = 4: best / random k = n/4 | n = 8 | n = 16 | Alg. 1 > random "
        "| worst k = n/2 loss for n >= 64 (points) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(variants):
        lines.append("| " + " | ".join(_row(variants[name])) + " |")
    lines.append(
        f"| paper | | about 97.5 | {PAPER_TABLE1['best'][4]:.2f} / {PAPER_TABLE1['random'][4][0]:.2f} | "
        f"{PAPER_TABLE1['best'][8]:.2f} / {PAPER_TABLE1['random'][8][0]:.2f} | "
        f"{PAPER_TABLE1['best'][16]:.2f} / {PAPER_TABLE1['random'][16][0]:.2f} | every cell but a tie | 'nearly the same' |"
    )
    return "\n".join(lines) + "\n"
