"""Table 3 of "Beyond Parameter Count" on this machine: latency of Algorithm 1 through 6 Soft MoE layers.

Smaller k use ``softmoe.select_experts(strategy="combine")``, which does not run unselected experts. k = n is
timed both as the plain forward (all experts in batched matmuls) and through the selection path with every
expert kept (``softmoe::grouped_mm``: one product per expert); the faster of the two is the baseline
of the speed-ups, so they measure skipped work, not a kernel difference. All configurations are timed
round-robin in the same run after warm-up; the table gives the median and std in ms, the speed-up over k = n,
and the time as a multiple of the roofline of the kept work (see ``softmoe_repro.latency.work``) with peak
FLOP/s and bandwidth measured in this run.

    python benchmarks/bench_latency.py                 # paper-size experts (9 GB of fp32 weights), a few minutes
    python benchmarks/bench_latency.py --preset small  # hidden 768 * 8, about a minute
    python benchmarks/bench_latency.py --json results/mnist5k/latency.json   # joins that folder's report
    python benchmarks/bench_latency.py --device cuda --dtype bfloat16         # on a GPU (the paper timed one)
    python benchmarks/bench_latency.py --device cuda --dtype bfloat16 --compile   # with CUDA graphs

On a GPU the limits are a bf16 or fp32 8192^3 matmul and a 1 GiB copy, and the header names the GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    environment,
    machine_limits,
    measure_interleaved,
    print_table,
    roofline_seconds,
)

import softmoe  # noqa: E402
from softmoe.checkpoint import write_json  # noqa: E402
from softmoe_repro.latency import (  # noqa: E402
    DIM,
    EXPERTS,
    PAPER_MS,
    PRESETS,
    TARGET_SPEEDUP,
    TOKENS,
    MoEStack,
    experts_used,
    work,
)
from softmoe.kernels.grouped_mm import uses_grouped_gemm  # noqa: E402
from softmoe.runtime import tune_cpu_allocator  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="paper")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--repeats", type=int, help="timed passes per configuration (default: the preset's)")
    parser.add_argument("--warmup", type=int, help="untimed passes per configuration (default: the preset's)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here (latency.json for a report)")
    parser.add_argument("--device", default="cpu", help="torch device to run on (default: cpu)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--compile", action="store_true", help="time the stack compiled with torch.compile "
                        "(fullgraph; on a GPU in bf16 with CUDA graphs, mode reduce-overhead)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    preset = PRESETS[args.preset]
    repeats = args.repeats or preset["repeats"]
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    tuned = tune_cpu_allocator() if device.type == "cpu" else False
    torch.manual_seed(0)
    with torch.no_grad(), device:  # built on the device: no 9 GB initialized on the host first
        stack = MoEStack(preset["hidden"]).eval().to(dtype=dtype)
    params = sum(p.numel() for p in stack.parameters())
    expert_params = sum(p.numel() for layer in stack.layers for p in layer.experts.parameters())
    env = environment()
    if device.type == "cpu":
        limits, where = machine_limits(dtype=dtype), f"{env['cpu']} ({env['torch_threads']} threads)"
    else:
        limits = machine_limits(matmul_size=8192, copy_bytes=2**30, device=device, dtype=dtype)
        where = f"{torch.cuda.get_device_name(device)} (host {env['cpu']})"
    print(f"# Table 3 on {where}, torch {env['torch']}, {env['date']}")
    print(
        f"preset {args.preset}: 6 Soft MoE layers, {EXPERTS} experts of hidden {preset['hidden']}, "
        f"{params / 1e9:.2f}B parameters ({expert_params / 1e9:.2f}B in experts); {args.dtype}; "
        f"{'compiled' if args.compile else 'eager'}; {'CPU allocator tuned' if tuned else 'allocator untuned'}; "
        f"measured peak {limits['flops_per_s'] / 1e9:.0f} GFLOP/s, bandwidth "
        f"{limits['bytes_per_s'] / 1e9:.1f} GB/s; {warmup} warm-up + {repeats} timed passes each, round-robin"
    )
    ks = [EXPERTS, 3 * EXPERTS // 4, EXPERTS // 2, EXPERTS // 4]
    results = {"environment": env | {"device": str(device), "dtype": args.dtype, "compiled": args.compile},
               "limits": limits,
               "preset": args.preset, "hidden": preset["hidden"], "parameters": params,
               "expert_parameters": expert_params, "batches": {}}
    rows = []
    for batch in args.batches:
        x = torch.randn(batch, TOKENS, DIM, device=device, dtype=dtype)
        model = stack
        if args.compile:  # one graph per configuration, fresh for every batch size
            torch.compiler.reset()
            # CUDA graphs need a selection path without host synchronization: torch's grouped GEMM (bf16) gives one.
            graphs = uses_grouped_gemm(x, x, DIM, preset["hidden"])
            model = torch.compile(stack, fullgraph=True, mode="reduce-overhead" if graphs else None)

        def timed(k: int, strategy: str):
            def run() -> None:
                with torch.no_grad(), softmoe.select_experts(stack, k=k, strategy=strategy):
                    model(x)

            return run

        used = {k: ([EXPERTS] * len(stack.layers) if k == EXPERTS else experts_used(stack, x, k)) for k in ks}
        configs = {str(k): timed(k, "combine") for k in ks[1:]}
        configs["all"] = timed(EXPERTS, "all")
        configs["grouped"] = timed(EXPERTS, "combine")
        stats = measure_interleaved(configs, warmup=warmup, repeats=repeats, device=device)
        batched, grouped = stats.pop("all"), stats.pop("grouped")
        stats[str(EXPERTS)] = min(batched, grouped, key=lambda s: s["median"])  # the faster way to run every expert
        base = stats[str(EXPERTS)]["median"]
        results["batches"][str(batch)] = {}
        for k in ks:
            s = stats[str(k)]
            flops, nbytes = work(batch, k, preset["hidden"], used[k], stack.layers[0].phi.element_size())
            entry = {"k": k, "median_ms": s["median"] * 1e3, "std_ms": s["std"] * 1e3, "min_ms": s["min"] * 1e3,
                     "speedup_vs_all": base / s["median"],
                     "x_roofline": s["median"] / roofline_seconds(flops, nbytes, limits),
                     "experts_run_per_layer": used[k]}
            if k == EXPERTS:
                entry["batched_ms"], entry["grouped_ms"] = batched["median"] * 1e3, grouped["median"] * 1e3
            results["batches"][str(batch)][str(k)] = entry
            paper = PAPER_MS.get(batch, {}).get(k)
            rows.append([batch, k, f"{entry['median_ms']:.1f} ± {entry['std_ms']:.1f}", f"{entry['speedup_vs_all']:.2f}x",
                         f"{entry['x_roofline']:.2f}", f"{paper[0]:.2f} ± {paper[1]:.2f}" if paper else "–",
                         f"{PAPER_MS[batch][EXPERTS][0] / paper[0]:.2f}x" if paper else "–"])
    print_table(["batch", "k", "ours ms (median ± std)", "speed-up vs k=n", "x roofline", "paper ms (2080 Ti)",
                 "paper speed-up"], rows)
    for batch in args.batches:
        quarter = results["batches"][str(batch)][str(EXPERTS // 4)]["speedup_vs_all"]
        target = TARGET_SPEEDUP.get(batch)
        verdict = f" (target >= {target}x: {'PASS' if quarter >= target else 'FAIL'})" if target else ""
        print(f"batch {batch}: k = n/4 is {quarter:.2f}x faster than k = n{verdict}")
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
