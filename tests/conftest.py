"""Suite-wide settings."""

import os
import shutil
import sys

import pytest
import torch

# Without a GPU softmoe's Triton kernels run on the CPU in Triton's interpreter, so that the default suite (CI: 2
# cores, no GPU) checks them. triton.jit reads the variable when it decorates a function, Triton's own (tl.zeros...)
# included, so it is set before anything imports Triton: softmoe does, through torch._dynamo.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import softmoe.kernels as kernels
from softmoe.kernels import ISAS, native_available, native_status, use_isa


@pytest.fixture(autouse=True, scope="session")
def _single_thread():
    """The tests use tiny tensors: one intra-op thread avoids OpenMP start-up and spin costs, which on a 2-core
    machine shared with other processes make small ops 10-20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def library():
    """The built native kernels. On Linux (CI included) a C++ compiler is part of the supported set-up, so none is a
    failure."""
    if sys.platform.startswith("linux"):
        assert shutil.which("c++") or shutil.which("g++"), "a C++ compiler (c++) is needed to build softmoe's kernels"
    assert native_available(), f"softmoe could not build its native kernels (csrc): {native_status()}"
    return native_status()


@pytest.fixture(params=ISAS)
def isa(request, library):
    """Each kernel variant in turn, run through use_isa (a variant this CPU lacks is skipped)."""
    if request.param not in kernels.supported_isas():
        pytest.skip(f"this CPU lacks {request.param} (it runs {', '.join(kernels.supported_isas())})")
    with use_isa(request.param):
        yield request.param


@pytest.fixture
def row_isa(request, library):
    """The kernel variant of a pairwise grid's row (tests.grids), run through use_isa; a variant this CPU lacks runs
    as the best one it has, so that the row's other pairs of values are still met."""
    isa = request.param if request.param in kernels.supported_isas() else kernels.supported_isas()[0]
    with use_isa(isa):
        yield isa


@pytest.fixture
def threads(request):
    """torch's thread count (which the kernels use) set to request.param for the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
