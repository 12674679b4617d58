"""Table 3 of "Beyond Parameter Count" on this machine: latency of Algorithm 1 through 6 Soft MoE layers.

Smaller k use ``softmoe.select_experts(strategy="combine")``, which does not run unselected experts. k = n is
timed both as the plain forward (all experts in batched matmuls) and through the selection path with every
expert kept (the selected plan: a grouped product, one product per expert, on the CPU ``softmoe::native_grouped_mm``
or in inference ``softmoe::selected_mixing`` where it serves); the faster of the two is the baseline
of the speed-ups, so they measure skipped work, not a kernel difference. All configurations are timed
round-robin in the same run after warm-up; the table gives the median and std in ms, the speed-up over k = n,
and the time as a multiple of the roofline of the kept work (see ``softmoe_repro.latency.work``) with peak
FLOP/s and bandwidth measured in this run.

    python benchmarks/bench_latency.py                 # paper-size experts (9 GB of fp32 weights), a few minutes
    python benchmarks/bench_latency.py --preset small  # hidden 768 * 8, about a minute
    python benchmarks/bench_latency.py --json results/mnist5k/latency.json   # joins that folder's report
    python benchmarks/bench_latency.py --device cuda --dtype bfloat16         # on a GPU (the paper timed one)
    python benchmarks/bench_latency.py --device cuda --dtype bfloat16 --compile   # with CUDA graphs
    python benchmarks/bench_latency.py --isa avx512,avx2     # one fresh process per instruction set
    python benchmarks/bench_latency.py --sweep --preset small   # one layer, every k < n at batch 1, 4, 16, 100,
                                                                # each plan forced too (is the cost model right?)
    python benchmarks/bench_latency.py --sweep --device cuda --dtype bfloat16   # the same on a GPU (eager)
    python benchmarks/bench_latency.py --sweep --mnist-experts 8    # the paper's MNIST layer (small relu experts)
    python benchmarks/bench_latency.py --sweep --memory-bound     # 8 experts of 256 -> 4096 -> 256, 64 tokens:
                                                                  # bound by reading the weights at batch 1
    python benchmarks/bench_latency.py --skinny --device cuda --dtype bfloat16   # the kept experts' products at
                                            # batch 1: the skinny Triton kernel, torch's grouped GEMM, a copy

On a GPU the limits are a bf16 or fp32 8192^3 matmul and a 1 GiB copy, and the header names the GPU. On the CPU
``--isa`` (default: the host's best) and ``--allocator`` (default: tuned, as the training CLI runs) choose the
processes, one after the other (``benchmarks/common.py``). k < n runs Algorithm 1 with ``plan="auto"``, which skips
the unselected experts where that is cheaper and else runs every expert with their combine weights zeroed
(``softmoe.selection_plan``; eager CUDA runs the dense plan unless ``--autotune`` has the plans timed); ``--sweep`` times that against every expert for one layer of the stack at every
k < n and several batch sizes, and says which plan ran: Algorithm 1 must never be slower. The sweep times the
layer's call alone (the selector ``select_experts`` installs put in place before each call, untimed); Table 3 times
each stack call inside its ``select_experts`` block.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (  # noqa: E402
    add_process_arguments,
    apply_allocator,
    environment,
    machine_limits,
    measure_interleaved,
    print_table,
    roofline_seconds,
    run_children,
    write_results,
)

import softmoe  # noqa: E402
from softmoe import SoftMoE  # noqa: E402
from softmoe.models.mnist import expert_hidden_for  # noqa: E402
from softmoe.selection_plan import auto_plan  # noqa: E402
from softmoe.tuning import set_autotune  # noqa: E402
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
from softmoe.kernels.grouped_mm import grouped_mm, uses_grouped_gemm  # noqa: E402
from softmoe.kernels.skinny_grouped_mm import skinny_grouped_mm  # noqa: E402


SWEEP_BATCHES = (1, 4, 16, 100)
# The paper's MNIST layer (softmoe.models.mnist): 4 tokens of dim 196 (7 x 7 patches of 28 x 28 images), relu experts
# of hidden 784 / n; batches below, at and above one group of the fused kernel's vector lanes, and the paper's 256.
MNIST_DIM, MNIST_TOKENS = 196, 4
MNIST_SWEEP_BATCHES = (1, 4, 16, 64, 256)
# A k whose median time exceeds every expert's by more than this is reported as slower (same-run noise is ~3%).
SLOWER_TOLERANCE = 0.03
# --memory-bound: (dim, experts, expert hidden, tokens) of a layer whose batch-1 calls read far more weight bytes than
# they do FLOPs per byte, where Algorithm 1 at k = n/4 must run MEMORY_BOUND_TARGET times faster than every expert.
MEMORY_BOUND = (256, 8, 4096, 64)
MEMORY_BOUND_BATCHES = (1, 4, 16)
MEMORY_BOUND_TARGET = 2.5
# The MNIST layer's calls take 0.1-3 ms: timed passes per configuration there (the presets' 6-8 are for the stack).
MNIST_SWEEP_REPEATS = 40
# Calls of one configuration in a row per round in a sweep: the first follows another configuration (its code and
# data out of the caches) and is reported apart ("cold"); the others, as a loop of inference calls runs, are timed.
SWEEP_BURST = 3


def sweep_layer(preset: dict | None, mnist_experts: int | None, memory_bound: bool, device: torch.device,
                dtype: torch.dtype) -> tuple[softmoe.SoftMoE, int, list[int], tuple[int, ...], str]:
    """The layer a sweep times (one of Table 3's stack; with ``mnist_experts`` the paper's MNIST layer of that many
    experts; with ``memory_bound`` MEMORY_BOUND's), its tokens, the k it tries (every k < n; for the MNIST layer 1,
    2, n/8, n/4, n/2, n - 1), the batches and its name."""
    torch.manual_seed(0)
    with torch.no_grad(), device:
        if memory_bound:
            dim, n, hidden, tokens = MEMORY_BOUND
            layer = SoftMoE(dim, n, expert_hidden=hidden).eval().to(dtype=dtype)
            return layer, tokens, list(range(1, n)), MEMORY_BOUND_BATCHES, \
                f"the memory-bound layer ({n} experts of {dim} -> {hidden} -> {dim}, {tokens} tokens)"
        if mnist_experts is None:
            layer = MoEStack(preset["hidden"], layers=1).layers[0].eval().to(dtype=dtype)
            return layer, TOKENS, list(range(1, EXPERTS)), SWEEP_BATCHES, \
                f"one layer of Table 3's stack (hidden {preset['hidden']})"
        n = mnist_experts
        layer = SoftMoE(MNIST_DIM, n, expert_hidden=expert_hidden_for(MNIST_DIM, n), activation="relu")
        ks = sorted({k for k in (1, 2, n // 8, n // 4, n // 2, n - 1) if 1 <= k < n})
        return layer.eval().to(dtype=dtype), MNIST_TOKENS, ks, MNIST_SWEEP_BATCHES, \
            f"the paper's MNIST layer ({n} experts of hidden {expert_hidden_for(MNIST_DIM, n)})"


def sweep(layer: softmoe.SoftMoE, tokens: int, ks: list[int], batches: tuple[int, ...], repeats: int, warmup: int,
          device: torch.device, dtype: torch.dtype) -> dict:
    """Algorithm 1 (plan "auto") at each of ``ks`` against every expert, at each of ``batches``; each plan forced
    ("selected", "dense") is timed in the same rounds, to check the cost model's choice. Each call is the layer's
    alone: the selector that ``select_experts`` installs is put in place before it, untimed (a user enters the
    context once for many calls); each configuration runs SWEEP_BURST times in a row per round, the first call
    reported apart (``cold_ms``, ``cold_speedup``)."""

    def selector(k: int | None, plan: str = "auto") -> softmoe.selection.ExpertSelector | None:
        with softmoe.select_experts(layer, k=k, strategy="all" if k is None else "combine", plan=plan):
            return layer.selector

    selectors = {"all": selector(None)} | {f"{k} {plan}": selector(k, plan) for k in ks
                                           for plan in ("auto", "selected", "dense")}
    setups = {name: (lambda s=s: setattr(layer, "selector", s)) for name, s in selectors.items()}
    results, rows, forced_rows, slower, mischosen = {}, [], [], [], []
    for batch in batches:
        x = torch.randn(batch, tokens, layer.dim, device=device, dtype=dtype)
        with torch.no_grad():
            stats = measure_interleaved({name: lambda: layer(x) for name in selectors}, warmup=warmup,
                                        repeats=repeats, device=device, burst=SWEEP_BURST, setups=setups)
        layer.selector = None
        plans = {}
        with torch.no_grad():  # as the timed calls run
            combine = layer.route(x).combine
            for k in ks:
                selected = softmoe.selection.top_k_by_combine(combine, k)
                plans[k] = auto_plan(layer, x, selected)
        base = stats["all"]["median"]
        speedup = {f"{k} {plan}": base / stats[f"{k} {plan}"]["median"] for k in ks
                   for plan in ("auto", "selected", "dense")}
        slower += [f"batch {batch} k = {k}" for k in ks if speedup[f"{k} auto"] < 1 / (1 + SLOWER_TOLERANCE)]
        mischosen += [f"batch {batch} k = {k}" for k in ks
                      if max(speedup[f"{k} selected"], speedup[f"{k} dense"])
                      > speedup[f"{k} {plans[k]}"] * (1 + SLOWER_TOLERANCE)]
        cold = stats["all"]["cold"]["median"]
        results[str(batch)] = {"all_ms": base * 1e3, "plan": plans,
                               "speedup": {k: speedup[f"{k} auto"] for k in ks},
                               "ms": {k: stats[f"{k} auto"]["median"] * 1e3 for k in ks},
                               "cold_all_ms": cold * 1e3,
                               "cold_ms": {k: stats[f"{k} auto"]["cold"]["median"] * 1e3 for k in ks},
                               "cold_speedup": {k: cold / stats[f"{k} auto"]["cold"]["median"] for k in ks},
                               "speedup_selected": {k: speedup[f"{k} selected"] for k in ks},
                               "speedup_dense": {k: speedup[f"{k} dense"] for k in ks}}
        rows.append([batch, f"{base * 1e3:.1f}"] + [f"{speedup[f'{k} auto']:.2f} {plans[k][0]}" for k in ks])
        forced_rows.append([batch] + [f"{speedup[f'{k} selected']:.2f} / {speedup[f'{k} dense']:.2f}" for k in ks])
    headers = [f"k = {k}" for k in ks]
    print_table(["batch", "all experts ms", *headers], rows)
    print(f"speed-up over every expert (median of round-robin passes, calls 2-{SWEEP_BURST} of each burst); s = only "
          "the selected experts ran, d = every expert ran with the unselected ones' combine weights zeroed (the cost "
          "model's choice)")
    print_table(["batch", *headers], forced_rows)
    print("each plan forced, same rounds: speed-up of the selected plan / of the dense plan over every expert")
    verdict = "none" if not slower else ", ".join(slower)
    print(f"Algorithm 1 slower than every expert (by more than {SLOWER_TOLERANCE:.0%}): {verdict}")
    print(f"the other plan faster (by more than {SLOWER_TOLERANCE:.0%}) than the one the cost model chose: "
          f"{'none' if not mischosen else ', '.join(mischosen)}")
    return {"batches": results, "slower": slower, "mischosen": mischosen, "tolerance": SLOWER_TOLERANCE}


# --skinny: the kept experts at batch 1 (n/8, n/4, n/2 of Table 3's 8), and the copies of the weights the timed calls
# rotate through, so that no call finds its weights in the GPU's L2 cache left there by the call before.
SKINNY_KS = (1, 2, 4)
SKINNY_COPIES = 4
# The issue's target: the kept experts' weights streamed at this share of the copy bandwidth or more.
SKINNY_TARGET = 0.8


def device_times(fns: dict, repeats: int) -> dict[str, float]:
    """The median seconds of each of ``fns`` on the GPU (CUDA events around each call), timed round-robin."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        for name, fn in fns.items():
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def as_graph(fn):
    """``fn`` (run once first: Triton's JIT, cuBLAS's set-up) captured as a CUDA graph, returned as its replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def products(op, x: torch.Tensor, weights: list[torch.Tensor], ends: torch.Tensor, bias: torch.Tensor,
             activation: str):
    """A call of the grouped product ``op`` on x through each of ``weights`` in turn."""
    return lambda: [op(x, w, ends, bias, activation) for w in weights]


def copies(sources: list[torch.Tensor], targets: list[torch.Tensor]):
    """A copy of each of ``sources`` into its target in turn."""
    return lambda: [t.copy_(s) for s, t in zip(sources, targets)]


def skinny_table(hidden: int, device: torch.device, dtype: torch.dtype, repeats: int) -> dict:
    """Algorithm 1's expert products at batch 1 (k kept experts of one slot each: k rows) through one layer of Table
    3's experts, the first product (768 x hidden, bias and gelu_tanh, as the layer runs it in inference) and the
    second (hidden x 768, bias): softmoe::skinny_grouped_mm against softmoe::grouped_mm (torch's grouped GEMM in
    bfloat16), and a copy of as many bytes as the kept experts' weights. Each timed call runs SKINNY_COPIES products,
    one per copy of the weights, as one CUDA graph (grouped_mm outside bfloat16 reads the groups on the host: eager
    there), timed with CUDA events; the bandwidth ratio is (kept weight bytes / the product's time) over (bytes read
    and written / the copy's time)."""
    torch.manual_seed(0)
    rows_out, table = [], []
    for name, (k_in, n_out, activation) in {"first": (DIM, hidden, "gelu_tanh"),
                                            "second": (hidden, DIM, "none")}.items():
        weights = [torch.randn(EXPERTS, k_in, n_out, device=device, dtype=dtype) / k_in**0.5
                   for _ in range(SKINNY_COPIES)]
        bias = torch.randn(EXPERTS, n_out, device=device, dtype=dtype)
        for k in SKINNY_KS:
            kept = set(range(0, EXPERTS, EXPERTS // k))  # k experts spread over the bank, one row each
            ends = torch.tensor([sum(e in kept for e in range(j + 1)) for j in range(EXPERTS)], device=device,
                                dtype=torch.int32)
            x = torch.randn(k, k_in, device=device, dtype=dtype)
            nbytes = k * k_in * n_out * dtype.itemsize
            sources = [torch.empty(nbytes, device=device, dtype=torch.uint8) for _ in range(SKINNY_COPIES)]
            targets = [torch.empty_like(t) for t in sources]
            skinny, grouped = (products(op, x, weights, ends, bias, activation)
                               for op in (skinny_grouped_mm, grouped_mm))
            torch.testing.assert_close(skinny()[0], grouped()[0], rtol=2e-2, atol=2e-2)  # (the same products)
            graphs = uses_grouped_gemm(x, x, k_in, n_out)
            fns = {"skinny": as_graph(skinny), "grouped": as_graph(grouped) if graphs else grouped,
                   "copy": as_graph(copies(sources, targets))}
            seconds = {key: t / SKINNY_COPIES for key, t in device_times(fns, repeats).items()}
            copy_rate = 2 * nbytes / seconds["copy"]
            ratio = {key: nbytes / seconds[key] / copy_rate for key in ("skinny", "grouped")}
            rows_out.append({"product": name, "k": k, "rows": k, "weight_bytes": nbytes,
                             "skinny_us": seconds["skinny"] * 1e6, "grouped_us": seconds["grouped"] * 1e6,
                             "copy_us": seconds["copy"] * 1e6, "copy_bytes_per_s": copy_rate,
                             "skinny_vs_copy": ratio["skinny"], "grouped_vs_copy": ratio["grouped"],
                             "grouped_mode": "CUDA graph" if graphs else "eager"})
            table.append([f"{name} ({k_in} x {n_out})", k, f"{nbytes / 2**20:.0f}", f"{seconds['skinny'] * 1e6:.1f}",
                          f"{seconds['grouped'] * 1e6:.1f}{'' if graphs else ' (eager)'}",
                          f"{seconds['grouped'] / seconds['skinny']:.2f}x", f"{copy_rate / 1e12:.2f}",
                          f"{ratio['skinny']:.2f}", f"{ratio['grouped']:.2f}",
                          "PASS" if ratio["skinny"] >= SKINNY_TARGET else "FAIL"])
    print_table(["product", "k", "kept MiB", "skinny us", "grouped_mm us", "grouped / skinny",
                 "copy TB/s (read+write)", "skinny / copy", "grouped / copy", f"skinny >= {SKINNY_TARGET}"],
                table, align="lrrrrrrrrl")
    print(f"median of {repeats} CUDA-event timings of {SKINNY_COPIES} calls (one per copy of the weights), per call; "
          "x / copy: the kept weight bytes over the product's time against the copy's read+write bytes over its time")
    return {"rows": rows_out, "copies": SKINNY_COPIES, "target": SKINNY_TARGET}


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
    parser.add_argument("--sweep", action="store_true", help="one layer, every k < n at batch "
                        f"{', '.join(map(str, SWEEP_BATCHES))}, against every expert (Algorithm 1 never slower)")
    parser.add_argument("--skinny", action="store_true", help="on a GPU: the selected experts' products at batch 1, "
                        "softmoe::skinny_grouped_mm against softmoe::grouped_mm, and their bandwidth against a copy of "
                        "the kept experts' weight bytes")
    parser.add_argument("--memory-bound", action="store_true", help="with --sweep: the memory-bound layer instead "
                        f"(dim {MEMORY_BOUND[0]}, {MEMORY_BOUND[1]} experts of hidden {MEMORY_BOUND[2]}, "
                        f"{MEMORY_BOUND[3]} tokens), at batch {', '.join(map(str, MEMORY_BOUND_BATCHES))}; k = n/4 "
                        f"must be {MEMORY_BOUND_TARGET}x faster than k = n at batch 1")
    parser.add_argument("--mnist-experts", type=int, metavar="N", help="with --sweep: the paper's MNIST layer of N "
                        f"experts instead (4 tokens of dim {MNIST_DIM}, relu experts of hidden 784 / N), at batch "
                        f"{', '.join(map(str, MNIST_SWEEP_BATCHES))}")
    parser.add_argument("--autotune", action="store_true", help="plan \"auto\" times both plans once per shape and "
                        "runs the faster (softmoe.tuning.set_autotune(True)); without it eager CUDA runs the dense "
                        "plan and the CPU the cost model's")
    add_process_arguments(parser)
    parser.set_defaults(allocator="tuned")
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.sweep and args.compile:
        parser.error("--sweep times eager calls only; leave out --compile")
    if args.skinny and (device.type != "cuda" or args.sweep or args.compile):
        parser.error("--skinny times the products on a GPU (--device cuda), without --sweep or --compile")
    if args.mnist_experts is not None and not (args.sweep and args.mnist_experts >= 2):
        parser.error("--mnist-experts N takes --sweep and N >= 2")
    if args.memory_bound and not (args.sweep and args.mnist_experts is None):
        parser.error("--memory-bound takes --sweep, without --mnist-experts")
    if device.type == "cpu" and run_children(parser, args, argv):
        return
    set_autotune(args.autotune)
    preset = PRESETS[args.preset]
    repeats = args.repeats or (MNIST_SWEEP_REPEATS if args.mnist_experts else preset["repeats"])
    warmup = args.warmup if args.warmup is not None else preset["warmup"]
    allocator = apply_allocator(args.allocator) if device.type == "cpu" else "allocator: CUDA's"
    if args.skinny:
        env = environment()
        print(f"# the selected experts' products at batch 1, Table 3's layer (hidden {preset['hidden']}), "
              f"{torch.cuda.get_device_name(device)} (host {env['cpu']}), torch {env['torch']}, {args.dtype}, "
              f"{env['date']}")
        results = {"environment": env | {"device": str(device), "dtype": args.dtype}, "preset": args.preset,
                   "skinny": skinny_table(preset["hidden"], device, dtype, repeats)}
        write_results(args, results)
        return
    if args.sweep:
        env = environment()
        where = env["cpu"] if device.type == "cpu" else f"{torch.cuda.get_device_name(device)} (host {env['cpu']})"
        layer, tokens, ks, batches, name = sweep_layer(preset, args.mnist_experts, args.memory_bound, device, dtype)
        print(f"# Algorithm 1 against every expert, {name}, "
              f"{where} | {env['isa']} | {env['torch_threads']} threads | {args.dtype} | {env['date']} | {allocator}")
        results = {"environment": env | {"device": str(device), "dtype": args.dtype}, "preset": args.preset,
                   "layer": name, "sweep": sweep(layer, tokens, ks, batches, repeats, warmup, device, dtype)}
        if args.memory_bound:
            k = layer.num_experts // 4
            ratio = results["sweep"]["batches"]["1"]["speedup"][k]
            verdict = "PASS" if ratio >= MEMORY_BOUND_TARGET else "FAIL"
            print(f"batch 1: k = n/4 is {ratio:.2f}x faster than k = n (target >= {MEMORY_BOUND_TARGET}x: {verdict})")
        write_results(args, results)
        return
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
    print(f"# Table 3 on {where}, {env['isa']}, torch {env['torch']}, {env['date']}")
    print(
        f"preset {args.preset}: 6 Soft MoE layers, {EXPERTS} experts of hidden {preset['hidden']}, "
        f"{params / 1e9:.2f}B parameters ({expert_params / 1e9:.2f}B in experts); {args.dtype}; "
        f"{'compiled' if args.compile else 'eager'}; {allocator}; "
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

        def timed(k: int, strategy: str, plan: str = "auto"):
            def run() -> None:
                with torch.no_grad(), softmoe.select_experts(stack, k=k, strategy=strategy, plan=plan):
                    model(x)

            return run

        used = {k: ([EXPERTS] * len(stack.layers) if k == EXPERTS else experts_used(stack, x, k)) for k in ks}
        configs = {str(k): timed(k, "combine") for k in ks[1:]}
        configs["all"] = timed(EXPERTS, "all")
        configs["grouped"] = timed(EXPERTS, "combine", plan="selected")
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
    write_results(args, results)


if __name__ == "__main__":
    main()
