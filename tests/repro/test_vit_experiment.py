"""The Soft MoE ViT experiment (softmoe_repro.vit) end to end on a tiny preset: results, run folders, plots, report."""

from __future__ import annotations

import json

import pytest

from softmoe.train import TrainConfig
from softmoe_repro import vit as experiment


@pytest.mark.slow
def test_experiment_end_to_end_on_a_tiny_preset(tmp_path):
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    assert experiment.selection_ks(2) == [1] and experiment.selection_ks(32) == [16, 8, 4]
    assert experiment.selection_ks(8) == [4, 2, 1] and experiment.selection_ks(12) == [6, 3]
    preset = experiment.VitPreset(
        "tiny", "digits", experts=(2, 8), patch=4, dim=8, depth=2, heads=2, mlp_dim=8, total_expert_hidden=16,
        trainer=TrainConfig.vision(epochs=2, batch_size=64, lr=3e-3, test_each_epoch=False),
        train_limit=192, val_limit=64, test_limit=64, random_seeds=2,
    )
    results = experiment.run(preset, out_dir=tmp_path, progress=False)
    assert json.loads((tmp_path / "vit.json").read_text()) == json.loads(json.dumps(results))
    assert results["data"]["train"] == 192 and results["data"]["test"] == 64 and results["data"]["notice"] is None
    assert list(results["variants"]) == ["residual", "no_residual"]
    for name, variant in results["variants"].items():
        assert variant["moe_residual"] == (name == "residual")
        for n, ks in ((2, [1]), (8, [4, 2, 1])):
            model = variant["models"][str(n)]
            assert model["expert_hidden"] == 16 // n and model["moe_layers"] == 1
            assert sorted(int(k) for k in model["selection"]["per_k"]) == sorted(ks)
            cell = model["selection"]["per_k"][str(ks[0])]
            assert 0 <= cell["algorithm1"] <= 1 and len(cell["random"]["accuracies"]) == 2
        models = variant["models"]
        assert models["2"]["expert_parameters"] == models["8"]["expert_parameters"] - 6 * 8
    assert (tmp_path / "vit_runs" / "no_residual" / "n008" / "epoch_002.json").exists()
    for variant in results["variants"].values():
        study = variant["models"]["8"]["budgets"]  # every MoE layer: k, tau or random subsets
        assert [p["value"] for p in study["points"]["algorithm1"]] == list(range(1, 8))
        assert set(study["calibrated"]) == {"combine", "mass"}
        maps = variant["models"]["8"]["dispatch_maps"]
        assert len(maps["images"]["hex"]) == 3 and maps["images"]["shape"] == [8, 8] and maps["experts"] == [0, 2, 5, 7]
        assert all(len(m) == 2 and len(m[0]) == 2 for row in maps["maps"] for m in row)  # 8x8 images, patch 4
        assert "budgets" not in variant["models"]["2"] and "dispatch_maps" not in variant["models"]["2"]
    plots = experiment.write_plots(results, tmp_path)
    names = ("fig_vit_selection_vs_n.png", "fig_vit_training_curves.png", "fig_vit_budgets.png",
             "fig_vit_dispatch_residual.png", "fig_vit_dispatch_no_residual.png")
    assert all((tmp_path / name).exists() for name in names)
    text = experiment.markdown(results, plots)
    assert "Beyond Algorithm 1" in text and "Where the slots look" in text
    assert text.startswith("## Soft MoE ViT") and "| 8 | 1 (n/8) |" in text and "31.88" in text
    assert "### No residual" in text and "### Residual" in text
    with pytest.raises(ValueError, match="unknown preset"):
        experiment.run("huge", out_dir=tmp_path)
