"""How a Soft MoE layer runs k of its n experts per input: the "selected" or the "dense" plan, whichever is cheaper.

Both plans give the same output (Algorithm 1's: unselected experts contribute nothing):

    "selected"  each expert runs on the slots of the inputs that keep it, grouped by expert
                (``Experts.forward_selected``; on the "cpu" backend in inference the whole plan in one call,
                ``softmoe::selected_mixing``); an unselected (input, expert) pair costs nothing.
    "dense"     every expert runs on every slot, as in the plain forward, and the slots of unselected experts get
                zero combine weight; no work is saved, except where the mixing skips the unkept experts itself
                (the "cpu" backend's fused small-expert kernel in inference).

Skipping work pays only when enough of it is skipped. An expert product of r rows costs about as much as
max(r, floor) + overhead rows at full speed: below ``floor`` rows it is bound by reading the expert's weights, which
costs the same whatever the rows; ``overhead`` covers what every product costs beyond its rows; plus a fixed
``call`` FLOPs per expert in use for the bookkeeping of its group. With F = 2 * (parameters per expert) FLOPs per row,
batch B, p slots per expert and k of n experts kept:

    selected = F * (max(P * p, u * floor) + u * overhead) + u * call
    dense    = F * n * (max(B * p, floor) + overhead)

with P the (input, expert) pairs kept and u the experts in use; the selected plan runs when selected <= margin *
dense. The floor is the bytes term: a product of fewer rows than the floor streams its weights, whatever the rows,
so a plan's cost is the weights it reads where they bound it and its FLOPs elsewhere. On the CPU the floor is the
float lanes of the native kernels' instruction set (:func:`row_floor`). The constants (floor, overhead, call,
margin) are softmoe.tuning.TABLE's, tagged with the hardware they were measured on. P and u are counted where host
reads are free (CPU, eager); elsewhere their bounds B * k and min(n, B * k) stand in, so the decision depends on
shapes alone (no host synchronization; torch.compile makes it once per graph). On eager CUDA, whose calls are bound
by the host's launches, the dense plan runs unless autotuning times the plans.

Nothing is timed by default: the same call gives the same plan, and the same bits, in every process. With
autotuning on (:func:`softmoe.tuning.set_autotune`), like ``torch.backends.cudnn.benchmark``, plan "auto" times
both plans for a close call (:func:`worth_timing`; every shape on eager CUDA) once per shape in eval mode
(:func:`timed_plan`) and runs the faster from then on; where a synchronization is unwelcome (CUDA's sync debug mode,
a CUDA graph being captured) or deterministic algorithms are on, it does not time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING

import torch

from softmoe.compat import transforms_active
from softmoe.kernels.build import LANES, cpu_isa
from softmoe.kernels.modes import host_reads_are_free
from softmoe.tuning import autotune_enabled, value

if TYPE_CHECKING:  # softmoe.experts imports softmoe.kernels, which imports this module
    from softmoe.experts import Experts

__all__ = [
    "SELECTION_PLANS",
    "auto_plan",
    "check_plan",
    "choose_plan",
    "host_reads_are_free",
    "kept_slots",
    "plan_costs",
]

SELECTION_PLANS = ("auto", "selected", "dense")
# With autotuning: timed rounds of each plan after one untimed round (the fastest counts); on the CPU the plans are
# timed where the selected plan's cost lies within this factor of the margin times the dense one's; a timed plan
# replaces the default ("dense") only in at most TIMED_MARGIN of its time (timings of one plan scatter by a few
# percent from run to run).
TIMED_ROUNDS = 5
TIMING_BAND = 1.4
TIMED_MARGIN = 0.97
# The plan found faster per shape: {key: "selected" or "dense"} (see timed_plan).
_TIMED_PLANS: dict[Hashable, str] = {}


def check_plan(plan: str) -> None:
    if plan not in SELECTION_PLANS:
        raise ValueError(f"plan must be one of {SELECTION_PLANS}, got {plan!r}")


def row_floor(kind: str) -> int:
    """The rows below which an expert product costs what reading its weight costs, on ``kind`` ("cpu" or "cuda"):
    on CPU the float lanes of the native kernels' variant (16 with AVX-512, 8 with AVX2; module doc), else
    softmoe.tuning.TABLE's "plan_row_floor"."""
    isa = cpu_isa() if kind == "cpu" else None
    return LANES[isa] if isa is not None else value("plan_row_floor")[kind]


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
    floor, overhead, call = row_floor(kind), value("plan_row_overhead")[kind], value("plan_call_flops")
    rows = pairs * slots_per_expert
    selected = flops_per_row * (max(rows, used * floor) + used * overhead) + used * call
    dense = flops_per_row * num_experts * (max(batch * slots_per_expert, floor) + overhead)
    return selected, dense


def selected_plan_is_cheaper(costs: tuple[float, float], device: torch.device) -> bool:
    """Whether the "selected" plan is expected to beat the "dense" one on ``device``, given their ``costs`` from
    :func:`plan_costs`: the selected one's at most the margin times the dense one's; on eager CUDA never (bound by
    the host's launches: there only autotuning's timing takes the selected plan)."""
    kind = "cpu" if device.type == "cpu" else "cuda"
    if kind == "cuda" and not torch.compiler.is_compiling():
        return False  # eager CUDA: the dense plan unless the plans were timed (plans_are_timed)
    selected, dense = costs
    return selected <= value("plan_margin")[kind] * dense


def worth_timing(costs: tuple[float, float]) -> bool:
    """Whether an eager CPU shape whose plans are not timed yet should be (eager CUDA, which has no cost model,
    times every shape): the call is close, its (selected, dense) ``costs`` of :func:`plan_costs` within a factor
    TIMING_BAND of the margin (module doc)."""
    selected, dense = costs
    scaled = value("plan_margin")["cpu"] * dense
    return scaled / TIMING_BAND <= selected <= scaled * TIMING_BAND


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
    if selected.numel() > value("host_count_max_places"):
        per_expert = torch.bincount(selected.flatten() + 1, minlength=num_experts + 1)[1:]
        return int(per_expert.sum()), int(per_expert.count_nonzero())
    places = [j for j in selected.flatten().tolist() if j >= 0]
    return len(places), len(set(places))


def plans_are_timed(device: torch.device) -> bool:
    """Whether plan "auto" may run the plan timed faster on ``device`` (module doc): autotuning turned on
    (:func:`softmoe.tuning.set_autotune`), eager CUDA or CPU (there for the calls :func:`worth_timing` names; a
    layer only in eval mode), outside torch.compile and torch.func transforms, with deterministic algorithms off
    (the plans round differently)."""
    return (
        autotune_enabled()
        and device.type in ("cuda", "cpu")
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
    """Drop every plan :func:`timed_plan` remembers: with autotuning on, the next call of each shape times them
    again."""
    _TIMED_PLANS.clear()


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


def flops_per_row(experts: Experts) -> float:
    """The FLOPs of one row through one expert, a multiply-add per parameter: the cost model's unit."""
    return 2 * sum(t.numel() for t in experts.parameters()) / experts.num_experts


def choose_plan(
    layer,
    x: torch.Tensor,
    selected: torch.Tensor,
    backend: str,
    runs: Callable[[], dict[str, Callable[[], object]]],
    top_k: bool = False,
) -> str:
    """The plan ("selected" or "dense") plan "auto" runs for ``layer``'s tokens x (batch, tokens, dim) keeping the
    experts ``selected`` (batch, k) on ``backend`` (a name): the cost model's (module doc), the pairs and experts in
    use counted where host reads are free (for Algorithm 1's top k, ``top_k``, whose places are all used, only where
    the count can change the answer). With autotuning on
    (:func:`plans_are_timed`), in eval mode, a close call is timed instead, once per shape (``runs``: a function
    giving the plans' calls by name)."""
    batch, k = selected.shape
    n, p = layer.num_experts, layer.slots_per_expert
    experts = layer.experts
    flops, device = flops_per_row(experts), x.device
    fewest, most = (batch * k, k), (batch * k, min(n, batch * k))
    kept: tuple[int, int] | None = most
    if host_reads_are_free(selected) and (
        not top_k
        or (
            fewest != most
            and counts_decide(
                plan_costs(batch, k, n, p, flops, device, fewest), plan_costs(batch, k, n, p, flops, device, most)
            )
        )
    ):
        kept = kept_counts(selected, n)
    costs = plan_costs(batch, k, n, p, flops, device, kept)
    if not layer.training and plans_are_timed(device) and (device.type != "cpu" or worth_timing(costs)):
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        host = (torch.get_num_threads(), cpu_isa()) if device.type == "cpu" else ()
        weights = tuple(t.shape for t in experts.parameters())
        key = (device, x.dtype, tuple(x.shape), k, n, p, autocast, backend, type(experts), weights, *host)
        choice = timed_plan(key, runs(), device)
        if choice is not None:
            return choice
    return "selected" if selected_plan_is_cheaper(costs, device) else "dense"


def auto_plan(layer, x: torch.Tensor, selected: torch.Tensor) -> str:
    """The plan ("selected" or "dense") plan "auto" runs for ``layer``'s tokens x (batch, tokens, dim) keeping the
    experts ``selected`` (batch, k), on the backend ``layer.backend_for(x)`` names (:func:`choose_plan`)."""
    from softmoe.backends import choose  # (softmoe.backends builds on this module)

    backend, _ = choose(layer, x)
    x = layer.slot_inputs(x)
    dispatch, combine = backend.route(layer, x, None)
    return backend.plan(layer, x, dispatch, combine, selected, False)
