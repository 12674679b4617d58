"""Faster CPU kernels for the products where torch's defaults (MKL) run far below the machine's limits.

Two kinds, each taken only where it applies (float32 CPU tensors), with torch's own ops everywhere else:

- oneDNN's linear for inference (``torch.ops.mkldnn._linear_pointwise``, the kernel torch.compile's CPU inference
  uses), bias and activation fused: on the reference machine (AMD EPYC, 2 cores) MKL reaches about 40% of its matmul
  peak for 25 rows through a 768 x 30720 weight and about 35% of the bandwidth for logits against 8 slots; oneDNN
  runs the same products 1.5-2.5x faster. It has no backward, so it is only taken when no gradient is needed.
- Native kernels (``csrc/*.c``, built on first use with the system's C compiler and called through ctypes), forward
  and backward:

  - batched expert matmuls for experts that see few rows each (``csrc/expert_matmul.c``): a ViT-S Soft MoE layer
    sends 8 rows through each 384 x 1536 weight, a product bound by memory bandwidth that MKL's batched matmul reads
    at about 12 GB/s; these kernels stream the weights at 25-35 GB/s, about what the machine can read;
  - the whole Soft MoE mixing of many small relu experts in one pass (``csrc/soft_moe_small.c``): the paper's MNIST
    layer (4 tokens, n = 8..512 experts of 98..2 hidden units) is a chain of thin matmuls that write (batch,
    slots, dim) tensors; the fused kernel keeps every slot in cache (1.1-2x faster, whole layer fwd+bwd).

  ``SOFTMOE_NATIVE=0`` turns them off; without a C compiler softmoe runs torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

# The activations oneDNN can fuse, as (attribute, algorithm) of _linear_pointwise.
ONEDNN_ACTIVATIONS = {None: ("none", ""), "gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh"), "relu": ("relu", "")}


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an operation on ``tensors`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def plain_eager_mode(device_type: str) -> bool:
    """Whether ops run as written: not traced by torch.compile, not under torch.func transforms, and autocast off
    for ``device_type`` (the native kernels and the hand-written backwards serve only this mode)."""
    return (
        not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and not torch.is_autocast_enabled(device_type)
    )


def onednn_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight`` may run in oneDNN: float32 CPU tensors, no gradient needed, oneDNN built in."""
    return (
        not needs_grad(x, weight)
        and x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
    )


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """activation(x @ weight + bias) in one oneDNN call: x (..., K), weight (K, N), bias (N,) -> (..., N).

    ``activation`` is None, "gelu", "gelu_tanh" or "relu". Only where :func:`onednn_applies`.
    """
    attr, algorithm = ONEDNN_ACTIVATIONS[activation]
    return torch.ops.mkldnn._linear_pointwise(x, weight.t(), bias, attr, [], algorithm)


# ---- native kernels: building, loading; batched matmuls for experts that see few rows (expert_matmul.c) ------

NATIVE_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("expert_matmul.c", "soft_moe_small.c"))
NATIVE_FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp")
# The native expert matmul serves NATIVE_MIN_ROWS..NATIVE_MAX_ROWS rows per expert through weights of at least
# NATIVE_MIN_WEIGHT elements per expert. Measured on the reference machine (fwd+bwd, native / MKL's baddbmm): 384 x
# 1536 weights 0.72 at 8 and 16 rows, 0.92 at 32, 1.09 at one row; 768 x 3072: 0.71 at 8 rows, 1.06 at 16; 196 x 392
# (and smaller): 1.4-2.8, slower, where MKL keeps the small weight in cache.
NATIVE_MIN_ROWS = 2
NATIVE_MAX_ROWS = 16
NATIVE_MIN_WEIGHT = 1 << 18


def native_cache_dir() -> Path:
    """Where built kernels are kept: $SOFTMOE_CACHE, else $XDG_CACHE_HOME/softmoe, else ~/.cache/softmoe."""
    if os.environ.get("SOFTMOE_CACHE"):
        return Path(os.environ["SOFTMOE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "softmoe"


def _cpu_signature() -> str:
    """The machine and its instruction-set flags: a kernel built with -march=native is only reused on a like CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return platform.machine() + flags


@functools.cache
def native_library() -> ctypes.CDLL | None:
    """The native kernels (csrc/*.c, one library), built on first use with the C compiler ($CC, else cc), or None.

    None when SOFTMOE_NATIVE=0, when there is no compiler, or when the build fails (with one warning); softmoe then
    runs torch's batched matmuls. The library is cached per source, compiler, flags and CPU (written to a temporary
    file, then renamed, so concurrent first uses are safe).
    """
    if os.environ.get("SOFTMOE_NATIVE", "1") == "0":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    sources = [path.read_bytes() for path in NATIVE_SOURCES]
    parts = [*sources, compiler.encode(), *map(str.encode, NATIVE_FLAGS), _cpu_signature().encode()]
    key = hashlib.sha256(b"\0".join(parts))
    path = native_cache_dir() / f"softmoe_native-{key.hexdigest()[:16]}.so"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                built = Path(tmp) / path.name
                subprocess.run(
                    [compiler, *NATIVE_FLAGS, "-o", str(built), *map(str, NATIVE_SOURCES)],
                    check=True, capture_output=True, text=True, timeout=300,
                )
                os.replace(built, path)
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", "") or error
            warnings.warn(f"softmoe: building the native kernels failed, using torch's ops instead: {detail}")
            return None
    lib = ctypes.CDLL(str(path))
    pointer, size = ctypes.c_void_p, ctypes.c_long
    lib.expert_matmul.argtypes = [pointer] * 4 + [size] * 4 + [ctypes.c_int, ctypes.c_int]
    lib.expert_matmul_nt.argtypes = [pointer] * 3 + [size] * 4 + [ctypes.c_int]
    lib.expert_matmul_tn.argtypes = [pointer] * 3 + [size] * 4 + [ctypes.c_int]
    for fn in (lib.expert_matmul, lib.expert_matmul_nt, lib.expert_matmul_tn):
        fn.restype = None
    lib.soft_moe_small_forward.argtypes = [pointer] * 9 + [size] * 6 + [ctypes.c_int]
    lib.soft_moe_small_backward.argtypes = [pointer] * 15 + [size] * 6 + [ctypes.c_int]
    lib.soft_moe_small_forward.restype = lib.soft_moe_small_backward.restype = ctypes.c_int
    lib.soft_moe_small_lanes.restype = ctypes.c_int
    return lib


def native_applies(x: torch.Tensor, weight: torch.Tensor, rows: int | None = None) -> bool:
    """Whether :func:`expert_matmul` serves x (E, rows, K) @ weight (E, K, N): float32 CPU tensors,
    NATIVE_MIN_ROWS to NATIVE_MAX_ROWS rows, at least NATIVE_MIN_WEIGHT weight elements per expert, eager mode (not
    under torch.compile, torch.func transforms or autocast) and the kernels built. ``rows`` overrides x.shape[1],
    for a caller asking before it has built x."""
    rows = x.shape[1] if rows is None else rows
    return (
        x.device.type == weight.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and NATIVE_MIN_ROWS <= rows <= NATIVE_MAX_ROWS
        and weight.shape[1] * weight.shape[2] >= NATIVE_MIN_WEIGHT
        and plain_eager_mode("cpu")
        and native_library() is not None
    )


def _pointer(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _native_call(name: str, out: torch.Tensor, *tensors: torch.Tensor | None, sizes: tuple[int, ...]) -> torch.Tensor:
    getattr(native_library(), name)(*map(_pointer, tensors), out.data_ptr(), *sizes, torch.get_num_threads())
    return out


def _native_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation_code: int):
    """The native x @ weight (+ bias), then the activation of that code (0: none), into a new (E, rows, N) tensor."""
    x, weight = x.contiguous(), weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    (experts, rows, k), n = x.shape, weight.shape[2]
    out = x.new_empty(experts, rows, n)
    return _native_call("expert_matmul", out, x, weight, bias, sizes=(experts, rows, k, n, activation_code))


class _ExpertMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x, weight = x.contiguous(), weight.contiguous()
        ctx.save_for_backward(x, weight)
        return _native_product(x, weight, bias, activation_code=0)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        (experts, rows, k), n = x.shape, weight.shape[2]
        grad = grad.contiguous()
        sizes = (experts, rows, k, n)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _native_call("expert_matmul_nt", x.new_empty(x.shape), grad, weight, sizes=sizes)
        if ctx.needs_input_grad[1]:
            grad_weight = _native_call("expert_matmul_tn", x.new_empty(weight.shape), x, grad, sizes=sizes)
        if ctx.needs_input_grad[2]:  # False when there is no bias
            grad_bias = grad.sum(1)
        return grad_x, grad_weight, grad_bias


# The activations expert_matmul can apply to its output, by their codes in csrc/expert_matmul.c.
NATIVE_ACTIVATIONS = {"gelu": 1, "gelu_tanh": 2, "relu": 3}


def expert_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None
) -> torch.Tensor:
    """x (E, rows, K) @ weight (E, K, N) (+ bias (E, N)) -> (E, rows, N) with the native kernels, differentiable.

    For experts that see few rows (about 8 in a ViT-S Soft MoE layer) the product is bound by memory bandwidth:
    the kernels stream each weight once at 25-35 GB/s where MKL's batched matmul reads it at about 12 GB/s (2.3x
    faster forward on the reference machine); the backward uses the same kernels (g @ w^T, x^T @ g, the weight
    gradient written with non-temporal stores). Only where :func:`native_applies`.

    ``activation`` ("gelu", "gelu_tanh" or "relu") is applied to the product inside the kernel while its output is
    still in cache (gelu's erf to about 2e-7); that output has no backward, so it is for inference only: a
    ValueError when a gradient would be needed.
    """
    if activation is None:
        return _ExpertMatmul.apply(x, weight, bias)
    if activation not in NATIVE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(NATIVE_ACTIVATIONS)} or None, got {activation!r}")
    if needs_grad(x, weight, bias):
        raise ValueError("a fused activation has no backward: call expert_matmul without it when training")
    return _native_product(x, weight, bias, NATIVE_ACTIVATIONS[activation])


# ---- the whole Soft MoE mixing of many small relu experts in one native pass (csrc/soft_moe_small.c) ---------------

# The fused kernel serves inputs of at most MIXING_MAX_TOKENS tokens (their routing weights stay in registers) and
# experts of at most MIXING_MAX_HIDDEN hidden units. Measured on the reference machine, whole layer fwd+bwd of the
# paper's MNIST layer (256 x 4 tokens, dim 196), time fused / time of torch's best path: hidden 2 (n = 512) 0.67,
# 3 (n = 256) 0.64, 6 (n = 128) 0.53, 12 (n = 64) 0.51, 24 (n = 32) 0.57-0.58, 49 (n = 16) 0.70-0.82, 98 (n = 8)
# 0.86-1.01; hidden 196 (n = 4) 0.99-1.09 and 392 (n = 2) 1.07-1.15: larger experts keep torch's batched matmuls.
MIXING_MAX_TOKENS = 8
MIXING_MAX_HIDDEN = 128


def native_mixing_applies(x: torch.Tensor, hidden: int, activation: str) -> bool:
    """Whether :func:`soft_moe_mixing` serves x (batch, tokens, dim) with relu experts of ``hidden`` units: float32
    CPU, 1..MIXING_MAX_TOKENS tokens, hidden <= MIXING_MAX_HIDDEN, eager mode (not under torch.compile, torch.func
    transforms or autocast) and the kernels built."""
    return (
        activation == "relu"
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and 1 <= x.shape[1] <= MIXING_MAX_TOKENS
        and hidden <= MIXING_MAX_HIDDEN
        and plain_eager_mode("cpu")
        and native_library() is not None
    )


class _SoftMoEMixing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dispatch, combine, weight1, bias1, weight2, bias2):
        lib = native_library()
        (batch, tokens, dim), slots, (experts, _, hidden) = x.shape, dispatch.shape[2], weight1.shape
        x, dispatch, combine = x.contiguous(), dispatch.contiguous(), combine.contiguous()
        weight1, weight2 = weight1.contiguous(), weight2.contiguous()
        bias1 = None if bias1 is None else bias1.contiguous()
        bias2 = None if bias2 is None else bias2.contiguous()
        lanes = lib.soft_moe_small_lanes()
        out = x.new_empty(batch, tokens, dim)
        pre = x.new_empty(-(-batch // lanes), slots, hidden, lanes)
        sizes = (batch, tokens, slots, slots // experts, hidden, dim)
        status = lib.soft_moe_small_forward(
            *map(_pointer, (x, dispatch, combine, weight1, bias1, weight2, bias2, out, pre)),
            *sizes, torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError(f"the native Soft MoE kernel takes 1..{MIXING_MAX_TOKENS} tokens, got {tokens}")
        ctx.save_for_backward(x, dispatch, combine, weight1, weight2, bias2, pre)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, dispatch, combine, weight1, weight2, bias2, pre = ctx.saved_tensors
        (batch, tokens, dim), slots, (experts, _, hidden) = x.shape, dispatch.shape[2], weight1.shape
        grad = grad.contiguous()  # kept in a name: the kernel reads it after the call's arguments are built
        threads = min(torch.get_num_threads(), experts)
        grad_x = x.new_empty(threads, batch, tokens, dim)  # one partial sum per thread; the kernel adds them up
        grad_dispatch, grad_combine = torch.empty_like(dispatch), torch.empty_like(combine)
        grad_w1 = torch.empty_like(weight1)
        grad_w2 = torch.empty_like(weight2)
        # Bias gradients only where asked for (False for an absent bias); the kernel skips a NULL one.
        grad_b1 = x.new_empty(experts, hidden) if ctx.needs_input_grad[4] else None
        grad_b2 = x.new_empty(experts, dim) if ctx.needs_input_grad[6] else None
        native_library().soft_moe_small_backward(
            *map(_pointer, (grad, x, dispatch, combine, weight1, weight2, bias2, pre, grad_x)),
            *map(_pointer, (grad_dispatch, grad_combine, grad_w1, grad_b1, grad_w2, grad_b2)),
            batch, tokens, slots, slots // experts, hidden, dim, threads,
        )
        return grad_x[0], grad_dispatch, grad_combine, grad_w1, grad_b1, grad_w2, grad_b2


def soft_moe_mixing(
    x: torch.Tensor,
    dispatch: torch.Tensor,
    combine: torch.Tensor,
    weight1: torch.Tensor,
    bias1: torch.Tensor | None,
    weight2: torch.Tensor,
    bias2: torch.Tensor | None,
) -> torch.Tensor:
    """The Soft MoE mixing C relu-MLP(D^T X) of small experts in one native pass, differentiable in every input.

    x (batch, tokens, dim); dispatch, combine (batch, tokens, slots) with slots = experts * slots_per_expert, slot s
    belonging to expert s // slots_per_expert; weight1 (experts, dim, hidden), bias1 (experts, hidden), weight2
    (experts, hidden, dim), bias2 (experts, dim) -> (batch, tokens, dim). No (batch, slots, dim) tensor is written:
    each thread takes 16 (AVX-512) inputs at a time, one per vector lane, and runs dispatch, both expert layers and
    the combine of a slot back to back in its cache. Only where :func:`native_mixing_applies`; other dtypes,
    devices or inconsistent shapes raise a ValueError.
    """
    _check_mixing_inputs(x, dispatch, combine, weight1, bias1, weight2, bias2)
    return _SoftMoEMixing.apply(x, dispatch, combine, weight1, bias1, weight2, bias2)


def _check_mixing_inputs(x, dispatch, combine, weight1, bias1, weight2, bias2) -> None:
    tensors = {"x": x, "dispatch": dispatch, "combine": combine, "weight1": weight1, "bias1": bias1,
               "weight2": weight2, "bias2": bias2}
    for name, t in tensors.items():
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"soft_moe_mixing takes float32 CPU tensors, got {name} {t.dtype} on {t.device}")
    if x.dim() != 3 or weight1.dim() != 3:
        raise ValueError(f"x must be (batch, tokens, dim) and weight1 (experts, dim, hidden), got "
                         f"{tuple(x.shape)} and {tuple(weight1.shape)}")
    (batch, tokens, dim), (experts, _, hidden) = x.shape, weight1.shape
    slots = dispatch.shape[-1] if dispatch.dim() == 3 else -1
    expected = {
        "dispatch": (batch, tokens, slots), "combine": (batch, tokens, slots), "weight1": (experts, dim, hidden),
        "bias1": (experts, hidden), "weight2": (experts, hidden, dim), "bias2": (experts, dim),
    }
    for name, shape in expected.items():
        t = tensors[name]
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if slots < 1 or slots % experts:
        raise ValueError(f"the {slots} slots must be a positive multiple of the {experts} experts")
