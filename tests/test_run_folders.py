"""Run folders a user can trust, through the `softmoe` command line (``softmoe.cli.main``, in this process; the real
entry point in a subprocess where that is what is tested): no silent mixing of configurations, one line and exit 2
for every damaged file or OS error, nothing damaged by a failed command, the user's umask, portable folders, stale
temporary files cleaned, reports re-rendered without changing their data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reference import run_cli as softmoe

TRAIN = ["--dataset", "digits", "--experts", "4", "--epochs", "1", "--batch-size", "64", "--no-progress"]


def real_softmoe(*args: str) -> subprocess.CompletedProcess:
    """Run ``python -m softmoe ARGS`` as a user would."""
    return subprocess.run([sys.executable, "-m", "softmoe", *args], capture_output=True, text=True, timeout=300)


def one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    err = proc.stderr.strip()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("cli") / "run"
    proc = softmoe("train", str(run), *TRAIN)
    assert proc.returncode == 0, proc.stderr
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != ".lock"}


@pytest.mark.slow
def test_python_dash_m_softmoe_works(trained):
    proc = real_softmoe("--help")
    assert proc.returncode == 0 and "reproduce" in proc.stdout
    one_line_error(real_softmoe("train", str(trained), *TRAIN, "--lr", "0.01"), "train.lr: 0.001 -> 0.01")


@pytest.mark.slow
def test_resume_under_another_configuration_is_refused_and_changes_nothing(trained):
    before = snapshot(trained)
    proc = softmoe("train", str(trained), *TRAIN[:2], "--experts", "8", *TRAIN[4:])
    one_line_error(proc, str(trained), "model.num_experts: 4 -> 8", "use another folder")
    proc = softmoe("train", str(trained), *TRAIN, "--lr", "0.01")
    one_line_error(proc, "train.lr: 0.001 -> 0.01")
    proc = softmoe("train", str(trained), *TRAIN, "--model", "definition1")
    one_line_error(proc, "model.model: 'authors' -> 'definition1'")
    assert snapshot(trained) == before


@pytest.mark.slow
def test_another_dataset_is_another_configuration(tmp_path):
    run = tmp_path / "run"
    assert softmoe("train", str(run), *TRAIN).returncode == 0
    digits_dir = tmp_path / "idx"
    write_tiny_idx(digits_dir)
    proc = softmoe("train", str(run), "--dataset", f"mnist:{digits_dir}", *TRAIN[2:])
    one_line_error(proc, "data.")


@pytest.mark.slow
def test_smoke_presets_on_two_datasets_do_not_share_a_folder(tmp_path, monkeypatch):
    from softmoe.cli import main

    monkeypatch.chdir(tmp_path)
    for dataset in ("digits", "mnist5k"):
        args = ["reproduce", "mnist", "--preset", "smoke", "--dataset", dataset, "--experts", "2", "--seeds", "1"]
        assert main([*args, "--no-progress"]) == 0
    assert (tmp_path / "runs" / "smoke-digits" / "mnist_suite.json").exists()
    suite = json.loads((tmp_path / "runs" / "smoke-mnist5k" / "mnist_suite.json").read_text())
    assert suite["data"]["name"] == "mnist5k"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["epoch_001.safetensors", "epoch_001.json", "run.json"])
def test_damaged_files_are_named_with_exit_2(trained, tmp_path, name):
    run = tmp_path / "copy"
    run.mkdir()
    for path in trained.iterdir():
        if path.is_file():
            (run / path.name).write_bytes(path.read_bytes())
    (run / name).write_bytes((run / name).read_bytes()[:40])
    for args in (("evaluate", str(run)), ("train", str(run), *TRAIN[:4], "--epochs", "2", *TRAIN[6:])):
        one_line_error(softmoe(*args), name)


@pytest.mark.slow
def test_damaged_last_checkpoint_resumes_from_the_one_before_only_when_asked(tmp_path):
    run = tmp_path / "run"
    assert softmoe("train", str(run), *TRAIN[:4], "--epochs", "2", *TRAIN[6:]).returncode == 0
    (run / "optimizer_002.safetensors").write_bytes(b"garbage")
    three = ("train", str(run), *TRAIN[:4], "--epochs", "3", *TRAIN[6:])
    one_line_error(softmoe(*three), "optimizer_002.safetensors", "--resume-last-good")
    proc = softmoe(*three, "--resume-last-good")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["epoch"] == 3


@pytest.mark.slow
def test_missing_checkpoint_file_is_named(trained, tmp_path):
    run = tmp_path / "copy"
    run.mkdir()
    for path in trained.iterdir():
        if path.is_file() and path.name != "epoch_001.safetensors":
            (run / path.name).write_bytes(path.read_bytes())
    one_line_error(softmoe("evaluate", str(run)), "epoch_001.safetensors")


@pytest.mark.slow
def test_files_honour_the_umask(tmp_path):
    run = tmp_path / "run"
    assert softmoe("train", str(run), *TRAIN, umask=0o022).returncode == 0
    modes = {p.name: p.stat().st_mode & 0o777 for p in run.iterdir()}
    assert modes["epoch_001.safetensors"] == modes["epoch_001.json"] == modes["run.json"] == 0o644, modes
    strict = tmp_path / "strict"
    assert softmoe("train", str(strict), *TRAIN, umask=0o077).returncode == 0
    assert (strict / "epoch_001.json").stat().st_mode & 0o777 == 0o600


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_is_one_line(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        one_line_error(softmoe("train", str(folder / "run"), *TRAIN), str(folder / "run"), "Permission denied")
    finally:
        folder.chmod(0o755)


@pytest.mark.slow
def test_operating_system_errors_are_one_line_and_leave_nothing(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_error(softmoe("train", str(afile), *TRAIN), str(afile))
    one_line_error(softmoe("train", str(afile / "run"), *TRAIN), str(afile))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


@pytest.mark.slow
def test_relative_dataset_paths_are_stored_absolute(tmp_path):
    data = tmp_path / "data"
    write_tiny_idx(data)
    proc = softmoe("train", "run", "--dataset", "mnist:data", *TRAIN[2:], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    stored = json.loads((tmp_path / "run" / "run.json").read_text())["model"]["dataset"]
    assert stored == f"mnist:{data.resolve()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = softmoe("evaluate", str(tmp_path / "run"), cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert set(json.loads(proc.stdout)) >= {"epoch", "all_experts"}


def test_stale_temporary_files_are_cleaned_on_the_next_write(trained, tmp_path):
    from softmoe.checkpoint import write_json

    stale = tmp_path / ".data.json.abc123.tmp"
    stale.write_text("half a file")
    other = tmp_path / ".other.json.x.tmp"
    other.write_text("not ours")
    write_json(tmp_path / "data.json", {"a": 1})
    assert not stale.exists() and other.exists()


@pytest.mark.slow
def test_report_rerender_keeps_results_json(tmp_path):
    from softmoe.cli import main

    out = tmp_path / "out"
    assert main(["reproduce", "mnist", "--preset", "smoke", "--out", str(out), "--no-progress"]) == 0
    before = (out / "results.json").read_bytes()
    assert softmoe("report", str(out)).returncode == 0
    assert (out / "results.json").read_bytes() == before


@pytest.mark.slow
def test_a_second_writer_is_told_who_holds_the_folder(tmp_path):
    import fcntl

    run = tmp_path / "run"
    run.mkdir()
    with open(run / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write("4242\n")
        handle.flush()
        one_line_error(softmoe("train", str(run), *TRAIN), f"{run} is in use by process 4242")


def test_non_integer_expert_hidden_is_a_value_error():
    from softmoe import SoftMoE

    with pytest.raises(ValueError, match=r"expert_hidden must be an integer >= 1, got 2\.5"):
        SoftMoE(8, 2, expert_hidden=2.5)


def write_tiny_idx(folder: Path) -> None:
    """A small MNIST in the real IDX format (gzipped): 5,060 train (5,000 of them the validation split) and 20 test
    images of 28x28."""
    import gzip
    import struct

    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.RandomState(0)
    for prefix, count in (("train", 5060), ("t10k", 20)):
        images = rng.randint(0, 256, size=(count, 28, 28)).astype(np.uint8)
        labels = (np.arange(count) % 10).astype(np.uint8)
        with gzip.open(folder / f"{prefix}-images-idx3-ubyte.gz", "wb") as f:
            f.write(struct.pack(">IIII", 2051, count, 28, 28) + images.tobytes())
        with gzip.open(folder / f"{prefix}-labels-idx1-ubyte.gz", "wb") as f:
            f.write(struct.pack(">II", 2049, count) + labels.tobytes())


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    import errno

    import softmoe.checkpoint as checkpoint
    from softmoe.cli import main

    def full(tensors, temp, metadata=None):
        Path(temp).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", temp)

    monkeypatch.setattr(checkpoint, "save_file", full)
    assert main(["train", str(tmp_path / "run"), *TRAIN]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "No space left on device" in err and ".tmp" in err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock", "run.json"]


def test_readme_synopsis_lists_every_option():
    """Every option of every command appears in the README's command-line synopsis."""
    import argparse

    from softmoe.cli import build_parser

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    synopsis = readme[readme.index("## Command line") : readme.index("## Results")]
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in commands.choices.items():
        line = next(text for text in synopsis.split("softmoe ")[1:] if text.startswith(name))
        block = synopsis[synopsis.index("softmoe " + line[:20]) :].split("\nsoftmoe ")[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert option in block, (name, option)


@pytest.mark.slow
def test_one_results_folder_refuses_the_suite_on_another_dataset(tmp_path, capsys):
    from softmoe.cli import main

    out = str(tmp_path / "out")
    assert main(["reproduce", "mnist", "--preset", "smoke", "--dataset", "digits", "--out", out, "--no-progress"]) == 0
    before = (tmp_path / "out" / "mnist_suite.json").read_bytes()
    capsys.readouterr()
    assert main(["reproduce", "mnist", "--preset", "smoke", "--dataset", "mnist5k", "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another configuration" in err and "data.name: 'digits' -> 'mnist5k'" in err
    assert (tmp_path / "out" / "mnist_suite.json").read_bytes() == before
