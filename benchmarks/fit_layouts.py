"""Fit the fused mixing's inference layout costs (softmoe.tuning.TABLE's "mixing_layout_costs") on this host.

The fused small-expert mixing lays Algorithm 1's kept combine out per call in one of three ways (groups of inputs,
the rows of each expert, each input's experts one at a time), the one a cost model in csrc/bindings.cpp counts
cheapest from the op's ``layout_costs``. This script times every layout, forced, on the paper's MNIST layer (4
tokens, dim 196, relu experts of round(784 / n) hidden units, one slot each) at each n, batch and k = n / f (the kept
experts Algorithm 1 picks from the layer's own routing), round-robin in one process. It then reads which layout the
model picks for a set of costs from the op itself (its output equals that layout's forced output to the bit: the
layouts round differently), so the model is never written twice, and searches the costs (multiplicative steps, one
cost at a time) for the least geometric mean of time(picked) / time(fastest) over the shapes.

Usage::

    python benchmarks/fit_layouts.py                        # this host's best instruction set
    python benchmarks/fit_layouts.py --isa avx2 --json fit.json

It prints the host, each shape's times and picks under TABLE's costs and under the fitted ones, both losses, and the
fitted costs as a TABLE line. Shapes whose layouts give identical bits (the pick cannot be read) are left out and
counted.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cpu_header, environment, measure_interleaved, print_table, write_results  # noqa: E402

from softmoe import SoftMoE  # noqa: E402
from softmoe.kernels import cpu_isa, native_available  # noqa: E402
from softmoe.kernels.build import supported_isas  # noqa: E402
from softmoe.kernels.soft_moe_mixing import LAYOUTS  # noqa: E402
from softmoe.selection import top_k_by_combine  # noqa: E402
from softmoe.tuning import value  # noqa: E402

FORCED = [name for name in LAYOUTS if name != "auto"]
COST_NAMES = ("input_group_moves", "sorted_group", "pair_token", "pair_weight", "row_block", "row_block_products",
              "row", "row_token")
STEPS = (0.25, 0.5, 0.8, 1.25, 2.0, 4.0)


def mixing_inputs(n: int, batch: int, k: int, seed: int) -> tuple:
    """The fused mixing's inputs for the MNIST layer with n experts: x, dispatch, Algorithm 1's kept combine (zero
    outside each input's k experts of largest summed combine weight), weight1, bias1, weight2, bias2."""
    torch.manual_seed(seed)
    layer = SoftMoE(196, n, expert_hidden=max(1, round(784 / n)), activation="relu", normalize="inputs")
    x = torch.randn(batch, 4, 196)
    with torch.no_grad():
        routing = layer.route(x)
        selected = top_k_by_combine(routing.combine, k)
        keep = torch.zeros(batch, n, dtype=torch.bool).scatter_(1, selected, True)
        combine = torch.where(keep[:, None, :], routing.combine.flatten(2), 0.0)
    e = layer.experts
    return (layer.slot_inputs(x).detach(), routing.dispatch.flatten(2).contiguous(), combine.contiguous(),
            e.weight1.detach(), e.bias1.detach(), e.weight2.detach(), e.bias2.detach())


def run(inputs: tuple, layout: str, costs, isa: str) -> torch.Tensor:
    return torch.ops.softmoe.soft_moe_mixing_inference(*inputs, True, None, LAYOUTS[layout], list(costs), isa)


def picked(inputs: tuple, costs, isa: str, forced: dict[str, torch.Tensor]) -> str | None:
    """The layout the model picks under ``costs``: the forced layout whose output it equals to the bit."""
    out = run(inputs, "auto", costs, isa)
    matches = [name for name, want in forced.items() if torch.equal(out, want)]
    return matches[0] if len(matches) == 1 else None


def loss(shapes: list[dict], costs, isa: str) -> tuple[float, float, list[str]]:
    """(geometric mean, max) of time(picked) / time(fastest) over the shapes, and the picks."""
    ratios, picks = [], []
    for shape in shapes:
        name = picked(shape["inputs"], costs, isa, shape["forced"]) or "?"
        times = shape["times"]
        ratios.append(times.get(name, max(times.values())) / min(times.values()))
        picks.append(name)
    return math.exp(sum(map(math.log, ratios)) / len(ratios)), max(ratios), picks


def fit(shapes: list[dict], start, isa: str, passes: int) -> tuple[float, ...]:
    """Coordinate search from ``start``: each cost times each of STEPS, kept where the mean loss falls."""
    best, (best_loss, _, _) = tuple(start), loss(shapes, start, isa)
    for _ in range(passes):
        improved = False
        for i in range(len(best)):
            for step in STEPS:
                trial = tuple(c * step if j == i else c for j, c in enumerate(best))
                trial_loss = loss(shapes, trial, isa)[0]
                if trial_loss < best_loss - 1e-4:
                    best, best_loss, improved = trial, trial_loss, True
        if not improved:
            break
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", help="the kernel variant to fit (default: this host's best)")
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--fractions", type=int, nargs="+", default=[8, 4, 2], help="k = n / f (default 8 4 2)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--passes", type=int, default=4, help="rounds of the coordinate search")
    parser.add_argument("--json", help="write the times and both fits here")
    parser.add_argument("--child-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not native_available():
        parser.exit(2, "fit_layouts.py: softmoe's native kernels are not built on this host\n")
    isa = args.isa or cpu_isa()
    if isa not in supported_isas():
        parser.exit(2, f"fit_layouts.py: --isa must be one of this CPU's {supported_isas()}, got {isa!r}\n")
    print(cpu_header(environment(), "allocator as it comes"))
    table_costs = tuple(value("mixing_layout_costs")[isa])
    shapes, unreadable = [], 0
    for n in args.experts:
        for batch in args.batches:
            for f in args.fractions:
                k = max(1, n // f)
                inputs = mixing_inputs(n, batch, k, seed=n + batch + k)
                with torch.no_grad():
                    forced = {name: run(inputs, name, table_costs, isa) for name in FORCED}
                    if len({tuple(t.flatten().tolist()) for t in forced.values()}) < len(FORCED):
                        unreadable += 1
                        continue
                    stats = measure_interleaved(
                        {name: (lambda name=name, inputs=inputs: run(inputs, name, table_costs, isa)) for name in FORCED},
                        warmup=3, repeats=args.repeats,
                    )
                times = {name: s["median"] for name, s in stats.items()}
                shapes.append({"n": n, "batch": batch, "k": k, "inputs": inputs, "forced": forced, "times": times})
    with torch.no_grad():
        before_mean, before_max, before_picks = loss(shapes, table_costs, isa)
        fitted = fit(shapes, table_costs, isa, args.passes)
        after_mean, after_max, after_picks = loss(shapes, fitted, isa)
    rows = []
    for shape, before, after in zip(shapes, before_picks, after_picks):
        t = shape["times"]
        rows.append([shape["n"], shape["batch"], shape["k"], *(f"{t[name] * 1e6:.0f}" for name in FORCED),
                     min(t, key=t.__getitem__), before, after])
    print_table(["n", "batch", "k", *(f"{name} (µs)" for name in FORCED), "fastest", "TABLE picks", "fit picks"],
                rows)
    print(f"\n{len(shapes)} shapes ({unreadable} left out: layouts with identical bits); time(picked) / "
          f"time(fastest): TABLE's costs mean {before_mean:.3f}, max {before_max:.2f}; fitted mean {after_mean:.3f}, "
          f"max {after_max:.2f}")
    print(f'fitted "{isa}": ({", ".join(f"{c:.3g}" for c in fitted)}),  # {", ".join(COST_NAMES)}')
    write_results(args, {
        "isa": isa, "table_costs": table_costs, "fitted_costs": fitted,
        "loss": {"table": [before_mean, before_max], "fitted": [after_mean, after_max]},
        "shapes": [{key: s[key] for key in ("n", "batch", "k", "times")} for s in shapes],
    })


if __name__ == "__main__":
    main()
