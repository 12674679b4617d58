"""Run folders: what a training run leaves on disk, how it is claimed, checked and resumed.

    run.json                        what defines the run (:func:`run_identity`); a folder is never resumed under
                                    another run
    epoch_{e:03d}.safetensors       model weights (buffers included) at the end of epoch e
    optimizer_{e:03d}.safetensors   optimizer state, for the latest two epochs (so a run whose last checkpoint was
                                    damaged can continue from the one before, when asked)
    epoch_{e:03d}.json              the epoch's metrics, the config and the schedule state; written LAST, so an epoch
                                    is finished exactly when its JSON exists
    metrics.csv                     one row per finished epoch
    .lock                           one process at a time writes a folder (an advisory lock naming the holder)

Everything is written atomically (:mod:`softmoe.checkpoint`).
"""

from __future__ import annotations

import contextlib
import csv
import io
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from softmoe.checkpoint import CorruptFileError, atomic_write, load_tensors, read_json, run_lock, write_json
from softmoe.data import Splits
from softmoe.distributed import LOCAL, DistContext

RUN_FILE = "run.json"
METRICS = ("epoch", "lr", "train_loss", "val_accuracy", "test_accuracy", "seconds")


def finished_epochs(run_dir: str | Path) -> list[dict]:
    """What each completed epoch of ``run_dir`` wrote to its JSON, in order (an empty list for a new run)."""
    run_dir = Path(run_dir)
    found = []
    epoch = 1
    while (run_dir / f"epoch_{epoch:03d}.json").exists():
        found.append(read_json(run_dir / f"epoch_{epoch:03d}.json"))
        epoch += 1
    return found


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def load_epoch(model: ModuleT, run_dir: str | Path, epoch: int) -> ModuleT:
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


def run_identity(recipe: dict, splits: Splits, model: dict | None = None) -> dict:
    """What defines a run folder: the caller's description of the model, the training recipe (a dict; leave out
    what a resumed run may change) and the data (its name, sizes and :meth:`Splits.fingerprint`)."""
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


@contextlib.contextmanager
def claimed_run_folder(run_dir: Path, identity: dict | None, dist: DistContext = LOCAL) -> Iterator[None]:
    """On rank 0: hold ``run_dir``'s lock for the block, after refusing (:func:`check_run_folder`) a folder of another
    run and recording ``identity`` in a new one. A refusal on rank 0 is raised on every rank (collective)."""
    with contextlib.ExitStack() as stack:
        problem = None
        if dist.is_main:
            assert identity is not None  # rank 0 records the run (the other ranks pass None)
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


def resume(
    model: nn.Module, run_dir: Path, epochs: int, last_good: bool = False
) -> tuple[list[dict], dict[str, torch.Tensor] | None]:
    """Load the last finished epoch's weights into ``model``; returns (the finished epochs' JSON, the optimizer state
    saved with it, or None when the run is complete or new).

    A damaged last checkpoint raises :class:`CorruptFileError` naming the file, unless ``last_good``: then that
    epoch's files are removed and the one before is tried, down to a fresh start.
    """
    history = finished_epochs(run_dir)
    while history:
        epoch = len(history)
        try:
            load_epoch(model, run_dir, epoch)
            optimizer = load_tensors(run_dir / f"optimizer_{epoch:03d}.safetensors") if epoch < epochs else None
            return history, optimizer
        except (CorruptFileError, FileNotFoundError) as error:
            problem = f"{error.filename}: not found" if isinstance(error, FileNotFoundError) else str(error)
            if not last_good:
                raise CorruptFileError(
                    f"{problem}; the last checkpoint of {run_dir} (epoch {epoch}) is unusable: run again with "
                    "--resume-last-good (resume_last_good=True) to continue from the epoch before"
                ) from None
            for name in (
                f"epoch_{epoch:03d}.json",
                f"epoch_{epoch:03d}.safetensors",
                f"optimizer_{epoch:03d}.safetensors",
            ):
                (run_dir / name).unlink(missing_ok=True)
            history = history[:-1]
    return history, None


def write_metrics_csv(path: Path, history: list[dict]) -> None:
    """All finished epochs' metrics as CSV (columns :data:`METRICS`), written atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=METRICS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow(row)
    atomic_write(path, lambda temp: Path(temp).write_text(buffer.getvalue()))
