"""Routers of "Routers in Vision Mixture of Experts" (Liu, Blondel, Riquelme, Puigcerver) in one formulation.

A router maps a group of T tokens to dispatch and combine tensors (T, E, C) (equation 2); :class:`MoELayer` applies
any router with the project's batched experts. The routers follow the authors' code (google-research/vmoe): every
top-k breaks ties towards the lower index (:func:`softmoe.topk.top_k`). Modules, one concept each:

- :mod:`~softmoe.routing.formulation`: routing tensors (index form :class:`SparseRouting`, dense :class:`DenseRouting`),
  the eq. (2) reference :func:`dense_moe` and the gather / scatter path :func:`sparse_moe`;
- :mod:`~softmoe.routing.layer`: :class:`MoELayer` (grouping, auxiliary losses, statistics);
- :mod:`~softmoe.routing.capacity`: :func:`buffer_capacity` (vmoe's ``compute_capacity``);
- :mod:`~softmoe.routing.gate`: the bias-free linear gate and the training-time logit noise;
- :mod:`~softmoe.routing.token_choice`: Algorithm 1 and Softmax / Sinkhorn Token Choice;
- :mod:`~softmoe.routing.expert_choice`: Algorithm 2 and Softmax / Sinkhorn / sparsity-constrained Expert Choice;
- :mod:`~softmoe.routing.sinkhorn`: log-domain entropic OT;
- :mod:`~softmoe.routing.sparse_ot`: vmoe's k-sparse OT (semi-dual solved with Adam, top-k sparse simplex projection);
- :mod:`~softmoe.routing.soft`: Soft MoE as a router, with vmoe's monitoring metrics;
- :mod:`~softmoe.routing.losses`: importance and load losses;
- :mod:`~softmoe.routing.registry`: the six routers by name at a capacity factor c.
"""

from softmoe.layer import add_logit_noise
from softmoe.routing.capacity import buffer_capacity, check_capacity_factor
from softmoe.routing.expert_choice import ExpertChoiceRouter, expert_choice_allocation
from softmoe.routing.formulation import (
    DenseRouting,
    Router,
    SparseRouting,
    dense_moe,
    sparse_moe,
)
from softmoe.routing.gate import LinearGate
from softmoe.routing.layer import MoELayer
from softmoe.routing.losses import importance_loss, load_loss, squared_cv
from softmoe.routing.registry import ROUTERS, make_router
from softmoe.routing.sinkhorn import sinkhorn_plan, sinkhorn_potentials
from softmoe.routing.soft import SoftMoERouter, soft_moe_metrics
from softmoe.routing.sparse_ot import (
    sparse_plan,
    sparse_plan_columns,
    sparse_simplex_projection,
)
from softmoe.routing.token_choice import TokenChoiceRouter, token_choice_allocation

__all__ = [
    "ROUTERS",
    "DenseRouting",
    "ExpertChoiceRouter",
    "LinearGate",
    "MoELayer",
    "Router",
    "SoftMoERouter",
    "SparseRouting",
    "TokenChoiceRouter",
    "add_logit_noise",
    "buffer_capacity",
    "check_capacity_factor",
    "dense_moe",
    "expert_choice_allocation",
    "importance_loss",
    "load_loss",
    "make_router",
    "sinkhorn_plan",
    "sinkhorn_potentials",
    "soft_moe_metrics",
    "sparse_moe",
    "sparse_plan",
    "sparse_plan_columns",
    "sparse_simplex_projection",
    "squared_cv",
    "token_choice_allocation",
]
