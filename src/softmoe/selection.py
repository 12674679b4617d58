"""Inference with k of the n experts per input: Algorithm 1 of "Beyond Parameter Count" and its baselines.

Strategies (per input, per SoftMoE layer):
    "combine"  Algorithm 1: sum the combine weights C(X) over tokens (and over an expert's slots), keep the k
               largest; ties go to the lower expert index.
    "mass"     adaptive: the fewest experts, by Algorithm 1's order, whose share of the summed combine weight
               (normalized over experts) reaches ``tau``, between ``k_min`` and ``k_max`` experts.
    "budget"   adaptive under a budget: k experts per input ON AVERAGE over the batch (round(k * batch) in all,
               between ``k_min`` and ``k_max`` per input), given to the (input, expert) pairs with the largest
               shares, so an input whose combine mass is spread keeps more experts than a peaked one.
    "random"   k experts drawn uniformly without replacement from a seeded ``torch.Generator``.
    "all"      every expert (the plain forward).
    a bool tensor (batch, n)  an explicit subset per input, each row with the same number k of True entries.

The adaptive strategies keep different numbers of experts for the inputs of one batch; their selections are
(batch, k_max) with -1 in the unused places, and the expert products of those places are skipped, not padded.

Semantics are the paper's: the outputs of unselected experts are zero and combine weights are not renormalized
(``renormalize=True`` rescales each token's combine weights over the kept slots). Unselected experts are not
computed at all where that is cheaper than computing them (``plan="auto"``; ``plan="selected"`` always skips them,
see :mod:`softmoe.selection_plan` and ``SoftMoE.forward_selected``).

    with softmoe.select_experts(model, k=0.25, strategy="combine"):
        logits = model(images)
"""

from __future__ import annotations

import math
import statistics
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from softmoe.compat import transforms_active
from softmoe.kernels.modes import host_reads_are_free
from softmoe.layer import SoftMoE, combine_slots, dispatch_slots
from softmoe.selection_plan import check_plan, mask_from_subsets, may_synchronize
from softmoe.topk import top_k, top_k_list
from softmoe.tuning import value

STRATEGIES = ("combine", "mass", "budget", "random", "all")
ADAPTIVE = ("mass", "budget")


class ExpertSelector(Protocol):
    """What a layer consults, when set as ``layer.selector``, to pick each input's experts (:class:`Selector` is one).

    ``top_k`` is k where :meth:`select` keeps each input's k experts of largest summed combine weight (Algorithm 1),
    else None: a backend may then make that choice itself, in its routing kernel, without calling :meth:`select`."""

    renormalize: bool
    plan: str  # one of softmoe.selection_plan.SELECTION_PLANS

    @property
    def top_k(self) -> int | None: ...

    def select(self, combine: torch.Tensor) -> torch.Tensor:
        """combine (batch, tokens, n, p) -> selected experts (batch, k) int64."""
        ...


def resolve_k(k: int | float, num_experts: int) -> int:
    """An int k in [1, n], or a fraction in (0, 1] of n rounded to the nearest integer, halves up (must be >= 1)."""
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise ValueError(f"k must be an int in [1, {num_experts}] or a fraction in (0, 1], got {k!r}")
    if isinstance(k, float):
        if not 0.0 < k <= 1.0:
            raise ValueError(f"a fractional k must lie in (0, 1], got {k}")
        count = math.floor(k * num_experts + 0.5)
        if count < 1:
            raise ValueError(f"k = {k} of {num_experts} experts rounds to {count}; at least 1 expert is needed")
        return count
    if not 1 <= k <= num_experts:
        raise ValueError(f"k must lie in [1, {num_experts}] (the layer's num_experts), got {k}")
    return k


def combine_scores(combine: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Algorithm 1's C_sum: combine (batch, tokens, n, p) summed over tokens and slots -> (batch, n), in ``dtype``
    (None: combine's)."""
    return combine.sum(dim=(1, 3), dtype=dtype)


def top_k_by_combine(combine: torch.Tensor, k: int) -> torch.Tensor:
    """Algorithm 1: the k experts with the largest C_sum per input -> (batch, k) int64, ascending indices.

    Ties are broken towards the lower expert index (:func:`softmoe.topk.top_k`, a stable sort). Only a tie between
    the k-th and the (k+1)-th largest can change which experts are kept, so where host reads are free (CPU, eager)
    and there are at least softmoe.tuning.TABLE's "topk_min_scores" scores, ``torch.topk`` (faster than the stable
    sort for that many scores) gives the set when no row has such a tie. With fewer scores the sort's 2 ops beat that
    path's 10, and up to "host_topk_max_scores" (where reads are free) a sort on the host
    (:func:`softmoe.topk.top_k_list`) beats both. Plain torch ops, the sums in float64 as in the "cpu" backend's
    native choice: a selector and that backend agree where sums in float32 would tie.
    """
    scores = combine_scores(combine, torch.float64)
    on_host = host_reads_are_free(scores)
    if on_host and scores.numel() <= value("host_topk_max_scores"):
        return torch.tensor([top_k_list(row, k) for row in scores.tolist()], dtype=torch.int64).view(-1, k)
    if on_host and k < scores.shape[1] and scores.numel() >= value("topk_min_scores"):
        values, index = torch.topk(scores, k + 1, dim=1)
        last, next_ = values[:, k - 1], values[:, k]
        if not bool(((last == next_) | (last.isnan() & next_.isnan())).any()):
            return index[:, :k].sort(dim=1).values
    return top_k(scores, k, dim=1)[1].sort(dim=1).values


def combine_shares(combine: torch.Tensor) -> torch.Tensor:
    """Algorithm 1's C_sum normalized over experts: each input's share of the combine mass per expert (batch, n)."""
    scores = combine_scores(combine)
    return scores / scores.sum(dim=1, keepdim=True).clamp_min(torch.finfo(scores.dtype).tiny)


UNIFORM_HALF_MASS = 1.02
"""The shares count as nearly uniform when each input's top half of the experts (n // 2 of them) keeps less than this
multiple of the combine mass a random half keeps: Algorithm 1's choice is then close to arbitrary."""


@dataclass(frozen=True)
class ShareUniformity:
    """How uniform the inputs' combine shares (:func:`combine_shares`) are, and what Algorithm 1 keeps over chance.

    entropy: the mean over inputs of the shares' entropy divided by log n (0: one expert, 1: uniform). Trained
    routers often sit near 1 while their choice still matters: it is reported, not judged on.
    kept_mass_ratio: the combine mass that Algorithm 1's top k keeps, over k / n, what a random k keeps in
    expectation (1: no better than chance). half_mass_ratio: the same for the top n // 2, the judged quantity
    (:data:`UNIFORM_HALF_MASS`). k, num_experts: what it was measured for.
    """

    entropy: float
    kept_mass_ratio: float
    half_mass_ratio: float
    k: int
    num_experts: int

    @property
    def nearly_uniform(self) -> bool:
        return self.num_experts > 1 and self.half_mass_ratio < UNIFORM_HALF_MASS

    def message(self) -> str:
        """One plain sentence for a user, saying what near-uniform shares mean for Algorithm 1."""
        return (
            f"the combine shares on these inputs are nearly uniform: each input's top half of its "
            f"{self.num_experts} experts keeps only {self.half_mass_ratio:.3f}x the combine mass of a random half "
            f"(normalized entropy {self.entropy:.4f}, where 1 is uniform), so which {self.k} experts Algorithm 1 keeps "
            "is close to arbitrary: it is no better than random selection here"
        )


def share_uniformity(combine: torch.Tensor, k: int | float) -> ShareUniformity:
    """The :class:`ShareUniformity` of combine weights (batch, tokens, n, p) for Algorithm 1 keeping k experts (an
    int, or a fraction of n), over the inputs with some combine mass (a fully padded one has none)."""
    scores = combine_scores(combine.detach()).double()
    shares = combine_shares(combine.detach()).double()[scores.sum(dim=1) > 0]  # a fully padded input has no shares
    num_experts = shares.shape[1]
    k = resolve_k(k, num_experts)
    entropy = -(shares * shares.clamp_min(torch.finfo(shares.dtype).tiny).log()).sum(dim=1)
    normalized = float(entropy.mean()) / math.log(num_experts) if num_experts > 1 else 0.0

    def ratio(count: int) -> float:
        return float(shares.topk(count, dim=1).values.sum(dim=1).mean()) / (count / num_experts)

    return ShareUniformity(normalized, ratio(k), ratio(max(1, num_experts // 2)), k, num_experts)


@torch.no_grad()
def measure_share_uniformity(model: nn.Module, inputs: torch.Tensor, k: int | float) -> list[ShareUniformity]:
    """The :class:`ShareUniformity` of every SoftMoE layer of ``model`` on one forward pass of ``inputs``, in module
    order (k: an int, or a fraction of each layer's n)."""
    found: list[ShareUniformity] = []

    def measure(layer: SoftMoE, args: tuple, kwargs: dict) -> None:
        found.append(share_uniformity(_combine_of_call(layer, args, kwargs), k))

    hooks = [layer.register_forward_pre_hook(measure, with_kwargs=True) for layer in soft_moe_layers(model)]
    try:
        model(inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return found


@torch.no_grad()
def _combine_of_call(layer: SoftMoE, args: tuple, kwargs: dict) -> torch.Tensor:
    """The combine weights of a call ``layer(x, mask)`` seen by a forward pre-hook (positional or keyword)."""
    x = args[0] if args else kwargs["x"]
    return layer.route(x, args[1] if len(args) > 1 else kwargs.get("mask")).combine


def _ascending_with_padding(ranked: torch.Tensor, counts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The first ``counts[i]`` experts of each row of ``ranked`` (batch, width), sorted ascending, then -1."""
    used = torch.arange(ranked.shape[1], device=ranked.device) < counts.unsqueeze(1)
    ordered = torch.where(used, ranked, num_experts).sort(dim=1).values
    return torch.where(ordered == num_experts, -1, ordered)


def experts_by_mass(combine: torch.Tensor, tau: float, k_min: int, k_max: int) -> torch.Tensor:
    """The "mass" strategy: per input the fewest experts, largest shares first, whose shares sum to at least
    ``tau``, clamped to [k_min, k_max] -> (batch, k_max) int64, ascending, -1 in the unused places."""
    shares, ranked = top_k(combine_shares(combine), k_max, dim=1)
    reached = (shares.cumsum(dim=1) < tau).sum(dim=1) + 1  # the first count whose running share reaches tau
    return _ascending_with_padding(ranked, reached.clamp(k_min, k_max), combine.shape[2])


def experts_by_budget(combine: torch.Tensor, average: float, k_min: int, k_max: int) -> torch.Tensor:
    """The "budget" strategy: round(average * batch) experts in all (halves up), at least k_min and at most k_max
    per input, given to the pairs with the largest shares -> (batch, k_max) int64, ascending, -1 unused."""
    batch = combine.shape[0]
    shares, ranked = top_k(combine_shares(combine), k_max, dim=1)
    extra = min(max(math.floor(average * batch + 0.5), batch * k_min), batch * k_max) - batch * k_min
    candidates = shares[:, k_min:].reshape(-1)
    chosen = torch.zeros_like(candidates, dtype=torch.int64)
    if extra > 0:
        chosen = chosen.index_fill(0, top_k(candidates, extra, dim=0)[1], 1)
    counts = k_min + chosen.view(batch, k_max - k_min).sum(dim=1)
    return _ascending_with_padding(ranked, counts, combine.shape[2])


def random_subsets(
    batch: int, num_experts: int, k: int, generator: torch.Generator | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """k distinct experts drawn uniformly per input -> (batch, k) int64, ascending, on ``device`` (default: the
    generator's, else the CPU); reproducible from ``generator``, which must live on that device."""
    if device is None:
        device = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(batch, num_experts, generator=generator, device=device)
    return keys.argsort(dim=1)[:, :k].sort(dim=1).values


def subsets_from_mask(keep: torch.Tensor, num_experts: int, batch: int | None = None) -> torch.Tensor:
    """A bool mask (batch, n) with the same count k of True per row -> selected experts (batch, k) int64."""
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"an expert mask must be a bool tensor of shape (batch, {num_experts}), got {got}")
    if keep.shape[1] != num_experts or (batch is not None and keep.shape[0] != batch):
        expected = f"({'batch' if batch is None else batch}, {num_experts})"
        raise ValueError(f"expert mask must have shape {expected}, got {tuple(keep.shape)}")
    counts = keep.sum(dim=1)
    k = int(counts[0]) if counts.numel() else 0
    if k < 1 or bool((counts != k).any()):
        raise ValueError(
            f"every row of the expert mask must keep the same k >= 1 experts, got counts {counts.tolist()}"
        )
    return keep.nonzero()[:, 1].view(keep.shape[0], k)


@dataclass
class Selector:
    """The per-layer choice rule installed by :func:`select_experts` (see ``SoftMoE.selector``).

    The random strategy draws on the device of the routing weights, from ``generators[device]``: a generator given
    for that device, else one seeded with ``seed`` and made there at its first use. The layers of one
    :func:`select_experts` block share one ``generators`` dict, so they draw from one stream per device.
    """

    strategy: str | torch.Tensor
    k: int | float
    renormalize: bool = False
    seed: int = 0
    generators: dict[torch.device, torch.Generator] = field(default_factory=dict)
    tau: float = 1.0
    k_min: int = 1
    k_max: int | None = None
    plan: str = "auto"

    @property
    def top_k(self) -> int | None:
        """k where this selector keeps each input's k experts of largest summed combine weight (Algorithm 1, a
        fixed k), else None: a layer may then choose them itself (:mod:`softmoe.kernels.routing_softmaxes` on
        CUDA, :mod:`softmoe.kernels.top_k_combine` on the CPU) instead of calling :meth:`select`."""
        if isinstance(self.strategy, str) and self.strategy == "combine":
            assert isinstance(self.k, int)  # a fixed k: resolve_k's count
            return self.k
        return None

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The random strategy's generator on ``device``."""
        if device not in self.generators:
            self.generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.generators[device]

    def select(self, combine: torch.Tensor) -> torch.Tensor:
        """combine (batch, tokens, n, p) -> selected experts (batch, k) int64, on combine's device."""
        batch, _, num_experts, _ = combine.shape
        if isinstance(self.strategy, torch.Tensor):
            return subsets_from_mask(self.strategy, num_experts, batch).to(combine.device)
        # k is resolve_k's count for "combine" and "random" and the average for "budget"; make_selector gives the
        # adaptive strategies ("mass", "budget") both bounds.
        if self.strategy == "combine":
            assert isinstance(self.k, int)
            return top_k_by_combine(combine, self.k)
        if self.strategy == "mass":
            assert self.k_max is not None
            return experts_by_mass(combine, self.tau, self.k_min, self.k_max)
        if self.strategy == "budget":
            assert self.k_max is not None
            return experts_by_budget(combine, self.k, self.k_min, self.k_max)
        if self.strategy == "random":
            assert isinstance(self.k, int)
            generator = self.generator_on(combine.device)
            return random_subsets(batch, num_experts, self.k, generator, combine.device)
        return torch.arange(num_experts, device=combine.device).expand(batch, num_experts)


def soft_moe_layers(model: nn.Module) -> list[SoftMoE]:
    """Every SoftMoE layer of ``model`` (the model itself included), in module order."""
    return [module for module in model.modules() if isinstance(module, SoftMoE)]


def make_selector(
    layer: SoftMoE,
    k: int | float | None,
    strategy: str | torch.Tensor,
    renormalize: bool = False,
    seed: int = 0,
    generators: dict[torch.device, torch.Generator] | None = None,
    tau: float | None = None,
    k_min: int = 1,
    k_max: int | None = None,
    plan: str = "auto",
) -> Selector | None:
    """The selector for one layer, or None for "all" (the plain forward). Validates k, tau, the bounds and the
    strategy.

    ``seed`` and ``generators`` (shared between layers; a new dict when None) are the random strategy's source;
    ``plan`` how the layer runs the selection (:mod:`softmoe.selection_plan`)."""
    check_plan(plan)
    n = layer.num_experts
    if isinstance(strategy, torch.Tensor):
        if strategy.dim() != 2 or strategy.shape[1] != n:
            raise ValueError(f"expert mask must have shape (batch, {n}), got {tuple(strategy.shape)}")
        count = subsets_from_mask(strategy, n).shape[1]
        if k is not None and resolve_k(k, n) != count:
            raise ValueError(f"k = {k} does not match the {count} experts kept per row by the mask")
        return Selector(strategy, count, renormalize, plan=plan)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES} or a bool mask (batch, n), got {strategy!r}")
    if strategy == "all":
        return None
    if strategy in ADAPTIVE:
        k_min, k_max = _bounds(k_min, k_max, n)
        if strategy == "mass":
            if tau is None or isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 < tau <= 1:
                raise ValueError(f'strategy "mass" needs tau, a combine-mass share in (0, 1], got {tau!r}')
            return Selector(strategy, k_max, renormalize, tau=float(tau), k_min=k_min, k_max=k_max, plan=plan)
        return Selector(strategy, _average_k(k, n, k_min, k_max), renormalize, k_min=k_min, k_max=k_max, plan=plan)
    if k is None:
        raise ValueError(f"strategy {strategy!r} needs k (an int in [1, {n}] or a fraction in (0, 1])")
    generators = {} if generators is None else generators
    return Selector(strategy, resolve_k(k, n), renormalize, seed, generators, plan=plan)


def _bounds(k_min: int, k_max: int | None, n: int) -> tuple[int, int]:
    """The adaptive strategies' bounds on each input's expert count, checked: 1 <= k_min <= k_max <= n."""
    k_max = n if k_max is None else k_max
    for name, bound in (("k_min", k_min), ("k_max", k_max)):
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise ValueError(f"{name} must be an int, got {bound!r}")
    if not 1 <= k_min <= k_max <= n:
        raise ValueError(
            f"the expert-count bounds must satisfy 1 <= k_min <= k_max <= {n}, got k_min={k_min}, k_max={k_max}"
        )
    return k_min, k_max


def _average_k(k: int | float | None, n: int, k_min: int, k_max: int) -> float:
    """The "budget" strategy's average experts per input: an int count, or a fraction in (0, 1] of n (unrounded)."""
    if k is None or isinstance(k, bool) or not isinstance(k, (int, float)):
        raise ValueError(
            f'strategy "budget" needs k, the average experts per input (an int, or a fraction in '
            f"(0, 1] of {n}), got {k!r}"
        )
    if isinstance(k, float) and not 0.0 < k <= 1.0:
        raise ValueError(f"a fractional k must lie in (0, 1], got {k}")
    average = k * n if isinstance(k, float) else float(k)
    if not k_min <= average <= k_max:
        raise ValueError(f"the average k = {average:g} experts must lie in [k_min, k_max] = [{k_min}, {k_max}]")
    return average


@contextmanager
def select_experts(
    model: nn.Module,
    k: int | float | None = None,
    strategy: str | torch.Tensor = "combine",
    renormalize: bool = False,
    seed: int | None = 0,
    generator: torch.Generator | None = None,
    *,
    tau: float | None = None,
    k_min: int = 1,
    k_max: int | None = None,
    plan: str = "auto",
) -> Iterator[list[SoftMoE]]:
    """Within the block every SoftMoE layer of ``model`` uses only some of its experts per input, chosen by
    ``strategy`` (the module doc lists them).

    Args:
        model: any module; each of its SoftMoE layers chooses its own experts per input.
        k: experts kept per input: an int (same for every layer), or a fraction of each layer's n; for "budget"
            the average over the batch (a fraction is not rounded: 0.3 of 8 experts is 2.4 on average).
        strategy: "combine" (Algorithm 1), "mass", "budget", "random", "all", or a bool mask (batch, n).
        renormalize: rescale each token's combine weights over the kept slots (the paper does not).
        seed, generator: the random strategy's source: ``generator`` on its device, else a ``torch.Generator``
            seeded with ``seed`` (0 when None) made on the device of the layers' inputs. Layers draw from it in
            module order, so a run is reproducible (on one device).
        tau: the "mass" strategy's share of the combine mass to reach, in (0, 1].
        k_min, k_max: the adaptive strategies' bounds on each input's expert count (k_max: the layer's n when
            None).
        plan: "selected" (run only the kept experts), "dense" (run all, zero the others' combine weights) or
            "auto" (the cheaper for the shape): same output (:mod:`softmoe.selection_plan`).
    Yields the list of affected layers. Previous selectors are restored on exit.

    With Algorithm 1 ("combine"), the first eager forward of a layer under Algorithm 1 in this process checks the
    combine shares of its batch (once per layer, whatever the blocks) and, when they are nearly uniform
    (:class:`ShareUniformity`), says once, as a :class:`NoBetterThanRandomWarning`, that Algorithm 1 is no better
    than random selection there (without labels this is all that can be judged;
    :func:`softmoe.calibration.calibrate` also compares with random subsets on labelled data).
    """
    layers = soft_moe_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} contains no SoftMoE layer")
    generators = {} if generator is None else {generator.device: generator}
    seed = 0 if seed is None else seed
    selectors = [
        make_selector(layer, k, strategy, renormalize, seed, generators, tau, k_min, k_max, plan) for layer in layers
    ]
    previous = [layer.selector for layer in layers]
    hooks: list = []
    unchecked = [layer for layer in layers if layer not in _CHECKED_LAYERS]
    if isinstance(strategy, str) and strategy == "combine" and unchecked and not torch.compiler.is_compiling():
        assert k is not None  # make_selector has refused "combine" without k
        check = _UniformityCheck(k, hooks, unchecked)
        hooks.extend(layer.register_forward_pre_hook(check, with_kwargs=True) for layer in unchecked)
    try:
        for layer, selector in zip(layers, selectors):
            layer.selector = selector
        yield layers
    finally:
        for hook in hooks:
            hook.remove()
        for layer, before in zip(layers, previous):
            layer.selector = before


class NoBetterThanRandomWarning(UserWarning):
    """Algorithm 1 runs where its choice is no better than random selection: the combine shares are nearly uniform
    (:func:`select_experts`, :func:`softmoe.calibration.calibrate`), or random subsets score as well on labelled data
    (:func:`softmoe.calibration.calibrate`)."""


_CHECKED_LAYERS: weakref.WeakSet[SoftMoE] = weakref.WeakSet()
"""Layers whose shares :func:`select_experts` has checked in this process: each is checked once, so a block entered
for every call costs nothing after the first (and a compiled model sees its hooks change once at most)."""


class _UniformityCheck:
    """A forward pre-hook that checks the first eager batch Algorithm 1 sees on not yet checked ``layers`` (their
    routing is computed once more for that batch), warns if its combine shares are nearly uniform, marks the layers
    checked and removes every hook of the block (``handles``). It reads the shares on the host, so it leaves for a
    later batch a call where that is unwelcome: under torch.compile or a torch.func transform, with CUDA's sync debug
    mode on or a CUDA graph being captured (:func:`~softmoe.selection_plan.may_synchronize`)."""

    def __init__(self, k: int | float, handles: list, layers: list[SoftMoE]) -> None:
        self.k, self.handles, self.layers = k, handles, layers

    def __call__(self, layer: SoftMoE, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else kwargs["x"]
        if torch.compiler.is_compiling() or transforms_active() or not may_synchronize(x.device):
            return
        for handle in self.handles:
            handle.remove()
        _CHECKED_LAYERS.update(self.layers)
        uniformity = share_uniformity(_combine_of_call(layer, args, kwargs), self.k)
        if uniformity.nearly_uniform:
            warnings.warn(uniformity.message(), NoBetterThanRandomWarning, stacklevel=2)


def masked_reference_forward(
    layer: SoftMoE,
    x: torch.Tensor,
    selected: torch.Tensor,
    mask: torch.Tensor | None = None,
    renormalize: bool = False,
) -> torch.Tensor:
    """The paper code's way: run ALL experts, zero the rows of unselected experts, combine. For tests/benchmarks.

    x (batch, tokens, dim), selected (batch, k) -> (batch, tokens, d_out). Same result as ``layer.forward_selected``
    but with no compute saved.
    """
    routing = layer.route(x, mask)
    batch, tokens, n, p = routing.combine.shape
    keep_slots = mask_from_subsets(selected, n).unsqueeze(-1).expand(batch, n, p).reshape(batch, 1, n * p)
    slots = dispatch_slots(layer.slot_inputs(x), routing.dispatch.reshape(batch, tokens, n * p))
    expert_out = layer.run_experts(slots) * keep_slots.transpose(1, 2).to(x.dtype)
    combine = routing.combine.reshape(batch, tokens, n * p)
    if renormalize:
        kept = combine * keep_slots
        combine = kept / kept.sum(-1, keepdim=True).clamp_min(torch.finfo(combine.dtype).tiny)
    return combine_slots(combine, expert_out)


def random_statistics(accuracies: list[float], algorithm1: float | None = None) -> dict:
    """Mean and sample std (ddof = 1, as the authors' scripts) of the random-selection accuracies, and Algorithm 1's
    lead in stds (Table 10).

    The std is 0 for a single seed; the lead is None without an Algorithm 1 accuracy or when the std is 0.
    """
    mean = statistics.fmean(accuracies)
    std = statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0
    lead = (algorithm1 - mean) / std if algorithm1 is not None and std > 0 else None
    return {"accuracies": accuracies, "mean": mean, "std": std, "stds_above_random": lead}
