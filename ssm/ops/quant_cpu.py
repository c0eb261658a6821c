"""The C reads of a stored matrix (ssm/native/decode_weights.c, and decode_simd.c's AVX2 /
AVX-512 products): how a tensor is handed to them, and three helpers that call them alone.

    WMat, Feed        the ctypes mirror of a matrix (its data, scales, format, instruction-set
                      level) and the C view of a step's tensors in one compute dtype: what the
                      fused decoding step (decode.py) builds its arguments from
    widen_rows        rows of a QuantizedMatrix in float32: the C counterpart of
                      ``ops.quant.dequantize_rows`` (a quantised layer's prefill, ssm/layers/quant.py)
    round_rows        a float32 tensor rounded to int8 activations per block of 32: the C
                      counterpart of ``ops.quant.round_activations`` (the same layer's prefill)
    decode_matvec     one matrix-vector product as the fused step computes it (tests, benchmarks)

quant.py defines the formats in tensor code; this module reads them with the C code the fused
step runs, so that a layer's prefill and the step round and widen alike. It imports nothing of
the step: decode.py imports it.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..native import ISA_LEVELS, cpu_isa, declare, kernel, library, ready, threads
from .quant import QuantizedMatrix


class WMat(ctypes.Structure):
    """WMat of ssm/native (decode_weights.c): a matrix's data, its scales, its format, the
    instruction-set level of its products (ssm.native.cpu_isa, decode_simd.c), and whether its
    products take int8 activations (a QuantizedMatrix's ``activations``)."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("type", ctypes.c_int64),
        ("isa", ctypes.c_int64),
        ("act", ctypes.c_int64),
    ]


# WMat.type for each storage of a matrix (W_REAL: the step's own dtype)
W_REAL, W_TYPES = 0, {torch.bfloat16: 1, torch.float16: 2, "int8": 3, "int4": 4}


class Feed:
    """The C view of a step's tensors in one compute dtype (float32 or float64): each one's
    pointer, a 16-bit vector widened once into a copy kept alive here, a matrix as a WMat in its
    own format. ``ok`` turns False, and its caller declines (the step returns None), at the first
    tensor that does not fit (not on the CPU, not contiguous, a dtype the step cannot read, a
    gradient to keep)."""

    def __init__(self, compute: torch.dtype):
        self.compute, self.keep, self.ok = compute, [], True
        self.isa = cpu_isa() if compute == torch.float32 else 0  # the float64 step is portable C
        self.grad = torch.is_grad_enabled()

    def _fits(self, t: Tensor) -> bool:
        fits = t.device.type == "cpu" and t.is_contiguous() and not (self.grad and t.requires_grad)
        self.ok &= fits
        return fits

    def vec(self, t: Tensor | None) -> int | None:
        """A read-only tensor other than a matrix (norm, bias, conv, A, D): the compute dtype, or
        bfloat16 / float16 widened to it."""
        if t is None or not self._fits(t):
            return None
        if t.dtype != self.compute:
            if t.dtype not in (torch.bfloat16, torch.float16):
                self.ok = False
                return None
            t = t.to(self.compute)
            self.keep.append(t)
        return t.data_ptr()

    def state(self, t: Tensor) -> int | None:
        """A tensor the step updates in place: in the compute dtype (the states stay wide)."""
        self.ok &= t.dtype == self.compute
        return t.data_ptr() if self._fits(t) else None

    def mat(self, t) -> WMat:
        """A matrix: the compute dtype, bfloat16 or float16, or a QuantizedMatrix."""
        m = WMat()
        m.isa = self.isa
        if isinstance(t, QuantizedMatrix):
            if self._fits(t.data) and self._fits(t.scales) and t.scales.dtype == torch.float32:
                m.w, m.scale, m.type = t.data.data_ptr(), t.scales.data_ptr(), W_TYPES[t.scheme]
                m.act = int(t.activations == "int8" and self.compute == torch.float32)
            else:
                self.ok = False
        elif self._fits(t) and (t.dtype == self.compute or t.dtype in W_TYPES):
            m.w, m.type = t.data_ptr(), W_REAL if t.dtype == self.compute else W_TYPES[t.dtype]
        else:
            self.ok = False
        return m


def decode_kernel(weight: Tensor | QuantizedMatrix, cpu: str | None = None) -> str:
    """The name of the C function that a float32 fused step's products with ``weight`` run now
    (decode_simd.c's dispatch: e.g. "dot4_bf16_512", "qdot4_vnni", or "portable" /
    "qdot_rows_portable" for the portable C), at the level ``cpu_isa()`` gives (SSM_CPU_ISA), on
    this CPU or, with ``cpu`` (one of ISA_LEVELS), on a CPU whose best level is that one. Asked of
    the code that dispatches, so that a test sees which instructions each level runs, whatever
    CPU runs the test. ``weight`` as the step takes it: a float32, bfloat16 or float16 matrix, or
    a QuantizedMatrix (with int8 activations or not)."""
    if not ready():
        raise RuntimeError("the C library is not built: no kernel runs")
    feed = Feed(torch.float32)
    m = feed.mat(weight)
    if not feed.ok:
        raise ValueError(f"the step does not read this weight: {type(weight).__name__}")
    if cpu is not None and cpu not in ISA_LEVELS:
        raise ValueError(f"cpu must be None or one of {list(ISA_LEVELS)}, got {cpu!r}")
    best = -1 if cpu is None else ISA_LEVELS.index(cpu)
    return library().ssm_decode_kernel(m.isa, m.type, m.act, best).decode()


declare(
    "decode_matvec",
    [ctypes.POINTER(WMat), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64],
)


def decode_matvec(weight: Tensor | QuantizedMatrix, x: Tensor, nthreads: int | None = None) -> Tensor:
    """weight (O, I) · x (I,) as the fused steps compute their projections (the same C reads, at
    ``cpu_isa()``'s level): for tests and benchmarks of the matrix reads alone. x float32 (any
    stored format) or float64 (weight float64); raises ValueError where the step would decline."""
    feed = Feed(x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
    m = feed.mat(weight)
    out_features, in_features = weight.shape
    if not (feed.ok and ready() and x.dtype == feed.compute and x.shape == (in_features,) and x.is_contiguous()):
        raise ValueError(f"decode_matvec: weight {tuple(weight.shape)} and x {tuple(x.shape)} {x.dtype} do not fit")
    y = x.new_empty(out_features)
    kernel("decode_matvec", x.dtype)(ctypes.byref(m), in_features, out_features, x.data_ptr(), y.data_ptr(),
                                     nthreads or threads())  # fmt: skip
    return y


declare(
    "decode_widen_rows",
    [ctypes.POINTER(WMat), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64],
)


def widen_rows(weight: QuantizedMatrix, lo: int, hi: int, out: Tensor | None = None) -> Tensor | None:
    """Rows lo .. hi-1 of a quantised matrix in float32 ((hi - lo, I), in ``out`` when given: a
    float32 CPU tensor of at least that many elements), widened by the C reads of the fused steps
    in one pass: the values of ``ops.quant.dequantize_rows``, several times faster. None where the
    C library is not there or the matrix is not a contiguous CPU one."""
    if not isinstance(weight, QuantizedMatrix):
        raise ValueError(f"widen_rows: weight must be a QuantizedMatrix, got {type(weight).__name__}")
    if not 0 <= lo <= hi <= weight.shape[0]:
        raise ValueError(f"widen_rows: lo, hi must satisfy 0 <= lo <= hi <= {weight.shape[0]} (rows), got {lo}, {hi}")
    if not ready():
        return None
    feed = Feed(torch.float32)
    m = feed.mat(weight)
    if not feed.ok:
        return None
    rows, n = hi - lo, weight.shape[1]
    if out is None:
        out = torch.empty(rows, n)
    elif out.dtype != torch.float32 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < rows * n:
        raise ValueError(f"widen_rows: out must be a contiguous float32 CPU tensor of >= {rows * n} elements")
    out = out.view(-1)[: rows * n].view(rows, n)
    kernel("decode_widen_rows", torch.float32)(ctypes.byref(m), n, lo, hi, out.data_ptr(), threads())
    return out


declare(
    "decode_round_rows",
    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64],
)


def round_rows(x: Tensor) -> Tensor | None:
    """x (..., I), a float32 CPU tensor, rounded to int8 activations per block of 32 and widened
    back (the values of ``ops.quant.round_activations``; contiguous) by the C code the fused step
    rounds with, on all threads; None where the C library is not there or x is not such a
    tensor. x may be strided (a transposed (B, D, L) tensor) where its rows have one stride."""
    if not (ready() and x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0):
        return None
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # the rows as one strided matrix: a view where they are one, else a copy
    out = torch.empty(x.shape, dtype=torch.float32)
    kernel("decode_round_rows", torch.float32)(
        rows.data_ptr(), rows.shape[0], n, rows.stride(0), rows.stride(1), out.data_ptr(), threads()
    )
    return out
