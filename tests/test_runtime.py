"""softmoe.runtime.tune_cpu_allocator: returns a bool, is idempotent, declines cleanly without glibc's mallopt."""

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
    monkeypatch.setattr(runtime, "_find_mallopt", lambda: None)
    assert runtime.tune_cpu_allocator() is False


def test_false_when_libc_has_no_mallopt(monkeypatch):
    class NoMallopt:
        def __init__(self, name):
            pass

        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(runtime.ctypes, "CDLL", NoMallopt)
    assert runtime._find_mallopt() is None
    assert runtime.tune_cpu_allocator() is False


def test_false_off_linux(monkeypatch):
    monkeypatch.setattr(runtime.sys, "platform", "darwin")
    assert runtime.tune_cpu_allocator() is False


def test_false_when_mallopt_reports_an_error(monkeypatch):
    calls = []

    def failing_mallopt(param, value):
        calls.append((param, value))
        return 0

    monkeypatch.setattr(runtime, "_find_mallopt", lambda: failing_mallopt)
    assert runtime.tune_cpu_allocator() is False
    assert {param for param, _ in calls} == {runtime.M_TRIM_THRESHOLD, runtime.M_MMAP_MAX}
