"""softmoe::grouped_mm and softmoe::native_grouped_mm: rows sorted by expert through each expert's weight, registered
custom ops of one contract (torch's products; each expert's product in softmoe's CPU kernels by its shape)."""

from __future__ import annotations

import pytest
import torch

import softmoe.kernels.grouped_mm as op_module
from reference import kernels_called
from softmoe.activations import ACTIVATIONS
from softmoe.compat import has_grouped_gemm
from softmoe.kernels import native_available
from softmoe.kernels.grouped_mm import grouped_mm, grouped_mm_weight_grad
from softmoe.kernels.native_grouped_mm import native_grouped_mm, row_block_matmul
from softmoe.runtime import cpu_signature
from softmoe.tuning import TABLE, Measured, value

F64 = torch.float64
# the tests of the contract run on both ops
OPS = pytest.mark.parametrize("op", [grouped_mm, native_grouped_mm], ids=["grouped_mm", "native_grouped_mm"])
OVERLOADS = {
    grouped_mm: torch.ops.softmoe.grouped_mm.default,
    native_grouped_mm: torch.ops.softmoe.native_grouped_mm.default,
}


def ends_of(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def loop_reference(x: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    blocks, start = [], 0
    for j, count in enumerate(counts):
        blocks.append(x[start : start + count] @ weight[j])
        start += count
    return torch.cat(blocks)


@pytest.mark.parametrize("counts", [[3, 1, 4, 2], [0, 5, 0, 2], [6, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]])
@OPS
def test_grouped_mm_and_gradients_equal_the_per_expert_loop(op, counts):
    torch.manual_seed(sum(counts))
    x = torch.randn(sum(counts), 5, dtype=F64, requires_grad=True)
    weight = torch.randn(4, 5, 3, dtype=F64, requires_grad=True)
    out = op(x, weight, ends_of(counts))
    want = loop_reference(x, weight, counts)
    assert out.shape == (sum(counts), 3)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    got_grads = torch.autograd.grad(out, [x, weight], g, allow_unused=True)
    want_grads = torch.autograd.grad(want, [x, weight], g, allow_unused=True)
    for got, expected in zip(got_grads, want_grads, strict=True):
        expected = torch.zeros_like(got) if expected is None else expected
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for j, count in enumerate(counts):  # an expert without rows gets exactly zero gradient
        if count == 0:
            assert torch.count_nonzero(got_grads[1][j]) == 0


@pytest.mark.parametrize("counts", [[3, 1, 4, 2], [0, 5, 0, 2], [0, 0, 0, 0]])
@OPS
def test_bias_is_added_per_expert_with_its_gradient(op, counts):
    """bias[j] is added to expert j's rows only (not to rows past the last end); its gradient is the sum of that
    expert's rows of the upstream gradient."""
    torch.manual_seed(sum(counts) + 1)
    rows = sum(counts) + 2  # two rows no expert owns
    x = torch.randn(rows, 5, dtype=F64, requires_grad=True)
    weight = torch.randn(4, 5, 3, dtype=F64, requires_grad=True)
    bias = torch.randn(4, 3, dtype=F64, requires_grad=True)
    out = op(x, weight, ends_of(counts), bias)
    owner = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    want = torch.cat([loop_reference(x, weight, counts) + bias[owner], torch.zeros(2, 3, dtype=F64)])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    g = torch.randn_like(out)
    for got, expected in zip(torch.autograd.grad(out, [x, weight, bias], g),
                             torch.autograd.grad(want, [x, weight, bias], g, allow_unused=True), strict=True):
        torch.testing.assert_close(got, torch.zeros_like(got) if expected is None else expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("native", [False, True])
@OPS
def test_a_fused_activation_equals_it_applied_after(op, monkeypatch, activation, native):
    """Inference only: act(x @ w + b) per expert, zero rows past the last end; with native, every weight counts
    as large (for softmoe::native_grouped_mm the native kernel, column and row splits, MKL above its rows; the
    generic op ignores the table); a ValueError where a gradient is needed."""
    if native:
        if not native_available():
            pytest.skip("softmoe's native kernels are not built here")
        monkeypatch.setitem(TABLE, "large_weight", Measured(1, "a test"))
        monkeypatch.setitem(TABLE, "native_min_weight", Measured(1, "a test"))
    torch.manual_seed(3)
    counts = [2, 0, 5, value("native_forward_max_rows") + 1]
    for k, n in ((6, 40), (40, 6)):
        x, weight, bias = torch.randn(sum(counts) + 1, k), torch.randn(4, k, n), torch.randn(4, n)
        got = op(x, weight, ends_of(counts), bias, activation)
        owner = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
        plain = loop_reference(x.double(), weight.double(), counts) + bias.double()[owner]
        want = torch.cat([ACTIVATIONS[activation](plain), torch.zeros(1, n, dtype=F64)])
        assert (got.double() - want).abs().max().item() < 1e-5
    with pytest.raises(ValueError, match="has no backward"):
        op(x, weight.requires_grad_(), ends_of(counts), bias, activation)
    with torch.no_grad():
        op(x, weight, ends_of(counts), bias, activation)


def test_row_groups_name_the_owner_of_every_row():
    assert op_module.row_groups(ends_of([2, 0, 3]), 7).tolist() == [0, 0, 2, 2, 2, 3, 3]


@OPS
def test_grouped_mm_never_reads_an_expert_without_rows(op):
    weight = torch.randn(3, 4, 2)
    weight[1] = float("nan")
    out = op(torch.randn(5, 4), weight, ends_of([2, 0, 3]))
    assert torch.isfinite(out).all()


@OPS
def test_rows_past_the_last_end_are_zero_and_unread(op):
    """Rows no expert owns (the padding of adaptive selection) give zero outputs and zero gradients, whatever they
    hold."""
    x = torch.randn(7, 4, dtype=torch.float64)
    x[5:] = float("nan")
    x.requires_grad_()
    weight = torch.randn(3, 4, 2, dtype=torch.float64, requires_grad=True)
    out = op(x, weight, ends_of([2, 0, 3]))
    assert torch.equal(out[5:], torch.zeros(2, 2, dtype=torch.float64)) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.equal(x.grad[5:], torch.zeros(2, 4, dtype=torch.float64)) and torch.isfinite(weight.grad).all()


@pytest.mark.slow
@pytest.mark.parametrize("counts", [[3, 0, 2], [0, 0, 4]])
@OPS
def test_grouped_mm_ops_pass_opcheck(op, counts):
    x = torch.randn(sum(counts), 8, requires_grad=True)
    weight = torch.randn(3, 8, 4, requires_grad=True)
    torch.library.opcheck(op, (x, weight, ends_of(counts)))
    torch.library.opcheck(op, (x, weight, ends_of(counts), torch.randn(3, 4, requires_grad=True)))
    torch.library.opcheck(op, (x.detach(), weight.detach(), ends_of(counts), torch.randn(3, 4), "gelu"))
    torch.library.opcheck(grouped_mm_weight_grad, (x.detach(), torch.randn(sum(counts), 4), ends_of(counts), 3))


@OPS
def test_grouped_mm_bad_inputs_raise(op):
    with pytest.raises(ValueError, match=r"x \(rows, K\) and weight \(E, K, N\), got \(4, 3\) and \(2, 5, 6\)"):
        op(torch.randn(4, 3), torch.randn(2, 5, 6), ends_of([1, 3]))
    with pytest.raises(ValueError, match=r"ends must be an int32 tensor of shape \(2,\), got torch.int64 \(2,\)"):
        op(torch.randn(4, 5), torch.randn(2, 5, 6), torch.tensor([1, 4]))
    with pytest.raises(ValueError, match=r"bias must have shape \(2, 6\), got \(6,\)"):
        op(torch.randn(4, 5), torch.randn(2, 5, 6), ends_of([1, 3]), torch.randn(6))
    with pytest.raises(ValueError, match=r"activation must be 'none' or one of \['gelu', 'gelu_tanh', 'relu'\], got 'tanh'"):
        op(torch.randn(4, 5), torch.randn(2, 5, 6), ends_of([1, 3]), None, "tanh")


@OPS
def test_grouped_mm_compiles_once_for_every_pattern_of_group_sizes(op):
    """The op is one node of a full graph: new group sizes neither break the graph nor recompile."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    weight = torch.randn(4, 8, 4)
    fn = torch.compile(lambda x, ends: op(x, weight, ends), backend=backend, fullgraph=True)
    x = torch.randn(12, 8)
    for counts in ([3, 3, 3, 3], [12, 0, 0, 0], [0, 5, 0, 7], [1, 2, 4, 5]):
        assert torch.equal(fn(x, ends_of(counts)), op(x, weight, ends_of(counts)))
    assert len(graphs) == 1
    assert any(node.target is OVERLOADS[op] for node in graphs[0].graph.nodes)


@pytest.fixture
def large_weights_on_two_threads(monkeypatch):
    """Every weight counts as large (the faster CPU kernels of group_product apply), every product as large enough
    for oneDNN, on 2 threads."""
    monkeypatch.setitem(TABLE, "large_weight", Measured(1, "a test"))
    monkeypatch.setitem(TABLE, "onednn_min_product_flops", Measured(1, "a test"))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_the_generic_op_takes_torchs_products_only(large_weights_on_two_threads, monkeypatch):
    """softmoe::grouped_mm runs torch's products where every weight counts as large and oneDNN pays for every product:
    no native kernel, no oneDNN (softmoe::native_grouped_mm takes them, the tests below)."""
    monkeypatch.setitem(TABLE, "native_min_weight", Measured(1, "a test"))
    vendor, family, _ = cpu_signature()
    monkeypatch.setitem(TABLE, "onednn_cpus", Measured(((vendor, family, None),), "a test: this CPU"))
    x, weight, counts = torch.randn(7, 12), torch.randn(3, 12, 40), [1, 0, 6]
    with torch.no_grad():
        called = kernels_called(lambda: grouped_mm(x, weight, ends_of(counts), None, "relu"))
    assert "aten::mm" in called and "softmoe::expert_matmul" not in called and "mkldnn::_linear_pointwise" not in called
    if native_available():
        with torch.no_grad():
            assert "softmoe::expert_matmul" in kernels_called(lambda: native_grouped_mm(x, weight, ends_of(counts)))


@pytest.mark.skipif(not native_available(), reason="softmoe's native kernels are not built here")
def test_row_block_matmul_with_the_native_kernel_sums_every_block():
    torch.manual_seed(2)
    x, w = torch.randn(5, 96), torch.randn(96, 20)
    want = x.double() @ w.double()
    for blocks in (1, 2, 3, 4, 5):  # 5 does not divide 96: one block
        assert (row_block_matmul(x, w, blocks).double() - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("rows", [1, 3])
def test_large_float64_weights_take_one_product_exactly_with_gradients(large_weights_on_two_threads, rows):
    """Few rows through a large weight the native kernel does not serve (float64): one product per expert, exact."""
    x = torch.randn(rows + 2, 6, dtype=F64, requires_grad=True)
    weight = torch.randn(2, 6, 16, dtype=F64, requires_grad=True)
    counts = [2, rows]
    called = kernels_called(lambda: native_grouped_mm(x, weight, ends_of(counts)))
    assert "mkldnn::_linear_pointwise" not in called and "softmoe::expert_matmul" not in called
    out = native_grouped_mm(x, weight, ends_of(counts))
    want = loop_reference(x, weight, counts)
    assert (out - want).abs().max().item() < 1e-12
    for got, expected in zip(torch.autograd.grad(out.square().sum(), [x, weight]),
                             torch.autograd.grad(want.square().sum(), [x, weight]), strict=True):
        assert (got - expected).abs().max().item() < 1e-10


@pytest.mark.parametrize("onednn_faster", [True, False])
def test_large_float32_weights_take_onednn_where_it_outruns_mkl(large_weights_on_two_threads, monkeypatch,
                                                                onednn_faster):
    """oneDNN where the tuning table says it outruns MKL on this CPU ("onednn_cpus"), MKL where it does not."""
    vendor, family, _ = cpu_signature()
    cpus = ((vendor, family, None),) if onednn_faster else ()
    monkeypatch.setitem(TABLE, "onednn_cpus", Measured(cpus, "a test: this CPU" if onednn_faster else "a test: no CPU"))
    torch.manual_seed(0)
    weight = torch.randn(2, 12, 40)
    x = torch.randn(6, 12)
    counts = [2, 4]
    called = kernels_called(lambda: native_grouped_mm(x, weight, ends_of(counts)))
    assert ("mkldnn::_linear_pointwise" in called) == onednn_faster
    assert ("aten::mm" in called) == (not onednn_faster)
    want = loop_reference(x.double(), weight.double(), counts)
    assert (native_grouped_mm(x, weight, ends_of(counts)).double() - want).abs().max().item() < 1e-5


@pytest.mark.skipif(not native_available(), reason="softmoe's native kernels are not built here")
@pytest.mark.parametrize("k, n", [(24, 40), (40, 24), (41, 24)], ids=["wide", "tall", "tall-odd"])
def test_large_weights_take_the_native_expert_matmul_for_few_rows(large_weights_on_two_threads, monkeypatch, k, n):
    """Groups of 1..native_forward_max_rows rows (softmoe.tuning.TABLE) through a large weight run
    softmoe::expert_matmul (more than one row through a tall weight cut in two row blocks where 2 divides K), more
    rows and a transposed weight (the backward) do not; equal to float64, gradients included."""
    monkeypatch.setitem(TABLE, "native_min_weight", Measured(1, "a test"))
    torch.manual_seed(1)
    most = value("native_forward_max_rows")
    assert most > value("native_max_rows")  # forward-only products take the native kernel further
    counts = [1, 2, most, 0, most + 1]
    x = torch.randn(sum(counts), k, requires_grad=True)
    weight = torch.randn(5, k, n, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        native_grouped_mm(x, weight, ends_of(counts))
    calls = {event.key: event.count for event in prof.key_averages()}
    assert calls.get("softmoe::expert_matmul") == 3  # the groups of 1, 2 and native_forward_max_rows rows
    out = native_grouped_mm(x, weight, ends_of(counts))
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = loop_reference(x64, w64, counts)
    assert (out.double() - want).abs().max().item() < 1e-4
    grad = torch.randn(out.shape)
    got = torch.autograd.grad(out, [x, weight], grad)
    expected = torch.autograd.grad(want, [x64, w64], grad.double())
    for g, e in zip(got, expected, strict=True):
        assert (g.double() - e).abs().max().item() < 1e-3


@pytest.mark.skipif(not has_grouped_gemm(), reason="torch before 2.8 has no grouped GEMM")
@pytest.mark.parametrize("activation", ["none", "gelu"])
def test_the_grouped_gemm_branch_with_bias_activation_and_padding_rows(monkeypatch, activation):
    """The branch CUDA bf16 takes (torch._grouped_mm, bias gathered by row group, no host read), run on the CPU,
    where torch 2.13 has _grouped_mm too: bias per expert, activation, zero rows past the last end, the bias gradient
    summed per expert."""
    # CI has no GPU: the branch is taken on the CPU where the op decides whether torch's grouped GEMM serves
    monkeypatch.setattr(op_module, "uses_grouped_gemm", lambda a, b, k, n: True)
    torch.manual_seed(9)
    counts = [5, 0, 3, 9]
    x64, w64, b64 = torch.randn(sum(counts) + 2, 16, dtype=F64), torch.randn(4, 16, 24, dtype=F64), torch.randn(4, 24, dtype=F64)
    x, weight, bias = (t.to(torch.bfloat16).requires_grad_(activation == "none") for t in (x64, w64, b64))
    assert "aten::_grouped_mm" in kernels_called(lambda: grouped_mm(x.detach(), weight.detach(), ends_of(counts)))
    out = grouped_mm(x, weight, ends_of(counts), bias, activation)
    owner = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    for t in (x64, w64, b64):
        t.requires_grad_()
    plain = loop_reference(x64, w64, counts) + b64[owner]
    want = torch.cat([plain if activation == "none" else ACTIVATIONS[activation](plain), torch.zeros(2, 24, dtype=F64)])
    scale = want.abs().max()
    assert ((out.double() - want).abs().max() / scale).item() < 2e-2
    assert torch.equal(out[-2:], torch.zeros(2, 24, dtype=torch.bfloat16))
    if activation == "none":
        g64 = torch.randn(out.shape, dtype=F64)
        out.backward(g64.to(torch.bfloat16))
        want.backward(g64)
        for got, expected in ((x.grad, x64.grad), (weight.grad, w64.grad), (bias.grad, b64.grad)):
            assert ((got.double() - expected).abs().max() / expected.abs().max().clamp_min(1.0)).item() < 2e-2


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("counts", [[5, 0, 3, 9], [0, 0, 17, 0], [1, 1, 1, 1]])
def test_cuda_bfloat16_takes_torchs_grouped_gemm_and_equals_the_loop(counts):
    """Forward, both gradients and an expert without rows (zero gradient) through torch._grouped_mm."""
    torch.manual_seed(len(counts))
    x64, w64 = torch.randn(sum(counts), 16, dtype=F64), torch.randn(4, 16, 24, dtype=F64)
    x = x64.to("cuda", torch.bfloat16).requires_grad_()
    weight = w64.to("cuda", torch.bfloat16).requires_grad_()
    ends = ends_of(counts).cuda()
    assert op_module.uses_grouped_gemm(x, weight, 16, 24)
    assert "aten::_grouped_mm" in kernels_called(lambda: grouped_mm(x, weight, ends))
    out = grouped_mm(x, weight, ends)
    g64 = torch.randn(out.shape, dtype=F64)
    out.backward(g64.to("cuda", torch.bfloat16))
    x64.requires_grad_(), w64.requires_grad_()
    want = loop_reference(x64, w64, counts)
    want.backward(g64)
    for got, expected in ((out, want), (x.grad, x64.grad), (weight.grad, w64.grad)):
        scale = expected.abs().max().clamp_min(1.0)
        assert ((got.double().cpu() - expected).abs().max() / scale).item() < 2e-2
    for j, count in enumerate(counts):
        if count == 0:
            assert torch.count_nonzero(weight.grad[j]) == 0


@cuda
def test_cuda_grouped_ops_pass_opcheck():
    x = torch.randn(7, 16, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(3, 16, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ends = ends_of([4, 0, 3]).cuda()
    torch.library.opcheck(grouped_mm, (x, weight, ends))
    torch.library.opcheck(grouped_mm_weight_grad, (x.detach(), torch.randn(7, 8, device="cuda", dtype=torch.bfloat16),
                                                  ends, 3))
