"""Soft MoE on a CUDA GPU: the layer in fp32 and bf16 against a dense MLP of the same FLOPs and the published peer
packages, and Algorithm 1's selection path against running every expert.

Usage (on a machine with a CUDA device)::

    python benchmarks/bench_gpu.py                  # every table (a few minutes)
    python benchmarks/bench_gpu.py --quick          # fewer shapes and repeats
    python benchmarks/bench_gpu.py --json gpu.json  # also write the results as JSON
    python benchmarks/bench_gpu.py --compile        # also the layer and the dense MLP compiled with CUDA graphs

Layer table: for every shape and dtype, the forward (under ``torch.no_grad``) and forward+backward (``x`` requiring
grad, gradients reset to None before each step) of ``softmoe.SoftMoE`` (backend "auto", which is "cuda" on CUDA),
the dense MLP of ``benchmarks/bench_layer.py`` (the layer's expert FLOPs spent on every token) and each installed
peer of ``benchmarks/peers.py`` at the same shape and dtype, timed round-robin in the same run; each timed call
ends with a device synchronization. fp32 runs with TF32 off (torch's default for matmul). Columns: median times,
the layer's rate and its multiple of the roofline max(FLOPs / matmul peak, bytes / copy bandwidth) with the peak
(8192^3 matmul in the row's dtype) and bandwidth (1 GiB copy, read+write bytes) measured in this run, and the time
ratios layer / dense and layer / best MLP peer.

With ``--compile`` the layer and the dense MLP are also timed compiled (``torch.compile(fullgraph=True,
mode="reduce-overhead")``: CUDA graphs, so a call is one graph launch instead of one launch per kernel) in the
same rounds, and the table adds their times and the compiled layer / compiled dense ratio. A contender that fails
to compile is reported, not timed.

Selection table: a forward of the same layer under ``softmoe.select_experts(k)`` (Algorithm 1, ``strategy=
"combine"``) for k = n, n/2, n/4, n/8 against the plain forward (every expert in one batched matmul); k = n also
runs through the selection path. Both eager and compiled (``torch.compile(fullgraph=True)``, in bf16 with
``mode="reduce-overhead"``: CUDA graphs, which replay the whole layer as one launch). In bf16 with dims that are
multiples of 8 the kept experts run through torch's grouped GEMM with no host synchronization
(``softmoe.kernels.grouped_mm``); elsewhere one product per expert.

Shapes: the paper's MNIST layer (batch 256, 4 tokens, dim 196, n = 2 ... 512, hidden round(784 / n), relu) and a
ViT-S/16 Soft MoE layer (196 tokens, dim 384, 128 experts, hidden 1536, gelu) at batch 8 (as on the CPU) and 128;
``--experts`` and ``--vit-batches`` pick others. Table 3 on a GPU is
``benchmarks/bench_latency.py --device cuda --dtype bfloat16``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_layer import VIT_S, Shape, dense_mlp, layer_bytes, layer_flops, mnist_shapes, step_fns  # noqa: E402
from common import environment, machine_limits, measure_interleaved, print_table, roofline_seconds  # noqa: E402
from peers import MLP_PEERS, build_peers  # noqa: E402

import softmoe  # noqa: E402
from softmoe.kernels.grouped_mm import uses_grouped_gemm  # noqa: E402
from softmoe.tuning import set_autotune  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def timed_modules(shape: Shape, dtype: torch.dtype, device: torch.device, compile_graphs: bool
                  ) -> tuple[dict, dict, softmoe.SoftMoE]:
    """({name: (forward, forward+backward)} for the layer, the dense MLP, the peers and, with ``compile_graphs``,
    the layer and the dense MLP compiled with CUDA graphs; {contender: why it is not timed}; the layer)."""
    torch.manual_seed(0)
    layer = softmoe.SoftMoE(shape.dim, shape.experts, shape.slots, expert_hidden=shape.hidden,
                            activation=shape.activation)
    modules = {"layer": layer, "dense": dense_mlp(shape)}
    peers, missing = build_peers(shape.dim, shape.experts, shape.slots, shape.hidden, shape.activation)
    modules |= peers
    x = torch.randn(shape.batch, shape.tokens, shape.dim, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    fns = {}
    for name, module in modules.items():
        module.to(device=device, dtype=dtype)
        fns[name] = step_fns(module, list(module.parameters()), x, grad)
    for name in ("layer", "dense") if compile_graphs else ():
        module = modules[name]
        compiled = torch.compile(module, fullgraph=True, mode="reduce-overhead")
        steps = step_fns(compiled, list(module.parameters()), x, grad)
        try:
            for step in steps * 3:  # compiles both graphs and records them (CUDA graphs record on a later call)
                step()
        except Exception as error:  # noqa: BLE001 - a benchmark reports a contender that cannot run
            where, first_line = f"{name} compiled ({shape.name} b{shape.batch}, {dtype})", str(error).partition("\n")[0]
            missing[where] = f"{type(error).__name__}: {first_line[:200]}"
            continue
        fns[f"{name} compiled"] = steps
    return fns, missing, layer


def layer_row(shape: Shape, dtype_name: str, device: torch.device, limits: dict, warmup: int, repeats: int,
              compile_graphs: bool) -> dict:
    fns, missing, layer = timed_modules(shape, DTYPES[dtype_name], device, compile_graphs)
    x = torch.randn(shape.batch, shape.tokens, shape.dim, device=device, dtype=DTYPES[dtype_name])
    fwd = measure_interleaved({k: v[0] for k, v in fns.items()}, warmup, repeats, device=device)
    fwdbwd = measure_interleaved({k: v[1] for k, v in fns.items()}, warmup, repeats, device=device)
    flops = layer_flops(shape)
    row = {
        "shape": dataclasses.asdict(shape), "dtype": dtype_name, "backend": layer.backend_for(x).name,
        "fwd_ms": {k: v["median"] * 1e3 for k, v in fwd.items()},
        "fwdbwd_ms": {k: v["median"] * 1e3 for k, v in fwdbwd.items()},
        "fwd_x_roofline": fwd["layer"]["median"] / roofline_seconds(flops, layer_bytes(shape, layer, False), limits),
        "fwdbwd_x_roofline": fwdbwd["layer"]["median"]
        / roofline_seconds(3 * flops, layer_bytes(shape, layer, True), limits),
        "fwd_tflops": flops / fwd["layer"]["median"] / 1e12,
        "not_timed": missing,
    }
    for pass_name in ("fwd", "fwdbwd"):
        times = row[f"{pass_name}_ms"]
        row[f"{pass_name}_vs_dense"] = times["layer"] / times["dense"]
        mlp_peers = [times[p] for p in MLP_PEERS if p in times]
        row[f"{pass_name}_vs_best_peer"] = times["layer"] / min(mlp_peers) if mlp_peers else None
        both = "layer compiled" in times and "dense compiled" in times
        row[f"{pass_name}_compiled_vs_dense"] = times["layer compiled"] / times["dense compiled"] if both else None
    return row


def selection_rows(shape: Shape, dtype_name: str, device: torch.device, warmup: int, repeats: int) -> list[dict]:
    """Algorithm 1 at k = n, n/2, n/4, n/8 against every expert, eager and compiled (fullgraph; with CUDA graphs
    where the selection path never synchronizes: bf16)."""
    torch.manual_seed(0)
    layer = softmoe.SoftMoE(shape.dim, shape.experts, shape.slots, expert_hidden=shape.hidden,
                            activation=shape.activation).eval().to(device=device, dtype=DTYPES[dtype_name])
    x = torch.randn(shape.batch, shape.tokens, shape.dim, device=device, dtype=DTYPES[dtype_name])
    n = shape.experts
    ks = [k for k in (n, n // 2, n // 4, n // 8) if k >= 1]
    torch.compiler.reset()
    # CUDA graphs need a selection path without host synchronization: torch's grouped GEMM (bf16) gives one.
    graphs = uses_grouped_gemm(x, x, shape.dim, shape.hidden)
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead" if graphs else None)

    def run(model, k: int | None):
        def call() -> None:
            with torch.no_grad(), softmoe.select_experts(layer, k=k or n, strategy="all" if k is None else "combine"):
                model(x)

        return call

    configs = {}
    for mode, model in (("eager", layer), ("compiled", compiled)):
        configs |= {f"{mode} all": run(model, None)} | {f"{mode} {k}": run(model, k) for k in ks}
    stats = measure_interleaved(configs, warmup, repeats, device=device)
    rows = []
    for k in ks:
        row = {"shape": dataclasses.asdict(shape), "dtype": dtype_name, "k": k}
        for mode in ("eager", "compiled"):
            base, time = stats[f"{mode} all"]["median"], stats[f"{mode} {k}"]["median"]
            row[mode] = {"ms": time * 1e3, "all_ms": base * 1e3, "speedup_vs_all": base / time}
        rows.append(row)
    return rows


def fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--json", metavar="PATH", help="also write all results as JSON to PATH")
    parser.add_argument("--device", default="cuda", help="a CUDA device (default: cuda)")
    parser.add_argument("--tables", nargs="+", choices=["layer", "selection"], default=["layer", "selection"])
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--experts", type=int, nargs="+", metavar="N",
                        help="the MNIST layer's expert counts (default 2 ... 512; --quick: 2, 8, 32, 128, 512)")
    parser.add_argument("--vit-batches", type=int, nargs="*", default=[8, 128], metavar="B",
                        help="batch sizes of the ViT-S/16 layer (default 8 128; none: leave it out)")
    parser.add_argument("--compile", action="store_true",
                        help="also time the layer and the dense MLP compiled with CUDA graphs (mode reduce-overhead)")
    parser.add_argument("--autotune", action="store_true", help="plan \"auto\" times both plans once per shape and "
                        "runs the faster (softmoe.tuning.set_autotune(True)); without it eager CUDA runs the dense "
                        "plan")
    args = parser.parse_args(argv)
    set_autotune(args.autotune)
    device = torch.device(args.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        parser.error(f"--device {args.device}: this benchmark needs a CUDA device and torch sees none")
    warmup, repeats = (3, 10) if args.quick else (5, 30)
    ns = args.experts or ([2, 8, 32, 128, 512] if args.quick else [2, 4, 8, 16, 32, 64, 128, 256, 512])
    vits = [dataclasses.replace(VIT_S, batch=batch) for batch in args.vit_batches]
    shapes = [*mnist_shapes(ns), *vits]
    env = environment()
    gpu = torch.cuda.get_device_name(device)
    limits = {name: machine_limits(repeats=10, matmul_size=8192, copy_bytes=2**30, device=device, dtype=dtype)
              for name, dtype in DTYPES.items()}
    print(f"# {gpu} (host {env['cpu']}), torch {env['torch']}, CUDA {torch.version.cuda}, {env['date']}")
    for name, lim in limits.items():
        print(f"{name}: matmul peak {lim['flops_per_s'] / 1e12:.0f} TFLOP/s, copy {lim['bytes_per_s'] / 1e12:.2f} "
              f"TB/s (read+write), read {lim['read_bytes_per_s'] / 1e12:.2f} TB/s")
    results = {"environment": env | {"gpu": gpu, "cuda": torch.version.cuda}, "limits": limits, "layer": [],
               "selection": []}

    table, missing = [], {}
    for dtype_name in args.dtypes if "layer" in args.tables else ():
        for shape in shapes:
            row = layer_row(shape, dtype_name, device, limits[dtype_name], warmup, repeats, args.compile)
            results["layer"].append(row)
            ours = ("layer", "dense", "layer compiled", "dense compiled")
            peers = "; ".join(f"{k} {v:.2f}" for k, v in row["fwd_ms"].items() if k not in ours)
            peers_bwd = "; ".join(f"{k} {v:.2f}" for k, v in row["fwdbwd_ms"].items() if k not in ours)
            compiled = [f"{fmt(row[f'{p}_ms'].get('layer compiled'), '.3f')} / "
                        f"{fmt(row[f'{p}_compiled_vs_dense'])}" for p in ("fwd", "fwdbwd")] if args.compile else []
            table.append([
                f"{shape.name} b{shape.batch}", shape.experts, shape.hidden, dtype_name, row["backend"],
                f"{row['fwd_ms']['layer']:.3f}", f"{row['fwdbwd_ms']['layer']:.3f}", f"{row['fwd_tflops']:.1f}",
                f"{row['fwd_x_roofline']:.1f} / {row['fwdbwd_x_roofline']:.1f}",
                f"{row['fwd_vs_dense']:.2f} / {row['fwdbwd_vs_dense']:.2f}",
                f"{fmt(row['fwd_vs_best_peer'])} / {fmt(row['fwdbwd_vs_best_peer'])}",
                *compiled, peers or "none installed", peers_bwd or "–",
            ])
            missing |= row["not_timed"]
    if table:
        print_table(["shape", "n", "h", "dtype", "backend", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s",
                     "x roofline fwd / fwd+bwd", "layer/dense fwd / fwd+bwd", "layer/best MLP peer fwd / fwd+bwd",
                     *(["compiled fwd ms / vs compiled dense", "compiled fwd+bwd ms / vs compiled dense"]
                       if args.compile else []),
                     "peers fwd ms", "peers fwd+bwd ms"], table, align="lrrllrrrrrr" + "rr" * args.compile + "ll")
    if missing:
        print("not timed: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))

    table = []
    for dtype_name in args.dtypes if "selection" in args.tables else ():
        for shape in vits:
            for row in selection_rows(shape, dtype_name, device, warmup, repeats):
                results["selection"].append(row)
                table.append([f"{shape.name} b{shape.batch}", dtype_name, row["k"]] + [
                    f"{row[mode]['ms']:.3f} vs {row[mode]['all_ms']:.3f}: {row[mode]['speedup_vs_all']:.2f}x"
                    for mode in ("eager", "compiled")])
    if table:
        print_table(["shape", "dtype", "k", "eager: Algorithm 1 ms vs all experts ms: speed-up",
                     "compiled (CUDA graphs in bf16): the same"], table, align="llrrr")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
