"""Table 3 of "Beyond Parameter Count": the latency of Algorithm 1 through the 6 Soft MoE layers of a ViT-B/16.

The paper's model has, in its last 6 blocks, Soft MoE layers of 8 experts with hidden size 768 * 40 (2.27B expert
parameters); it times a forward pass of random data through those 6 layers with k in {n, 3n/4, n/2, n/4} experts
chosen per input by Algorithm 1, at batch 1 and 100 on a GPU. The paper's code computed every expert and
zeroed the unselected outputs, so it could not really skip work; softmoe does not run unselected experts at all.

This module holds the model, the work accounting and the report section; ``benchmarks/bench_latency.py`` times
it and writes ``latency.json`` (which ``softmoe report`` renders when it sits in a results folder).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from softmoe.layer import SoftMoE
from softmoe.selection import select_experts, top_k_by_combine

PAPER_MS = {
    1: {8: (21.50, 0.20), 6: (19.46, 0.23), 4: (14.75, 0.35), 2: (9.96, 0.19)},
    100: {8: (99.03, 0.28), 6: (78.26, 0.51), 4: (78.86, 0.36), 2: (51.69, 0.79)},
}
PRESETS = {
    "paper": {"hidden": 768 * 40, "warmup": 2, "repeats": 8},
    "small": {"hidden": 768 * 8, "warmup": 2, "repeats": 6},
}
DIM, TOKENS, EXPERTS, LAYERS = 768, 197, 8, 6
TARGET_SPEEDUP = {1: 3.0, 100: 2.5}


class MoEStack(nn.Module):
    """The 6 Soft MoE layers of the model (197 tokens of dim 768, 8 experts, one slot each, gelu_tanh experts),
    each applied with a residual connection: (batch, 197, 768) -> same. ``layers``: fewer of them (one for a
    per-layer measurement)."""

    def __init__(self, hidden: int, layers: int = LAYERS) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            SoftMoE(DIM, EXPERTS, expert_hidden=hidden, activation="gelu_tanh") for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def experts_used(stack: MoEStack, x: torch.Tensor, k: int) -> list[int]:
    """How many distinct experts each layer runs for this batch under Algorithm 1 with k experts per input: the
    experts it selects (``top_k_by_combine`` of each layer's combine weights on the input it receives)."""
    used: list[int] = []

    def count(layer: SoftMoE, args: tuple) -> None:
        selected = top_k_by_combine(layer.route(args[0]).combine, k)
        used.append(int(selected.unique().numel()))

    handles = [layer.register_forward_pre_hook(count) for layer in stack.layers]
    try:
        with torch.no_grad(), select_experts(stack, k=k, plan="selected"):
            stack(x)
    finally:
        for handle in handles:
            handle.remove()
    return used


def work(batch: int, k: int, hidden: int, used: list[int], itemsize: int = 4) -> tuple[float, float]:
    """FLOPs and compulsory bytes of one forward through the stack with k of n experts per input.

    FLOPs: routing logits of all slots, the dispatch and combine of the kept slots, the kept experts' MLPs.
    Bytes: the weights (``itemsize`` bytes per element: 4 for fp32) of every expert that at least one input uses
    (read once), input and output.
    """
    expert_flops = 2 * 2 * DIM * hidden
    per_layer_flops = 2 * batch * TOKENS * DIM * EXPERTS + 2 * 2 * batch * TOKENS * k * DIM + batch * k * expert_flops
    expert_bytes = itemsize * (2 * DIM * hidden + hidden + DIM)
    activation_bytes = itemsize * 2 * batch * TOKENS * DIM
    return LAYERS * per_layer_flops, sum(u * expert_bytes for u in used) + LAYERS * activation_bytes


def write_plots(results: dict, out_dir: str | Path) -> dict[str, str]:
    """Speed-up over k = n against k, ours and the paper's, for each batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for batch, color in zip(results["batches"], ("tab:blue", "tab:orange", "tab:green")):
        entries = results["batches"][batch]
        ks = sorted((int(k) for k in entries), reverse=True)
        ax.plot(ks, [entries[str(k)]["speedup_vs_all"] for k in ks], "-o", color=color, label=f"ours, batch {batch}")
        paper = PAPER_MS.get(int(batch))
        if paper:
            ax.plot(
                ks,
                [paper[EXPERTS][0] / paper[k][0] for k in ks],
                "--s",
                color=color,
                alpha=0.6,
                label=f"paper (2080 Ti), batch {batch}",
            )
    ax.plot([8, 2], [1, 4], ":", color="gray", label="ideal n/k")
    ax.invert_xaxis()
    ax.set_xlabel("experts kept per input, k (of n = 8)")
    ax.set_ylabel("speed-up over k = n")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = str(Path(out_dir) / "fig_latency_speedup.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return {"speedup": path}


def markdown(results: dict, plots: dict[str, str]) -> str:
    """The Table 3 section: our latencies and speed-ups beside the paper's."""
    env, limits = results["environment"], results["limits"]
    lines = [
        "## Faster inference with Algorithm 1 (section 4.5, Table 3)",
        "",
        f"The 6 Soft MoE layers of a ViT-B/16 with {EXPERTS} experts of hidden size {results['hidden']:,} "
        f"({results['parameters'] / 1e9:.2f}B parameters, {results['expert_parameters'] / 1e9:.2f}B in experts; "
        f"preset `{results['preset']}`), random input, fp32 on {env['cpu']} ({env['torch_threads']} threads), "
        f"{env['date']}; measured peak {limits['flops_per_s'] / 1e9:.0f} GFLOP/s and bandwidth "
        f"{limits['bytes_per_s'] / 1e9:.1f} GB/s in the same run. Unselected experts are not computed; the paper's "
        "code computed them all and zeroed their outputs.",
        "",
        "| batch | k | ours ms (median ± std) | speed-up vs k = n | x roofline of the kept work "
        "| paper ms (RTX 2080 Ti) | paper speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for batch, entries in results["batches"].items():
        for k in sorted((int(k) for k in entries), reverse=True):
            e = entries[str(k)]
            paper = PAPER_MS.get(int(batch), {}).get(k)
            paper_ms = f"{paper[0]:.2f} ± {paper[1]:.2f}" if paper else "–"
            paper_speedup = f"{PAPER_MS[int(batch)][EXPERTS][0] / paper[0]:.2f}x" if paper else "–"
            lines.append(
                f"| {batch} | {k} | {e['median_ms']:.1f} ± {e['std_ms']:.1f} | {e['speedup_vs_all']:.2f}x | "
                f"{e['x_roofline']:.2f} | {paper_ms} | {paper_speedup} |"
            )
    lines.append("")
    for batch, entries in results["batches"].items():
        full = entries[str(EXPERTS)]
        if "batched_ms" in full:
            lines.append(
                f"- k = n at batch {batch}: the plain forward (experts in batched matmuls) took "
                f"{full['batched_ms']:.1f} ms, every expert through the selection path (one call per expert) "
                f"{full['grouped_ms']:.1f} ms; the faster of the two is the baseline of the speed-ups."
            )
    lines += ["", f"![speed-up against k]({Path(plots['speedup']).name})", ""]
    for batch, entries in results["batches"].items():
        quarter = entries[str(EXPERTS // 4)]["speedup_vs_all"]
        target = TARGET_SPEEDUP.get(int(batch))
        paper_batch = PAPER_MS.get(int(batch))
        text = f"- Batch {batch}: k = n/4 runs {quarter:.2f}x faster than k = n"
        if paper_batch:
            text += f" (the paper: {paper_batch[EXPERTS][0] / paper_batch[2][0]:.2f}x"
            text += f"; our target {target}x: {'met' if quarter >= target else 'NOT met'})" if target else ")"
        lines.append(text + ".")
    return "\n".join(lines) + "\n"
