"""The published PyTorch Soft MoE packages, built at one of our benchmark shapes so that they can be timed beside
``softmoe.SoftMoE`` in the same process.

Install them with ``make peers`` (pinned versions, without their own dependencies, which would pull another torch
through timm; einops comes along). Each builder takes the layer's shape (dim d, n experts, p slots per expert, expert
hidden size h) and returns a module mapping (batch, tokens, d) -> (batch, tokens, d), or raises ``PeerMissing``
with the reason.

- ``soft-moe-pytorch`` (lucidrains, 0.1.9): ``SoftMoE(dim, num_experts, num_slots=p, expert_mult=h/d)``; its experts
  are an ``nn.ModuleList`` of ``Linear -> GELU -> Linear`` run in a Python loop; it also RMS-normalizes the tokens
  and the slots.
- ``soft-moe`` (bwconrad, 0.0.1): ``SoftMoELayerWrapper(dim, n, p, layer=...)`` with our expert MLP as its layer;
  a Python loop over the experts. Its package ``__init__`` imports timm, which is not needed for the layer: where
  timm is missing, the layer's module is loaded from the package's folder alone.
- ``soft-mixture-of-experts`` (fkodom, 0.2.0): ``SoftMoE(d, d, n, p)``, one batched einsum over experts, but each
  expert is a single d x d linear map, not an MLP: it does less work than the others at the same shape, so it is
  reported apart from the "best MLP peer".
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable

from torch import nn


class PeerMissing(Exception):
    """A peer package is not installed (or cannot build this shape)."""


def expert_mlp(features: int, hidden: int, activation: str) -> nn.Module:
    """One expert as the peers' users write it: Linear(d, h) -> activation -> Linear(h, d)."""
    act = {"relu": nn.ReLU(), "gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh")}[activation]
    return nn.Sequential(nn.Linear(features, hidden), act, nn.Linear(hidden, features))


def _import(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise PeerMissing(f"{package} is not installed ({error})") from None


def lucidrains(dim: int, experts: int, slots: int, hidden: int, activation: str) -> nn.Module:
    soft_moe = _import("soft_moe_pytorch", "soft-moe-pytorch")
    # int(dim * mult) is its hidden size; the half keeps a float rounding from losing one unit.
    return soft_moe.SoftMoE(dim, num_experts=experts, num_slots=slots, expert_mult=(hidden + 0.5) / dim,
                            is_distributed=False, offload_unused_experts_to_cpu=False)


def bwconrad(dim: int, experts: int, slots: int, hidden: int, activation: str) -> nn.Module:
    try:
        module = importlib.import_module("soft_moe.soft_moe")
    except ImportError:  # the package __init__ imports timm; the layer's own module does not need it
        spec = importlib.util.find_spec("soft_moe")
        if spec is None or not spec.submodule_search_locations:
            raise PeerMissing("soft-moe is not installed") from None
        path = f"{list(spec.submodule_search_locations)[0]}/soft_moe.py"
        file_spec = importlib.util.spec_from_file_location("_peer_soft_moe_layer", path)
        module = importlib.util.module_from_spec(file_spec)
        sys.modules[file_spec.name] = module
        file_spec.loader.exec_module(module)
    return module.SoftMoELayerWrapper(dim, experts, slots, layer=expert_mlp, features=dim, hidden=hidden,
                                      activation=activation)


def fkodom(dim: int, experts: int, slots: int, hidden: int, activation: str) -> nn.Module:
    soft_moe = _import("soft_mixture_of_experts.soft_moe", "soft-mixture-of-experts")
    return soft_moe.SoftMoE(dim, dim, experts, slots)


PEERS: dict[str, Callable[..., nn.Module]] = {
    "soft-moe-pytorch": lucidrains,
    "soft-moe": bwconrad,
    "soft-mixture-of-experts": fkodom,
}
# Peers whose experts are MLPs like ours (the "best peer" of a row is the fastest of these).
MLP_PEERS = ("soft-moe-pytorch", "soft-moe")


def build_peers(dim: int, experts: int, slots: int, hidden: int, activation: str) -> tuple[dict, dict]:
    """({name: module} of the installed peers, {name: reason} of the others) at this shape."""
    built, missing = {}, {}
    for name, build in PEERS.items():
        try:
            built[name] = build(dim, experts, slots, hidden, activation)
        except PeerMissing as reason:
            missing[name] = str(reason)
    return built, missing
