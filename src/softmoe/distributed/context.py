"""torchrun set-up and the process-group context that one training loop uses on 1 or many ranks.

:func:`setup_distributed` reads torchrun's environment and returns a :class:`DistContext` (rank, world size,
device, ``is_main``); without torchrun it returns the single-process context :data:`LOCAL`, whose helpers do
nothing, so one training loop serves both. The context shards every global batch across ranks
(:meth:`DistContext.shard`), turns a per-rank loss sum into the loss whose DDP-averaged gradient is the gradient of
the mean over the global batch (:meth:`DistContext.global_mean`), sums metrics over ranks
(:func:`reduce_metrics`), and wraps the model (:meth:`DistContext.prepare`).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from softmoe.distributed.communication import _active, _collective_device
from softmoe.distributed.expert_parallel import data_parallel, shard_experts

DEFAULT_TIMEOUT_S = 600.0


def local_batch_size(global_batch_size: int, world_size: int) -> int:
    """The per-rank batch size: ``global // world``; a ValueError unless it divides exactly."""
    if global_batch_size % world_size:
        raise ValueError(
            f"the batch size {global_batch_size} is the global batch and must be divisible by the number of ranks "
            f"{world_size} (each rank gets batch_size / ranks examples); use a multiple of {world_size}"
        )
    return global_batch_size // world_size


def reduce_metrics(sums: Mapping[str, float | int], device: torch.device | str | None = None) -> dict[str, float | int]:
    """Sum each value over all ranks (one float64 all_reduce); ints stay ints. Identity in a single process."""
    if not _active():
        return dict(sums)
    keys = list(sums)
    device = torch.device(device) if device is not None else _collective_device()
    values = torch.tensor([float(sums[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return {k: round(v) if isinstance(sums[k], int) else v for k, v in zip(keys, values.tolist())}


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a torchrun job; :data:`LOCAL` is the single-process context.

    Every helper is collective in a distributed run (all ranks call it in the same order) and a no-op, or the
    obvious single-process operation, in :data:`LOCAL`.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    expert_parallel: bool = False

    @property
    def is_main(self) -> bool:
        """True on the rank that writes checkpoints, reports and progress bars (rank 0)."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def local_batch_size(self, global_batch_size: int) -> int:
        """The per-rank batch size (global // world); a ValueError unless divisible."""
        return local_batch_size(global_batch_size, self.world_size)

    def shard(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This rank's part of a global batch: contiguous chunks of dim 0, moved to the device.

        A global batch divisible by the world size gives every rank exactly global // world examples (the
        DistributedSampler split without padding); otherwise sizes differ by at most one (a last, smaller batch),
        which :meth:`global_mean` accounts for. Ranks may get empty parts.
        """
        return tuple(t.tensor_split(self.world_size)[self.rank].to(self.device) for t in tensors)

    def shard_batches(
        self, batches: Iterable[tuple[torch.Tensor, ...]]
    ) -> Iterator[tuple[*tuple[torch.Tensor, ...], int]]:
        """Shard each global batch of ``batches``; yields this rank's tensors followed by the global batch size.

        Every rank must iterate the same global batches (same seed and generator), as ``softmoe.data.batches``
        does with the epoch's generator.
        """
        for batch in batches:
            yield (*self.shard(*batch), batch[0].shape[0])

    def global_mean(self, loss_sum: torch.Tensor, global_count: int) -> torch.Tensor:
        """The per-rank loss whose DDP-averaged gradient is the gradient of the mean over the global batch.

        ``loss_sum`` is this rank's sum of per-example losses; returns ``loss_sum * world / global_count``, which is
        the ordinary mean in a single process.
        """
        return loss_sum / (global_count / self.world_size)

    def reduce(self, **sums: float | int) -> dict[str, float | int]:
        """:func:`reduce_metrics` on this context's device: ``ctx.reduce(loss=..., seen=...)``.

        The identity for a single-process context, even inside a process group (rank 0 working alone).
        """
        if not self.is_distributed:
            return dict(sums)
        return reduce_metrics(sums, self.device if self.backend == "nccl" else None)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (picklable objects)."""
        if not self.is_distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=_collective_device())
        return box[0]

    def barrier(self) -> None:
        if self.is_distributed:
            dist.barrier()

    def prepare(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device; in a distributed run shard its experts (if ``expert_parallel``) and wrap it
        in DDP. Every rank ends up with rank 0's weights (DDP broadcasts them; sharding broadcasts the experts)."""
        model = model.to(self.device)
        if not self.is_distributed:
            return model
        if self.expert_parallel:
            shard_experts(model)
        return data_parallel(model, self.device)

    def close(self) -> None:
        """Destroy the process group (call once, at the end of the job)."""
        if self.is_distributed and dist.is_initialized():
            dist.destroy_process_group()


LOCAL = DistContext()


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"environment variable {name} is not set: launch with torchrun")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"environment variable {name} must be an integer, got {value!r}") from None


def setup_distributed(
    backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, expert_parallel: bool = False
) -> DistContext:
    """Initialize torch.distributed from torchrun's environment and return this process's :class:`DistContext`.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR / MASTER_PORT through ``init_method="env://"``). Without
    torchrun (no WORLD_SIZE) or with one process, nothing is initialized and a single-process context is returned.
    The backend defaults to NCCL when CUDA is available (device cuda:LOCAL_RANK) and gloo otherwise (CPU). Any
    collective that waits longer than ``timeout_s`` fails instead of hanging. ``expert_parallel`` makes
    :meth:`DistContext.prepare` shard the experts of every SoftMoE layer.
    """
    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        return DistContext(expert_parallel=expert_parallel)
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        backend = dist.get_backend()
    else:
        rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
        if world < 1 or not 0 <= rank < world:
            raise RuntimeError(f"invalid torchrun environment: RANK={rank}, WORLD_SIZE={world}")
        if world == 1:
            return DistContext(expert_parallel=expert_parallel)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in os.environ:
                raise RuntimeError(f"environment variable {name} is not set: launch with torchrun")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA devices: use "
                "--nproc_per_node <= the number of GPUs"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method="env://", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
        )
    return DistContext(rank, world, local_rank, device, backend, expert_parallel)
