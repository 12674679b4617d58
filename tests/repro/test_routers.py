"""The router head-to-head experiment (softmoe_repro.routers): model, compute budget, run / plots / markdown."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from softmoe.routing import ROUTERS
from softmoe.train import TrainConfig
from softmoe_repro import routers as exp

SMALL = exp.ModelConfig(grid=(4, 4), dim=8, heads=2, blocks=2, num_experts=4, expert_hidden=8, group_images=4)


@pytest.mark.parametrize("c", [1, 2])
def test_same_model_and_compute_budget_for_every_router(c):
    models = {r: exp.RouterClassifier((1, 8, 8), 10, r, c, SMALL) for r in ROUTERS}
    tokens = 16
    for name, model in models.items():
        assert model(torch.rand(5, 1, 8, 8)).shape == (5, 10)
        router = model.moe.router
        if name == "soft_moe":
            rows_per_image = router.slots_per_expert * SMALL.num_experts
        else:
            rows_per_image = router.capacity(SMALL.group_images * tokens) * SMALL.num_experts / SMALL.group_images
        assert rows_per_image == c * tokens, name  # the same expert compute per image
        # Everything but the router is the same model.
        others = sum(p.numel() for n, p in model.named_parameters() if ".router." not in n)
        assert others == sum(p.numel() for n, p in models["softmax_expert_choice"].named_parameters() if ".router." not in n)
    dense = exp.RouterClassifier((1, 8, 8), 10, None, 1, SMALL)
    assert dense.moe is None and dense(torch.rand(2, 1, 8, 8)).shape == (2, 10)


def test_auxiliary_loss_is_exposed_for_training_only():
    torch.manual_seed(0)
    images = torch.rand(8, 1, 8, 8)
    model = exp.RouterClassifier((1, 8, 8), 10, "softmax_token_choice", 1, SMALL).train()
    model(images)
    assert model.auxiliary_loss is not None and float(model.auxiliary_loss.detach()) > 0
    model.auxiliary_loss.backward()
    assert float(model.moe.router.gate.weight.grad.abs().sum()) > 0  # the balancing losses reach the gate
    with torch.no_grad():
        model.eval()(images)
    assert model.auxiliary_loss is None
    assert exp.RouterClassifier((1, 8, 8), 10, "soft_moe", 1, SMALL).train()(images) is not None

def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        exp.run("huge")


@pytest.mark.slow
def test_micro_run_plots_and_markdown(tmp_path):
    preset = replace(
        exp.PRESETS["smoke"],
        name="micro",
        train=TrainConfig(epochs=1, batch_size=32),
        model=SMALL,
        routers=("softmax_token_choice", "soft_moe"),
        capacity_factors=(1,),
        dense_baseline=True,
        repeat=("soft_moe", 1),
        repeat_seeds=(3,),
        limit_train=64,
        limit_eval=32,
        stats_examples=32,
    )
    results = exp.run(preset, out_dir=tmp_path, progress=False)
    assert json.loads((tmp_path / "routers.json").read_text()) == json.loads(json.dumps(results))
    assert list(results["runs"]) == ["softmax_token_choice_c1", "soft_moe_c1", "dense"]
    assert list(results["repeats"]) == ["soft_moe_c1_seed3"]
    spread = results["seed_spread"]
    assert spread["seeds"] == [0, 3] and len(spread["test_accuracies"]) == 2
    tc = results["runs"]["softmax_token_choice_c1"]
    assert tc["capacity_per_group"] == 16 and 0 <= tc["test_dropped_fraction"] <= 1
    assert results["runs"]["soft_moe_c1"]["slots_per_expert"] == 4
    assert results["runs"]["soft_moe_c1"]["test_dropped_fraction"] is None
    plots = exp.write_plots(results, tmp_path)
    assert all(Path(p).is_file() for p in plots.values())
    text = exp.markdown(results, plots)
    assert "| Softmax Token Choice (k = 1) | 16 |" in text and "| Soft MoE (c = 1) | 4 per image |" in text
    assert "41.23" in text and "Run-to-run spread" in text and "fig_routers_accuracy_vs_time.png" in text
    # A second run resumes every finished model instead of training it again.
    again = exp.run(preset, out_dir=tmp_path, progress=False)
    assert again["runs"]["soft_moe_c1"]["history"] == results["runs"]["soft_moe_c1"]["history"]


def fake_results(acc: dict[tuple[str, int], float], std: float | None) -> dict:
    runs = {
        exp.run_key(r, c): {"router": r, "capacity_factor": c, "final_test_accuracy": a, "step_cpu_ms": 10.0, "label": r}
        for (r, c), a in acc.items()
    }
    spread = None if std is None else {"label": "x", "seeds": [0, 1], "test_accuracies": [0.5, 0.5], "std": std}
    return {"runs": runs, "seed_spread": spread}


def test_findings_verdicts():
    acc = {
        ("softmax_token_choice", 1): 0.80,
        ("sinkhorn_token_choice", 1): 0.81,
        ("softmax_expert_choice", 1): 0.83,
        ("soft_moe", 1): 0.829,
    }
    lines = exp.findings(fake_results(acc, std=0.001))  # noise band 2 * sqrt(2) * 0.1 = 0.28 points
    assert any("Expert Choice beats Token Choice in 2 of 2 pairs" in l and "reproduces" in l for l in lines)
    assert any("Soft MoE 82.90% beats 2 of 3" in l and "within the seed noise" in l for l in lines)
    assert any("Sinkhorn Token Choice vs Softmax Token Choice: +1.00 points: reproduces" in l for l in lines)
    lines = exp.findings(fake_results(acc, std=None))
    assert any("Soft MoE" in l and "the opposite of the paper" in l for l in lines)
