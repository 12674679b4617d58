"""Shared helpers for the benchmark scripts: timing, the machine's measured limits, a roofline, markdown tables.

All times are in seconds. Timings on a shared CPU are noisy: report the minimum (or the median) of several
repeats taken after a warm-up, and time the things being compared round-robin in the same run
(:func:`measure_interleaved`) so that a change of load affects them alike. On a GPU every timed call ends with a
synchronization of its device, so a time is the work's, not its launch's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from softmoe.checkpoint import write_json
from softmoe.kernels import onednn_applies, onednn_linear
from softmoe.runtime import cpu_model

MATMUL_SIZE = 2048
COPY_BYTES = 256 * 2**20

# What limits a process to one instruction set: softmoe's kernels (SOFTMOE_ISA) and torch's own, MKL, oneDNN and
# ATen's vectorized CPU kernels, so that an AVX-512 host runs what an AVX2 host would ("native": the host's best).
ISA_ENVIRONMENT = {
    "native": {},
    "avx512": {"SOFTMOE_ISA": "avx512"},
    "avx2": {"SOFTMOE_ISA": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "ATEN_CPU_CAPABILITY": "avx2"},
}
ALLOCATORS = ("default", "tuned")


def add_process_arguments(parser) -> None:
    """--isa and --allocator, each taking one value or a comma-separated list (see :func:`run_processes`)."""
    parser.add_argument("--isa", default="native", help="instruction sets to run under, comma-separated, of "
                        f"{sorted(ISA_ENVIRONMENT)} (default: native, the host's best)")
    parser.add_argument("--allocator", default="default", help="'default' (glibc as it comes), 'tuned' "
                        "(softmoe.runtime.tune_cpu_allocator) or both, comma-separated (default: default)")
    parser.add_argument("--child-json", help=argparse.SUPPRESS)


def process_settings(args) -> list[tuple[str, str]]:
    """The (isa, allocator) pairs asked for, checked (a ValueError names a bad value)."""
    isas, allocators = args.isa.split(","), args.allocator.split(",")
    for isa in isas:
        if isa not in ISA_ENVIRONMENT:
            raise ValueError(f"--isa: expected one of {sorted(ISA_ENVIRONMENT)}, got {isa!r}")
    for allocator in allocators:
        if allocator not in ALLOCATORS:
            raise ValueError(f"--allocator: expected one of {ALLOCATORS}, got {allocator!r}")
    return [(isa, allocator) for isa in isas for allocator in allocators]


def run_processes(args, argv: list[str]) -> list[dict]:
    """Run this script once per (isa, allocator) of ``args``, each in a fresh process under that instruction set
    (:data:`ISA_ENVIRONMENT`), one after the other; return what each wrote with ``--child-json``.

    A child is started with the same arguments plus ``--isa ISA --allocator ALLOCATOR --child-json PATH`` and must
    call :func:`apply_allocator` first and write its results (a dict) to PATH."""
    results = []
    for isa, allocator in process_settings(args):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "child.json")
            env = os.environ | ISA_ENVIRONMENT[isa]
            command = [sys.executable, sys.argv[0], *argv, "--isa", isa, "--allocator", allocator,
                       "--child-json", path]
            print(f"\n==== {isa} instruction set, {allocator} allocator ====", flush=True)
            status = subprocess.run(command, env=env).returncode
            if status != 0:
                how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
                hint = " (SIGKILL: out of memory?)" if status == -9 else ""
                sys.exit(f"error: the {isa} / {allocator} process {how}{hint}")
            with open(path) as f:
                results.append(json.load(f) | {"isa": isa, "allocator": allocator})
    return results


def run_children(parser: argparse.ArgumentParser, args, argv: list[str]) -> bool:
    """In a parent asked for instruction sets or allocators other than its own: run one child per setting
    (:func:`run_processes`), write all their results to ``--json`` where given, and return True (the caller is done);
    else (a child, or the host's own setting) False: the caller measures in this process. A bad --isa or
    --allocator ends the script through ``parser.error``."""
    try:
        settings = process_settings(args)
    except ValueError as error:
        parser.error(str(error))
    if args.child_json is not None or settings == [("native", args.allocator)]:
        return False
    results = run_processes(args, passed_on(argv))
    if args.json:
        write_json(args.json, {"processes": results})
    return True


def cpu_header(env: dict, allocator: str) -> str:
    """The line a CPU benchmark prints first: CPU model, threads, instruction sets, torch, date, allocator."""
    return (f"# {env['cpu']} ({torch.get_num_threads()} threads), {isa_line()}, torch {torch.__version__}, "
            f"{env['date']}; {allocator}")


def write_results(args, results: dict) -> None:
    """This process's results (a dict) to ``--child-json`` for its parent, else to ``--json`` where given."""
    if args.child_json or args.json:
        write_json(args.child_json or args.json, results)


def passed_on(argv: list[str]) -> list[str]:
    """The arguments a child process gets from the parent's: all but --isa, --allocator and --json (the parent's)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--isa", "--allocator", "--json"):
            skip = True
        elif not arg.startswith(("--isa=", "--allocator=", "--json=")):
            kept.append(arg)
    return kept


def apply_allocator(allocator: str) -> str:
    """Tune glibc's allocator for large blocks when ``allocator`` is "tuned"; a line saying what is in effect."""
    from softmoe.runtime import tune_cpu_allocator

    if allocator == "tuned":
        applied = tune_cpu_allocator()
        return ("allocator tuned (softmoe.runtime.tune_cpu_allocator: M_MMAP_MAX=0, M_TRIM_THRESHOLD=2**31-1)"
                if applied else "allocator: tuning not applied (not glibc)")
    return "allocator: default (glibc as it comes)"


def isa_line() -> str:
    """The instruction sets in effect in this process: softmoe's kernels and what limits torch's libraries."""
    from softmoe.kernels import cpu_isa

    limits = [f"{key}={os.environ[key]}" for key in ("MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                                                      "ATEN_CPU_CAPABILITY") if key in os.environ]
    return (f"softmoe kernels {cpu_isa() or 'unavailable'}; torch CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}" + (f" ({', '.join(limits)})" if limits else ""))


def _stats(times: Sequence[float]) -> dict[str, float]:
    return {
        "min": min(times),
        "median": statistics.median(times),
        "std": statistics.pstdev(times) if len(times) > 1 else 0.0,
        "repeats": len(times),
    }


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], object], device: torch.device | str) -> float:
    """Seconds one call of ``fn`` takes, its device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def measure(fn: Callable[[], object], warmup: int = 2, repeats: int = 10, device: str = "cpu") -> dict[str, float]:
    """Run ``fn`` ``warmup`` times untimed, then ``repeats`` timed times -> dict(min, median, std, repeats) in seconds.

    The result of each call is dropped before the next one starts, so freed memory can be reused.
    """
    return measure_interleaved({"fn": fn}, warmup, repeats, device=device)["fn"]


def measure_interleaved(
    fns: Mapping[str, Callable[[], object]],
    warmup: int = 2,
    repeats: int = 10,
    budget_s: float | None = None,
    min_repeats: int = 3,
    device: torch.device | str = "cpu",
    burst: int = 1,
    setups: Mapping[str, Callable[[], object]] | None = None,
) -> dict[str, dict[str, float]]:
    """Like :func:`measure` for several functions timed round-robin (``burst`` calls of each per round).

    Returns ``{name: dict(min, median, std, repeats)}``. Interleaving makes the comparison fair when the load
    on the machine changes during the run; each round takes the functions in a new (seeded) random order, so that
    no function always runs right after the same other one. With ``budget_s``, rounds stop once that many seconds
    have been spent timing (after at least ``min_repeats`` rounds), so slow cases cannot stretch a run. ``device``:
    where the functions queue their work (each timed call waits for it).

    With ``burst`` > 1 each function runs that many times in a row per round: the first call of a burst follows
    another function (caches filled with its data, the thread pool possibly asleep) and is reported apart, as
    ``cold`` (the same statistics), the others make the main statistics: the function's time when it runs again and
    again, as in a training loop or under ``timeit``.

    ``setups``: per name, a function run untimed before each call of that function (what the call needs in place,
    e.g. a layer's selector).
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if burst < 1:
        raise ValueError(f"burst must be >= 1, got {burst}")
    setups = setups or {}

    def prepared(name: str) -> Callable[[], object]:
        setups.get(name, lambda: None)()
        return fns[name]

    for _ in range(warmup):
        for name in fns:
            prepared(name)()
    times: dict[str, list[float]] = {name: [] for name in fns}
    cold: dict[str, list[float]] = {name: [] for name in fns}
    spent = 0.0
    order, shuffle = list(fns), random.Random(0).shuffle
    for done in range(repeats):
        if budget_s is not None and done >= min_repeats and spent >= budget_s:
            break
        for name in order:
            for call in range(burst):
                elapsed = timed_call(prepared(name), device)
                (cold if burst > 1 and call == 0 else times)[name].append(elapsed)
                spent += elapsed
        shuffle(order)
    if burst == 1:
        return {name: _stats(t) for name, t in times.items()}
    return {name: _stats(t) | {"cold": _stats(cold[name])} for name, t in times.items()}


def machine_limits(
    repeats: int = 5,
    matmul_size: int = MATMUL_SIZE,
    copy_bytes: int = COPY_BYTES,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict:
    """The machine's limits on ``device`` for ``dtype`` matrices, measured now (on the CPU with torch's current
    thread count).

    - ``flops_per_s``: ``torch.matmul`` of two (size, size) matrices into a preallocated output, 2*size^3 FLOPs
      over the minimum time of ``repeats`` (2048 on the CPU; use 8192 on a GPU); for float32 on the CPU the faster
      of it (MKL) and oneDNN's product of the same matrices: on CPUs not made by Intel MKL keeps to its AVX2 code
      and reaches half of what the machine can (AMD EPYC Zen 5: 215 GFLOP/s against oneDNN's 442).
    - ``bytes_per_s``: ``copy_`` between two preallocated tensors of ``copy_bytes`` bytes, counting the bytes read
      plus the bytes written over the minimum time.
    - ``read_bytes_per_s``: ``sum`` of the same bytes, bytes read over the minimum time: the rate at which a
      kernel that only reads (an expert product streaming its weights) can at best get data. Reported beside the
      roofline, not part of it.
    """
    a = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    b = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    c = torch.empty(matmul_size, matmul_size, device=device, dtype=dtype)
    mm = measure(lambda: torch.matmul(a, b, out=c), warmup=2, repeats=repeats, device=device)
    flops = 2.0 * matmul_size**3
    name = str(dtype).removeprefix("torch.")
    matmul, product = mm["min"], f"{name} torch.matmul"
    if torch.device(device).type == "cpu" and onednn_applies(a, b):
        onednn = measure(lambda: onednn_linear(a, b), warmup=2, repeats=repeats, device=device)["min"]
        if onednn < matmul:
            matmul, product = onednn, f"{name} oneDNN linear (torch.matmul {flops / mm['min'] / 1e9:.0f} GFLOP/s)"
    numel = copy_bytes // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty(numel, device=device)
    cp = measure(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=device)
    rd = measure(src.sum, warmup=2, repeats=repeats, device=device)
    return {
        "flops_per_s": flops / matmul,
        "bytes_per_s": 2.0 * copy_bytes / cp["min"],
        "read_bytes_per_s": copy_bytes / rd["min"],
        "matmul": f"{product} {matmul_size}^3 on {device}, min of {repeats}",
        "copy": f"copy_ of {copy_bytes // 2**20} MiB, read+write bytes, min of {repeats}",
        "read": f"sum of {copy_bytes // 2**20} MiB, bytes read, min of {repeats}",
        "threads": torch.get_num_threads(),
    }


def roofline_seconds(flops: float, nbytes: float, limits: Mapping[str, float]) -> float:
    """The roofline time: ``max(flops / peak FLOP/s, bytes / copy bandwidth)``, with limits from :func:`machine_limits`."""
    return max(flops / limits["flops_per_s"], nbytes / limits["bytes_per_s"])


def environment() -> dict:
    """Machine, software and date, for the header of a benchmark report."""
    return {
        "cpu": cpu_model(),
        "isa": isa_line(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average_1min": load_average(),
    }


def load_average() -> float | None:
    """The 1-minute load average (None where unavailable)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _busy_cpu_seconds() -> float | None:
    """CPU seconds spent busy by all processes since boot, from /proc/stat (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class OtherLoad:
    """Context manager measuring how many cores *other* processes kept busy meanwhile (Linux; else None).

    ``value`` = (CPU seconds busy machine-wide - this process's CPU seconds) / wall seconds. Above about 0.2 the
    multi-threaded timings taken meanwhile are inflated: every parallel region waits for descheduled threads.
    """

    def __enter__(self) -> "OtherLoad":
        self.value: float | None = None
        self._busy, self._own, self._wall = _busy_cpu_seconds(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        busy = _busy_cpu_seconds()
        wall = time.perf_counter() - self._wall
        if busy is None or self._busy is None or wall <= 0:
            return
        own = time.process_time() - self._own
        self.value = max(0.0, (busy - self._busy - own) / wall)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one character per column, 'l' or 'r' (default: all right)."""
    align = align or "r" * len(headers)
    if len(align) != len(headers):
        raise ValueError("align must have one character per column")
    cells = [[str(c) for c in row] for row in rows]
    for row in cells:
        if len(row) != len(headers):
            raise ValueError(f"row {row} has {len(row)} cells, expected {len(headers)}")
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [v.ljust(w) if a == "l" else v.rjust(w) for v, w, a in zip(values, widths, align)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in cells)])


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> None:
    print(markdown_table(headers, rows, align), flush=True)
