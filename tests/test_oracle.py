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


@pytest.mark.parametrize("renormalize", [False, True], ids=["plain", "renormalized"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_both_paths_equal_brute_force(model_and_data, k, renormalize):
    model, images, labels = model_and_data
    # Brute force with the masked dense reference: every subset, every input.
    solvable, counts, margins, reached = [], [], [], []
    subsets = list(itertools.combinations(range(6), k))
    with torch.no_grad():
        for i in range(len(images)):
            x = model.tokenize(images[i : i + 1])
            row_margins, classes = [], set()
            correct = 0
            for s in subsets:
                out = masked_reference_forward(model.moe, x, torch.tensor([s]), renormalize=renormalize)
                logits = model.head(out.flatten(1))[0]
                others = logits.clone()
                others[labels[i]] = -float("inf")
                row_margins.append(float(logits[labels[i]] - others.max()))
                correct += int(logits.argmax() == labels[i])
                classes.add(int(logits.argmax()))
            solvable.append(correct > 0)
            counts.append(correct)
            margins.append(row_margins)
            reached.append(classes)
    best = [max(range(len(subsets)), key=lambda j: (m[j], -j)) for m in margins]
    with torch.no_grad():
        contributions, bias, mass = model.expert_logit_contributions(images, per_token=True)
        if renormalize:
            fast = oracle_from_contributions(contributions, bias, labels, k, token_mass=mass)
        else:
            fast = oracle_from_contributions(*model.expert_logit_contributions(images), labels, k)
            # the per-token contributions add up to the per-input ones
            assert torch.allclose(contributions.sum(1), model.expert_logit_contributions(images)[0], atol=1e-12)
    generic = oracle_by_forward(model, images, labels, k, rows_per_forward=40, renormalize=renormalize)
    wrong = (labels + 1) % 4
    for result in (fast, generic):
        assert result.solvable.tolist() == solvable
        assert result.correct_subsets.tolist() == counts
        assert result.best_subset.tolist() == best
        assert [set(row.nonzero().flatten().tolist()) for row in result.reachable] == reached
        assert result.reaches(wrong) == pytest.approx(sum(int(w) in r for w, r in zip(wrong, reached)) / len(labels))
        assert result.mean_reachable_classes == pytest.approx(sum(map(len, reached)) / len(labels))
    assert fast.distinct_best_subsets == len({b for b, ok in zip(best, solvable) if ok})


def test_hand_worked_renormalized_oracle():
    # 1 input, 2 tokens, 3 experts, 2 classes, k = 2. Token 0 weights experts (0.5, 0.3, 0.2), token 1 (0.1, 0.1, 0.8).
    mass = torch.tensor([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])
    contributions = torch.zeros(1, 2, 3, 2)
    contributions[0, 0, :, 0] = torch.tensor([0.5, 0.3, 0.2])  # token 0 votes class 0 through every expert
    contributions[0, 1, :, 1] = torch.tensor([0.1, 0.1, 0.8])  # token 1 votes class 1
    # subset (0,1): class 0 gets 0.8/0.8 = 1, class 1 gets 0.2/0.2 = 1 -> a tie, argmax 0 (the first);
    # (0,2): 0.7/0.7 = 1 vs 0.9/0.9 = 1, a tie; (1,2): 0.5/0.5 vs 0.9/0.9: a tie too. Without renormalization:
    # (0,1): 0.8 vs 0.2 -> 0; (0,2): 0.7 vs 0.9 -> 1; (1,2): 0.5 vs 0.9 -> 1.
    labels = torch.tensor([1])
    renormalized = oracle_from_contributions(contributions, torch.zeros(2), labels, 2, token_mass=mass)
    plain = oracle_from_contributions(contributions.sum(1), torch.zeros(2), labels, 2)
    assert renormalized.correct_subsets.tolist() == [0] and renormalized.reachable.tolist() == [[True, False]]
    assert plain.correct_subsets.tolist() == [2] and plain.reachable.tolist() == [[True, True]]
    assert plain.best_subset.tolist() == [2]  # margin 0.4 for (1,2) against 0.2 for (0,2)
    with pytest.raises(ValueError, match="token_mass"):
        oracle_from_contributions(contributions, torch.zeros(2), labels, 2, token_mass=mass[:, :1])


def test_oracle_by_forward_needs_one_layer():
    with pytest.raises(ValueError, match="exactly one SoftMoE layer, found 0"):
        oracle_by_forward(torch.nn.Linear(3, 2), torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), 1)
