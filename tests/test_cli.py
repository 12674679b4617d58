"""The softmoe command: the smoke reproduction end to end, train/evaluate, and user errors as one line + exit 2."""

import json

import pytest

from reference import run_cli
from softmoe.cli import main


@pytest.fixture(scope="module")
def smoke_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    assert main(["reproduce", "--preset", "smoke", "--out", str(out), "--no-progress"]) == 0
    return out


@pytest.mark.slow
def test_smoke_reproduction_writes_complete_results(smoke_results):
    results = json.loads((smoke_results / "results.json").read_text())
    assert set(results) >= {"provenance", "mnist_suite", "l2norm"}
    assert results["provenance"]["code_version"].startswith("0.1.0")
    suite = results["mnist_suite"]
    assert suite["preset"]["name"] == "smoke" and suite["data"]["name"] == "digits"
    assert suite["preset"]["train"]["seed"] == 0
    assert (suite["model"]["name"], suite["protocol"]["name"]) == ("authors", "authors")
    assert suite["preset"]["train"]["shuffle"] is False and suite["preset"]["train"]["frozen_first_epoch"] is True
    assert sorted(int(n) for n in suite["models"]) == [2, 4, 8]
    assert suite["seeds"] == [0, 1] and suite["masked_forward"] == "renormalized"
    # the authors' protocol trains on the validation split too
    assert suite["data"]["val_in_train"] and suite["data"]["train"] == 600 + suite["data"]["val"]
    for n, model in suite["models"].items():
        selection = model["selection"]
        assert selection == model["masked_forwards"]["renormalized"]["selection"]
        assert 0.0 <= selection["all_experts"] <= 1.0
        assert sorted(int(k) for k in selection["per_k"]) == list(range(1, int(n)))
        for cell in selection["per_k"].values():
            assert len(cell["random"]["accuracies"]) == 2 * 3  # pooled over training seeds x random seeds
            assert 0.0 <= cell["algorithm1"] <= 1.0
            paired = cell["paired"]
            assert paired["examples"] == suite["data"]["test"] and 0 < paired["p_value"] <= 1
            assert paired["ci99"][0] <= paired["difference"] <= paired["ci99"][1]
        assert model["epoch"] == 3  # the authors' protocol evaluates the last epoch
        assert [record["seed"] for record in model["seeds"]] == [0, 1]
        assert model["test_accuracy"] == pytest.approx(sum(r["test_accuracy"] for r in model["seeds"]) / 2)
        assert model["oracle"]["k"] == max(1, round(int(n) / 4))
        assert 0.0 <= model["oracle"]["best_subset_accuracy"] <= 1.0
        assert 0.0 <= model["oracle"]["wrong_label_reach"] <= 1.0
        assert 1.0 <= model["oracle"]["mean_reachable_classes"] <= 10.0
        assert 0.0 <= model["diagnostics"]["share_entropy"] <= 1.0 and model["diagnostics"]["scale"] > 0
        # Per model and masked forward, the oracle includes Algorithm 1's subset, so it can never do worse.
        k = str(model["oracle"]["k"])
        for record in model["seeds"]:
            for masked in ("renormalized", "plain"):
                oracle, sweep = record[masked]["oracle"], record[masked]["selection"]
                if k in sweep["per_k"]:
                    assert oracle["best_subset_accuracy"] >= sweep["per_k"][k]["algorithm1"] - 1e-9
    # Beyond the paper, for n = 4 and 8: accuracy against expert compute, calibrated settings, specialization.
    for n in ("4", "8"):
        study = suite["models"][n]["budgets"]
        points = study["points"]
        assert [p["value"] for p in points["algorithm1"]] == list(range(1, int(n)))
        assert [p["expert_fraction"] for p in points["algorithm1"]] == [k / int(n) for k in range(1, int(n))]
        assert points["mass"][-1]["value"] == 1.0 and points["mass"][-1]["expert_fraction"] == 1.0
        assert points["mass"][-1]["test_accuracy"] == points["all"]["test_accuracy"]
        assert all(p["us_per_example"] > 0 for p in points["algorithm1"] + points["mass"])
        for calibrated in study["calibrated"].values():
            assert calibrated["chosen"]["accuracy"] >= calibrated["required_accuracy"]
        shares = suite["models"][n]["specialization"]["class_expert_shares"]
        assert len(shares) == 10 and all(len(row) == int(n) for row in shares)
        assert all(abs(sum(row) - 1) < 1e-5 for row in shares)  # every digit class occurs in the test split
    assert "budgets" not in suite["models"]["2"] and "specialization" not in suite["models"]["2"]


@pytest.mark.slow  # (the smoke reproduction of smoke_results)
def test_smoke_report_is_well_formed(smoke_results):
    report = (smoke_results / "report.md").read_text()
    for heading in ("Table 1", "Figures 1 and 2a", "Table 10", "Figure 5", "How our numbers compare",
                    "Beyond Algorithm 1", "Specialization made visible", "The paired test", "(y+1) mod 10",
                    "Why Algorithm 1 wins or loses", "The other masked forward: plain"):
        assert heading in report
    assert "94.69" in report and "46.57 ± 0.44" in report  # the paper's numbers beside ours
    assert "model `authors` and the protocol `authors`" in report and "sample standard deviation over them (ddof = 1)" in report
    assert "| n = 8 | adaptive mass | tau = " in report
    for png in ("fig_selection_vs_n.png", "fig_distinct_best_subsets.png", "fig_training_curves.png", "fig_budgets.png",
                "fig_class_experts.png", "fig_expert_top_images.png"):
        assert f"({png})" in report
        data = (smoke_results / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.slow
def test_calibrating_a_suite_model_says_it_trained_on_the_validation_split(smoke_results, capsys):
    run = smoke_results / "runs" / "authors_authors" / "n004"
    assert json.loads((run / "run.json").read_text())["model"]["train_split"] == "train+val"
    assert main(["calibrate", str(run), "--max-drop", "100"]) == 0
    err = capsys.readouterr().err
    assert "note: this model was trained on the validation split too" in err and "Traceback" not in err


@pytest.mark.slow  # (the smoke reproduction of smoke_results)
def test_a_suite_file_of_an_older_format_is_one_line_saying_what_to_do(smoke_results, tmp_path, capsys):
    suite = json.loads((smoke_results / "mnist_suite.json").read_text())
    del suite["seeds"]
    (tmp_path / "mnist_suite.json").write_text(json.dumps(suite))
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "written by an older softmoe" in err and "softmoe reproduce mnist" in err


@pytest.mark.slow
def test_rerun_resumes_without_training(smoke_results, capsys):
    def files():  # every file but the lock, which holds the pid of the last writer
        folder = smoke_results / "runs" / "authors_authors" / "n002"
        return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.name != ".lock"}

    before = files()
    assert main(["reproduce", "mnist", "--preset", "smoke", "--out", str(smoke_results), "--no-progress"]) == 0
    assert files() == before


def test_train_and_evaluate(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", str(run), "--dataset", "digits", "--experts", "4", "--epochs", "2", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["epoch"] == 2
    assert main(["evaluate", str(run), "--k", "2", "--strategy", "random", "--seeds", "3"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["random"]["accuracies"]) == 3
    assert main(["evaluate", str(run), "--k", "0.5"]) == 0
    assert 0.0 <= json.loads(capsys.readouterr().out)["accuracy"] <= 1.0
    assert main(["evaluate", str(run), "--k", "5"]) == 2
    assert "k must lie in [1, 4]" in capsys.readouterr().err
    assert main(["evaluate", str(run), "--epoch", "9"]) == 2
    assert "epoch 9 is not available" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["reproduce", "--dataset", "nosuch"], "nosuch"),
        (["reproduce", "mnist", "--dataset", "mnist:/nonexistent/dir", "--out", "{tmp}"], "/nonexistent/dir"),
        (["evaluate", "{tmp}/missing"], "run.json: no run.json: not a run folder"),
        (["report", "{tmp}/missing"], "does not exist"),
        (["report", "{tmp}"], "no experiment results"),
    ],
)
def test_user_errors_are_one_line(tmp_path, capsys, argv, message):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


@pytest.mark.slow
def test_argument_errors_exit_2():
    for argv in (["reproduce", "--preset", "huge"], ["train", "x", "--experts", "0"], ["evaluate", "x", "--k", "a"], []):
        proc = run_cli(*argv)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and "usage:" in proc.stderr


@pytest.mark.slow
def test_help_explains_options():
    proc = run_cli("reproduce", "--help")
    assert proc.returncode == 0
    for option in ("--preset", "--dataset", "--out", "resumes"):
        assert option in proc.stdout


@pytest.mark.slow
def test_routers_and_vit_sections_join_the_report(tmp_path):
    for experiment in ("routers", "vit"):
        assert main(["reproduce", experiment, "--preset", "smoke", "--out", str(tmp_path), "--no-progress"]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"provenance", "routers", "vit"}
    report = (tmp_path / "report.md").read_text()
    assert "Soft MoE" in report and report.count("![") >= 3
    for line in report.splitlines():
        if line.startswith("!["):
            assert (tmp_path / line.split("(")[1].rstrip(")")).exists()


@pytest.mark.slow
def test_other_model_and_protocol_run_beside_the_default(smoke_results):
    """--model/--protocol train in their own runs folder and JSON file; the report compares the pairs."""
    args = ["reproduce", "mnist", "--preset", "smoke", "--model", "definition1", "--protocol", "equal-accuracy"]
    assert main([*args, "--out", str(smoke_results), "--no-progress"]) == 0
    variant = json.loads((smoke_results / "mnist_suite_definition1_equal-accuracy.json").read_text())
    assert variant["model"]["name"] == "definition1" and variant["model"]["normalize"] == "none"
    assert variant["preset"]["train"]["shuffle"] is True
    assert all(target is not None for target in variant["equal_accuracy_target"].values())
    assert (smoke_results / "runs" / "definition1_equal-accuracy" / "n002" / "epoch_001.json").exists()
    report = (smoke_results / "report.md").read_text()
    assert "## The MNIST suite under each model and protocol" in report
    assert "| `authors` | `authors` |" in report and "| `definition1` | `equal-accuracy` |" in report
    suite = json.loads((smoke_results / "results.json").read_text())["mnist_suite"]
    assert suite["model"]["name"] == "authors"  # the default pair's file is untouched
