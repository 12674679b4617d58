"""Process-level runtime settings that make the CPU path fast.

:func:`tune_cpu_allocator` keeps large tensors on glibc's heap instead of fresh ``mmap`` pages.

Why: PyTorch's CPU allocator is a thin wrapper around ``posix_memalign``/``free``. glibc serves every block above
its mmap threshold (128 KiB at start, adapting up to 32 MiB) with a fresh anonymous ``mmap`` and returns it to the
kernel with ``munmap`` on free. A tensor of hundreds of MB, such as the weight gradient of a large expert bank,
is therefore allocated from scratch at every step, and the first write to each of its 4 KiB pages costs a page
fault plus zeroing by the kernel, which can cost more than the copy or product that fills the tensor
(docs/performance.md has the measurements). The PyTorch CPU performance tuning guide recommends a caching allocator
such as jemalloc or tcmalloc (``LD_PRELOAD``) for the same reason; this function gets the same effect for large
blocks without any extra library.

How: ``mallopt(M_MMAP_MAX, 0)`` makes glibc serve all blocks from the heap (``brk``), and
``mallopt(M_TRIM_THRESHOLD, 2**31 - 1)`` stops it from handing freed heap memory back to the kernel, so a freed
300 MB block is reused, already faulted in, by the next allocation of that size. The same settings can be
given without code through the environment variables ``MALLOC_MMAP_MAX_=0`` and
``MALLOC_TRIM_THRESHOLD_=2147483647``.

Trade-offs:

- The process's resident memory no longer shrinks after large tensors are freed (it stays at its peak, as with
  any caching allocator).
- The heap can fragment: a freed large block whose start is then taken by small allocations no longer fits the
  next large block of the same size, which goes to the top of the heap instead. The peak resident memory can end
  well above the default allocator's, and an autograd pattern that allocates one full-size zero gradient per
  ``t[:, j]`` slice of a large tensor can grow the tuned process to many times that tensor's size
  (docs/performance.md has the measurements).
  Call it in processes whose large allocations repeat step after step (training and inference loops), not in
  long-lived services with very irregular allocation sizes.
- Blocks still served from ``mmap`` (allocations made by threads that glibc gave their own arena, when that arena
  cannot grow) behave as before.

Alternatives: ``LD_PRELOAD`` of jemalloc or tcmalloc; or PyTorch's ``THP_MEM_ALLOC_ENABLE=1`` (2 MB transparent huge
pages for large tensors, which also cuts the page faults; do not combine the two, the combination is slower than
either).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from collections.abc import Callable

__all__ = ["cpu_model", "cpu_signature", "tune_cpu_allocator"]

# glibc's <malloc.h> parameter numbers.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
# Largest value mallopt accepts (a C int): freed heap memory is practically never trimmed.
TRIM_THRESHOLD = 2**31 - 1


def _find_mallopt() -> Callable[[int, int], int] | None:
    """glibc's ``mallopt`` as a ctypes function, or None on any other platform or C library."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded in this process, libc included
        libc.gnu_get_libc_version  # noqa: B018  present in glibc only (musl also has a stub mallopt)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt


def tune_cpu_allocator() -> bool:
    """Serve large CPU tensors from glibc's heap and keep freed memory for reuse; True if applied.

    Returns False, changing nothing, where the C library is not glibc (macOS, Windows, musl). Idempotent:
    calling it again sets the same two values. See the module docstring for the reason and the trade-off
    (resident memory stays at its peak).
    """
    mallopt = _find_mallopt()
    if mallopt is None:
        return False
    # mallopt returns 1 on success and 0 on error.
    trim_ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    mmap_ok = mallopt(M_MMAP_MAX, 0) == 1
    return trim_ok and mmap_ok


def _cpuinfo(field: str) -> str | None:
    """The first value of ``field`` in /proc/cpuinfo, or None (no such file or field)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo on Linux), else what the platform module knows."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def cpu_signature() -> tuple[str, int, bool]:
    """(vendor, family, AVX-512) of the CPU, from /proc/cpuinfo: ``vendor_id`` ("GenuineIntel", "AuthenticAMD", ...),
    ``cpu family`` and whether its flags hold avx512f; ("", 0, False) where it does not say."""
    family = _cpuinfo("cpu family")
    flags = (_cpuinfo("flags") or "").split()
    return _cpuinfo("vendor_id") or "", int(family) if family and family.isdigit() else 0, "avx512f" in flags
