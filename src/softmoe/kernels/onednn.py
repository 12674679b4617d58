"""oneDNN's linear for CPU inference (``torch.ops.mkldnn._linear_pointwise``, the kernel torch.compile's CPU
inference uses), bias and activation fused.

For a few rows through a large weight, and for logits against a few slots, MKL stays well below the CPU's matmul
peak and memory bandwidth; oneDNN runs the same products faster (docs/performance.md has the measurements). It has
no backward, so it is only taken when no gradient is needed.

Batched products (:func:`batched_matmul`, one oneDNN product per batch entry) are taken where oneDNN outruns MKL
for large products too (:func:`onednn_outruns_mkl`: by the CPU, from softmoe.tuning.TABLE; with
autotuning on, timed once per process). Inside an autograd.Function (the slot backend) no gradient is recorded, so
its forward and backward products take them in training as well.
"""

from __future__ import annotations

import functools
import threading
import time

import torch

from softmoe.compat import onednn_linear_pointwise
from softmoe.kernels.modes import needs_grad, plain_eager_mode, transforms_active
from softmoe.runtime import cpu_signature
from softmoe.tuning import autotune_enabled, value

# The activations oneDNN can fuse, as (attribute, algorithm) of _linear_pointwise.
ONEDNN_ACTIVATIONS = {None: ("none", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight`` may run in oneDNN: float32 CPU tensors, no gradient needed (nor a tangent: oneDNN's
    linear has no derivative, and no batching rule for torch.func; :func:`~softmoe.kernels.modes.transforms_active`),
    oneDNN built in."""
    return (
        not needs_grad(x, weight)
        and not transforms_active()
        and x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


# The product timed once per process to decide between oneDNN and MKL: (rows, K) @ (K, N), 0.6 GFLOP, in the
# regime of the products that take it (tens to hundreds of rows through a weight of megabytes). With AVX2 only, a
# smaller product can rank the two the other way round from the larger ones.
PROBE_SHAPE = (128, 768, 3072)


_probe_lock = threading.Lock()


def onednn_outruns_mkl() -> bool:
    """Whether oneDNN's float32 products are clearly faster than MKL's (torch's matmul) on this CPU: where the CPU
    (:func:`softmoe.runtime.cpu_signature`) matches an entry of softmoe.tuning.TABLE's "onednn_cpus". With
    autotuning on (:func:`softmoe.tuning.set_autotune`) the two are timed instead, once per process, on a
    ``PROBE_SHAPE`` product with torch's thread count (fastest of 3 each, the table's "onednn_margin")."""
    if not torch.backends.mkldnn.is_available():
        return False
    if autotune_enabled():
        return _timed_choice()
    vendor, family, avx512 = cpu_signature()
    return any(vendor == v and family >= f and (a is None or avx512 == a) for v, f, a in value("onednn_cpus"))


@functools.cache
def _timed_choice() -> bool:
    with _probe_lock:
        return _time_probe()


def _time_probe() -> bool:
    """oneDNN's time <= softmoe.tuning.TABLE's "onednn_margin" x MKL's on the probe. Its own float32 CPU tensors,
    filled without a random draw (the caller's generator is left as it was), outside autocast and autograd, whatever
    the caller's defaults."""
    rows, inner, cols = PROBE_SHAPE
    with torch.no_grad(), torch.autocast("cpu", enabled=False):
        x = torch.linspace(-1.0, 1.0, rows * inner, dtype=torch.float32, device="cpu").view(rows, inner)
        w = torch.linspace(-1.0, 1.0, inner * cols, dtype=torch.float32, device="cpu").view(inner, cols)
        mkl = _fastest(lambda: torch.mm(x, w))
        onednn = _fastest(lambda: onednn_linear(x, w))
    return onednn <= value("onednn_margin") * mkl


def _fastest(fn, repeats: int = 3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def onednn_pays(flops: int) -> bool:
    """Whether a float32 CPU product of ``flops`` FLOPs that oneDNN may run (the caller checks
    :func:`onednn_applies` or its equivalent) should: at least softmoe.tuning.TABLE's "onednn_min_product_flops",
    and oneDNN faster than MKL on this CPU (:func:`onednn_outruns_mkl`, asked only after the FLOPs)."""
    return flops >= value("onednn_min_product_flops") and onednn_outruns_mkl()


def batched_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a (E, M, K) @ b (E, K, N) (+ bias (E, N)) -> (E, M, N), as ``torch.bmm`` / ``torch.baddbmm`` compute it.

    Where oneDNN may run (:func:`onednn_applies`: float32 CPU tensors, no gradient recorded; no torch.func transform,
    autocast or torch.compile tracing), the work is large enough (softmoe.tuning.TABLE's "onednn_min_product_flops"
    per entry, "onednn_min_batch_flops" in all) and oneDNN outruns MKL (:func:`onednn_outruns_mkl`), one oneDNN
    product per entry, stacked; else torch's. oneDNN is taken only for rows of ``a`` in unit stride, entries of ``b``
    that are dense matrices, row-major or transposed (``w.transpose(1, 2)``), and a bias of shape (E, N) (others
    broadcast in ``baddbmm``): other strides made oneDNN reorder the matrix on every call (e.g. a combine product
    through slots in expert order).
    """
    experts, rows, inner = a.shape
    cols = b.shape[2]
    if (
        a.is_cpu
        and plain_eager_mode("cpu")
        and 2 * experts * rows * inner * cols >= value("onednn_min_batch_flops")
        and a.stride(2) == 1
        and (b.stride(1), b.stride(2)) in ((cols, 1), (1, inner))
        and (bias is None or (bias.shape == (experts, cols) and bias.dtype == torch.float32))
        and onednn_applies(a, b)
        and not needs_grad(bias)
        and onednn_pays(2 * rows * inner * cols)
    ):
        return torch.stack([onednn_linear(a[e], b[e], None if bias is None else bias[e]) for e in range(experts)])
    return torch.bmm(a, b) if bias is None else torch.baddbmm(bias.unsqueeze(1), a, b)


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """activation(x @ weight + bias) in one oneDNN call: x (..., K), weight (K, N), bias (N,) -> (..., N).

    ``activation`` is None, "gelu", "gelu_tanh" or "relu". Only where :func:`onednn_applies`.
    """
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    bias = None if bias is None else bias.contiguous()  # oneDNN reads the bias as a dense vector
    return onednn_linear_pointwise(x, weight.t(), bias, attr, algorithm)
