"""What softmoe decides by itself: the measured constants its choices read, in one table, and autotuning.

By default nothing is timed inside a call. Every choice softmoe makes for you (which library runs a large CPU
product, which plan runs Algorithm 1) follows from the call's shapes, dtypes and device and from :data:`TABLE`, so
the same inputs and settings give bitwise-equal outputs in any process on the same host.

Autotuning is an explicit opt-in, off by default, as ``torch.backends.cudnn.benchmark`` is: after
``softmoe.tuning.set_autotune(True)`` softmoe times the candidates of a close choice once per shape and process and
runs the faster one. Outputs may then differ in their last bits between processes (the candidates agree to
rounding).

Each entry of :data:`TABLE` names the hardware it was measured on; docs/performance.md has the measurements.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["TABLE", "Measured", "autotune_enabled", "set_autotune"]


class Measured(NamedTuple):
    """A constant of a choice and the hardware its value was measured on."""

    value: object
    measured_on: str


TABLE: dict[str, Measured] = {
    # The CPUs whose large float32 products run faster in oneDNN than in MKL, as (vendor, lowest CPU family, AVX-512:
    # True, False, or None for either): MKL takes its AVX-512 code on Intel's CPUs only, so oneDNN wins on AMD's
    # where AVX-512 runs at full width (family 26) or where neither library has it (family 25 without AVX-512); on
    # AMD's family 25 with AVX-512 (at half width) and on Intel's, MKL's.
    "onednn_cpus": Measured(
        (("AuthenticAMD", 26, None), ("AuthenticAMD", 25, False)), "AMD EPYC Zen 3, Zen 4, Zen 5; Intel Xeon"
    ),
    # Algorithm 1's plans (softmoe.selection_plan): rows below which an expert product costs what reading its
    # weight costs (on the CPU the native kernels' float lanes, 8 or 16), rows each product is worth beyond its own,
    # the share of the dense plan's cost the selected plan must stay under, fixed FLOPs per expert in use.
    "plan_row_floor": Measured({"cpu": 16, "cuda": 0}, "Intel Xeon and AMD EPYC Zen 5 (CPU); H100 (CUDA)"),
    "plan_row_overhead": Measured({"cpu": 2, "cuda": 256}, "Intel Xeon and AMD EPYC Zen 5 (CPU); H100 (CUDA)"),
    "plan_margin": Measured({"cpu": 0.85, "cuda": 0.4}, "Intel Xeon and AMD EPYC Zen 5 (CPU); H100, H200 (CUDA)"),
    "plan_call_flops": Measured(1e7, "Intel Xeon (AVX-512 and AVX2)"),
    # The FLOPs one byte of memory traffic costs, in the cost model between the slot and token formulations
    # (softmoe.backends.generic.token_space_is_cheaper).
    "mixing_flops_per_byte": Measured(8, "AMD EPYC (2 cores)"),
}

_AUTOTUNE = False


def set_autotune(enabled: bool) -> bool:
    """Turn autotuning on or off for this process (module doc); returns the previous setting."""
    global _AUTOTUNE
    previous, _AUTOTUNE = _AUTOTUNE, bool(enabled)
    return previous


def autotune_enabled() -> bool:
    """Whether softmoe may time candidates inside calls (off unless :func:`set_autotune` turned it on)."""
    return _AUTOTUNE


def value(name: str):
    """The value of the entry ``name`` of :data:`TABLE`."""
    return TABLE[name].value
