"""softmoe::routing_softmaxes: both softmaxes and Algorithm 1's choice from the logits, in torch's ops everywhere and
in one Triton kernel on CUDA; and the layer that takes it in CUDA inference (forced here on the CPU)."""

# Why this file patches: the "cuda" backend's fused path and the kernel's launch logic run only on a GPU, and CI has
# none. So the tests below simulate one (the backend's device check lifted, fused_routing_applies forced, a CUDA
# tensor, Triton's JIT and its devices stood in for), and inject the faults no CPU shows (a launch that fails); the
# rest goes through the public API (layer.backend, select_experts, layer.selector, the op itself) and the profiler.

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import softmoe.backends.cuda as cuda_backend
import softmoe.kernels.triton_kernels as triton_kernels
import softmoe.layer as layer_module
from softmoe import SoftMoE, masked_reference_forward, select_experts
from softmoe.backends import REGISTRY
from softmoe.selection import top_k_by_combine
from softmoe.selection_plan import kept_slots

fused = sys.modules["softmoe.kernels.routing_softmaxes"]  # the package exports the op of that name
F64 = torch.float64
# The kernel runs on CUDA, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1 with Triton installed).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else (
    "cpu" if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") else None)
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA, or Triton's interpreter")


@pytest.fixture(autouse=True)
def launch_failure_kept_per_test(monkeypatch):
    """A test that forces the kernel where it cannot run (CPU tensors, with Triton installed) records a launch
    failure for the process; each test starts from the state before it."""
    monkeypatch.setattr(fused.KERNEL, "failure", fused.KERNEL.failure)


def slow_reference(logits: torch.Tensor, p: int, k: int):
    """Both softmaxes and Algorithm 1 written out: per input, per expert, the combine weight summed over tokens and
    the expert's p slots; the k largest by a Python sort (ties to the lower index); their slots kept."""
    batch, tokens, slots = logits.shape
    dispatch, combine = logits.softmax(dim=1), logits.softmax(dim=-1)
    if k == 0:
        return dispatch, combine, torch.empty(batch, 0, dtype=torch.int64)
    kept, chosen = torch.zeros_like(combine), []
    for b in range(batch):
        sums = [combine[b, :, e * p:(e + 1) * p].sum().item() for e in range(slots // p)]
        order = sorted(range(len(sums)), key=lambda e: (-sums[e], e))[:k]
        chosen.append(sorted(order))
        for e in order:
            kept[b, :, e * p:(e + 1) * p] = combine[b, :, e * p:(e + 1) * p]
    return dispatch, kept, torch.tensor(chosen, dtype=torch.int64)


SHAPES = [((3, 7, 8), 1, 2), ((4, 5, 12), 3, 2), ((2, 9, 16), 2, 8), ((5, 1, 6), 1, 5), ((2, 4, 6), 2, 0)]


@pytest.mark.parametrize("shape, p, k", SHAPES)
def test_the_op_equals_the_formulas_in_float64(shape, p, k):
    logits = torch.randn(*shape, dtype=F64) * 3
    got = fused.routing_softmaxes(logits, p, k)
    want = slow_reference(logits, p, k)
    torch.testing.assert_close(got[0], want[0], rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(got[1], want[1], rtol=1e-14, atol=1e-15)
    assert torch.equal(got[2], want[2])
    if k:
        assert torch.equal(got[2], top_k_by_combine(logits.softmax(-1).view(*shape[:2], -1, p), k))


@pytest.mark.parametrize("shape, p, k", SHAPES)
def test_the_op_normalizes_the_tokens_and_rounds_to_out_dtype(shape, p, k):
    """With tokens x the logits of each token are first divided by sqrt(sum x^2 + eps), written out here; with
    out_dtype the weights are the float64 ones rounded to it (the choice made before rounding; float32 tokens
    holding the same values as the float64 ones)."""
    torch.manual_seed(sum(shape) + k)
    logits = torch.randn(*shape, dtype=F64) * 3
    x = torch.randn(*shape[:2], 5).double()  # (values a float32 holds exactly)
    x[0, 0] = 0.0  # a zero token: its logits times 1 / sqrt(eps)
    norms = torch.tensor([[math.sqrt(sum(v * v for v in x[b, t].tolist()) + 1e-6) for t in range(shape[1])]
                          for b in range(shape[0])], dtype=F64)
    want = slow_reference(logits / norms[..., None], p, k)
    got = fused.routing_softmaxes(logits, p, k, None, x, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)
    got = fused.routing_softmaxes(logits, p, k, torch.bfloat16, x.float(), 1e-6)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0].to(torch.bfloat16)) and torch.equal(got[1], want[1].to(torch.bfloat16))
    assert torch.equal(got[2], want[2])


@needs_kernel
@pytest.mark.parametrize("shape, p, k, dim", [((3, 7, 8), 1, 2, 20), ((2, 197, 8), 1, 2, 768),
                                              ((4, 4, 16), 2, 3, 196), ((2, 33, 24), 1, 0, 64)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_the_kernel_normalizes_the_tokens_and_rounds_like_torchs_ops(shape, p, k, dim, out_dtype, x_dtype):
    """The kernel's tokens (read in blocks of columns, bfloat16 ones widened) and its rounded outputs against the
    op's torch implementation: float32 at 2e-6, bfloat16 within one unit of its last place."""
    logits = torch.randn(*shape, device=KERNEL_DEVICE) * 3
    x = torch.randn(*shape[:2], dim, device=KERNEL_DEVICE).to(x_dtype)
    from softmoe.kernels.routing_softmaxes_triton import launch

    got = (torch.empty_like(logits, dtype=out_dtype), torch.empty_like(logits, dtype=out_dtype),
           torch.empty(shape[0], k, dtype=torch.int64, device=KERNEL_DEVICE))
    launch(logits, *got, p, k, k > 0, x)
    want = fused.reference_routing_softmaxes(logits, p, k, out_dtype, x)
    tolerance = dict(rtol=2e-6, atol=1e-7) if out_dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-7)
    torch.testing.assert_close(got[0], want[0], **tolerance)
    torch.testing.assert_close(got[1], want[1], **tolerance)
    assert torch.equal(got[2], want[2])


def test_ties_go_to_the_lower_expert_and_nan_comes_first():
    logits = torch.zeros(2, 3, 6, dtype=F64)
    logits[1, 0, 4] = float("nan")  # input 1: every combine weight of token 0 is NaN, so every sum
    _, combine, selected = fused.routing_softmaxes(logits, 1, 3)
    assert selected.tolist() == [[0, 1, 2], [0, 1, 2]]
    assert (combine[0, :, 3:] == 0).all() and (combine[0, :, :3] == 1 / 6).all()


@pytest.mark.parametrize("k", [0, 2])
def test_opcheck_and_gradcheck(k):
    logits = (torch.randn(3, 5, 8, dtype=F64) * 2).requires_grad_()
    torch.library.opcheck(torch.ops.softmoe.routing_softmaxes.default, (logits, 2, k))
    permuted = torch.randn(3, 8, 5, dtype=F64).transpose(1, 2)  # outputs contiguous whatever the logits' strides
    torch.library.opcheck(torch.ops.softmoe.routing_softmaxes.default, (permuted, 2, k))

    def outputs(z):
        dispatch, combine, _ = fused.routing_softmaxes(z, 2, k)
        return dispatch, combine

    torch.autograd.gradcheck(outputs, (logits,))
    x = torch.randn(3, 5, 4, dtype=F64, requires_grad=True)
    torch.library.opcheck(torch.ops.softmoe.routing_softmaxes.default, (logits, 2, k, torch.float32, x, 1e-6))
    torch.autograd.gradcheck(lambda z, t: fused.routing_softmaxes(z, 2, k, None, t, 0.5)[:2], (logits, x))
    # The choice is a constant: the gradient equals the masked softmax's with the same experts kept.
    selected = fused.routing_softmaxes(logits, 2, k)[2]
    keep = kept_slots(selected, 4, 2) if k else torch.ones(1, dtype=torch.bool)
    weights = torch.randn(2, 3, 5, 8, dtype=F64)
    got = torch.autograd.grad(sum((w * o).sum() for w, o in zip(weights, outputs(logits))), logits)[0]
    want_out = (logits.softmax(1), torch.where(keep, logits.softmax(-1), 0.0))
    want = torch.autograd.grad(sum((w * o).sum() for w, o in zip(weights, want_out)), logits)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match=r"logits \(batch, tokens, slots\) in float32 or float64, got torch.float16"):
        fused.routing_softmaxes(torch.zeros(2, 3, 4, dtype=torch.float16), 1, 1)
    with pytest.raises(ValueError, match="slots_per_expert must divide the 6 slots, got 4"):
        fused.routing_softmaxes(torch.zeros(2, 3, 6), 4, 1)
    with pytest.raises(ValueError, match=r"k must lie in \[0, 3\] \(0: no choice\), got 4"):
        fused.routing_softmaxes(torch.zeros(2, 3, 6), 2, 4)
    with pytest.raises(ValueError, match="out_dtype must be None or a floating dtype, got torch.int32"):
        fused.routing_softmaxes(torch.zeros(2, 3, 6), 2, 1, torch.int32)
    with pytest.raises(ValueError, match=r"x must be floating tokens \(batch, tokens, dim\) = \(2, 3\) \+ \(dim,\) "
                                         r"on cpu, got torch.float32 \(2, 4, 5\) on cpu"):
        fused.routing_softmaxes(torch.zeros(2, 3, 6), 2, 1, None, torch.zeros(2, 4, 5))
    with pytest.raises(ValueError, match="eps must be >= 0, got -1.0"):
        fused.routing_softmaxes(torch.zeros(2, 3, 6), 2, 1, None, torch.zeros(2, 3, 5), -1.0)


def test_the_kernel_takes_float32_cuda_logits_within_its_tile(monkeypatch):
    cuda, f32 = torch.device("cuda"), torch.float32
    monkeypatch.setattr(fused.KERNEL, "available", lambda: False)
    assert not fused.kernel_applies((2, 197, 8), f32, cuda, 1, 2)
    monkeypatch.setattr(fused.KERNEL, "available", lambda: True)
    assert fused.kernel_applies((2, 197, 8), f32, cuda, 1, 2)  # Table 3: 256 x 16
    assert fused.kernel_applies((128, 196, 128), f32, cuda, 1, 32)  # ViT-S: 256 x 128, 128 experts ranked
    assert not fused.kernel_applies((2, 197, 8), F64, cuda, 1, 2)
    assert not fused.kernel_applies((2, 197, 8), f32, torch.device("cpu"), 1, 2)
    assert not fused.kernel_applies((2, 257, 128), f32, cuda, 1, 0)  # 512 x 128 > MAX_TILE
    assert fused.kernel_applies((256, 4, 512), f32, cuda, 1, 0)  # MNIST n = 512: softmaxes only
    assert not fused.kernel_applies((256, 4, 512), f32, cuda, 1, 4)  # 512 experts: not ranked in the kernel
    assert not fused.kernel_applies((256, 4, 512), f32, cuda, 4, 4)  # 128 experts x 512 slots > MAX_TILE
    assert fused.kernel_applies((256, 4, 256), f32, cuda, 2, 4)  # 128 experts x 256 slots


def test_the_layer_takes_the_op_only_in_cuda_inference(monkeypatch):
    """The logits' shape and dtype (float32 for bfloat16 tokens) reach kernel_applies; CPU tokens, recorded
    gradients and torch.compile never do."""
    layer = SoftMoE(8, 4, dtype=torch.bfloat16)
    phi = layer.phi.reshape(8, 4)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    asked = []
    monkeypatch.setattr(fused, "kernel_applies", lambda *args: asked.append(args) or True)
    assert not fused.fused_routing_applies(x, phi, layer.scale)  # CPU
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    with torch.no_grad():
        assert fused.fused_routing_applies(x, phi, layer.scale, 2, 1)
        assert asked == [((2, 3, 4), torch.float32, x.device, 2, 1)]
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not fused.fused_routing_applies(x, phi, layer.scale)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert not fused.fused_routing_applies(x, phi, layer.scale)  # phi and scale record gradients
    assert len(asked) == 1


def cuda_backend_on_the_cpu(monkeypatch, layer: SoftMoE) -> None:
    """Run ``layer`` on the "cuda" backend with CPU tensors (the backend's own check of the device lifted): its
    routing and selection paths, with the op's torch implementation standing in for the kernel where a test says."""
    monkeypatch.setattr(REGISTRY["cuda"], "unsupported", lambda layer, x: None)
    layer.backend = "cuda"


class WatchedSelector:
    """A layer's selector (``layer.selector``, the ExpertSelector protocol) that records each select() call (the
    selector's top_k): a backend that makes Algorithm 1's choice itself never calls it."""

    def __init__(self, selector):
        self.selector, self.calls = selector, []
        self.renormalize, self.plan, self.top_k = selector.renormalize, selector.plan, selector.top_k

    def select(self, combine):
        self.calls.append(self.top_k)
        return self.selector.select(combine)


def watch_selector(layer: SoftMoE) -> WatchedSelector:
    """Wrap the selector select_experts gave ``layer`` (restored when its block ends)."""
    layer.selector = WatchedSelector(layer.selector)
    return layer.selector


class RoutingCalls(TorchDispatchMode):
    """Records each softmoe::routing_softmaxes call the dispatcher sees while active: (k, out_dtype, whether tokens
    x were passed). On the CPU the op is its torch implementation, the kernel's reference."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.softmoe.routing_softmaxes:
            self.calls.append((args[2], args[3] if len(args) > 3 else None, len(args) > 4 and args[4] is not None))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("plan", ["auto", "dense", "selected"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_the_layer_runs_algorithm1_from_the_op_as_from_its_selector(monkeypatch, p, plan, renormalize):
    """The layer's fused path (forced on the CPU, where the op is its torch implementation, the kernel's reference):
    the selector's select() is not called, and every plan equals the paper's masked forward; the plain forward
    too."""
    monkeypatch.setattr(cuda_backend, "fused_routing_applies", lambda *args: True)
    torch.manual_seed(0)
    layer = SoftMoE(12, 6, slots_per_expert=p, expert_hidden=20, dtype=F64).eval()
    cuda_backend_on_the_cpu(monkeypatch, layer)
    with torch.no_grad():
        layer.scale.fill_(4.0)
    x = torch.randn(5, 7, 12, dtype=F64)
    with torch.no_grad():
        selected = top_k_by_combine(layer.route(x).combine, 2)
        want = masked_reference_forward(layer, x, selected, renormalize=renormalize)
        with select_experts(layer, k=2, plan=plan, renormalize=renormalize), RoutingCalls() as routing:
            selector = watch_selector(layer)
            got = layer(x)
        assert selector.calls == [] and routing.calls == [(2, None, True)]  # the op chose
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(layer(x), layer_module.soft_moe_reference(
            x, layer.phi, layer.scale, layer.experts, layer.normalize), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("normalize, renormalize, narrow, tokens, dtype", [
    ("router", False, True, True, torch.bfloat16), ("router", True, False, True, torch.bfloat16),
    ("inputs", False, True, False, torch.float16)])
def test_a_bfloat16_layer_takes_its_weights_from_the_op_in_its_dtype(monkeypatch, normalize, renormalize, narrow,
                                                                      tokens, dtype):
    """The "cuda" backend's fused path (forced on the CPU) in bfloat16 (and float16): the op writes dispatch and
    combine in x's dtype where the mixing would cast them, not for a renormalization; with the "router"
    normalization it gets the tokens and the unnormalized product. The plain layer keeps torch's softmaxes (the op
    paid under 1.2x there). Both equal the unfused paths (the selector's choice, torch's softmaxes)."""
    torch.manual_seed(0)
    layer = SoftMoE(12, 6, expert_hidden=20, normalize=normalize, dtype=dtype).eval()
    cuda_backend_on_the_cpu(monkeypatch, layer)
    x = torch.randn(5, 7, 12, dtype=dtype)
    with torch.no_grad(), RoutingCalls() as routing:
        want_plain = layer(x)
        with select_experts(layer, k=2, renormalize=renormalize):
            want = layer(x)
            monkeypatch.setattr(cuda_backend, "fused_routing_applies", lambda *args: True)
            got = layer(x)
        got_plain = layer(x)
    assert routing.calls == [(2, dtype if narrow else None, tokens)]
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got_plain, want_plain, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("watcher", ["profiler", "dispatch mode"])
def test_a_watched_layer_calls_the_op_through_the_dispatcher(monkeypatch, watcher):
    """The layer's fused path is the op (forced on the CPU, where the op is torch's ops): the profiler and a dispatch
    mode see it."""
    monkeypatch.setattr(cuda_backend, "fused_routing_applies", lambda *args: True)
    torch.manual_seed(0)
    layer = SoftMoE(12, 6, expert_hidden=20, dtype=F64).eval()
    cuda_backend_on_the_cpu(monkeypatch, layer)
    x = torch.randn(3, 7, 12, dtype=F64)
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with torch.no_grad():
        want = masked_reference_forward(layer, x, top_k_by_combine(layer.route(x).combine, 2))
        with select_experts(layer, k=2):
            if watcher == "profiler":
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    got = layer(x)
                seen = [event.name for event in prof.events()]
            else:
                with Ops():
                    got = layer(x)
    assert {"softmoe::routing_softmaxes", "softmoe.routing_softmaxes"} & set(seen)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_kernel_that_cannot_launch_leaves_torchs_ops_for_the_process(monkeypatch):
    """E.g. Triton installed without a C compiler for its launcher: one warning, the reference's result, and the
    kernel not tried again."""
    triton_module = pytest.importorskip("softmoe.kernels.routing_softmaxes_triton")
    monkeypatch.setattr(fused.KERNEL, "failure", None)
    monkeypatch.setattr(triton_kernels, "triton_installed", lambda: True)
    monkeypatch.setattr(fused, "kernel_applies", lambda *args: fused.KERNEL.available())
    launches = []

    def launch(*args, **kwargs):
        launches.append(args)
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(triton_module, "launch", launch)
    logits = torch.randn(2, 5, 8)
    with pytest.warns(RuntimeWarning, match=r"routing kernel \(Triton\) could not run \(RuntimeError: Failed to find"):
        got = fused.routing_softmaxes(logits, 1, 3)
    want = fused.reference_routing_softmaxes(logits, 1, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not fused.KERNEL.available()
    fused.routing_softmaxes(logits, 1, 3)
    assert len(launches) == 1


class _TopKSelector:
    """A custom selector whose top_k is not a usable k (0 here): the layer must call its select()."""

    renormalize, plan, top_k = False, "auto", 0

    def __init__(self):
        self.calls = 0

    def select(self, combine):
        self.calls += 1
        return top_k_by_combine(combine, 2)


def test_a_selector_whose_top_k_is_not_a_k_chooses_through_select(monkeypatch):
    monkeypatch.setattr(cuda_backend, "fused_routing_applies", lambda *args: True)
    layer = SoftMoE(12, 6, expert_hidden=20).eval()
    cuda_backend_on_the_cpu(monkeypatch, layer)
    layer.selector = _TopKSelector()
    with torch.no_grad():
        layer(torch.randn(3, 7, 12))
    assert layer.selector.calls == 1


@needs_kernel
@pytest.mark.parametrize("shape, p, k", SHAPES + [((3, 197, 8), 1, 2), ((2, 196, 128), 1, 32), ((3, 4, 40), 5, 3),
                                                 ((2, 33, 96), 1, 95), ((3, 7, 8), 1, 8), ((2, 4, 256), 2, 4)])
def test_the_kernel_equals_torchs_ops(shape, p, k):
    logits = torch.randn(*shape, device=KERNEL_DEVICE) * 3
    assert fused.kernel_applies(shape, logits.dtype, logits.device, p, k) or KERNEL_DEVICE == "cpu"
    from softmoe.kernels.routing_softmaxes_triton import launch

    got = (torch.empty_like(logits), torch.empty_like(logits), torch.empty(shape[0], k, dtype=torch.int64,
                                                                           device=KERNEL_DEVICE))
    launch(logits, *got, p, k, choose=k > 0)
    want = fused.reference_routing_softmaxes(logits, p, k)
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    assert torch.equal(got[2], want[2])


@needs_kernel
def test_a_compiled_kernel_called_again_equals_torchs_ops():
    """The second launch of a shape runs the kernel compiled at the first on new logits; logits one float off a
    16-byte boundary take a kernel compiled without that alignment."""
    from softmoe.kernels.routing_softmaxes_triton import launch

    storage = torch.randn(2 * 3 * 40 * 24 + 1, device=KERNEL_DEVICE) * 3
    for logits in (torch.randn(3, 40, 24, device=KERNEL_DEVICE) * 3, storage[:3 * 40 * 24].view(3, 40, 24),
                   storage[1:1 + 3 * 40 * 24].view(3, 40, 24), storage[1 + 3 * 40 * 24:].view(3, 40, 24)):
        for p, k in ((2, 5), (2, 0), (1, 3)):
            got = (torch.empty_like(logits), torch.empty_like(logits),
                   torch.empty(3, k, dtype=torch.int64, device=KERNEL_DEVICE))
            launch(logits, *got, p, k, choose=k > 0)
            want = fused.reference_routing_softmaxes(logits, p, k)
            torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
            torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
            assert torch.equal(got[2], want[2])


class _FakeJit:
    """Stands for the JIT kernel: each launch records its grid, arguments and meta-parameters, and the current
    device."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.calls.append((grid, args, meta, torch.cuda.current_device()))


def test_a_launch_passes_the_shapes_and_its_constexprs_to_the_jit(monkeypatch):
    """The launch logic without a GPU: one program per input; the tensors, then the sizes, then the constexprs
    (blocks of the sizes rounded up to powers of two, at least 16); without a choice the kernel gets dispatch for
    selected, without tokens the logits for x."""
    triton_module = pytest.importorskip("softmoe.kernels.routing_softmaxes_triton")
    jit = _FakeJit()
    monkeypatch.setattr(triton_module, "routing_softmaxes_kernel", jit)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    logits, x = torch.zeros(2, 20, 12), torch.zeros(2, 20, 5)
    out = torch.empty_like(logits), torch.empty_like(logits), torch.empty(2, 3, dtype=torch.int64)
    triton_module.launch(logits, *out, 2, 3, True)
    triton_module.launch(logits, *out, 2, 0, False, x)
    (grid, args, meta, _), (_, args2, meta2, _) = jit.calls
    assert grid == (2,) and args[:5] == (logits, logits, *out) and args[5:] == (20, 12, 2, 6, 3)
    assert meta == dict(BLOCK_T=32, BLOCK_S=16, BLOCK_E=16, BLOCK_D=64, CHOOSE=True, NORMALIZE=False, DIM=0,
                        EPS=1e-6, num_warps=4)
    assert args2[1] is x and args2[4] is out[0] and meta2["NORMALIZE"] and meta2["DIM"] == 5 and not meta2["CHOOSE"]


def test_a_launch_on_another_device_runs_under_its_guard(monkeypatch):
    """Triton launches on the current device: logits elsewhere are launched with their device made current."""
    triton_module = pytest.importorskip("softmoe.kernels.routing_softmaxes_triton")
    jit = _FakeJit()
    monkeypatch.setattr(triton_module, "routing_softmaxes_kernel", jit)
    current = [3]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    @contextlib.contextmanager
    def device(index):
        saved, current[0] = current[0], index
        yield
        current[0] = saved

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 1)))
    logits = torch.zeros(2, 20, 12)
    triton_module.launch(logits, torch.empty_like(logits), torch.empty_like(logits), None, 2, 0, False)
    assert [call[3] for call in jit.calls] == [1] and current == [3]


@needs_kernel
def test_the_kernel_breaks_ties_and_ranks_nan_like_torch():
    logits = torch.zeros(3, 5, 8, device=KERNEL_DEVICE)
    logits[1, :, 6] = 2.0  # input 1: expert 6 first, then a tie of the rest
    logits[2, 0, 3] = float("nan")  # input 2: every sum NaN
    from softmoe.kernels.routing_softmaxes_triton import launch

    got = (torch.empty_like(logits), torch.empty_like(logits), torch.empty(3, 3, dtype=torch.int64,
                                                                           device=KERNEL_DEVICE))
    launch(logits, *got, 1, 3, choose=True)
    assert got[2].tolist() == [[0, 1, 2], [0, 1, 6], [0, 1, 2]]


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_a_second_launch_runs_on_the_current_stream():
    """A shape's later launches go to the current stream:
    logits written on a side stream after a long wait are read after them, not before (they would read zeros)."""
    from softmoe.kernels.routing_softmaxes_triton import launch

    z = torch.randn(3, 197, 8, device="cuda") * 3

    def run(logits):
        got = (torch.empty_like(logits), torch.empty_like(logits), torch.empty(3, 2, dtype=torch.int64,
                                                                               device="cuda"))
        launch(logits, *got, 1, 2, choose=True)
        return got

    run(z)  # the first launch of the shape: Triton's JIT
    logits = torch.zeros_like(z)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # (GPU cycles: tens of milliseconds)
        logits.copy_(z)
        got = run(logits)
    torch.cuda.synchronize()
    want = fused.reference_routing_softmaxes(z, 1, 2)
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-7)
    assert torch.equal(got[2], want[2])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_algorithm1_on_cuda_launches_no_more_kernels_than_every_expert(dtype):
    """Eager CUDA inference: the dense plan of Algorithm 1 takes the routing kernel's softmaxes and choice, so it
    launches no more kernels than the plain layer (one fewer: the plain layer's softmaxes are torch's two), and
    equals the masked reference."""
    torch.manual_seed(0)
    exact = SoftMoE(64, 8, expert_hidden=128, dtype=F64).eval()
    layer = SoftMoE(64, 8, expert_hidden=128).eval()
    layer.load_state_dict(exact.state_dict())
    layer = layer.to(device="cuda", dtype=dtype)
    x64 = torch.randn(4, 20, 64, dtype=F64)
    x = x64.to("cuda", dtype)

    def kernels(fn) -> int:
        fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        return sum(1 for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)

    def algorithm1():
        with select_experts(layer, k=3, plan="dense"):
            return layer(x)

    with torch.no_grad():
        assert kernels(algorithm1) <= kernels(lambda: layer(x))
        selected = top_k_by_combine(exact.route(x64).combine, 3)
        want = masked_reference_forward(exact, x64, selected)
        got = algorithm1()
    assert ((got.double().cpu() - want).abs().max() / want.abs().max()).item() < (1e-5 if dtype == torch.float32
                                                                                  else 3e-2)


@pytest.mark.parametrize("strategy, options", [("random", {"k": 2}), ("mass", {"tau": 0.5}), ("budget", {"k": 2}),
                                               ("mask", {})])
def test_other_strategies_choose_through_their_selector(monkeypatch, strategy, options):
    """Only Algorithm 1 with a fixed k ("combine") has a top_k; every other strategy keeps calling select()."""
    monkeypatch.setattr(cuda_backend, "fused_routing_applies", lambda *args: True)
    layer = SoftMoE(12, 6, expert_hidden=20).eval()
    cuda_backend_on_the_cpu(monkeypatch, layer)
    x = torch.randn(3, 7, 12)
    if strategy == "mask":
        strategy = torch.tensor([[True, False, True, False, False, False]] * 3)
    with torch.no_grad(), select_experts(layer, strategy=strategy, **options), RoutingCalls() as routing:
        selector = watch_selector(layer)
        layer(x)
    assert selector.calls == [None] and routing.calls == []
