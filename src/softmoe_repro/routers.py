"""The router study at small scale: the six routers of "Routers in Vision Mixture of Experts" head to head.

One small patch-token vision model, identical for every router except the router itself, trained with each router at
capacity factor c in {1, 2} on Fashion-MNIST (or the user's data), with the same recipe, seed and data order, and
the same expert compute per image (see :data:`COMPUTE_BUDGET`). The paper's Tables 1 and 4 (B/32) are shown beside
our numbers, with the paper's findings checked one by one.

API (as every experiment module): ``run(preset, dataset, out_dir, progress) -> dict`` (written as ``routers.json``),
``write_plots(results, out_dir) -> {name: path}`` and ``markdown(results, plots) -> str``.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from softmoe.checkpoint import write_json
from softmoe.data import Splits, load_dataset
from softmoe.distributed import LOCAL, DistContext
from softmoe.models.patches import patchify
from softmoe.routing import ROUTERS, MoELayer, make_router
from softmoe.train import TrainConfig, train_classifier
from softmoe_repro.common import (
    default_vision_dataset,
    pct,
    pick_preset,
)

log = logging.getLogger(__name__)

COMPUTE_BUDGET = (
    "Same compute budget: every router sends c x (tokens per image) token-sized rows per image through the experts "
    "(Token Choice: k = c experts per token with C = round(c T / E); Expert Choice: C = round(c T / E) tokens per "
    "expert; Soft MoE: round(c T_image / E) slots per expert), every expert is the same MLP, and the rest of the model "
    "is identical."
)


@dataclass(frozen=True)
class ModelConfig:
    """The vision model: patches -> linear embedding + positions -> `blocks` pre-LN blocks (attention + MLP) where
    the last block's MLP is the MoE layer (the 'Every-2'/last-layer placement of V-MoE at our depth) -> LayerNorm ->
    mean over tokens -> linear head."""

    grid: tuple[int, int] = (4, 4)
    dim: int = 64
    heads: int = 4
    blocks: int = 2
    num_experts: int = 8
    expert_hidden: int = 128
    group_images: int = 32


@dataclass(frozen=True)
class RoutersPreset:
    """Everything that defines one run of the experiment.

    ``repeat`` names one (router, c) trained again with each of ``repeat_seeds`` (initialization and data order) to
    measure the run-to-run spread that every difference in the table has to beat. ``threads`` sets torch's thread
    count for the run (restored afterwards); None leaves it as it is. The default is 1: the tensors are tiny
    (128 images x 16 tokens x 64 features), so intra-op parallelism gains little, while on a machine shared with
    other jobs two OpenMP threads made a training step much slower than one thread.
    """

    name: str
    dataset: str | None = None  # None: fashion-mnist when installed, else mnist5k
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=2, batch_size=128))
    model: ModelConfig = field(default_factory=ModelConfig)
    routers: tuple[str, ...] = tuple(ROUTERS)
    capacity_factors: tuple[int, ...] = (1, 2)
    dense_baseline: bool = True
    repeat: tuple[str, int] | None = ("softmax_expert_choice", 1)
    repeat_seeds: tuple[int, ...] = (1, 2)
    limit_train: int | None = None
    limit_eval: int | None = None
    timing_steps: int = 10
    stats_examples: int = 2048
    threads: int | None = 1


PRESETS = {
    "default": RoutersPreset("default"),
    # Five times the training of the default, for tighter comparisons.
    "paper": RoutersPreset("paper", train=TrainConfig(epochs=10, batch_size=128)),
    "smoke": RoutersPreset(
        "smoke",
        dataset="digits",
        train=TrainConfig(epochs=1, batch_size=64),
        model=ModelConfig(grid=(4, 4), dim=16, heads=2, blocks=2, num_experts=4, expert_hidden=32, group_images=16),
        repeat=None,
        limit_train=256,
        limit_eval=128,
        timing_steps=1,
        stats_examples=128,
        threads=1,
    ),
}

# The paper's B/32 numbers (Appendix B): JFT-300M precision@1 and TPUv3-days (Table 1), ImageNet 10-shot (Table 4).
PAPER_B32 = {
    ("softmax_token_choice", 1): (41.23, 34.31, 62.77),
    ("sinkhorn_token_choice", 1): (41.63, 34.73, 63.42),
    ("softmax_expert_choice", 1): (43.83, 33.73, 64.99),
    ("sinkhorn_expert_choice", 1): (43.65, 34.40, 65.34),
    ("sparsity_constrained_expert_choice", 1): (43.43, 56.88, 64.50),
    ("soft_moe", 1): (45.23, 36.95, 67.37),
    ("softmax_token_choice", 2): (43.47, 41.46, 65.91),
    ("sinkhorn_token_choice", 2): (44.26, 41.88, 65.87),
    ("softmax_expert_choice", 2): (44.40, 40.60, 66.38),
    ("sinkhorn_expert_choice", 2): (44.30, 41.21, 66.52),
    ("sparsity_constrained_expert_choice", 2): (44.30, 65.13, 65.75),
    ("soft_moe", 2): (45.28, 43.59, 67.85),
}
TOKEN_CHOICE = ("softmax_token_choice", "sinkhorn_token_choice")
EXPERT_CHOICE = ("softmax_expert_choice", "sinkhorn_expert_choice", "sparsity_constrained_expert_choice")


class Block(nn.Module):
    """Pre-LN transformer block: x + attention(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, dim: int, heads: int, mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class DenseMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class RouterClassifier(nn.Module):
    """images (batch, channels, H, W) -> logits; the last block's MLP is an MoE layer with ``router`` (or a dense MLP
    with the expert's hidden size when ``router`` is None).

    After a training forward, ``auxiliary_loss`` holds the weighted auxiliary loss of the MoE layer (a scalar tensor,
    None in eval mode or without one); ``softmoe.train`` adds it to the training loss.
    """

    def __init__(
        self,
        image_shape: tuple[int, int, int],
        num_classes: int,
        router: str | None,
        capacity_factor: int = 1,
        config: ModelConfig = ModelConfig(),
    ) -> None:
        super().__init__()
        channels, height, width = image_shape
        rows, cols = config.grid
        if height % rows or width % cols:
            raise ValueError(f"a {rows}x{cols} patch grid must divide the image size {height}x{width}")
        self.config, self.grid = config, config.grid
        self.tokens = rows * cols
        patch = channels * (height // rows) * (width // cols)
        d = config.dim
        self.embed = nn.Linear(patch, d)
        self.pos = nn.Parameter(torch.randn(1, self.tokens, d) * 0.02)
        mlps: list[nn.Module] = [DenseMLP(d, config.expert_hidden) for _ in range(config.blocks - 1)]
        if router is None:
            mlps.append(DenseMLP(d, config.expert_hidden))
        else:
            r = make_router(router, d, config.num_experts, capacity_factor, tokens_per_image=self.tokens)
            mlps.append(MoELayer(d, r, config.expert_hidden, group_size=config.group_images))
        self.blocks = nn.ModuleList(Block(d, config.heads, mlp) for mlp in mlps)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, num_classes)
        self.auxiliary_loss: torch.Tensor | None = None

    @property
    def moe(self) -> MoELayer | None:
        """The MoE layer (the last block's MLP), or None for the dense baseline."""
        mlp = self.blocks[-1].mlp
        return mlp if isinstance(mlp, MoELayer) else None

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.embed(patchify(images, self.grid)) + self.pos
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(dim=1))
        moe = self.moe
        training = self.training and torch.is_grad_enabled()
        self.auxiliary_loss = (
            moe.auxiliary_loss if moe is not None and training and moe.auxiliary_loss.requires_grad else None
        )
        return logits


def run_key(router: str | None, c: int) -> str:
    return "dense" if router is None else f"{router}_c{c}"


def label(router: str | None, c: int) -> str:
    if router is None:
        return "Dense (no MoE)"
    if router.endswith("token_choice"):
        return f"{ROUTERS[router]} (k = {c})"
    return f"{ROUTERS[router]} (c = {c})"


@torch.no_grad()
def routing_stats(model: RouterClassifier, images: torch.Tensor, batch_size: int) -> dict:
    """Mean fraction of tokens dropped (in no buffer) and of buffer slots filled, in eval mode, for sparse routers.

    The layer's ``last_stats`` are 0-dim float64 tensors: they are summed on the device, batch after batch, and read
    back once at the end (the same float64 additions, in the same order, as summing Python floats)."""
    if model.moe is None:
        return {}
    model.eval()
    # Python floats until the first batch with statistics, then 0-dim tensors
    dropped: float | torch.Tensor = 0.0
    fill: float | torch.Tensor = 0.0
    n = 0
    for start in range(0, len(images), batch_size):
        model(images[start : start + batch_size])
        if model.moe.last_stats:
            dropped = dropped + model.moe.last_stats["dropped"]
            fill = fill + model.moe.last_stats["fill"]
            n += 1
    return {"dropped": float(dropped) / n, "fill": float(fill) / n} if n else {}


def step_milliseconds(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int) -> tuple[float, float]:
    """Median wall and CPU (process) time in ms of a forward + backward pass on one training batch, after up to two
    warm-up passes. The CPU time counts every thread of the process; with one thread it is nearly independent of
    other jobs on the machine, the wall time is not."""
    model.train()
    walls, cpus = [], []
    warmup = min(2, steps)
    for i in range(steps + warmup):
        wall, cpu = time.perf_counter(), time.process_time()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= warmup:
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
    return 1000 * statistics.median(walls), 1000 * statistics.median(cpus)


def _resolve(preset: RoutersPreset | str, dataset: str | None) -> RoutersPreset:
    preset = pick_preset(PRESETS, preset)
    return preset if dataset is None else replace(preset, dataset=dataset)


def _train_one(
    preset: RoutersPreset,
    splits: Splits,
    router: str | None,
    c: int,
    seed: int,
    run_dir: Path,
    progress: bool,
    dist: DistContext = LOCAL,
) -> dict | None:
    """Train one model (resuming finished epochs in ``run_dir``) and measure it (rank 0 only: None elsewhere)."""
    image_shape, num_classes = splits.train.image_shape, splits.train.num_classes

    def factory() -> RouterClassifier:
        return RouterClassifier(image_shape, num_classes, router, c, preset.model)

    config = replace(preset.train, seed=seed)
    cpu = time.process_time()
    model, history = train_classifier(factory, splits, config, run_dir, progress, run_dir.name, dist=dist)
    cpu = time.process_time() - cpu
    if not dist.is_main:
        return None
    history = [{k: v for k, v in epoch.items() if k != "config"} for epoch in history]  # resumed epochs carry it
    batch = min(preset.train.batch_size, len(splits.train))
    timing_model = factory()
    timing_model.load_state_dict(model.state_dict())
    step_ms, step_cpu_ms = step_milliseconds(
        timing_model, splits.train.images[:batch], splits.train.labels[:batch], preset.timing_steps
    )
    stats = routing_stats(model, splits.test.images[: preset.stats_examples], preset.train.batch_size)
    moe = model.moe
    capacity = getattr(moe.router, "capacity", None) if moe is not None else None
    return {
        "router": router,
        "label": label(router, c),
        "capacity_factor": c,
        "seed": seed,
        "capacity_per_group": capacity(preset.model.group_images * model.tokens) if capacity else None,
        "slots_per_expert": getattr(moe.router, "slots_per_expert", None) if moe is not None else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "router_parameters": sum(p.numel() for p in moe.router.parameters()) if moe is not None else 0,
        "final_val_accuracy": history[-1]["val_accuracy"],
        "final_test_accuracy": history[-1]["test_accuracy"],
        "best_val_accuracy": max(e["val_accuracy"] for e in history),
        "train_seconds": sum(e["seconds"] for e in history),
        # CPU time of this call (a resumed run only counts the epochs trained now).
        "train_cpu_seconds": cpu,
        "step_ms": step_ms,
        "step_cpu_ms": step_cpu_ms,
        "test_dropped_fraction": stats.get("dropped"),
        "test_fill_fraction": stats.get("fill"),
        "history": history,
    }


def run(
    preset: RoutersPreset | str = "default",
    dataset: str | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
    dist: DistContext | None = None,
) -> dict | None:
    """Train the model with every router at every c (resuming finished epochs in ``out_dir/runs/routers``), measure
    accuracy, training time, step time and token dropping; write ``out_dir/routers.json`` when ``out_dir`` is given.

    Under torchrun pass ``dist=softmoe.distributed.setup_distributed()``: every rank trains data parallel
    (``softmoe.train.train_classifier``), then rank 0 alone measures and writes; the other ranks return None.
    """
    dist = dist or LOCAL
    preset = _resolve(preset, dataset)
    previous_threads = torch.get_num_threads()
    if preset.threads is not None:
        torch.set_num_threads(preset.threads)
    try:
        return _run(preset, out_dir, progress, dist)
    finally:
        torch.set_num_threads(previous_threads)


def _run(preset: RoutersPreset, out_dir: str | Path | None, progress: bool, dist: DistContext = LOCAL) -> dict | None:
    started, started_cpu = time.perf_counter(), time.process_time()
    notice = None
    name = preset.dataset
    if name is None:
        name, notice = default_vision_dataset()
        if notice and dist.is_main:
            log.warning(notice)
    splits = load_dataset(name).limit(preset.limit_train, preset.limit_eval, preset.limit_eval)
    seed = preset.train.seed
    jobs: list[tuple[str | None, int, int]] = [(r, c, seed) for c in preset.capacity_factors for r in preset.routers]
    if preset.dense_baseline:
        jobs.append((None, 1, seed))
    if preset.repeat is not None:
        jobs += [(preset.repeat[0], preset.repeat[1], s) for s in preset.repeat_seeds if s != seed]
    runs, repeats = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(out_dir) / "runs" / "routers" if out_dir is not None else Path(scratch)
        for router, c, job_seed in tqdm(jobs, desc="routers", disable=not progress or not dist.is_main):
            key = run_key(router, c)
            if job_seed == seed:
                runs[key] = _train_one(preset, splits, router, c, job_seed, root / key, progress, dist)
            else:
                key = f"{key}_seed{job_seed}"
                repeats[key] = _train_one(preset, splits, router, c, job_seed, root / key, progress, dist)
    if not dist.is_main:
        return None
    results = {
        "preset": {**asdict(preset), "train": asdict(preset.train), "model": asdict(preset.model)},
        "data": {
            "name": name,
            "notice": notice,
            "train": len(splits.train),
            "val": len(splits.val),
            "test": len(splits.test),
            "image_shape": list(splits.train.image_shape),
        },
        "tokens_per_image": preset.model.grid[0] * preset.model.grid[1],
        "compute_budget": COMPUTE_BUDGET,
        "runs": runs,
        "repeats": repeats,
        "seed_spread": seed_spread(runs, repeats, preset),
        "threads": torch.get_num_threads(),
        "total_seconds": time.perf_counter() - started,
        "total_cpu_seconds": time.process_time() - started_cpu,
    }
    if out_dir is not None:
        write_json(Path(out_dir) / "routers.json", results)
    return results


def seed_spread(runs: dict, repeats: dict, preset: RoutersPreset) -> dict | None:
    """Test accuracies of the repeated (router, c) over its seeds and their sample std (None without repeats)."""
    if preset.repeat is None or not repeats:
        return None
    key = run_key(*preset.repeat)
    accuracies = [runs[key]["final_test_accuracy"]] + [r["final_test_accuracy"] for r in repeats.values()]
    return {
        "run": key,
        "label": label(*preset.repeat),
        "seeds": [preset.train.seed] + [r["seed"] for r in repeats.values()],
        "test_accuracies": accuracies,
        "std": statistics.stdev(accuracies) if len(accuracies) > 1 else None,
    }


def _runs_at(results: dict, c: int) -> dict[str, dict]:
    return {r["router"]: r for r in results["runs"].values() if r["router"] is not None and r["capacity_factor"] == c}


def write_plots(results: dict, out_dir: str | Path) -> dict[str, str]:
    """Accuracy against training time per router (the paper's Figure 1 layout) and validation curves, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    markers = {
        "softmax_token_choice": "x",
        "sinkhorn_token_choice": "P",
        "softmax_expert_choice": "s",
        "sinkhorn_expert_choice": "o",
        "sparsity_constrained_expert_choice": "^",
        "soft_moe": "*",
    }
    colors = {name: f"C{i}" for i, name in enumerate([*ROUTERS, None])}
    paths = {}
    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for run in results["runs"].values():
        router = run["router"]
        size = 60 if run["capacity_factor"] == 1 else 160
        ax.scatter(
            run["train_cpu_seconds"],
            100 * run["final_test_accuracy"],
            s=size,
            color=colors.get(router, "k"),
            marker=markers.get(router, "D"),
            label=run["label"],
            alpha=0.8,
        )
    spread = results.get("seed_spread")
    if spread and spread.get("std") is not None:
        ax.text(
            0.01, 0.02, f"seed std of one router: {100 * spread['std']:.2f} points", transform=ax.transAxes, fontsize=8
        )
    ax.set_xlabel("training CPU time (s, this machine)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"Routers head to head on {results['data']['name']} (small markers c = 1, large c = 2)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    paths["routers"] = str(out_dir / "fig_routers_accuracy_vs_time.png")
    fig.savefig(paths["routers"], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(9.5, 4.8))
    for run in results["runs"].values():
        history = run["history"]
        style = "-" if run["capacity_factor"] == 1 else "--"
        ax.plot(
            [e["epoch"] for e in history],
            [100 * e["val_accuracy"] for e in history],
            style,
            color=colors.get(run["router"], "k"),
            marker="o",
            ms=3,
            label=run["label"],
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation accuracy (%)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths["routers_training"] = str(out_dir / "fig_routers_training_curves.png")
    fig.savefig(paths["routers_training"], dpi=120)
    plt.close(fig)
    return paths


def _noise(results: dict) -> float | None:
    """The smallest difference between two single runs that we call clear: 2 x sqrt(2) x the seed std (a two-sigma
    band for the difference of two runs), or None when no spread was measured."""
    spread = results.get("seed_spread")
    return None if not spread or spread.get("std") is None else 2 * 2**0.5 * spread["std"]


def _verdict(diff: float, noise: float | None) -> str:
    if noise is not None and abs(diff) <= noise:
        return "within the seed noise"
    if diff == 0:
        return "a tie"
    return "reproduces" if diff > 0 else "the opposite of the paper"


def findings(results: dict) -> list[str]:
    """The paper's claims, each checked on our numbers (computed, not written by hand)."""
    out = []
    noise = _noise(results)
    spread = results.get("seed_spread")
    if spread and spread.get("std") is not None:
        assert noise is not None  # measured from this spread
        out.append(
            f"Run-to-run spread: {spread['label']} over seeds {spread['seeds']} gave "
            f"{', '.join(pct(a) for a in spread['test_accuracies'])}% (std {100 * spread['std']:.2f} points), so "
            f"differences below {100 * noise:.2f} points between two single runs are called within the seed noise."
        )
    for c in sorted({r["capacity_factor"] for r in results["runs"].values() if r["router"] is not None}):
        runs = _runs_at(results, c)
        acc = {r: runs[r]["final_test_accuracy"] for r in runs}
        tc = [r for r in TOKEN_CHOICE if r in acc]
        ec = [r for r in EXPERT_CHOICE if r in acc]
        if tc and ec:
            wins = sum(acc[e] > acc[t] for e in ec for t in tc)
            mean_ec = statistics.fmean(acc[e] for e in ec)
            mean_tc = statistics.fmean(acc[t] for t in tc)
            out.append(
                f"c = {c}: Expert Choice beats Token Choice in {wins} of {len(ec) * len(tc)} pairs; mean "
                f"{pct(mean_ec)}% vs {pct(mean_tc)}% ({100 * (mean_ec - mean_tc):+.2f} points): "
                f"{_verdict(mean_ec - mean_tc, noise)} (the paper: Expert Choice generally better, by about 2 points "
                "at c = 1 and 0.5 at c = 2 on JFT B/32)."
            )
        if "soft_moe" in acc and len(acc) > 1:
            sparse = {r: a for r, a in acc.items() if r != "soft_moe"}
            best = max(sparse, key=lambda r: sparse[r])
            beaten = sum(acc["soft_moe"] > a for a in sparse.values())
            diff = acc["soft_moe"] - sparse[best]
            out.append(
                f"c = {c}: Soft MoE {pct(acc['soft_moe'])}% beats {beaten} of {len(sparse)} sparse routers; the best "
                f"sparse one is {ROUTERS[best]} at {pct(sparse[best])}% ({100 * diff:+.2f} points): "
                f"{_verdict(diff, noise)} (the paper: Soft MoE beats every sparse router, by 1.4 points at c = 1 and "
                "0.9 at c = 2 on JFT B/32)."
            )
        if set(TOKEN_CHOICE) <= set(acc):
            diff = acc["sinkhorn_token_choice"] - acc["softmax_token_choice"]
            out.append(
                f"c = {c}: Sinkhorn Token Choice vs Softmax Token Choice: {100 * diff:+.2f} points: "
                f"{_verdict(diff, noise)} (the paper: Sinkhorn usually better among Token Choice routers, by 0.4 to "
                "0.8 points on JFT B/32)."
            )
        if "sparsity_constrained_expert_choice" in runs and "softmax_expert_choice" in runs:
            ratio = (
                runs["sparsity_constrained_expert_choice"]["step_cpu_ms"] / runs["softmax_expert_choice"]["step_cpu_ms"]
            )
            paper = PAPER_B32[("sparsity_constrained_expert_choice", c)][1] / PAPER_B32[("softmax_expert_choice", c)][1]
            out.append(
                f"c = {c}: a sparsity-constrained step costs {ratio:.2f}x a Softmax Expert Choice step (the paper: "
                f"{paper:.2f}x the training time on B/32, the most expensive router)."
            )
    dense = results["runs"].get("dense")
    if dense is not None:
        moe = [r for r in results["runs"].values() if r["router"] is not None]
        better = sum(r["final_test_accuracy"] > dense["final_test_accuracy"] for r in moe)
        out.append(
            "Dense baseline (the same model with a dense MLP of the expert's size): "
            f"{pct(dense['final_test_accuracy'])}%; {better} of {len(moe)} MoE runs beat it (not in the paper's "
            "tables; it shows whether the MoE layer helps at all at this scale)."
        )
    return out


def markdown(results: dict, plots: dict[str, str]) -> str:
    """The report section: our table beside the paper's B/32 tables, the findings checked, and the caveats."""
    data, preset = results["data"], results["preset"]
    model, train = preset["model"], preset["train"]
    tokens = results.get("tokens_per_image")
    lines = [
        '## Routers head to head ("Routers in Vision Mixture of Experts"; paper columns: B/32, Tables 1 and 4)',
        "",
        f"Data: `{data['name']}` ({data['train']:,} train / {data['val']:,} validation / {data['test']:,} test)"
        + (f". Note: {data['notice']}." if data.get("notice") else "."),
        f"Model (same for every router): {model['grid'][0]}x{model['grid'][1]} patches ({tokens} tokens per image) -> "
        f"linear embedding to d = {model['dim']} + positions -> {model['blocks']} pre-LN blocks (attention with "
        f"{model['heads']} heads + MLP), the MLP of the last block replaced by the MoE layer "
        f"({model['num_experts']} experts, each a GELU MLP {model['dim']} -> {model['expert_hidden']} -> "
        f"{model['dim']}) -> LayerNorm -> mean over tokens -> linear head. Sparse routers route groups of "
        f"{model['group_images']} images ({model['group_images'] * (tokens or 0)} tokens) in training and evaluation; "
        "Soft MoE routes each image alone. Softmax Token Choice trains with the importance and load losses "
        "(weights 0.005 each); as in vmoe, the Softmax and Sinkhorn routers (Token and Expert Choice) add Gaussian "
        "noise of std 1/E to their logits in training, the sparsity-constrained router and Soft MoE none; ties in "
        "every top-k go to the lowest index and capacities follow vmoe's compute_capacity.",
        f"Recipe: Adam, lr {train['lr']}, batch {train['batch_size']}, {train['epochs']} epochs, seed {train['seed']}, "
        f"one run per router. {results['compute_budget']}",
        "",
        "| router | C per group (slots/expert) | test acc (%) | best val (%) | tokens dropped (%) | train wall (s) | "
        "train CPU (s) | CPU ms/step | paper B/32 JFT (%) | paper TPUv3-days | paper B/32 10-shot (%) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in results["runs"].values():
        router, c = run["router"], run["capacity_factor"]
        paper = PAPER_B32.get((router, c), (None, None, None))
        cap = (
            run["capacity_per_group"]
            if run["capacity_per_group"] is not None
            else (f"{run['slots_per_expert']} per image" if run["slots_per_expert"] else "–")
        )
        lines.append(
            f"| {run['label']} | {cap} | {pct(run['final_test_accuracy'])} | {pct(run['best_val_accuracy'])} | "
            f"{pct(run['test_dropped_fraction'])} | {run['train_seconds']:.1f} | {run['train_cpu_seconds']:.1f} | "
            f"{run['step_cpu_ms']:.1f} | " + " | ".join("–" if v is None else f"{v:.2f}" for v in paper) + " |"
        )
    lines += [
        "",
        f"Train wall: the sum of the epochs' wall-clock seconds (each includes one evaluation pass); train CPU: the "
        f"process CPU time of training; CPU ms/step: median CPU time of a forward + backward pass on one training "
        f"batch. {results['threads']} torch thread(s); with one thread the CPU times hardly depend on other jobs on "
        f"the machine, the wall times do. The whole experiment took {results['total_seconds'] / 60:.1f} minutes of "
        f"wall time and {results.get('total_cpu_seconds', float('nan')) / 60:.1f} minutes of CPU time.",
        "",
    ]
    if "routers" in plots:
        lines += [f"![accuracy against training time]({Path(plots['routers']).name})", ""]
    if "routers_training" in plots:
        lines += [f"![validation curves]({Path(plots['routers_training']).name})", ""]
    lines += ["### What reproduces at this scale", ""]
    if preset["name"] == "smoke":
        lines += ["- Smoke run: a few training steps on a few hundred digits; the accuracies below mean nothing.", ""]
    lines += [f"- {finding}" for finding in findings(results)]
    lines += [
        "- Scale: the paper trains ViT-B/32 to L/16 with 32 experts on 300M JFT images for 34 to 1,500 TPUv3-days; "
        "here a two-block model with a handful of experts trains for minutes on a CPU. Accuracy differences between "
        "routers of a few tenths of a point are within the run-to-run spread of a single seed at this scale (see the "
        "measured spread above) and should not be read as a ranking.",
        "- Token dropping: Token Choice drops tokens when experts overflow (the column 'tokens dropped' at test time); "
        "Expert Choice leaves some tokens unprocessed by design; Soft MoE drops none. The MoE layer sits in a "
        "residual block, so a dropped token keeps its attention output.",
    ]
    return "\n".join(lines) + "\n"
