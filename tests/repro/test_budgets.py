"""Accuracy against expert compute and calibrated settings (softmoe_repro.budgets): the grids, the table, the
statements computed from the results, the figure."""

from __future__ import annotations

import pytest

from softmoe_repro import budgets


def study(a1_fraction, mass_fraction):
    def calibrated(strategy, value, fraction):
        chosen = {"strategy": strategy, "value": value, "accuracy": 0.9, "expert_fraction": fraction}
        return {"chosen": chosen, "test_accuracy": 0.89, "reference_test_accuracy": 0.9, "required_accuracy": 0.89}

    point = {"value": 1, "test_accuracy": 0.8, "expert_fraction": 0.5, "us_per_example": 3.0}
    return {
        "num_experts": 8, "max_drop": 1.0, "random_seeds": 3,
        "points": {"all": {**point, "value": None, "expert_fraction": 1.0}, "algorithm1": [point],
                   "mass": [{**point, "value": 0.9}], "random": [{**point, "std": 0.01}]},
        "calibrated": {"combine": calibrated("combine", 2, a1_fraction), "mass": calibrated("mass", 0.9, mass_fraction)},
    }


def test_random_ks():
    assert budgets.random_ks(4) == [1, 2, 3]
    assert budgets.random_ks(32) == [2, 4, 8, 16, 24]
    assert budgets.random_ks(16) == [1, 2, 4, 8, 12]


def test_table_and_findings_say_where_adaptive_selection_helps():
    studies = {"n = 8": study(0.25, 0.2), "n = 32": study(0.25, 0.5), "n = 128": study(0.5, 0.5)}
    table = budgets.table(studies)
    assert table[2] == "| n = 8 | Algorithm 1 | k = 2 | 90.00 | 89.00 | 90.00 | 25.0 % |"
    assert table[3] == "| n = 8 | adaptive mass | tau = 0.9 | 90.00 | 89.00 | 90.00 | 20.0 % |"
    text = budgets.findings(studies)
    assert text[0] == ("Within 1 point of all experts on the validation split, the adaptive mass strategy runs less "
                       "expert compute than Algorithm 1 for 1 of 3 models: n = 8 (20.0 % vs 25.0 %).")
    assert text[1].startswith("It needs more for n = 32 (50.0 % vs 25.0 %)")
    assert text[2] == "Both need the same compute for n = 128 (50.0 % vs 50.0 %)."
    assert text[3] == ("Measured time, n = 8: all experts 3.0 µs per example, Algorithm 1 3.0 to 3.0 µs; Algorithm 1 "
                       "is not faster than all experts at any k.")


def test_plot_renders(tmp_path):
    pytest.importorskip("matplotlib")
    path = budgets.plot({"n = 8": study(0.25, 0.2)}, tmp_path / "b.png", "title")
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.endswith("b.png")


def test_findings_compare_as_printed_and_name_the_faster_ks():
    close = study(0.09375, 0.0937)  # 9.4 % and 9.4 % as printed: the same compute
    close["points"]["algorithm1"] = [
        {"value": 1, "test_accuracy": 0.7, "expert_fraction": 0.125, "us_per_example": 2.0},
        {"value": 2, "test_accuracy": 0.8, "expert_fraction": 0.25, "us_per_example": 4.0},
    ]
    text = budgets.findings({"n = 8": close})
    assert text[1] == "Both need the same compute for n = 8 (9.4 % vs 9.4 %)."
    assert text[2].endswith("Algorithm 1 2.0 to 4.0 µs; Algorithm 1 is faster than all experts at k = 1.")
