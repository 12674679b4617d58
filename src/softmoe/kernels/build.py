"""Building, caching and loading softmoe's native CPU kernels, and choosing the instruction set they run with.

The kernels (``softmoe/csrc``) are one PyTorch C++ extension, built on first use with
``torch.utils.cpp_extension.load`` (the C++ compiler $CXX, else ``c++``, driven by ninja) into
``native_cache_dir()/native-<key>``, where the key hashes the sources, the flags, the torch version and the Python
ABI: a changed source builds anew, an unchanged one is imported from the cache without running the compiler (or
ninja) again. An exclusive file lock (``native-<key>.lock``, fcntl) around the build makes concurrent first uses
safe: one process builds, the others wait and import its result. The build is marked complete only after it
imported.

One build serves any x86-64 host: every kernel source is compiled three times, for AVX-512 (F, BW, DQ, VL and FMA;
16 float lanes), AVX2 (and FMA; 8 lanes) and the compiler's baseline ("portable": SSE2 on x86-64, 4 lanes; the only
variant on other machines), and the binding picks one at run time, the best this CPU supports
(``__builtin_cpu_supports``). ``SOFTMOE_ISA=avx512|avx2|portable`` asks for one: an instruction set this CPU lacks
(or an unknown name) gives a warning and the best supported one. :func:`use_isa` runs a given variant for a while
(for tests and measurements); :func:`cpu_isa` says which one runs.

``SOFTMOE_NATIVE=0`` turns the native kernels off. Without a C++ compiler or ninja, or when the build fails, they
are unavailable: :func:`native_available` is False, :func:`native_status` says why in one line, one warning per
process says so, and softmoe runs torch's ops.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import sysconfig
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

try:
    import fcntl
except ImportError:  # not POSIX: concurrent first uses are not locked against each other
    fcntl = None  # type: ignore[assignment]

CSRC = Path(__file__).resolve().parent.parent / "csrc"
# The kernel variants, best first, and the float lanes of their vectors.
ISAS = ("avx512", "avx2", "portable")
LANES = {"avx512": 16, "avx2": 8, "portable": 4}
KERNELS = ("expert_matmul", "soft_moe_small", "soft_moe_routing", "top_k_combine")
SOURCES = ("bindings.cpp", "autograd.cpp", *(f"{kernel}_{isa}.cpp" for kernel in KERNELS for isa in ISAS))
HEADERS = ("kernels.h", "variant.h", "vector_math.h", *(f"{kernel}.h" for kernel in KERNELS))
# -ffp-contract=fast: multiply-adds become FMAs where the variant has them (ISO C++ mode, which cpp_extension uses,
# would otherwise leave them apart). No -march: the variants raise the instruction set themselves (variant.h).
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
LDFLAGS = ("-fopenmp",)
BUILD_FORMAT = "1"  # changes the key when the way the extension is built changes


def native_cache_dir() -> Path:
    """Where built kernels are kept: $SOFTMOE_CACHE, else $XDG_CACHE_HOME/softmoe, else ~/.cache/softmoe."""
    if os.environ.get("SOFTMOE_CACHE"):
        return Path(os.environ["SOFTMOE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "softmoe"


def build_key(csrc: Path = CSRC) -> str:
    """The cache key of a build from the sources in ``csrc``: a hash of every source and header, the compiler flags,
    the torch version and the Python ABI (not the CPU: the build serves every x86-64 CPU)."""
    digest = hashlib.sha256()
    for name in sorted(SOURCES + HEADERS):
        digest.update(name.encode() + b"\0" + (csrc / name).read_bytes() + b"\0")
    parts = (
        BUILD_FORMAT,
        torch.__version__,
        sys.implementation.cache_tag,
        sysconfig.get_config_var("EXT_SUFFIX") or "",
        platform.machine(),
        *CFLAGS,
        "|",
        *LDFLAGS,
    )
    digest.update("\0".join(parts).encode())
    return digest.hexdigest()[:16]


def build_directory(key: str) -> Path:
    """The directory of the build with cache key ``key``."""
    return native_cache_dir() / f"native-{key}"


def library_file(key: str) -> Path:
    """The extension module file of the build with key ``key`` (what cpp_extension links)."""
    return build_directory(key) / f"{module_name(key)}{'.pyd' if sys.platform == 'win32' else '.so'}"


def module_name(key: str) -> str:
    """The Python name of the extension module built with key ``key`` (one name per key, so that a rebuilt
    extension never clashes with one already imported)."""
    return f"softmoe_native_{key}"


# ---- the process-wide state: the loaded extension (or why there is none) and the instruction set -----------------


class _State:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = False  # whether loading was tried in this process
        self.module: ModuleType | None = None
        self.status = "native kernels not loaded yet"
        self.compiled = False  # whether this process ran the build
        self.isa: str | None = None  # the default variant: SOFTMOE_ISA, else the best this CPU supports


_state = _State()
# The variant use_isa() asks for, else None (the default). A plain module global, so that torch.compile guards on it.
_isa_override: str | None = None


def extension() -> ModuleType | None:
    """The loaded extension module (built, or imported from the cache, on the first call), or None when the
    native kernels are unavailable (:func:`native_status` says why)."""
    if not _state.done:
        with _state.lock:
            if not _state.done:
                _load()
                _state.done = True
    return _state.module


def native_module() -> ModuleType:
    """The extension module, for the custom ops to call; a RuntimeError saying why when the native kernels are
    unavailable."""
    module = extension()
    if module is None:
        raise RuntimeError(f"softmoe's native kernels are unavailable: {native_status()}")
    return module


def compiled_in_this_process() -> bool:
    """Whether this process built the extension (False when it was imported from the cache)."""
    extension()
    return _state.compiled


def _load() -> None:
    if os.environ.get("SOFTMOE_NATIVE", "1").strip() == "0":
        _state.status = "SOFTMOE_NATIVE=0: the native kernels are turned off"
        return
    try:
        module = _import_or_build()
    except _Unavailable as error:
        _state.status = str(error)
        warnings.warn(
            f"softmoe: the native CPU kernels are unavailable, softmoe runs torch's ops instead: {error}", stacklevel=4
        )
        return
    _state.module = module
    _state.isa = _default_isa_of(module)
    requested = os.environ.get("SOFTMOE_ISA", "").strip()
    _state.status = f"native kernels built for {_state.isa}" + (f" (SOFTMOE_ISA={requested})" if requested else "")


class _Unavailable(Exception):
    """Why the native kernels cannot be had, in one line."""


def _import_or_build() -> ModuleType:
    key = build_key()
    directory = build_directory(key)
    if (directory / "complete").exists():
        with contextlib.suppress(ImportError, OSError):
            return _import(directory, key)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(directory.parent / f"native-{key}.lock", "a")  # noqa: SIM115 - closed by _locked
    except OSError as error:
        raise _Unavailable(f"the cache directory {directory.parent} is not writable: {error}") from None
    with _locked(lock_file):
        if (directory / "complete").exists():  # built by another process while this one waited
            try:
                return _import(directory, key)
            except (ImportError, OSError):  # a damaged build: linked again below
                (directory / "complete").unlink(missing_ok=True)
                library_file(key).unlink(missing_ok=True)
        module = _build(directory, key)
        sys.modules[module_name(key)] = module
        (directory / "complete").write_text(f"{module_name(key)}\n")
        _state.compiled = True
        return module


@contextlib.contextmanager
def _locked(handle) -> Iterator[None]:
    """An exclusive lock on the open file ``handle`` while the block runs (released by the OS if the process
    dies); the file is closed after."""
    with handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _import(directory: Path, key: str) -> ModuleType:
    name = module_name(key)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, library_file(key))
    if spec is None or spec.loader is None:
        raise ImportError(f"no extension module in {directory}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def _tool_path() -> str:
    """PATH with the directories where pip puts ninja first: the `ninja` package's, and this interpreter's (a
    virtual environment's bin, which is not on PATH when its python is run directly)."""
    directories = [os.path.dirname(sys.executable)]
    with contextlib.suppress(ImportError, AttributeError):
        import ninja

        directories.insert(0, ninja.BIN_DIR)
    return os.pathsep.join([*directories, os.environ.get("PATH", "")])


def _build(directory: Path, key: str) -> ModuleType:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None:
        raise _Unavailable(f"no C++ compiler: {compiler!r} (from $CXX, else c++) was not found")
    path = _tool_path()
    if shutil.which("ninja", path=path) is None:
        raise _Unavailable("ninja was not found (pip install ninja)")
    directory.mkdir(parents=True, exist_ok=True)
    # cpp_extension's own lock file, left behind by a build that was killed, would make it wait forever; this
    # process holds the build lock, so no other build is running here.
    (directory / "lock").unlink(missing_ok=True)
    saved_path = os.environ.get("PATH")
    os.environ["PATH"] = path
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one warning is ours, with the reason
            return cpp_extension.load(
                name=module_name(key),
                sources=[str(CSRC / name) for name in SOURCES],
                extra_cflags=list(CFLAGS),
                extra_ldflags=list(LDFLAGS),
                extra_include_paths=[str(CSRC)],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as error:
        raise _Unavailable(f"building the native kernels in {directory} failed: {_first_error(error)}") from None
    finally:
        if saved_path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = saved_path


def _first_error(error: Exception) -> str:
    """The compiler's first error line of a failed build, else the exception's first line."""
    text = str(error)
    for line in text.splitlines():
        if "error" in line.lower() and "error building extension" not in line.lower():
            return line.strip()
    return text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _default_isa_of(module: ModuleType) -> str:
    supported = list(module.supported_isas())
    requested = os.environ.get("SOFTMOE_ISA", "").strip().lower()
    if not requested or requested == "auto":
        return supported[0]
    if requested not in ISAS:
        warnings.warn(
            f"softmoe: SOFTMOE_ISA={requested!r} is not one of {', '.join(ISAS)}: the native kernels run "
            f"{supported[0]}",
            stacklevel=5,
        )
        return supported[0]
    if requested not in supported:
        warnings.warn(
            f"softmoe: SOFTMOE_ISA={requested} but this CPU lacks {requested}: the native kernels run "
            f"{supported[0]} (this CPU supports {', '.join(supported)})",
            stacklevel=5,
        )
        return supported[0]
    return requested


# ---- public: availability, status and the instruction set ------------------------------------------------------


@torch.compiler.assume_constant_result
def native_available() -> bool:
    """Whether the native kernels are built and loaded (building them on the first call). Constant for a process;
    torch.compile takes its value when it traces."""
    return extension() is not None


@torch.compiler.assume_constant_result
def native_status() -> str:
    """Why the native kernels are (un)available, in one line: e.g. "native kernels built for avx2",
    "SOFTMOE_NATIVE=0: ...", "no C++ compiler: ...", "building the native kernels ... failed: ..."."""
    extension()
    return _state.status


@torch.compiler.assume_constant_result
def supported_isas() -> tuple[str, ...]:
    """The kernel variants this CPU runs, best first (e.g. ("avx2", "portable")); empty when the native kernels
    are unavailable."""
    module = extension()
    return () if module is None else tuple(module.supported_isas())


@torch.compiler.assume_constant_result
def _default_isa() -> str | None:
    extension()
    return _state.isa


def cpu_isa() -> str | None:
    """The kernel variant the native ops run ("avx512", "avx2" or "portable"): the one :func:`use_isa` asks for,
    else $SOFTMOE_ISA, else the best this CPU supports; None when the native kernels are unavailable."""
    return _isa_override if _isa_override is not None else _default_isa()


def required_isa() -> str:
    """:func:`cpu_isa` for the native ops' entry points: a RuntimeError saying why when the kernels are unavailable."""
    isa = cpu_isa()
    if isa is None:
        raise RuntimeError(f"softmoe's native kernels are unavailable: {native_status()}")
    return isa


@contextlib.contextmanager
def use_isa(isa: str) -> Iterator[str]:
    """Run the native ops with the ``isa`` variant ("avx512", "avx2" or "portable") while the block runs (for the
    whole process: meant for tests and measurements). A ValueError when this CPU lacks it (or the native kernels are
    unavailable). Nests; compiled functions recompile for the variant (torch.compile guards on it)."""
    global _isa_override
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    if isa not in supported_isas():
        why = f"this CPU supports {', '.join(supported_isas())}" if native_available() else native_status()
        raise ValueError(f"cannot run the {isa} kernels: {why}")
    previous = _isa_override
    _isa_override = isa
    try:
        yield isa
    finally:
        _isa_override = previous


def _reset() -> None:
    """Forget the loaded state, so that the next use loads (and reads SOFTMOE_NATIVE / SOFTMOE_ISA) again: for
    tests. An extension already imported stays imported."""
    global _isa_override
    with _state.lock:
        _state.done = False
        _state.module = None
        _state.status = "native kernels not loaded yet"
        _state.compiled = False
        _state.isa = None
        _isa_override = None
