"""Collectives: the differentiable all_to_all and the communication recorder.

The collectives the rest of the package builds on: a differentiable ``all_to_all`` (its backward is the
reverse exchange), the process-group queries, and the communication recorder the all_to_all benchmark reads
(off unless inside :func:`record_communication`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _active() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class CommunicationStats:
    """Time spent in the expert-parallel collectives while recording, summed over calls (seconds, on this rank).

    ``all_to_all_seconds`` covers the data exchanges only; with ``barrier=True`` every exchange is preceded by a
    barrier whose time (waiting for the slowest rank) goes to ``barrier_seconds`` instead. ``rows_seconds`` is the
    small all_gather of the row counts that precedes each forward exchange.
    """

    barrier: bool = False
    all_to_all_calls: int = 0
    all_to_all_seconds: float = 0.0
    all_to_all_bytes: int = 0
    rows_calls: int = 0
    rows_seconds: float = 0.0
    barrier_seconds: float = 0.0

    def reset(self) -> None:
        self.all_to_all_calls = self.rows_calls = self.all_to_all_bytes = 0
        self.all_to_all_seconds = self.rows_seconds = self.barrier_seconds = 0.0


_RECORDER: CommunicationStats | None = None


@contextmanager
def record_communication(barrier: bool = True) -> Iterator[CommunicationStats]:
    """Time every expert-parallel collective issued inside the block (CUDA work is synchronized around each)."""
    global _RECORDER
    previous, _RECORDER = _RECORDER, CommunicationStats(barrier=barrier)
    try:
        yield _RECORDER
    finally:
        _RECORDER = previous


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(kind: str, device: torch.device, group, nbytes: int, call) -> None:
    recorder = _RECORDER
    if recorder is None:
        call()
        return
    if recorder.barrier:
        _synchronize(device)
        start = time.perf_counter()
        dist.barrier(group=group)
        recorder.barrier_seconds += time.perf_counter() - start
    _synchronize(device)
    start = time.perf_counter()
    call()
    _synchronize(device)
    elapsed = time.perf_counter() - start
    if kind == "rows":
        recorder.rows_calls += 1
        recorder.rows_seconds += elapsed
    else:
        recorder.all_to_all_calls += 1
        recorder.all_to_all_seconds += elapsed
        recorder.all_to_all_bytes += nbytes


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    _timed(
        "all_to_all",
        x.device,
        group,
        x.numel() * x.element_size(),
        lambda: dist.all_to_all_single(out, x, output_splits, input_splits, group=group),
    )
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        # The reverse exchange: what rank r received from rank s goes back from r to s.
        return _exchange(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(
    x: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group=None,
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0: returns the received tensor; backward is the reverse exchange.

    Rows ``x[sum(input_split_sizes[:k]) : ...]`` go to group rank k; the result holds, in group rank order, the
    ``output_split_sizes[k]`` rows received from each rank k. Without split sizes, dim 0 is split equally (it must be
    divisible by the group size) and the result has the shape of ``x``. Every rank of ``group`` must call it, and,
    when the result takes part in a backward pass on one rank, on all of them.
    """
    size = _group_size(group)
    if input_split_sizes is None:
        if x.shape[0] % size:
            raise ValueError(f"all_to_all: dim 0 of size {x.shape[0]} is not divisible by the group size {size}")
        input_split_sizes = [x.shape[0] // size] * size
    if output_split_sizes is None:
        output_split_sizes = [x.shape[0] // size] * size
    input_split_sizes, output_split_sizes = [int(s) for s in input_split_sizes], [int(s) for s in output_split_sizes]
    if len(input_split_sizes) != size or len(output_split_sizes) != size:
        raise ValueError(f"all_to_all: split sizes must have one entry per rank ({size})")
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"all_to_all: input splits sum to {sum(input_split_sizes)}, dim 0 has {x.shape[0]} rows")
    return _AllToAll.apply(x, output_split_sizes, input_split_sizes, group)
