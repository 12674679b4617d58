"""Scale-out on torch.distributed: data parallel training and expert parallel Soft MoE layers, one concern per
module: ``context`` (torchrun set-up, the process-group context, DDP), ``communication`` (the differentiable
all_to_all and its recorder), ``expert_parallel`` (sharded expert banks), ``checkpoints`` (gathered and scattered
state through torch.distributed.checkpoint, so a model trained on 4 ranks loads on 1).

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
    Expert shards are DTensors (``Shard(0)`` over the group's device mesh) registered under the bank's own names,
    so ``torch.distributed.checkpoint``'s state-dict helpers see the unsharded model. :func:`full_state_dict` and
    :func:`full_optimizer_tensors` gather exactly the state of the single-process model (the same keys and shapes),
    so a checkpoint written on 4 ranks loads on 1 and the other way round; :func:`load_full_state_dict` and
    :func:`load_full_optimizer_tensors` give each rank its slice, from a full state present on every rank or
    broadcast from rank 0. :func:`clip_grad_norm_` clips by the norm of the whole gradient, shards included.
"""

from softmoe.distributed.communication import (
    CommunicationStats,
    all_to_all,
    record_communication,
)
from softmoe.distributed.context import (
    DistContext,
    LOCAL,
    local_batch_size,
    reduce_metrics,
    setup_distributed,
)
from softmoe.distributed.expert_parallel import (
    ExpertParallelExperts,
    clip_grad_norm_,
    data_parallel,
    expert_parallel_modules,
    shard_experts,
    unwrap,
)
from softmoe.distributed.checkpoints import (
    full_optimizer_tensors,
    full_state_dict,
    load_full_optimizer_tensors,
    load_full_state_dict,
)

__all__ = [
    "LOCAL",
    "CommunicationStats",
    "DistContext",
    "ExpertParallelExperts",
    "all_to_all",
    "clip_grad_norm_",
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
