"""The training loop: one loop for every classifier here, seeded, resumable, single-process or under torchrun.

Two configurations of it ship. ``TrainConfig()`` is the paper's loop (Appendix E.1: Adam, constant lr 1e-3, batch
256, 15 epochs; ``shuffle=False, frozen_first_epoch=True`` is the authors' code). ``TrainConfig.vision()`` is the
recipe for the vision models: AdamW with weight decay, warm-up + cosine schedule, gradient clipping, and, as asked,
label smoothing, mixup, crop/flip augmentation and bfloat16 autocast.

Every epoch e, in order: reseed (shuffling from :func:`epoch_generator` (seed, e), augmentation and mixup from a
generator seeded by (seed, e), torch's global RNG (dropout) from (seed, e)); one optimizer step per batch; validation
and test accuracy; the checkpoint (:mod:`softmoe.runs` describes the run folder). So an interrupted run that resumes
ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from softmoe.checkpoint import save_tensors, write_json
from softmoe.data import ImageDataset, Splits, batches
from softmoe.data.augment import Augment, mixup
from softmoe.distributed import (
    LOCAL,
    DistContext,
    clip_grad_norm_,
    full_optimizer_tensors,
    full_state_dict,
    load_full_optimizer_tensors,
    unwrap,
)
from softmoe.runs import METRICS, ModuleT, claimed_run_folder, resume, run_identity, write_metrics_csv


@dataclass(frozen=True)
class TrainConfig:
    """A training recipe; the defaults are the paper's (Appendix E.1). See :meth:`vision` for the ViT recipe.

    Attributes:
        epochs, batch_size: training length and mini-batch size (the global batch under torchrun; the last batch
            of an epoch may be smaller).
        lr: the learning rate; with a warm-up, reached after ``warmup_epochs`` (linear from ``warmup_lr``).
        seed: initialization (``torch.manual_seed`` before the model factory), shuffling, augmentation, dropout.
        shuffle: reshuffle the training set every epoch (False: stored order every epoch, as the authors' code).
        frozen_first_epoch: epoch 1 runs the forward passes but takes no optimizer step (the authors' code does
            this, so its 15 epochs make 14 of updates).
        weight_decay: decoupled (AdamW) weight decay on parameters with 2 or more dimensions only (not on biases,
            norms, the router's scalar ``scale``); 0 is the paper's plain Adam.
        schedule: "constant" (lr after the warm-up) or "cosine" (decay to ``min_lr`` at the end of the last epoch);
            the schedule advances every optimizer step.
        clip_norm: clip the global gradient norm to this value (None: no clipping).
        label_smoothing: cross-entropy label smoothing.
        mixup_alpha: mixup with lam ~ Beta(alpha, alpha) on every training batch (0: off).
        crop_padding, flip: random crop with this padding (0: off) and random horizontal flip.
        bf16: bfloat16 autocast for training and evaluation forward passes.
        eval_batch_size: batch size of the accuracy passes.
        test_each_epoch: measure test accuracy after every epoch (False: only after the last one; None before).
        keep_all_epochs: keep every epoch's weights (needed to pick an epoch afterwards) or only the latest.
        tensorboard: also log each epoch's metrics with ``torch.utils.tensorboard`` (needs the tensorboard package).
        device: where a single process trains ("cpu", "cuda", ...); under torchrun the rank's device instead.
    """

    epochs: int = 15
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    shuffle: bool = True
    frozen_first_epoch: bool = False
    weight_decay: float = 0.0
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_epochs: float = 0.0
    warmup_lr: float = 0.0
    min_lr: float = 0.0
    clip_norm: float | None = None
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    crop_padding: int = 0
    flip: bool = False
    bf16: bool = False
    eval_batch_size: int = 1024
    test_each_epoch: bool = True
    keep_all_epochs: bool = True
    tensorboard: bool = False
    device: str = "cpu"

    def __post_init__(self) -> None:
        problems = []
        if self.epochs < 1 or self.batch_size < 1 or self.eval_batch_size < 1:
            problems.append("epochs, batch_size and eval_batch_size must be >= 1")
        if not self.lr > 0 or self.warmup_lr < 0 or self.min_lr < 0:
            problems.append("lr must be > 0 and warmup_lr, min_lr >= 0")
        if self.weight_decay < 0 or self.warmup_epochs < 0 or self.crop_padding < 0 or self.mixup_alpha < 0:
            problems.append("weight_decay, warmup_epochs, crop_padding and mixup_alpha must be >= 0")
        if self.schedule not in ("constant", "cosine"):
            problems.append(f"schedule must be 'constant' or 'cosine', got {self.schedule!r}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            problems.append("clip_norm must be > 0 or None")
        if not 0 <= self.label_smoothing < 1:
            problems.append("label_smoothing must lie in [0, 1)")
        if problems:
            raise ValueError(f"bad TrainConfig ({'; '.join(problems)}): {self}")

    @classmethod
    def vision(cls, **overrides) -> TrainConfig:
        """The recipe for the vision models (a small-model CPU default): AdamW with weight decay 0.05, 1 warm-up
        epoch then cosine to 1e-6, gradient clipping at 1.0, batch 128, 10 epochs; ``overrides`` replace fields.
        The paper's CIFAR recipe (Table 7) is lr 3e-4, 5 warm-up epochs, mixup 0.8, label smoothing 0.1."""
        recipe = {
            "epochs": 10,
            "batch_size": 128,
            "weight_decay": 0.05,
            "schedule": "cosine",
            "warmup_epochs": 1.0,
            "warmup_lr": 1e-6,
            "min_lr": 1e-6,
            "clip_norm": 1.0,
        }
        return cls(**{**recipe, **overrides})

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def identity(self) -> dict:
        """What a run folder must keep (``run.json``): everything but the epoch count, which a resumed run may
        raise, unless the schedule depends on it (cosine)."""
        recipe = self.to_json()
        if self.schedule == "constant":
            del recipe["epochs"]
        return recipe


class WarmupCosine:
    """Per-step learning rate: linear from ``warmup_lr`` to ``lr`` over ``warmup_steps``, then cosine to ``min_lr``
    (``cosine=False``: constant ``lr``).

    Its state is the number of steps taken (``state_dict``/``load_state_dict``); :meth:`apply` writes the current rate
    into every parameter group of the optimizer.
    """

    def __init__(
        self,
        lr: float,
        total_steps: int,
        warmup_steps: int,
        warmup_lr: float = 0.0,
        min_lr: float = 0.0,
        cosine: bool = True,
    ):
        self.lr, self.total_steps, self.warmup_steps = lr, max(1, total_steps), min(warmup_steps, total_steps)
        self.warmup_lr, self.min_lr, self.cosine = warmup_lr, min_lr, cosine
        self.step_count = 0

    def rate(self, step: int) -> float:
        """The learning rate used by optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.warmup_lr + (self.lr - self.warmup_lr) * step / self.warmup_steps
        if not self.cosine:
            return self.lr
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / decay_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer) -> float:
        rate = self.rate(self.step_count)
        for group in optimizer.param_groups:
            group["lr"] = rate
        return rate

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on parameters with >= 2 dimensions, none on biases, norms and scalars (one group
    of every parameter when ``weight_decay`` is 0)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if weight_decay == 0:
        return [{"params": params, "weight_decay": 0.0}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The shuffling generator of one epoch, independent of how the run got there."""
    return torch.Generator().manual_seed(seed * 100_003 + epoch)


def _stream_seed(seed: int, epoch: int, stream: int) -> int:
    """A seed for one random stream (1: augmentation/mixup, 2: global RNG) of one epoch, distinct from shuffling's."""
    return (seed * 1_000_003 + epoch) * 7 + stream


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


@torch.no_grad()
def accuracy(
    model: nn.Module,
    data: ImageDataset,
    batch_size: int = 1024,
    dist: DistContext = LOCAL,
    bf16: bool = False,
) -> float:
    """Top-1 accuracy of ``model`` on ``data`` in eval mode, on ``dist.device`` (the caller's selection context
    applies); ``bf16``: under bfloat16 autocast.

    In a distributed run every rank scores its part of each batch and the counts are summed (collective).
    """
    model = unwrap(model)  # no DDP forward (and its buffer broadcast) for a no-grad pass
    was_training = model.training
    model.eval()
    correct = 0
    for *tensors, _ in dist.shard_batches(batches(data, batch_size)):  # the global batch size last
        images, labels = tensors
        with _autocast(dist.device, bf16):
            correct += int((model(images).argmax(dim=1) == labels).sum())
    model.train(was_training)
    return dist.reduce(correct=correct)["correct"] / max(1, len(data))


def evaluate_accuracy(model: nn.Module, data: ImageDataset, config: TrainConfig, dist: DistContext = LOCAL) -> float:
    """:func:`accuracy` with the config's device (single process), autocast and eval batch size (collective)."""
    return accuracy(model, data, config.eval_batch_size, _on_device(dist, config), config.bf16)


def _on_device(dist: DistContext, config: TrainConfig) -> DistContext:
    return dist if dist.is_distributed else dataclasses.replace(dist, device=torch.device(config.device))


def _tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from softmoe.data.errors import MissingDependencyError

        raise MissingDependencyError(
            "TrainConfig(tensorboard=True) needs the optional package 'tensorboard': run `pip install tensorboard`"
        ) from None
    return SummaryWriter(str(run_dir / "tensorboard"))


def train_classifier(
    model_factory: Callable[[], ModuleT],
    splits: Splits,
    config: TrainConfig,
    run_dir: str | Path,
    progress: bool = True,
    description: str = "train",
    dist: DistContext | None = None,
    model_config: dict | None = None,
    resume_last_good: bool = False,
) -> tuple[ModuleT, list[dict]]:
    """Train (or resume, or just load) a classifier; returns the model at its last epoch, in eval mode, and every
    epoch's metrics (:data:`softmoe.runs.METRICS`: epoch, lr, train_loss, val_accuracy, test_accuracy, seconds).

    ``model_factory`` builds the untrained model on the CPU, right after ``torch.manual_seed(config.seed)``. A model
    that sets ``auxiliary_loss`` (a scalar tensor) in its training forward has it added to the loss.
    ``model_config`` (JSON-able) describes the model in ``run.json``; a folder made with another model, recipe or
    data is refused with a ValueError naming the differences. A damaged last checkpoint raises
    :class:`~softmoe.checkpoint.CorruptFileError` unless ``resume_last_good``.

    Under torchrun pass ``dist=softmoe.distributed.setup_distributed()``: ``config.batch_size`` is the global batch
    (divisible by the number of ranks). Every rank draws the same global batch, augmentation and mixup, then trains
    on its part of it (DDP on ``dist.device``, optionally expert parallel), so the update is that of one process on
    the whole batch; dropout draws differ. Rank 0 alone reads and writes the run folder, whose checkpoints are those
    of a single process (a run resumes with any world size).
    """
    dist = _on_device(dist or LOCAL, config)
    dist.local_batch_size(config.batch_size)  # the global batch must split evenly across ranks
    run_dir = Path(run_dir)
    identity = run_identity(config.identity(), splits, model_config) if dist.is_main else None
    with claimed_run_folder(run_dir, identity, dist):
        return _train(model_factory, splits, config, run_dir, progress, description, dist, resume_last_good)


def _train(model_factory, splits, config, run_dir, progress, description, dist, resume_last_good):
    """The body of :func:`train_classifier`, inside the run folder's lock."""
    torch.manual_seed(config.seed)
    model = model_factory()
    history, saved_optimizer = resume(model, run_dir, config.epochs, resume_last_good) if dist.is_main else (None, None)
    history = dist.broadcast_object(history)
    model = dist.prepare(model)  # on the device; every rank gets rank 0's weights
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr)
    steps = -(-len(splits.train) // config.batch_size)
    schedule = WarmupCosine(
        config.lr,
        config.epochs * steps,
        round(config.warmup_epochs * steps),
        config.warmup_lr,
        config.min_lr,
        cosine=config.schedule == "cosine",
    )
    if history:
        schedule.load_state_dict(history[-1]["schedule"])
        if len(history) < config.epochs:
            if saved_optimizer is not None:
                saved_optimizer = {key: value.to(dist.device) for key, value in saved_optimizer.items()}
            load_full_optimizer_tensors(model, optimizer, saved_optimizer, from_rank0=True)
    board = (
        _tensorboard_writer(run_dir) if config.tensorboard and len(history) < config.epochs and dist.is_main else None
    )
    bar = tqdm(
        total=config.epochs * steps,
        initial=len(history) * steps,
        desc=description,
        disable=not progress or not dist.is_main,
        leave=False,
    )
    try:
        for epoch in range(len(history) + 1, config.epochs + 1):
            started = time.perf_counter()
            rate, train_loss = _train_epoch(model, optimizer, schedule, splits.train, config, epoch, bar, dist)
            tested = config.test_each_epoch or epoch == config.epochs
            metrics = {
                "epoch": epoch,
                "lr": rate,
                "train_loss": train_loss,
                "val_accuracy": evaluate_accuracy(model, splits.val, config, dist),
                "test_accuracy": evaluate_accuracy(model, splits.test, config, dist) if tested else None,
                "seconds": time.perf_counter() - started,
            }
            bar.set_postfix(loss=f"{train_loss:.3f}", val=f"{metrics['val_accuracy']:.4f}")
            weights, optimizer_state = full_state_dict(model), full_optimizer_tensors(model, optimizer)  # collective
            history.append(metrics)
            if dist.is_main:
                save_tensors(run_dir / f"epoch_{epoch:03d}.safetensors", weights)
                save_tensors(run_dir / f"optimizer_{epoch:03d}.safetensors", optimizer_state)
                write_metrics_csv(run_dir / "metrics.csv", history)
                write_json(
                    run_dir / f"epoch_{epoch:03d}.json",
                    {**metrics, "schedule": schedule.state_dict(), "config": config.to_json()},
                )
                (run_dir / f"optimizer_{epoch - 2:03d}.safetensors").unlink(missing_ok=True)
                if not config.keep_all_epochs:
                    (run_dir / f"epoch_{epoch - 1:03d}.safetensors").unlink(missing_ok=True)
                if board is not None:
                    for name in METRICS[1:]:
                        if metrics[name] is not None:
                            board.add_scalar(name, metrics[name], epoch)
                    board.flush()
            dist.barrier()
    finally:
        bar.close()
        if board is not None:
            board.close()
    model = unwrap(model)
    model.eval()
    return model, [{key: h.get(key) for key in METRICS} for h in history]


def _train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: WarmupCosine,
    data: ImageDataset,
    config: TrainConfig,
    epoch: int,
    bar,
    dist: DistContext,
) -> tuple[float, float]:
    """One epoch over ``data``; returns (the last learning rate, the mean training loss over all ranks)."""
    torch.manual_seed(_stream_seed(config.seed, epoch, 2))  # dropout and anything else on the global RNG
    draws = torch.Generator().manual_seed(_stream_seed(config.seed, epoch, 1))
    augment = Augment(config.crop_padding, config.flip)
    frozen = config.frozen_first_epoch and epoch == 1
    model.train()
    total_loss, seen, rate = 0.0, 0, schedule.rate(schedule.step_count)
    generator = epoch_generator(config.seed, epoch) if config.shuffle else None
    for images, labels in batches(data, config.batch_size, config.shuffle, generator):
        with torch.set_grad_enabled(not frozen):
            loss_sum, count = _loss_sum(model, images, labels, config, augment, draws, dist)
        if not frozen:
            loss = dist.global_mean(loss_sum, images.shape[0])  # the plain mean in one process
            auxiliary = getattr(unwrap(model), "auxiliary_loss", None)  # e.g. a sparse router's balancing losses
            if auxiliary is not None:
                loss = loss + auxiliary
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients over the ranks here
            if config.clip_norm is not None:
                clip_grad_norm_(model.parameters(), config.clip_norm)  # of the whole gradient, expert shards included
            rate = schedule.apply(optimizer)
            optimizer.step()
            schedule.step()
        total_loss += float(loss_sum.detach())
        seen += count
        bar.update(1)
    totals = dist.reduce(loss=total_loss, seen=seen)
    return rate, totals["loss"] / max(1, totals["seen"])


def _loss_sum(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: TrainConfig,
    augment: Augment,
    draws: torch.Generator,
    dist: DistContext,
) -> tuple[torch.Tensor, int]:
    """(this rank's sum of per-example losses, its example count) on one global batch.

    Augmentation and mixup act on the global batch with the epoch's generator (as in one process), then each rank
    keeps its part (:meth:`DistContext.shard`, the whole batch in one process).
    """
    if augment.enabled:
        images = augment(images, draws)
    if config.mixup_alpha > 0:
        images, labels_a, labels_b, lam = mixup(images, labels, config.mixup_alpha, draws)
    else:
        labels_a, labels_b, lam = labels, labels, 1.0
    images, labels_a, labels_b = dist.shard(images, labels_a, labels_b)
    with _autocast(dist.device, config.bf16):
        logits = model(images).float()
    loss_sum = F.cross_entropy(logits, labels_a, reduction="sum", label_smoothing=config.label_smoothing)
    if lam != 1.0:
        loss_sum = lam * loss_sum + (1.0 - lam) * F.cross_entropy(
            logits, labels_b, reduction="sum", label_smoothing=config.label_smoothing
        )
    return loss_sum, labels_a.shape[0]
