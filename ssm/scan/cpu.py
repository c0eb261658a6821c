"""Fast CPU path: sequential sweeps in C, each thread owning whole channels.

On a CPU the parallel scan is the wrong algorithm: batch × channels already give ample
parallelism, and a sweep over L that keeps the state h in registers does O(L) work with no
(B, D, L, N) temporaries. The sweeps are written in plain C (cpu_kernels.c, next to this file):
every thread takes whole channels (a work unit is one channel, or one block of columns of the
linear scan) and walks all L steps of them alone, vectorised over N, so threads never wait on
one another inside a sweep. Units are handed out dynamically, so a thread that shares its core
with another busy process simply does fewer of them; the selective backward's units are blocks
of channels, each summing its dB and dC into rows of its own, added up in block order
(bitwise-reproducible gradients for a given thread count). Softplus, the D·u skip and the
silu(z) gate are fused into the sweep, and the backward writes every gradient in one reverse
sweep.

The same library holds the rest of a Mamba-1 layer's CPU work that torch does poorly: the
causal depthwise convolution with its SiLU on in_proj's output as it lies (B, L, D)
(``causal_conv1d_cpu``, Mamba-1's and Mamba-2's), RMSNorm and Mamba-2's gated, grouped RMSNorm
in one pass each way (``rms_norm_cpu``), and the decoding step
of a whole stack of blocks in one call (``mamba_blocks_step_cpu``). They live here, beside the
scans, because this is the one compiled library; the layers call them.

Building: at first use the C file is compiled with the system C compiler (``$CC``, else cc,
gcc or clang) as ``-O3 -march=native -fopenmp`` into a shared library in a user cache
directory (``$SSM_CACHE_DIR``, else ``$XDG_CACHE_HOME/ssm``, else ``~/.cache/ssm``), named by a
hash of the source, the compiler, its flags and the CPU, and written atomically; later
processes load it in milliseconds. It is called through ctypes on the tensors' data pointers,
so it needs neither torch's headers nor a build step at install time. The kernels take the
OpenMP runtime torch already loaded (same soname), so they share its threads, and run on
``torch.get_num_threads()`` of them.

If no compiler works, the backend warns once (per compiler and flags tried) and runs
``pscan``'s pure-PyTorch path instead: correct, several times slower. ``SSM_CPU_KERNEL=0`` (read
at every call) asks for that path without building or warning. There is no other switch, and
nothing is decided once for the process: a call that finds the library built uses it.

The kernels are torch custom ops (``torch.ops.ssm.cpu_selective_scan_fwd`` / ``_bwd``,
``cpu_linear_scan_fwd`` / ``_bwd``, ``cpu_causal_conv_fwd`` / ``_bwd``, ``cpu_rms_norm_fwd`` /
``_bwd``) with fake implementations and an autograd formula, so a
user's ``torch.compile`` traces through them without graph breaks and calls the same kernels.
No shape, dtype or option recompiles anything: one library serves every input.

Backward memory: the forward keeps the state at the start of every chunk of ``CHUNK`` steps,
(B, L / CHUNK, D, N), beside its inputs; the backward recomputes a chunk's states from it and runs
the adjoint recurrence back through the chunk (see selective_bwd in cpu_kernels.c). So memory
is O(B·D·L), never O(B·D·L·N). Under ``torch.no_grad()`` (or when no input needs a gradient)
nothing is kept.

Shape symbols: B batch, D channels, L length, N state size, G groups, S packed sequences,
T chunk length (``CHUNK``), E / F linear_scan's flattened dims before / after the scanned one.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
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
from ._checks import compute_dtype
from ._common import ssd_delta

CHUNK = 64  # T: steps between the states the forward keeps for the backward
SOURCE = Path(__file__).with_name("cpu_kernels.c")
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
ABI = 7  # what ssm_kernels_abi() returns for this version of the structs below

# ----------------------------------------------------------------------------- building


class _SelectiveArgs(ctypes.Structure):
    """SelectiveArgs of cpu_kernels.c, field for field."""

    _fields_ = (
        [
            (name, ctypes.c_int64)
            for name in (
                "batch",
                "dim",
                "length",
                "N",
                "groups_B",
                "groups_C",
                "nseq",
                "nthreads",
                "chunk",
                "B_fixed",
                "C_fixed",
                "softplus",
                "nparts",
            )
        ]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "u",
                "delta",
                "A",
                "B",
                "C",
                "D",
                "z",
                "delta_bias",
                "h0",
                "cu_seqlens",
            )
        ]
        + [(name, ctypes.c_int64 * 3) for name in ("su", "sdelta", "sz", "sB", "sC")]
        + [(name, ctypes.c_void_p) for name in ("out", "last", "ckpt", "grad_out", "grad_last")]
        + [("sgo", ctypes.c_int64 * 3)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "d_u",
                "d_delta",
                "d_z",
                "d_A",
                "d_B",
                "d_C",
                "part_B",
                "part_C",
                "d_D",
                "d_delta_bias",
                "d_h0",
            )
        ]
    )


class _LinearArgs(ctypes.Structure):
    """LinearArgs of cpu_kernels.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("E", "length", "F", "nseq", "reverse", "nthreads")] + [
        (name, ctypes.c_void_p)
        for name in (
            "gates",
            "inputs",
            "h0",
            "cu_seqlens",
            "states",
            "grad",
            "d_gates",
            "d_inputs",
            "d_h0",
        )
    ]


class _StepArgs(ctypes.Structure):
    """StepArgs of cpu_kernels.c, field for field."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("batch", "dim", "N", "softplus", "nthreads")]
        + [(name, ctypes.c_void_p) for name in ("state", "u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
        + [(name, ctypes.c_int64) for name in ("su", "sdelta", "sz", "sB", "sC")]
        + [(name, ctypes.c_void_p) for name in ("out", "new_state")]
    )


class _BlockStepArgs(ctypes.Structure):
    """BlockStepArgs of cpu_kernels.c, field for field."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("batch", "d_model", "dim", "N", "R", "K", "nthreads")]
        + [("eps", ctypes.c_double)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "hidden", "residual", "norm_w", "in_w", "in_b", "conv_w", "conv_b", "conv_state",
                "x_w", "dt_w", "dt_b", "A", "Dskip", "ssm_state", "out_w", "out_b",
                "work", "new_hidden", "new_residual",
            )
        ]
    )  # fmt: skip


class _HeadArgs(ctypes.Structure):
    """HeadArgs of cpu_kernels.c, field for field."""

    _fields_ = [("vocab", ctypes.c_int64), ("eps", ctypes.c_double)] + [
        (name, ctypes.c_void_p) for name in ("norm_w", "weight", "logits")
    ]


class _ConvArgs(ctypes.Structure):
    """ConvArgs of cpu_kernels.c, field for field."""

    _fields_ = [
        (name, ctypes.c_int64) for name in ("batch", "length", "dim", "K", "sxb", "sx", "nseq", "silu", "nthreads")
    ] + [
        (name, ctypes.c_void_p)
        for name in ("x", "wt", "bias", "cu_seqlens", "y", "yT", "grad", "gradT", "d_x", "d_wt", "d_bias", "part")
    ]


class _NormArgs(ctypes.Structure):
    """NormArgs of cpu_kernels.c, field for field."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "M", "group", "gate", "nthreads", "sz")]
    _fields_ += [("eps", ctypes.c_double)]
    _fields_ += [(name, ctypes.c_void_p) for name in ("x", "z", "w", "y", "rstd", "grad", "d_x", "d_z", "d_w", "part")]


_ARGS = {"selective_step": _StepArgs, "mamba_blocks_step": _BlockStepArgs}
_ARGS |= {"conv_fwd": _ConvArgs, "conv_bwd": _ConvArgs, "rms_norm_fwd": _NormArgs, "rms_norm_bwd": _NormArgs}
_KERNELS = ("selective_fwd", "selective_bwd", "linear_fwd", "linear_bwd", "selective_step", "mamba_blocks_step")
_KERNELS += ("conv_fwd", "conv_bwd", "rms_norm_fwd", "rms_norm_bwd")
_lock = threading.Lock()
_built: dict[tuple, ctypes.CDLL | str] = {}  # build key -> the library, or why it failed
_warned: set[tuple] = set()


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


def _build_key() -> tuple:
    """What decides the build, as far as a process can change it: the compiler asked for."""
    return (os.environ.get("CC"), FLAGS)


def _compile(compiler: str, flags: tuple[str, ...]) -> Path:
    """Compile the kernels (or find them compiled) and return the library's path."""
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise RuntimeError(f"cannot run the C compiler {compiler!r}: {error}") from error
    digest = hashlib.sha256(
        b"\0".join(
            [
                source,
                compiler.encode(),
                version.encode(),
                " ".join(flags).encode(),
                _cpu_identity().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:20]
    directory = cache_dir()
    library = directory / f"cpu_kernels-{digest}{'.dll' if sys.platform == 'win32' else '.so'}"
    if library.exists():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    # Compile into a temporary name in the same directory, then rename: another process
    # never sees a half-written library.
    fd, tmp = tempfile.mkstemp(prefix=library.stem + ".", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {(result.stderr or result.stdout).strip()[:500]}")
        os.replace(tmp, library)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return library


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.ssm_kernels_abi.restype = ctypes.c_int
    if lib.ssm_kernels_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {lib.ssm_kernels_abi()}, expected {ABI}")
    for name in _KERNELS:
        args = _ARGS.get(name, _SelectiveArgs if name.startswith("selective") else _LinearArgs)
        for suffix in ("_f32", "_f64"):
            fn = getattr(lib, name + suffix)
            fn.argtypes, fn.restype = [ctypes.POINTER(args)], None
            if name == "mamba_blocks_step":  # (the blocks, how many, the head or NULL)
                fn.argtypes = [ctypes.POINTER(args), ctypes.c_int64, ctypes.POINTER(_HeadArgs)]
    return lib


def kernels() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first use; None when ``SSM_CPU_KERNEL=0`` or when
    no compiler works (then a warning, once per compiler and flags tried)."""
    if os.environ.get("SSM_CPU_KERNEL", "1").lower() in ("0", "off", "false", "no"):
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
                f"ssm.scan 'cpu' backend: could not build its C kernels ({built}); running pscan's "
                "pure-PyTorch path instead (correct, several times slower). A C compiler (cc, gcc "
                "or clang; or set CC) makes it fast; SSM_CPU_KERNEL=0 chooses that path silently.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return built


def build_in_background() -> threading.Thread | None:
    """Start building (or loading) the kernels in a thread and return it, so that a program
    can do its other start-up work (imports, data) meanwhile: the first scan then waits only
    for what is left of the build. None, doing nothing, where CUDA is available (the cpu
    backend is then rarely used) or the kernels are switched off."""
    if torch.cuda.is_available() or os.environ.get("SSM_CPU_KERNEL", "1").lower() in ("0", "off", "false", "no"):
        return None
    thread = threading.Thread(target=kernels, name="ssm-cpu-kernels", daemon=True)
    thread.start()
    return thread


def _build() -> ctypes.CDLL | str:
    compiler = _compiler()
    if compiler is None:
        return "no C compiler found (looked for $CC, cc, gcc, clang)"
    errors = []
    # Without OpenMP (e.g. Apple's clang) the kernels still build, single-threaded.
    for flags in (FLAGS, tuple(f for f in FLAGS if f != "-fopenmp")):
        try:
            return _load(_compile(compiler, flags))
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            errors.append(str(error).splitlines()[0][:300] if str(error) else type(error).__name__)
    return "; ".join(errors)


def _kernels_ready() -> bool:
    """Whether the kernels can run (a constant to torch.compile, which asks it while tracing)."""
    return kernels() is not None


# What @torch.compiler.assume_constant_result sets, without importing torch._dynamo (and with it
# triton) whenever ssm is imported.
_kernels_ready._dynamo_marked_constant = True


def _ptr(x: Tensor | None) -> int | None:
    return None if x is None else x.data_ptr()


def _strides3(x: Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if x is None else tuple(x.stride())


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _empty(shape: Sequence[int], like: Tensor) -> Tensor:
    """A contiguous output or scratch of a kernel, in ``like``'s dtype, from the buffer pool (storage
    reused once nothing refers to it: see ssm/scan/_buffers.py). Only the custom ops' own
    implementations call it, never code that torch.compile traces."""
    return pool.empty(shape, like.dtype)


def _suffix(x: Tensor) -> str:
    return "_f64" if x.dtype == torch.float64 else "_f32"


# ----------------------------------------------------------------------------- selective scan
# In the ops, B and C are either fixed (D, N) or time-varying (B, G, L, N) with N contiguous:
# the layout of a Mamba layer's x_proj output, so that a step reads B_t as N adjacent values.


def _selective_args(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens) -> _SelectiveArgs:
    batch, dim, length = u.shape
    a = _SelectiveArgs()
    a.batch, a.dim, a.length, a.N = batch, dim, length, A.shape[1]
    a.nseq = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    a.nthreads, a.chunk, a.softplus = _threads(), CHUNK, int(softplus)
    for name, M in (("B", B), ("C", C)):
        fixed = M.ndim == 2
        setattr(a, f"{name}_fixed", int(fixed))
        setattr(a, f"groups_{name}", dim if fixed else M.shape[1])
        # fixed: channel d reads row d ("group" d), the same at every step and batch row
        setattr(a, f"s{name}", (0, M.shape[1], 0) if fixed else M.stride()[:3])
    a.u, a.delta, a.A, a.B, a.C = (x.data_ptr() for x in (u, delta, A, B, C))
    a.D, a.z, a.delta_bias, a.h0, a.cu_seqlens = (_ptr(x) for x in (D, z, delta_bias, h0, cu_seqlens))
    a.su, a.sdelta, a.sz = _strides3(u), _strides3(delta), _strides3(z)
    return a


@torch.library.custom_op("ssm::cpu_selective_scan_fwd", mutates_args=(), device_types="cpu")
def _selective_fwd(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    softplus: bool,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    keep_states: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """u, delta, z (B, D, L), any strides; A (D, N), D and delta_bias (D,), h0 (S, D, N)
    contiguous; B, C as above; all of one dtype (float32 or float64).
    Returns out (B, D, L), the last states (S, D, N), and the state entering each chunk
    (B, ceil(L / T), D, N) when ``keep_states`` (else an empty tensor)."""
    batch, dim, length = u.shape
    a = _selective_args(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens)
    out = _empty((batch, dim, length), u)
    last = _empty((a.nseq, dim, A.shape[1]), u)
    ckpt = _empty((batch, -(-length // CHUNK), dim, A.shape[1]) if keep_states else (0,), u)
    a.out, a.last, a.ckpt = out.data_ptr(), last.data_ptr(), (ckpt.data_ptr() if keep_states else None)
    getattr(kernels(), "selective_fwd" + _suffix(u))(ctypes.byref(a))
    return out, last, ckpt


@_selective_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens, keep_states):
    batch, dim, length = u.shape
    S = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    ckpt = u.new_empty(batch, -(-length // CHUNK), dim, A.shape[1]) if keep_states else u.new_empty(0)
    return u.new_empty(batch, dim, length), u.new_empty(S, dim, A.shape[1]), ckpt


@torch.library.custom_op("ssm::cpu_selective_scan_bwd", mutates_args=(), device_types="cpu")
def _selective_bwd(
    grad_out: Tensor,
    grad_last: Tensor | None,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    softplus: bool,
    h0: Tensor | None,
    cu_seqlens: Tensor | None,
    ckpt: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of u, delta, A, B, C, D, z, delta_bias, h0 (an empty tensor for each absent
    one) from those of out (any strides) and of the last states (contiguous, or None)."""
    batch, dim, length = u.shape
    if grad_out.stride(-1) != 1:
        # e.g. out_proj's gradient, (B, L, D) seen as (B, D, L): one transposing copy costs less
        # than the sweeps' reading it a step apart (a cache line a step and channel).
        grad_out = _empty(grad_out.shape, u).copy_(grad_out)
    a = _selective_args(u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens)
    a.ckpt, a.grad_out, a.grad_last, a.sgo = ckpt.data_ptr(), grad_out.data_ptr(), _ptr(grad_last), grad_out.stride()
    d_u, d_delta = _empty(u.shape, u), _empty(u.shape, u)
    d_z = _empty(u.shape if z is not None else (0,), u)  # (an empty tensor stands for an absent input's)
    d_A, d_B, d_C = torch.empty_like(A), _empty(B.shape, u), _empty(C.shape, u)
    d_D, d_bias = (u.new_empty(dim if x is not None else 0) for x in (D, delta_bias))
    d_h0 = u.new_empty(h0.shape if h0 is not None else 0)
    a.nparts = min(dim, 4 * a.nthreads)  # channel blocks: 4 per thread, to share out under load
    parts = [_empty((a.nparts, *M.shape), u) if M.ndim == 4 else None for M in (B, C)]
    a.d_u, a.d_delta, a.d_A, a.d_B, a.d_C = (x.data_ptr() for x in (d_u, d_delta, d_A, d_B, d_C))
    a.d_z, a.d_D, a.d_delta_bias, a.d_h0 = (
        x.data_ptr() if p is not None else None for x, p in ((d_z, z), (d_D, D), (d_bias, delta_bias), (d_h0, h0))
    )
    a.part_B, a.part_C = (_ptr(p) for p in parts)
    getattr(kernels(), "selective_bwd" + _suffix(u))(ctypes.byref(a))
    return d_u, d_delta, d_A, d_B, d_C, d_D, d_z, d_bias, d_h0


@_selective_bwd.register_fake
def _(grad_out, grad_last, u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens, ckpt):
    return (
        u.new_empty(u.shape),
        u.new_empty(u.shape),
        u.new_empty(A.shape),
        u.new_empty(B.shape),
        u.new_empty(C.shape),
        u.new_empty(u.shape[1] if D is not None else 0),
        u.new_empty(u.shape if z is not None else 0),
        u.new_empty(u.shape[1] if delta_bias is not None else 0),
        u.new_empty(h0.shape if h0 is not None else 0),
    )


def _selective_setup(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, softplus, h0, cu_seqlens, _ = inputs
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, h0, cu_seqlens, output[2])
    ctx.softplus = softplus
    ctx.set_materialize_grads(False)  # no zero tensors for the gradients of unused outputs (the states)


def _selective_backward(ctx, grad_out, grad_last, _grad_ckpt):
    u, delta, A, B, C, D, z, delta_bias, h0, cu_seqlens, ckpt = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(u)
    grads = _selective_bwd(
        grad_out,
        None if grad_last is None else grad_last.contiguous(),
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        ctx.softplus,
        h0,
        cu_seqlens,
        ckpt,
    )
    d_u, d_delta, d_A, d_B, d_C, d_D, d_z, d_bias, d_h0 = grads
    return (
        d_u,
        d_delta,
        d_A,
        d_B,
        d_C,
        d_D if D is not None else None,
        d_z if z is not None else None,
        d_bias if delta_bias is not None else None,
        None,
        d_h0 if h0 is not None else None,
        None,
        None,
    )


_selective_fwd.register_autograd(_selective_backward, setup_context=_selective_setup)


def _kernel_layout(M: Tensor, dtype: torch.dtype) -> Tensor:
    """B or C, (D, N) or (B, G, N, L), as the kernels read it: (D, N) contiguous or
    (B, G, L, N) with N contiguous (a view when it already is, e.g. a Mamba layer's x_proj output)."""
    M = M.to(dtype)
    if M.ndim == 2:
        return M.contiguous()
    M = M.transpose(-1, -2)  # (B, G, L, N)
    return M if M.stride(-1) == 1 else M.contiguous()


def _steps_adjacent(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (B, D, L) in ``dtype`` with its steps adjacent in memory. The sweeps read a channel's
    steps one after another; from a (B, L, D) layout seen transposed (a Mamba layer's z, its Δ)
    each step is a row apart, and those strided reads cost more than one copy (measured: a
    Mamba layer at (8, 512, 256) fwd+bwd 138 -> 114 ms, medians of 3)."""
    x = x.to(dtype)
    return x if x.stride(-1) == 1 else x.contiguous()


def selective_scan_cpu(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Backend "cpu" of :func:`ssm.scan.selective_scan`.

    u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) or (B, G, N, L); D, delta_bias: (D,);
    initial_state: (B, D, N), or (S, D, N) with cu_seqlens (S + 1,) (validated; batch 1).
    Returns out (B, D, L) in u's dtype and the last state (B or S, D, N) in float32 (float64
    for float64 inputs)."""
    if not _kernels_ready():
        return _pscan_selective(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens)
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    args = (
        _steps_adjacent(u, dtype),
        _steps_adjacent(delta, dtype),
        A.to(dtype).contiguous(),
        _kernel_layout(B, dtype),
        _kernel_layout(C, dtype),
        None if D is None else D.to(dtype).contiguous(),
        None if z is None else _steps_adjacent(z, dtype),
        None if delta_bias is None else delta_bias.to(dtype).contiguous(),
    )
    h0 = None if initial_state is None else initial_state.to(dtype).contiguous()
    keep = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (*args, h0))
    out, last, _ = _selective_fwd(*args, bool(delta_softplus), h0, cu_seqlens, keep)
    return out.to(u.dtype), last


# ----------------------------------------------------------------------------- linear scan


def _linear_args(gates, inputs, h0, cu_seqlens, reverse) -> _LinearArgs:
    E, length, F = inputs.shape
    p = _LinearArgs()
    p.E, p.length, p.F, p.reverse, p.nthreads = E, length, F, int(reverse), _threads()
    p.nseq = E if cu_seqlens is None else cu_seqlens.numel() - 1
    p.gates, p.inputs, p.h0, p.cu_seqlens = (_ptr(x) for x in (gates, inputs, h0, cu_seqlens))
    return p


@torch.library.custom_op("ssm::cpu_linear_scan_fwd", mutates_args=(), device_types="cpu")
def _linear_fwd(gates: Tensor, inputs: Tensor, h0: Tensor | None, cu_seqlens: Tensor | None, reverse: bool) -> Tensor:
    """gates, inputs (E, L, F) contiguous, one dtype; h0 (E, F), or (S, F) with cu_seqlens
    (E = 1). Returns every state, (E, L, F)."""
    p = _linear_args(gates, inputs, h0, cu_seqlens, reverse)
    states = _empty(inputs.shape, inputs)
    p.states = states.data_ptr()
    getattr(kernels(), "linear_fwd" + _suffix(inputs))(ctypes.byref(p))
    return states


@_linear_fwd.register_fake
def _(gates, inputs, h0, cu_seqlens, reverse):
    return torch.empty_like(inputs)


@torch.library.custom_op("ssm::cpu_linear_scan_bwd", mutates_args=(), device_types="cpu")
def _linear_bwd(
    grad: Tensor, gates: Tensor, states: Tensor, h0: Tensor | None, cu_seqlens: Tensor | None, reverse: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of gates, inputs and h0 (empty when h0 is None) from grad (E, L, F)."""
    p = _linear_args(gates, states, h0, cu_seqlens, reverse)
    grad = grad.contiguous()
    d_gates, d_inputs = _empty(gates.shape, gates), _empty(gates.shape, gates)
    d_h0 = torch.empty_like(h0) if h0 is not None else gates.new_empty(0)
    p.states, p.grad, p.d_gates, p.d_inputs = (
        states.data_ptr(),
        grad.data_ptr(),
        d_gates.data_ptr(),
        d_inputs.data_ptr(),
    )
    p.d_h0 = d_h0.data_ptr() if h0 is not None else None
    getattr(kernels(), "linear_bwd" + _suffix(gates))(ctypes.byref(p))
    return d_gates, d_inputs, d_h0


@_linear_bwd.register_fake
def _(grad, gates, states, h0, cu_seqlens, reverse):
    return (
        torch.empty_like(gates),
        torch.empty_like(gates),
        torch.empty_like(h0) if h0 is not None else gates.new_empty(0),
    )


def _linear_setup(ctx, inputs, output):
    gates, _, h0, cu_seqlens, reverse = inputs
    ctx.save_for_backward(gates, output, h0, cu_seqlens)
    ctx.reverse = reverse


def _linear_backward(ctx, grad):
    gates, states, h0, cu_seqlens = ctx.saved_tensors
    d_gates, d_inputs, d_h0 = _linear_bwd(grad, gates, states, h0, cu_seqlens, ctx.reverse)
    return d_gates, d_inputs, (d_h0 if h0 is not None else None), None, None


_linear_fwd.register_autograd(_linear_backward, setup_context=_linear_setup)


def linear_scan_cpu(
    gates: Tensor,
    inputs: Tensor,
    dim: int,
    initial_state: Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Backend "cpu" of :func:`ssm.scan.linear_scan` (``dim`` non-negative): the inputs are
    viewed as (E, L, F) around the scanned dimension (no copy when contiguous) and scanned in
    place along it. With cu_seqlens (validated; E = 1), initial_state is (S, *shape after dim)."""
    if not _kernels_ready():
        return _pscan_linear(gates, inputs, dim, initial_state, reverse, cu_seqlens)
    dtype = compute_dtype(gates, inputs, initial_state)
    out_dtype = torch.promote_types(gates.dtype, inputs.dtype)
    shape = inputs.shape
    length = shape[dim]
    E, F = math.prod(shape[:dim]), math.prod(shape[dim + 1 :])
    a = gates.to(dtype).reshape(E, length, F).contiguous()
    x = inputs.to(dtype).reshape(E, length, F).contiguous()
    rows = E if cu_seqlens is None else cu_seqlens.numel() - 1  # E, or S packed sequences
    h0 = None if initial_state is None else initial_state.to(dtype).reshape(rows, F).contiguous()
    return _linear_fwd(a, x, h0, cu_seqlens, bool(reverse)).view(shape).to(out_dtype)


# ----------------------------------------------------------------------------- causal conv


def _conv_args(x: Tensor, wt: Tensor, bias: Tensor | None, cu_seqlens: Tensor | None, silu: bool) -> _ConvArgs:
    batch, length, dim = x.shape
    a = _ConvArgs()
    a.batch, a.length, a.dim, a.K, a.sxb, a.sx = batch, length, dim, wt.shape[0], x.stride(0), x.stride(1)
    a.nseq = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    a.silu, a.nthreads = int(silu), _threads()
    a.x, a.wt, a.bias, a.cu_seqlens = x.data_ptr(), wt.data_ptr(), _ptr(bias), _ptr(cu_seqlens)
    return a


@torch.library.custom_op("ssm::cpu_causal_conv_fwd", mutates_args=(), device_types="cpu")
def _conv_fwd(
    x: Tensor, wt: Tensor, bias: Tensor | None, cu_seqlens: Tensor | None, silu: bool, transposed: bool
) -> tuple[Tensor, Tensor]:
    """x (B, L, D) with its channels contiguous (any batch and step strides), wt (K, D) and bias
    (D,) contiguous, all of one dtype → (silu of) the causal depthwise convolution, (B, L, D),
    and with ``transposed`` the same values as (B, D, L) contiguous (else an empty tensor)."""
    a = _conv_args(x, wt, bias, cu_seqlens, silu)
    y = _empty(x.shape, x)
    yT = _empty((x.shape[0], x.shape[2], x.shape[1]) if transposed else (0,), x)
    a.y, a.yT = y.data_ptr(), (yT.data_ptr() if transposed else None)
    getattr(kernels(), "conv_fwd" + _suffix(x))(ctypes.byref(a))
    return y, yT


@_conv_fwd.register_fake
def _(x, wt, bias, cu_seqlens, silu, transposed):
    return x.new_empty(x.shape), x.new_empty(x.shape[0], x.shape[2], x.shape[1]) if transposed else x.new_empty(0)


@torch.library.custom_op("ssm::cpu_causal_conv_bwd", mutates_args=(), device_types="cpu")
def _conv_bwd(
    grad: Tensor | None,
    gradT: Tensor | None,
    x: Tensor,
    wt: Tensor,
    bias: Tensor | None,
    cu_seqlens: Tensor | None,
    silu: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of x (B, L, D) contiguous, wt and bias (an empty tensor without one) from
    those of the two outputs, grad (B, L, D) and gradT (B, D, L), contiguous, either None."""
    a = _conv_args(x, wt, bias, cu_seqlens, silu)
    d_x, d_wt = _empty(x.shape, x), torch.empty_like(wt)
    d_bias = x.new_empty(wt.shape[1] if bias is not None else 0)
    part = _empty((a.nthreads * (2 * a.K + 2) * a.dim,), x)  # per thread: its sums, its ring of rows, a row
    a.grad, a.gradT, a.d_x, a.d_wt = _ptr(grad), _ptr(gradT), d_x.data_ptr(), d_wt.data_ptr()
    a.d_bias, a.part = (d_bias.data_ptr() if bias is not None else None), part.data_ptr()
    getattr(kernels(), "conv_bwd" + _suffix(x))(ctypes.byref(a))
    return d_x, d_wt, d_bias


@_conv_bwd.register_fake
def _(grad, gradT, x, wt, bias, cu_seqlens, silu):
    return x.new_empty(x.shape), torch.empty_like(wt), x.new_empty(wt.shape[1] if bias is not None else 0)


def _conv_setup(ctx, inputs, output):
    x, wt, bias, cu_seqlens, silu, transposed = inputs
    ctx.save_for_backward(x, wt, bias, cu_seqlens)
    ctx.silu, ctx.transposed = silu, transposed


def _conv_backward(ctx, grad, gradT):
    x, wt, bias, cu_seqlens = ctx.saved_tensors
    grad = None if grad is None else grad.contiguous()
    gradT = None if gradT is None or not ctx.transposed else gradT.contiguous()
    d_x, d_wt, d_bias = _conv_bwd(grad, gradT, x, wt, bias, cu_seqlens, ctx.silu)
    return d_x, d_wt, (d_bias if bias is not None else None), None, None, None


_conv_fwd.register_autograd(_conv_backward, setup_context=_conv_setup)


def causal_conv1d_cpu(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    silu: bool = False,
    transposed: bool = False,
) -> Tensor | tuple[Tensor, Tensor] | None:
    """The causal depthwise convolution of x (B, L, D), channels last as a Mamba layer's in_proj
    leaves it (its channels contiguous; no copy of x), with weight (D, 1, K) and optional bias
    (D,), each step reading itself and the K - 1 steps before it in its sequence (zeros before
    a sequence's start; ``cu_seqlens`` (S + 1,) validated, int64, B = 1: packed sequences).
    With ``silu``, SiLU of it, fused: the pre-activation is recomputed in the backward, never
    stored. Returns (B, L, D) contiguous; with ``transposed``, (that, the same values as
    (B, D, L) contiguous): the scans' layout, written by the same pass instead of a transposed
    copy (and the gradients of both are added in the backward's pass).

    None when it does not apply, and the caller takes the tensor path: x, weight and bias on
    the CPU in one dtype (float32 or float64), x's channels contiguous, kernels built."""
    dtype = x.dtype
    if (
        dtype not in (torch.float32, torch.float64)
        or x.ndim != 3
        or x.stride(-1) != 1
        or any(t is not None and (t.device.type != "cpu" or t.dtype != dtype) for t in (x, weight, bias))
        or not _kernels_ready()
    ):
        return None
    wt = weight[:, 0, :].t().contiguous()  # (K, D): a step's taps across channels are adjacent
    y, yT = _conv_fwd(x, wt, None if bias is None else bias.contiguous(), cu_seqlens, bool(silu), bool(transposed))
    return (y, yT) if transposed else y


# ----------------------------------------------------------------------------- RMSNorm


def _norm_args(x: Tensor, z: Tensor | None, w: Tensor, eps: float, group: int, gate: int) -> _NormArgs:
    a = _NormArgs()
    a.M, a.group, a.gate = w.shape[0], group, gate
    a.rows, a.nthreads, a.eps = x.numel() // max(a.M, 1), _threads(), eps
    a.x, a.z, a.w = x.data_ptr(), _ptr(z), w.data_ptr()
    a.sz = 0 if z is None else z.stride(0)
    return a


@torch.library.custom_op("ssm::cpu_rms_norm_fwd", mutates_args=(), device_types="cpu")
def _rms_norm_fwd(x: Tensor, z: Tensor | None, w: Tensor, eps: float, group: int, gate: int) -> tuple[Tensor, Tensor]:
    """x (..., M) and w (M,) contiguous, z None or (rows, M) with its rows any stride apart, all
    of one dtype → (y like x, rstd (rows, M / group)). gate: 0 none, 1 norm(x·silu(z)), 2
    norm(x)·silu(z) (NormArgs in cpu_kernels.c)."""
    a = _norm_args(x, z, w, eps, group, gate)
    y, rstd = _empty(x.shape, x), _empty((a.rows, a.M // group), x)
    a.y, a.rstd = y.data_ptr(), rstd.data_ptr()
    getattr(kernels(), "rms_norm_fwd" + _suffix(x))(ctypes.byref(a))
    return y, rstd


@_rms_norm_fwd.register_fake
def _(x, z, w, eps, group, gate):
    return torch.empty_like(x), x.new_empty(x.numel() // max(w.shape[0], 1), w.shape[0] // group)


@torch.library.custom_op("ssm::cpu_rms_norm_bwd", mutates_args=(), device_types="cpu")
def _rms_norm_bwd(
    grad: Tensor, x: Tensor, z: Tensor | None, w: Tensor, rstd: Tensor, group: int, gate: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of x, z (an empty tensor without one) and w."""
    a = _norm_args(x, z, w, 0.0, group, gate)
    d_x, d_w, part = _empty(x.shape, x), torch.empty_like(w), _empty((a.nthreads * a.M,), x)
    d_z = _empty(z.shape, z) if z is not None else x.new_empty(0)
    a.rstd, a.grad, a.d_x, a.d_w, a.part = (
        rstd.data_ptr(),
        grad.data_ptr(),
        d_x.data_ptr(),
        d_w.data_ptr(),
        part.data_ptr(),
    )
    a.d_z = d_z.data_ptr() if z is not None else None
    getattr(kernels(), "rms_norm_bwd" + _suffix(x))(ctypes.byref(a))
    return d_x, d_z, d_w


@_rms_norm_bwd.register_fake
def _(grad, x, z, w, rstd, group, gate):
    return torch.empty_like(x), torch.empty_like(z) if z is not None else x.new_empty(0), torch.empty_like(w)


def _rms_norm_setup(ctx, inputs, output):
    x, z, w, _, group, gate = inputs
    ctx.save_for_backward(x, z, w, output[1])
    ctx.group, ctx.gate = group, gate


def _rms_norm_backward(ctx, grad, _grad_rstd):
    x, z, w, rstd = ctx.saved_tensors
    d_x, d_z, d_w = _rms_norm_bwd(grad.contiguous(), x, z, w, rstd, ctx.group, ctx.gate)
    return d_x, (d_z if z is not None else None), d_w, None, None, None


_rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def rms_norm_cpu(
    x: Tensor,
    weight: Tensor,
    eps: float,
    z: Tensor | None = None,
    group_size: int | None = None,
    norm_before_gate: bool = False,
) -> Tensor | None:
    """RMSNorm of x (..., M) over groups of ``group_size`` channels (default M), times
    ``weight``, in one pass, and its backward in one pass (torch's eager backward of these
    formulas is a handful of elementwise operations, each a fresh tensor). With ``z`` it is
    Mamba-2's gated norm: norm(x·silu(z)), or norm(x)·silu(z) with ``norm_before_gate``.
    None where it does not apply and the caller takes the tensor formulas: x, z and weight on
    the CPU in one dtype (float32 or float64), x and z contiguous, kernels built."""
    dtype, M = x.dtype, x.shape[-1] if x.ndim else 0
    group = M if group_size is None else group_size
    if (
        dtype not in (torch.float32, torch.float64)
        or x.ndim == 0
        or group < 1
        or M % group
        or any(t is not None and (t.device.type != "cpu" or t.dtype != dtype) for t in (x, z, weight))
        or not x.is_contiguous()
        or (z is not None and z.shape != x.shape)
        or not _kernels_ready()
    ):
        return None
    if z is not None:  # rows of M a stride apart, as the kernels read it (a view where it can be)
        z = z.reshape(-1, M)
        z = z if z.stride(1) == 1 else z.contiguous()
    gate = 0 if z is None else 2 if norm_before_gate else 1
    return _rms_norm_fwd(x, z, weight.contiguous(), float(eps), group, gate)[0]


# ----------------------------------------------------------------------------- without kernels


def _pscan_selective(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens):
    from .pscan import selective_scan_pscan

    return selective_scan_pscan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens)


def _pscan_linear(gates, inputs, dim, initial_state, reverse, cu_seqlens):
    from .pscan import linear_scan_pscan

    return linear_scan_pscan(gates, inputs, dim, initial_state, reverse, cu_seqlens)


# ----------------------------------------------------------------------------- SSD (Mamba-2)


def ssd_cpu(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_state: Tensor | None = None,
    chunk_size: int = 64,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Backend "cpu" of :func:`ssm.scan.ssd`: the SSD recurrence is a selective scan whose
    channels are the H·P head channels, whose Δ and A are shared by the P channels of a head and
    whose B and C are grouped, so it runs on the selective sweeps. x, z, B and C are passed as
    views (the kernels take strides); Δ (softplus and clamp included, by autograd) and A are
    broadcast to the channels. ``chunk_size`` is not used: the sweeps walk every step.
    Same contract as ``reference.ssd_ref``, packed sequences included."""
    batch, length, heads, P = x.shape
    dim = heads * P
    N = B.shape[-1]
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    delta = ssd_delta(dt.to(dtype), dt_bias, dt_softplus, dt_limit)  # (batch, L, H)

    def per_channel(t: Tensor) -> Tensor:  # (..., H) -> (..., H·P), each head's value on its P channels
        # expand + reshape rather than an index: the backward is then a sum over P, not a scatter
        return t[..., None].expand(*t.shape, P).reshape(*t.shape[:-1], dim)

    if D is not None:
        D = per_channel(D.to(dtype)) if D.ndim == 1 else D.to(dtype).reshape(dim)
    out, last = selective_scan_cpu(
        x.reshape(batch, length, dim).transpose(1, 2),
        per_channel(delta).transpose(1, 2),
        per_channel(A.to(dtype))[:, None].expand(dim, N),
        B.permute(0, 2, 3, 1),  # (batch, G, N, L)
        C.permute(0, 2, 3, 1),
        D,
        None if z is None else z.reshape(batch, length, dim).transpose(1, 2),
        initial_state=None if initial_state is None else initial_state.reshape(-1, dim, N),
        cu_seqlens=cu_seqlens,
    )
    return out.transpose(1, 2).reshape(batch, length, heads, P), last.reshape(-1, heads, P, N)


# ----------------------------------------------------------------------------- one step (decoding)


def selective_step_cpu(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus) -> tuple[Tensor, Tensor] | None:
    """``selective_scan_step`` in one C call, or None when it does not apply: CPU tensors of one
    float dtype (float32 or float64, the state's and u's), B and C (batch, N), no gradient to
    keep, not inside torch.compile, kernels built. Arguments validated by the caller."""
    dtype = state.dtype
    if (
        dtype not in (torch.float32, torch.float64)
        or state.device.type != "cpu"
        or u.dtype != dtype
        or compute_dtype(state, u, delta, A, B, C, D, z, delta_bias) != dtype
        or B.ndim != 2
        or C.ndim != 2
        or torch.compiler.is_compiling()
        or (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (state, u, delta, A, B, C, D, z, delta_bias))
        )
    ):
        return None
    lib = kernels()
    if lib is None:
        return None
    batch, dim, N = state.shape

    def rows(x):  # (batch, k) with the last dim contiguous, in the state's dtype
        x = x.to(dtype)
        return x if x.stride(-1) == 1 else x.contiguous()

    state = state.contiguous()
    u, delta, B, C = rows(u), rows(delta), rows(B), rows(C)
    z = None if z is None else rows(z)
    A = A.to(dtype).contiguous()
    D = None if D is None else D.to(dtype).contiguous()
    delta_bias = None if delta_bias is None else delta_bias.to(dtype).contiguous()
    out, new_state = u.new_empty(batch, dim), torch.empty_like(state)
    a = _StepArgs()
    a.batch, a.dim, a.N, a.softplus, a.nthreads = batch, dim, N, int(delta_softplus), _threads()
    a.state, a.u, a.delta, a.A, a.B, a.C = (x.data_ptr() for x in (state, u, delta, A, B, C))
    a.D, a.z, a.delta_bias = _ptr(D), _ptr(z), _ptr(delta_bias)
    a.su, a.sdelta, a.sB, a.sC = u.stride(0), delta.stride(0), B.stride(0), C.stride(0)
    a.sz = 0 if z is None else z.stride(0)
    a.out, a.new_state = out.data_ptr(), new_state.data_ptr()
    getattr(lib, "selective_step" + _suffix(state))(ctypes.byref(a))
    return out, new_state


# ----------------------------------------------------------------------------- decoding blocks
BLOCK_STEP_TENSORS = ("norm_w", "in_w", "in_b", "conv_w", "conv_b", "conv_state", "x_w", "dt_w", "dt_b")
BLOCK_STEP_TENSORS += ("A", "Dskip", "ssm_state", "out_w", "out_b")


def mamba_blocks_step_cpu(
    hidden: Tensor, blocks: Sequence[dict], head: dict | None = None
) -> Tensor | tuple[Tensor, Tensor] | None:
    """The decoding step of a stack of Mamba-1 blocks in one C call (``mamba_blocks_step`` of
    cpu_kernels.c). Block after block: residual ← hidden + residual (the first block: residual ←
    hidden), RMSNorm, then the mixer's step (in_proj, conv, x_proj, dt_proj with softplus, the
    selective step gated by SiLU(z), out_proj). ``hidden`` (batch, d_model) enters the first
    block; returns the last block's (hidden, residual), or with ``head`` (a dict of "norm_w",
    "eps" and "weight" (vocab, d_model)) the logits (batch, vocab) of
    weight · RMSNorm(hidden + residual). Each of ``blocks`` maps the names of
    BLOCK_STEP_TENSORS to that block's tensors (a bias may be None; ``A`` is -exp(A_log), ``Dskip``
    the skip D; ``conv_state`` (batch, dim, K) and ``ssm_state`` (batch, dim, N) are updated in
    place) and "eps" to its norm's epsilon.

    None when it does not apply, and the caller takes the tensor path: every tensor on the CPU,
    contiguous, of one dtype (float32 or float64), no gradient to keep, not inside
    torch.compile, kernels built. The caller validates shapes against its layers."""
    step = MambaBlocksStep.prepare(hidden, blocks, head)
    return None if step is None else step()


class MambaBlocksStep:
    """``mamba_blocks_step_cpu`` prepared once and run once per token: the C arguments, the
    scratch and the output buffers are built in ``prepare``, so a call costs only the C call
    (building them took 0.5 ms a token at mamba-130m's 24 layers, checking and collecting the
    tensors another 0.9 ms, against 19.5 ms for the C call).

    The caller writes each token's input into ``hidden`` (the tensor given to ``prepare``) and
    calls; the result (logits, or the (hidden, residual) pair) lives in buffers that the next
    call overwrites. Valid only while every tensor it was prepared from keeps its storage and
    layout (in-place changes of values are seen): for a caller that holds them fixed between
    calls, such as ``MambaLM.generate``'s loop. It keeps them alive, so a stale one is never
    freed memory."""

    def __init__(self, tensors: list, fn, args, head: _HeadArgs | None, result):
        self.hidden = tensors[0]
        self._tensors, self._fn, self._args, self._head, self._result = tensors, fn, args, head, result
        self._head_ref = None if head is None else ctypes.byref(head)

    @classmethod
    def prepare(cls, hidden: Tensor, blocks: Sequence[dict], head: dict | None = None) -> MambaBlocksStep | None:
        """See ``mamba_blocks_step_cpu`` for the arguments, and for when this is None."""
        dtype = hidden.dtype
        tensors = [hidden] + [t for block in blocks for name in BLOCK_STEP_TENSORS if (t := block[name]) is not None]
        if head is not None:
            tensors += [head["norm_w"], head["weight"]]
        if (
            not blocks
            or dtype not in (torch.float32, torch.float64)
            or any(t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() for t in tensors)
            or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        ):
            return None
        lib = kernels()
        if lib is None:
            return None
        batch, d_model = hidden.shape
        args = (_BlockStepArgs * len(blocks))()
        # outputs alternate between two (hidden, residual) pairs: block l reads block l - 1's pair
        pairs = hidden.new_empty(2, 2, batch, d_model)
        pair_ptrs = [(pairs[p, 0].data_ptr(), pairs[p, 1].data_ptr()) for p in (0, 1)]
        work_size = 0
        for i, (a, block) in enumerate(zip(args, blocks)):
            dim, N = block["A"].shape
            R = block["dt_w"].shape[1]
            a.batch, a.d_model, a.dim, a.N, a.R, a.K = batch, d_model, dim, N, R, block["conv_w"].shape[-1]
            a.nthreads, a.eps = _threads(), block["eps"]
            for name in BLOCK_STEP_TENSORS:
                setattr(a, name, _ptr(block[name]))
            a.hidden, a.residual = (hidden.data_ptr(), None) if i == 0 else pair_ptrs[(i - 1) % 2]
            a.new_hidden, a.new_residual = pair_ptrs[i % 2]
            work_size = max(work_size, batch * (d_model + 5 * dim + R + 2 * N))
        work = hidden.new_empty(work_size)
        for a in args:
            a.work = work.data_ptr()
        tensors += [pairs, work]
        fn = getattr(lib, "mamba_blocks_step" + _suffix(hidden))
        last = (len(blocks) - 1) % 2
        if head is None:
            return cls(tensors, fn, args, None, (pairs[last, 0], pairs[last, 1]))
        h = _HeadArgs()
        h.vocab, h.eps = head["weight"].shape[0], head["eps"]
        logits = hidden.new_empty(batch, h.vocab)
        h.norm_w, h.weight, h.logits = head["norm_w"].data_ptr(), head["weight"].data_ptr(), logits.data_ptr()
        tensors.append(logits)
        return cls(tensors, fn, args, h, logits)

    def __call__(self) -> Tensor | tuple[Tensor, Tensor]:
        self._fn(self._args, len(self._args), self._head_ref)
        return self._result
