"""The MNIST suite's rules: model sizes per n, the equal-accuracy protocol, k lists, statistics."""

from dataclasses import replace

import pytest
import torch

from softmoe.selection import random_statistics
from softmoe_repro.common import equal_accuracy_epochs
from softmoe_repro.mnist_suite import (
    PRESETS,
    chosen_epochs,
    run_suite,
    selection_ks,
    suite_file,
    training_config,
)
from softmoe.models import SoftMoEClassifier
from softmoe.models.mnist import expert_hidden_for


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64, 128, 256, 512])
def test_parameter_counts_of_the_definition1_model(n):
    model = SoftMoEClassifier((1, 28, 28), n, model="definition1")
    hidden = expert_hidden_for(196, n, "round")
    assert model.moe.experts.hidden == hidden == max(1, round(784 / n))
    experts = n * (196 * hidden + hidden + hidden * 196 + 196)
    assert model.expert_parameter_count() == experts
    assert sum(p.numel() for p in model.parameters()) == experts + 196 * n + (4 * 196 * 10 + 10)
    # Expert weight matrices hold 2 * 196 * 784 = 307,328 numbers whenever n divides 784 (the paper's 307K).
    if 784 % n == 0:
        assert 2 * 196 * n * hidden == 307_328


def test_paper_model_shapes():
    model = SoftMoEClassifier((1, 28, 28), 8)
    assert model.tokens == 4 and model.dim == 196
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)
    digits = SoftMoEClassifier((1, 8, 8), 4, grid=(2, 2))
    assert digits.dim == 16
    with pytest.raises(ValueError, match="3x3 patch grid must divide the image size 28x28"):
        SoftMoEClassifier((1, 28, 28), 4, grid=(3, 3))


def history(*accuracies):
    return [{"epoch": e + 1, "val_accuracy": a} for e, a in enumerate(accuracies)]


def test_equal_accuracy_rule():
    histories = {
        2: history(0.90, 0.95, 0.97),
        4: history(0.91, 0.93, 0.94, 0.96),  # best 0.96: the common target
        8: history(0.96, 0.98, 0.955),
    }
    target, chosen = equal_accuracy_epochs(histories)
    assert target == 0.96
    assert chosen == {2: 2, 4: 4, 8: 1}  # n=2: |0.95-0.96| = |0.97-0.96| -> the earlier epoch


def test_equal_accuracy_needs_epochs():
    with pytest.raises(ValueError, match="at least one finished epoch"):
        equal_accuracy_epochs({2: []})


def test_selection_ks():
    assert selection_ks(2) == [1]
    assert selection_ks(8) == [1, 2, 3, 4, 5, 6, 7]
    assert selection_ks(16) == list(range(1, 16))
    assert selection_ks(32) == [16, 8, 4]
    assert selection_ks(512) == [256, 128, 64]


def test_random_statistics():
    stats = random_statistics([0.5, 0.7], algorithm1=0.9)
    assert stats["mean"] == pytest.approx(0.6)
    assert stats["std"] == pytest.approx(0.1 * 2**0.5)  # sample std (ddof = 1), as the authors' np.std(ddof=1)
    assert stats["stds_above_random"] == pytest.approx(0.3 / (0.1 * 2**0.5))
    assert random_statistics([0.5])["std"] == 0.0
    assert random_statistics([0.5, 0.5], 0.9)["stds_above_random"] is None
    assert random_statistics([0.5, 0.7])["stds_above_random"] is None


def test_protocols_choose_epochs():
    histories = {2: history(0.90, 0.95, 0.97), 4: history(0.91, 0.96, 0.94)}
    assert chosen_epochs(histories, "authors") == (None, {2: 3, 4: 3})
    assert chosen_epochs(histories, "equal-accuracy") == (0.96, {2: 2, 4: 2})
    config = training_config(PRESETS["default"])
    assert (config.shuffle, config.frozen_first_epoch, config.epochs) == (False, True, 15)
    assert training_config(replace(PRESETS["default"], protocol="equal-accuracy")).shuffle


def test_variants_write_their_own_files():
    assert suite_file("authors", "authors") == "mnist_suite.json"
    assert suite_file("definition1", "equal-accuracy") == "mnist_suite_definition1_equal-accuracy.json"


def test_unknown_model_or_protocol_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown MNIST model 'big'"):
        run_suite("smoke", tmp_path, model="big", progress=False)
    with pytest.raises(ValueError, match="unknown protocol 'fast'; choose one of"):
        run_suite("smoke", tmp_path, protocol="fast", progress=False)
