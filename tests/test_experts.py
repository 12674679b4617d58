"""Tests of the batched experts: MLPExperts (stacked weights, bmm) and StackedExperts (vmap over copies)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from reference import ref_activation
from softmoe import MLPExperts, StackedExperts
from softmoe.experts import Experts

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


# Expert of each group, for groups of 3 rows: unsorted, repeated, experts left out, one expert only.
GROUP_EXPERTS = [[2, 0, 3, 0, 1], [3, 3, 1], [0], [1, 1, 1, 1]]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("expert", GROUP_EXPERTS)
def test_mlp_forward_selected_equals_each_groups_expert(bias, expert):
    experts = make_mlp(bias=bias)
    rows = torch.randn(len(expert), 3, 5, dtype=F64)
    with torch.no_grad():
        out = experts.forward_selected(rows, torch.tensor(expert))
    assert out.shape == (len(expert), 3, 5)
    for g, j in enumerate(expert):
        assert (out[g] - ref_expert(experts, j, rows[g])).abs().max().item() < 1e-12


def test_mlp_forward_selected_skips_unnamed_experts():
    """An expert no group names is never evaluated: NaN weights in it cannot reach the output."""
    experts = make_mlp()
    with torch.no_grad():
        for name in ("weight1", "bias1", "weight2", "bias2"):
            getattr(experts, name)[1].fill_(float("nan"))
            getattr(experts, name)[3].fill_(float("nan"))
    rows = torch.randn(3, 2, 5, dtype=F64)
    with torch.no_grad():
        out = experts.forward_selected(rows, torch.tensor([2, 0, 2]))
    assert torch.isfinite(out).all()
    assert (out[1] - ref_expert(experts, 0, rows[1])).abs().max().item() < 1e-12


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # (torch's jvp rules)
@pytest.mark.parametrize("expert", [[2, 0, -1, 3], [1, 1], [-1, -1]])
def test_mlp_forward_selected_under_forward_mode_ad(expert):
    """Under forward-mode AD (a transform for softmoe: the grouped products are custom ops, which drop tangents)
    every expert runs on every group in torch's ops and each group keeps its own: values and tangents equal the
    usual path's and its central differences; padding groups (-1) give zeros; unnamed experts' NaN weights stay out."""
    experts = make_mlp()
    with torch.no_grad():
        experts.weight1[1 if 1 not in expert else 2].fill_(float("nan"))  # an expert no group names
    rows, tangent = torch.randn(len(expert), 3, 5, dtype=F64), torch.randn(len(expert), 3, 5, dtype=F64)
    index = torch.tensor(expert)
    fwd = torch.autograd.forward_ad
    with torch.no_grad():
        want = experts.forward_selected(rows, index)
        h = 1e-7
        slope = (experts.forward_selected(rows + h * tangent, index) -
                 experts.forward_selected(rows - h * tangent, index)) / (2 * h)
        with fwd.dual_level():
            out = fwd.unpack_dual(experts.forward_selected(fwd.make_dual(rows, tangent), index))
    assert torch.isfinite(out.primal).all() and torch.isfinite(out.tangent).all()
    torch.testing.assert_close(out.primal, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.tangent, slope, rtol=1e-6, atol=1e-7)
    assert (out.primal[index < 0] == 0).all() and (out.tangent[index < 0] == 0).all()


@pytest.mark.parametrize("kind", ["mlp", "stacked"])
def test_forward_selected_gradients_equal_the_per_group_loop(kind):
    """Gradients of rows and of every stacked parameter equal those of running each group through its expert
    one at a time (float64); experts no group names get exactly zero gradient."""
    experts = make_mlp() if kind == "mlp" else make_stacked()[0]
    expert = torch.tensor([2, 0, 2, 3])
    rows = torch.randn(4, 3, 5, dtype=F64, requires_grad=True)
    weights = torch.randn(4, 3, 5, dtype=F64)
    params = dict(experts.named_parameters())
    got = torch.autograd.grad((experts.forward_selected(rows, expert) * weights).sum(), [rows, *params.values()])
    loop = torch.stack([experts(rows[g].expand(4, 3, 5))[j] for g, j in enumerate(expert.tolist())])
    want = torch.autograd.grad((loop * weights).sum(), [rows, *params.values()])
    for name, g, w in zip(["rows", *params], got, want, strict=True):
        assert (g - w).abs().max().item() < 1e-12, name
    for g in got[1:]:
        assert torch.count_nonzero(g[1]) == 0


@pytest.mark.parametrize("kind", ["mlp", "stacked"])
def test_forward_selected_bad_inputs_raise(kind):
    experts = make_mlp() if kind == "mlp" else make_stacked()[0]
    rows = torch.randn(3, 2, 5, dtype=F64)
    with pytest.raises(ValueError, match=r"selected rows must have shape \(groups, rows, dim=5\), got \(3, 2, 4\)"):
        experts.forward_selected(torch.randn(3, 2, 4, dtype=F64), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"expert must be an int64 tensor of shape \(groups=3,\), got torch.int64 \(2,\)"):
        experts.forward_selected(rows, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"got torch.float32"):
        experts.forward_selected(rows, torch.tensor([0.0, 1.0, 2.0]))


def test_both_banks_implement_the_experts_protocol():
    assert isinstance(make_mlp(), Experts)
    assert isinstance(make_stacked()[0], Experts)


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
    expert = torch.tensor([2, 0, 3, 2, 3])
    rows = torch.randn(5, 2, 5, dtype=F64)
    with torch.no_grad():
        assert (stacked(x) - mlp(x)).abs().max().item() < 1e-12
        grouped = stacked.forward_selected(rows, expert) - mlp.forward_selected(rows, expert)
        assert grouped.abs().max().item() < 1e-12


@pytest.mark.parametrize("expert", GROUP_EXPERTS)
def test_stacked_forward_selected_equals_each_groups_expert(expert):
    stacked, template = make_stacked()
    rows = torch.randn(len(expert), 3, 5, dtype=F64)
    with torch.no_grad():
        out = stacked.forward_selected(rows, torch.tensor(expert))
        for g, j in enumerate(expert):
            assert (out[g] - stacked_ref(stacked, template, j, rows[g])).abs().max().item() < 1e-12


def test_stacked_forward_selected_skips_unnamed_experts():
    stacked, _ = make_stacked()
    with torch.no_grad():
        for _, value in stacked.named_parameters():
            value[0].fill_(float("nan"))
    with torch.no_grad():
        out = stacked.forward_selected(torch.randn(3, 2, 5, dtype=F64), torch.tensor([1, 2, 2]))
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
