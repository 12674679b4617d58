"""The MNIST suite's rules: model sizes per n, the equal-accuracy protocol, k lists, statistics."""

from dataclasses import replace

import pytest
import torch

from softmoe.data import ImageDataset, Splits
from softmoe.models import SoftMoEClassifier
from softmoe.models.mnist import expert_hidden_for
from softmoe.selection import random_statistics
from softmoe_repro.common import equal_accuracy_epochs
from softmoe_repro.mnist_suite import (
    MASKED_FORWARDS,
    PRESETS,
    chosen_epochs,
    masked_forward,
    run_folder,
    run_suite,
    selection_ks,
    suite_file,
    summarize_oracle,
    summarize_selection,
    training_config,
    training_splits,
)


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
    assert (config.shuffle, config.frozen_first_epoch, config.epochs, config.seed) == (False, True, 15, 0)
    assert training_config(PRESETS["default"], seed=2).seed == 2
    assert training_config(replace(PRESETS["default"], protocol="equal-accuracy")).shuffle


def test_the_default_is_the_full_mnist_with_three_seeds_and_the_authors_masked_forward():
    preset = PRESETS["default"]
    assert (preset.dataset, preset.seeds, preset.renormalize, preset.model, preset.protocol) == (
        "mnist", 3, True, "authors", "authors")
    assert masked_forward(True) == "renormalized" and masked_forward(False) == "plain"
    assert set(MASKED_FORWARDS) == {"renormalized", "plain"}


def test_the_authors_protocol_trains_on_the_validation_split_too():
    def part(start, count):
        return ImageDataset(torch.full((count, 1, 2, 2), start / 100), torch.arange(count) % 2, 2, "toy")

    splits = Splits(part(0, 5), part(50, 3), part(90, 2))
    joined = training_splits(splits, "authors")
    assert torch.equal(joined.train.images, torch.cat([splits.train.images, splits.val.images]))
    assert joined.val is splits.val and joined.test is splits.test
    assert training_splits(splits, "equal-accuracy") is splits  # epochs are chosen on the held-out split
    with pytest.raises(ValueError, match="cannot join"):
        splits.train.concat(ImageDataset(torch.zeros(1, 1, 2, 2), torch.zeros(1, dtype=torch.long), 3, "toy"))


def test_diagnostics_against_a_slow_reference():
    """Each expert's evidence from a forward pass that keeps that expert alone (the head has no bias), the shares from
    the routing, the correlation per image with numpy, the kept evidence by sorting in Python."""
    import numpy as np

    from softmoe import select_experts
    from softmoe_repro.mnist_suite import diagnostics

    torch.manual_seed(0)
    n, classes = 6, 3
    model = SoftMoEClassifier((1, 8, 8), n, num_classes=classes).eval()
    test = ImageDataset(torch.rand(20, 1, 8, 8), torch.arange(20) % classes, classes, "toy")
    images = test.images
    got = diagnostics(model, test)
    with torch.no_grad():
        alone = []
        for j in range(n):
            keep = torch.zeros(20, n, dtype=torch.bool)
            keep[:, j] = True
            with select_experts(model, strategy=keep):
                alone.append(model(images))
        logits = torch.stack(alone, dim=1)  # (images, n, classes): expert j's contribution alone
        combine = model.moe.route(model.tokenize(images)).combine.sum(dim=(1, 3))
    shares = (combine / combine.sum(dim=1, keepdim=True)).double().numpy()
    evidence = (logits[torch.arange(20), :, test.labels] - logits.mean(dim=2)).double().numpy()
    correlation = np.mean([np.corrcoef(shares[i], evidence[i])[0, 1] for i in range(20)])
    assert got["share_evidence_correlation"] == pytest.approx(correlation, abs=1e-5)
    for fraction, k in (("0.5", 3), ("0.25", 2), ("0.125", 1)):
        kept = np.mean([evidence[i][np.argsort(-shares[i], kind="stable")[:k]].sum() for i in range(20)])
        assert got["kept_evidence_ratio"][fraction] == pytest.approx(kept / (evidence.sum(axis=1).mean() * k / n), abs=1e-5)
        top = np.mean([np.sort(shares[i])[::-1][:k].sum() for i in range(20)])
        assert got["kept_mass_ratio"][fraction] == pytest.approx(top / (k / n), abs=1e-5)
    assert got["scale"] == 1.0 and 0 < got["share_entropy"] <= 1


def test_run_folders_per_seed(tmp_path):
    assert run_folder(tmp_path, 8, 0, 0) == tmp_path / "n008"
    assert run_folder(tmp_path, 8, 2, 0) == tmp_path / "n008-seed2"


def test_summaries_over_training_seeds():
    def sweep(all_experts, algorithm1, randoms, lead):
        cell = {"k": 1, "fraction": 0.5, "algorithm1": algorithm1,
                "random": {"accuracies": randoms, "std": random_statistics(randoms)["std"], "stds_above_random": lead}}
        return {"all_experts": all_experts, "per_k": {"1": cell}}

    records = [sweep(0.9, 0.8, [0.5, 0.7], 2.0), sweep(0.7, 0.6, [0.3, 0.5], 4.0)]
    ones, zeros = torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    outcomes = [{1: (ones, zeros)}, {1: (ones, torch.full((4,), 0.5, dtype=torch.float64))}]
    summary = summarize_selection(records, outcomes)
    assert summary["all_experts"] == pytest.approx(0.8) and summary["all_experts_sd"] == pytest.approx(0.1414213562)
    cell = summary["per_k"]["1"]
    assert cell["algorithm1"] == pytest.approx(0.7) and cell["algorithm1_sd"] == pytest.approx(0.1414213562)
    assert cell["random"]["accuracies"] == [0.5, 0.7, 0.3, 0.5]  # every (training seed, random seed) pair
    assert cell["random"]["mean"] == pytest.approx(0.5) and cell["random"]["std"] == pytest.approx(0.1632993162)
    assert cell["random"]["std_within_seed"] == pytest.approx(0.1414213562)
    assert cell["random"]["stds_above_random"] == pytest.approx(3.0)
    # the paired test on the images: per image 1 - mean(0, 0.5) = 0.75 better, the same on all 4 images
    assert cell["paired"]["difference"] == pytest.approx(0.75) and cell["paired"]["examples"] == 4
    oracles = [{"k": 1, "subsets": 2, "distinct_cap": 2, "best_subset_accuracy": b, "distinct_best_subsets": d,
                "wrong_label_reach": w, "mean_reachable_classes": c} for b, d, w, c in ((1.0, 2, 0.5, 2), (0.8, 1, 0.3, 1))]
    oracle = summarize_oracle(oracles)
    assert oracle["best_subset_accuracy"] == pytest.approx(0.9) and oracle["distinct_best_subsets"] == 1.5
    assert oracle["wrong_label_reach"] == pytest.approx(0.4) and oracle["mean_reachable_classes_sd"] > 0
    assert summarize_oracle([{"k": 8, "skipped": "too many"}]) == {"k": 8, "skipped": "too many"}


def test_variants_write_their_own_files():
    assert suite_file("authors", "authors") == "mnist_suite.json"
    assert suite_file("definition1", "equal-accuracy") == "mnist_suite_definition1_equal-accuracy.json"


def test_unknown_model_or_protocol_raises(tmp_path):
    with pytest.raises(ValueError, match="unknown MNIST model 'big'"):
        run_suite("smoke", tmp_path, model="big", progress=False)
    with pytest.raises(ValueError, match="unknown protocol 'fast'; choose one of"):
        run_suite("smoke", tmp_path, protocol="fast", progress=False)
    with pytest.raises(ValueError, match="need seeds >= 1"):
        run_suite("smoke", tmp_path, seeds=0, progress=False)
