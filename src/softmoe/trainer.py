"""The reusable training recipe for the vision models: AdamW, warm-up + cosine schedule, gradient clipping, label
smoothing, mixup, optional crop/flip augmentation and bfloat16 autocast; seeded, resumable, with per-epoch metrics.

A run folder uses the layout of :mod:`softmoe.train` (so its ``finished_epochs`` and ``load_epoch`` read it):

    epoch_{e:03d}.safetensors   model weights (buffers included) at the end of epoch e (every epoch, or only the
                                latest with ``keep_all_epochs=False``)
    optimizer_{e:03d}.safetensors  AdamW state, latest epoch only
    epoch_{e:03d}.json          metrics, the config and the schedule state; written LAST, so an epoch is finished
                                exactly when its JSON exists
    metrics.csv                 one row per finished epoch, rewritten atomically after every epoch

Resuming is exact: epoch e shuffles with ``softmoe.train.epoch_generator(seed, e)``, draws its augmentation and mixup
from a generator seeded by (seed, e) and reseeds torch's global RNG (dropout) from (seed, e), so an interrupted run
that resumes ends with the same weights as one that never stopped.
"""

from __future__ import annotations

import csv
import io
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from softmoe.checkpoint import (
    atomic_write,
    load_optimizer_tensors,
    load_tensors,
    optimizer_tensors,
    save_tensors,
    write_json,
)
from softmoe.data import Splits, batches
from softmoe.data.augment import Augment, mixup
from softmoe.distributed import (
    LOCAL,
    DistContext,
    full_optimizer_tensors,
    full_state_dict,
    load_full_optimizer_tensors,
    unwrap,
)
from softmoe.train import accuracy, claimed_run_folder, epoch_generator, finished_epochs, load_epoch, run_identity

METRICS = ("epoch", "lr", "train_loss", "val_accuracy", "test_accuracy", "seconds")


@dataclass(frozen=True)
class TrainerConfig:
    """The recipe. Defaults are a small-model CPU recipe; the paper's CIFAR recipe (Table 7) is AdamW, lr 3e-4,
    cosine, 5 warm-up epochs, mixup 0.8, label smoothing 0.1.

    Attributes:
        epochs, batch_size: training length and mini-batch size (the last batch of an epoch may be smaller).
        lr: peak learning rate, reached after ``warmup_epochs`` (linear warm-up from ``warmup_lr``), then a cosine
            decay to ``min_lr`` at the end of the last epoch; the schedule advances every step.
        weight_decay: AdamW decoupled weight decay, applied to parameters with 2 or more dimensions only (not to
            biases, norms, the router's scalar ``scale``).
        clip_norm: clip the global gradient norm to this value (None: no clipping).
        label_smoothing: cross-entropy label smoothing.
        mixup_alpha: mixup with lam ~ Beta(alpha, alpha) on every training batch (0: off).
        crop_padding, flip: random crop with this padding (0: off) and random horizontal flip.
        bf16: bfloat16 autocast for training and evaluation forward passes.
        seed: initialization (torch.manual_seed before the model factory), shuffling, augmentation, dropout.
        eval_batch_size: batch size of the accuracy passes.
        test_each_epoch: measure test accuracy after every epoch (False: only after the last one; None before).
        keep_all_epochs: keep every epoch's weights (needed to pick an epoch afterwards) or only the latest.
        tensorboard: also log each epoch's metrics with ``torch.utils.tensorboard`` (needs the tensorboard package).
        device: where to train ("cpu", "cuda", ...; default CPU); batches are moved there.
    """

    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.05
    warmup_epochs: float = 1.0
    warmup_lr: float = 1e-6
    min_lr: float = 1e-6
    clip_norm: float | None = 1.0
    label_smoothing: float = 0.0
    mixup_alpha: float = 0.0
    crop_padding: int = 0
    flip: bool = False
    bf16: bool = False
    seed: int = 0
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
        if self.clip_norm is not None and not self.clip_norm > 0:
            problems.append("clip_norm must be > 0 or None")
        if not 0 <= self.label_smoothing < 1:
            problems.append("label_smoothing must lie in [0, 1)")
        if problems:
            raise ValueError(f"bad TrainerConfig ({'; '.join(problems)}): {self}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainerConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class WarmupCosine:
    """Per-step learning rate: linear from ``warmup_lr`` to ``lr`` over ``warmup_steps``, then cosine to ``min_lr``.

    Its state is the number of steps taken (``state_dict``/``load_state_dict``); :meth:`apply` writes the current rate
    into every parameter group of the optimizer.
    """

    def __init__(self, lr: float, total_steps: int, warmup_steps: int, warmup_lr: float = 0.0, min_lr: float = 0.0):
        self.lr, self.total_steps, self.warmup_steps = lr, max(1, total_steps), min(warmup_steps, total_steps)
        self.warmup_lr, self.min_lr = warmup_lr, min_lr
        self.step_count = 0

    def rate(self, step: int) -> float:
        """The learning rate used by optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.warmup_lr + (self.lr - self.warmup_lr) * step / self.warmup_steps
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
    """AdamW groups: weight decay on parameters with >= 2 dimensions, none on biases, norms and scalars."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _stream_seed(seed: int, epoch: int, stream: int) -> int:
    """A seed for one random stream (1: augmentation/mixup, 2: global RNG) of one epoch, distinct from shuffling's."""
    return (seed * 1_000_003 + epoch) * 7 + stream


class _OnDevice(nn.Module):
    """Evaluation wrapper: moves each batch to ``device`` under the autocast setting, returns float32 logits on
    ``out_device`` (the CPU by default)."""

    def __init__(
        self, model: nn.Module, device: torch.device, bf16: bool, out_device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        self.model, self.device, self.bf16, self.out_device = model, device, bf16, torch.device(out_device)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        with _autocast(self.device, self.bf16):
            return self.model(images.to(self.device)).float().to(self.out_device)


def _autocast(device: torch.device, bf16: bool):
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if bf16 else nullcontext()


def evaluate_accuracy(model: nn.Module, data, config: TrainerConfig, dist: DistContext | None = None) -> float:
    """Top-1 accuracy with the config's device, autocast and eval batch size (``softmoe.train.accuracy``).

    With a distributed ``dist`` every rank scores its part of each eval batch on ``dist.device`` and the counts are
    summed over ranks (collective: every rank must call it).
    """
    dist = dist or LOCAL
    if not dist.is_distributed:
        wrapped = _OnDevice(model, torch.device(config.device), config.bf16)
        wrapped.train(model.training)
        return accuracy(wrapped, data, config.eval_batch_size)
    # The bare module: no DDP forward (and its buffer broadcast) for a no-grad pass.
    wrapped = _OnDevice(unwrap(model), dist.device, config.bf16, dist.device)
    wrapped.train(model.training)
    return accuracy(wrapped, data, config.eval_batch_size, dist=dist)


def write_metrics_csv(path: Path, history: list[dict]) -> None:
    """All finished epochs' metrics as CSV (columns :data:`METRICS`), written atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=METRICS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow(row)
    atomic_write(path, lambda temp: Path(temp).write_text(buffer.getvalue()))


def _tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from softmoe.data.errors import MissingDependencyError

        raise MissingDependencyError(
            "TrainerConfig(tensorboard=True) needs the optional package 'tensorboard': run `pip install tensorboard`"
        ) from None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _check_resumable(run_dir: Path, history: list[dict], config: TrainerConfig) -> None:
    stored, schedule = history[-1].get("config"), history[-1].get("schedule")
    if not isinstance(stored, dict) or not isinstance(schedule, dict):
        raise ValueError(f"{run_dir} holds epochs that softmoe.trainer.fit did not write; use another run folder")
    if TrainerConfig.from_json(stored) != config:
        raise ValueError(
            f"{run_dir} holds {len(history)} epoch(s) trained with a different TrainerConfig ({stored}); use another "
            f"run folder or the same config to resume (now: {config.to_json()})"
        )


def fit(
    model_factory: Callable[[], nn.Module],
    splits: Splits,
    config: TrainerConfig,
    run_dir: str | Path,
    progress: bool = True,
    description: str = "train",
    dist: DistContext | None = None,
    model_config: dict | None = None,
) -> tuple[nn.Module, list[dict]]:
    """Train (or resume, or just load) a classifier with the recipe; returns the model at its last epoch (in eval
    mode) and every epoch's metrics (epoch, lr, train_loss, val_accuracy, test_accuracy, seconds).

    ``model_factory`` builds the untrained model on the CPU; it runs right after ``torch.manual_seed(config.seed)``.

    Under torchrun pass ``dist=softmoe.distributed.setup_distributed()``: ``config.batch_size`` is the global batch
    (divisible by the number of ranks). Every rank draws the same global batch, augmentation and mixup (the same
    generators), then trains on its part of it (DDP on ``dist.device``, which replaces ``config.device``), so the
    update is that of one process on the whole batch. Rank 0 alone reads and writes the run folder, whose files are
    those of a single process (a run resumes with any world size). Dropout draws differ from a single process.

    The run folder records the model (``model_config``), the recipe and the data's fingerprint in ``run.json`` and
    is refused to another run, under the same lock as :func:`softmoe.train.train_classifier`.

    Raises:
        ValueError: ``run_dir`` already holds epochs trained with a different config, model or data.
    """
    dist = dist or LOCAL
    identity = run_identity(config.to_json(), splits, model_config) if dist.is_main else None
    with claimed_run_folder(Path(run_dir), identity, dist):
        return _fit(model_factory, splits, config, run_dir, progress, description, dist)


def _fit(model_factory, splits, config, run_dir, progress, description, dist):
    """The body of :func:`fit`, inside the run folder's lock."""
    distributed = dist.is_distributed
    dist.local_batch_size(config.batch_size)  # the global batch must split evenly across ranks
    run_dir = Path(run_dir)
    device = dist.device if distributed else torch.device(config.device)
    torch.manual_seed(config.seed)
    model = model_factory()
    history = dist.broadcast_object(finished_epochs(run_dir) if dist.is_main else None)
    if history:
        _check_resumable(run_dir, history, config)  # every rank has the history: all raise together
        if dist.is_main:
            load_epoch(model, run_dir, len(history))
    model = dist.prepare(model) if distributed else model.to(device)  # every rank gets rank 0's weights
    optimizer = torch.optim.AdamW(parameter_groups(model, config.weight_decay), lr=config.lr)
    steps = -(-len(splits.train) // config.batch_size)
    schedule = WarmupCosine(
        config.lr, config.epochs * steps, round(config.warmup_epochs * steps), config.warmup_lr, config.min_lr
    )
    if history:
        if len(history) < config.epochs:
            path = run_dir / f"optimizer_{len(history):03d}.safetensors"
            if distributed:
                load_full_optimizer_tensors(model, optimizer, load_tensors(path) if dist.is_main else None, src=0)
            else:
                state = load_tensors(path)
                load_optimizer_tensors(optimizer, {k: v.to(device) for k, v in state.items()})
        schedule.load_state_dict(history[-1]["schedule"])
        if dist.is_main:
            write_metrics_csv(run_dir / "metrics.csv", history)
    augment = Augment(config.crop_padding, config.flip)
    board = (
        _tensorboard_writer(run_dir)
        if config.tensorboard and len(history) < config.epochs and dist.is_main
        else None
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
            metrics = _train_epoch(model, optimizer, schedule, splits, config, augment, epoch, device, bar, dist)
            metrics["val_accuracy"] = evaluate_accuracy(model, splits.val, config, dist)
            last = epoch == config.epochs
            metrics["test_accuracy"] = (
                evaluate_accuracy(model, splits.test, config, dist) if config.test_each_epoch or last else None
            )
            metrics["seconds"] = time.perf_counter() - metrics.pop("started")
            bar.set_postfix(loss=f"{metrics['train_loss']:.3f}", val=f"{metrics['val_accuracy']:.4f}")
            if distributed:
                weights, optimizer_state = full_state_dict(model), full_optimizer_tensors(model, optimizer)  # collective
            else:
                weights, optimizer_state = model.state_dict(), optimizer_tensors(optimizer)
            history.append(metrics)
            if dist.is_main:
                save_tensors(run_dir / f"epoch_{epoch:03d}.safetensors", weights)
                save_tensors(run_dir / f"optimizer_{epoch:03d}.safetensors", optimizer_state)
                write_metrics_csv(run_dir / "metrics.csv", history)
                write_json(
                    run_dir / f"epoch_{epoch:03d}.json",
                    {**metrics, "schedule": schedule.state_dict(), "config": config.to_json()},
                )
                (run_dir / f"optimizer_{epoch - 1:03d}.safetensors").unlink(missing_ok=True)
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
    return model, [{k: h[k] for k in METRICS if k in h} for h in history]


def _train_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule: WarmupCosine,
    splits: Splits,
    config: TrainerConfig,
    augment: Augment,
    epoch: int,
    device: torch.device,
    bar,
    dist: DistContext = LOCAL,
) -> dict:
    started = time.perf_counter()
    torch.manual_seed(_stream_seed(config.seed, epoch, 2))  # dropout and anything else on the global RNG
    draws = torch.Generator().manual_seed(_stream_seed(config.seed, epoch, 1))
    model.train()
    total_loss, seen, rate = 0.0, 0, schedule.rate(schedule.step_count)
    for images, labels in batches(splits.train, config.batch_size, True, epoch_generator(config.seed, epoch)):
        if dist.is_distributed:
            loss, loss_sum, count = _distributed_loss(model, images, labels, config, augment, draws, device, dist)
            total_loss += float(loss_sum.detach())
        else:
            images, labels = images.to(device), labels.to(device)
            if augment.enabled:
                images = augment(images, draws)
            with _autocast(device, config.bf16):
                if config.mixup_alpha > 0:
                    images, labels_a, labels_b, lam = mixup(images, labels, config.mixup_alpha, draws)
                    logits = model(images).float()
                    loss = lam * F.cross_entropy(logits, labels_a, label_smoothing=config.label_smoothing) + (
                        1.0 - lam
                    ) * F.cross_entropy(logits, labels_b, label_smoothing=config.label_smoothing)
                else:
                    logits = model(images).float()
                    loss = F.cross_entropy(logits, labels, label_smoothing=config.label_smoothing)
            count = labels.shape[0]
            total_loss += float(loss.detach()) * count
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages the gradients over the ranks here
        if config.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
        rate = schedule.apply(optimizer)
        optimizer.step()
        schedule.step()
        seen += count
        bar.update(1)
    if dist.is_distributed:
        totals = dist.reduce(loss=total_loss, seen=seen)
        total_loss, seen = totals["loss"], totals["seen"]
    return {"epoch": epoch, "lr": rate, "train_loss": total_loss / max(1, seen), "started": started}


def _distributed_loss(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    config: TrainerConfig,
    augment: Augment,
    draws: torch.Generator,
    device: torch.device,
    dist: DistContext,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss to backpropagate, this rank's loss sum, this rank's example count) of one global batch.

    Augmentation and mixup act on the global batch with the shared generator (as in one process), then each rank
    keeps its part; the loss is the sum over its part scaled by :meth:`DistContext.global_mean`.
    """
    global_count = images.shape[0]
    if augment.enabled:
        images = augment(images, draws)
    smoothing = config.label_smoothing
    if config.mixup_alpha > 0:
        images, labels_a, labels_b, lam = mixup(images, labels, config.mixup_alpha, draws)
        images, labels_a, labels_b = dist.shard(images, labels_a, labels_b)
        with _autocast(device, config.bf16):
            logits = model(images).float()
            loss_sum = lam * F.cross_entropy(logits, labels_a, reduction="sum", label_smoothing=smoothing) + (
                1.0 - lam
            ) * F.cross_entropy(logits, labels_b, reduction="sum", label_smoothing=smoothing)
        count = labels_a.shape[0]
    else:
        images, labels = dist.shard(images, labels)
        with _autocast(device, config.bf16):
            logits = model(images).float()
            loss_sum = F.cross_entropy(logits, labels, reduction="sum", label_smoothing=smoothing)
        count = labels.shape[0]
    return dist.global_mean(loss_sum, global_count), loss_sum, count
