"""One training loop for the classifiers of the reproduction: seeded, resumable, with per-epoch checkpoints.

A run folder holds ``run.json`` (what defines the run: the model, the recipe but for the epoch count, the data's
fingerprint; a folder is never resumed under another), for every finished epoch e ``epoch_{e:03d}.safetensors``
(model weights) and ``epoch_{e:03d}.json`` (metrics), plus ``optimizer_{e:03d}.safetensors`` for the latest two epochs
(so a run whose last checkpoint was damaged can continue from the one before, when asked). Everything is written
atomically and the epoch's JSON last, so an epoch counts as done exactly when its JSON exists; one process at a time
writes a folder (an advisory lock). Batches of epoch e
are shuffled by a generator seeded with (seed, e) (or taken in order without shuffling), so a resumed run continues
exactly as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from softmoe.checkpoint import CorruptFileError, load_tensors, read_json, run_lock, save_tensors, write_json
from softmoe.data import ImageDataset, Splits, batches
from softmoe.distributed import (
    LOCAL,
    DistContext,
    full_optimizer_tensors,
    full_state_dict,
    load_full_optimizer_tensors,
    unwrap,
)


@dataclass(frozen=True)
class TrainConfig:
    """Appendix E.1 of the paper: Adam (default betas), constant lr 1e-3, batch 256, 15 epochs.

    shuffle: reshuffle the training set every epoch (False: in stored order every epoch, as the authors' code).
    frozen_first_epoch: epoch 1 runs the forward passes but takes no optimizer step (the authors' code does this,
        so its 15 epochs make 14 of updates).
    """

    epochs: int = 15
    batch_size: int = 256
    lr: float = 1e-3
    seed: int = 0
    shuffle: bool = True
    frozen_first_epoch: bool = False

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"epochs and batch_size must be >= 1 and lr > 0, got {self}")


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The shuffling generator of one epoch, independent of how the run got there."""
    return torch.Generator().manual_seed(seed * 100_003 + epoch)


@torch.no_grad()
def accuracy(model: nn.Module, data: ImageDataset, batch_size: int = 1024, dist: DistContext = LOCAL) -> float:
    """Top-1 accuracy of ``model`` on ``data`` in eval mode (the caller's selection context applies).

    In a distributed run every rank scores its part of each batch and the counts are summed (collective).
    """
    was_training = model.training
    model.eval()
    correct = 0
    for images, labels, _ in dist.shard_batches(batches(data, batch_size)):
        correct += int((model(images).argmax(dim=1) == labels).sum())
    model.train(was_training)
    return dist.reduce(correct=correct)["correct"] / max(1, len(data))


def finished_epochs(run_dir: str | Path) -> list[dict]:
    """Metrics of the epochs completed in ``run_dir``, in order (an empty list for a new run)."""
    run_dir = Path(run_dir)
    found = []
    epoch = 1
    while (run_dir / f"epoch_{epoch:03d}.json").exists():
        found.append(read_json(run_dir / f"epoch_{epoch:03d}.json"))
        epoch += 1
    return found


def load_epoch(model: nn.Module, run_dir: str | Path, epoch: int) -> nn.Module:
    """Load the weights saved at the end of ``epoch`` into ``model`` and return it."""
    path = Path(run_dir) / f"epoch_{epoch:03d}.safetensors"
    try:
        model.load_state_dict(load_tensors(path))
    except RuntimeError as error:
        first = str(error).strip().splitlines()[-1].strip()
        raise ValueError(
            f"{path} does not fit this model ({first}); it belongs to another configuration: use another folder"
        ) from None
    return model


RUN_FILE = "run.json"


def run_identity(recipe: dict, splits: Splits, model: dict | None = None) -> dict:
    """What defines a run folder: the caller's description of the model, the recipe (a training config as a dict;
    all of it but the epoch count, which a resumed run may raise) and the data (its name, sizes and
    :meth:`Splits.fingerprint`)."""
    recipe = {key: value for key, value in recipe.items() if key != "epochs"}
    sizes = [len(part) for part in splits]
    return {
        "model": model or {},
        "train": recipe,
        "data": {"name": splits.train.name, "sizes": sizes, "fingerprint": splits.fingerprint()},
    }


def differences(stored: dict, wanted: dict, prefix: str = "") -> list[str]:
    """``"key: stored -> wanted"`` for every leaf where two nested dicts differ."""
    found = []
    for key in sorted(set(stored) | set(wanted), key=str):
        a, b = stored.get(key, "(absent)"), wanted.get(key, "(absent)")
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return found


@contextlib.contextmanager
def claimed_run_folder(run_dir: Path, identity: dict | None, dist: DistContext = LOCAL) -> Iterator[None]:
    """On rank 0: hold ``run_dir``'s lock for the block, after refusing (:func:`check_run_folder`) a folder of another
    run and recording ``identity`` in a new one. A refusal on rank 0 is raised on every rank (collective)."""
    with contextlib.ExitStack() as stack:
        problem = None
        if dist.is_main:
            try:
                stack.enter_context(run_lock(run_dir))
                check_run_folder(run_dir, identity)
                if not (run_dir / RUN_FILE).exists():
                    write_json(run_dir / RUN_FILE, identity)
            except (ValueError, OSError) as error:
                problem = error
        message = dist.broadcast_object(None if problem is None else str(problem))
        if problem is not None:
            raise problem
        if message is not None:
            raise ValueError(message)
        yield


def check_run_folder(run_dir: Path, identity: dict) -> None:
    """Raise a ValueError, before anything is written, unless ``run_dir`` is new or was made with ``identity``."""
    path = run_dir / RUN_FILE
    if path.exists():
        changed = differences(read_json(path), identity)
        if changed:
            raise ValueError(
                f"{run_dir} holds a run of another configuration ({'; '.join(changed[:4])}); use another folder"
            )
    elif (run_dir / "epoch_001.json").exists():
        raise ValueError(f"{run_dir} holds epochs but no {RUN_FILE} saying how they were trained; use another folder")


def _resume(model: nn.Module, run_dir: Path, history: list[dict], config: TrainConfig, last_good: bool):
    """Load the last epoch's weights (and optimizer state when training goes on) into ``model``.

    Returns (history, optimizer tensors or None). A damaged last checkpoint raises, naming the file, unless
    ``last_good``: then that epoch's files are removed and the one before is tried, down to a fresh start.
    """
    while history:
        epoch = len(history)
        try:
            load_epoch(model, run_dir, epoch)
            optimizer = None
            if epoch < config.epochs:
                optimizer = load_tensors(run_dir / f"optimizer_{epoch:03d}.safetensors")
            return history, optimizer
        except (CorruptFileError, FileNotFoundError) as error:
            problem = f"{error.filename}: not found" if isinstance(error, FileNotFoundError) else str(error)
            if not last_good:
                raise CorruptFileError(
                    f"{problem}; the last checkpoint of {run_dir} (epoch {epoch}) is unusable: run again with "
                    "--resume-last-good (resume_last_good=True) to continue from the epoch before"
                ) from None
            for name in (f"epoch_{epoch:03d}.json", f"epoch_{epoch:03d}.safetensors", f"optimizer_{epoch:03d}.safetensors"):
                (run_dir / name).unlink(missing_ok=True)
            history = history[:-1]
    return history, None


def train_classifier(
    model_factory: Callable[[], nn.Module],
    splits: Splits,
    config: TrainConfig,
    run_dir: str | Path,
    progress: bool = True,
    description: str = "train",
    dist: DistContext | None = None,
    model_config: dict | None = None,
    resume_last_good: bool = False,
) -> tuple[nn.Module, list[dict]]:
    """Train (or resume, or just load) a classifier; returns the model at its last epoch and every epoch's metrics.

    ``model_factory`` builds the untrained model; it is called after seeding torch with ``config.seed`` so the
    initialization is reproducible. Each epoch's metrics: epoch, train_loss, val_accuracy, test_accuracy, seconds.
    A model that sets ``auxiliary_loss`` (a scalar tensor) in its training forward has it added to the loss.
    ``model_config`` (JSON-able) describes the model in ``run.json``; a folder made with another model, recipe or
    data is refused with a ValueError naming the differences (:func:`run_identity`). A damaged last checkpoint
    raises :class:`~softmoe.checkpoint.CorruptFileError` unless ``resume_last_good``.

    Under torchrun pass ``dist=softmoe.distributed.setup_distributed()``: every rank trains on its part of each
    global batch of ``config.batch_size`` (DDP, optionally expert parallel), and rank 0 alone reads and writes the
    run folder, whose checkpoints are those of a single process (so a run resumes with any world size).
    """
    dist = dist or LOCAL
    dist.local_batch_size(config.batch_size)  # the global batch must split evenly across ranks
    run_dir = Path(run_dir)
    identity = run_identity(asdict(config), splits, model_config) if dist.is_main else None
    with claimed_run_folder(run_dir, identity, dist):
        return _train(model_factory, splits, config, run_dir, progress, description, dist, resume_last_good)


def _train(model_factory, splits, config, run_dir, progress, description, dist, resume_last_good):
    """The body of :func:`train_classifier`, inside the run folder's lock."""
    torch.manual_seed(config.seed)
    model = model_factory()
    flat = None
    if dist.is_main:
        history, flat = _resume(model, run_dir, finished_epochs(run_dir), config, resume_last_good)
    history = dist.broadcast_object(history if dist.is_main else None)
    model = dist.prepare(model)  # every rank gets rank 0's weights
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    if history and len(history) < config.epochs:
        load_full_optimizer_tensors(model, optimizer, flat, src=0)
    steps = -(-len(splits.train) // config.batch_size)
    bar = tqdm(
        total=config.epochs * steps,
        initial=len(history) * steps,
        desc=description,
        disable=not progress or not dist.is_main,
        leave=False,
    )
    for epoch in range(len(history) + 1, config.epochs + 1):
        started = time.perf_counter()
        model.train()
        total_loss, seen = 0.0, 0
        generator = epoch_generator(config.seed, epoch) if config.shuffle else None
        epoch_batches = batches(splits.train, config.batch_size, config.shuffle, generator)
        frozen = config.frozen_first_epoch and epoch == 1
        for images, labels, count in dist.shard_batches(epoch_batches):
            with torch.set_grad_enabled(not frozen):
                loss_sum = F.cross_entropy(model(images), labels, reduction="sum")
            if not frozen:
                loss = dist.global_mean(loss_sum, count)  # the plain mean in one process
                auxiliary = getattr(unwrap(model), "auxiliary_loss", None)  # e.g. a sparse router's balancing losses
                if auxiliary is not None:
                    loss = loss + auxiliary
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            total_loss += float(loss_sum.detach())
            seen += labels.shape[0]
            bar.update(1)
        totals = dist.reduce(loss=total_loss, seen=seen)
        metrics = {
            "epoch": epoch,
            "train_loss": totals["loss"] / max(1, totals["seen"]),
            "val_accuracy": accuracy(model, splits.val, dist=dist),
            "test_accuracy": accuracy(model, splits.test, dist=dist),
            "seconds": time.perf_counter() - started,
        }
        bar.set_postfix(val=f"{metrics['val_accuracy']:.4f}")
        weights, optimizer_state = full_state_dict(model), full_optimizer_tensors(model, optimizer)  # collective
        if dist.is_main:
            save_tensors(run_dir / f"epoch_{epoch:03d}.safetensors", weights)
            save_tensors(run_dir / f"optimizer_{epoch:03d}.safetensors", optimizer_state)
            write_json(run_dir / f"epoch_{epoch:03d}.json", {**metrics, "config": asdict(config)})
            (run_dir / f"optimizer_{epoch - 2:03d}.safetensors").unlink(missing_ok=True)
        dist.barrier()
        history.append(metrics)
    bar.close()
    return unwrap(model), history
