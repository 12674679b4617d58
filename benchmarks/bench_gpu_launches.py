"""Eager Soft MoE calls on a CUDA GPU are bound by the host's kernel launches: count them and time the router.

Usage (on a machine with a CUDA device)::

    python benchmarks/bench_gpu_launches.py

Table 1: for the paper's MNIST layer at n = 8 (batch 256, 4 tokens, dim 196, hidden 98, relu) in fp32 and bf16, the
CUDA kernels one eager call launches (torch profiler) and the time per call (200 calls after 10 warm-up ones, one
device synchronization at the end), for the forward, the forward+backward and Algorithm 1 at k = 2 (forward).

Table 2: the layer's time with the router's logits computed by the general path (``backend="slots"``: the norms of
the tokens and of phi's columns as separate ops, :func:`softmoe.layer.soft_moe_logits`) against the "cuda" backend's
(two fused RMS norms, ``softmoe.backends.cuda.rms_norm_logits``; the two backends' mixing is the same), in the same
process: 5 interleaved rounds of 50 calls each, median per call.

Table 3: inference (eval mode), same process, same rounds: the plain forward against Algorithm 1 at k = n/4 (plan
"auto" with autotuning on, ``softmoe.tuning.set_autotune(True)``: the plans timed once per shape, the faster run)
with its choice in torch's ops and in the routing kernel (``softmoe::routing_softmaxes``, one Triton kernel):
kernels per call, time, and Algorithm 1's speed against the plain forward.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import softmoe
import softmoe.backends.cuda as cuda_backend
from softmoe.tuning import set_autotune


def cuda_kernels(fn) -> int:
    """The number of CUDA kernels (and copies) one call of ``fn`` launches, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def microseconds_per_call(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def calls(layer: softmoe.SoftMoE, x: torch.Tensor) -> dict:
    """{name: fn} for the forward and the forward+backward of ``layer`` on ``x``."""
    x_grad = x.clone().requires_grad_(True)

    def forward() -> None:
        with torch.no_grad():
            layer(x)

    def forward_backward() -> None:
        layer(x_grad).float().sum().backward()

    return {"fwd": forward, "fwd+bwd": forward_backward}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device and torch sees none")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for name, dtype in dtypes.items():
        torch.manual_seed(0)
        layer = softmoe.SoftMoE(196, 8, 1, expert_hidden=98, activation="relu").to("cuda", dtype)
        x = torch.randn(256, 4, 196, device="cuda", dtype=dtype)

        def algorithm1() -> None:
            with torch.no_grad(), softmoe.select_experts(layer, k=2):
                layer(x)

        for call_name, fn in (calls(layer, x) | {"Algorithm 1 k=2 fwd": algorithm1}).items():
            print(f"MNIST n=8 {name} {call_name}: {cuda_kernels(fn)} kernels, {microseconds_per_call(fn):.0f} us/call")
    shapes = {"MNIST n=8 b256": (256, 4, 196, 8, 98), "ViT-S b128": (128, 196, 384, 128, 1536)}
    for label, (batch, tokens, dim, experts, hidden) in shapes.items():
        for name, dtype in dtypes.items():
            torch.manual_seed(0)
            layer = softmoe.SoftMoE(dim, experts, 1, expert_hidden=hidden, activation="relu").to("cuda", dtype)
            x = torch.randn(batch, tokens, dim, device="cuda", dtype=dtype)
            for call_name, fn in calls(layer, x).items():
                times = {"slots": [], "cuda": []}
                for _ in range(5):
                    for backend in times:
                        layer.backend = backend  # the general logits ("slots") or the fused RMS norms ("cuda")
                        times[backend].append(microseconds_per_call(fn, 50))
                general, rms = (sorted(times[backend])[2] for backend in ("slots", "cuda"))
                print(f"{label} {name} {call_name}: general {general:.0f} us, fused RMS norms {rms:.0f} us, "
                      f"{general / rms:.2f}x")
    previous = set_autotune(True)
    try:
        routing_kernel_table(dtypes)
    finally:
        set_autotune(previous)
    return 0


def interleaved(fns: dict[str, object], rounds: int = 5, calls: int = 50) -> dict[str, float]:
    """{name: median us per call} of the functions timed in turn, ``rounds`` rounds of ``calls`` calls each."""
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(microseconds_per_call(fn, calls))
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}


def routing_kernel_table(dtypes: dict[str, torch.dtype]) -> None:
    """Table 3 (module doc): the plain forward, and Algorithm 1 with its choice in torch's ops
    (``fused_routing_applies`` patched to False) and in the routing kernel, timed in turn."""
    shapes = {"MNIST n=8 b256": (256, 4, 196, 8, 98, "relu"), "Table 3 layer b1": (1, 197, 768, 8, 30720, "gelu_tanh"),
              "Table 3 layer b100": (100, 197, 768, 8, 30720, "gelu_tanh"),
              "ViT-S b128": (128, 196, 384, 128, 1536, "relu")}
    applies = cuda_backend.fused_routing_applies
    print("| shape | dtype | k | fwd: kernels, us | Algorithm 1, torch's ops: kernels, us, speed vs fwd "
          "| Algorithm 1, routing kernel: kernels, us, speed vs fwd |")
    print("|---|---|---:|---:|---:|---:|")
    try:
        for label, (batch, tokens, dim, experts, hidden, activation) in shapes.items():
            for name, dtype in dtypes.items():
                torch.manual_seed(0)
                with torch.device("cuda"):
                    layer = softmoe.SoftMoE(dim, experts, 1, expert_hidden=hidden,
                                            activation=activation).to(dtype).eval()
                x = torch.randn(batch, tokens, dim, device="cuda", dtype=dtype)
                k = max(1, experts // 4)

                def call(rule, selection: bool) -> None:
                    cuda_backend.fused_routing_applies = rule
                    with torch.no_grad(), softmoe.select_experts(layer, k=k if selection else None,
                                                                 strategy="combine" if selection else "all"):
                        layer(x)

                variants = {"fwd": lambda: call(applies, False),
                            "torch ops": lambda: call(lambda *args: False, True),
                            "routing kernel": lambda: call(applies, True)}
                counts = {path: cuda_kernels(fn) for path, fn in variants.items()}
                times = interleaved(variants)
                cells = [f"{counts[path]}, {times[path]:.0f}" + ("" if path == "fwd" else
                                                                f", {times['fwd'] / times[path]:.2f}x")
                         for path in variants]
                print(f"| {label} | {name} | {k} | " + " | ".join(cells) + " |")
    finally:
        cuda_backend.fused_routing_applies = applies


if __name__ == "__main__":
    sys.exit(main())
