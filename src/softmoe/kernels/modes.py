"""The execution modes the kernels' dispatch rules look at: gradients, torch.func transforms, torch.compile,
autocast, and what watches the dispatcher; and the autograd Function that runs an op's code where nothing does."""

from __future__ import annotations

import torch

from softmoe.compat import dispatcher_watched as _dispatcher_watched
from softmoe.compat import transforms_active


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd would record an operation on ``tensors`` (grad mode on and one of them requires grad)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def host_reads_are_free(x: torch.Tensor) -> bool:
    """Whether reading ``x``'s values on the host costs nothing: a CPU tensor, outside torch.compile and torch.func
    transforms (elsewhere a read synchronizes with the device or breaks the graph)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and not transforms_active()


def plain_eager_mode(device_type: str) -> bool:
    """Whether ops run as written: not traced by torch.compile, not under torch.func transforms, and autocast off
    for ``device_type`` (hand-written autograd Functions serve only this mode; softmoe's native ops, registered as
    custom ops, do not need it)."""
    return (
        not torch.compiler.is_compiling()
        and not transforms_active()
        and not torch.is_autocast_enabled(device_type)
    )


def eager_inference(device_type: str, *tensors: torch.Tensor | None) -> bool:
    """Whether ops on ``tensors`` run as written and record no gradient: plain eager mode for ``device_type``
    (:func:`plain_eager_mode`) and no gradient recorded for them (:func:`needs_grad`), in reverse or forward mode."""
    return _eager_inference(device_type, tensors)


def dispatcher_watched(*tensors: torch.Tensor | None) -> bool:
    """Whether something watches the dispatcher and would miss an op's code called directly: a tensor subclass
    with its own ``__torch_function__`` among ``tensors``, a TorchDispatchMode or TorchFunctionMode (e.g.
    ``FlopCounterMode``), the profiler, or ``torch.jit.trace``."""
    return _dispatcher_watched(tensors)


def direct_call_ok(device_type: str, *tensors: torch.Tensor | None) -> bool:
    """Whether an op's code may be called directly, without the dispatcher's host time (paid on every call;
    docs/performance.md has the measurements): :func:`eager_inference` and nothing watches the dispatcher
    (:func:`dispatcher_watched`). In an op's backward formula (no gradient recorded unless ``create_graph``) this
    is what lets it call its backward op's code directly."""
    return _eager_inference(device_type, tensors) and not _dispatcher_watched(tensors)


def direct_autograd_ok(device_type: str, *tensors: torch.Tensor | None) -> bool:
    """Whether an op may run as :func:`direct_function`'s autograd.Function, gradients recorded or not: plain eager
    mode (:func:`plain_eager_mode`), no forward-mode AD level open and nothing watching the dispatcher; torch.compile,
    torch.func, autocast, the profiler and dispatch modes see the op itself. A custom op's own autograd (the
    dispatcher, then torch.library's Python wrappers binding and checking the arguments) costs host time per op,
    forward and backward each, which a small layer such as the paper's MNIST layer feels in every call
    (docs/performance.md has the measurements)."""
    return plain_eager_mode(device_type) and not _dispatcher_watched(tensors)


def direct_function(name: str, run, setup_context, backward) -> type[torch.autograd.Function]:
    """An autograd.Function (class ``name``, nodes ``name`` + "Backward") that runs a custom op's code
    ``run(*inputs) -> outputs`` and differentiates it with the op's own autograd registration
    (``setup_context(ctx, inputs, output)`` and ``backward(ctx, *grads)``, as given to ``register_autograd``): the
    op's math and saved tensors without the dispatcher, for eager calls where :func:`direct_autograd_ok`.
    ``Function.apply(*inputs)`` takes the op's arguments in order."""

    # forward(ctx, ...) rather than a separate setup_context: apply then skips binding the arguments to forward's
    # signature (inspect.signature, on every call), which only torch.func transforms need.
    def forward(ctx, *inputs):
        output = run(*inputs)
        setup_context(ctx, inputs, output)
        return output

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


# The checks on a tuple of tensors, the calls written out: they run a few times in every layer call, where each
# Python call and repacking of the tensors adds host time.
def _eager_inference(device_type: str, tensors: tuple) -> bool:
    return plain_eager_mode(device_type) and not (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    )
