"""Slow, obviously-correct reference pieces shared by the tests, written from the formulas."""

import contextlib
import io
import math
import os
import subprocess
from pathlib import Path

import torch


def ref_activation(name: str, t: torch.Tensor) -> torch.Tensor:
    if name == "gelu":
        return 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * t * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (t + 0.044715 * t**3)))
    if name == "relu":
        return torch.where(t > 0, t, torch.zeros_like(t))
    raise AssertionError(name)


# The grouped products of Algorithm 1's selected plan (one contract: softmoe.kernels.grouped_mm): the generic op and
# the "cpu" backend's.
GROUPED_PRODUCTS = ("softmoe::grouped_mm", "softmoe::native_grouped_mm")


def kernels_called(fn) -> set[str]:
    """The names of the operators that ``fn()`` ran (torch profiler), e.g. "mkldnn::_linear_pointwise"."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, computed in float64."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30)).item()


def output_and_gradients(layer, x: torch.Tensor, grad: torch.Tensor, mask: torch.Tensor | None = None) -> list:
    """[layer(x), d x, d every parameter] for the upstream gradient ``grad``, from fresh gradients."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = layer(x) if mask is None else layer(x, mask)
    out.backward(grad)
    return [out.detach(), x.grad] + [p.grad for p in layer.parameters()]


def run_cli(*args: str, cwd: Path | None = None, umask: int | None = None) -> subprocess.CompletedProcess:
    """Run the command line ``softmoe ARGS`` (``softmoe.cli.main``) in this process, from ``cwd`` and with ``umask``
    where given, its output captured: what ``python -m softmoe ARGS`` does, without starting an interpreter."""
    from softmoe.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_umask = os.umask(umask) if umask is not None else None
    try:
        with contextlib.chdir(cwd or Path.cwd()), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit:  # argparse's usage errors and --help
                code = exit.code if isinstance(exit.code, int) else 2
    finally:
        if saved_umask is not None:
            os.umask(saved_umask)
    return subprocess.CompletedProcess(["softmoe", *args], code, out.getvalue(), err.getvalue())
