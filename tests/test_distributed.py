"""Data parallel and expert parallel training on torch.distributed (CPU, gloo, 2 processes spawned by the tests).

Each spawned job runs several scenarios and returns tensors; the single-process references are computed here.
Every process group has a 30 s timeout and every job a join deadline, so a broken collective fails, never hangs.
"""

from __future__ import annotations

import datetime
import socket
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from softmoe import SoftMoE
from softmoe.checkpoint import load_tensors, save_tensors
from softmoe.distributed import (
    LOCAL,
    DistContext,
    ExpertParallelExperts,
    all_to_all,
    clip_grad_norm_,
    data_parallel,
    full_optimizer_tensors,
    full_state_dict,
    load_full_optimizer_tensors,
    load_full_state_dict,
    local_batch_size,
    reduce_metrics,
    setup_distributed,
    shard_experts,
    unwrap,
)
from softmoe.models import SoftMoEClassifier

WORLD = 2
GROUP_TIMEOUT_S = 30
JOB_TIMEOUT_S = 75


# ---------------------------------------------------------------------------------------------------------------------
# Spawning


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    result_path = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        )
        result = fn(rank, world, Path(out_dir))
        dist.destroy_process_group()
        torch.save({"ok": result}, result_path)
    except BaseException:  # reported to the parent, which fails the test with the traceback
        torch.save({"error": traceback.format_exc()}, result_path)
        raise


def run_ranks(fn, out_dir: Path, world: int = WORLD, timeout: float = JOB_TIMEOUT_S) -> list:
    """Run ``fn(rank, world, out_dir)`` in ``world`` spawned processes; return each rank's result."""
    context = mp.get_context("spawn")
    port = _free_port()
    procs = [context.Process(target=_entry, args=(fn, r, world, port, str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {timeout} s")
    results = []
    for r in range(world):
        path = out_dir / f"rank{r}.pt"
        if not path.exists():
            pytest.fail(f"rank {r} exited with code {procs[r].exitcode} and no result")
        saved = torch.load(path, weights_only=False)
        if "error" in saved:
            pytest.fail(f"rank {r} failed:\n{saved['error']}")
        results.append(saved["ok"])
    return results


# ---------------------------------------------------------------------------------------------------------------------
# Scenarios (shared by the workers and the references)

LAYER_CASES = {
    # name: (layer kwargs, global batch, tokens, dtype, tolerance)
    "mlp_f64_uneven_mask": (
        dict(dim=8, num_experts=4, slots_per_expert=2, expert_hidden=16), 5, 5, torch.float64, 1e-6
    ),
    # For the full layer the token-space rewrite is cheaper here: the sharded layer must use slots and agree.
    "mlp_f32_token_space": (
        dict(dim=8, num_experts=2, slots_per_expert=16, expert_hidden=4), 6, 4, torch.float32, 1e-4
    ),
    "stacked_f64": (dict(dim=8, num_experts=4, slots_per_expert=1), 4, 3, torch.float64, 1e-6),
}


def make_layer(case: str) -> SoftMoE:
    kwargs, _, _, dtype, _ = LAYER_CASES[case]
    torch.manual_seed(0)
    if case.startswith("stacked"):
        expert = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 8))
        return SoftMoE(kwargs["dim"], kwargs["num_experts"], kwargs["slots_per_expert"], expert=expert, dtype=dtype)
    return SoftMoE(**kwargs, dtype=dtype)


def layer_inputs(case: str):
    kwargs, batch, tokens, dtype, _ = LAYER_CASES[case]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, kwargs["dim"], generator=g, dtype=torch.float64).to(dtype)
    target = torch.randn(batch, tokens, kwargs["dim"], generator=g, dtype=torch.float64).to(dtype)
    mask = None
    if "mask" in case:
        mask = torch.ones(batch, tokens, dtype=torch.bool)
        mask[0, -2:] = False
        mask[-1, 1] = False
    return x, target, mask


def classifier_batches(dtype=torch.float64):
    """Three global batches of 8x8 images (sizes 8, 7, 8): the second one is a smaller, unevenly split batch."""
    g = torch.Generator().manual_seed(2)
    out = []
    for size in (8, 7, 8):
        images = torch.rand(size, 1, 8, 8, generator=g, dtype=torch.float64).to(dtype)
        labels = torch.randint(0, 3, (size,), generator=g)
        out.append((images, labels))
    return out


def make_classifier() -> nn.Module:
    torch.manual_seed(3)
    return SoftMoEClassifier((1, 8, 8), num_experts=4, num_classes=3).double()


def train_steps(model, optimizer, steps, ctx: DistContext = LOCAL):
    """The data parallel step of the proposed train.py patch: shard, sum the loss, scale to the global mean."""
    for images, labels, count in ctx.shard_batches(steps):
        loss = ctx.global_mean(F.cross_entropy(model(images), labels, reduction="sum"), count)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


# ---------------------------------------------------------------------------------------------------------------------
# Workers (run in the spawned processes)


def _worker_main(rank: int, world: int, out_dir: Path) -> dict:
    results: dict = {}

    # The differentiable all_to_all: uneven splits with an empty one; gradient = the reverse exchange.
    send_sizes = [[2, 0], [3, 1]][rank]  # rank 0 sends 2 rows to itself, none to rank 1; rank 1 sends 3 and 1
    recv_sizes = [[2, 3], [0, 1]][rank]
    x = (torch.arange(sum(send_sizes) * 2, dtype=torch.float64).view(-1, 2) + 100 * rank).requires_grad_()
    y = all_to_all(x, recv_sizes, send_sizes)
    weight = torch.arange(y.numel(), dtype=torch.float64).view_as(y) + 10 * rank
    (y * weight).sum().backward()
    results["a2a"] = (y.detach(), x.grad, all_to_all(weight.detach(), send_sizes, recv_sizes))

    # Expert parallel layer vs the single-process layer.
    for case in LAYER_CASES:
        layer = make_layer(case)
        probe = torch.zeros(1, LAYER_CASES[case][2], layer.dim, dtype=layer.phi.dtype)
        choice = layer.backend_for(probe)
        backend_before = choice.backend.mixing(layer, probe)
        shard_experts(layer)
        assert isinstance(layer.experts, ExpertParallelExperts)
        ddp = data_parallel(layer)
        x, target, mask = layer_inputs(case)
        ctx = DistContext(rank, world)
        x_local, target_local = ctx.shard(x, target)
        mask_local = ctx.shard(mask)[0] if mask is not None else None
        x_local.requires_grad_()
        out = ddp(x_local, mask_local)
        ctx.global_mean((out * target_local).sum(), x.shape[0]).backward()
        results[case] = {
            "backend_before": backend_before,
            "backend_after": layer.backend_for(probe).name,
            "out": out.detach(),
            "x_grad": x_local.grad,
            "grads": {name: _local(p.grad) for name, p in layer.named_parameters()},
            "offset": layer.experts.expert_offset,
        }

    # Data parallel training (two steps) and expert parallel + data parallel training (two steps), float64.
    batches = classifier_batches()
    for mode in ("dp", "ep"):
        ctx = DistContext(rank, world, expert_parallel=mode == "ep")
        model = ctx.prepare(make_classifier())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        train_steps(model, optimizer, batches[:2], ctx)
        state = full_state_dict(model)
        optim = full_optimizer_tensors(model, optimizer)
        probe = ctx.shard(batches[2][0])[0]
        with torch.no_grad():
            results[f"{mode}_probe_out"] = model(probe)
        if ctx.is_main:
            save_tensors(out_dir / f"{mode}_model.safetensors", state)
            save_tensors(out_dir / f"{mode}_optim.safetensors", optim)
        results[f"{mode}_state_on_rank"] = len(state)
        ctx.barrier()

        # Resume on this world size from the full checkpoint, read by rank 0 only, then a third step.
        resumed = make_classifier()
        resumed = ctx.prepare(resumed)
        optimizer = torch.optim.Adam(resumed.parameters(), lr=1e-2)
        main = ctx.is_main
        load_full_state_dict(
            resumed, load_tensors(out_dir / f"{mode}_model.safetensors") if main else None, from_rank0=True
        )
        flat = load_tensors(out_dir / f"{mode}_optim.safetensors") if main else None
        load_full_optimizer_tensors(resumed, optimizer, flat, from_rank0=True)
        train_steps(resumed, optimizer, batches[2:], ctx)
        results[f"{mode}_step3"] = full_state_dict(resumed, rank0_only=False)

    # Every rank reads the full checkpoint itself (no communication) and gets the same outputs.
    ctx = DistContext(rank, world, expert_parallel=True)
    model = ctx.prepare(SoftMoEClassifier((1, 8, 8), num_experts=4, num_classes=3).double())
    load_full_state_dict(model, load_tensors(out_dir / "ep_model.safetensors"))
    with torch.no_grad():
        results["ep_local_load_out"] = model(ctx.shard(batches[2][0])[0])

    results["metrics"] = reduce_metrics({"loss": 0.5 + rank, "seen": 3 + rank})
    # The clipped gradients, then (last: they must leave the process group working) the refused configurations:
    # in these ranks rather than in ranks of their own, each start of which costs seconds.
    results["clip"] = _worker_clip(rank, world, out_dir)
    results["bad"] = _worker_bad(rank, world, out_dir)
    return results


def _local(tensor):
    """A rank's own part of a tensor (a sharded DTensor's local slice), to send back to the test process."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _expect_error(errors: dict, name: str, fn) -> None:
    try:
        fn()
    except (ValueError, RuntimeError) as error:
        errors[name] = f"{type(error).__name__}: {error}"
    else:
        errors[name] = None


def _worker_bad(rank: int, world: int, out_dir: Path) -> dict:
    errors: dict = {}
    _expect_error(errors, "indivisible", lambda: shard_experts(SoftMoE(8, 3)))
    _expect_error(errors, "models_differ", lambda: shard_experts(SoftMoE(8, 4 if rank == 0 else 6)))
    only_rank0 = dist.new_group([0])  # every rank must create every group; rank 1 is not a member
    _expect_error(errors, "not_member", lambda: shard_experts(SoftMoE(8, 4), group=only_rank0))
    mixed = only_rank0 if rank == 0 else None  # rank 0 shards over [0], rank 1 over [0, 1]
    _expect_error(errors, "groups_differ", lambda: shard_experts(SoftMoE(8, 4), group=mixed))
    own = [dist.new_group([0]), dist.new_group([1])][rank]  # a valid partition, but DDP spans both ranks
    layer = shard_experts(SoftMoE(8, 4), group=own)
    _expect_error(errors, "ddp_group", lambda: data_parallel(layer))
    _expect_error(errors, "batch", lambda: DistContext(rank, world).local_batch_size(5))
    _expect_error(errors, "one_rank_wrong", lambda: shard_experts(SoftMoE(8, 4) if rank == 0 else nn.Linear(8, 8)))
    sharded = shard_experts(SoftMoE(8, 4))
    _expect_error(errors, "twice", lambda: shard_experts(sharded))
    other = SoftMoE(8, 6).state_dict() if rank == 0 else None  # a checkpoint of 6 experts, read by rank 0
    _expect_error(errors, "checkpoint_experts", lambda: load_full_state_dict(sharded, other, from_rank0=True))
    # The process group still works after the errors: nothing is left half-way in a collective.
    total = torch.tensor([1.0])
    dist.all_reduce(total)
    errors["still_alive"] = float(total)
    return errors


# ---------------------------------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope="module")
def main_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("dist")
    return run_ranks(_worker_main, out_dir), out_dir


def _reference_layer(case: str):
    layer = make_layer(case)
    x, target, mask = layer_inputs(case)
    x = x.clone().requires_grad_()
    out = layer(x, mask)
    ((out * target).sum() / x.shape[0]).backward()
    return layer, x, out.detach()


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow
def test_all_to_all_exchanges_rows_and_gradients(main_results):
    results, _ = main_results
    rank0, rank1 = (r["a2a"] for r in results)
    x0 = torch.arange(4, dtype=torch.float64).view(2, 2)
    x1 = torch.arange(8, dtype=torch.float64).view(4, 2) + 100
    assert torch.equal(rank0[0], torch.cat([x0, x1[:3]]))
    assert torch.equal(rank1[0], x1[3:])
    for y, grad, reverse in (rank0, rank1):
        assert torch.equal(grad, reverse)  # backward = the reverse exchange of the output gradient


@pytest.mark.slow  # (the torchrun of main_results)
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_expert_parallel_matches_single_process(main_results, case):
    results, _ = main_results
    tol = LAYER_CASES[case][4]
    layer, x, out = _reference_layer(case)
    chunks = [len(c) for c in x.tensor_split(WORLD)]
    starts = [sum(chunks[:r]) for r in range(WORLD)]
    n_local = layer.num_experts // WORLD
    for rank, result in enumerate(r[case] for r in results):
        rows = slice(starts[rank], starts[rank] + chunks[rank])
        _close(result["out"], out[rows], tol, f"{case} rank {rank} output")
        # Each rank's loss is its sum scaled by world/global, hence world times the global-mean gradient.
        _close(result["x_grad"], WORLD * x.grad[rows], tol, f"{case} rank {rank} input gradient")
        assert result["backend_after"] == "reference"  # sharded experts: slots exchanged with all_to_all
        offset = result["offset"]
        assert offset == rank * n_local
        reference = dict(layer.named_parameters())
        for name, grad in result["grads"].items():
            full = reference[name].grad
            if name.startswith("experts."):  # this rank's slice of the expert axis
                full = full[offset : offset + n_local]
            _close(grad, full, tol, f"{case} rank {rank} grad of {name}")
        assert set(result["grads"]) == set(reference)  # the names of the unsharded layer
    if case == "mlp_f32_token_space":
        assert results[0][case]["backend_before"] == "tokens"  # the full layer would have used the token-space rewrite


def _reference_training(steps):
    model = make_classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for images, labels in steps:
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.slow  # (the torchrun of main_results)
@pytest.mark.parametrize("mode", ["dp", "ep"])
def test_two_training_steps_match_one_process(main_results, mode):
    results, out_dir = main_results
    model, optimizer = _reference_training(classifier_batches()[:2])
    saved = load_tensors(out_dir / f"{mode}_model.safetensors")
    expected = model.state_dict()
    assert set(saved) == set(expected)
    for key, value in expected.items():
        _close(saved[key], value, 1e-9, f"{mode} parameter {key}")
    assert results[0][f"{mode}_state_on_rank"] == len(expected)
    assert results[1][f"{mode}_state_on_rank"] == 0  # rank 0 only
    # The optimizer state is written in the single-process format, so training resumes on any world size.
    saved_optim = load_tensors(out_dir / f"{mode}_optim.safetensors")
    expected_optim = full_optimizer_tensors(model, optimizer)
    assert set(saved_optim) == set(expected_optim)
    for key, value in expected_optim.items():
        _close(saved_optim[key], value.to(saved_optim[key].dtype), 1e-9, f"{mode} optimizer {key}")


@pytest.mark.slow  # (the torchrun of main_results)
@pytest.mark.parametrize("mode", ["dp", "ep"])
def test_resume_from_full_checkpoint(main_results, mode):
    results, _ = main_results
    model, _ = _reference_training(classifier_batches())
    for rank, result in enumerate(results):
        state = result[f"{mode}_step3"]
        for key, value in model.state_dict().items():
            _close(state[key], value, 1e-9, f"{mode} rank {rank} after resume: {key}")


@pytest.mark.slow  # (the torchrun of main_results)
def test_checkpoint_from_two_ranks_loads_in_one_process(main_results):
    results, out_dir = main_results
    model = SoftMoEClassifier((1, 8, 8), num_experts=4, num_classes=3).double()
    model.load_state_dict(load_tensors(out_dir / "ep_model.safetensors"))
    probe = classifier_batches()[2][0]
    with torch.no_grad():
        expected = model(probe)
    for key in ("ep_probe_out", "ep_local_load_out"):
        got = torch.cat([r[key] for r in results])
        _close(got, expected, 1e-12, key)
    dp_model = SoftMoEClassifier((1, 8, 8), num_experts=4, num_classes=3).double()
    dp_model.load_state_dict(load_tensors(out_dir / "dp_model.safetensors"))
    with torch.no_grad():
        _close(torch.cat([r["dp_probe_out"] for r in results]), dp_model(probe), 1e-12, "dp outputs")


@pytest.mark.slow  # (the torchrun of main_results)
def test_metrics_are_summed_over_ranks(main_results):
    results, _ = main_results
    for result in results:
        assert result["metrics"] == {"loss": 2.0, "seen": 7}
        assert isinstance(result["metrics"]["seen"], int)


@pytest.mark.slow
def test_bad_configurations_raise_on_every_rank(main_results):
    results = [result["bad"] for result in main_results[0]]
    expected = {
        "indivisible": "num_experts=3 is not divisible by the expert-parallel group size 2",
        "models_differ": "differ across ranks",
        "not_member": "rank 1 is not a member of the process group",
        "groups_differ": "rank 1 shards over ranks [0, 1] but rank 0 shards over [0]",
        "ddp_group": "experts are sharded over 1 ranks but data parallelism spans 2",
        "batch": "must be divisible by the number of ranks 2",
        "one_rank_wrong": "shard_experts: rank 1: Linear has no SoftMoE layer",
        "twice": "rank 0: the experts of layer '<model>' are already sharded",
        "checkpoint_experts": "experts.weight1: expected shape (4, 8, 32), got (6, 8, 32)",
    }
    for rank, errors in enumerate(results):
        for name, text in expected.items():
            assert errors[name] is not None, f"rank {rank}: {name} did not raise"
            assert text in errors[name], f"rank {rank}: {name}: {errors[name]}"
        assert errors["still_alive"] == WORLD


# ---------------------------------------------------------------------------------------------------------------------
# The training loop with the vision recipe (softmoe.train) under data parallelism


class _Interrupted(Exception):
    pass


def fit_splits():
    from softmoe.data import ImageDataset, Splits

    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 3, (56,), generator=g)
    images = torch.rand(56, 1, 8, 8, generator=g) * 0.5
    images[:, 0, labels.tolist(), :] += 0.5
    data = ImageDataset(images.clamp(0, 1), labels, 3, "tiny")
    return Splits(data.subset(slice(0, 24)), data.subset(slice(24, 40)), data.subset(slice(40, 56)))


class _Float64(nn.Module):
    """A float64 model on float32 images: sharded and whole batches then agree to rounding (1e-16), not 1e-7,
    which Adam would amplify on gradients that are zero in exact arithmetic (the key bias of attention)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.double()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images.double())


def fit_factory():
    from softmoe.models.vit import ViT

    return _Float64(
        ViT(
            image_size=8, patch_size=4, in_channels=1, num_classes=3, dim=8, depth=2, heads=2, mlp_dim=8,
            classifier="gap", moe_blocks=(1,), num_experts=4, expert_hidden=4, dropout=0.0,
        )
    )


def fit_config():
    from softmoe.train import TrainConfig

    # Shuffling, crop, flip, mixup, label smoothing and clipping at once (no dropout: its draws depend on the shard).
    return TrainConfig.vision(
        epochs=2, batch_size=8, lr=1e-2, warmup_epochs=0.5, label_smoothing=0.1, mixup_alpha=0.4, crop_padding=1,
        flip=True, clip_norm=0.5, seed=3,
    )


def _fit_first_epoch(rank: int, world: int, out_dir: Path, expert_parallel: bool) -> dict:
    """Epoch 1 of the vision recipe on ``world`` ranks, then an interruption on every rank."""
    import softmoe.train as train

    train_epoch = train._train_epoch

    def first_epoch_only(*args, **kwargs):
        if args[5] > 1:
            raise _Interrupted
        return train_epoch(*args, **kwargs)

    train._train_epoch = first_epoch_only
    ctx = DistContext(rank, world, expert_parallel=expert_parallel)
    try:
        train.train_classifier(fit_factory, fit_splits(), fit_config(), out_dir / "run", progress=False, dist=ctx)
    except _Interrupted:
        pass
    return {"files": sorted(p.name for p in (out_dir / "run").iterdir()) if rank == 0 else None}


def _worker_fit(rank: int, world: int, out_dir: Path) -> dict:
    return _fit_first_epoch(rank, world, out_dir, expert_parallel=False)


def _worker_fit_expert_parallel(rank: int, world: int, out_dir: Path) -> dict:
    return _fit_first_epoch(rank, world, out_dir, expert_parallel=True)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["data_parallel", "expert_parallel"])
def test_fit_two_ranks_match_one_process_and_resume(tmp_path, expert_parallel):
    """Epoch 1 on two ranks (DDP; or DDP with sharded experts, whose clipping uses the whole gradient's norm) equals
    one process, and its checkpoint (weights and AdamW state, gathered by torch.distributed.checkpoint) resumes in
    one process to the same end."""
    from softmoe.runs import finished_epochs, load_epoch
    from softmoe.train import train_classifier as fit

    results = run_ranks(_worker_fit_expert_parallel if expert_parallel else _worker_fit, tmp_path)
    assert results[0]["files"] == [
        ".lock", "epoch_001.json", "epoch_001.safetensors", "metrics.csv", "optimizer_001.safetensors", "run.json"
    ]
    reference, reference_history = fit(fit_factory, fit_splits(), fit_config(), tmp_path / "reference", progress=False)
    after_one = load_epoch(fit_factory(), tmp_path / "reference", 1).state_dict()
    saved = load_tensors(tmp_path / "run" / "epoch_001.safetensors")
    assert saved.keys() == after_one.keys()
    for key, value in after_one.items():
        _close(saved[key], value, 1e-5, f"epoch 1 on two ranks: {key}")
    saved_optimizer = load_tensors(tmp_path / "run" / "optimizer_001.safetensors")
    reference_optimizer = load_tensors(tmp_path / "reference" / "optimizer_001.safetensors")
    assert saved_optimizer.keys() == reference_optimizer.keys()
    for key, value in reference_optimizer.items():
        _close(saved_optimizer[key], value, 1e-5, f"optimizer state after epoch 1 on two ranks: {key}")
    two_rank_epoch = finished_epochs(tmp_path / "run")[0]
    assert two_rank_epoch["train_loss"] == pytest.approx(reference_history[0]["train_loss"], abs=1e-5)
    assert two_rank_epoch["val_accuracy"] == pytest.approx(reference_history[0]["val_accuracy"])
    resumed, history = fit(fit_factory, fit_splits(), fit_config(), tmp_path / "run", progress=False)
    assert len(history) == 2
    for key, value in reference.state_dict().items():
        _close(resumed.state_dict()[key], value, 1e-5, f"resumed in one process: {key}")


def _worker_clip(rank: int, world: int, out_dir: Path) -> dict:
    """Gradients of one global batch with sharded experts, clipped by the norm of the whole gradient."""
    ctx = DistContext(rank, world, expert_parallel=True)
    model = ctx.prepare(make_classifier())
    train_steps(model, _NoStep(), classifier_batches()[:1], ctx)
    total = clip_grad_norm_(model.parameters(), 0.01)
    grads = {name: _local(p.grad) for name, p in model.module.named_parameters()}
    return {"total": total, "grads": grads, "offset": model.module.moe.experts.expert_offset}


class _NoStep:
    """An optimizer that only clears gradients: train_steps leaves the gradients of its last batch."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


@pytest.mark.slow
def test_clipping_uses_the_norm_of_the_whole_gradient(main_results):
    results = [result["clip"] for result in main_results[0]]
    model = make_classifier()
    train_steps(model, _NoStep(), classifier_batches()[:1])
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    assert float(total) > 0.01  # the clip is active
    reference = {name: p.grad for name, p in model.named_parameters()}
    for rank, result in enumerate(results):
        _close(result["total"], total, 1e-12, f"rank {rank} total norm")
        for name, grad in result["grads"].items():
            expected = reference[name]
            if ".experts." in name:
                expected = expected[result["offset"] : result["offset"] + grad.shape[0]]
            _close(grad, expected, 1e-12, f"rank {rank} clipped gradient of {name}")


def _worker_four_ranks(rank: int, world: int, out_dir: Path) -> dict:
    """Two Adam steps with one expert per rank; the full checkpoint is written by rank 0."""
    ctx = DistContext(rank, world, expert_parallel=True)
    model = ctx.prepare(make_classifier())
    assert model.module.moe.experts.num_local_experts == 1
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, optimizer, classifier_batches()[:2], ctx)
    state, optim = full_state_dict(model), full_optimizer_tensors(model, optimizer)
    if ctx.is_main:
        save_tensors(out_dir / "model.safetensors", state)
        save_tensors(out_dir / "optim.safetensors", optim)
    return {"entries": len(state)}


@pytest.mark.slow
def test_a_model_trained_on_four_ranks_resumes_in_one_process(tmp_path):
    results = run_ranks(_worker_four_ranks, tmp_path, world=4)
    assert [r["entries"] for r in results][1:] == [0, 0, 0]  # written by rank 0 only
    model = make_classifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    load_full_state_dict(model, load_tensors(tmp_path / "model.safetensors"))
    load_full_optimizer_tensors(model, optimizer, load_tensors(tmp_path / "optim.safetensors"))
    train_steps(model, optimizer, classifier_batches()[2:])
    reference, _ = _reference_training(classifier_batches())  # three steps in one process
    for key, value in reference.state_dict().items():
        _close(model.state_dict()[key], value, 1e-9, f"trained on 4 ranks, resumed on 1: {key}")


# ---------------------------------------------------------------------------------------------------------------------
# Single-process behaviour (no process group)


def test_local_context_is_the_single_process_loop():
    images, labels = torch.rand(5, 1, 8, 8), torch.tensor([0, 1, 2, 0, 1])
    assert not LOCAL.is_distributed and LOCAL.is_main
    shard_images, shard_labels = LOCAL.shard(images, labels)
    assert torch.equal(shard_images, images) and torch.equal(shard_labels, labels)
    losses = torch.rand(5)
    assert torch.equal(LOCAL.global_mean(losses.sum(), 5), losses.sum() / 5)
    assert LOCAL.reduce(loss=1.5, seen=5) == {"loss": 1.5, "seen": 5}
    assert LOCAL.broadcast_object([1, 2]) == [1, 2]
    model = SoftMoEClassifier((1, 8, 8), 4, 3)
    assert LOCAL.prepare(model) is model and unwrap(model) is model
    assert full_state_dict(model).keys() == model.state_dict().keys()
    assert LOCAL.local_batch_size(256) == 256


def test_sharding_splits_the_global_batch():
    batch = torch.arange(10)
    parts = [DistContext(rank, 4).shard(batch)[0] for rank in range(4)]
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert torch.equal(torch.cat(parts), batch)
    assert local_batch_size(256, 4) == 64
    with pytest.raises(ValueError, match="256 is the global batch and must be divisible by the number of ranks 3"):
        local_batch_size(256, 3)


def test_setup_without_torchrun_is_single_process(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    ctx = setup_distributed(expert_parallel=True)
    assert (ctx.rank, ctx.world_size, ctx.is_main, ctx.expert_parallel) == (0, 1, True, True)
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        setup_distributed()


def test_shard_experts_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialized torch.distributed process group"):
        shard_experts(SoftMoE(8, 4))
