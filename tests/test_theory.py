"""Theorem 1 (Appendix B): witnesses on real layers, the single-slot collapse, and why n >= 2 escapes."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from softmoe import SoftMoE
from softmoe.theory import (
    CASE_NEGATIVE,
    CASE_NORMALIZED,
    CASE_POSITIVE,
    CASE_ZERO,
    NORM_GAP_SLOPE,
    single_expert_collapse,
    theorem1_witness,
    witness_gaps,
    witness_table,
)


class TanhExpert(nn.Module):
    """A custom (non-MLPExperts) expert: d -> 7 -> d with tanh, a skip and a buffer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, 7)
        self.outer = nn.Linear(7, dim)
        self.register_buffer("shift", torch.full((dim,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(torch.tanh(self.inner(x))) + 0.5 * x + self.shift


def make_layer(seed: int, dim: int, kind: str, normalize: bool = False, phi_first: float | None = None) -> SoftMoE:
    torch.manual_seed(seed)
    if kind == "mlp":
        layer = SoftMoE(dim, 1, expert_hidden=5 * dim, activation="relu", normalize=normalize)
    elif kind == "gelu":
        layer = SoftMoE(dim, 1, normalize=normalize)
    else:
        layer = SoftMoE(dim, 1, normalize=normalize, expert=TanhExpert(dim))
    with torch.no_grad():
        layer.phi.mul_(3.0)  # some scale, so that the fastest-decaying regime is reached at moderate a
        if phi_first is not None:
            layer.phi[0, 0, 0] = phi_first
    return layer


def sizes_for(layer: SoftMoE, coord: int) -> list[float]:
    """Sizes in units of 1/|phi_c| (the slot gap decays like a exp(-a |phi_c|)), plain sizes when phi_c = 0."""
    phi_c = abs(float(layer.phi.detach()[coord, 0, 0]))
    unit = 1.0 / phi_c if phi_c > 0 and layer.normalize == "none" else 1.0
    return [unit * k for k in (0.5, 2.0, 8.0, 30.0, 100.0, 300.0)]


def assert_witnesses_theorem(rows: list[dict], slope: float) -> None:
    sizes = [r["a"] for r in rows]
    norm_gaps = [r["norm_gap"] for r in rows]
    output_gaps = [r["output_gap"] for r in rows]
    # the norm gap is exactly linear in a ...
    for a, gap in zip(sizes, norm_gaps):
        assert gap == pytest.approx(slope * a, rel=1e-9)
    assert norm_gaps[-1] > 100 * norm_gaps[0]
    # ... while the outputs (and what the expert sees) converge to each other
    assert output_gaps[-1] < 1e-6
    assert rows[-1]["slot_gap"] < 1e-6
    assert output_gaps[-1] / norm_gaps[-1] < 1e-3 * output_gaps[0] / norm_gaps[0] + 1e-12
    assert max(output_gaps[-2:]) <= max(output_gaps) + 1e-15


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["mlp", "gelu", "custom"])
@pytest.mark.parametrize("phi_first", [0.7, -0.4, 0.0, None])
def test_witness_on_random_single_expert_layers(seed, kind, phi_first):
    dim, tokens = 3, 4
    layer = make_layer(seed, dim, kind, phi_first=phi_first)
    rows = witness_table(layer, sizes_for(layer, 0), tokens)
    phi_c = float(layer.phi.detach()[0, 0, 0])
    expected = CASE_ZERO if phi_c == 0 else (CASE_POSITIVE if phi_c > 0 else CASE_NEGATIVE)
    assert {r["case"] for r in rows} == {expected}
    assert_witnesses_theorem(rows, NORM_GAP_SLOPE[expected])


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["mlp", "custom"])
@pytest.mark.parametrize("dim", [1, 4])
def test_witness_with_normalized_routing(seed, kind, dim):
    layer = make_layer(seed, dim, kind, normalize=True)
    with torch.no_grad():
        layer.scale.fill_(5.0)  # a sharp router: the witness must not rely on a flat one
    rows = witness_table(layer, [1.0, 10.0, 100.0, 1e3, 1e4, 1e5], 3, token=2, partner=0)
    assert {r["case"] for r in rows} == {CASE_NORMALIZED}
    assert_witnesses_theorem(rows, NORM_GAP_SLOPE[CASE_NORMALIZED])


def test_proof_constructions_are_literal():
    a = 3.0
    layer = make_layer(0, 2, "mlp", phi_first=0.5)
    w = theorem1_witness(layer, a, 3)
    assert w.case == CASE_POSITIVE and (w.token, w.partner, w.coord) == (0, 1, 0)
    assert torch.equal(w.A, torch.tensor([[a, 0.0], [-a, 0.0], [0.0, 0.0]]))
    assert torch.equal(w.B, torch.tensor([[a, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    with torch.no_grad():
        layer.phi[0, 0, 0] = -0.5
    w = theorem1_witness(layer, a, 3)
    assert w.case == CASE_NEGATIVE
    assert torch.equal(w.A, torch.tensor([[-a, 0.0], [a, 0.0], [0.0, 0.0]]))
    assert torch.equal(w.B, torch.tensor([[-a, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    with torch.no_grad():
        layer.phi[0, 0, 0] = 0.0
    w = theorem1_witness(layer, a, 3)
    assert w.case == CASE_ZERO
    assert torch.equal(w.A, torch.tensor([[a / 2, 0.0], [a / 2, 0.0], [0.0, 0.0]]))
    assert torch.equal(w.B, torch.tensor([[a, 0.0], [0.0, 0.0], [0.0, 0.0]]))
    # the exact proof values: uniform dispatch, equal slots a/m, zero output gap
    gaps = witness_gaps(layer, w)
    assert gaps["slot_gap"] == 0.0 and gaps["output_gap"] == 0.0
    assert gaps["norm_gap"] == pytest.approx((1 - 1 / math.sqrt(2)) * a)


def test_coord_none_picks_largest_phi_and_tokens_are_placed():
    layer = make_layer(0, 3, "mlp")
    with torch.no_grad():
        layer.phi.copy_(torch.tensor([0.01, -2.0, 0.3]).view(3, 1, 1))
    w = theorem1_witness(layer, 2.0, 5, token=3, partner=1, coord=None)
    assert w.coord == 1 and w.case == CASE_NEGATIVE
    nonzero = w.A.nonzero().tolist()
    assert sorted(nonzero) == [[1, 1], [3, 1]]
    assert w.B.nonzero().tolist() == [[3, 1]]
    # with the largest |phi_c| the witness converges already at moderate a; with phi_c = 0.01 it has not yet
    fast = witness_table(layer, [20.0], 5, coord=None)[0]
    slow = witness_table(layer, [20.0], 5, coord=0)[0]
    assert fast["slot_gap"] < 1e-12 < 1e-2 < slow["slot_gap"]


def test_float32_evaluation_also_converges():
    layer = make_layer(3, 2, "mlp", phi_first=-1.0)
    rows = witness_table(layer, [1.0, 10.0, 50.0], 2, dtype=None)
    assert rows[-1]["output_gap"] < 1e-4 * rows[-1]["norm_gap"]


def train_l2norm_single_expert(steps: int = 60, tokens: int = 5, dim: int = 2, seed: int = 0) -> SoftMoE:
    """A briefly trained n = 1 model of Appendix C (relu expert d -> 10d -> d, no biases, sum head)."""
    torch.manual_seed(seed)
    layer = SoftMoE(dim, 1, expert_hidden=10 * dim, activation="relu", normalize=False, expert_bias=False)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    first = None
    for _ in range(steps):
        x = torch.randn(512, tokens * dim, generator=gen) * math.sqrt(5.0)
        pred = layer(x.view(-1, tokens, dim)).sum(dim=(1, 2))
        loss = torch.nn.functional.mse_loss(pred, x.norm(dim=1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert loss.item() < first  # it did train
    return layer


@pytest.mark.parametrize("tokens,dim", [(5, 2), (2, 5)])
def test_witness_on_trained_single_expert(tokens, dim):
    layer = train_l2norm_single_expert(tokens=tokens, dim=dim)
    phi_max = float(layer.phi.detach().abs().max())
    sizes = [k / phi_max for k in (1.0, 10.0, 40.0, 100.0, 400.0)]
    rows = witness_table(layer, sizes, tokens, coord=None)
    case = rows[0]["case"]
    assert case in (CASE_POSITIVE, CASE_NEGATIVE)
    assert_witnesses_theorem(rows, NORM_GAP_SLOPE[case])
    # Theorem 1's conclusion on this model: with the sum head g, one of A, B is mispredicted by more than
    # max(1, t/20), the tolerance that the theorem rules out.
    w = theorem1_witness(layer, sizes[-1], tokens, coord=None)
    with torch.no_grad():
        preds = layer(torch.stack([w.A, w.B])).sum(dim=(1, 2))
    errors = [abs(float(p) - float(x.norm())) - max(1.0, float(x.norm()) / 20) for p, x in zip(preds, (w.A, w.B))]
    assert max(errors) > 0.1 * rows[-1]["norm_gap"]


def two_expert_counterexample() -> SoftMoE:
    """n = 2, d = 1, phi = (+1, -1), both experts the identity (a custom linear expert with weight 1)."""
    layer = SoftMoE(1, 2, normalize=False, expert=nn.Linear(1, 1, bias=False))
    with torch.no_grad():
        layer.phi.copy_(torch.tensor([1.0, -1.0]).view(1, 2, 1))
        layer.experts.weight.fill_(1.0)
    return layer


@pytest.mark.parametrize("a", [10.0, 100.0, 1000.0])
def test_two_experts_escape_the_construction(a):
    """The phi_1 > 0 witness pair of the proof, fed to an n = 2 layer: the second expert's slot sees the token that
    only A has (-a e_1 in A, the zero tokens in B), so the outputs differ by about 1.5 a instead of converging."""
    layer = two_expert_counterexample()
    A = torch.tensor([[a], [-a]])
    B = torch.tensor([[a], [0.0]])
    with torch.no_grad():
        out = layer(torch.stack([A, B]))
    assert float(A.norm() - B.norm()) == pytest.approx((math.sqrt(2) - 1) * a)
    assert torch.allclose(out[0], torch.tensor([[a], [-a]]), rtol=1e-4)  # A is reproduced
    assert torch.allclose(out[1], torch.tensor([[a], [a / 2]]), rtol=1e-4)
    gap = float((out[0] - out[1]).norm())
    assert gap > 1.4 * a
    # and the sum over outputs is no longer blind to the norm: it changes by ~1.5a between A and B
    assert abs(float(out[0].sum() - out[1].sum())) > 1.4 * a


def test_two_experts_random_layer_outputs_do_not_converge():
    torch.manual_seed(0)
    layer = SoftMoE(2, 2, normalize=False, expert_hidden=8, activation="relu")
    with torch.no_grad():
        layer.phi.copy_(torch.tensor([[1.0, -1.0], [0.3, 0.2]]).view(2, 2, 1))
    gaps = []
    for a in (10.0, 100.0, 1000.0):
        A = torch.zeros(3, 2)
        A[0, 0], A[1, 0] = a, -a
        B = torch.zeros(3, 2)
        B[0, 0] = a
        with torch.no_grad():
            out = layer(torch.stack([A, B]))
        gaps.append(float((out[0] - out[1]).norm()))
    assert gaps[0] < gaps[1] < gaps[2]
    assert gaps[-1] > 10.0  # grows with a, unlike the single-expert case


@pytest.mark.parametrize("kind", ["mlp", "custom"])
@pytest.mark.parametrize("normalize", [False, True])
def test_single_expert_collapse(kind, normalize):
    layer = make_layer(5, 3, kind, normalize=normalize)
    x = torch.randn(6, 7, 3) * 4
    result = single_expert_collapse(layer, x)
    assert result.output.shape == (6, 7, 3) and result.expert_output.shape == (6, 3)
    assert result.max_token_spread == 0.0
    assert torch.equal(result.output, result.output[:, :1].expand_as(result.output))
    assert result.max_expert_gap < 1e-5
    # the expert output really depends on the input (so the collapse is not a trivial zero)
    assert float(result.expert_output.std(dim=0).max()) > 1e-3


def test_collapse_is_specific_to_one_slot():
    """Sanity check of the collapse test itself: with two slots the output tokens do differ."""
    torch.manual_seed(0)
    layer = SoftMoE(3, 2, normalize=False)
    with torch.no_grad():
        out = layer(torch.randn(4, 5, 3) * 3)
    assert float((out - out[:, :1]).abs().max()) > 1e-3


@pytest.mark.parametrize("n,p", [(2, 1), (1, 2), (4, 3)])
def test_bad_layers_raise(n, p):
    layer = SoftMoE(2, n, slots_per_expert=p, normalize=False)
    with pytest.raises(ValueError):
        theorem1_witness(layer, 1.0, 3)
    with pytest.raises(ValueError):
        witness_table(layer, [1.0], 3)
    with pytest.raises(ValueError):
        single_expert_collapse(layer, torch.randn(1, 3, 2))


def test_bad_arguments_raise():
    layer = make_layer(0, 2, "mlp")
    for kwargs in ({"a": 0.0}, {"a": -1.0}, {"a": float("inf")}, {"num_tokens": 1}, {"coord": 2},
                   {"token": 1, "partner": 1}, {"token": 3}):
        args = {"a": 1.0, "num_tokens": 3, **kwargs}
        with pytest.raises(ValueError):
            theorem1_witness(layer, **args)
