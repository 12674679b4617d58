"""The L2-norm experiment (Appendix C, Figure 4): model, data, the smoke run, JSON, plots, report section."""

from __future__ import annotations

import copy
import json
import math
import os
import statistics
from pathlib import Path

import pytest
import torch

from softmoe.theory import NORM_GAP_SLOPE
from softmoe_repro import l2norm

TINY = l2norm.L2NormPreset(
    "tiny", steps=4, batch_size=200, experts=(1, 2), tokenizations=((5, 2),), seeds=(0,), eval_size=300,
    curve_points=3, witness_sizes=(1.0, 1000.0),
)


@pytest.mark.parametrize("tokens,dim", l2norm.PAPER_TOKENIZATIONS)
@pytest.mark.parametrize("n", l2norm.PAPER_EXPERTS)
def test_expert_parameter_count_is_20_d_squared(tokens, dim, n):
    model = l2norm.build_model(dim, n, seed=0)
    experts = model.moe.experts
    assert l2norm.expert_parameter_count(model) == 20 * dim * dim
    assert experts.weight1.shape == (n, dim, 10 * dim // n)
    assert experts.weight2.shape == (n, 10 * dim // n, dim)
    assert experts.bias1 is None and experts.bias2 is None
    assert experts.activation == "relu"
    assert model.moe.normalize == "none" and model.moe.slots_per_expert == 1 and model.moe.num_experts == n
    # the only other parameter is the router; the sum head has none
    others = {name for name, _ in model.named_parameters() if not name.startswith("moe.experts.")}
    assert others == {"moe.phi"}


def test_sum_head_is_fixed_sum_over_all_outputs():
    model = l2norm.build_model(2, 5, seed=1)
    x = torch.randn(7, 5, 2)
    with torch.no_grad():
        assert torch.allclose(model(x), model.moe(x).sum(dim=(1, 2)))


def test_tokenization_is_in_coordinate_order():
    x = torch.arange(20.0).view(2, 10)
    five = l2norm.tokenize(x, 5, 2)
    assert five[0].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert five[1, 4].tolist() == [18, 19]
    two = l2norm.tokenize(x, 2, 5)
    assert two[0].tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    with pytest.raises(ValueError):
        l2norm.tokenize(x, 3, 3)


def test_data_variance_five_and_norm_labels():
    x, y = l2norm.sample(200_000, torch.Generator().manual_seed(0))
    assert x.shape == (200_000, 10) and y.shape == (200_000,)
    assert x.var(dim=0).sub(5.0).abs().max() < 0.1  # variance 5, not std 5
    assert torch.allclose(y, x.norm(dim=1))
    assert float(y.var()) == pytest.approx(l2norm.constant_predictor_mse(), rel=0.02)


def test_ordering_and_summary():
    assert l2norm.ordering({1: 3.0, 2: 2.0, 5: 1.0, 10: 0.5}) == {
        "experts": [1, 2, 5, 10], "means": [3.0, 2.0, 1.0, 0.5], "n1_worst": True, "monotone": True
    }
    o = l2norm.ordering({1: 3.0, 2: 1.0, 5: 2.0, 10: 0.5})
    assert o["n1_worst"] and not o["monotone"]
    o = l2norm.ordering({1: 1.0, 2: 2.0, 5: 0.5, 10: 0.4})
    assert not o["n1_worst"] and not o["monotone"]
    s = l2norm.summarize([1.0, 2.0, 3.0])
    assert s == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0}
    assert l2norm.summarize([4.0])["std"] == 0.0


def test_presets():
    assert l2norm.PRESETS["paper"].steps == 500 and l2norm.PRESETS["paper"].batch_size == 10_000
    default = l2norm.PRESETS["default"]
    assert default.steps * default.batch_size < 500 * 10_000 and len(default.seeds) == 3
    for preset in l2norm.PRESETS.values():
        assert preset.lr == 1e-3
        assert preset.experts == (1, 2, 5, 10) and preset.tokenizations == ((5, 2), (2, 5))
    with pytest.raises(ValueError):
        l2norm.run("nope", progress=False)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("l2norm")
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        replaced.append((str(src), str(dst)))
        return real_replace(src, dst)

    os.replace = spy
    try:
        results = l2norm.run("smoke", out_dir=out, progress=False)
    finally:
        os.replace = real_replace
    return results, out, replaced


@pytest.mark.slow
def test_smoke_run_is_well_formed(smoke):
    results, _, _ = smoke
    preset = l2norm.PRESETS["smoke"]
    assert json.loads(json.dumps(results)) == results  # JSON-serializable, nothing lost
    assert results["experiment"] == "l2norm"
    assert results["config"]["steps"] == preset.steps and results["config"]["seeds"] == list(preset.seeds)
    assert set(results["tokenizations"]) == {"5x2", "2x5"}
    for key, entry in results["tokenizations"].items():
        assert entry["curve_steps"][0] == 1 and entry["curve_steps"][-1] == preset.steps
        assert set(entry["experts"]) == {"1", "2", "5", "10"}
        for n, cell in entry["experts"].items():
            assert cell["expert_params"] == 20 * entry["dim"] ** 2
            assert cell["hidden"] == 10 * entry["dim"] // int(n)
            finals = []
            for seed in preset.seeds:
                run = cell["seeds"][str(seed)]
                assert len(run["curve"]) == len(entry["curve_steps"])
                assert all(math.isfinite(v) and v > 0 for v in run["curve"])
                finals.append(run["final_loss"])
            assert cell["final"]["mean"] == pytest.approx(sum(finals) / len(finals))
            assert cell["final"]["min"] == min(finals) and cell["final"]["max"] == max(finals)
            assert cell["final"]["std"] == pytest.approx(statistics.stdev(finals))
        assert set(entry["ordering"]) == {"experts", "means", "n1_worst", "monotone", "n1_worst_seeds",
                                          "monotone_seeds"}
        for seed in entry["ordering"]["monotone_seeds"]:
            finals = [entry["experts"][n]["seeds"][str(seed)]["final_loss"] for n in ("1", "2", "5", "10")]
            assert finals == sorted(finals, reverse=True)
    assert set(results["ordering"]) == {"n1_worst", "monotone"}
    assert results["timing"]["seconds"] > 0


def test_smoke_witness_on_trained_single_expert(smoke):
    results, _, _ = smoke
    assert set(results["witness"]) == {"5x2", "2x5"}
    for record in results["witness"].values():
        rows = record["rows"]
        assert [r["a"] for r in rows] == list(l2norm.PRESETS["smoke"].witness_sizes)
        for r in rows:
            assert r["norm_gap"] == pytest.approx(NORM_GAP_SLOPE[record["case"]] * r["a"])
        assert rows[-1]["output_gap"] < 1e-6 < rows[-1]["norm_gap"]


def test_smoke_json_written_atomically(smoke):
    results, out, replaced = smoke
    target = out / l2norm.RESULTS_FILE
    assert json.loads(target.read_text()) == results
    writes = [(src, dst) for src, dst in replaced if Path(dst) == target]
    assert len(writes) == 1
    src = Path(writes[0][0])
    assert src.parent == out and src != target and not src.exists()  # a temporary in the same folder, renamed
    assert sorted(p.name for p in out.iterdir()) == [l2norm.RESULTS_FILE]  # no stray temporaries


@pytest.mark.slow
def test_plots_and_markdown(smoke, tmp_path):
    results, _, _ = smoke
    paths = l2norm.write_plots(results, tmp_path / "report")
    assert paths and all(Path(p).stat().st_size > 1000 for p in paths)
    assert all(Path(p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
    text = l2norm.markdown(results, paths)
    assert "| n | 5 tokens × dim 2 (hidden) | 2 tokens × dim 5 (hidden) |" in text
    for n in ("1", "2", "5", "10"):
        cell = results["tokenizations"]["5x2"]["experts"][n]["final"]
        assert f"| {n} | {l2norm._fmt(cell['mean'])} ± {l2norm._fmt(cell['std'])}" in text
    assert f"]({Path(paths[0]).name})" in text
    assert "Theorem 1" in text and "| a | norm gap" in text
    assert "Paper:" in text and l2norm.verdict(results) in text


def test_verdict_follows_the_ordering(smoke):
    results = copy.deepcopy(smoke[0])
    for entry in results["tokenizations"].values():
        for n, cell in entry["experts"].items():
            cell["final"]["mean"] = 2.0 / int(n)
        entry["ordering"] = l2norm.ordering({int(n): c["final"]["mean"] for n, c in entry["experts"].items()})
    results["ordering"] = {"n1_worst": True, "monotone": True}
    assert l2norm.verdict(results).startswith("Reproduced")
    results["ordering"] = {"n1_worst": True, "monotone": False}
    results["tokenizations"]["2x5"]["ordering"]["monotone"] = False
    assert l2norm.verdict(results).startswith("Partly reproduced") and "2x5" in l2norm.verdict(results)
    results["ordering"] = {"n1_worst": False, "monotone": False}
    results["tokenizations"]["5x2"]["ordering"]["n1_worst"] = False
    assert l2norm.verdict(results).startswith("Not reproduced")


def test_close_steps_flags_differences_within_the_seed_spread():
    def cell(mean, std):
        return {"final": {"mean": mean, "std": std}}

    results = {"tokenizations": {"2x5": {"experts": {
        "1": cell(2.5, 0.02), "2": cell(1.2, 0.06), "5": cell(0.98, 0.08), "10": cell(0.97, 0.1)}}}}
    assert l2norm.close_steps(results) == ["n = 5 -> 10 in 2x5"]


def test_same_seed_same_losses_and_global_rng_untouched():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = l2norm.run(TINY, progress=False)
    assert torch.equal(torch.get_rng_state(), before)
    second = l2norm.run(TINY, progress=False)
    other = l2norm.run(TINY, seeds=[1], progress=False)
    for n in ("1", "2"):
        a = first["tokenizations"]["5x2"]["experts"][n]["seeds"]["0"]
        b = second["tokenizations"]["5x2"]["experts"][n]["seeds"]["0"]
        c = other["tokenizations"]["5x2"]["experts"][n]["seeds"]["1"]
        assert a["curve"] == b["curve"] and a["final_loss"] == b["final_loss"]
        assert a["curve"] != c["curve"]
    assert other["config"]["seeds"] == [1]


def test_training_lowers_the_loss_with_more_experts():
    """A quick functional check: 25 steps of n = 10 beat the untrained model."""
    preset = l2norm.L2NormPreset("quick", steps=25, batch_size=500, lr=1e-2, experts=(10,),
                                 tokenizations=((2, 5),), seeds=(0,), eval_size=2000)
    model, losses = l2norm.train_one(2, 5, 10, 0, preset)
    assert losses[-1] < 0.5 * losses[0]
