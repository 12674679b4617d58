"""The training loop in both of its configurations (the paper's Adam loop and the vision recipe): determinism, resume
after an interruption (no lost or duplicated work), run-folder files, config checks, the schedule."""

import csv
import math
import os

import pytest
import torch

import softmoe.train as train_module
from softmoe.checkpoint import atomic_write, read_json, write_json
from softmoe.data import ImageDataset, Splits
from softmoe.data.errors import MissingDependencyError
from softmoe.models import SoftMoEClassifier
from softmoe.models.vit import ViT
from softmoe.runs import finished_epochs, load_epoch
from softmoe.train import TrainConfig, WarmupCosine, parameter_groups, train_classifier


def tiny_splits(n=96):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (n,), generator=g)
    images = torch.rand(n, 1, 8, 8, generator=g) * 0.5
    images[:, 0, labels.tolist(), :] += 0.5  # learnable: the label lights up a row
    data = ImageDataset(images.clamp(0, 1), labels, 3, "tiny")
    return Splits(data.subset(slice(0, 64)), data.subset(slice(64, 80)), data.subset(slice(80, 96)))


def factory():
    return SoftMoEClassifier((1, 8, 8), num_experts=4, num_classes=3)


CONFIG = TrainConfig(epochs=3, batch_size=16, lr=1e-2, seed=1)


def watched(model_factory, seen: list):
    """``model_factory`` whose models append the input of each training-mode forward to ``seen`` (a forward
    pre-hook): what the loop trains on, in order."""

    def make():
        model = model_factory()
        model.register_forward_pre_hook(lambda module, args: seen.append(args[0]) if module.training else None)
        return model

    return make


def test_training_learns_and_is_deterministic(tmp_path):
    splits = tiny_splits()
    model_a, history_a = train_classifier(factory, splits, CONFIG, tmp_path / "a", progress=False)
    model_b, history_b = train_classifier(factory, splits, CONFIG, tmp_path / "b", progress=False)
    assert [h["train_loss"] for h in history_a] == [h["train_loss"] for h in history_b]
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
    assert history_a[-1]["train_loss"] < history_a[0]["train_loss"]
    assert [h["epoch"] for h in finished_epochs(tmp_path / "a")] == [1, 2, 3]
    # The last two epochs keep optimizer state; every epoch keeps weights and metrics; run.json and the lock.
    names = sorted(os.listdir(tmp_path / "a"))
    epochs = [f"epoch_{e:03d}.{ext}" for e in (1, 2, 3) for ext in ("json", "safetensors")]
    assert names == [".lock", *epochs, "metrics.csv", "optimizer_002.safetensors", "optimizer_003.safetensors", "run.json"]


def test_load_epoch_restores_that_epoch(tmp_path):
    splits = tiny_splits()
    model, history = train_classifier(factory, splits, CONFIG, tmp_path, progress=False)
    first = load_epoch(factory(), tmp_path, 1)
    assert train_module.accuracy(first, splits.val) == pytest.approx(history[0]["val_accuracy"])
    assert not torch.equal(first.moe.phi, model.moe.phi)


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"a": 1})

    def failing(temp):
        with open(temp, "w") as f:
            f.write("{partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(path, failing)
    assert read_json(path) == {"a": 1}
    assert os.listdir(tmp_path) == ["r.json"]


def test_bad_config():
    with pytest.raises(ValueError, match="epochs"):
        TrainConfig(epochs=0)


class WithAuxiliaryLoss(torch.nn.Module):
    """A classifier whose training forward exposes an auxiliary loss on a parameter the logits never use."""

    def __init__(self):
        super().__init__()
        self.net = factory()
        self.unused = torch.nn.Parameter(torch.zeros(()))
        self.auxiliary_loss = None

    def forward(self, images):
        self.auxiliary_loss = 10.0 * self.unused if self.training else None
        return self.net(images)


def test_training_loop_adds_the_models_auxiliary_loss(tmp_path):
    model, _ = train_classifier(WithAuxiliaryLoss, tiny_splits(), CONFIG, tmp_path, progress=False)
    # Only the auxiliary loss has a gradient for `unused`: Adam moves it down by about lr per step.
    assert float(model.unused.detach()) == pytest.approx(-CONFIG.lr * 4 * CONFIG.epochs, rel=0.05)


def test_resuming_a_folder_of_another_model_is_a_clear_error(tmp_path):
    train_classifier(factory, tiny_splits(), TrainConfig(epochs=1, batch_size=16), tmp_path, progress=False)

    def other():
        return SoftMoEClassifier((1, 8, 8), num_experts=8, num_classes=3)

    with pytest.raises(ValueError, match="epoch_001.safetensors does not fit this model"):
        train_classifier(other, tiny_splits(), TrainConfig(epochs=2, batch_size=16), tmp_path, progress=False)


def test_authors_protocol_frozen_first_epoch_and_stored_order(tmp_path):
    """frozen_first_epoch: epoch 1 changes no weight (and saves the initial ones); shuffle=False: every epoch sees
    the training set in stored order, so a run over a permuted set differs."""
    splits = tiny_splits()
    config = TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=1, shuffle=False, frozen_first_epoch=True)
    torch.manual_seed(config.seed)
    initial = factory().state_dict()
    seen = []
    model, history = train_classifier(watched(factory, seen), splits, config, tmp_path / "run", progress=False)
    assert len(seen) == 2 * 4  # 64 / 16 batches per epoch
    assert all(torch.equal(torch.cat(seen[start:start + 4]), splits.train.images) for start in (0, 4))
    first = load_epoch(factory(), tmp_path / "run", 1).state_dict()
    assert all(torch.equal(first[k], initial[k]) for k in initial)
    assert not all(torch.equal(model.state_dict()[k], initial[k]) for k in initial)


def test_a_run_folder_refuses_another_configuration_before_writing(tmp_path):
    splits = tiny_splits()
    short = TrainConfig(epochs=1, batch_size=16, lr=1e-2, seed=1)
    train_classifier(factory, splits, short, tmp_path / "run", progress=False, model_config={"experts": 4})
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    other = Splits(splits.train.subset(slice(0, 48)), splits.val, splits.test)
    cases = [
        (dict(splits=splits, config=TrainConfig(epochs=2, batch_size=16, lr=1e-3, seed=1)), r"train\.lr: 0\.01 -> 0\.001"),
        (dict(splits=splits, config=TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=2)), r"train\.seed: 1 -> 2"),
        (dict(splits=other, config=TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=1)), r"data\.fingerprint: '"),
    ]
    for kwargs, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            train_classifier(factory, kwargs["splits"], kwargs["config"], tmp_path / "run", progress=False,
                             model_config={"experts": 4})
    with pytest.raises(ValueError, match=r"another configuration \(model\.experts: 4 -> 8\); use another folder"):
        train_classifier(factory, splits, short, tmp_path / "run", progress=False, model_config={"experts": 8})
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    assert after == before  # nothing written by the refused calls
    # More epochs of the same run are a continuation, not another configuration.
    _, history = train_classifier(factory, splits, TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=1),
                                  tmp_path / "run", progress=False, model_config={"experts": 4})
    assert [h["epoch"] for h in history] == [1, 2]


@pytest.mark.parametrize("damaged", ["epoch_002.safetensors", "optimizer_002.safetensors"])
def test_a_damaged_last_checkpoint_is_named_and_skipped_only_when_asked(tmp_path, damaged):
    splits = tiny_splits()
    two = TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=1)
    train_classifier(factory, splits, two, tmp_path / "run", progress=False)
    path = tmp_path / "run" / damaged
    path.write_bytes(path.read_bytes()[:100])  # truncated
    three = TrainConfig(epochs=3, batch_size=16, lr=1e-2, seed=1)
    with pytest.raises(ValueError, match=rf"{damaged}: not a readable safetensors file .*epoch 2\) is unusable"):
        train_classifier(factory, splits, three, tmp_path / "run", progress=False)
    assert path.exists()  # nothing removed without asking
    _, history = train_classifier(factory, splits, three, tmp_path / "run", progress=False, resume_last_good=True)
    assert [h["epoch"] for h in history] == [1, 2, 3]  # epoch 2 trained again from epoch 1's checkpoint
    reference = train_classifier(factory, splits, three, tmp_path / "ref", progress=False)[1]
    assert [h["train_loss"] for h in history] == [h["train_loss"] for h in reference]


def test_one_writer_per_run_folder(tmp_path):
    from softmoe.checkpoint import run_lock

    with run_lock(tmp_path / "run"):
        with pytest.raises(ValueError, match=rf"{tmp_path / 'run'} is in use by process {os.getpid()}"):
            train_classifier(factory, tiny_splits(), CONFIG, tmp_path / "run", progress=False)


# ---------------------------------------------------------------------------------------------------- the vision recipe


def recipe_splits():
    """48 training examples: 3 batches of 16 per epoch."""
    splits = tiny_splits(80)
    data = splits.train.subset(slice(0, 48)), splits.train.subset(slice(48, 64)), splits.val
    return Splits(*data)


def vit_factory():
    return ViT(
        image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, depth=2, heads=2, mlp_dim=8,
        classifier="gap", moe_blocks=(1,), num_experts=4, expert_hidden=4, dropout=0.1,
    )


# Every random ingredient at once: shuffling, crop, flip, mixup, dropout.
RECIPE = TrainConfig.vision(
    epochs=3, batch_size=16, lr=1e-2, warmup_epochs=1, label_smoothing=0.1, mixup_alpha=0.4, crop_padding=1,
    flip=True, clip_norm=0.5, seed=3,
)


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def without_seconds(history):
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]


def test_schedule_warmup_then_cosine():
    schedule = WarmupCosine(lr=1.0, total_steps=110, warmup_steps=10, warmup_lr=0.1, min_lr=0.01)
    rates = [schedule.rate(s) for s in range(110)]
    assert rates[0] == pytest.approx(0.1) and rates[10] == pytest.approx(1.0)
    assert rates[5] == pytest.approx(0.55)
    assert rates[60] == pytest.approx(0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule.rate(110) == pytest.approx(0.01)
    assert all(a <= b for a, b in zip(rates[:10], rates[1:11])) and all(a >= b for a, b in zip(rates[10:], rates[11:]))
    schedule.step()
    schedule.step()
    restored = WarmupCosine(1.0, 110, 10, 0.1, 0.01)
    restored.load_state_dict(schedule.state_dict())
    assert restored.step_count == 2


@pytest.mark.slow
def test_vision_recipe_learns_is_deterministic_and_writes_the_run_folder(tmp_path):
    splits = recipe_splits()
    model_a, history_a = train_classifier(vit_factory, splits, RECIPE, tmp_path / "a", progress=False)
    model_b, history_b = train_classifier(vit_factory, splits, RECIPE, tmp_path / "b", progress=False)
    assert same_weights(model_a, model_b) and without_seconds(history_a) == without_seconds(history_b)
    assert history_a[-1]["train_loss"] < history_a[0]["train_loss"]
    assert [h["epoch"] for h in history_a] == [1, 2, 3] and not model_a.training
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(
        [f"epoch_{e:03d}.{ext}" for e in (1, 2, 3) for ext in ("json", "safetensors")]
        + ["optimizer_002.safetensors", "optimizer_003.safetensors", "metrics.csv", "run.json", ".lock"]
    )
    with open(tmp_path / "a" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(history_a[-1]["val_accuracy"])
    assert finished_epochs(tmp_path / "a")[0]["schedule"] == {"step_count": 3}  # 48 / 16 steps per epoch


@pytest.mark.parametrize("recipe", ["paper", pytest.param("vision", marks=pytest.mark.slow)])
def test_resume_after_interruption_equals_uninterrupted_run(tmp_path, monkeypatch, recipe):
    """An interruption inside epoch 2 (per epoch: 4 or 3 training batches, then the validation and test batches);
    the resumed run trains epochs 2 and 3 only and ends as the uninterrupted one; a finished run is only loaded."""
    model_factory, config, splits = {
        "paper": (factory, CONFIG, tiny_splits()), "vision": (vit_factory, RECIPE, recipe_splits()),
    }[recipe]
    reference, reference_history = train_classifier(model_factory, splits, config, tmp_path / "ref", progress=False)

    real_batches = train_module.batches
    calls = {"n": 0}

    def interrupted(*args, **kwargs):  # the fault: the run is killed at its 7th batch
        for batch in real_batches(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 7:
                raise KeyboardInterrupt
            yield batch

    with monkeypatch.context() as crash, pytest.raises(KeyboardInterrupt):
        crash.setattr(train_module, "batches", interrupted)
        train_classifier(model_factory, splits, config, tmp_path / "run", progress=False)
    assert [h["epoch"] for h in finished_epochs(tmp_path / "run")] == [1]

    def epoch_files():  # each epoch's metrics file, as written: name -> (bytes, modification time)
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "run").glob("epoch_*.json")}

    steps = -(-len(splits.train) // config.batch_size)
    before, seen = epoch_files(), []
    resumed, history = train_classifier(watched(model_factory, seen), splits, config, tmp_path / "run",
                                        progress=False)
    after = epoch_files()
    assert [name for name in sorted(after) if after[name] != before.get(name)] == ["epoch_002.json", "epoch_003.json"]
    assert len(seen) == 2 * steps  # epoch 1 is not trained again, nothing is lost
    assert same_weights(reference, resumed)
    assert without_seconds(history) == without_seconds(reference_history)
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3]

    seen.clear()
    again, _ = train_classifier(watched(model_factory, seen), splits, config, tmp_path / "run", progress=False)
    assert seen == [] and epoch_files() == after and same_weights(again, reference)  # a finished run is only loaded


def test_resume_refuses_a_different_config(tmp_path):
    splits = recipe_splits()
    config = TrainConfig.vision(epochs=1, batch_size=16, seed=0)
    train_classifier(vit_factory, splits, config, tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"another configuration \(train\.seed: 0 -> 1\)"):
        train_classifier(vit_factory, splits, TrainConfig.vision(epochs=1, batch_size=16, seed=1), tmp_path, progress=False)


def test_keep_last_epoch_only_bf16_and_test_once(tmp_path):
    splits = recipe_splits()
    config = TrainConfig.vision(epochs=2, batch_size=16, bf16=True, keep_all_epochs=False, test_each_epoch=False)
    model, history = train_classifier(vit_factory, splits, config, tmp_path, progress=False)
    assert not (tmp_path / "epoch_001.safetensors").exists() and (tmp_path / "epoch_002.safetensors").exists()
    assert history[0]["test_accuracy"] is None and history[1]["test_accuracy"] is not None
    assert all(math.isfinite(h["train_loss"]) for h in history)
    loaded = load_epoch(vit_factory(), tmp_path, 2)
    assert same_weights(loaded, model)


def test_bad_configs_and_parameter_groups():
    for bad in (dict(epochs=0), dict(lr=0), dict(clip_norm=0), dict(label_smoothing=1.0), dict(mixup_alpha=-1)):
        with pytest.raises(ValueError, match="bad TrainConfig"):
            TrainConfig.vision(**bad)
    model = vit_factory()
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert TrainConfig.from_json(RECIPE.to_json()) == RECIPE


def test_tensorboard_is_optional(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="tensorboard"):
            train_classifier(vit_factory, recipe_splits(), TrainConfig.vision(epochs=1, tensorboard=True), tmp_path, progress=False)
    else:
        train_classifier(vit_factory, recipe_splits(), TrainConfig.vision(epochs=1, tensorboard=True), tmp_path, progress=False)
        assert (tmp_path / "tensorboard").is_dir()
