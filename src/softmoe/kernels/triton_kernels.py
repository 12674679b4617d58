"""softmoe's Triton kernels as their ops see them: each module imported at its kernel's first launch (so that
``import softmoe`` never loads Triton), and a kernel whose launch fails turned off for the rest of the process."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import warnings
from types import ModuleType


@functools.cache
def triton_installed() -> bool:
    """Whether Triton can be imported (it comes with torch's CUDA builds) and is not turned off
    (``SOFTMOE_TRITON=0``: every op takes its path without Triton)."""
    return os.environ.get("SOFTMOE_TRITON", "1") != "0" and importlib.util.find_spec("triton") is not None


class TritonKernel:
    """The Triton kernel of one op: its module ``module`` (which defines ``launch``), named ``name`` in the warning
    a failed launch gives, which ends with ``fallback`` (what runs instead from then on)."""

    def __init__(self, module: str, name: str, fallback: str) -> None:
        self.module_name, self.name, self.fallback = module, name, fallback
        self.failure: str | None = None  # why a launch failed in this process (not tried again), or None

    def available(self) -> bool:
        """Whether the kernel may run: Triton installed and not turned off, and no launch of it failed in this
        process (Triton compiles a launcher at its first use, which needs a C compiler)."""
        return self.failure is None and triton_installed()

    def module(self) -> ModuleType:
        """The kernel's module, imported at the first call (it imports Triton)."""
        return importlib.import_module(self.module_name)

    def launch_failed(self, error: Exception) -> None:
        """Remember that a launch failed (the kernel is not tried again in this process) and say so once."""
        self.failure = f"{type(error).__name__}: {error}"
        warnings.warn(
            f"softmoe: {self.name} (Triton) could not run ({self.failure}); {self.fallback} in this process",
            RuntimeWarning,
            stacklevel=3,
        )
