"""Checkpoints of distributed models: the full single-process state, through ``torch.distributed.checkpoint``.

Sharded expert banks hold DTensors (:class:`~softmoe.distributed.ExpertParallelExperts`), so the state-dict helpers
of ``torch.distributed.checkpoint.state_dict`` gather them into exactly the state of the unsharded single-process
model (the same keys and shapes) and give each rank its slice on load: a checkpoint written on 4 ranks loads on 1
and the other way round. The same functions serve a data-parallel model and a single process (no process group).

Optimizer state travels as flat tensors keyed ``state.<parameter name>.<state name>`` (e.g.
``state.moe.phi.exp_avg``), which is what the training loop writes with safetensors; hyper-parameters come from
the optimizer as constructed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    DictValueType,
    ListDictValueType,
    OptimizerStateType,
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from softmoe.distributed.communication import _active, _collective_device
from softmoe.distributed.expert_parallel import unwrap


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded, unwrapped model: the same keys and shapes as the single-process model.

    Collective in a distributed run (every rank must call it). With ``rank0_only`` the result is complete, on the
    CPU, on global rank 0 and empty elsewhere; otherwise every rank gets it on its device.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    # A model's state: tensors (torch types the result as any state-dict value).
    return cast(dict[str, torch.Tensor], get_model_state_dict(unwrap(model), options=options))


def full_optimizer_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = True
) -> dict[str, torch.Tensor]:
    """The optimizer state of the unsharded model as flat tensors ``state.<parameter>.<name>`` (collective).

    ``rank0_only`` as in :func:`full_state_dict`. Non-tensor state (a plain step count) is stored as a 0-d tensor.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    # The "state" entry maps each parameter's name to its state (torch types it as any state-dict value).
    state = cast(
        dict[str, DictValueType], get_optimizer_state_dict(unwrap(model), optimizer, options=options).get("state", {})
    )
    return {
        f"state.{param}.{name}": value if torch.is_tensor(value) else torch.tensor(value)
        for param, entries in state.items()
        for name, value in entries.items()
    }


def _expected_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Key -> global shape of every entry of ``module``'s state dict (a DTensor's shape is the global one)."""
    return {key: tuple(value.shape) for key, value in module.state_dict().items()}


def _shape_problems(module: nn.Module, state: Mapping[str, torch.Tensor] | None) -> str | None:
    if state is None:
        return None
    expected = _expected_shapes(module)
    problems = [
        f"{key}: expected shape {expected[key]}, got {tuple(value.shape)}"
        for key, value in state.items()
        if key in expected and tuple(value.shape) != expected[key]
    ]
    return "; ".join(problems[:4]) or None


def _raise_everywhere(problem: str | None, from_rank0: bool) -> None:
    """Raise ``problem`` (found on rank 0 when ``from_rank0``) as a ValueError on every rank (collective)."""
    if from_rank0:
        box = [problem]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        problem = box[0]
    if problem is not None:
        raise ValueError(f"the checkpoint does not fit this model: {problem}")


def load_full_state_dict(
    model: nn.Module, state: Mapping[str, torch.Tensor] | None, from_rank0: bool = False, strict: bool = True
):
    """Load a full (unsharded) state dict into ``model``, each sharded expert bank taking its slice.

    ``from_rank0=False``: every rank passes the full state (for instance each read the checkpoint file).
    ``from_rank0=True``: only global rank 0 passes it (the others pass None) and it is broadcast (collective).
    A tensor of another shape than the model's raises the same ValueError on every rank, before anything loads.
    Returns what ``load_state_dict`` returns.
    """
    module = unwrap(model)
    from_rank0 = from_rank0 and _active()
    main = not from_rank0 or dist.get_rank() == 0
    if main and state is None:
        raise ValueError("a full state is needed on this rank (or pass from_rank0=True and the state on rank 0)")
    _raise_everywhere(_shape_problems(module, state) if main else None, from_rank0)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0, strict=strict)
    return set_model_state_dict(module, dict(state) if main and state is not None else {}, options=options)


def load_full_optimizer_tensors(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    flat: Mapping[str, torch.Tensor] | None,
    from_rank0: bool = False,
) -> None:
    """Inverse of :func:`full_optimizer_tensors`: load the unsharded optimizer state, each rank taking its slice.

    ``from_rank0`` as in :func:`load_full_state_dict`. Works unchanged on a data-parallel model and in a single
    process, so a run resumes with any world size.
    """
    module = unwrap(model)
    from_rank0 = from_rank0 and _active()
    main = not from_rank0 or dist.get_rank() == 0
    if main and flat is None:
        raise ValueError("a full optimizer state is needed on this rank (or pass from_rank0=True)")
    state_dict: OptimizerStateType = {}
    if main:
        assert flat is not None  # checked above
        names = {id(p): name for name, p in module.named_parameters()}
        groups: ListDictValueType = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
            for group in optimizer.param_groups
        ]
        state: dict[str, DictValueType] = {}
        for key, value in flat.items():
            param, name = key.removeprefix("state.").rsplit(".", 1)
            state.setdefault(param, {})[name] = value
        # A dict of DictValueType is a DictValueType, but dict's invariant value type keeps mypy from seeing it.
        state_dict = {"state": cast(DictValueType, state), "param_groups": groups}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    set_optimizer_state_dict(module, optimizer, state_dict, options=options)
