"""The CPU products of Algorithm 1's selected plan: softmoe's native expert matmul against MKL (and oneDNN) for few
rows through each of E large weights, the shapes where ``softmoe.kernels.native_grouped_mm`` picks between them.

Each cell times E products of ``rows`` x K through E different K x N weights (for Table 3's paper-size shapes,
8 x 94 MB: more than a last-level cache holds, so every weight streams from memory as in the model; the small
preset's 8 x 19 MB may stay in a large L3), one call per expert as ``softmoe::native_grouped_mm`` makes them: the native kernel (a weight taller than wide split by rows over the
threads), ``x @ w`` (MKL) and oneDNN's linear, round-robin in the same run, and prints GFLOP/s and native / MKL.

    python benchmarks/bench_products.py                           # Table 3's shapes at 8-100 rows
    python benchmarks/bench_products.py --isa avx512,avx2         # one fresh process per instruction set
    python benchmarks/bench_products.py --shapes 384x1536 --rows 8 16 --experts 128
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
    cpu_header,
    environment,
    measure_interleaved,
    print_table,
    run_children,
    write_results,
)

from softmoe.kernels import native_available, native_status  # noqa: E402
from softmoe.kernels.native_grouped_mm import native_product  # noqa: E402
from softmoe.kernels.onednn import onednn_linear  # noqa: E402
from softmoe.tuning import value  # noqa: E402


def shape(text: str) -> tuple[int, int]:
    k, sep, n = text.partition("x")
    if not sep or not k.isdigit() or not n.isdigit() or int(k) < 1 or int(n) < 1:
        raise argparse.ArgumentTypeError(f"expected KxN with positive integers (e.g. 768x30720), got {text!r}")
    return int(k), int(n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=shape, nargs="+", default=[shape(s) for s in
                        ("768x30720", "30720x768", "768x6144", "6144x768")], help="weights KxN")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 25, 32, 48, 64, 100])
    parser.add_argument("--experts", type=int, default=8, help="weights per shape, each used once per pass")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    add_process_arguments(parser)
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if min(args.rows) < 1 or args.experts < 1 or args.repeats < 1:
        parser.error("--rows, --experts and --repeats must be positive")
    if run_children(parser, args, argv):
        return
    if not native_available():
        parser.error(f"softmoe's native kernels are unavailable: {native_status()}")
    allocator = apply_allocator(args.allocator)
    env = environment()
    print(cpu_header(env, allocator))
    torch.manual_seed(0)
    rows_out, records = [], []
    for k, n in args.shapes:
        weights = torch.randn(args.experts, k, n)
        for rows in args.rows:
            x = torch.randn(args.experts, rows, k)
            products = {
                "native": lambda: [native_product(x[e], weights[e]) for e in range(args.experts)],
                "mkl": lambda: [x[e] @ weights[e] for e in range(args.experts)],
                "onednn": lambda: [onednn_linear(x[e], weights[e]) for e in range(args.experts)],
            }
            stats = measure_interleaved(products, warmup=1, repeats=args.repeats)
            flops = 2 * args.experts * rows * k * n
            rate = {name: flops / s["median"] / 1e9 for name, s in stats.items()}
            chosen = "native" if rows <= value("native_forward_max_rows") else "mkl/onednn"
            records.append({"k": k, "n": n, "rows": rows, "gflops": rate, "native_grouped_mm_takes": chosen})
            rows_out.append([f"{k} x {n}", rows, f"{rate['native']:.0f}", f"{rate['mkl']:.0f}",
                             f"{rate['onednn']:.0f}", f"{rate['native'] / rate['mkl']:.2f}", chosen])
    print_table(["weight", "rows", "native GFLOP/s", "MKL GFLOP/s", "oneDNN GFLOP/s", "native / MKL",
                 "native_grouped_mm takes"], rows_out)
    results = {"environment": env, "allocator": allocator, "experts": args.experts,
               "cells": records}
    write_results(args, results)

if __name__ == "__main__":
    main()
