"""The MNIST suite's headline numbers side by side for every (model, protocol) pair run into one results folder.

``softmoe reproduce mnist --model definition1 --protocol equal-accuracy`` writes
``mnist_suite_definition1_equal-accuracy.json`` beside the default ``mnist_suite.json``; this section shows how far
the numbers move with the model and the protocol.
"""

from __future__ import annotations

from softmoe_repro.common import holds, mean_std_pct, num, pct
from softmoe_repro.mnist_suite import PAPER_TABLE1, cell, check_format, tally


def write_plots(variants: dict, out_dir) -> dict[str, str]:
    """No plots: the section is tables (each variant's format checked first)."""
    for results in variants.values():
        check_format(results)
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
    won, total = tally(models)
    row.append(f"{won} of {total}")
    # (an n without a k = n/2 cell, an odd one whose round(n / 2) the sweep's n // 2 misses, is left out)
    large = [
        models[str(n)]["selection"]["all_experts"] - c["algorithm1"]
        for n in ns
        if n >= 64 and (c := cell(models, n, 0.5)) is not None
    ]
    row.append(f"{100 * max(large):.2f}" if large else "–")
    correlations = [c for n in ns if (c := models[str(n)]["diagnostics"]["share_evidence_correlation"]) is not None]
    row.append(f"{min(correlations):.2f} to {max(correlations):.2f}" if correlations else "–")
    return row


def markdown(variants: dict, plots: dict[str, str]) -> str:
    """A table with one row per (model, protocol) pair found in the folder, then per n what separates them."""
    lines = [
        "## The MNIST suite under each model and protocol",
        "",
        "Where the numbers move with the model (`authors`: the authors' code; `definition1`: equation (1) as the "
        "paper writes it; `authors-scale10`: the authors' model with the router's scale starting at 10, a control) "
        "and the protocol (`authors`: the authors' training loop, last epoch; `equal-accuracy`: the paper's text). "
        "Each row is a run of the suite on the same data with this code (its seeds in the last column).",
        "",
        "| model | protocol | test acc (%) over n | n = 4: best / random k = n/4 | n = 8 | n = 16 "
        "| Alg. 1 > random (p < 0.01) | worst k = n/2 loss for n >= 64 (points) | share-evidence correlation over n "
        "| seeds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(variants):
        lines.append("| " + " | ".join([*_row(variants[name]), str(len(variants[name]["seeds"]))]) + " |")
    lines.append(
        f"| paper | | about 97.5 | {PAPER_TABLE1['best'][4]:.2f} / {PAPER_TABLE1['random'][4][0]:.2f} | "
        f"{PAPER_TABLE1['best'][8]:.2f} / {PAPER_TABLE1['random'][8][0]:.2f} | "
        f"{PAPER_TABLE1['best'][16]:.2f} / {PAPER_TABLE1['random'][16][0]:.2f} | every cell but a tie | "
        "'nearly the same' | – | 1 |"
    )
    names = sorted(variants)
    ns = sorted({int(n) for name in names for n in variants[name]["models"]})
    lines += [
        "",
        "Per n, what separates them: Algorithm 1's lead over random subsets at k = n/4 (n/2 for n = 2), in points "
        "(paired test; * = holds at p < 0.01), the correlation of the combine shares with each expert's evidence for "
        "the true class, and the learned router scale.",
        "",
        "| n | "
        + " | ".join(f"`{variants[name]['model']['name']}` / `{variants[name]['protocol']['name']}`" for name in names)
        + " |",
        "|---|" + "---|" * len(names),
    ]
    for n in ns:
        row = [str(n)]
        for name in names:
            model = variants[name]["models"].get(str(n))
            record = cell(variants[name]["models"], n, 0.25 if n >= 4 else 0.5)
            if model is None or record is None:
                row.append("–")
                continue
            d = model["diagnostics"]
            star = "*" if holds(record["paired"]) else ""
            row.append(
                f"{100 * record['paired']['difference']:+.1f}{star}, r = {num(d['share_evidence_correlation'])}, "
                f"scale {num(d['scale'])}"
            )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"
