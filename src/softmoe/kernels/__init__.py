"""Faster kernels: on CPU for the products where torch's defaults (MKL) run far below the machine's limits, on CUDA
for the launches of Algorithm 1's choice.

Two kinds, each taken only where it applies (float32 CPU tensors), with torch's own ops everywhere else; the
measured thresholds that decide where each runs (rows, weight sizes, FLOPs) are entries of
:data:`softmoe.tuning.TABLE`, not constants of this package:

- oneDNN's linear for inference (:mod:`softmoe.kernels.onednn`): bias and activation fused, faster than MKL for
  the few-row products of a Soft MoE layer; no backward, so only where no gradient is recorded.
  :func:`batched_matmul` runs batched products there too where oneDNN outruns MKL on this CPU (timed once per
  process, :func:`onednn_outruns_mkl`), the slot backend's forward and backward products among them.
- softmoe's native kernels (``softmoe/csrc``), one PyTorch C++ extension built on first use
  (:mod:`softmoe.kernels.build`) and registered as custom ops that torch.compile, autograd and
  ``torch.library.opcheck`` see like torch's own:

  - ``torch.ops.softmoe.expert_matmul`` (and its backward ops ``expert_matmul_nt``, ``expert_matmul_tn``): batched
    expert matmuls for experts that see few rows each (:mod:`softmoe.kernels.expert_matmul`);
  - ``torch.ops.softmoe.soft_moe_mixing`` (and ``soft_moe_mixing_backward``): the whole Soft MoE mixing of many
    small relu experts in one pass (:mod:`softmoe.kernels.soft_moe_mixing`);
  - ``torch.ops.softmoe.soft_moe_routing`` (and ``soft_moe_routing_backward``): a layer's logits, dispatch and
    combine weights in one call (:mod:`softmoe.kernels.soft_moe_routing`; in inference :func:`soft_moe_routing_top_k`
    makes Algorithm 1's choice in the same pass);
  - ``torch.ops.softmoe.top_k_combine``: Algorithm 1's choice of experts from the combine weights, and the combine
    weights with the others' slots zeroed, in one call (:mod:`softmoe.kernels.top_k_combine`);
  - ``torch.ops.softmoe.selected_mixing``: Algorithm 1's selected plan for inference (the kept slots, the kept
    experts' MLPs, the combine) in one call (:mod:`softmoe.kernels.selected_mixing`);
  - ``torch.ops.softmoe.native_grouped_mm``: ``softmoe::grouped_mm``'s contract (rows sorted by expert through each
    expert's weight) with each expert's product in the native expert matmul, oneDNN or MKL by its shape
    (:mod:`softmoe.kernels.native_grouped_mm`).

  One build serves every x86-64 CPU: each kernel is compiled for AVX-512, AVX2 and the baseline, and the best
  variant this CPU runs is picked at run time (``SOFTMOE_ISA`` to ask for one, :func:`use_isa` in tests,
  :func:`cpu_isa` to see which runs). ``SOFTMOE_NATIVE=0`` turns them off; without a C++ compiler softmoe runs
  torch's ops (:func:`native_available`, :func:`native_status`).

On CUDA, ``torch.ops.softmoe.routing_softmaxes`` (:mod:`softmoe.kernels.routing_softmaxes`) computes a layer's two
softmaxes and Algorithm 1's choice of experts in one Triton kernel (the tokens' normalization and a bfloat16 layer's
casts with them), which the "cuda" backend takes for Algorithm 1 in eager inference (:func:`fused_routing_applies`);
elsewhere it is torch's ops. ``torch.ops.softmoe.skinny_grouped_mm``
(:mod:`softmoe.kernels.skinny_grouped_mm`) is ``softmoe::grouped_mm``'s product in a Triton kernel that streams the
weights for few rows, which the "cuda" backend takes for Algorithm 1's selected experts (:func:`skinny_applies`).
"""

from softmoe.kernels.build import (
    ISAS,
    compiled_in_this_process,
    cpu_isa,
    native_available,
    native_cache_dir,
    native_status,
    supported_isas,
    use_isa,
)
from softmoe.kernels.expert_matmul import NATIVE_ACTIVATIONS, expert_matmul, native_applies
from softmoe.kernels.modes import needs_grad, plain_eager_mode, transforms_active
from softmoe.kernels.native_grouped_mm import native_grouped_mm
from softmoe.kernels.onednn import ONEDNN_ACTIVATIONS, batched_matmul, onednn_applies, onednn_linear, onednn_outruns_mkl
from softmoe.kernels.routing_softmaxes import fused_routing_applies, routing_softmaxes
from softmoe.kernels.selected_mixing import selected_mixing
from softmoe.kernels.skinny_grouped_mm import skinny_applies, skinny_grouped_mm
from softmoe.kernels.soft_moe_mixing import MIXING_MAX_TOKENS, native_mixing_applies, soft_moe_mixing
from softmoe.kernels.soft_moe_routing import native_routing_applies, soft_moe_routing, soft_moe_routing_top_k
from softmoe.kernels.top_k_combine import top_k_combine

__all__ = [
    "ISAS",
    "MIXING_MAX_TOKENS",
    "NATIVE_ACTIVATIONS",
    "ONEDNN_ACTIVATIONS",
    "batched_matmul",
    "compiled_in_this_process",
    "cpu_isa",
    "expert_matmul",
    "fused_routing_applies",
    "native_applies",
    "native_available",
    "native_cache_dir",
    "native_grouped_mm",
    "native_mixing_applies",
    "native_routing_applies",
    "native_status",
    "needs_grad",
    "onednn_applies",
    "onednn_linear",
    "onednn_outruns_mkl",
    "plain_eager_mode",
    "routing_softmaxes",
    "selected_mixing",
    "skinny_applies",
    "skinny_grouped_mm",
    "soft_moe_mixing",
    "soft_moe_routing",
    "soft_moe_routing_top_k",
    "supported_isas",
    "top_k_combine",
    "transforms_active",
    "use_isa",
]
