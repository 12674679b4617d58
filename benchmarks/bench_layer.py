"""Speed of ``softmoe.SoftMoE`` on CPU against the published peer packages, a per-expert Python loop, a dense MLP
and the machine's roofline, per instruction set and allocator.

Usage::

    python benchmarks/bench_layer.py            # full run, the host's ISA, default allocator
    python benchmarks/bench_layer.py --quick    # short run
    python benchmarks/bench_layer.py --isa avx512,avx2 --allocator default,tuned --json results.json

Every (``--isa``, ``--allocator``) pair runs in a fresh process of its own, one after the other (``avx2`` limits
softmoe's kernels and torch's MKL, oneDNN and ATen kernels to AVX2, so an AVX-512 host times what an AVX2 host
runs; ``tuned`` calls ``softmoe.runtime.tune_cpu_allocator()`` first, ``default`` leaves glibc as it comes; with
``tuned`` leave n = 512 out of ``--mnist-experts``: the soft-moe peer's backward there writes a full-size zero gradient
of its (256, 512, 1, 196) slots for each of the 512 expert slices ``xs[:, i]``, the pattern under which the tuned heap
fragments, and its process grows past 24 GiB, where the default allocator's peaks at 1.5 GiB); a
summary puts them side by side and holds the ViT-S forward+backward of the default allocator to within 1.1x of the
tuned one, each as a multiple of its own process's roofline (on a shared host the memory bandwidth can differ by
1.5x between two processes a minute apart; the time ratio is printed too). In each process, for every shape, it
times the forward pass (under ``torch.no_grad``) and forward+backward (``out.backward(grad)`` with ``x`` requiring
grad and all gradients reset to None before each step) of:

- ``softmoe.SoftMoE`` itself;
- the published peers installed (``make peers``; ``benchmarks/peers.py``) at the same shape: soft-moe-pytorch and
  soft-moe (MLP experts in a Python loop; the faster of them is the row's "best peer") and soft-mixture-of-experts
  (one linear map per expert: less work, shown but not counted);
- ``loop``: the same layer math as the public ports write it, the layer's own routing (``layer.route``)
  followed by a Python loop over an ``nn.ModuleList`` of ``n`` pairs of ``nn.Linear`` holding the layer's expert
  weights (its outputs are checked against the layer's);
- ``dense``: a dense MLP ``nn.Linear(d, h') -> act -> nn.Linear(h', d)`` applied to all ``batch*tokens`` tokens,
  with ``h' = n*p*hidden / tokens`` so that its FLOPs equal those of the layer's experts;

all round-robin, in a new random order each round, two calls of each in a row: the second call is the one timed
(the function running again and again, as in a training loop or under ``timeit``); the first, right after another
function (caches holding that one's data, the thread pool possibly asleep), is reported apart as "cold" (on the
2-core AMD EPYC Zen 5 VM that costs the fastest contender most: MNIST n = 256 fwd+bwd 5.9 ms warm, 6.6 ms after a
16 MiB cache flush, 6.5 ms after 50 ms idle, 7.2 ms after a peer's step; the peers 1-3%). Right before and right after
each shape it measures the machine's limits (fp32 2048^3 GFLOP/s of ``torch.matmul`` or oneDNN's, whichever is
faster; ``copy_`` bandwidth of 256 MB, read+write bytes, and the read bandwidth of a ``sum``), so that a row and its
limits see the same load (on a shared host the measured limits drift by up to 1.5x from minute to minute). All of
this is done in two sweeps over the shapes (``--sweeps``), a minute or more apart, so that one slow stretch of the
host cannot spoil a whole row: a row reports each function's minimum over the rounds of all its sweeps and is held
to the best limits read in any of them (four readings of each).

Definitions (B batch, M tokens, D dim, N experts, P slots per expert, H expert hidden size, fp32 = 4 bytes):

- FLOPs per forward, slot formulation (the useful work, whichever path the layer takes):
  logits 2*B*M*D*N*P + dispatch 2*B*M*N*P*D + combine 2*B*M*N*P*D + experts 2*B*N*P*(2*D*H).
  Forward+backward = 3 x forward.
- Bytes, compulsory traffic: forward reads x and all parameters and writes the output:
  4*(params + 2*B*M*D). Forward+backward: 4*(3*params + 4*B*M*D) (parameters read twice, gradients written;
  x and output read/written with their gradients).
- Roofline time = max(FLOPs / matmul peak, bytes / B), with the row's limits, B the bandwidth of a ``sum`` over
  a tensor of as many bytes as the row's expert weights (read beside the row: a short probe catches bursts of a
  shared host that a stream of hundreds of MB never sees); "x roofline" = measured time / roofline.
- Speed-up vs loop = loop time / layer time; dense-MLP ratio = layer time / dense MLP time (fwd, fwd+bwd).
- Forward floor (rows whose mixing is the slot formulation, "slots" or "native"): the expert products alone (the backend's batched
  expert matmuls on the row's slots, timed in the same rounds as the forward) and the time to read the expert weights once at the read bandwidth
  (``sum`` of 256 MB, bytes read), each as a multiple of the forward roofline. The roofline's bandwidth is the copy
  probe's, which counts written bytes too. No implementation reads its weights faster than the read floor; where
  the products alone approach a target, this one can meet it only by running the routing inside the weight stream.
- backend: the mixing "auto" runs for the row (``layer.backend_for(x)``, see ``softmoe.backends``): "fused"
  (the one-pass native mixing of small relu experts), "native" (the slot formulation with the native expert matmul
  for few rows through large weights), "slots" (dispatch, batched experts, combine) or "tokens" (the exact
  token-space rewrite).
- other load: cores kept busy by other processes while a row was timed (from /proc/stat); above 0.2 the row's
  multi-threaded timings are inflated and the script says so.

Shapes: the MNIST layer of "Beyond Parameter Count" (batch 256, 4 tokens, dim 196, n = 2, 4, ..., 512 experts
with 1 slot each, hidden = max(1, round(784 / n)) as in the paper's model (softmoe.models.mnist), relu) and a
ViT-S/16 Soft MoE layer (batch 8, 196 tokens, dim 384, 128 experts, 1 slot, hidden 1536, gelu).

Targets, fp32 (PASS/FAIL per row): ViT-S forward within 1.3x of roofline and forward+backward within 1.6x;
forward+backward within 2x of roofline at every MNIST shape; at most 0.5x the best peer's time, forward and
forward+backward, or within 1.1x of the experts' FLOP roofline (2BNP(2DH) FLOPs forward, 3x that forward+backward,
at the row's matmul peak) where that bound is slower; faster than the loop at every shape, by at least 1.5x at
n >= 64.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    OtherLoad,
    add_process_arguments,
    apply_allocator,
    environment,
    machine_limits,
    measure,
    measure_interleaved,
    passed_on,
    print_table,
    process_settings,
    roofline_seconds,
    run_processes,
)
from peers import MLP_PEERS, build_peers  # noqa: E402

import softmoe  # noqa: E402
from softmoe.kernels import expert_matmul  # noqa: E402
from softmoe.models.mnist import expert_hidden_for  # noqa: E402

# The layer's time as a fraction of the fastest published MLP peer's (benchmarks/peers.py) that a row must meet, or,
# where that bound asks for more than the hardware gives, a multiple of the experts' FLOP roofline: whichever bound
# is slower.
PEER_TARGET = 0.5
PEER_ROOFLINE_SLACK = 1.1
# Calls of each function in a row per round: the first (cold) is reported apart, the second is the row's time.
BURST = 2
# Cores kept busy by other processes above which a row's timings are flagged as unreliable.
OTHER_LOAD_LIMIT = 0.2
ACTIVATION_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh")}


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    tokens: int
    dim: int
    experts: int
    slots: int
    hidden: int
    activation: str


def mnist_shapes(ns: list[int]) -> list[Shape]:
    return [Shape("MNIST", 256, 4, 196, n, 1, expert_hidden_for(196, n), "relu") for n in ns]


VIT_S = Shape("ViT-S/16", 8, 196, 384, 128, 1, 1536, "gelu")


class LoopSoftMoE(nn.Module):
    """The layer's math with a Python loop over an ``nn.ModuleList`` of experts (as the public ports do it).

    Routing is the layer's own (``layer.route``: shared ``phi`` and ``scale``); the experts are copies of the
    layer's expert weights as ``nn.Linear`` pairs, so the output equals the layer's.
    """

    def __init__(self, layer: softmoe.SoftMoE) -> None:
        super().__init__()
        self.__dict__["router"] = layer  # not a submodule: only its routing is used
        ex = layer.experts
        self.n, self.p, self.d = layer.num_experts, layer.slots_per_expert, layer.dim
        self.experts = nn.ModuleList()
        with torch.no_grad():
            for j in range(self.n):
                # Built on the meta device (no random init of weights that are overwritten next), then allocated.
                first = nn.Linear(ex.dim, ex.hidden, device="meta").to_empty(device=ex.weight1.device)
                second = nn.Linear(ex.hidden, ex.dim, device="meta").to_empty(device=ex.weight1.device)
                first.weight.copy_(ex.weight1[j].T)
                first.bias.copy_(ex.bias1[j])
                second.weight.copy_(ex.weight2[j].T)
                second.bias.copy_(ex.bias2[j])
                self.experts.append(nn.Sequential(first, ACTIVATION_MODULES[ex.activation](), second))

    def routing_parameters(self) -> list[nn.Parameter]:
        return [p for p in (self.router.phi, self.router.scale) if p is not None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        routing = self.router.route(x)
        dispatch, combine = routing.dispatch.flatten(2), routing.combine.flatten(2)
        slots = torch.bmm(dispatch.transpose(1, 2), x).view(batch, self.n, self.p, self.d)
        # Iterating over a tensor unbinds it (one UnbindBackward, not n full-size zero gradients of a select).
        outs = [expert(chunk) for expert, chunk in zip(self.experts, slots.transpose(0, 1))]
        expert_out = torch.stack(outs, dim=1).view(batch, self.n * self.p, self.d)
        return torch.bmm(combine, expert_out)


def dense_mlp(shape: Shape) -> nn.Module:
    hidden = max(1, round(shape.experts * shape.slots * shape.hidden / shape.tokens))
    return nn.Sequential(
        nn.Linear(shape.dim, hidden), ACTIVATION_MODULES[shape.activation](), nn.Linear(hidden, shape.dim)
    )


def expert_flops(s: Shape) -> float:
    """Forward FLOPs of the experts alone: 2BNP(2DH)."""
    return float(2 * s.batch * s.experts * s.slots * (2 * s.dim * s.hidden))


def layer_flops(s: Shape) -> float:
    """Forward FLOPs of the slot formulation (see the module docstring)."""
    b, m, d, n, p = s.batch, s.tokens, s.dim, s.experts, s.slots
    logits = 2 * b * m * d * n * p
    dispatch = 2 * b * m * n * p * d
    combine = 2 * b * m * n * p * d
    return float(logits + dispatch + combine) + expert_flops(s)


def parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def layer_bytes(s: Shape, layer: nn.Module, backward: bool) -> float:
    """Compulsory traffic in bytes (see the module docstring)."""
    param_bytes = parameter_bytes(layer)
    act_bytes = s.batch * s.tokens * s.dim * next(layer.parameters()).element_size()
    return float(3 * param_bytes + 4 * act_bytes) if backward else float(param_bytes + 2 * act_bytes)


def step_fns(module: nn.Module, params: list[torch.Tensor], x: torch.Tensor, grad: torch.Tensor):
    """(forward under no_grad, forward+backward with gradients reset to None first) for ``module``."""
    x_req = x.detach().clone().requires_grad_(True)
    leaves = [*params, x_req]

    def forward() -> None:
        with torch.no_grad():
            module(x)

    def forward_backward() -> None:
        for t in leaves:
            t.grad = None
        module(x_req).backward(grad)

    return forward, forward_backward


def check_targets(s: Shape, row: dict) -> str:
    failures = []
    if s.name == "ViT-S/16":
        if row["fwd_x_roofline"] > 1.3:
            failures.append(f"fwd {row['fwd_x_roofline']:.2f}x>1.3")
        if row["fwdbwd_x_roofline"] > 1.6:
            failures.append(f"fwd+bwd {row['fwdbwd_x_roofline']:.2f}x>1.6")
    elif row["fwdbwd_x_roofline"] > 2.0:
        failures.append(f"fwd+bwd {row['fwdbwd_x_roofline']:.2f}x>2")
    for key, label in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
        ratio, bound = row[f"{key}_vs_best_peer"], row[f"{key}_peer_bound_ms"]
        if ratio is not None and row[f"{key}_ms"] > bound:
            failures.append(f"{label} {ratio:.2f}x best peer>{PEER_TARGET} ({row[f'{key}_ms']:.2f}>{bound:.2f} ms)")
    need = 1.5 if s.experts >= 64 else 1.0
    for key, label in (("fwd_speedup_vs_loop", "fwd"), ("fwdbwd_speedup_vs_loop", "fwd+bwd")):
        ok = row[key] >= need if need > 1.0 else row[key] > 1.0
        if not ok:
            failures.append(f"{label} vs loop {row[key]:.2f}x<{need}")
    return "PASS" if not failures else "FAIL: " + "; ".join(failures)


def measure_shape(
    s: Shape, warmup: int, repeats: int, limit_repeats: int, budget_s: float | None = None, seed: int = 0
) -> dict:
    """One sweep of one shape: the limits, the round-robin timings of both passes, the limits again.

    The modules are rebuilt from ``seed`` on every call, so every sweep of a shape times the same weights.
    """
    torch.manual_seed(seed)
    layer = softmoe.SoftMoE(s.dim, s.experts, s.slots, expert_hidden=s.hidden, activation=s.activation)
    loop = LoopSoftMoE(layer)
    dense = dense_mlp(s)
    x = torch.randn(s.batch, s.tokens, s.dim)
    grad = torch.randn(s.batch, s.tokens, s.dim)

    with torch.no_grad():
        want, got = loop(x), layer(x)
        error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    if error > 1e-4:
        raise AssertionError(f"{s}: loop baseline differs from the layer (relative error {error:.2e})")
    del want, got

    peers, missing = build_peers(s.dim, s.experts, s.slots, s.hidden, s.activation)
    modules = {"layer": layer, "loop": loop, "dense": dense} | peers
    params = {name: list(module.parameters()) for name, module in modules.items()}
    params["loop"] += loop.routing_parameters()
    fns = {name: step_fns(module, params[name], x, grad) for name, module in modules.items()}
    choice = layer.backend_for(x)
    path = choice.backend.mixing(layer, x)
    forwards = {k: v[0] for k, v in fns.items()}
    if path in ("slots", "native"):
        forwards["experts"] = expert_products(layer, x, native=path == "native")
    volume = torch.empty(parameter_bytes(layer.experts) // 4)
    volume.fill_(1.0)
    with OtherLoad() as other:
        before = machine_limits(limit_repeats) | {"volume_read_bytes_per_s": read_rate(volume)}
        fwd = measure_interleaved(forwards, warmup, repeats, budget_s, burst=BURST)
        fwdbwd = measure_interleaved({k: v[1] for k, v in fns.items()}, warmup, repeats, budget_s, burst=BURST)
        after = machine_limits(limit_repeats) | {"volume_read_bytes_per_s": read_rate(volume)}
    return {
        "backend": path,
        "dense_hidden": dense[0].out_features,
        "loop_relative_error": error,
        "fwd_bytes": layer_bytes(s, layer, backward=False),
        "fwdbwd_bytes": layer_bytes(s, layer, backward=True),
        "expert_weight_bytes": parameter_bytes(layer.experts),
        "times": {"fwd": fwd, "fwdbwd": fwdbwd},
        "limits": [before, after],
        "other_load": other.value,
        "peers_missing": missing,
    }


def read_rate(volume: torch.Tensor) -> float:
    """Bytes per second of a ``sum`` over ``volume`` (as many bytes as the row's expert weights), best of 5."""
    return volume.numel() * volume.element_size() / measure(volume.sum, warmup=1, repeats=5)["min"]


def summarize_shape(s: Shape, sweeps: list[dict]) -> dict:
    """The row of a shape from its sweeps: per function the fastest time of any sweep, the best limits read."""
    first = sweeps[0]
    readings = [limits for sweep in sweeps for limits in sweep["limits"]]
    limits = {key: max(r[key] for r in readings)
              for key in ("flops_per_s", "bytes_per_s", "read_bytes_per_s", "volume_read_bytes_per_s")}
    for key in ("matmul", "copy", "read"):
        limits[key] = f"{first['limits'][0][key]}, best of {len(readings)} readings"
    times = {}
    for key in ("fwd", "fwdbwd"):
        times[key] = {}
        for name in first["times"][key]:
            per_sweep = [sw["times"][key][name] for sw in sweeps]
            times[key][name] = {"min": min(t["min"] for t in per_sweep),
                                "cold_min": min(t["cold"]["min"] for t in per_sweep), "sweeps": per_sweep}
    loads = [sw["other_load"] for sw in sweeps if sw["other_load"] is not None]
    flops = layer_flops(s)
    row = {
        "shape": s.name,
        "batch": s.batch,
        "tokens": s.tokens,
        "dim": s.dim,
        "experts": s.experts,
        "slots": s.slots,
        "hidden": s.hidden,
        "activation": s.activation,
        "backend": first["backend"],
        "dense_hidden": first["dense_hidden"],
        "loop_relative_error": first["loop_relative_error"],
        "fwd_flops": flops,
        "fwdbwd_flops": 3 * flops,
        "fwd_bytes": first["fwd_bytes"],
        "fwdbwd_bytes": first["fwdbwd_bytes"],
        "sweeps": len(sweeps),
        "times": times,
        "limits": limits,
        "limit_readings": readings,
        "other_load": max(loads) if loads else None,
        "peers_missing": first["peers_missing"],
    }
    for key, nflops in (("fwd", flops), ("fwdbwd", 3 * flops)):
        cold = times[key]["layer"]["cold_min"]
        row[f"{key}_cold_ms"] = 1e3 * cold
        cold_peers = [times[key][name]["cold_min"] for name in MLP_PEERS if name in times[key]]
        row[f"{key}_cold_vs_best_peer"] = cold / min(cold_peers) if cold_peers else None
        t = times[key]["layer"]["min"]
        row[f"{key}_ms"] = 1e3 * t
        row[f"{key}_gflops"] = nflops / t / 1e9
        row[f"{key}_speedup_vs_loop"] = times[key]["loop"]["min"] / t
        row[f"{key}_dense_ratio"] = t / times[key]["dense"]["min"]
        mlp_peers = [times[key][name]["min"] for name in MLP_PEERS if name in times[key]]
        row[f"{key}_vs_best_peer"] = t / min(mlp_peers) if mlp_peers else None
        row[f"{key}_peers_ms"] = {name: 1e3 * times[key][name]["min"] for name in times[key]
                                  if name not in ("layer", "loop", "dense", "experts")}
    add_roofline(s, row, limits)
    if "experts" in times["fwd"]:
        weights, t = first["expert_weight_bytes"], times["fwd"]["experts"]["min"]
        row["fwd_experts_ms"] = 1e3 * t
        row["fwd_experts_x_roofline"] = row["fwd_experts_ms"] / row["fwd_roofline_ms"]
        row["experts_weights_gb_per_s"] = weights / t / 1e9
        row["fwd_weights_read_ms"] = 1e3 * weights / limits["read_bytes_per_s"]
        row["fwd_weights_read_x_roofline"] = row["fwd_weights_read_ms"] / row["fwd_roofline_ms"]
    return row


def expert_products(layer: softmoe.SoftMoE, x: torch.Tensor, native: bool) -> Callable[[], None]:
    """The forward's expert products alone (the layer's experts on its slots, under no_grad), slots built once:
    torch's batched matmuls, or with ``native`` the native expert matmul (activation fused) the backend runs."""
    experts = layer.experts
    with torch.no_grad():
        slots = softmoe.layer.dispatch_slots(x, layer.route(x).dispatch.flatten(2))
        rows = slots.view(x.shape[0], layer.num_experts, -1, layer.dim).transpose(0, 1).reshape(
            layer.num_experts, -1, layer.dim
        )

    def run() -> None:
        with torch.no_grad():
            if native:
                hidden = expert_matmul(rows, experts.weight1, experts.bias1, experts.activation)
                expert_matmul(hidden, experts.weight2, experts.bias2)
            else:
                layer.run_experts(slots)

    return run


def add_roofline(s: Shape, row: dict, limits: dict) -> None:
    """Set the roofline times, the measured/roofline ratios and the PASS/FAIL verdict of ``row``."""
    # Bytes are held to a read of the expert weights' volume measured beside the row (module doc).
    stream = limits | {"bytes_per_s": limits["volume_read_bytes_per_s"]}
    experts_flops = expert_flops(s)
    for key, passes in (("fwd", 1), ("fwdbwd", 3)):
        roof = roofline_seconds(row[f"{key}_flops"], row[f"{key}_bytes"], stream)
        row[f"{key}_roofline_ms"] = 1e3 * roof
        row[f"{key}_x_roofline"] = row[f"{key}_ms"] / 1e3 / roof
        row[f"{key}_cold_x_roofline"] = row[f"{key}_cold_ms"] / 1e3 / roof
        row[f"{key}_experts_flop_roofline_ms"] = 1e3 * passes * experts_flops / limits["flops_per_s"]
        peers = row[f"{key}_peers_ms"]
        best = min((peers[name] for name in MLP_PEERS if name in peers), default=None)
        row[f"{key}_peer_bound_ms"] = None if best is None else max(
            PEER_TARGET * best, PEER_ROOFLINE_SLACK * row[f"{key}_experts_flop_roofline_ms"]
        )
    row["targets"] = check_targets(s, row)


HEADERS = [
    "shape",
    "n",
    "h",
    "backend",
    "fwd ms",
    "fwd GFLOP/s",
    "fwd x roofline",
    "fwd speed-up vs loop",
    "fwd+bwd ms",
    "fwd+bwd GFLOP/s",
    "fwd+bwd x roofline",
    "fwd+bwd speed-up vs loop",
    "dense-MLP ratio fwd / fwd+bwd",
    "vs best peer fwd / fwd+bwd",
    "limits GFLOP/s / copy, read, weights-volume read GB/s",
    "other load",
    "targets",
]


def table_row(r: dict) -> list[str]:
    return [
        r["shape"],
        str(r["experts"]),
        str(r["hidden"]),
        r["backend"],
        f"{r['fwd_ms']:.2f}",
        f"{r['fwd_gflops']:.0f}",
        f"{r['fwd_x_roofline']:.2f}",
        f"{r['fwd_speedup_vs_loop']:.1f}x",
        f"{r['fwdbwd_ms']:.2f}",
        f"{r['fwdbwd_gflops']:.0f}",
        f"{r['fwdbwd_x_roofline']:.2f}",
        f"{r['fwdbwd_speedup_vs_loop']:.1f}x",
        f"{r['fwd_dense_ratio']:.2f} / {r['fwdbwd_dense_ratio']:.2f}",
        peer_ratio(r),
        f"{r['limits']['flops_per_s'] / 1e9:.0f} / {r['limits']['bytes_per_s'] / 1e9:.1f}, "
        f"{r['limits']['read_bytes_per_s'] / 1e9:.1f}, {r['limits']['volume_read_bytes_per_s'] / 1e9:.1f}",
        "n/a" if r["other_load"] is None else f"{r['other_load']:.2f}",
        r["targets"],
    ]


def peer_ratio(r: dict) -> str:
    if r["fwd_vs_best_peer"] is None:
        return "no peer installed"
    return f"{r['fwd_vs_best_peer']:.2f} / {r['fwdbwd_vs_best_peer']:.2f}"


def cold_row(r: dict) -> list[str]:
    peers = ("no peer installed" if r["fwd_cold_vs_best_peer"] is None
             else f"{r['fwd_cold_vs_best_peer']:.2f} / {r['fwdbwd_cold_vs_best_peer']:.2f}")
    return [r["shape"], str(r["experts"]), f"{r['fwd_cold_ms']:.2f} / {r['fwdbwd_cold_ms']:.2f}",
            f"{r['fwd_cold_x_roofline']:.2f} / {r['fwdbwd_cold_x_roofline']:.2f}", peers]


def floor_line(r: dict) -> str:
    """The forward floor of a slot-path row in words; the weights' read time only where it weighs (>= 0.5x)."""
    line = (
        f"{r['shape']} n={r['experts']}, forward floor: the expert products alone took {r['fwd_experts_ms']:.2f} ms"
        f" = {r['fwd_experts_x_roofline']:.2f}x the forward roofline"
    )
    if r["fwd_weights_read_x_roofline"] < 0.5:
        return line + "."
    return line + (
        f" (weights read at {r['experts_weights_gb_per_s']:.1f} GB/s); reading the expert weights once at the "
        f"measured read bandwidth ({r['limits']['read_bytes_per_s'] / 1e9:.1f} GB/s) takes "
        f"{r['fwd_weights_read_ms']:.2f} ms = {r['fwd_weights_read_x_roofline']:.2f}x."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats (well under a minute)")
    parser.add_argument("--json", metavar="PATH", help="also write all results as JSON to PATH")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--shapes", choices=["all", "mnist", "vit"], default="all")
    parser.add_argument("--mnist-experts", help="the MNIST rows' n, comma-separated (default 2, 4, ..., 512; "
                        "with --quick 2, 16, 128, 512)")
    parser.add_argument(
        "--sweeps", type=int, default=None, help="passes over all shapes, a row keeping each function's fastest "
        "time and the best limits of all its sweeps (default 2, 1 with --quick)"
    )
    add_process_arguments(parser)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.sweeps is None:
        args.sweeps = 1 if args.quick else 2
    if args.sweeps < 1:
        parser.error(f"--sweeps must be >= 1, got {args.sweeps}")
    try:
        process_settings(args)
    except ValueError as error:
        parser.error(str(error))
    if args.child_json is None:  # the parent: one fresh process per instruction set and allocator
        return summarize_processes(args, run_processes(args, passed_on(argv)))

    print(apply_allocator(args.allocator), flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment()
    limits = machine_limits(repeats=3 if args.quick else 10)
    print(
        f"{env['date']} | {env['cpu']} | {env['isa']} | {env['cores']} cores, torch {env['torch']} with "
        f"{env['torch_threads']} threads | fp32 | at start: matmul peak {limits['flops_per_s'] / 1e9:.0f} GFLOP/s ({limits['matmul']}), "
        f"copy bandwidth {limits['bytes_per_s'] / 1e9:.1f} GB/s ({limits['copy']})",
        flush=True,
    )

    ns = [2, 16, 128, 512] if args.quick else [2**k for k in range(1, 10)]
    if args.mnist_experts:
        ns = [int(n) for n in args.mnist_experts.split(",")]
    shapes = []
    if args.shapes in ("all", "mnist"):
        shapes += mnist_shapes(ns)
    if args.shapes in ("all", "vit"):
        shapes.append(VIT_S)

    sweeps: list[list[dict]] = [[] for _ in shapes]
    for sweep in range(args.sweeps):
        for s, measured in zip(shapes, sweeps):
            small = s.name == "MNIST"
            # (warm-up rounds, max rounds, seconds of timing after which rounds stop, per pass and sweep)
            if args.quick:
                warmup, repeats, budget = (1, 5, 0.5) if small else (1, 3, 2.0)
            else:
                warmup, repeats, budget = (3, 30, 4.0) if small else (2, 25, 15.0)
            measured.append(measure_shape(s, warmup, repeats, 3 if args.quick else 5, budget))
            layer_times = {key: 1e3 * measured[-1]["times"][key]["layer"]["min"] for key in ("fwd", "fwdbwd")}
            print(
                f"  sweep {sweep + 1}/{args.sweeps} {s.name} n={s.experts}: fwd {layer_times['fwd']:.2f} ms, "
                f"fwd+bwd {layer_times['fwdbwd']:.2f} ms ({measured[-1]['backend']})",
                file=sys.stderr,
                flush=True,
            )
    rows = [summarize_shape(s, measured) for s, measured in zip(shapes, sweeps)]

    print()
    print(
        "Times: min over the round-robin repeats of all sweeps, after warm-up, of the second of two calls in a "
        "row; FLOPs: slot formulation, per forward "
        "2BMDNP (logits) + 2BMNPD (dispatch) + 2BMNPD (combine) + 2BNP(2DH) (experts), fwd+bwd = 3x fwd; "
        "bytes (compulsory): fwd 4(params + 2BMD), fwd+bwd 4(3 params + 4BMD); x roofline = time / "
        "max(FLOPs/peak, bytes/bandwidth), with the best limits (matmul peak, copy bandwidth) measured right before "
        "and after the row in each sweep; speed-up vs loop = nn.ModuleList-loop time / layer time; dense-MLP ratio "
        "= layer time / time of a dense MLP with the experts' FLOPs; backend: the one layer.backend_for(x) names "
        "(native custom ops, slot formulation or token-space rewrite); "
        "other load: cores kept busy by other processes while the row was timed (> 0.2: timings inflated)."
    )
    print()
    print_table(HEADERS, [table_row(r) for r in rows], align="lrrl" + "r" * 12 + "l")
    print("\nFirst calls after another contender (cold; the table above times the second call of each pair):")
    print_table(["shape", "n", "fwd / fwd+bwd ms", "x roofline fwd / fwd+bwd", "vs best peer fwd / fwd+bwd"],
                [cold_row(r) for r in rows], align="lrrrr")
    passed = sum(r["targets"] == "PASS" for r in rows)
    print(f"\nTargets met on {passed}/{len(rows)} rows.")
    for r in rows:
        if "fwd_experts_ms" in r:
            print(floor_line(r))
    busy = [f"{r['shape']} n={r['experts']}" for r in rows if (r["other_load"] or 0.0) > OTHER_LOAD_LIMIT]
    if busy:
        print(
            f"WARNING: other processes kept more than {OTHER_LOAD_LIMIT} cores busy while timing {', '.join(busy)}: "
            "those multi-threaded timings are inflated; rerun on an idle machine."
        )

    for r in rows:
        if r["peers_missing"]:
            print(f"peers not timed for {r['shape']} n={r['experts']}: " + "; ".join(r["peers_missing"].values()))
            break
    with open(args.child_json, "w") as f:
        json.dump({"environment": env, "limits": limits, "quick": args.quick, "rows": rows}, f)
    return 0


def summarize_processes(args, results: list[dict]) -> int:
    """Print the rows of every (isa, allocator) process side by side, the default allocator against the tuned one
    where both ran, and write them all to --json."""
    print("\n==== summary ====")
    table = []
    for result in results:
        for r in result["rows"]:
            table.append([result["isa"], result["allocator"], r["shape"], str(r["experts"]), r["backend"],
                          f"{r['fwd_ms']:.2f}", f"{r['fwdbwd_ms']:.2f}",
                          f"{r['fwd_x_roofline']:.2f} / {r['fwdbwd_x_roofline']:.2f}", peer_ratio(r),
                          cold_row(r)[3], cold_row(r)[4], r["targets"]])
    print(f"{results[0]['environment']['cpu']}, {results[0]['environment']['date']}")
    print_table(["isa", "allocator", "shape", "n", "backend", "fwd ms", "fwd+bwd ms", "x roofline fwd / fwd+bwd",
                 "vs best peer fwd / fwd+bwd", "cold: x roofline", "cold: vs best peer", "targets"], table,
                align="llllrrrrrrrl")
    by_setting = {(r["isa"], r["allocator"]): r for r in results}
    for isa in dict.fromkeys(r["isa"] for r in results):
        if (isa, "default") in by_setting and (isa, "tuned") in by_setting:
            tuned = {(r["shape"], r["experts"]): r for r in by_setting[isa, "tuned"]["rows"]}
            for r in by_setting[isa, "default"]["rows"]:
                other = tuned.get((r["shape"], r["experts"]))
                if other is not None and r["shape"] == "ViT-S/16":
                    ratio = r["fwdbwd_ms"] / other["fwdbwd_ms"]
                    own = r["fwdbwd_x_roofline"] / other["fwdbwd_x_roofline"]
                    print(f"{isa}: {r['shape']} fwd+bwd, default allocator / tuned: {ratio:.2f} in time, {own:.2f} "
                          f"against each process's own limits (target <= 1.10 on the latter, which cancels the "
                          f"host's drift between the two processes: {'PASS' if own <= 1.10 else 'FAIL'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"processes": results}, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
