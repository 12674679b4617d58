"""Pieces every experiment shares: dataset default, the selection sweep, report formatting."""

import torch

import softmoe_repro.common as common
from softmoe.data import ImageDataset
from softmoe.models import SoftMoEClassifier


def test_default_dataset_falls_back(monkeypatch, tmp_path):
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

    def accuracy(m, d):
        calls.append([layer.selector for layer in [m.moe]][0])
        return float((m(d.images).argmax(1) == d.labels).float().mean())

    result = common.selection_sweep(model, test, [1, 2], random_seeds=3, accuracy=accuracy)
    assert len(calls) == 1 + 2 * (1 + 3)  # all experts, then per k: Algorithm 1 and 3 seeds
    assert calls[0] is None and calls[1].strategy == "combine" and calls[1].k == 1 and calls[2].strategy == "random"
    for k in ("1", "2"):
        cell = result["per_k"][k]
        assert cell["fraction"] == int(k) / 4 and len(cell["random"]["accuracies"]) == 3
    assert model.moe.selector is None  # restored


def test_formatting():
    assert common.pct(0.12345) == "12.35" and common.pct(None) == "–"
    assert common.num(3.14159) == "3.14" and common.num(None) == "–"
    assert common.mean_std_pct({"mean": 0.5, "std": 0.0125}) == "50.00 ± 1.25"
