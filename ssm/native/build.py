"""Building, caching and loading the one C library that every C-backed op uses.

At first use the library (library.c, which includes each kernel family's file over common.h)
is compiled with the system C compiler (``$CC``, else cc, gcc or clang) as ``-O3 -march=native
-fopenmp`` into a user cache directory (``$SSM_CACHE_DIR``, else ``$XDG_CACHE_HOME/ssm``, else
``~/.cache/ssm``), named by a hash of every source file, the compiler, its flags and the CPU,
and written atomically; later processes load it in milliseconds. It is called through ctypes on
the tensors' data pointers, so it needs neither torch's headers nor a build step at install
time. The kernels take the OpenMP runtime torch already loaded (same soname), so they share its
threads, and run on ``torch.get_num_threads()`` of them. One library per process, whatever the
ops used: one compile, one load.

The decoding steps' matrix-vector products (decode_simd.c) also exist in AVX2 and AVX-512
intrinsics (and, for int8 activations, AVX-512 VNNI), compiled per function whatever -march says
and chosen at run time: ``cpu_isa()`` gives the level a step prepared now uses, the best this
CPU runs unless ``SSM_CPU_ISA`` (``portable``, ``avx2``, ``avx512``, ``avx512vnni``; ``auto`` or
unset: the best) asks for another.

If no compiler works, ``library()`` warns once (per compiler and flags tried) and returns None;
each op then takes its pure-PyTorch path (correct, slower). ``SSM_CPU_KERNEL=0`` (read at every
call) asks for those paths without building or warning. Nothing is decided once for the
process: a call that finds the library built uses it.

The modules that bind a kernel family (ssm/scan/cpu.py, ssm/ops/cpu.py, ssm/ops/decode.py,
ssm/ops/quant_cpu.py) ``declare`` each kernel's ctypes argument types; ``kernel(name, dtype)``
returns the function for that dtype (``name_f32`` or ``name_f64``) with them set.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ._buffers import pool

SOURCES = Path(__file__).parent  # library.c, common.h, and one file per kernel family
MAIN = SOURCES / "library.c"
FLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fPIC",
    "-shared",
    "-std=c11",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
)
ABI = 15  # what ssm_kernels_abi() returns for this version of the argument structs

# SSM_CPU_SANITIZE=1 (read when a library is looked up): the library built with AddressSanitizer
# and UndefinedBehaviorSanitizer instead, into a cache entry of its own (the flags are part of the
# hash), for the C-backed tests (`make test-asan`): an out-of-bounds read or write, a use after
# free or undefined behaviour in a kernel aborts the process with a report instead of corrupting
# memory. Python is not instrumented, so the ASan runtime must come first:
# LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 (Python's own
# allocations are not freed at exit). -O1 and frame pointers keep the reports' stacks readable.
SANITIZE_FLAGS = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all")

_lock = threading.Lock()
_built: dict[tuple, ctypes.CDLL | str] = {}  # build key -> the library, or why it failed
_warned: set[tuple] = set()
_declared: dict[str, list] = {}  # kernel name (no suffix) -> its ctypes argtypes


def _off() -> bool:
    return os.environ.get("SSM_CPU_KERNEL", "1").lower() in ("0", "off", "false", "no")


def cache_dir() -> Path:
    """Where built libraries are kept (read when a library is built or looked up)."""
    if os.environ.get("SSM_CACHE_DIR"):
        return Path(os.environ["SSM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ssm"


def _compiler() -> str | None:
    if os.environ.get("CC"):
        return os.environ["CC"]
    return next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU's model and feature flags where Linux says."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith(("model name", "flags", "Features"))]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _sanitized() -> bool:
    return os.environ.get("SSM_CPU_SANITIZE", "0").lower() not in ("0", "off", "false", "no", "")


def _flags() -> tuple[str, ...]:
    """The compiler flags: FLAGS, with SSM_CPU_SANITIZE the sanitizers' in place of -O3."""
    if not _sanitized():
        return FLAGS
    return tuple(f for f in FLAGS if f != "-O3") + SANITIZE_FLAGS


def _build_key() -> tuple:
    """What decides the build, as far as a process can change it: the compiler asked for, and
    whether sanitized."""
    return (os.environ.get("CC"), _flags())


def _source_bytes() -> bytes:
    """Every source file of the library, named and in a fixed order (what the build hash covers)."""
    files = sorted(p for p in SOURCES.iterdir() if p.suffix in (".c", ".h"))
    return b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in files)


def _compile(compiler: str, flags: tuple[str, ...]) -> Path:
    """Compile the library (or find it compiled) and return its path."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"cannot run the C compiler {compiler!r}: {error}") from error
    parts = [_source_bytes(), compiler.encode(), version.encode(), " ".join(flags).encode()]
    parts += [_cpu_identity().encode(), platform.machine().encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]
    directory = cache_dir()
    library = directory / f"ssm_kernels-{digest}{'.dll' if sys.platform == 'win32' else '.so'}"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Compile into a temporary name in the same directory, then rename: another process
    # never sees a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=library.stem + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, str(MAIN), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(result.stderr or result.stdout).strip()[:500]}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


def _set_argtypes(lib: ctypes.CDLL, name: str, argtypes: list) -> None:
    found = [getattr(lib, name + suffix, None) for suffix in ("_f32", "_f64")]
    if not any(found):
        raise AttributeError(f"the C library has no kernel {name}_f32 or {name}_f64")
    for fn in found:  # a float32-only kernel (decode_round_rows) has no _f64
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, None


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ssm_kernels_abi.restype = ctypes.c_int
    lib.ssm_cpu_isa.restype = ctypes.c_int
    lib.ssm_flush_subnormals_on_threads.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ssm_flush_subnormals_on_threads.restype = None
    lib.ssm_decode_kernel.argtypes = [ctypes.c_int64] * 4
    lib.ssm_decode_kernel.restype = ctypes.c_char_p
    if lib.ssm_kernels_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.ssm_kernels_abi()}, expected {ABI}")
    for name, argtypes in list(_declared.items()):
        _set_argtypes(lib, name, argtypes)
    return lib


def declare(name: str, argtypes: Sequence) -> None:
    """The ctypes argument types of kernel ``name`` (both dtypes), set on the library now if it
    is loaded and at every later load. Binding modules call it at import."""
    with _lock:
        _declared[name] = list(argtypes)
        for built in _built.values():
            if not isinstance(built, str):
                _set_argtypes(built, name, _declared[name])


def library() -> ctypes.CDLL | None:
    """The compiled library, building it on first use; None when ``SSM_CPU_KERNEL=0`` or when
    no compiler works (then a warning, once per compiler and flags tried)."""
    if _off():
        return None
    key = _build_key()
    built = _built.get(key)
    if built is None:
        with _lock:
            built = _built.get(key)
            if built is None:
                built = _build()
                _built[key] = built
    if isinstance(built, str):
        if key not in _warned:
            _warned.add(key)
            warnings.warn(
                f"ssm's CPU kernels: could not build them ({built}); running the pure-PyTorch paths "
                "instead (correct, several times slower). A C compiler (cc, gcc or clang; or set CC) "
                "makes them fast; SSM_CPU_KERNEL=0 chooses those paths silently.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return built


ISA_LEVELS = ("portable", "avx2", "avx512", "avx512vnni")  # decode_simd.c's ISA_*, in order


def cpu_isa() -> int:
    """The instruction-set level (an index into ISA_LEVELS) for the decoding steps' products:
    ``$SSM_CPU_ISA`` (read at every call) or, unset or ``auto``, the best this CPU runs. A level
    above that is a ValueError naming the variable (never silently another path). Call only once
    ``library()`` or ``ready()`` said the library is there."""
    best = library().ssm_cpu_isa()
    asked = os.environ.get("SSM_CPU_ISA", "auto").strip().lower() or "auto"
    if asked == "auto":
        return best
    if asked not in ISA_LEVELS:
        raise ValueError(f"SSM_CPU_ISA must be 'auto' or one of {list(ISA_LEVELS)}, got {asked!r}")
    level = ISA_LEVELS.index(asked)
    if level > best:
        raise ValueError(f"SSM_CPU_ISA={asked}: this CPU runs at most {ISA_LEVELS[best]!r}")
    return level


@contextlib.contextmanager
def flushed_subnormals():
    """Within the block, torch's CPU threads (those of its OpenMP team, which the library
    shares) flush subnormal numbers to zero, as the C sweeps do inside themselves; their own
    mode comes back at the end. For stretches of torch ops whose weights decay through the
    subnormal range (the chunked scans' exp of strong decays): each subnormal read or made
    otherwise takes a microcode assist. Without the library, the block runs unchanged."""
    lib = library()
    if lib is None:
        yield
        return
    n = threads()
    lib.ssm_flush_subnormals_on_threads(1, n)
    try:
        yield
    finally:
        lib.ssm_flush_subnormals_on_threads(0, n)


def kernel(name: str, dtype: torch.dtype):
    """Kernel ``name`` (declared) for float32 or float64 tensors. Call only once ``library()``
    or ``ready()`` said the library is there."""
    return getattr(library(), name + ("_f64" if dtype == torch.float64 else "_f32"))


def build_in_background() -> threading.Thread | None:
    """Start building (or loading) the library in a thread and return it, so that a program can
    do its other start-up work (imports, data) meanwhile: the first kernel call then waits only
    for what is left of the build. None, doing nothing, where CUDA is available (the CPU kernels
    are then rarely used) or the kernels are switched off."""
    if torch.cuda.is_available() or _off():
        return None
    thread = threading.Thread(target=library, name="ssm-cpu-kernels", daemon=True)
    thread.start()
    return thread


def _build() -> ctypes.CDLL | str:
    compiler = _compiler()
    if compiler is None:
        return "no C compiler found (looked for $CC, cc, gcc, clang)"
    errors = []
    # Without OpenMP (e.g. Apple's clang) the kernels still build, single-threaded.
    for flags in (_flags(), tuple(f for f in _flags() if f != "-fopenmp")):
        try:
            return _load(_compile(compiler, flags))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(str(error).splitlines()[0][:300] if str(error) else type(error).__name__)
    return "; ".join(errors)


def ready() -> bool:
    """Whether the kernels can run (a constant to torch.compile, which asks it while tracing)."""
    return library() is not None


# What @torch.compiler.assume_constant_result sets, without importing torch._dynamo (and with it
# triton) whenever ssm is imported.
ready._dynamo_marked_constant = True

# ----------------------------------------------------------------------------- for the bindings


def ptr(x: Tensor | None) -> int | None:
    """x's data pointer, or NULL for None."""
    return None if x is None else x.data_ptr()


def strides3(x: Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if x is None else tuple(x.stride())


def threads() -> int:
    return max(1, torch.get_num_threads())


def empty(shape: Sequence[int], like: Tensor) -> Tensor:
    """A contiguous output or scratch of a kernel, in ``like``'s dtype, from the buffer pool (storage
    reused once nothing refers to it: see _buffers.py). Only the custom ops' own implementations
    call it, never code that torch.compile traces."""
    return pool.empty(shape, like.dtype)
