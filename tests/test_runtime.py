"""softmoe.runtime.tune_cpu_allocator: returns a bool, is idempotent, declines cleanly without glibc's mallopt.

The C libraries CI lacks (none loadable, one without mallopt, a mallopt that fails) and other platforms are
simulated where the module meets them: ctypes.CDLL and sys.platform."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from softmoe import runtime


def test_returns_bool_and_is_idempotent():
    first = runtime.tune_cpu_allocator()
    second = runtime.tune_cpu_allocator()
    assert isinstance(first, bool)
    assert first is second
    # Allocation still works normally afterwards, large blocks included.
    big = torch.ones(1 << 22)
    assert float(big.sum()) == float(1 << 22)


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"), reason="glibc only"
)
def test_applied_on_glibc():
    assert runtime.tune_cpu_allocator() is True


def test_false_when_mallopt_cannot_be_found(monkeypatch):
    def unloadable(name):
        raise OSError("no C library to load")

    monkeypatch.setattr(runtime.ctypes, "CDLL", unloadable)
    assert runtime.tune_cpu_allocator() is False


def test_false_when_libc_has_no_mallopt(monkeypatch):
    class NoMallopt:
        def __init__(self, name):
            pass

        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(runtime.ctypes, "CDLL", NoMallopt)
    assert runtime.tune_cpu_allocator() is False  # (without raising: the lookup's AttributeError is caught)


def test_false_off_linux(monkeypatch):
    monkeypatch.setattr(runtime.sys, "platform", "darwin")
    assert runtime.tune_cpu_allocator() is False


def test_false_when_mallopt_reports_an_error(monkeypatch):
    calls = []

    def failing_mallopt(param, value):
        calls.append((param, value))
        return 0

    class FailingGlibc:  # glibc whose mallopt returns 0 (an error) for every setting
        gnu_get_libc_version = object()

        def __init__(self, name):
            self.mallopt = failing_mallopt

    monkeypatch.setattr(runtime.sys, "platform", "linux")  # (where glibc is looked for)
    monkeypatch.setattr(runtime.ctypes, "CDLL", FailingGlibc)
    assert runtime.tune_cpu_allocator() is False
    assert {param for param, _ in calls} == {runtime.M_TRIM_THRESHOLD, runtime.M_MMAP_MAX}
