"""softmoe::skinny_grouped_mm: softmoe::grouped_mm's contract in a Triton kernel for few rows, checked on CUDA or, by
default (tests/conftest.py), on the CPU in Triton's interpreter; and the "cuda" backend's choice of it.

Patches here only simulate what CI lacks (a GPU for the backend's choice, a machine without Triton or without
the interpreter) and inject a launch that fails; the rest goes through the op, MLPExperts and the layer."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

import softmoe.backends.cuda as cuda_backend
from reference import kernels_called, ref_activation
from softmoe import SoftMoE, masked_reference_forward, select_experts
from softmoe.backends import REGISTRY
from softmoe.experts import MLPExperts
from softmoe.kernels.grouped_mm import grouped_mm
from softmoe.kernels.triton_kernels import triton_installed
from softmoe.kernels.skinny_grouped_mm import (
    SkinnyConfig,
    skinny_applies,
    skinny_config,
    skinny_grouped_mm,
)
from softmoe.selection import top_k_by_combine
from softmoe.tuning import value

skinny = sys.modules["softmoe.kernels.skinny_grouped_mm"]
F64, BF16 = torch.float64, torch.bfloat16
# The kernel runs on CUDA, or on the CPU in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py without a
# GPU, with Triton installed).
DEVICE = "cuda" if torch.cuda.is_available() else (
    "cpu" if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") else None)
needs_kernel = pytest.mark.skipif(DEVICE is None, reason="needs CUDA, or Triton and its interpreter")


@pytest.fixture(autouse=True)
def launch_failure_kept_per_test(monkeypatch):
    """A test that makes the launch fail records it for the process; each test starts from the state before it.
    A failed launch falls back to grouped_mm with a warning: here the warning is an error (with or without pytest's
    warnings plugin), so a kernel that does not run cannot pass for one that does."""
    monkeypatch.setattr(skinny.KERNEL, "failure", skinny.KERNEL.failure)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "softmoe: the skinny grouped GEMM kernel", RuntimeWarning)
        yield


def ends_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)


def slow_reference(x, weight, counts, bias=None, activation="none"):
    """In float64, expert by expert: act(x[rows of j] @ weight[j] + bias[j]), one output row at a time; the rows
    past the last expert's are zero."""
    x, weight = x.double(), weight.double()
    out = torch.zeros(x.shape[0], weight.shape[2], dtype=F64, device=x.device)
    row = 0
    for j, count in enumerate(counts):
        for r in range(row, row + count):
            y = x[r] @ weight[j] + (0.0 if bias is None else bias[j].double())
            out[r] = y if activation == "none" else ref_activation(activation, y)
        row += count
    return out


def operands(counts, k, n, dtype, pad=0, transposed=False, seed=0):
    """x (sum(counts) + pad, k), weight (experts, k, n) (with ``transposed`` a transposed view of an (experts, n, k)
    tensor), bias (experts, n): values of order one in the outputs. What the op must never read is NaN: the pad rows
    of x and the weights of the experts with no rows."""
    torch.manual_seed(seed)
    x = torch.randn(sum(counts) + pad, k, device=DEVICE).to(dtype)
    shape = (len(counts), n, k) if transposed else (len(counts), k, n)
    weight = (torch.randn(*shape, device=DEVICE) / k**0.5).to(dtype)
    weight = weight.transpose(1, 2) if transposed else weight
    x[sum(counts):] = float("nan")
    weight[torch.tensor(counts, device=DEVICE) == 0] = float("nan")
    return x, weight, torch.randn(len(counts), n, device=DEVICE).to(dtype)


def assert_matches(got, want, dtype):
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    else:  # the output rounded to 8 (bfloat16) or 11 (float16) bits, the products exact, the sums in float32
        torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-2)


# (counts, pad rows, K, N, transposed weight): why each is there in its comment.
CASES = [
    ([3, 0, 5, 2], 2, 40, 24, False),  # uneven groups, an expert with no rows, rows past ends[-1], partial tiles
    ([0, 70, 0], 1, 24, 20, False),  # more rows than one block (64): the row loop
    ([2, 1], 0, 1000, 16, False),  # a long K for few column blocks: K split (skinny_config, asserted below)
    ([1, 4, 0, 3], 1, 48, 40, True),  # a transposed weight view (the backward's grad_x), read by its strides
]


@needs_kernel
@pytest.mark.parametrize("counts, pad, k, n, transposed", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
def test_the_op_equals_the_loop_over_experts(counts, pad, k, n, transposed, dtype):
    x, weight, bias = operands(counts, k, n, dtype, pad, transposed, seed=sum(counts) + k)
    ends = ends_of(counts)
    want = slow_reference(x, weight, counts, bias)
    assert_matches(skinny_grouped_mm(x, weight, ends, bias), want, dtype)
    assert_matches(skinny_grouped_mm(x, weight, ends), slow_reference(x, weight, counts), dtype)
    if k == 1000:  # (split at 1 SM, as in the interpreter, so at any number of SMs)
        assert skinny_config(x.shape[0], k, n, len(counts), dtype, 1).split_k > 1


@needs_kernel
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_each_activation_with_the_bias(activation, dtype):
    counts = [2, 0, 3]
    x, weight, bias = operands(counts, 32, 48, dtype, pad=1, seed=1)
    x = x * 3  # (both signs of the activations' range, far from zero)
    want = slow_reference(x, weight, counts, bias, activation)
    assert_matches(skinny_grouped_mm(x, weight, ends_of(counts), bias, activation), want, dtype)


@needs_kernel
@pytest.mark.parametrize("split_k, k_per_split", [(1, 80), (3, 32)], ids=["one K range", "three K ranges"])
def test_the_kernels_paths_with_small_tiles(split_k, k_per_split):
    """Tiles of 16: rows in two blocks, K in five steps, four column blocks; the epilogue in the product's kernel
    (one K range) or after the partial products' sum (three ranges of 32, 32 and 16)."""
    from softmoe.kernels.skinny_grouped_mm_triton import launch

    counts = [20, 0, 5]
    x, weight, bias = operands(counts, 80, 64, torch.float32, pad=3, seed=2)
    config = SkinnyConfig(16, 16, 16, split_k, k_per_split, num_warps=4, num_stages=2)
    for activation in ("none", "gelu"):
        got = launch(x, weight, ends_of(counts), bias, activation, config)
        assert_matches(got, slow_reference(x, weight, counts, bias, activation), torch.float32)


@needs_kernel
def test_empty_dimensions():
    """K = 0: each owned row is its expert's bias; no rows, no columns or no experts: an empty or zero output."""
    ends = ends_of([2, 0, 1])
    x, weight, bias = torch.zeros(4, 0, device=DEVICE), torch.zeros(3, 0, 5, device=DEVICE), torch.randn(3, 5)
    want = torch.cat([bias[[0, 0, 2]], torch.zeros(1, 5)]).to(DEVICE)
    torch.testing.assert_close(skinny_grouped_mm(x, weight, ends, bias.to(DEVICE)), want, rtol=0, atol=0)
    assert skinny_grouped_mm(torch.zeros(0, 4, device=DEVICE), torch.zeros(3, 4, 5, device=DEVICE),
                             torch.zeros(3, dtype=torch.int32, device=DEVICE)).shape == (0, 5)
    assert skinny_grouped_mm(torch.ones(3, 4, device=DEVICE), torch.ones(3, 4, 0, device=DEVICE), ends).shape == (3, 0)
    none = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    assert not skinny_grouped_mm(torch.ones(3, 4, device=DEVICE), torch.ones(0, 4, 5, device=DEVICE), none).any()


@needs_kernel
def test_the_split_product_gives_the_same_bits_every_run():
    """No atomics: the partial products are summed in a fixed order."""
    counts = [2, 1]
    x, weight, bias = operands(counts, 1000, 16, BF16, seed=3)
    assert skinny_config(3, 1000, 16, 2, BF16, 1).split_k > 1  # (at 1 SM, so at any number of SMs)
    first = skinny_grouped_mm(x, weight, ends_of(counts), bias)
    assert torch.equal(first, skinny_grouped_mm(x, weight, ends_of(counts), bias))


@needs_kernel
def test_gradients_equal_the_references():
    """x's gradient (through the op with the transposed weight), the weight's and the bias's, against autograd
    through the float64 loop; the rows past ends[-1] get zero."""
    counts = [3, 0, 5, 2]
    x, weight, bias = operands(counts, 24, 40, torch.float32, pad=2, seed=4)
    leaves = [t.detach().requires_grad_() for t in (x, weight, bias)]
    exact = [t.detach().double().requires_grad_() for t in (x, weight, bias)]
    out = skinny_grouped_mm(*leaves[:2], ends_of(counts), leaves[2])
    want = slow_reference(exact[0], exact[1], counts, exact[2])
    grad = torch.randn_like(want)
    got_grads = torch.autograd.grad(out, leaves, grad.float())
    for got, expected in zip(got_grads, torch.autograd.grad(want, exact, grad), strict=True):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got_grads[0][sum(counts):]) == 0 and torch.count_nonzero(got_grads[1][1]) == 0


@needs_kernel
def test_opcheck():
    """Schema, fake tensors, the autograd registration and dispatch with dynamic shapes."""
    counts = [2, 0, 3]
    x, weight, bias = operands(counts, 16, 24, torch.float32, pad=1, seed=5)
    op = torch.ops.softmoe.skinny_grouped_mm.default
    torch.library.opcheck(op, (x.requires_grad_(), weight.requires_grad_(), ends_of(counts), bias.requires_grad_()))
    torch.library.opcheck(op, (x.detach(), weight.detach(), ends_of(counts), bias.detach(), "gelu"))


@needs_kernel
def test_an_activation_has_no_backward():
    counts = [2, 1]
    x, weight, bias = operands(counts, 16, 16, torch.float32, seed=6)
    with pytest.raises(ValueError, match=r"skinny_grouped_mm's activation \('relu'\) has no backward"):
        skinny_grouped_mm(x, weight.requires_grad_(), ends_of(counts), bias, "relu")


def test_bad_arguments_are_value_errors(monkeypatch):
    x, weight, ends = torch.zeros(3, 4), torch.zeros(2, 4, 5), torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"one dtype of \['torch.bfloat16', 'torch.float16', 'torch.float32'\], "
                                         r"got \['torch.float32', 'torch.float64'\]"):
        skinny_grouped_mm(x, weight.double(), ends)
    with pytest.raises(ValueError, match=r"got \['torch.float64'\]"):
        skinny_grouped_mm(x.double(), weight.double(), ends)
    with pytest.raises(ValueError, match="ends must be an int32 tensor of shape"):
        skinny_grouped_mm(x, weight, ends.long())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="the Triton kernel runs on CUDA, or on the CPU under TRITON_INTERPRET=1; "
                                         "got tensors on cpu"):
        skinny_grouped_mm(x, weight, ends)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name, *a))
    with pytest.raises(ValueError, match="needs Triton, which is not installed"):
        skinny_grouped_mm(x, weight, ends)


@needs_kernel
def test_a_kernel_that_cannot_launch_leaves_grouped_mm_for_the_process(monkeypatch):
    """E.g. Triton without a C compiler for its launcher: one warning, grouped_mm's result, and neither the op nor
    the backend's choice tries the kernel again."""
    triton_module = pytest.importorskip("softmoe.kernels.skinny_grouped_mm_triton")
    launches = []

    def launch(*args):
        launches.append(args)
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(triton_module, "launch", launch)
    counts = [2, 1]
    x, weight, bias = operands(counts, 16, 16, torch.float32, seed=7)
    assert skinny_applies(3, torch.float32, torch.float32, torch.device("cuda"))
    with pytest.warns(RuntimeWarning, match=r"skinny grouped GEMM kernel \(Triton\) could not run \(RuntimeError: "):
        got = skinny_grouped_mm(x, weight, ends_of(counts), bias)
    assert torch.equal(got, grouped_mm(x, weight, ends_of(counts), bias))
    skinny_grouped_mm(x, weight, ends_of(counts), bias)
    assert len(launches) == 1
    assert not skinny_applies(3, torch.float32, torch.float32, torch.device("cuda"))


def test_the_cuda_backend_takes_the_kernel_for_few_rows_of_its_dtypes():
    """skinny_applies: a pure function of the rows, the dtypes and the device (Triton installed)."""
    cuda, most = torch.device("cuda"), value("skinny_max_rows")
    installed = triton_installed()
    for dtype in (BF16, torch.float16, torch.float32):
        assert skinny_applies(most, dtype, dtype, cuda) == installed
        assert not skinny_applies(most + 1, dtype, dtype, cuda)
    assert not skinny_applies(1, F64, F64, cuda)
    assert not skinny_applies(1, BF16, torch.float32, cuda)  # (tokens and weights of two dtypes)
    assert not skinny_applies(1, BF16, BF16, torch.device("cpu"))


def test_the_config_splits_k_where_the_columns_are_few():
    """Table 3's two expert layers at batch 1 (k = 2 of 8 experts, one slot each) on a GPU of 132 SMs: the first
    (768 x 30720) has 960 column blocks and no split; the second (30720 x 768) 24 column blocks, so K is split for
    4 programs per SM, every range non-empty."""
    first = skinny_config(2, 768, 30720, 8, BF16, 132)
    assert first == SkinnyConfig(16, 64, 128, 1, 768, 4, 3)
    second = skinny_config(2, 30720, 768, 8, BF16, 132)
    assert second.split_k == 22 and second.k_per_split % 128 == 0
    assert (second.split_k - 1) * second.k_per_split < 30720 <= second.split_k * second.k_per_split
    assert skinny_config(2, 30720, 768, 8, torch.float32, 132).block_k == 64  # a weight tile of 16 KiB either way
    assert skinny_config(100, 24, 20, 3, torch.float32, 132)[:3] == (64, 32, 32)  # small dims: the tiles that fit


@needs_kernel
@pytest.mark.parametrize("grad", [False, True], ids=["inference", "training"])
def test_mlp_experts_through_the_kernel_equal_the_default_product(grad):
    """MLPExperts.forward_selected(product=softmoe::skinny_grouped_mm): the output (and, training, the
    gradients) of softmoe::grouped_mm's, a padding group (-1) zero."""
    torch.manual_seed(8)
    experts = MLPExperts(5, 24, 40, activation="gelu").to(DEVICE)
    rows = torch.randn(6, 3, 24, device=DEVICE)
    expert = torch.tensor([4, 0, -1, 4, 2, 0], device=DEVICE)
    with torch.set_grad_enabled(grad):
        got = experts.forward_selected(rows, expert, product=skinny_grouped_mm)
        want = experts.forward_selected(rows, expert)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[2]) == 0
    if grad:
        params = list(experts.parameters())
        g = torch.randn_like(got)
        for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def cuda_backend_on_the_cpu(monkeypatch) -> None:
    """The "cuda" backend with its device checks lifted: CPU tensors stand in for CUDA ones."""
    monkeypatch.setattr(REGISTRY["cuda"], "unsupported", lambda layer, x: None)
    monkeypatch.setattr(cuda_backend, "skinny_applies",
                        lambda rows, dtype, weight_dtype, device: skinny_applies(rows, dtype, weight_dtype,
                                                                                 torch.device("cuda")))


@needs_kernel
def test_the_cuda_backend_runs_the_selected_plan_through_the_kernel(monkeypatch):
    """Algorithm 1's selected plan on the "cuda" backend calls the op for 2 x 2 rows and equals the masked
    reference; 40 inputs (80 rows) take grouped_mm; the backend's steps say which runs."""
    cuda_backend_on_the_cpu(monkeypatch)
    torch.manual_seed(9)
    layer = SoftMoE(16, 4, expert_hidden=32, backend="cuda").eval().to(DEVICE)
    for batch, op in ((2, "softmoe::skinny_grouped_mm"), (40, "softmoe::grouped_mm")):
        x = torch.randn(batch, 5, 16, device=DEVICE)
        with torch.no_grad(), select_experts(layer, k=2, plan="selected"):
            called = kernels_called(lambda: layer(x))  # noqa: B023 (called at once)
            got = layer(x)
            want = masked_reference_forward(layer, x, top_k_by_combine(layer.route(x).combine, 2))
        assert op in called and ({"softmoe::skinny_grouped_mm", "softmoe::grouped_mm"} - {op}).isdisjoint(called)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    steps = REGISTRY["cuda"].steps(layer, x[:2])
    assert "softmoe::skinny_grouped_mm (Triton) for every k, else softmoe::grouped_mm" in steps["select"]
    assert "softmoe::skinny_grouped_mm (Triton) for k <= 3," in REGISTRY["cuda"].steps(layer, x[:17])["select"]
    assert "softmoe::skinny_grouped_mm" not in REGISTRY["cuda"].steps(layer, torch.randn(65, 5, 16))["select"]


@needs_kernel
def test_the_compiled_selected_plan_keeps_the_op_in_its_graph(monkeypatch):
    """torch.compile(fullgraph=True) of the layer on the "cuda" backend: the op is one node of the graph (the choice
    taken while tracing), and the output equals eager."""
    cuda_backend_on_the_cpu(monkeypatch)
    graphs = []

    def recorder(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.manual_seed(10)
    layer = SoftMoE(16, 4, expert_hidden=32, backend="cuda").eval().to(DEVICE)
    x = torch.randn(2, 5, 16, device=DEVICE)
    with torch.no_grad(), select_experts(layer, k=2, plan="selected"):
        want = layer(x)
        got = torch.compile(layer, backend=recorder, fullgraph=True)(x)
    ops = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    assert "softmoe.skinny_grouped_mm.default" in ops and "softmoe.grouped_mm.default" not in ops
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# Both kernels compiled for an H100 / H200 (sm_90) in each dtype, each activation once, as Triton compiles them at
# their first launch on a GPU (its bundled ptxas included), in a process where they are not decorated for the
# interpreter.
_COMPILE_FOR_SM90 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import softmoe.kernels.skinny_grouped_mm_triton as m

target = GPUTarget("cuda", 90, 32)
strides = ("stride_xm", "stride_xk", "stride_we", "stride_wk", "stride_wn", "stride_split")
for dtype in ("bf16", "fp16", "fp32"):
    p = "*" + dtype
    for finish, activation in ((True, "gelu_tanh"), (False, "none")):
        args = dict(x=p, weight=p, ends="*i32", bias=p, out=p if finish else "*fp32", n="i32", k="i32",
                    k_per_split="i32") | dict.fromkeys(strides, "i32")
        consts = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, PRECISION="ieee" if dtype == "fp32" else "tf32",
                      WIDEN=False, FINISH=finish, HAS_BIAS=finish, ACTIVATION=activation)
        source = ASTSource(m.skinny_grouped_mm_kernel, args | dict.fromkeys(consts, "constexpr"), constexprs=consts)
        triton.compile(source, target=target, options={"num_warps": 4, "num_stages": 3})
    args = dict(partial="*fp32", ends="*i32", bias=p, out=p, n="i32", split_k="i32", stride_split="i32")
    consts = dict(BLOCK_M=16, BLOCK_N=64, HAS_BIAS=True, ACTIVATION="gelu" if dtype == "bf16" else "relu")
    triton.compile(ASTSource(m.sum_partials_kernel, args | dict.fromkeys(consts, "constexpr"), constexprs=consts),
                   target=target)
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs a kernel as Python and lets through what Triton's compiler refuses (a global that is not
    a constexpr, say): both kernels are compiled for sm_90 here, no GPU needed."""
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
