"""Training speed of the Soft MoE ViT-S/16 against the dense ViT-S/16 at the same batch: time per step and its ratio.

Usage::

    python benchmarks/bench_vit_train.py --device cuda                  # bf16 autocast, compiled, batch 128
    python benchmarks/bench_vit_train.py --device cuda --no-compile     # eager
    python benchmarks/bench_vit_train.py --batch 4 --image-size 64 --no-compile   # a short run on the CPU

The Soft MoE model is ``softmoe.models.vit.soft_moe_vit("S/16", num_experts=128)``: Soft MoE layers in the second
half of the blocks (as in the Soft MoE paper), one slot per expert, experts of the ViT's MLP size (1536, GELU with
tanh), a global-average-pooling head. The dense model is ``vit("S/16", classifier="gap")``: the same blocks with MLPs,
the same head. Both see the same random images and labels.

A step is what a training loop runs: the forward under autocast (bf16 on CUDA unless ``--dtype float32``; off on the
CPU), cross-entropy, the backward, an AdamW step (fused on CUDA), and the gradients set to None; the forward and
backward alone are timed too (the Soft MoE model has 923M parameters against 22M, so its optimizer step is a large
share of its step). With ``--compile`` (the default) the
models are ``torch.compile``d (default mode, the optimizer step eager); the warm-up steps compile them. The two
models then run round-robin, each step ending with a device synchronization (``common.measure_interleaved``), and the
table gives the median ms per step, images per second and the ratio Soft MoE / dense, held to RATIO_TARGET. The
Soft MoE papers report about 1.4x at inference on TPU; a public port measured +44% on an A100.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import environment, measure_interleaved, print_table  # noqa: E402

from softmoe.checkpoint import write_json  # noqa: E402
from softmoe.models.vit import count_parameters, soft_moe_vit, vit  # noqa: E402

# The target: a Soft MoE step at most this many times the dense step.
RATIO_TARGET = 1.3
NUM_CLASSES = 1000


def train_steps(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, autocast: torch.dtype | None
                ) -> tuple[Callable[[], None], Callable[[], None]]:
    """(a training step, its forward and backward alone) of ``model`` on (images, labels): the forward under
    ``autocast`` where given, cross-entropy, the backward, then in the step an AdamW step (fused on CUDA), the
    gradients set to None in both."""
    device_type = images.device.type
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device_type == "cuda")

    def forward_backward() -> None:
        context = (torch.autocast(device_type, dtype=autocast) if autocast is not None
                   else contextlib.nullcontext())
        with context:
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()

    def step() -> None:
        forward_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def gradients_only() -> None:
        forward_backward()
        optimizer.zero_grad(set_to_none=True)

    return step, gradients_only


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="autocast dtype (default: bfloat16 on CUDA, float32 (no autocast) on the CPU)")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile both models (default on)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each model (compilation included)")
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each model, round-robin")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("batch", "image_size", "experts", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.image_size % 16:
        parser.error(f"--image-size must be a multiple of the patch size 16, got {args.image_size}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    autocast = None if dtype_name == "float32" else getattr(torch, dtype_name)

    torch.manual_seed(0)
    sizes = {"image_size": args.image_size, "num_classes": NUM_CLASSES, "device": device}
    models = {"soft moe": soft_moe_vit("S/16", num_experts=args.experts, **sizes),
              "dense": vit("S/16", classifier="gap", **sizes)}
    images = torch.randn(args.batch, 3, args.image_size, args.image_size, device=device)
    labels = torch.randint(0, NUM_CLASSES, (args.batch,), device=device)
    steps = {}
    for name, model in models.items():
        model.train()
        run = torch.compile(model) if args.compile else model
        steps[name], steps[f"{name} fwd+bwd"] = train_steps(run, images, labels, autocast)

    env = environment()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else env["cpu"]
    print(f"# ViT-S/16 training steps, Soft MoE ({args.experts} experts, one slot each, blocks 6-11) against dense | "
          f"{where} | torch {env['torch']} | {dtype_name} | {'compiled' if args.compile else 'eager'} | batch "
          f"{args.batch}, {args.image_size} px | {env['date']}", flush=True)
    stats = measure_interleaved(steps, warmup=args.warmup, repeats=args.repeats, device=device)
    ms = {name: 1e3 * s["median"] for name, s in stats.items()}
    ratio = ms["soft moe"] / ms["dense"]
    rows = [[name, f"{count_parameters(models[name]) / 1e6:.1f}M"]
            + [f"{ms[key]:.1f} ± {1e3 * stats[key]['std']:.1f}" for key in (name, f"{name} fwd+bwd")]
            + [f"{args.batch / ms[name] * 1e3:.0f}"] for name in models]
    print_table(["model", "parameters", "ms per step (median ± std)", "fwd+bwd alone", "images / s"], rows)
    verdict = "PASS" if ratio <= RATIO_TARGET else "FAIL"
    print(f"Soft MoE / dense time per step: {ratio:.2f} (target <= {RATIO_TARGET}: {verdict}); forward and backward "
          f"alone: {ms['soft moe fwd+bwd'] / ms['dense fwd+bwd']:.2f}")
    results = {"environment": env | {"device": str(device), "dtype": dtype_name}, "compiled": args.compile,
               "batch": args.batch, "image_size": args.image_size, "experts": args.experts,
               "parameters": {name: count_parameters(model) for name, model in models.items()}, "ms": ms,
               "ratio": ratio, "target": RATIO_TARGET}
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
