"""Scale-out on torch.distributed, one concern per module, layered over the single-device core (``SoftMoE``, the
expert banks, the training loop) and using only torch.distributed (gloo on CPU, NCCL on GPU) under ``torchrun``:

- ``context``: torchrun set-up and :class:`DistContext` (:data:`LOCAL` in one process, whose helpers do nothing),
  which shards global batches, scales per-rank losses, sums metrics and wraps the model in DDP;
- ``communication``: the differentiable :func:`all_to_all` and its recorder;
- ``expert_parallel`` (explicit, never automatic): :func:`shard_experts` gives each rank a slice of every Soft MoE
  layer's experts (DTensors) and exchanges their slots with all_to_all; :func:`data_parallel` keeps the shards out
  of DDP's all-reduce; :func:`clip_grad_norm_` clips by the whole gradient's norm; the gradient convention;
- ``checkpoints``: the full single-process state through ``torch.distributed.checkpoint``, so a model trained on
  4 ranks loads on 1 and the other way round.
"""

from softmoe.distributed.checkpoints import (
    full_optimizer_tensors,
    full_state_dict,
    load_full_optimizer_tensors,
    load_full_state_dict,
)
from softmoe.distributed.communication import (
    CommunicationStats,
    all_to_all,
    record_communication,
)
from softmoe.distributed.context import (
    LOCAL,
    DistContext,
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
