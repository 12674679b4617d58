"""Every CPU backend of a Soft MoE layer on the same input, timed in the same process: the one "auto" takes
(``layer.backend_for(x)``) against each other one that can run it.

For each layer (dim, experts, hidden; relu MLP experts by default, as in the paper's MNIST model) one SoftMoE per
backend ("slots", "tokens", "cpu", "reference"; "cpu" is the fused one-pass mixing where
``softmoe.kernels.native_mixing_applies``, else the native slot path), all with the same weights, are timed
round-robin: the forward under no_grad, and forward+backward with every gradient reset to None first and a dense
upstream gradient (as ``bench_layer.py``). The table gives each backend's median time and its time over the
time of the backend "auto" takes; a ratio below 1 is a faster backend that "auto" leaves.

    python benchmarks/bench_backends.py                                  # the paper's MNIST layer, n = 2, 4, 8
    python benchmarks/bench_backends.py --isa avx512,avx2                # one fresh process per instruction set
    python benchmarks/bench_backends.py --layers 196,2,512 768,4,256 --tokens 4 --batch 256
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

from softmoe import SoftMoE  # noqa: E402

BACKENDS = ("slots", "tokens", "cpu", "reference")


def layer_spec(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"expected DIM,EXPERTS,HIDDEN with positive integers (e.g. 196,2,392), "
                                         f"got {text!r}")
    dim, experts, hidden = (int(p) for p in parts)
    return dim, experts, hidden


def time_layer(dim: int, experts: int, hidden: int, args) -> dict:
    """Every backend that runs this layer's input, timed round-robin -> the record of one table row group."""
    torch.manual_seed(0)
    base = SoftMoE(dim, experts, args.slots_per_expert, expert_hidden=hidden, activation=args.activation)
    x = torch.randn(args.batch, args.tokens, dim)
    grad = torch.randn(args.batch, args.tokens, dim)
    auto = base.backend_for(x)
    forward, forward_backward = {}, {}
    for backend in BACKENDS:
        layer = SoftMoE(dim, experts, args.slots_per_expert, expert_hidden=hidden, activation=args.activation,
                        backend=backend)
        layer.load_state_dict(base.state_dict())
        try:
            layer.backend_for(x)
        except ValueError:  # this backend cannot run the input (e.g. "native" without the native kernels)
            continue
        x_leaf = x.clone().requires_grad_(True)
        leaves = [*layer.parameters(), x_leaf]

        def fwd(layer=layer) -> None:
            with torch.no_grad():
                layer(x)

        def fwd_bwd(layer=layer, leaves=leaves, x_leaf=x_leaf) -> None:
            for t in leaves:
                t.grad = None
            layer(x_leaf).backward(grad)

        forward[backend], forward_backward[backend] = fwd, fwd_bwd
    return {
        "dim": dim, "experts": experts, "hidden": hidden, "auto": auto.name, "auto_reason": auto.reason,
        "fwd": measure_interleaved(forward, warmup=2, repeats=args.repeats),
        "fwdbwd": measure_interleaved(forward_backward, warmup=2, repeats=args.repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=layer_spec, nargs="+", default=[layer_spec(s) for s in
                        ("196,2,392", "196,4,196", "196,8,98")], help="DIM,EXPERTS,HIDDEN per layer")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4)
    parser.add_argument("--slots-per-expert", type=int, default=1)
    parser.add_argument("--activation", default="relu")
    parser.add_argument("--repeats", type=int, default=20, help="rounds (median reported)")
    parser.add_argument("--json", type=Path, help="also write the results as JSON here")
    add_process_arguments(parser)
    argv = sys.argv[1:]
    args = parser.parse_args(argv)
    if min(args.batch, args.tokens, args.slots_per_expert, args.repeats) < 1:
        parser.error("--batch, --tokens, --slots-per-expert and --repeats must be positive")
    if run_children(parser, args, argv):
        return
    allocator = apply_allocator(args.allocator)
    env = environment()
    print(f"{cpu_header(env, allocator)}; batch {args.batch} x {args.tokens} tokens, {args.activation} experts, "
          f"{args.slots_per_expert} slot(s) per expert; median of {args.repeats} rounds")
    records, rows = [], []
    for dim, experts, hidden in args.layers:
        record = time_layer(dim, experts, hidden, args)
        records.append(record)
        auto = record["auto"]
        for backend in record["fwd"]:
            fwd, fwdbwd = record["fwd"][backend]["median"], record["fwdbwd"][backend]["median"]
            rows.append([
                f"{dim}, {experts}, {hidden}", backend + (" (auto)" if backend == auto else ""),
                f"{1e3 * fwd:.2f}", f"{1e3 * fwdbwd:.2f}",
                f"{fwd / record['fwd'][auto]['median']:.2f}", f"{fwdbwd / record['fwdbwd'][auto]['median']:.2f}",
            ])
    print_table(["dim, experts, hidden", "backend", "fwd ms", "fwd+bwd ms", "fwd / auto's", "fwd+bwd / auto's"],
                rows)
    results = {"environment": env, "allocator": allocator, "batch": args.batch, "tokens": args.tokens,
               "layers": records}
    write_results(args, results)

if __name__ == "__main__":
    main()
