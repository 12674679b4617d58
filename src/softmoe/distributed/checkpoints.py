"""Checkpoints of expert-parallel models: the full single-process state, gathered on save and scattered on load.

:func:`full_state_dict` and :func:`full_optimizer_tensors` gather the shards into exactly the state of the
unsharded single-process model (the same keys and shapes), so a checkpoint written on 4 ranks loads on 1 and
the other way round; :func:`load_full_state_dict` and :func:`load_full_optimizer_tensors` give each rank its
slice, either from a full state present on every rank or scattered from one rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from softmoe.checkpoint import load_optimizer_tensors, optimizer_tensors
from softmoe.distributed.communication import _active, _collective_device
from softmoe.distributed.expert_parallel import (
    ExpertParallelExperts,
    _group_members,
    _join,
    expert_parallel_modules,
    unwrap,
)


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
