"""Scale-out on torch.distributed: data parallel training and expert parallel Soft MoE layers.

The core (``SoftMoE``, the expert banks, the training loop) stays single-device; everything here is layered on top
and uses only torch.distributed (gloo on CPU, NCCL on GPU) under ``torchrun``.

Data parallel
    :func:`setup_distributed` reads torchrun's environment and returns a :class:`DistContext` (rank, world size,
    device, ``is_main``); without torchrun it returns the single-process context :data:`LOCAL`, whose helpers do
    nothing, so one training loop serves both. The context shards every global batch across ranks
    (:meth:`DistContext.shard`), turns a per-rank loss sum into the loss whose DDP-averaged gradient is the gradient of
    the mean over the global batch (:meth:`DistContext.global_mean`), sums metrics over ranks
    (:func:`reduce_metrics`), and wraps the model (:meth:`DistContext.prepare`).

Expert parallel (explicit, never automatic)
    :func:`shard_experts` replaces the expert bank of every ``SoftMoE`` layer of a model by an
    :class:`ExpertParallelExperts` holding only this rank's slice of the stacked expert weights (``num_experts`` must
    be divisible by the group size). In the forward pass every rank builds the slots of its local batch, one
    ``all_to_all`` sends each expert's slots to the rank that owns it, the local experts run batched on the slots of
    the whole global batch, a second ``all_to_all`` returns the outputs and the combine is local. Both exchanges are
    differentiable (:func:`all_to_all`, whose backward is the reverse exchange). :func:`data_parallel` wraps such a
    model in DDP with the expert shards on DDP's ignore list, so DDP all-reduces the router and the rest of the model
    but never the experts.

Gradient convention
    DDP averages the gradients of the replicated parameters over the ``W`` ranks, which makes the update that of the
    mean of the per-rank losses. Through the all_to_all, an expert shard receives the sum over the ranks of the
    gradients of their losses; :class:`ExpertParallelExperts` multiplies it by ``1 / W`` so that every parameter gets
    the gradient of the same objective (the global-batch mean when each rank's loss is the mean of its own part, or
    :meth:`DistContext.global_mean` when parts differ in size).

Checkpoints
    :func:`full_state_dict` and :func:`full_optimizer_tensors` gather the shards into exactly the state of the
    unsharded single-process model (the same keys and shapes), so a checkpoint written on 4 ranks loads on 1 and
    the other way round; :func:`load_full_state_dict` and :func:`load_full_optimizer_tensors` give each rank its
    slice, either from a full state present on every rank or scattered from one rank.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from softmoe.backends import ReferenceOnly
from softmoe.checkpoint import load_optimizer_tensors, optimizer_tensors
from softmoe.experts import check_expert_input
from softmoe.layer import SoftMoE

__all__ = [
    "LOCAL",
    "CommunicationStats",
    "DistContext",
    "ExpertParallelExperts",
    "all_to_all",
    "data_parallel",
    "expert_parallel_modules",
    "full_optimizer_tensors",
    "full_state_dict",
    "load_full_optimizer_tensors",
    "load_full_state_dict",
    "local_batch_size",
    "record_communication",
    "reduce_metrics",
    "setup_distributed",
    "shard_experts",
    "unwrap",
]

DEFAULT_TIMEOUT_S = 600.0


def _active() -> bool:
    """True inside an initialized process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


# ---------------------------------------------------------------------------------------------------------------------
# Communication timing (for the benchmark; off unless inside ``record_communication``)


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


# ---------------------------------------------------------------------------------------------------------------------
# Differentiable all_to_all


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
    def forward(ctx, x, output_splits, input_splits, group):  # noqa: D102
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
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


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward pass, gradient times ``scale`` in the backward pass."""

    @staticmethod
    def forward(ctx, x, scale):  # noqa: D102
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return grad * ctx.scale, None


# ---------------------------------------------------------------------------------------------------------------------
# Expert parallel


def _stacked_tensors(experts: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) of the bank's own parameters and buffers, each with a leading expert axis."""
    num_experts = getattr(experts, "num_experts", None)
    dim = getattr(experts, "dim", None)
    if not isinstance(num_experts, int) or not isinstance(dim, int):
        raise TypeError(
            f"{type(experts).__name__} cannot be sharded: an expert bank needs int attributes num_experts and dim"
        )
    own = [(n, t, True) for n, t in experts.named_parameters(recurse=False)]
    own += [(n, t, False) for n, t in experts.named_buffers(recurse=False)]
    nested = [n for n, _ in experts.named_parameters()] + [n for n, _ in experts.named_buffers()]
    if len(nested) != len(own):
        raise TypeError(
            f"{type(experts).__name__} cannot be sharded: its parameters and buffers must be stacked tensors held "
            f"directly by the bank (as in MLPExperts and StackedExperts), found submodule tensors"
        )
    for name, tensor, _ in own:
        if tensor.dim() == 0 or tensor.shape[0] != num_experts:
            raise TypeError(
                f"{type(experts).__name__}.{name} of shape {tuple(tensor.shape)} has no leading expert axis of size "
                f"num_experts={num_experts}"
            )
    return own


class ExpertParallelExperts(ReferenceOnly, nn.Module):
    """This rank's slice of a stacked expert bank, serving the slots of every rank of ``group`` via all_to_all.

    Same calling convention as the full bank: ``(num_experts, rows, dim) -> (num_experts, rows, dim)`` with the
    GLOBAL ``num_experts``; ``rows`` may differ between ranks (a smaller last batch, an empty shard). Rank k of the
    group owns experts ``[k * num_local_experts, (k + 1) * num_local_experts)``. Every rank of the group must call
    it together (and, when training, run the backward pass together).

    The local bank is kept as the child module ``shard`` (the original bank, sliced in place), so its parameters are
    named ``<layer>.experts.shard.<name>``; :func:`full_state_dict` maps them back to ``<layer>.experts.<name>``.
    With ``average_gradients`` the shard's gradients are divided by the group size, matching DDP's averaging of the
    replicated parameters (see the module docstring).

    Build it with :func:`shard_experts`, which validates the configuration on every rank first.
    """

    def __init__(self, experts: nn.Module, group=None, average_gradients: bool = True) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("expert parallelism needs an initialized torch.distributed process group")
        tensors = _stacked_tensors(experts)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if experts.num_experts % size:
            raise ValueError(
                f"num_experts={experts.num_experts} is not divisible by the expert-parallel group size {size}"
            )
        self.group = group
        self.reference_reason = "sharded experts (ExpertParallelExperts) exchange the slots with all_to_all"
        self.group_size, self.group_rank = size, rank
        self.num_experts, self.dim, self.out_dim = experts.num_experts, experts.dim, experts.out_dim
        self.num_local_experts = experts.num_experts // size
        self.expert_offset = rank * self.num_local_experts
        self.grad_scale = 1.0 / size if average_gradients else 1.0
        local = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
        for name, tensor, is_parameter in tensors:
            piece = tensor.detach()[local].clone()
            if is_parameter:
                setattr(experts, name, nn.Parameter(piece, requires_grad=tensor.requires_grad))
            else:
                experts.register_buffer(name, piece, persistent=name not in experts._non_persistent_buffers_set)
        experts.num_experts = self.num_local_experts
        self.shard = experts

    def _rows_of_group(self, rows: int, device: torch.device) -> list[int]:
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.group_size)]
        _timed("rows", device, self.group, 0, lambda: dist.all_gather(gathered, mine, group=self.group))
        return torch.cat(gathered).tolist()  # one device sync

    def _run_local(self, slots: torch.Tensor) -> torch.Tensor:
        if self.grad_scale == 1.0 or not torch.is_grad_enabled():
            return self.shard(slots)
        params = {name: _ScaleGrad.apply(p, self.grad_scale) for name, p in self.shard.named_parameters()}
        return torch.func.functional_call(self.shard, params, (slots,))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (num_experts, rows, dim) slots of this rank, grouped by expert -> expert outputs, same shape."""
        check_expert_input(x, self.num_experts, self.dim)
        if torch.is_grad_enabled() and not x.requires_grad:
            # Every rank must take part in both backward exchanges, whatever requires grad where.
            x = x.detach().requires_grad_()
        size, local, dim = self.group_size, self.num_local_experts, self.dim
        rows = x.shape[1]
        group_rows = self._rows_of_group(rows, x.device)
        send_sizes = [local * rows * dim] * size
        recv_sizes = [local * r * dim for r in group_rows]
        received = all_to_all(x.reshape(-1), recv_sizes, send_sizes, self.group)
        pieces = [piece.view(local, r, dim) for piece, r in zip(received.split(recv_sizes), group_rows)]
        slots = pieces[0] if size == 1 else torch.cat(pieces, dim=1)  # (local experts, rows of all ranks, dim)
        out = self._run_local(slots)
        back = torch.cat([piece.reshape(-1) for piece in out.split(group_rows, dim=1)])
        returned = all_to_all(back, send_sizes, recv_sizes, self.group)
        return returned.view(self.num_experts, rows, dim)

    def forward_selected(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "expert selection (select_experts / forward_selected) is not supported on sharded experts; save the "
            "model with full_state_dict and evaluate it in one process"
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local_experts=[{self.expert_offset}, "
            f"{self.expert_offset + self.num_local_experts}), group_size={self.group_size}"
        )


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (the model itself otherwise)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def expert_parallel_modules(model: nn.Module) -> list[tuple[str, ExpertParallelExperts]]:
    """(qualified name, module) of every sharded expert bank in ``model`` (DDP wrappers are looked through)."""
    return [(name, m) for name, m in unwrap(model).named_modules() if isinstance(m, ExpertParallelExperts)]


def _group_members(group) -> list[int] | None:
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _layer_signature(name: str, layer: SoftMoE) -> tuple:
    experts = layer.experts
    shapes = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in experts.state_dict().items())
    return (name, layer.dim, layer.num_experts, layer.slots_per_expert, type(experts).__name__, shapes)


def shard_experts(
    model: nn.Module, group=None, *, average_gradients: bool = True, sync: bool = True
) -> nn.Module:
    """Shard the experts of every ``SoftMoE`` layer of ``model`` across the ranks of ``group`` (default: all ranks).

    Collective over the default group: every rank must call it, before wrapping the model in DDP
    (:func:`data_parallel`). The configuration is checked on every rank from the gathered configurations of all
    ranks, so a bad one (num_experts not divisible by the group size, a rank outside its group, groups or models
    that differ between ranks) raises the same ValueError on every rank instead of hanging a collective. With
    ``sync`` the full expert weights are first broadcast from the group's first rank, so every rank slices the same
    experts (DDP does the same for the replicated parameters). Layers then always take the slot path. Returns
    ``model``, modified in place.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "shard_experts needs an initialized torch.distributed process group: run under torchrun and call "
            "softmoe.distributed.setup_distributed() first"
        )
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, SoftMoE)]
    problem = None
    try:  # problems found on one rank are reported on every rank, so no rank is left waiting in a collective
        if isinstance(model, DistributedDataParallel):
            raise ValueError("shard_experts must be called before wrapping the model in DistributedDataParallel")
        if not layers:
            raise ValueError(f"{type(model).__name__} has no SoftMoE layer")
        for name, layer in layers:
            if isinstance(layer.experts, ExpertParallelExperts):
                raise ValueError(f"the experts of layer {name or '<model>'!r} are already sharded")
            _stacked_tensors(layer.experts)
        signatures = [_layer_signature(name, layer) for name, layer in layers]
    except (TypeError, ValueError) as error:
        problem, signatures = str(error), None
    mine = {"problem": problem, "members": _group_members(group), "layers": signatures}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [f"rank {rank}: {info['problem']}" for rank, info in enumerate(everyone) if info["problem"]]
    if failed:
        raise ValueError("shard_experts: " + "; ".join(failed))
    _check_expert_parallel_config(everyone)
    for _, layer in layers:
        if sync:
            with torch.no_grad():
                for _, tensor, _ in _stacked_tensors(layer.experts):
                    dist.broadcast(tensor.detach(), group=group, group_src=0)
        layer.experts = ExpertParallelExperts(layer.experts, group, average_gradients)
    return model


def _check_expert_parallel_config(everyone: list[dict]) -> None:
    """Raise the same ValueError on every rank for any inconsistency in the gathered per-rank configurations."""
    problems = []
    for rank, info in enumerate(everyone):
        members = info["members"]
        if members is None:
            problems.append(f"rank {rank} is not a member of the process group it passed")
        elif rank not in members:
            problems.append(f"rank {rank} is not in its group {members}")
        else:
            for other in members:
                theirs = everyone[other]["members"] if other < len(everyone) else None
                if theirs != members:
                    problems.append(
                        f"rank {rank} shards over ranks {members} but rank {other} shards over {theirs}"
                    )
                    break
    if problems:
        raise ValueError("expert-parallel groups do not match across ranks: " + "; ".join(problems))
    reference = everyone[0]["layers"]
    for rank, info in enumerate(everyone):
        if info["layers"] != reference:
            raise ValueError(
                "the model's SoftMoE layers differ across ranks (name, dim, num_experts, slots_per_expert, experts, "
                f"tensor shapes): rank 0 has {reference}, rank {rank} has {info['layers']}"
            )
    for size in sorted({len(info["members"]) for info in everyone}):
        for name, _, num_experts, *_ in reference:
            if num_experts % size:
                raise ValueError(
                    f"layer {name or '<model>'!r}: num_experts={num_experts} is not divisible by the expert-parallel "
                    f"group size {size}; use a number of experts that is a multiple of the number of ranks"
                )


def data_parallel(model: nn.Module, device: torch.device | str | None = None, process_group=None, **ddp_kwargs):
    """Wrap ``model`` in DistributedDataParallel, leaving sharded experts out of DDP's gradient all-reduce.

    The parameters and buffers of every :class:`ExpertParallelExperts` are put on DDP's ignore list
    (``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), so DDP neither broadcasts them at
    construction nor all-reduces their gradients; the router and the rest of the model are replicated and
    all-reduced as usual. Expert shards must be spread over the same ranks as the data parallel group (an expert
    replicated on several ranks would need its own all-reduce). Extra keyword arguments go to DDP.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("data_parallel needs an initialized torch.distributed process group")
    world = dist.get_world_size(process_group)
    ignore = []
    for name, module in expert_parallel_modules(model):
        if module.group_size != world:
            raise ValueError(
                f"{name}: experts are sharded over {module.group_size} ranks but data parallelism spans {world}; "
                "shard the experts over the data parallel group (expert replicas would not be synchronized)"
            )
        ignore += [_join(name, f"shard.{n}") for n, _ in module.shard.named_parameters()]
        ignore += [_join(name, f"shard.{n}") for n, _ in module.shard.named_buffers()]
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, process_group=process_group, **ddp_kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# Full checkpoints from sharded experts


def _shard_keys(module: nn.Module) -> dict[str, tuple[str, ExpertParallelExperts]]:
    """Full-model key -> (sharded key, module) for every tensor of every sharded expert bank."""
    keys = {}
    for name, m in expert_parallel_modules(module):
        for local_key in m.shard.state_dict():
            keys[_join(name, local_key)] = (_join(name, f"shard.{local_key}"), m)
    return keys


def _gather_shards(tensor: torch.Tensor, module: ExpertParallelExperts, rank0_only: bool) -> torch.Tensor | None:
    tensor = tensor.detach().contiguous()
    if module.group_size == 1:
        return tensor.clone()
    if rank0_only:
        pieces = [torch.empty_like(tensor) for _ in range(module.group_size)] if module.group_rank == 0 else None
        dist.gather(tensor, pieces, group=module.group, group_dst=0)
        return torch.cat(pieces) if pieces is not None else None
    pieces = [torch.empty_like(tensor) for _ in range(module.group_size)]
    dist.all_gather(pieces, tensor, group=module.group)
    return torch.cat(pieces)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded, unwrapped model: the same keys and shapes as the single-process model.

    Expert shards are gathered (collective: every rank must call it when the model has sharded experts). With
    ``rank0_only`` the result is complete on global rank 0 and empty elsewhere; otherwise every rank gets it.
    """
    module = unwrap(model)
    state = module.state_dict()
    sharded = {local_key: (full_key, m) for full_key, (local_key, m) in _shard_keys(module).items()}
    keep = not rank0_only or _is_main()
    result = {}
    for key, value in state.items():
        if key in sharded:
            full_key, m = sharded[key]
            gathered = _gather_shards(value, m, rank0_only)
            if keep and gathered is not None:
                result[full_key] = gathered
        elif keep:
            result[key] = value
    return result


def _param_index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def _sharded_optimizer_entries(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[int, tuple[torch.Tensor, ExpertParallelExperts]]:
    """Optimizer parameter index -> (shard parameter, module) for every sharded expert parameter."""
    index = _param_index(optimizer)
    entries = {}
    for _, m in expert_parallel_modules(model):
        for p in m.shard.parameters():
            if id(p) in index:
                entries[index[id(p)]] = (p, m)
    return entries


def full_optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """:func:`softmoe.checkpoint.optimizer_tensors` of the unsharded model (collective under expert parallelism).

    Per-parameter state shaped like a sharded expert parameter (Adam's moments) is gathered along the expert axis;
    other state (Adam's step) is taken as is. Parameters are indexed in optimizer order, which sharding preserves,
    so the result loads into the optimizer of the single-process model.
    """
    flat = optimizer_tensors(optimizer)
    sharded = _sharded_optimizer_entries(model, optimizer)
    keep = not rank0_only or _is_main()
    result = {}
    for key in sorted(flat, key=_optimizer_key_order):
        value = flat[key]
        index = int(key.split(".", 2)[1])
        entry = sharded.get(index)
        if entry is not None and value.shape == entry[0].shape:
            gathered = _gather_shards(value, entry[1], rank0_only)
            if keep and gathered is not None:
                result[key] = gathered
        elif keep:
            result[key] = value
    return result


def _optimizer_key_order(key: str) -> tuple[int, str]:
    _, index, name = key.split(".", 2)
    return int(index), name


def _collective_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slice_for(full: torch.Tensor, module: ExpertParallelExperts, what: str) -> torch.Tensor:
    if full.dim() == 0 or full.shape[0] != module.num_experts:
        raise ValueError(
            f"{what}: expected a leading expert axis of size num_experts={module.num_experts}, got shape "
            f"{tuple(full.shape)}"
        )
    return full[module.expert_offset : module.expert_offset + module.num_local_experts]


def _distribute(
    state: Mapping[str, torch.Tensor] | None,
    src: int | None,
    shard_of: Callable[[str, tuple[int, ...]], ExpertParallelExperts | None],
) -> dict[str, torch.Tensor]:
    """A full flat state -> this rank's part: the expert slice of sharded entries (``shard_of(key, shape)``), the
    whole tensor otherwise. ``src=None``: ``state`` is on every rank (no communication); ``src=k``: it is on rank k
    only, sharded entries are scattered over their group and the others broadcast (collective)."""
    if src is None or not _active():
        if state is None:
            raise ValueError("a full state is needed on this rank (or pass src= the rank that has it)")
        local = {}
        for key, value in state.items():
            module = shard_of(key, tuple(value.shape))
            local[key] = value if module is None else _slice_for(value, module, key)
        return local
    is_src = dist.get_rank() == src
    if is_src and state is None:
        raise ValueError(f"rank {src} is the source of the state and must pass it")
    device = _collective_device()
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in state.items()] if is_src else None]
    dist.broadcast_object_list(meta, src=src, device=device)
    local = {}
    for key, shape, dtype in meta[0]:  # the same order, checks and collectives on every rank
        module = shard_of(key, shape)
        if module is None:
            if is_src:
                t = state[key].detach().to(device).contiguous().clone()
            else:
                t = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(t, src=src)
            local[key] = t
            continue
        if not shape or shape[0] != module.num_experts:
            raise ValueError(f"{key}: expected a leading expert axis of size {module.num_experts}, got shape {shape}")
        members = _group_members(module.group)
        if src not in members:
            raise ValueError(f"{key}: the source rank {src} is not in the expert-parallel group {members}")
        t = torch.empty((module.num_local_experts, *shape[1:]), dtype=dtype, device=device)
        chunks = list(state[key].detach().to(device).contiguous().chunk(module.group_size)) if is_src else None
        dist.scatter(t, chunks, group=module.group, group_src=members.index(src))
        local[key] = t
    return local


def load_full_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None, src: int | None = None, strict: bool = True
):
    """Load a full (unsharded) state dict into ``model``, each sharded expert bank taking its slice.

    ``src=None``: every rank passes the full state (for instance each read the checkpoint file); no communication.
    ``src=k``: only rank k passes it (others pass None); expert tensors are scattered (each rank receives only its
    experts) and the other tensors broadcast (collective). Returns what ``load_state_dict`` returns.
    """
    module = unwrap(model)
    keys = _shard_keys(module)
    local = _distribute(state, src, lambda key, shape: keys[key][1] if key in keys else None)
    for full_key, (local_key, _) in keys.items():
        if full_key in local:
            local[local_key] = local.pop(full_key)
    return module.load_state_dict(local, strict=strict)


def load_full_optimizer_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    flat: Mapping[str, torch.Tensor] | None,
    src: int | None = None,
) -> None:
    """Inverse of :func:`full_optimizer_tensors`: load the unsharded optimizer state, slicing sharded entries.

    ``src`` as in :func:`load_full_state_dict`. Works unchanged on a model without sharded experts (data parallel
    or single process), so a run resumes with any world size.
    """
    sharded = _sharded_optimizer_entries(model, optimizer)

    def shard_of(key: str, shape: tuple[int, ...]) -> ExpertParallelExperts | None:
        entry = sharded.get(int(key.split(".", 2)[1]))
        if entry is not None and len(shape) > 0 and shape[1:] == tuple(entry[0].shape[1:]):
            return entry[1]
        return None

    load_optimizer_tensors(optimizer, _distribute(flat, src, shard_of))


# ---------------------------------------------------------------------------------------------------------------------
# Data parallel


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
    return {k: int(round(v)) if isinstance(sums[k], int) else v for k, v in zip(keys, values.tolist())}


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
    ) -> Iterator[tuple[torch.Tensor, ...]]:
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
