"""The recipe trainer: schedule, determinism, exact resume after an interruption, run-folder files, config checks,
and the torch augmentation it uses."""

from __future__ import annotations

import csv
import math
import os

import pytest
import torch

import softmoe.trainer as trainer_module
from softmoe.data import ImageDataset, Splits
from softmoe.data.augment import Augment, mixup, random_crop, random_flip, sample_beta
from softmoe.data.errors import MissingDependencyError
from softmoe.models.vit import ViT
from softmoe.train import finished_epochs, load_epoch
from softmoe.trainer import TrainerConfig, WarmupCosine, fit, parameter_groups


def tiny_splits(n=80):
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (n,), generator=g)
    images = torch.rand(n, 1, 8, 8, generator=g) * 0.5
    images[:, 0, labels.tolist(), :] += 0.5  # learnable: the label lights up a row
    data = ImageDataset(images.clamp(0, 1), labels, 3, "tiny")
    return Splits(data.subset(slice(0, 48)), data.subset(slice(48, 64)), data.subset(slice(64, 80)))


def factory():
    return ViT(
        image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, depth=2, heads=2, mlp_dim=8,
        classifier="gap", moe_blocks=(1,), num_experts=4, expert_hidden=4, dropout=0.1,
    )


# Every random ingredient at once: shuffling, crop, flip, mixup, dropout.
CONFIG = TrainerConfig(
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
def test_fit_learns_is_deterministic_and_writes_the_run_folder(tmp_path):
    splits = tiny_splits()
    model_a, history_a = fit(factory, splits, CONFIG, tmp_path / "a", progress=False)
    model_b, history_b = fit(factory, splits, CONFIG, tmp_path / "b", progress=False)
    assert same_weights(model_a, model_b) and without_seconds(history_a) == without_seconds(history_b)
    assert history_a[-1]["train_loss"] < history_a[0]["train_loss"]
    assert [h["epoch"] for h in history_a] == [1, 2, 3] and not model_a.training
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == sorted(
        [f"epoch_{e:03d}.{ext}" for e in (1, 2, 3) for ext in ("json", "safetensors")]
        + ["optimizer_003.safetensors", "metrics.csv", "run.json", ".lock"]
    )
    with open(tmp_path / "a" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3]
    assert float(rows[-1]["val_accuracy"]) == pytest.approx(history_a[-1]["val_accuracy"])
    assert finished_epochs(tmp_path / "a")[0]["schedule"] == {"step_count": 3}  # 48 / 16 steps per epoch


@pytest.mark.slow
def test_resume_after_interruption_equals_uninterrupted_run(tmp_path, monkeypatch):
    splits = tiny_splits()
    reference, reference_history = fit(factory, splits, CONFIG, tmp_path / "ref", progress=False)

    real_batches = trainer_module.batches
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        for batch in real_batches(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 5:  # the second step of epoch 2 (3 training batches per epoch)
                raise KeyboardInterrupt
            yield batch

    monkeypatch.setattr(trainer_module, "batches", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fit(factory, splits, CONFIG, tmp_path / "run", progress=False)
    monkeypatch.setattr(trainer_module, "batches", real_batches)
    assert [h["epoch"] for h in finished_epochs(tmp_path / "run")] == [1]

    trained = []
    write_json = trainer_module.write_json

    def record(path, data):
        trained.append(data["epoch"])
        write_json(path, data)

    monkeypatch.setattr(trainer_module, "write_json", record)
    resumed, history = fit(factory, splits, CONFIG, tmp_path / "run", progress=False)
    assert trained == [2, 3]
    assert same_weights(reference, resumed)
    assert without_seconds(history) == without_seconds(reference_history)
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3]

    trained.clear()
    again, _ = fit(factory, splits, CONFIG, tmp_path / "run", progress=False)
    assert trained == [] and same_weights(again, reference)  # a finished run is only loaded


def test_resume_refuses_a_different_config(tmp_path):
    splits = tiny_splits()
    config = TrainerConfig(epochs=1, batch_size=16, seed=0)
    fit(factory, splits, config, tmp_path, progress=False)
    with pytest.raises(ValueError, match=r"another configuration \(train\.seed: 0 -> 1\)"):
        fit(factory, splits, TrainerConfig(epochs=1, batch_size=16, seed=1), tmp_path, progress=False)


def test_keep_last_epoch_only_bf16_and_test_once(tmp_path):
    splits = tiny_splits()
    config = TrainerConfig(epochs=2, batch_size=16, bf16=True, keep_all_epochs=False, test_each_epoch=False)
    model, history = fit(factory, splits, config, tmp_path, progress=False)
    assert not (tmp_path / "epoch_001.safetensors").exists() and (tmp_path / "epoch_002.safetensors").exists()
    assert history[0]["test_accuracy"] is None and history[1]["test_accuracy"] is not None
    assert all(math.isfinite(h["train_loss"]) for h in history)
    loaded = load_epoch(factory(), tmp_path, 2)
    assert same_weights(loaded, model)


def test_bad_configs_and_parameter_groups():
    for bad in (dict(epochs=0), dict(lr=0), dict(clip_norm=0), dict(label_smoothing=1.0), dict(mixup_alpha=-1)):
        with pytest.raises(ValueError, match="bad TrainerConfig"):
            TrainerConfig(**bad)
    model = factory()
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert TrainerConfig.from_json(CONFIG.to_json()) == CONFIG


def test_tensorboard_is_optional(tmp_path):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        with pytest.raises(MissingDependencyError, match="tensorboard"):
            fit(factory, tiny_splits(), TrainerConfig(epochs=1, tensorboard=True), tmp_path, progress=False)
    else:
        fit(factory, tiny_splits(), TrainerConfig(epochs=1, tensorboard=True), tmp_path, progress=False)
        assert (tmp_path / "tensorboard").is_dir()


# ---------------------------------------------------------------------------------------------------- augment


def test_random_crop_is_a_window_of_the_padded_image():
    images = torch.rand(6, 2, 5, 7)
    out = random_crop(images, 2, torch.Generator().manual_seed(0))
    offsets = torch.randint(0, 5, (6, 2), generator=torch.Generator().manual_seed(0))
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2))
    for i, (dy, dx) in enumerate(offsets.tolist()):
        assert torch.equal(out[i], padded[i, :, dy : dy + 5, dx : dx + 7])
    assert random_crop(images, 0) is images
    with pytest.raises(ValueError, match="padding"):
        random_crop(images, -1)


def test_flip_mixup_and_reproducibility():
    images = torch.rand(8, 1, 4, 4)
    flipped = random_flip(images, torch.Generator().manual_seed(1))
    for a, b in zip(images, flipped):
        assert torch.equal(a, b) or torch.equal(a.flip(-1), b)
    augment = Augment(crop_padding=1, flip=True)
    one = augment(images, torch.Generator().manual_seed(2))
    two = augment(images, torch.Generator().manual_seed(2))
    assert torch.equal(one, two) and augment.enabled and not Augment().enabled
    labels = torch.arange(8)
    mixed, a, b, lam = mixup(images, labels, 0.4, torch.Generator().manual_seed(3))
    assert 0 <= lam <= 1 and torch.equal(a, labels) and sorted(b.tolist()) == list(range(8))
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * images[b])
    draws = [sample_beta(0.4, torch.Generator().manual_seed(s)) for s in range(200)]
    assert sample_beta(0.4, torch.Generator().manual_seed(0)) == draws[0]
    assert 0.4 < sum(draws) / len(draws) < 0.6  # Beta(a, a) has mean 1/2
