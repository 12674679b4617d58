"""Pieces every experiment shares: dataset default, the selection sweep, report formatting."""

import math

import pytest
import torch

import softmoe_repro.common as common
from softmoe.data import ImageDataset
from softmoe.models import SoftMoEClassifier


def test_default_dataset_falls_back(monkeypatch, tmp_path):
    # A machine without Debian's dataset-fashion-mnist, then one with it (the default is a fixed system path).
    monkeypatch.setattr(common, "FASHION_MNIST_DIR", tmp_path / "missing")
    name, notice = common.default_vision_dataset()
    assert name == "mnist5k" and "falling back" in notice and "dataset-fashion-mnist" in notice
    monkeypatch.setattr(common, "FASHION_MNIST_DIR", tmp_path)
    assert common.default_vision_dataset() == ("fashion-mnist", None)


def data(n):
    return ImageDataset(torch.rand(n, 1, 8, 8), torch.arange(n) % 3, 3, "toy")


def test_selection_sweep_counts_and_statistics():
    torch.manual_seed(0)
    model = SoftMoEClassifier((1, 8, 8), 4, num_classes=3).eval()
    test = data(30)
    calls = []

    def correct(m, d):
        calls.append([layer.selector for layer in [m.moe]][0])
        return m(d.images).argmax(1) == d.labels

    for renormalize in (False, True):
        calls.clear()
        result, outcomes = common.selection_sweep(model, test, [1, 2], 3, correct, renormalize=renormalize)
        assert len(calls) == 1 + 2 * (1 + 3)  # all experts, then per k: Algorithm 1 and 3 seeds
        assert calls[0] is None and calls[1].strategy == "combine" and calls[1].k == 1
        assert calls[2].strategy == "random" and all(c.renormalize == renormalize for c in calls[1:])
        for k in (1, 2):
            cell = result["per_k"][str(k)]
            assert cell["fraction"] == k / 4 and len(cell["random"]["accuracies"]) == 3
            algorithm1, randoms = outcomes[k]
            assert algorithm1.shape == randoms.shape == (30,)
            assert float(algorithm1.mean()) == pytest.approx(cell["algorithm1"])
            assert float(randoms.mean()) == pytest.approx(cell["random"]["mean"])
        assert model.moe.selector is None  # restored
    # the default per-example outcome is the model's argmax against the labels
    assert torch.equal(common.correct_predictions(model, test, batch_size=7), correct(model, test))


def exact_sign_test(wins: int, losses: int) -> float:
    """The two-sided exact binomial sign test, what the sign-flip test estimates for differences of +-1."""
    m = wins + losses
    tail = sum(math.comb(m, i) for i in range(max(wins, losses), m + 1)) / 2**m
    return min(1.0, 2 * tail)


@pytest.mark.parametrize("wins, losses", [(30, 10), (12, 8), (60, 30)])
def test_paired_test_agrees_with_the_exact_sign_test(wins, losses):
    first = torch.tensor([1.0] * wins + [0.0] * losses + [1.0] * 50 + [0.0] * 20)
    second = torch.tensor([0.0] * wins + [1.0] * losses + [1.0] * 50 + [0.0] * 20)  # ties do not count
    test = common.paired_test(first, second, flips=20_000)
    exact = exact_sign_test(wins, losses)
    assert test["p_value"] == pytest.approx(exact, abs=4 * math.sqrt(exact * (1 - exact) / 20_000) + 1e-4)
    assert test["difference"] == pytest.approx((wins - losses) / len(first))
    low, high = test["ci99"]
    assert low < test["difference"] < high
    assert test == common.paired_test(first, second, flips=20_000)  # seeded: the same numbers every time


def test_paired_test_extremes_and_errors():
    better = common.paired_test(torch.ones(500), torch.zeros(500), flips=999)
    assert better["p_value"] == pytest.approx(1 / 1000) and better["ci99"] == [1.0, 1.0]
    assert common.holds(better) and not common.holds({**better, "difference": -1.0})
    same = common.paired_test(torch.full((50,), 0.3), torch.full((50,), 0.3))
    assert same["difference"] == 0.0 and same["p_value"] == 1.0 and not common.holds(same)
    with pytest.raises(ValueError, match=r"one shape \(N,\)"):
        common.paired_test(torch.ones(3), torch.ones(4))


def test_mean_sd():
    assert common.mean_sd([1.0, 2.0, 3.0]) == (2.0, 1.0) and common.mean_sd([4.0]) == (4.0, 0.0)


def test_formatting():
    assert common.pct(0.12345) == "12.35" and common.pct(None) == "–"
    assert common.num(3.14159) == "3.14" and common.num(None) == "–"
    assert common.mean_std_pct({"mean": 0.5, "std": 0.0125}) == "50.00 ± 1.25"
