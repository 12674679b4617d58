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
    # (family 25 with and without AVX-512, family 26); on Intel's, MKL's.
    "onednn_cpus": Measured((("AuthenticAMD", 25, None),), "AMD EPYC Zen 3, Zen 4, Zen 5; Intel Xeon"),
    # Algorithm 1's plans (softmoe.selection_plan): rows below which an expert product costs what reading its
    # weight costs (on the CPU the native kernels' float lanes, 8 or 16), rows each product is worth beyond its own,
    # the share of the dense plan's cost the selected plan must stay under, fixed FLOPs per expert in use.
    "plan_row_floor": Measured({"cpu": 16, "cuda": 0}, "Intel Xeon and AMD EPYC Zen 5 (CPU); H100 (CUDA)"),
    "plan_row_overhead": Measured({"cpu": 2, "cuda": 256}, "Intel Xeon and AMD EPYC Zen 5 (CPU); H100 (CUDA)"),
    "plan_margin": Measured({"cpu": 0.85, "cuda": 0.4}, "Intel Xeon and AMD EPYC Zen 5 (CPU); H100, H200 (CUDA)"),
    "plan_call_flops": Measured(1e7, "Intel Xeon (AVX-512 and AVX2); compiled CUDA takes it too, unmeasured there"),
    # Algorithm 1's bookkeeping where host reads are free (CPU, eager): a selection of at most host_count_max_places
    # places is counted in Python, a larger one with torch's bincount (which costs the same at any size); the top-k
    # of at most host_topk_max_scores scores (batch x experts) is a Python sort per input (one read costs less than
    # the sort's ops, whose code comes back from memory after the expert products), and from topk_min_scores up
    # torch.topk is tried before the stable sort (below, every op's fixed cost outweighs the sort's).
    "host_count_max_places": Measured(256, "AMD EPYC Zen 5 (2 cores)"),
    "host_topk_max_scores": Measured(256, "Intel Xeon (2 cores)"),
    "topk_min_scores": Measured(4096, "Intel Xeon (2 cores)"),
    # The FLOPs one byte of memory traffic costs, in the cost model between the slot and token formulations
    # (softmoe.backends.generic.token_space_is_cheaper).
    "mixing_flops_per_byte": Measured(8, "AMD EPYC (2 cores)"),
    # The native expert matmul (softmoe.kernels.expert_matmul.native_applies) serves 1..native_max_rows rows per
    # expert through weights of at least native_min_weight elements per expert: forward and backward it beats MKL's
    # baddbmm at a few rows through large weights (its lead shrinks as the rows grow), and it is slower through
    # weights small enough for MKL to keep them in cache. Where only the forward product runs (grad mode off;
    # softmoe::native_grouped_mm's products) it serves up to native_forward_max_rows: with the later row passes
    # reading a copy of each tile, the forward alone keeps up with MKL and oneDNN to more rows.
    "native_max_rows": Measured(16, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    "native_forward_max_rows": Measured(48, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    "native_min_weight": Measured(1 << 18, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    # softmoe::native_grouped_mm's products (softmoe.kernels.native_grouped_mm.group_product): a weight of at least
    # large_weight elements run by few rows takes the faster kernels, the native expert matmul up to
    # native_forward_max_rows rows (a forward product: the bound of the layer's native path in training, which must
    # also win backward, is lower), MKL or oneDNN otherwise.
    "large_weight": Measured(1 << 20, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    # oneDNN for float32 CPU products (softmoe.kernels.onednn): a product of fewer FLOPs than onednn_min_product_flops
    # pays more for oneDNN's call than it gains over MKL; a batch of less work in all than onednn_min_batch_flops
    # gains nothing inside a layer in a default process (each entry's output and their stack are fresh memory that
    # glibc may have returned to the system: page faults). With autotuning on, oneDNN is taken where it takes at most
    # onednn_margin of MKL's time on the probe: a clear win, not noise.
    "onednn_min_product_flops": Measured(1 << 24, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    "onednn_min_batch_flops": Measured(1 << 28, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    "onednn_margin": Measured(0.8, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    # The fused mixing (softmoe.kernels.soft_moe_mixing.native_mixing_applies) serves experts whose two weight
    # matrices (2 dim hidden floats) take at most this many bytes per vector lane of the kernel variant: each group
    # of `lanes` inputs streams every expert's weights (and, backward, their gradients) through a core's cache, so
    # their traffic per input is the weights' size over the lanes. Beyond it the fused kernel no longer beats the
    # slot backend's batched products.
    "mixing_max_weight_bytes_per_lane": Measured(112 << 10, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    # The most rows (groups x rows per group: batch x k x slots per expert) of Algorithm 1's selected plan that the
    # "cuda" backend runs in softmoe::skinny_grouped_mm (softmoe.kernels.skinny_grouped_mm.skinny_applies): at most
    # one block of the kernel's rows (its MAX_BLOCK_M), so each kept expert's weight tiles are read once.
    "skinny_max_rows": Measured(64, "not yet measured: chosen from the kernel's design (no GPU lent)"),
    # From this many hidden units up the fused mixing's forward keeps the slots' outputs (batch * slots * dim floats)
    # for the backward, which otherwise runs each slot's second layer again (a fifth of the backward's multiply-adds);
    # below it writing, holding and reading them costs more than computing them again (the larger record is fresh
    # memory every step in a default process).
    "mixing_keep_outputs_min_hidden": Measured(64, "AMD EPYC Zen 5 and Zen 4 (2 cores)"),
    # The costs of the fused mixing's inference layouts per kernel variant (the cost model in csrc/bindings.cpp's
    # kept_lanes, which picks the layout of fewest vector operations per call), in this order: input_group_moves,
    # sorted_group, pair_token, pair_weight, row_block, row_block_products, row, row_token. Fitted by relative least
    # squares to the op's times with 2 threads (the MNIST layer at 8, 64 and 256 experts, batch 2-64, k = n/8, n/4 and
    # n/2, each layout forced), in units of the groups of inputs' times in the same process; the AVX2 costs serve the
    # portable variant too. benchmarks/fit_layouts.py refits them on a host and says how far each set's picks are from
    # the fastest layout.
    "mixing_layout_costs": Measured(
        {
            "avx512": (10.0, 0.05, 1.26, 0.42, 430.0, 2.4, 0.69, 12.8),
            "avx2": (10.0, 0.05, 1.64, 0.57, 1300.0, 0.23, 0.93, 7.4),
            "portable": (10.0, 0.05, 1.64, 0.57, 1300.0, 0.23, 0.93, 7.4),
        },
        "AMD EPYC Zen 5 (2 cores); checked on Zen 4",
    ),
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
