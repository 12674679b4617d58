"""Tests of the batched experts: MLPExperts (stacked weights, bmm) and StackedExperts (vmap over copies)."""

from __future__ import annotations

import math

import pytest
import torch
from reference import kernels_called, ref_activation
from torch import nn

import softmoe.experts as experts_module
from softmoe import MLPExperts, StackedExperts

F64 = torch.float64




def ref_expert(experts: MLPExperts, j: int, rows: torch.Tensor) -> torch.Tensor:
    """Expert j on a (rows, dim) block, row by row, from its slices of the stacked weights."""
    out = torch.zeros(rows.shape[0], experts.dim, dtype=F64)
    for r in range(rows.shape[0]):
        h = rows[r] @ experts.weight1[j].detach()
        if experts.bias1 is not None:
            h = h + experts.bias1[j].detach()
        y = ref_activation(experts.activation, h) @ experts.weight2[j].detach()
        if experts.bias2 is not None:
            y = y + experts.bias2[j].detach()
        out[r] = y
    return out


def make_mlp(num_experts=4, dim=5, hidden=7, activation="gelu", bias=True, seed=0) -> MLPExperts:
    torch.manual_seed(seed)
    return MLPExperts(num_experts, dim, hidden, activation, bias, dtype=F64)


def mlp_module(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def make_stacked(num_experts=4, dim=5, hidden=7, seed=0) -> tuple[StackedExperts, nn.Module]:
    torch.manual_seed(seed)
    template = mlp_module(dim, hidden).double()
    return StackedExperts(template, num_experts, dim), template


def stacked_ref(stacked: StackedExperts, template: nn.Module, j: int, rows: torch.Tensor) -> torch.Tensor:
    params, buffers = stacked.expert_state(j)
    return torch.func.functional_call(template, (params, buffers), (rows,))


# ----------------------------------------------------------------------------------------------------------------
# MLPExperts
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_forward_equals_per_expert_loop(activation, bias):
    experts = make_mlp(activation=activation, bias=bias)
    x = torch.randn(4, 6, 5, dtype=F64)
    with torch.no_grad():
        out = experts(x)
    assert out.shape == (4, 6, 5)
    for j in range(4):
        assert (out[j] - ref_expert(experts, j, x[j])).abs().max().item() < 1e-12


def test_mlp_forward_rejects_bad_shapes():
    experts = make_mlp()
    with pytest.raises(ValueError, match=r"num_experts=4, rows, dim=5\), got \(3, 6, 5\)"):
        experts(torch.randn(3, 6, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"dim=5\), got \(4, 6, 6\)"):
        experts(torch.randn(4, 6, 6, dtype=F64))
    with pytest.raises(ValueError, match=r"got \(24, 5\)"):
        experts(torch.randn(24, 5, dtype=F64))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("counts", [[3, 1, 4, 2], [0, 5, 0, 2], [6, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]])
def test_mlp_run_grouped_equals_blocks(bias, counts):
    experts = make_mlp(bias=bias)
    rows = sum(counts)
    x = torch.randn(rows, 5, dtype=F64)
    with torch.no_grad():
        out = experts.run_grouped(x, torch.tensor(counts))
    assert out.shape == (rows, 5)
    start = 0
    for j, count in enumerate(counts):
        if count:
            block = slice(start, start + count)
            assert (out[block] - ref_expert(experts, j, x[block])).abs().max().item() < 1e-12
        start += count


def test_mlp_run_grouped_skips_empty_experts():
    """An expert with no rows is never evaluated: NaN weights in it cannot reach the output."""
    experts = make_mlp()
    counts = torch.tensor([2, 0, 3, 0])
    with torch.no_grad():
        for name in ("weight1", "bias1", "weight2", "bias2"):
            getattr(experts, name)[1].fill_(float("nan"))
            getattr(experts, name)[3].fill_(float("nan"))
    x = torch.randn(5, 5, dtype=F64)
    with torch.no_grad():
        out = experts.run_grouped(x, counts)
    assert torch.isfinite(out).all()
    assert (out[:2] - ref_expert(experts, 0, x[:2])).abs().max().item() < 1e-12
    assert (out[2:] - ref_expert(experts, 2, x[2:])).abs().max().item() < 1e-12


def test_mlp_run_grouped_gradients():
    experts = make_mlp()
    counts = torch.tensor([2, 0, 3, 1])
    x = torch.randn(6, 5, dtype=F64, requires_grad=True)
    experts.run_grouped(x, counts).sum().backward()
    assert torch.all(experts.weight1.grad[1] == 0) and torch.all(experts.weight2.grad[1] == 0)
    for j in (0, 2, 3):
        assert experts.weight1.grad[j].abs().sum() > 0
        assert experts.weight2.grad[j].abs().sum() > 0
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0


@pytest.fixture
def large_experts_on_two_threads(monkeypatch):
    """Every expert counts as large (the fast single-expert kernels of MLPExperts.run_one apply) on 2 threads."""
    monkeypatch.setattr(experts_module, "LARGE_EXPERT", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_row_block_matmul_sums_blocks_exactly():
    x, w = torch.randn(3, 12, dtype=F64), torch.randn(12, 5, dtype=F64)
    for blocks in (1, 2, 3, 4, 5):  # 5 does not divide 12: plain matmul
        assert (experts_module.row_block_matmul(x, w, blocks) - x @ w).abs().max().item() < 1e-12


@pytest.mark.parametrize("dim, hidden", [(6, 16), (5, 7)])  # both weights in 2 row blocks; neither divisible
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_run_one_row_blocks_exact_with_gradients(large_experts_on_two_threads, dim, hidden, bias):
    experts = make_mlp(dim=dim, hidden=hidden, bias=bias)
    x = torch.randn(3, dim, dtype=F64, requires_grad=True)
    assert "mkldnn::_linear_pointwise" not in kernels_called(lambda: experts.run_one(x, 2))  # float64, gradients
    out = experts.run_one(x, 2)
    assert (out - ref_expert(experts, 2, x.detach())).abs().max().item() < 1e-12
    out.square().sum().backward()
    grads = {"x": x.grad.clone()} | {name: p.grad[2].clone() for name, p in experts.named_parameters()}
    x.grad = None
    ref = {name: p[2].detach().clone().requires_grad_() for name, p in experts.named_parameters()}
    h = x @ ref["weight1"] + (ref["bias1"] if bias else 0)
    y = ref_activation(experts.activation, h) @ ref["weight2"] + (ref["bias2"] if bias else 0)
    y.square().sum().backward()
    expected = {"x": x.grad} | {name: t.grad for name, t in ref.items()}
    assert grads.keys() == expected.keys()
    for name, want in expected.items():
        assert (grads[name] - want).abs().max().item() < 1e-10, name


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_run_one_onednn_inference_kernel(large_experts_on_two_threads, activation, bias):
    torch.manual_seed(0)
    experts = MLPExperts(3, 12, 40, activation, bias)
    x = torch.randn(experts_module.ONEDNN_MIN_ROWS + 2, 12)
    with torch.no_grad():
        assert "mkldnn::_linear_pointwise" in kernels_called(lambda: experts.run_one(x, 1))
        out = experts.run_one(x, 1)
    want = ref_expert(experts.double(), 1, x.double())
    assert (out.double() - want).abs().max().item() < 1e-5
    experts.float()
    few = x[: experts_module.ONEDNN_MIN_ROWS - 1]
    with torch.no_grad():
        assert "mkldnn::_linear_pointwise" not in kernels_called(lambda: experts.run_one(few, 1))
    # with gradients needed, the differentiable kernels run and the gradient reaches the weights
    assert "mkldnn::_linear_pointwise" not in kernels_called(lambda: experts.run_one(x, 1).sum().backward())
    assert experts.weight1.grad[1].abs().sum() > 0 and experts.weight1.grad[0].abs().sum() == 0


@pytest.mark.parametrize("kind", ["mlp", "stacked"])
def test_run_grouped_bad_counts_raise(kind):
    experts = make_mlp() if kind == "mlp" else make_stacked()[0]
    x = torch.randn(6, 5, dtype=F64)
    with pytest.raises(ValueError, match=r"counts must have shape \(4,\), got \(3,\)"):
        experts.run_grouped(x, torch.tensor([2, 2, 2]))
    with pytest.raises(ValueError, match=r"counts must have shape \(4,\), got \(2, 2\)"):
        experts.run_grouped(x, torch.tensor([[2, 1], [2, 1]]))
    with pytest.raises(ValueError, match=r"counts sum to 7 but x has 6 rows"):
        experts.run_grouped(x, torch.tensor([2, 2, 2, 1]))
    with pytest.raises(ValueError, match=r"counts sum to 5 but x has 6 rows"):
        experts.run_grouped(x, torch.tensor([2, 0, 2, 1]))


@pytest.mark.parametrize("kind", ["mlp", "stacked"])
def test_run_grouped_negative_counts_raise(kind):
    """Counts that sum to the number of rows but contain a negative entry must be rejected, not mis-assigned."""
    experts = make_mlp() if kind == "mlp" else make_stacked()[0]
    x = torch.randn(6, 5, dtype=F64)
    with pytest.raises(ValueError, match=r"-1"):
        experts.run_grouped(x, torch.tensor([4, -1, 2, 1]))


@pytest.mark.parametrize("kind", ["mlp", "stacked"])
def test_run_grouped_non_integer_counts_raise(kind):
    experts = make_mlp() if kind == "mlp" else make_stacked()[0]
    x = torch.randn(6, 5, dtype=F64)
    with pytest.raises(ValueError, match=r"float"):
        experts.run_grouped(x, torch.tensor([2.0, 1.0, 2.0, 1.0]))


def test_mlp_init_bounds():
    """Each expert is initialized like nn.Linear: uniform in +-1/sqrt(fan_in)."""
    torch.manual_seed(1)
    experts = MLPExperts(3, 64, 256)
    for name, fan_in in (("weight1", 64), ("bias1", 64), ("weight2", 256), ("bias2", 256)):
        value = getattr(experts, name).detach()
        bound = 1 / math.sqrt(fan_in)
        assert value.abs().max().item() <= bound, name
        assert value.abs().max().item() > 0.9 * bound, name
    # Uniform in +-b has std b/sqrt(3).
    assert abs(experts.weight1.detach().std().item() / (1 / math.sqrt(64) / math.sqrt(3)) - 1) < 0.05


@pytest.mark.parametrize("identical", [False, True])
def test_mlp_identical_init(identical):
    torch.manual_seed(2)
    experts = MLPExperts(4, 6, 8, identical_init=identical)
    for name in ("weight1", "bias1", "weight2", "bias2"):
        value = getattr(experts, name)
        assert value[0].abs().sum() > 0, name
        for j in range(1, 4):
            assert torch.equal(value[j], value[0]) is identical, (name, j)


def test_mlp_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"hidden must be an integer >= 1, got 0"):
        MLPExperts(2, 4, 0)
    with pytest.raises(ValueError, match=r"num_experts must be an integer >= 1, got 0"):
        MLPExperts(0, 4, 4)
    with pytest.raises(ValueError, match=r"dim must be an integer >= 1, got -2"):
        MLPExperts(2, -2, 4)
    with pytest.raises(ValueError, match=r"got 'tanh'"):
        MLPExperts(2, 4, 4, activation="tanh")


# ----------------------------------------------------------------------------------------------------------------
# StackedExperts
# ----------------------------------------------------------------------------------------------------------------


def test_stacked_forward_equals_per_expert_calls():
    stacked, template = make_stacked()
    x = torch.randn(4, 6, 5, dtype=F64)
    with torch.no_grad():
        out = stacked(x)
        for j in range(4):
            assert (out[j] - stacked_ref(stacked, template, j, x[j])).abs().max().item() < 1e-12


def test_stacked_matches_mlp_experts_with_same_weights():
    mlp = make_mlp(activation="gelu")
    stacked, _ = make_stacked(seed=3)
    with torch.no_grad():
        stacked.get_parameter("0__weight").copy_(mlp.weight1.transpose(1, 2))
        stacked.get_parameter("0__bias").copy_(mlp.bias1)
        stacked.get_parameter("2__weight").copy_(mlp.weight2.transpose(1, 2))
        stacked.get_parameter("2__bias").copy_(mlp.bias2)
    x = torch.randn(4, 6, 5, dtype=F64)
    counts = torch.tensor([1, 0, 3, 2])
    flat = torch.randn(6, 5, dtype=F64)
    with torch.no_grad():
        assert (stacked(x) - mlp(x)).abs().max().item() < 1e-12
        assert (stacked.run_grouped(flat, counts) - mlp.run_grouped(flat, counts)).abs().max().item() < 1e-12


def test_stacked_run_grouped_equals_forward():
    stacked, _ = make_stacked()
    x = torch.randn(4, 3, 5, dtype=F64)
    counts = torch.full((4,), 3)
    with torch.no_grad():
        grouped = stacked.run_grouped(x.reshape(12, 5), counts)
        assert (grouped - stacked(x).reshape(12, 5)).abs().max().item() < 1e-12


@pytest.mark.parametrize("counts", [[1, 0, 3, 2], [0, 0, 4, 0], [0, 0, 0, 0]])
def test_stacked_run_grouped_uneven_blocks(counts):
    stacked, template = make_stacked()
    rows = sum(counts)
    x = torch.randn(rows, 5, dtype=F64)
    with torch.no_grad():
        out = stacked.run_grouped(x, torch.tensor(counts))
        start = 0
        for j, count in enumerate(counts):
            if count:
                block = slice(start, start + count)
                assert (out[block] - stacked_ref(stacked, template, j, x[block])).abs().max().item() < 1e-12
            start += count
    assert out.shape == (rows, 5)


def test_stacked_run_grouped_skips_empty_experts():
    stacked, template = make_stacked()
    with torch.no_grad():
        for _, value in stacked.named_parameters():
            value[0].fill_(float("nan"))
    x = torch.randn(4, 5, dtype=F64)
    with torch.no_grad():
        out = stacked.run_grouped(x, torch.tensor([0, 1, 3, 0]))
    assert torch.isfinite(out).all()


def test_stacked_parameters_and_independence():
    torch.manual_seed(4)
    template = mlp_module(5, 7)
    stacked = StackedExperts(template, 3, 5)
    shapes = {name: tuple(value.shape) for name, value in stacked.named_parameters()}
    assert shapes == {"0__weight": (3, 7, 5), "0__bias": (3, 7), "2__weight": (3, 5, 7), "2__bias": (3, 5)}
    # The template is not a submodule: its own weights are not parameters of the stack.
    assert len(list(stacked.parameters())) == 4
    for name, value in stacked.named_parameters():
        for i in range(3):
            for j in range(i + 1, 3):
                assert not torch.allclose(value[i], value[j]), (name, i, j)


def test_stacked_identical_init():
    torch.manual_seed(5)
    template = mlp_module(5, 7)
    stacked = StackedExperts(template, 3, 5, identical_init=True)
    expected = dict(template.named_parameters())
    for name, value in stacked.named_parameters():
        for j in range(3):
            assert torch.equal(value[j], expected[name.replace("__", ".")].detach()), (name, j)


def test_stacked_gradients_reach_every_copy():
    stacked, _ = make_stacked()
    x = torch.randn(4, 3, 5, dtype=F64)
    stacked(x).pow(2).sum().backward()
    for name, value in stacked.named_parameters():
        for j in range(4):
            assert value.grad[j].abs().sum() > 0, (name, j)


def test_stacked_bad_arguments_raise():
    with pytest.raises(ValueError, match=r"num_experts must be >= 1, got 0"):
        StackedExperts(mlp_module(4, 4), 0, 4)
    stacked, _ = make_stacked()
    with pytest.raises(ValueError, match=r"num_experts=4, rows, dim=5\), got \(3, 2, 5\)"):
        stacked(torch.randn(3, 2, 5, dtype=F64))
