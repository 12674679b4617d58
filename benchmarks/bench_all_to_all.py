"""Share of an expert-parallel Soft MoE training step spent in the all_to_all exchanges.

Launch with torchrun (gloo on CPU, NCCL on GPU); every rank holds num_experts / ranks experts:

    torchrun --nproc_per_node=2 benchmarks/bench_all_to_all.py
    torchrun --nproc_per_node=2 benchmarks/bench_all_to_all.py --dim 512 --experts 16 --batch 64

A training step is: shard the global batch, forward through the sharded layer (slot exchange, local experts, output
exchange), mean squared error, backward (the two reverse exchanges and DDP's all-reduce of phi and scale), Adam
step. Two timings, each the median over ``--steps`` steps started together after a barrier, of the slowest rank:

* plain: the step as training runs it;
* instrumented: the same step with every expert-parallel collective timed on its own, preceded by a barrier so
  that waiting for a slower rank is not counted as communication (the barrier time is reported apart).

The reported share is ``all_to_all seconds / instrumented step seconds`` (without the barriers), per rank and for
the slowest rank; the row-count all_gather that precedes each forward exchange is reported apart. Rank 0 also
times the unsharded layer on the whole global batch in one process (same thread count) for reference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, print_table  # noqa: E402

from softmoe import SoftMoE  # noqa: E402
from softmoe.distributed import LOCAL, record_communication, setup_distributed  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512, help="hidden size of each expert")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--slots", type=int, default=4, help="slots per expert")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="global batch (split across ranks)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results to this JSON file (rank 0)")
    return parser.parse_args(argv)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> None:
    args = parse_args(argv)
    ctx = setup_distributed(expert_parallel=True)
    if not ctx.is_distributed:
        sys.exit("run under torchrun with at least 2 processes: torchrun --nproc_per_node=2 " + sys.argv[0])
    device = ctx.device
    torch.manual_seed(0)
    layer = SoftMoE(args.dim, args.experts, args.slots, expert_hidden=args.hidden)
    reference = SoftMoE(args.dim, args.experts, args.slots, expert_hidden=args.hidden).to(device)
    reference.load_state_dict(layer.state_dict())
    model = ctx.prepare(layer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.tokens, args.dim, generator=g)
    target = torch.randn(args.batch, args.tokens, args.dim, generator=g)
    x_local, target_local = ctx.shard(x, target)

    def step(net, optim, inputs, targets, count, context=ctx) -> None:
        loss = context.global_mean(F.mse_loss(net(inputs), targets, reduction="sum"), count)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()

    def timed_steps(fn, stats=None) -> list[dict]:
        rows = []
        for i in range(args.warmup + args.steps):
            if stats is not None:
                stats.reset()
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                row = {"step": elapsed}
                if stats is not None:
                    row |= {
                        "a2a": stats.all_to_all_seconds,
                        "rows": stats.rows_seconds,
                        "barrier": stats.barrier_seconds,
                        "calls": stats.all_to_all_calls,
                        "bytes": stats.all_to_all_bytes,
                    }
                rows.append(row)
        return rows

    plain = timed_steps(lambda: step(model, optimizer, x_local, target_local, args.batch))
    with record_communication(barrier=True) as stats:
        instrumented = timed_steps(lambda: step(model, optimizer, x_local, target_local, args.batch), stats)

    def median(rows, key):
        return statistics.median(r[key] for r in rows)

    mine = {
        "rank": ctx.rank,
        "plain_step_s": median(plain, "step"),
        "step_s": statistics.median(r["step"] - r["barrier"] for r in instrumented),
        "a2a_s": median(instrumented, "a2a"),
        "rows_s": median(instrumented, "rows"),
        "barrier_s": median(instrumented, "barrier"),
        "a2a_calls": instrumented[0]["calls"],
        "a2a_bytes_sent": instrumented[0]["bytes"],
    }
    mine["a2a_share"] = mine["a2a_s"] / mine["step_s"]
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)

    single = None
    if ctx.is_main:
        ref_optim = torch.optim.Adam(reference.parameters(), lr=1e-4)
        xs, ts = x.to(device), target.to(device)
        times = []
        for i in range(args.warmup + args.steps):
            synchronize(device)
            start = time.perf_counter()
            step(reference, ref_optim, xs, ts, args.batch, LOCAL)
            synchronize(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        single = statistics.median(times)
    ctx.barrier()

    if ctx.is_main:
        env = environment()
        title = f"all_to_all share of an expert-parallel Soft MoE training step ({ctx.world_size} ranks, {ctx.backend})"
        print(f"# {title}")
        print()
        print(
            f"{env.get('cpu', '')} | torch {torch.__version__} | threads per rank {torch.get_num_threads()} | "
            f"dim {args.dim}, experts {args.experts} ({args.experts // ctx.world_size} per rank), slots/expert "
            f"{args.slots}, expert hidden {args.hidden}, tokens {args.tokens}, global batch {args.batch} "
            f"({args.batch // ctx.world_size} per rank), fp32, median of {args.steps} steps"
        )
        print()
        rows = [
            [
                r["rank"],
                f"{1e3 * r['plain_step_s']:.2f}",
                f"{1e3 * r['step_s']:.2f}",
                f"{1e3 * r['a2a_s']:.2f}",
                r["a2a_calls"],
                f"{r['a2a_bytes_sent'] / 2**20:.2f}",
                f"{1e3 * r['rows_s']:.3f}",
                f"{1e3 * r['barrier_s']:.2f}",
                f"{r['a2a_share']:.3f}",
            ]
            for r in everyone
        ]
        print_table(
            [
                "rank",
                "step ms (plain)",
                "step ms (instrumented)",
                "all_to_all ms",
                "calls",
                "MiB sent",
                "row-count all_gather ms",
                "barrier wait ms",
                "all_to_all share",
            ],
            rows,
        )
        slowest = max(everyone, key=lambda r: r["step_s"])
        summary = {
            "world_size": ctx.world_size,
            "a2a_share": slowest["a2a_share"],
            "a2a_share_mean": statistics.mean(r["a2a_share"] for r in everyone),
            "step_ms": 1e3 * slowest["step_s"],
            "plain_step_ms": 1e3 * max(r["plain_step_s"] for r in everyone),
            "single_process_step_ms": 1e3 * single,
            "config": vars(args) | {"json": None},
            "ranks": everyone,
        }
        print()
        print(
            f"all_to_all share of the step (slowest rank): {summary['a2a_share']:.3f} "
            f"(mean over ranks {summary['a2a_share_mean']:.3f}); step {summary['plain_step_ms']:.2f} ms on "
            f"{ctx.world_size} ranks vs {summary['single_process_step_ms']:.2f} ms for the whole batch in one process"
        )
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
    ctx.close()


if __name__ == "__main__":
    main()
