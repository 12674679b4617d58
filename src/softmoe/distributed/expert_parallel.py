"""Expert parallelism: each rank holds a slice of every Soft MoE layer's experts.

:func:`shard_experts` replaces the expert bank of every ``SoftMoE`` layer of a model by an
:class:`ExpertParallelExperts` holding only this rank's slice of the stacked expert weights (``num_experts`` must
be divisible by the group size). In the forward pass every rank builds the slots of its local batch, one
``all_to_all`` sends each expert's slots to the rank that owns it, the local experts run batched on the slots of
the whole global batch, a second ``all_to_all`` returns the outputs and the combine is local. Both exchanges are
differentiable (:func:`all_to_all`, whose backward is the reverse exchange). :func:`data_parallel` wraps such a
model in DDP with the expert shards on DDP's ignore list, so DDP all-reduces the router and the rest of the model
but never the experts.

DDP averages the gradients of the replicated parameters over the ``W`` ranks, which makes the update that of the
mean of the per-rank losses. Through the all_to_all, an expert shard receives the sum over the ranks of the
gradients of their losses; :class:`ExpertParallelExperts` multiplies it by ``1 / W`` so that every parameter gets
the gradient of the same objective (the global-batch mean when each rank's loss is the mean of its own part, or
:meth:`DistContext.global_mean` when parts differ in size).
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.parallel import DistributedDataParallel

from softmoe.distributed.communication import _timed, all_to_all
from softmoe.experts import Experts, check_expert_input
from softmoe.layer import SoftMoE


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward pass, gradient times ``scale`` in the backward pass."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _stacked_tensors(experts: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) of the bank's own parameters and buffers, each with a leading expert axis."""
    num_experts = getattr(experts, "num_experts", None)
    dim = getattr(experts, "dim", None)
    if not isinstance(num_experts, int) or not isinstance(dim, int):
        raise TypeError(
            f"{type(experts).__name__} cannot be sharded: an expert bank needs int attributes num_experts and dim"
        )
    own: list[tuple[str, torch.Tensor, bool]] = [(n, t, True) for n, t in experts.named_parameters(recurse=False)]
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


class ExpertParallelExperts(nn.Module):
    """This rank's slice of a stacked expert bank, serving the slots of every rank of ``group`` via all_to_all.

    Same calling convention as the full bank: ``(num_experts, rows, dim) -> (num_experts, rows, dim)`` with the
    GLOBAL ``num_experts``; ``rows`` may differ between ranks (a smaller last batch, an empty shard). Rank k of the
    group owns experts ``[k * num_local_experts, (k + 1) * num_local_experts)``. Every rank of the group must call
    it together (and, when training, run the backward pass together).

    The bank's stacked tensors become this module's own, under the same names, as DTensors sharded along the expert
    axis over the group's device mesh (``Shard(0)``): the state dict has the keys and global shapes of the unsharded
    model, and ``torch.distributed.checkpoint`` gathers and scatters them (:mod:`softmoe.distributed.checkpoints`).
    The bank itself (child ``bank``) keeps no tensors; it runs on this rank's slices (``to_local``). With
    ``average_gradients`` the shard's gradients are divided by the group size, matching DDP's averaging of the
    replicated parameters (see the module docstring).

    Build it with :func:`shard_experts`, which validates the configuration on every rank first.
    """

    def __init__(self, experts: nn.Module, group=None, average_gradients: bool = True) -> None:
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("expert parallelism needs an initialized torch.distributed process group")
        tensors = _stacked_tensors(experts)
        # The bank's attributes as the Experts protocol types them (nn.Module's types them as tensors or modules);
        # _stacked_tensors has checked that num_experts and dim are ints.
        bank = cast(Experts, experts)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if bank.num_experts % size:
            raise ValueError(
                f"num_experts={bank.num_experts} is not divisible by the expert-parallel group size {size}"
            )
        self.group = group
        self.group_size, self.group_rank = size, rank
        self.num_experts, self.dim, self.out_dim = bank.num_experts, bank.dim, bank.out_dim
        self.num_local_experts = bank.num_experts // size
        self.expert_offset = rank * self.num_local_experts
        self.grad_scale = 1.0 / size if average_gradients else 1.0
        device = tensors[0][1].device if tensors else torch.device("cpu")
        mesh_group = group if group is not None else dist.group.WORLD
        assert mesh_group is not None  # the default group, set once torch.distributed is initialized (checked above)
        self.mesh = DeviceMesh.from_group(mesh_group, device.type)
        local = slice(self.expert_offset, self.expert_offset + self.num_local_experts)
        for name, tensor, is_parameter in tensors:
            piece = tensor.detach()[local].clone()
            sharded = DTensor.from_local(
                piece, self.mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride()
            )
            persistent = name not in experts._non_persistent_buffers_set
            delattr(experts, name)
            if is_parameter:
                self.register_parameter(name, nn.Parameter(sharded, requires_grad=tensor.requires_grad))
            else:
                self.register_buffer(name, sharded, persistent=persistent)
        bank.num_experts = self.num_local_experts
        self.bank = experts

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's slices of the bank's tensors (differentiable; gradients scaled by ``grad_scale``)."""
        scale = self.grad_scale if torch.is_grad_enabled() else 1.0
        local = {}
        # Every tensor of this module is one of the DTensors registered in __init__ (typed as Parameter or Tensor).
        for name, p in self.named_parameters(recurse=False):
            shard = cast(DTensor, p).to_local()
            local[name] = shard if scale == 1.0 else _ScaleGrad.apply(shard, scale)
        for name, b in self.named_buffers(recurse=False):
            local[name] = cast(DTensor, b).to_local()
        return local

    def _rows_of_group(self, rows: int, device: torch.device) -> list[int]:
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        gathered = [torch.empty_like(mine) for _ in range(self.group_size)]
        _timed("rows", device, self.group, 0, lambda: dist.all_gather(gathered, mine, group=self.group))
        return torch.cat(gathered).tolist()  # one device sync

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
        out = torch.func.functional_call(self.bank, self.local_tensors(), (slots,))
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


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models whose expert shards are DTensors; returns the total norm.

    The norm is that of the whole, unsharded gradient (each shard's norm is reduced over its mesh), so every rank
    scales by the same factor and the update equals the single-process one. Without sharded gradients it is
    torch's function.
    """
    parameters = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in parameters]
    if not any(isinstance(g, DTensor) for g in grads):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    norms = [torch.linalg.vector_norm(g) for g in grads]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(scale)
    return total


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
    experts = layer.get_submodule("experts")  # the bank as the nn.Module it is
    shapes = tuple((n, tuple(t.shape), str(t.dtype)) for n, t in experts.state_dict().items())
    return (name, layer.dim, layer.num_experts, layer.slots_per_expert, type(experts).__name__, shapes)


def shard_experts(model: nn.Module, group=None, *, average_gradients: bool = True, sync: bool = True) -> nn.Module:
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
            _stacked_tensors(layer.get_submodule("experts"))
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
                for _, tensor, _ in _stacked_tensors(layer.get_submodule("experts")):
                    dist.broadcast(tensor.detach(), group=group, group_src=0)
        layer.experts = ExpertParallelExperts(layer.get_submodule("experts"), group, average_gradients)
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
                    problems.append(f"rank {rank} shards over ranks {members} but rank {other} shards over {theirs}")
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
        ignore += [_join(name, n) for n, _ in module.named_parameters(recurse=False)]
        ignore += [_join(name, n) for n, _ in module.named_buffers(recurse=False)]
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignore)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    device_ids = None
    if device.type == "cuda":
        device_ids = [device.index if device.index is not None else torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, process_group=process_group, **ddp_kwargs)
