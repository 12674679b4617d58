"""The best-subset oracle: hand-worked golden values, brute force, both exact paths, the cap."""

import itertools

import pytest
import torch

from softmoe.models import SoftMoEClassifier
from softmoe.oracle import (
    all_subsets,
    check_subset_count,
    oracle_by_forward,
    oracle_from_contributions,
)
from softmoe.selection import masked_reference_forward, select_experts


def test_hand_worked_example():
    # 2 inputs, 3 experts, 2 classes, k = 2; subsets in order (0,1), (0,2), (1,2).
    contributions = torch.tensor(
        [
            [[1.0, 0.0], [0.0, 2.0], [0.5, 0.0]],  # logits: (1,2) wrong, (1.5,0) right, (0.5,2) wrong
            [[0.0, 1.0], [0.0, 1.0], [3.0, 0.0]],  # label 1: (0,2) right, (3,1) wrong, (3,1) wrong
        ]
    )
    bias = torch.tensor([0.0, 0.0])
    labels = torch.tensor([0, 1])
    result = oracle_from_contributions(contributions, bias, labels, k=2)
    assert result.subsets.tolist() == [[0, 1], [0, 2], [1, 2]]
    assert result.solvable.tolist() == [True, True]
    assert result.correct_subsets.tolist() == [1, 1]
    assert result.best_subset.tolist() == [1, 0]
    assert result.accuracy == 1.0
    assert result.distinct_best_subsets == 2


def test_unsolvable_input_and_distinct_count_ignores_it():
    contributions = torch.tensor([[[0.0, 1.0], [0.0, 1.0]], [[1.0, 0.0], [2.0, 0.0]]])
    result = oracle_from_contributions(contributions, torch.zeros(2), torch.tensor([0, 0]), k=1)
    assert result.solvable.tolist() == [False, True]
    assert result.correct_subsets.tolist() == [0, 2]
    assert result.best_subset.tolist()[1] == 1  # the larger margin
    assert result.accuracy == 0.5
    assert result.distinct_best_subsets == 1


def test_all_subsets_lexicographic():
    assert all_subsets(4, 2).tolist() == [list(c) for c in itertools.combinations(range(4), 2)]


def test_cap_refuses_with_count_and_limit():
    with pytest.raises(ValueError, match=r"C\(32, 8\) = 10,518,300 subsets exceeds the cap max_subsets = 1,000,000"):
        check_subset_count(32, 8, 1_000_000)
    with pytest.raises(ValueError, match=r"C\(8, 2\) = 28"):
        oracle_from_contributions(torch.zeros(1, 8, 3), torch.zeros(3), torch.zeros(1, dtype=torch.long), 2, max_subsets=27)
    with pytest.raises(ValueError, match=r"k must lie in \[1, 4\]"):
        check_subset_count(4, 5, 100)


@pytest.fixture
def model_and_data():
    torch.manual_seed(0)
    model = SoftMoEClassifier((1, 8, 8), num_experts=6, num_classes=4).double().eval()
    images = torch.rand(12, 1, 8, 8, dtype=torch.float64)
    labels = torch.randint(0, 4, (12,))
    return model, images, labels


def test_contributions_decompose_the_logits_exactly(model_and_data):
    model, images, labels = model_and_data
    contributions, bias = model.expert_logit_contributions(images)
    assert torch.allclose(contributions.sum(1) + bias, model(images), atol=1e-12, rtol=0)
    subset = torch.tensor([[0, 2, 5]]).expand(len(images), 3)
    keep = torch.zeros(len(images), 6, dtype=torch.bool).scatter_(1, subset, True)
    with torch.no_grad(), select_experts(model, strategy=keep):
        selected_logits = model(images)
    assert torch.allclose(contributions[:, [0, 2, 5]].sum(1) + bias, selected_logits, atol=1e-12, rtol=0)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_both_paths_equal_brute_force(model_and_data, k):
    model, images, labels = model_and_data
    # Brute force with the masked dense reference: every subset, every input.
    solvable, counts, margins = [], [], []
    subsets = list(itertools.combinations(range(6), k))
    with torch.no_grad():
        for i in range(len(images)):
            x = model.tokenize(images[i : i + 1])
            row_margins = []
            correct = 0
            for s in subsets:
                out = masked_reference_forward(model.moe, x, torch.tensor([s]))
                logits = model.head(out.flatten(1))[0]
                others = logits.clone()
                others[labels[i]] = -float("inf")
                row_margins.append(float(logits[labels[i]] - others.max()))
                correct += int(logits.argmax() == labels[i])
            solvable.append(correct > 0)
            counts.append(correct)
            margins.append(row_margins)
    best = [max(range(len(subsets)), key=lambda j: (m[j], -j)) for m in margins]
    with torch.no_grad():
        fast = oracle_from_contributions(*model.expert_logit_contributions(images), labels, k)
    generic = oracle_by_forward(model, images, labels, k, rows_per_forward=40)
    for result in (fast, generic):
        assert result.solvable.tolist() == solvable
        assert result.correct_subsets.tolist() == counts
        assert result.best_subset.tolist() == best
    assert fast.distinct_best_subsets == len({b for b, ok in zip(best, solvable) if ok})


def test_oracle_by_forward_needs_one_layer():
    with pytest.raises(ValueError, match="exactly one SoftMoE layer, found 0"):
        oracle_by_forward(torch.nn.Linear(3, 2), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 1)
