"""Suite-wide settings."""

import shutil
import sys

import pytest
import torch

from softmoe.kernels import native_available, native_status


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
