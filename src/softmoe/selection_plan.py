"""How a Soft MoE layer runs k of its n experts per input: the "selected" or the "dense" plan, whichever is cheaper.

Both plans give the same output (Algorithm 1's: unselected experts contribute nothing):

    "selected"  each expert runs on the slots of the inputs that keep it, grouped by expert
                (``MLPExperts.forward_selected``); an unselected (input, expert) pair costs nothing.
    "dense"     every expert runs on every slot, as in the plain forward, and the slots of unselected experts get
                zero combine weight: the plain forward's kernels, and no work saved but in one case: in inference
                the CPU's fused kernel for small relu experts (``softmoe.kernels.soft_moe_mixing``) groups the
                inputs by the experts they keep and skips, for each group of vector lanes, the experts none of its
                inputs keeps (at batch 1 all the unselected ones).

Skipping work pays only when enough of it is skipped. An expert product of r rows costs about as much as
max(r, floor) + ROW_OVERHEAD rows at full speed: below `floor` rows it is bound by reading the weight, which
costs the same whatever the rows, and ROW_OVERHEAD covers what every product costs beyond its rows (the selected
plan's grouping, one call per expert); plus a fixed CALL_FLOPS per expert for the bookkeeping of its group. With
F = 2 * (parameters per expert) FLOPs per row, batch B, p slots per expert and k of n experts kept:

    selected = F * (max(P * p, u * floor) + u * ROW_OVERHEAD) + u * CALL_FLOPS
    dense    = F * n * (max(B * p, floor) + ROW_OVERHEAD)

with P the (input, expert) pairs kept and u the experts in use (max(P * p, u * floor) is the sum over the
experts in use of max(their rows, floor) where the rows spread evenly), and the selected plan runs when
selected <= MARGIN * dense (the margin covers the gathers and sorting that only the selected plan does). P and u
are counted where host reads are free (CPU, eager); elsewhere their bounds B * k and min(n, B * k) stand in, so
the decision depends on shapes alone (no host synchronization; torch.compile makes it once per graph).

The CPU constants were fitted on an Intel Xeon (2 cores, AVX-512 and AVX2 only): one layer of Table 3's stack
(768 -> 6144 -> 768, 8 experts) at batch 1, 4, 16 and 100, every k, both plans timed against all experts
(docs/performance.md). With them the selected plan runs where it was measured 1.03-4.3x faster than all experts
and the dense plan elsewhere, which costs all experts plus choosing them (0-4% more there); the selected plan would
have been faster in 2 of 28 cells (AVX2 only: 3), by 8-20%. The CPU's floor is the float lanes of the native
kernels' variant (:func:`row_floor`): the native expert matmul, which runs the products of up to 16 rows (the
plain forward's) and of up to 48 (the selected plan's), kept its time flat up to 16 rows with AVX-512 but only up to
8 with AVX2 (AMD EPYC Zen 5, 768 x 6144 weights, AVX-512 / AVX2: 8 rows 148 / 112 GFLOP/s, 16 rows 254 / 152;
before the tile copy of the kernel's row passes 4 rows 58 / 54, 8 rows 119 / 108, 16 rows 226 / 126), and a floor of
16 with AVX2 left the selected plan untaken at batch 16 where it ran 1.13-1.89x as fast as all experts (k = 1-5). On
CUDA under torch.compile (CUDA graphs, bf16 grouped GEMM) the selected plan is taken with a row overhead of 256 (and
no floor) where it costs at most 0.4x the dense one: Table 3's stack at batch 1 ran the selected plan 1.16-1.23x as
fast as all experts at k = 2 (cost ratio 0.25) but 0.93-1.00x at k = 4 (ratio 0.5), no better than the dense plan
ran at k = 6 (0.98x; H100, two sessions); k = 3 (ratio 0.375) was not measured, and on an H200 the selected plan
lost at k = 2 too (0.91x).

Eager CUDA calls are bound by the host's launches at small sizes and by the GPU's arithmetic at large ones (float32
at batch 100), and where one turns into the other depends on the GPU, its host and the dtype: no FLOP count sees it.
There "auto" times both plans (:func:`timed_plan`, as ``torch.backends.cudnn.benchmark`` times convolutions): once
per shape, at its first call, which synchronizes with the device; later calls of that shape run the faster plan
without timing. Where a synchronization is unwanted (CUDA's sync debug mode set, a CUDA graph being captured) a
shape not yet timed takes the dense plan, untimed; so does every shape with deterministic algorithms on (the plans
round differently). A plan that runs out of memory while timed loses, and the selected plan replaces the dense
one only where it took at most TIMED_MARGIN of its time. Eager CPU calls time the plans the same way where the
cost model's call is close (:func:`worth_timing`: its selected cost, from the call's own kept counts, within a
factor TIMING_BAND of MARGIN times the dense one): its constants, fitted on one host, misjudged such shapes on
another (the AMD EPYC Zen 5: batch 16, k = 1 with AVX-512, the selected plan 1.08x as fast as all experts and the
dense one it chose 0.96x; batch 100, k = 6 with AVX2, the selected plan it chose 0.93x, the dense one 0.99x), and
timing them costs 12 runs of the plans once per shape, threads and instruction set of the kernels. Timing runs the
experts again, so a layer times only in eval mode (in training a forward would draw the experts' dropout anew);
the plans agree to rounding, so where they are timed the output may differ in its last bits from run to run.

On an H200 (docs/performance.md) the timing took the selected plan for one layer of Table 3's stack in float32 at
batch 100, k <= 5 (1.17-1.46x as fast as all experts; the dense plan 0.99x), and the dense plan everywhere else
(the selected plan 0.41-0.84x at batch 1-16, 0.43-0.53x in bfloat16).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

import torch

from softmoe.kernels.build import LANES, cpu_isa
from softmoe.kernels.modes import host_reads_are_free, transforms_active

SELECTION_PLANS = ("auto", "selected", "dense")
# Per device type: the rows below which a product costs the same (reading its weight; on CPU with the native
# kernels their float lanes instead, see row_floor), the rows every product is worth beyond its own, the margin the
# selected plan must beat.
ROW_FLOOR = {"cpu": 16, "cuda": 0}
ROW_OVERHEAD = {"cpu": 2, "cuda": 256}
MARGIN = {"cpu": 0.85, "cuda": 0.4}
CALL_FLOPS = 1e7
# Selections of at most this many places are counted in Python where host reads are free (one read and a set: 1-7 us
# up to 256 places on an AMD EPYC Zen 5), larger ones with torch's bincount (7 us at any size).
HOST_COUNT_MAX_PLACES = 256


# Timed rounds of each plan after one untimed round, where "auto" times them (eager CUDA; eager CPU for close calls);
# the fastest round counts (with 3, AVX2 on the AMD EPYC Zen 5 took the dense plan for batch 16, k = 6 of Table 3's
# layer, 0.97x as fast as all experts where the selected one ran 1.04x, in one of five sweeps).
TIMED_ROUNDS = 5
# On CPU the plans are timed where the selected plan's cost lies within this factor of MARGIN times the dense one's.
TIMING_BAND = 1.4
# A timed plan replaces the default (the layer's: "dense", every expert and no more) only in at most this fraction of
# its time: on a 2-core host, timings of one plan scatter by a few percent (AVX2, batch 1, k = 7 of Table 3's layer:
# the selected plan, 0.94x as fast as all experts, was timed faster than the dense one, 0.98x, without it).
TIMED_MARGIN = 0.97
# The plan found faster per shape: {key: "selected" or "dense"} (see timed_plan).
_TIMED_PLANS: dict[Hashable, str] = {}
# How many times forget_timed_plans has run: plans remembered elsewhere for a timing (a layer's) name it.
_FORGOTTEN = 0


def check_plan(plan: str) -> None:
    if plan not in SELECTION_PLANS:
        raise ValueError(f"plan must be one of {SELECTION_PLANS}, got {plan!r}")


def row_floor(kind: str) -> int:
    """The rows below which an expert product costs what reading its weight costs, on ``kind`` ("cpu" or "cuda"):
    on CPU the float lanes of the native kernels' variant (16 with AVX-512, 8 with AVX2; module doc), else
    ``ROW_FLOOR``."""
    isa = cpu_isa() if kind == "cpu" else None
    return LANES[isa] if isa is not None else ROW_FLOOR[kind]


def plan_costs(
    batch: int,
    k: int,
    num_experts: int,
    slots_per_expert: int,
    flops_per_row: float,
    device: torch.device,
    kept: tuple[int, int] | None = None,
) -> tuple[float, float]:
    """The cost model's (selected, dense) costs in FLOPs (module doc), for ``batch`` inputs keeping ``k`` of
    ``num_experts`` experts each, ``slots_per_expert`` slots per expert, ``flops_per_row`` FLOPs per row per expert
    (2 x its parameters), on ``device``. ``kept``: the (input, expert) pairs kept and the experts in use, where they
    are known (else batch * k and min(n, batch * k), their upper bounds)."""
    kind = "cpu" if device.type == "cpu" else "cuda"
    pairs, used = kept if kept is not None else (batch * k, min(num_experts, batch * k))
    floor, overhead = row_floor(kind), ROW_OVERHEAD[kind]
    rows = pairs * slots_per_expert
    selected = flops_per_row * (max(rows, used * floor) + used * overhead) + used * CALL_FLOPS
    dense = flops_per_row * num_experts * (max(batch * slots_per_expert, floor) + overhead)
    return selected, dense


def selected_plan_is_cheaper(costs: tuple[float, float], device: torch.device) -> bool:
    """Whether the "selected" plan is expected to beat the "dense" one on ``device``, given their ``costs`` from
    :func:`plan_costs`: the selected one's at most MARGIN times the dense one's; on eager CUDA never (the plans are
    timed there instead)."""
    kind = "cpu" if device.type == "cpu" else "cuda"
    if kind == "cuda" and not torch.compiler.is_compiling():
        return False  # eager CUDA: the dense plan unless the plans were timed (plans_are_timed)
    selected, dense = costs
    return selected <= MARGIN[kind] * dense


def worth_timing(costs: tuple[float, float]) -> bool:
    """Whether an eager CPU shape whose plans are not timed yet should be (eager CUDA, which has no cost model,
    times every shape): the call is close, its (selected, dense) ``costs`` of :func:`plan_costs` within a factor
    TIMING_BAND of the margin (module doc)."""
    selected, dense = costs
    return dense / TIMING_BAND <= selected / MARGIN["cpu"] <= dense * TIMING_BAND


def counts_decide(fewest: tuple[float, float], most: tuple[float, float]) -> bool:
    """Whether the kept counts of a CPU call can change what plan "auto" does (the cost model's answer, or timing the
    call as a close one), given the (selected, dense) costs of :func:`plan_costs` at the fewest and at the most
    experts the selection may keep in use: not where even the fewest leave the selected plan's cost above
    :func:`worth_timing`'s band, nor where even the most leave it below."""
    cpu = torch.device("cpu")
    above = not worth_timing(fewest) and not selected_plan_is_cheaper(fewest, cpu)
    below = not worth_timing(most) and selected_plan_is_cheaper(most, cpu)
    return not (above or below)


def mask_from_subsets(selected: torch.Tensor, num_experts: int) -> torch.Tensor:
    """selected (batch, k) int64, -1 for an unused place -> bool mask (batch, n)."""
    keep = torch.zeros(selected.shape[0], num_experts + 1, dtype=torch.bool, device=selected.device)
    # -1 % (n + 1) = n (a floored remainder, as torch.remainder is): unused places land in the dropped column.
    return keep.scatter_(1, selected.remainder(num_experts + 1), True)[:, :num_experts]


def slot_mask(keep: torch.Tensor, slots_per_expert: int) -> torch.Tensor:
    """A mask over experts (batch, n) -> the same over their slots, (batch, 1, n * slots_per_expert)."""
    return (keep if slots_per_expert == 1 else keep.repeat_interleave(slots_per_expert, dim=1)).unsqueeze(1)


def kept_slots(selected: torch.Tensor, num_experts: int, slots_per_expert: int) -> torch.Tensor:
    """selected (batch, k) int64, -1 for an unused place -> bool (batch, 1, num_experts * slots_per_expert), True
    on the kept slots."""
    return slot_mask(mask_from_subsets(selected, num_experts), slots_per_expert)


def kept_counts(selected: torch.Tensor, num_experts: int) -> tuple[int, int] | None:
    """selected (batch, k) int64, -1 for an unused place -> (pairs kept, experts in use), what the cost model
    counts; None where host reads are not free (then :func:`plan_costs` takes their bounds)."""
    if not host_reads_are_free(selected):
        return None
    if selected.numel() > HOST_COUNT_MAX_PLACES:
        per_expert = torch.bincount(selected.flatten() + 1, minlength=num_experts + 1)[1:]
        return int(per_expert.sum()), int(per_expert.count_nonzero())
    places = [j for j in selected.flatten().tolist() if j >= 0]
    return len(places), len(set(places))


def plans_are_timed(device: torch.device) -> bool:
    """Whether plan "auto" may run the plan timed faster on ``device`` (module doc): eager CUDA or CPU (there for
    the calls :func:`worth_timing` names; a layer only in eval mode), outside torch.compile and torch.func
    transforms, with deterministic algorithms off (the plans round differently, and timings differ from run to
    run)."""
    return (
        device.type in ("cuda", "cpu")
        and not torch.compiler.is_compiling()
        and not transforms_active()
        and not torch.are_deterministic_algorithms_enabled()
    )


def timed_plan(key: Hashable, runs: dict[str, Callable[[], object]], device: torch.device) -> str | None:
    """The name of the fastest of ``runs`` (plan name -> a call running it on ``device``), timed at the first call
    with ``key`` and remembered for the process: one untimed round, then TIMED_ROUNDS rounds of each in turn, each
    call between two synchronizations with the device, without gradients; the fastest call of each plan counts,
    and a plan other than the first of ``runs`` (the default) wins only in at most TIMED_MARGIN of its time.
    A plan that runs out of device memory is not run again and loses. None where ``key`` was not timed and cannot
    be now (:func:`may_synchronize`)."""
    if key not in _TIMED_PLANS:
        if not may_synchronize(device):
            return None
        best = dict.fromkeys(runs, float("inf"))
        failed = set()
        with torch.no_grad():
            for round_ in range(TIMED_ROUNDS + 1):
                for name, run in runs.items():
                    if name in failed:
                        continue
                    synchronize(device)
                    start = time.perf_counter()
                    try:
                        run()
                    except torch.OutOfMemoryError:
                        failed.add(name)
                        continue
                    synchronize(device)
                    if round_:
                        best[name] = min(best[name], time.perf_counter() - start)
        if len(failed) == len(runs):
            raise torch.OutOfMemoryError(f"every plan of Algorithm 1 ran out of device memory ({sorted(runs)})")
        default = next(iter(runs))

        def weighed(name: str) -> float:  # another plan must beat the default by TIMED_MARGIN
            return best[name] if name == default else best[name] / TIMED_MARGIN

        _TIMED_PLANS[key] = min((name for name in runs if name not in failed), key=weighed)
    return _TIMED_PLANS[key]


def timed_choice(key: Hashable) -> str | None:
    """The plan :func:`timed_plan` found faster for ``key``, or None where it has not timed that key."""
    return _TIMED_PLANS.get(key)


def forget_timed_plans() -> None:
    """Drop every plan :func:`timed_plan` remembers (and what layers remember of them): the next call of each shape
    times them again."""
    global _FORGOTTEN
    _TIMED_PLANS.clear()
    _FORGOTTEN += 1


def timings_forgotten() -> int:
    """How many times :func:`forget_timed_plans` has run (a plan remembered with an older count is stale)."""
    return _FORGOTTEN


def may_synchronize(device: torch.device) -> bool:
    """Whether waiting for ``device`` is welcome: always for the CPU; for CUDA, its sync debug mode off and no CUDA
    graph being captured on the device's current stream."""
    if device.type == "cpu":
        return True
    if torch.cuda.get_sync_debug_mode() != 0:
        return False
    with torch.cuda.device(device):
        return not torch.cuda.is_current_stream_capturing()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        torch.cuda.synchronize(device)
