"""Calibrated expert budgets: the known answer on a hand-built model, the expert-FLOP fraction, the choice rule,
errors, and the CLI."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from torch import nn

from reference import run_cli
from softmoe import SoftMoE
from softmoe.calibration import Setting, calibrate, choose, evaluate_setting
from softmoe.data import ImageDataset
from softmoe.selection import UNIFORM_HALF_MASS, NoBetterThanRandomWarning


class FourClasses(nn.Module):
    """A hand-built Soft MoE classifier with a known answer.

    An input is one token, the one-hot vector of its class c in {0, 1, 2, 3}. Slot j's logit is 10 x_j for
    experts 0 and 1 and 10 (x_2 + x_3) for experts 2 and 3, so classes 0 and 1 send (almost) all their combine
    weight to their own expert and classes 2 and 3 split theirs evenly between experts 2 and 3. Experts 0 and 1
    output 5 e_0 and 12 e_1; experts 2 and 3 output 10 x. With a head bias of 7 e_0 a class-2 or class-3 input is
    classified right only when it keeps both experts 2 and 3 (10 x > 7 e_0 but 5 x < 7 e_0), a class-0 or class-1
    input with its one expert. So Algorithm 1 needs k = 2 for every input (half the expert FLOPs), while the mass
    strategy keeps 1 expert for classes 0 and 1 and 2 for classes 2 and 3: 3/8 of the expert FLOPs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.moe = SoftMoE(4, 4, slots_per_expert=1, expert_hidden=4, normalize="none", dtype=torch.float64)
        with torch.no_grad():
            phi = torch.zeros(4, 4, 1, dtype=torch.float64)
            phi[0, 0], phi[1, 1] = 10.0, 10.0
            phi[2, 2], phi[3, 2], phi[2, 3], phi[3, 3] = 10.0, 10.0, 10.0, 10.0
            self.moe.phi.copy_(phi)
            experts = self.moe.experts
            for tensor in (experts.weight1, experts.bias1, experts.weight2, experts.bias2):
                tensor.zero_()
            experts.bias2[0, 0], experts.bias2[1, 1] = 5.0, 12.0
            for j in (2, 3):
                experts.weight1[j] = torch.eye(4)
                experts.weight2[j] = 10.0 * torch.eye(4)
        self.register_buffer("bias", torch.tensor([7.0, 0.0, 0.0, 0.0], dtype=torch.float64))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.moe(images.reshape(-1, 1, 4).double())[:, 0] + self.bias


def four_classes(per_class=3, name="four"):
    labels = torch.arange(4).repeat(per_class)
    images = torch.eye(4)[labels].reshape(-1, 1, 1, 4)
    return ImageDataset(images, labels, 4, name)


def test_calibration_finds_the_known_answer():
    model, val = FourClasses(), four_classes()
    expected = {  # (accuracy, expert fraction) by k, from the construction
        1: (0.5, 0.25), 2: (1.0, 0.5), 3: (1.0, 0.75), 4: (1.0, 1.0),
    }
    result = calibrate(model, val, 0.0, test=four_classes(2, "four-test"))
    assert result.reference == Setting("all", None, 1.0, 1.0)
    assert {s.value: (s.accuracy, s.expert_fraction) for s in result.settings} == expected
    assert result.chosen == Setting("combine", 2, 1.0, 0.5)
    assert result.test_accuracy == 1.0 and result.reference_test_accuracy == 1.0
    # 50 points of drop allowed: k = 1 is enough.
    assert calibrate(model, val, 50.0).chosen == Setting("combine", 1, 0.5, 0.25)
    # The adaptive strategy meets the same target with 3/8 of the expert FLOPs.
    adaptive = calibrate(model, val, 0.0, strategy="mass", grid=[0.4, 0.9, 1.0])
    assert adaptive.chosen.accuracy == 1.0
    assert adaptive.chosen.expert_fraction == pytest.approx(3 / 8)
    assert adaptive.chosen.value == 0.9  # 0.4 keeps one of experts 2 and 3: classes 2 and 3 fail
    assert [s.accuracy for s in adaptive.settings] == [0.5, 1.0, 1.0]


def test_expert_fraction_weights_layers_by_their_cost():
    """Two layers, the second with 3 times the expert parameters per pair: keeping k of n everywhere is k/n, and
    the fraction is the cost-weighted share of the pairs run."""
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = SoftMoE(4, 4, expert_hidden=4)
            self.b = SoftMoE(4, 4, expert_hidden=12)
            self.head = nn.Linear(4, 3)

        def forward(self, images):
            x = images.reshape(-1, 2, 4)
            return self.head(self.b(self.a(x)).mean(1))

    data = ImageDataset(torch.rand(10, 1, 2, 4), torch.randint(0, 3, (10,)), 3, "two")
    model = Two()
    assert evaluate_setting(model, data, "combine", 1).expert_fraction == pytest.approx(0.25)
    assert evaluate_setting(model, data, "combine", 3).expert_fraction == pytest.approx(0.75)
    assert evaluate_setting(model, data, "all").expert_fraction == 1.0
    mass = evaluate_setting(model, data, "mass", 0.6)
    assert 0 < mass.expert_fraction < 1


def test_choice_rule_least_compute_then_accuracy():
    settings = [
        Setting("all", None, 0.90, 1.0),
        Setting("combine", 1, 0.80, 0.25),
        Setting("combine", 2, 0.89, 0.5),
        Setting("mass", 0.8, 0.895, 0.5),
        Setting("combine", 3, 0.90, 0.75),
    ]
    assert choose(settings, 0.889).value == 0.8  # equal compute: the more accurate
    assert choose(settings, 0.80).value == 1
    assert choose(settings, 0.90).value == 3
    assert choose(settings, 0.91) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), r"give exactly one of max_drop \(points\) and target"),
        (dict(max_drop=1.0, target=0.5), r"give exactly one of"),
        (dict(max_drop=-1.0), r"max_drop must be a finite number of accuracy points >= 0, got -1.0"),
        (dict(max_drop=math.nan), r"got nan"),
        (dict(target=1.5), r"target must be an accuracy in \[0, 1\], got 1.5"),
        (dict(max_drop=1.0, strategy="random"), r"strategy must be one of \('combine', 'mass'\), got 'random'"),
        (dict(max_drop=1.0, grid=[]), r"the calibration grid is empty"),
        (dict(max_drop=1.0, strategy="mass", grid=[1.5]), r"tau, a combine-mass share in \(0, 1\], got 1.5"),
    ],
)
def test_bad_calibration_requests_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        calibrate(FourClasses(), four_classes(), **kwargs)


def test_an_impossible_target_and_empty_splits_are_clear_errors():
    model = FourClasses()
    with torch.no_grad():
        model.bias[0] = 20.0  # now every input is classified 0: 25 % with all experts
    with pytest.raises(ValueError, match=r"target accuracy 0.9000 is out of reach: even all experts reach only 0.2500"):
        calibrate(model, four_classes(), target=0.9)
    empty = four_classes().subset(slice(0, 0))
    with pytest.raises(ValueError, match="the validation split of four is empty"):
        calibrate(model, empty, 1.0)
    with pytest.raises(ValueError, match="the test split of four is empty"):
        calibrate(model, four_classes(), 1.0, test=empty)


def test_calibrate_says_when_the_shares_are_nearly_uniform():
    model, val = FourClasses(), four_classes()
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoBetterThanRandomWarning)
        peaked = calibrate(model, val, max_drop=0.0)
    assert peaked.uniformity[0].k == 2 and not peaked.uniformity[0].nearly_uniform
    assert peaked.chosen.value == 2 and peaked.random_accuracy < peaked.chosen.accuracy
    with torch.no_grad():
        model.moe.phi.zero_()  # every expert the same combine weight
    with pytest.warns(NoBetterThanRandomWarning, match="nearly uniform") as caught:
        uniform = calibrate(model, val, max_drop=100.0)
    assert len(caught) == 1 and uniform.uniformity[0].entropy == pytest.approx(1.0)
    assert uniform.to_json()["uniformity"][0]["kept_mass_ratio"] == pytest.approx(1.0)


def test_calibrate_says_when_random_subsets_do_as_well():
    """Routing that is far from uniform but sends classes 0 and 1 to each other's expert: Algorithm 1 with k = 1
    keeps the wrong expert for every input (0 %), random single experts score 5 of 36 (3 seeds x 12 inputs)."""
    model, val = FourClasses(), four_classes()
    with torch.no_grad():
        model.moe.phi[:, [0, 1]] = model.moe.phi[:, [1, 0]].clone()
    with pytest.warns(NoBetterThanRandomWarning, match="random subsets of the same size") as caught:
        result = calibrate(model, val, max_drop=100.0, grid=[1])
    assert len(caught) == 1 and "Algorithm 1 with k = 1 reaches 0.00 %" in str(caught[0].message)
    assert not result.uniformity[0].nearly_uniform
    assert (result.chosen.accuracy, result.random_accuracy) == (0.0, pytest.approx(5 / 36))
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoBetterThanRandomWarning)
        assert calibrate(model, val, max_drop=100.0, grid=[2]).random_accuracy < 0.5  # Algorithm 1: 50 %


def test_calibrate_command(tmp_path):
    run = tmp_path / "run"
    train = run_cli("train", str(run), "--dataset", "digits", "--experts", "4", "--epochs", "1", "--batch-size", "64",
                    "--no-progress")
    assert train.returncode == 0, train.stderr
    proc = run_cli("calibrate", str(run), "--max-drop", "100", "--strategy", "mass", "--grid", "0.5", "1.0")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    # the shares' uniformity is in the result, and said once on stderr exactly when nearly uniform
    (uniformity,) = result["uniformity"]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("softmoe calibrate: note: the combine")]
    assert len(notes) == (uniformity["half_mass_ratio"] < UNIFORM_HALF_MASS) and "Traceback" not in proc.stderr
    assert result["epoch"] == 1 and result["strategy"] == "mass"
    assert [s["value"] for s in result["settings"]] == [0.5, 1.0]
    assert result["chosen"]["expert_fraction"] <= 1.0 and result["test_accuracy"] is not None
    proc = run_cli("calibrate", str(run), "--target", "1.0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "out of reach" in proc.stderr
    proc = run_cli("evaluate", str(run), "--strategy", "mass", "--tau", "0.7")
    assert proc.returncode == 0, proc.stderr
    assert 0 < json.loads(proc.stdout)["expert_fraction"] <= 1
