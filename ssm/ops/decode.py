"""The decoding step of a stack of Mamba-1, Mamba-2 or Mamba-3 blocks (or of a hybrid's
attention blocks), and the LM head, in one C call per token (ssm/native/decode.c,
decode_mamba2.c, decode_mamba3.c, decode_attention.c), for recurrent generation on the CPU.

A layer hands its tensors over as a ``MambaBlockWeights``, ``Mamba2BlockWeights``,
``Mamba3BlockWeights`` or ``AttentionBlockWeights`` (with a ``GatedMLPWeights`` for a block's
MLP), and the model its head as
``LMHeadWeights``: typed, documented fields, so that nothing here knows a module's parameter
names. ``mamba_blocks_step`` runs one step; ``MambaBlocksStep.prepare`` builds the C arguments
once for a caller that decodes many tokens with the same tensors (``MambaLM.generate``).

Both return None where the C step does not apply, and the caller steps its layers one by one
(same numbers): every tensor on the CPU, contiguous, no gradient to keep, not inside
torch.compile, the library built, every block of one kind, and the dtypes one of these:

    float64 everything: the step computes in float64;
    float32 (or a bfloat16 / float16 ``hidden``, copied into float32): the step computes in
    float32, the two states float32, the other vectors float32 or bfloat16 / float16 (widened
    once), each matrix (the projections, the MLP's, the head) float32, bfloat16, float16 or an
    int8 / int4 ``QuantizedMatrix`` (ssm.ops.quant), read as stored and widened in registers
    (ssm/native/decode_weights.c). The output (logits, or hidden and residual) is float32.
``mamba_blocks_step_ref`` and ``mamba2_blocks_step_ref`` (reference.py) compute the same steps
in plain float64 loops.

Shape symbols: B batch, M d_model, D the mixer's channels (d_inner), N state size, R dt_rank,
K the conv's width, V the vocabulary; for Mamba-2, H heads, P head dim, S = H·P (d_ssm),
G groups, C = S + 2·G·N the conv's channels, Q = d_inner − S (the mixer's MLP branch, usually
0), E = 2·Q + S + C + H in_proj's rows, F the block MLP's hidden size.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..native import cpu_isa, declare, kernel, ready, threads
from .quant import QuantizedMatrix


@dataclass(frozen=True)
class MambaBlockWeights:
    """One Mamba-1 block's decoding step: residual ← hidden + residual (the first block:
    residual ← hidden); x = RMSNorm(residual); the mixer's step on x (in_proj, the causal conv's
    step and SiLU, x_proj, dt_proj with softplus, the selective step gated by SiLU(z), out_proj).
    Dtypes: see the module's docstring (a matrix may be narrower, or a QuantizedMatrix);
    contiguous; a bias may be None. The two states are updated in
    place."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (2·D, M): x rows then z rows
    in_proj_bias: Tensor | None  # (2·D,)
    conv_weight: Tensor  # (D, 1, K) or (D, K)
    conv_bias: Tensor | None  # (D,)
    conv_state: Tensor  # (B, D, K): the last K conv inputs, most recent last
    x_proj_weight: Tensor | QuantizedMatrix  # (R + 2·N, D): dt rows, B rows, C rows
    dt_proj_weight: Tensor | QuantizedMatrix  # (D, R)
    dt_proj_bias: Tensor | None  # (D,)
    A: Tensor  # (D, N) = -exp(A_log)
    D: Tensor | None  # (D,): the skip
    ssm_state: Tensor  # (B, D, N)
    out_proj_weight: Tensor | QuantizedMatrix  # (M, D)
    out_proj_bias: Tensor | None  # (M,)

    def tensors(self) -> list[Tensor | None]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "norm_eps"]


@dataclass(frozen=True)
class GatedMLPWeights:
    """A block's MLP after its mixer: residual ← hidden + residual;
    (f, g) = fc1 · RMSNorm(residual); hidden = fc2 · (f·SiLU(g))."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    fc1_weight: Tensor | QuantizedMatrix  # (2·F, M): f rows then g rows
    fc2_weight: Tensor | QuantizedMatrix  # (M, F)


def _tensors_and_mlp(weights) -> list:
    """The tensors of a block's weights (Mamba2BlockWeights, Mamba3BlockWeights), then its MLP's."""
    out = [getattr(weights, f.name) for f in fields(weights) if isinstance(getattr(weights, f.name), Tensor)]
    if weights.mlp is not None:
        out += [weights.mlp.norm_weight, weights.mlp.fc1_weight, weights.mlp.fc2_weight]
    return out


@dataclass(frozen=True)
class Mamba2BlockWeights:
    """One Mamba-2 block's decoding step: residual ← hidden + residual (the first block:
    residual ← hidden); u = RMSNorm(residual); (z0, x0, z, xBC, dt) = in_proj u; the causal
    conv's step and SiLU on xBC → (x, B, C); per head h (group h // (H/G)):
    Δ = clamp(softplus(dt + dt_bias), *dt_limit), h ← exp(Δ·A)·h + Δ·B·xᵀ, y = C·h + D·x;
    y = RMSNorm(y·SiLU(z)) per group of ``gate_norm_group`` channels (or RMSNorm(y)·SiLU(z) with
    ``norm_before_gate``, or y·SiLU(z) without a gate norm); hidden = out_proj [SiLU(z0)·x0, y];
    then the block's ``mlp`` if any. Dtypes: see the module's docstring; contiguous; a bias may
    be None.
    The two states are updated in place."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (E, M): z0, x0 (Q each), z (S), xBC (C), dt (H) rows
    in_proj_bias: Tensor | None  # (E,)
    conv_weight: Tensor  # (C, 1, K) or (C, K)
    conv_bias: Tensor | None  # (C,)
    conv_state: Tensor  # (B, C, K): the last K conv inputs, most recent last
    dt_bias: Tensor  # (H,)
    A: Tensor  # (H,) = -exp(A_log)
    D: Tensor | None  # (H,), or (S,) per channel
    ssm_state: Tensor  # (B, H, P, N)
    ngroups: int  # G
    dt_limit: tuple[float, float]  # Δ's clamp; (0, inf) clamps nothing
    gate_norm_weight: Tensor | None  # (S,); None: no norm, y·SiLU(z)
    gate_norm_eps: float
    gate_norm_group: int  # channels per norm group: a multiple of P dividing S
    norm_before_gate: bool
    out_proj_weight: Tensor | QuantizedMatrix  # (M, Q + S)
    out_proj_bias: Tensor | None  # (M,)
    mlp: GatedMLPWeights | None = None

    def tensors(self) -> list[Tensor | None]:
        return _tensors_and_mlp(self)


@dataclass(frozen=True)
class Mamba3BlockWeights:
    """One Mamba-3 block's decoding step, SISO or MIMO of rank R: residual ← hidden + residual
    (the first block: residual ← hidden); u = RMSNorm(residual); (z, x, B, C, dt, a, λ, θ) =
    in_proj u; B and C RMS-normalised per rank and group, plus their per-head biases; per head h
    (group h // (H/G)): Δ = softplus(dt + dt_bias), A = min(−heavy_tail(a), −A_floor),
    λ = sigmoid(λ), the phase φ ← φ + Δ·π·tanh(θ) turning the T rotary pairs of k_r = B_r + B_bias
    and q_r = C_r + C_bias (``halved``: pairs (m, m + N/2), else (2m, 2m + 1)); with v_r =
    x ⊙ mimo_x_r (SISO: x) the trapezoidal step h ← exp(Δ·A)·h + Σ_r ((1 − λ)·Δ·exp(Δ·A)·v'_r·key_rᵀ
    + λ·Δ·v_r·k_rᵀ) (v'_r from the last step's x), y_r = h·q_r + D·v_r, key ← k, value ← x; each
    y_r gated by SiLU(z ⊙ mimo_z_r) (or with ``gate_norm_weight`` RMSNorm(y_r) per head · weight ·
    that), summed over the ranks with mimo_o; hidden = out_proj y; then the block's ``mlp`` if
    any. Dtypes: see the module's docstring; contiguous. The four state tensors are updated in
    place (the phase kept in [0, 2π))."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (E, M): z, x (S each), B, C (R·G·N each), dt, a, λ (H each), θ (T)
    B_norm_weight: Tensor  # (N,)
    C_norm_weight: Tensor  # (N,)
    bc_norm_eps: float
    B_bias: Tensor  # (H, R, N)
    C_bias: Tensor  # (H, R, N)
    dt_bias: Tensor  # (H,)
    A_floor: float
    D: Tensor | None  # (H,)
    phase: Tensor  # (B, H, T)
    ssm_state: Tensor  # (B, H, P, N)
    key: Tensor  # (B, R, H, N), or (B, H, N) for SISO: the last step's rotated keys
    value: Tensor  # (B, H, P): the last step's x
    ngroups: int  # G
    halved: bool
    gate_norm_weight: Tensor | None  # (S,); None: y·SiLU(z)
    gate_norm_eps: float
    out_proj_weight: Tensor | QuantizedMatrix  # (M, S)
    mimo_x: Tensor | None = None  # (H, R, P) each, MIMO only
    mimo_z: Tensor | None = None
    mimo_o: Tensor | None = None
    mlp: GatedMLPWeights | None = None

    def tensors(self) -> list[Tensor | None]:
        return _tensors_and_mlp(self)


@dataclass(frozen=True)
class AttentionBlockWeights:
    """A hybrid model's attention block (``ssm.layers.MHA`` in a Block), one token per row:
    residual ← hidden + residual (the first block: residual ← hidden); u = RMSNorm(residual);
    (qkv, up, gate) = in_proj u; with a conv, its step (no activation) on qkv; q (H heads of P),
    k, v (Hk heads); the first ``rotary_dim`` channels of each q and k head rotated to the row's
    position t = lengths[b] (pairs (i, i + R/2), or (2i, 2i + 1) with ``rotary_interleaved``, at
    angle t·inv_freq[i]); k and v written into the cache at t, lengths[b] ← t + 1; each query
    head h attends to the row's t + 1 keys and values of head h // (H / Hk) with softmax(scale·q·kᵀ);
    hidden = out_proj [context, up·SiLU(gate)]; then the block's ``mlp`` if any. Dtypes: see the
    module's docstring (the key/value cache and the conv state are states: the compute dtype).
    The cache has room for one more token in every row (lengths[b] < capacity)."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor | QuantizedMatrix  # (E, M): q (H·P), k, v (Hk·P each), up, gate (U each) rows
    in_proj_bias: Tensor | None  # (E,)
    conv_weight: Tensor | None  # (Z, 1, K) or (Z, K), Z = (H + 2·Hk)·P; None: no conv
    conv_bias: Tensor | None  # (Z,)
    conv_state: Tensor | None  # (B, Z, K)
    num_heads: int  # H
    num_heads_kv: int  # Hk
    softmax_scale: float
    inv_freq: Tensor | None  # (R/2,) the rotary frequencies; None: no rotary
    rotary_interleaved: bool
    key: Tensor  # (B, capacity, Hk, P)
    value: Tensor  # (B, capacity, Hk, P)
    lengths: Tensor  # (B,) int64: the tokens each row holds
    out_proj_weight: Tensor | QuantizedMatrix  # (M, H·P + U)
    out_proj_bias: Tensor | None  # (M,)
    mlp: GatedMLPWeights | None = None

    def tensors(self) -> list[Tensor | None]:
        return _tensors_and_mlp(self)


@dataclass(frozen=True)
class LMHeadWeights:
    """After the last block: residual ← hidden + residual; logits = weight · RMSNorm(residual)."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    weight: Tensor | QuantizedMatrix  # (V, M)


class _WMat(ctypes.Structure):
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
_W_REAL, _W_TYPES = 0, {torch.bfloat16: 1, torch.float16: 2, "int8": 3, "int4": 4}


class _BlockStepArgs(ctypes.Structure):
    """BlockStepArgs of ssm/native, field for field."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("batch", "d_model", "dim", "N", "R", "K", "nthreads")]
        + [("eps", ctypes.c_double)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "hidden", "residual", "norm_w", "in_b", "conv_w", "conv_b", "conv_state",
                "dt_b", "A", "Dskip", "ssm_state", "out_b", "work", "new_hidden", "new_residual",
            )
        ]
        + [(name, _WMat) for name in ("in_w", "x_w", "dt_w", "out_w")]
    )  # fmt: skip


class _HeadArgs(ctypes.Structure):
    """HeadArgs of ssm/native, field for field."""

    _fields_ = [("vocab", ctypes.c_int64), ("eps", ctypes.c_double)] + [
        (name, ctypes.c_void_p) for name in ("norm_w", "logits")
    ]
    _fields_ += [("weight", _WMat)]


class _Mamba2StepArgs(ctypes.Structure):
    """Mamba2StepArgs of ssm/native (decode_mamba2.c), field for field."""

    _fields_ = (
        [
            (name, ctypes.c_int64)
            for name in (
                "batch", "d_model", "H", "P", "N", "G", "K", "Q", "F", "gate_group", "D_per_channel",
                "norm_before_gate", "nthreads",
            )
        ]
        + [(name, ctypes.c_double) for name in ("eps", "gate_eps", "eps2", "dt_min", "dt_max")]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "hidden", "residual", "norm_w", "in_b", "conv_w", "conv_b", "conv_state",
                "dt_bias", "A", "Dskip", "ssm_state", "gate_w", "out_b", "norm2_w",
                "work", "new_hidden", "new_residual",
            )
        ]
        + [(name, _WMat) for name in ("in_w", "out_w", "fc1_w", "fc2_w")]
    )  # fmt: skip


class _Mamba3StepArgs(ctypes.Structure):
    """Mamba3StepArgs of ssm/native (decode_mamba3.c), field for field."""

    _fields_ = (
        [
            (name, ctypes.c_int64)
            for name in ("batch", "d_model", "H", "P", "N", "G", "R", "T", "F", "halved", "nthreads")
        ]
        + [(name, ctypes.c_double) for name in ("eps", "bc_eps", "gate_eps", "eps2", "A_floor")]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "hidden", "residual", "norm_w", "B_norm_w", "C_norm_w", "B_bias", "C_bias", "dt_bias", "Dskip",
                "mimo_x", "mimo_z", "mimo_o", "phase", "ssm_state", "key", "value", "gate_w", "norm2_w",
                "work", "new_hidden", "new_residual",
            )
        ]
        + [(name, _WMat) for name in ("in_w", "out_w", "fc1_w", "fc2_w")]
    )  # fmt: skip


class _AttentionStepArgs(ctypes.Structure):
    """AttentionStepArgs of ssm/native (decode_attention.c), field for field."""

    _fields_ = (
        [
            (name, ctypes.c_int64)
            for name in ("batch", "d_model", "H", "Hk", "P", "U", "K", "T", "R", "interleaved", "F", "nthreads")
        ]
        + [(name, ctypes.c_double) for name in ("eps", "eps2", "scale")]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "hidden", "residual", "norm_w", "in_b", "conv_w", "conv_b", "conv_state", "inv_freq",
                "key", "value", "lengths", "out_b", "norm2_w", "work", "new_hidden", "new_residual",
            )
        ]
        + [(name, _WMat) for name in ("in_w", "out_w", "fc1_w", "fc2_w")]
    )  # fmt: skip


_HEAD = ctypes.POINTER(_HeadArgs)
declare("mamba_blocks_step", [ctypes.POINTER(_BlockStepArgs), ctypes.c_int64, _HEAD])
declare("mamba2_blocks_step", [ctypes.POINTER(_Mamba2StepArgs), ctypes.c_int64, _HEAD])
declare("mamba3_blocks_step", [ctypes.POINTER(_Mamba3StepArgs), ctypes.c_int64, _HEAD])
declare("attention_blocks_step", [ctypes.POINTER(_AttentionStepArgs), ctypes.c_int64, _HEAD])


declare(
    "decode_matvec",
    [ctypes.POINTER(_WMat), ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64],
)


def decode_matvec(weight: Tensor | QuantizedMatrix, x: Tensor, nthreads: int | None = None) -> Tensor:
    """weight (O, I) · x (I,) as the fused steps compute their projections (the same C reads, at
    ``cpu_isa()``'s level): for tests and benchmarks of the matrix reads alone. x float32 (any
    stored format) or float64 (weight float64); raises ValueError where the step would decline."""
    feed = _Feed(x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32)
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
    [ctypes.POINTER(_WMat), ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64],
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
    feed = _Feed(torch.float32)
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


def mamba_blocks_step(
    hidden: Tensor,
    blocks: Sequence[MambaBlockWeights] | Sequence[Mamba2BlockWeights] | Sequence[Mamba3BlockWeights],
    head: LMHeadWeights | None = None,
) -> Tensor | tuple[Tensor, Tensor] | None:
    """The decoding step of ``blocks`` (all of one kind) in order, in one C call.
    ``hidden`` (B, M) enters the first block; returns the last block's (hidden, residual), or
    with ``head`` the logits (B, V). None where the C step does not apply (see the module's
    docstring). The caller validates Mamba-1 shapes against its layers; Mamba-2 and Mamba-3
    blocks whose shapes do not fit together raise ValueError."""
    step = MambaBlocksStep.prepare(hidden, blocks, head)
    return None if step is None else step()


class _Feed:
    """The C view of a step's tensors in one compute dtype (float32 or float64): each one's
    pointer, a 16-bit vector widened once into a copy kept alive here, a matrix as a WMat in its
    own format. ``ok`` turns False, and the step is declined, at the first tensor that does not
    fit (not on the CPU, not contiguous, a dtype the step cannot read, a gradient to keep)."""

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

    def mat(self, t) -> _WMat:
        """A matrix: the compute dtype, bfloat16 or float16, or a QuantizedMatrix."""
        m = _WMat()
        m.isa = self.isa
        if isinstance(t, QuantizedMatrix):
            if self._fits(t.data) and self._fits(t.scales) and t.scales.dtype == torch.float32:
                m.w, m.scale, m.type = t.data.data_ptr(), t.scales.data_ptr(), _W_TYPES[t.scheme]
                m.act = int(t.activations == "int8" and self.compute == torch.float32)
            else:
                self.ok = False
        elif self._fits(t) and (t.dtype == self.compute or t.dtype in _W_TYPES):
            m.w, m.type = t.data_ptr(), _W_REAL if t.dtype == self.compute else _W_TYPES[t.dtype]
        else:
            self.ok = False
        return m


def _mamba1_args(a: _BlockStepArgs, block: MambaBlockWeights, batch: int, d_model: int, feed: _Feed) -> int:
    """Fill a's sizes and weights; return the scratch the block needs (elements)."""
    dim, N = block.A.shape
    R = block.dt_proj_weight.shape[1]
    a.batch, a.d_model, a.dim, a.N, a.R, a.K = batch, d_model, dim, N, R, block.conv_weight.shape[-1]
    a.eps = block.norm_eps
    a.norm_w, a.in_b, a.conv_w, a.conv_b = (
        feed.vec(t) for t in (block.norm_weight, block.in_proj_bias, block.conv_weight, block.conv_bias)
    )
    a.dt_b, a.A, a.Dskip, a.out_b = (feed.vec(t) for t in (block.dt_proj_bias, block.A, block.D, block.out_proj_bias))
    a.conv_state, a.ssm_state = feed.state(block.conv_state), feed.state(block.ssm_state)
    a.in_w, a.x_w = feed.mat(block.in_proj_weight), feed.mat(block.x_proj_weight)
    a.dt_w, a.out_w = feed.mat(block.dt_proj_weight), feed.mat(block.out_proj_weight)
    return batch * (d_model + 5 * dim + R + 2 * N)


def _mamba2_args(a: _Mamba2StepArgs, block: Mamba2BlockWeights, batch: int, d_model: int, feed: _Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    if block.ssm_state.ndim != 4:
        raise ValueError(f"ssm_state must be (B, H, P, N), got shape {tuple(block.ssm_state.shape)}")
    _, H, P, N = block.ssm_state.shape
    G, S = block.ngroups, H * P
    C, K = block.conv_weight.shape[0], block.conv_weight.shape[-1]
    E = block.in_proj_weight.shape[0]
    Q = (E - S - C - H) // 2
    F = 0 if block.mlp is None else block.mlp.fc2_weight.shape[1]
    group = block.gate_norm_group
    expected = {
        "ssm_state": ((batch, H, P, N), block.ssm_state),
        "conv_weight": ((S + 2 * G * N, K), block.conv_weight.reshape(C, -1)),
        "conv_state": ((batch, C, K), block.conv_state),
        "in_proj_weight": ((2 * Q + S + C + H, d_model), block.in_proj_weight),
        "A": ((H,), block.A),
        "dt_bias": ((H,), block.dt_bias),
        "out_proj_weight": ((d_model, Q + S), block.out_proj_weight),
    }
    if block.mlp is not None:
        expected["mlp.fc1_weight"] = ((2 * F, d_model), block.mlp.fc1_weight)
    for name, (shape, t) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"Mamba2BlockWeights.{name} must have shape {shape}, got {tuple(t.shape)}")
    if G < 1 or H % G or Q < 0 or (block.D is not None and block.D.numel() not in (H, S)):
        D = None if block.D is None else tuple(block.D.shape)
        raise ValueError(f"Mamba2BlockWeights: ngroups {G} must divide H = {H}, Q = {Q} >= 0, D {D} (H,) or (S,)")
    if block.gate_norm_weight is not None and (group < 1 or group % P or S % group):
        raise ValueError(f"gate_norm_group must be a multiple of P = {P} dividing S = {S}, got {group}")
    a.batch, a.d_model, a.H, a.P, a.N, a.G, a.K, a.Q, a.F = batch, d_model, H, P, N, G, K, Q, F
    a.gate_group = group if block.gate_norm_weight is not None else S
    a.D_per_channel = int(block.D is not None and block.D.numel() == S != H)
    a.norm_before_gate = int(block.norm_before_gate)
    a.eps, a.gate_eps = block.norm_eps, block.gate_norm_eps
    a.dt_min, a.dt_max = (float(v) for v in block.dt_limit)
    a.norm_w, a.in_b, a.conv_w, a.conv_b = (
        feed.vec(t) for t in (block.norm_weight, block.in_proj_bias, block.conv_weight, block.conv_bias)
    )
    a.dt_bias, a.A, a.Dskip = feed.vec(block.dt_bias), feed.vec(block.A), feed.vec(block.D)
    a.gate_w, a.out_b = feed.vec(block.gate_norm_weight), feed.vec(block.out_proj_bias)
    a.conv_state, a.ssm_state = feed.state(block.conv_state), feed.state(block.ssm_state)
    a.in_w, a.out_w = feed.mat(block.in_proj_weight), feed.mat(block.out_proj_weight)
    if block.mlp is not None:
        a.eps2, a.norm2_w = block.mlp.norm_eps, feed.vec(block.mlp.norm_weight)
        a.fc1_w, a.fc2_w = feed.mat(block.mlp.fc1_weight), feed.mat(block.mlp.fc2_weight)
    return batch * (d_model + E + C + Q + S + H + 3 * F)


def _mamba3_args(a: _Mamba3StepArgs, block: Mamba3BlockWeights, batch: int, d_model: int, feed: _Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    if block.ssm_state.ndim != 4 or block.B_bias.ndim != 3:
        shapes = tuple(block.ssm_state.shape), tuple(block.B_bias.shape)
        raise ValueError(f"ssm_state must be (B, H, P, N) and B_bias (H, R, N), got shapes {shapes}")
    _, H, P, N = block.ssm_state.shape
    G, S, T, R = block.ngroups, H * P, block.phase.shape[-1], block.B_bias.shape[1]
    F = 0 if block.mlp is None else block.mlp.fc2_weight.shape[1]
    E = 2 * S + 2 * R * G * N + 3 * H + T
    expected = {
        "ssm_state": ((batch, H, P, N), block.ssm_state),
        "phase": ((batch, H, T), block.phase),
        "key": ((batch, R, H, N) if block.key.ndim == 4 else (batch, H, N), block.key),
        "value": ((batch, H, P), block.value),
        "in_proj_weight": ((E, d_model), block.in_proj_weight),
        "B_norm_weight": ((N,), block.B_norm_weight),
        "C_norm_weight": ((N,), block.C_norm_weight),
        "B_bias": ((H, R, N), block.B_bias),
        "C_bias": ((H, R, N), block.C_bias),
        "dt_bias": ((H,), block.dt_bias),
        "out_proj_weight": ((d_model, S), block.out_proj_weight),
    }
    optional = {"D": (H,), "gate_norm_weight": (S,), "mimo_x": (H, R, P), "mimo_z": (H, R, P), "mimo_o": (H, R, P)}
    for name, shape in optional.items():
        if getattr(block, name) is not None:
            expected[name] = (shape, getattr(block, name))
    if block.mlp is not None:
        expected["mlp.fc1_weight"] = ((2 * F, d_model), block.mlp.fc1_weight)
    for name, (shape, t) in expected.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"Mamba3BlockWeights.{name} must have shape {shape}, got {tuple(t.shape)}")
    if G < 1 or H % G or T < 1 or T > (N // 2) or (block.key.ndim == 3 and R != 1):
        raise ValueError(
            f"Mamba3BlockWeights: ngroups {G} must divide H = {H}, 1 <= T = {T} <= N / 2 = {N // 2}, "
            f"and a key without a rank axis means R = 1 (B_bias has R = {R})"
        )
    a.batch, a.d_model, a.H, a.P, a.N, a.G, a.R, a.T, a.F = batch, d_model, H, P, N, G, R, T, F
    a.halved = int(block.halved)
    a.eps, a.bc_eps, a.gate_eps, a.A_floor = block.norm_eps, block.bc_norm_eps, block.gate_norm_eps, block.A_floor
    a.norm_w, a.B_norm_w, a.C_norm_w = (
        feed.vec(t) for t in (block.norm_weight, block.B_norm_weight, block.C_norm_weight)
    )
    a.B_bias, a.C_bias, a.dt_bias = (feed.vec(t) for t in (block.B_bias, block.C_bias, block.dt_bias))
    a.Dskip, a.gate_w = feed.vec(block.D), feed.vec(block.gate_norm_weight)
    a.mimo_x, a.mimo_z, a.mimo_o = (feed.vec(t) for t in (block.mimo_x, block.mimo_z, block.mimo_o))
    a.phase, a.ssm_state = feed.state(block.phase), feed.state(block.ssm_state)
    a.key, a.value = feed.state(block.key), feed.state(block.value)
    a.in_w, a.out_w = feed.mat(block.in_proj_weight), feed.mat(block.out_proj_weight)
    if block.mlp is not None:
        a.eps2, a.norm2_w = block.mlp.norm_eps, feed.vec(block.mlp.norm_weight)
        a.fc1_w, a.fc2_w = feed.mat(block.mlp.fc1_weight), feed.mat(block.mlp.fc2_weight)
    return batch * (d_model + E + 2 * R * G * N + 2 * H * R * N + H * R * P + S + 3 * F)


def _attention_args(a: _AttentionStepArgs, block: AttentionBlockWeights, batch: int, d_model: int, feed: _Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    H, Hk = block.num_heads, block.num_heads_kv
    if block.key.ndim != 4 or H < 1 or Hk < 1 or H % Hk:
        raise ValueError(
            f"AttentionBlockWeights: key must be (B, capacity, Hk, P) and num_heads_kv {Hk} divide num_heads {H}, "
            f"got key shape {tuple(block.key.shape)}"
        )
    _, T, _, P = block.key.shape
    Z = (H + 2 * Hk) * P
    E = block.in_proj_weight.shape[0]
    U = (E - Z) // 2
    R = 0 if block.inv_freq is None else 2 * block.inv_freq.numel()
    K = 0 if block.conv_weight is None else block.conv_weight.shape[-1]
    F = 0 if block.mlp is None else block.mlp.fc2_weight.shape[1]
    expected = {
        "key": ((batch, T, Hk, P), block.key),
        "value": ((batch, T, Hk, P), block.value),
        "lengths": ((batch,), block.lengths),
        "in_proj_weight": ((Z + 2 * U, d_model), block.in_proj_weight),
        "out_proj_weight": ((d_model, H * P + U), block.out_proj_weight),
    }
    if K:
        expected["conv_weight"] = ((Z, K), block.conv_weight.reshape(block.conv_weight.shape[0], -1))
        expected["conv_state"] = ((batch, Z, K), block.conv_state)
    if block.mlp is not None:
        expected["mlp.fc1_weight"] = ((2 * F, d_model), block.mlp.fc1_weight)
    for name, (shape, t) in expected.items():
        if t is None or tuple(t.shape) != shape:
            raise ValueError(
                f"AttentionBlockWeights.{name} must have shape {shape}, got {None if t is None else tuple(t.shape)}"
            )
    if U < 0 or R > P or block.lengths.dtype != torch.int64:
        raise ValueError(
            f"AttentionBlockWeights: in_proj's {E} rows must be (H + 2·Hk)·P = {Z} plus twice the MLP's width, "
            f"the rotary channels {R} at most P = {P}, lengths int64 (got {block.lengths.dtype})"
        )
    a.batch, a.d_model, a.H, a.Hk, a.P, a.U, a.K, a.T, a.R, a.F = batch, d_model, H, Hk, P, U, K, T, R, F
    a.interleaved = int(block.rotary_interleaved)
    a.eps, a.scale = block.norm_eps, block.softmax_scale
    a.norm_w, a.in_b, a.conv_w, a.conv_b = (
        feed.vec(t) for t in (block.norm_weight, block.in_proj_bias, block.conv_weight, block.conv_bias)
    )
    a.inv_freq, a.out_b = feed.vec(block.inv_freq), feed.vec(block.out_proj_bias)
    a.conv_state = None if block.conv_state is None or not K else feed.state(block.conv_state)
    a.key, a.value = feed.state(block.key), feed.state(block.value)
    a.lengths = block.lengths.data_ptr() if feed._fits(block.lengths) else None
    a.in_w, a.out_w = feed.mat(block.in_proj_weight), feed.mat(block.out_proj_weight)
    if block.mlp is not None:
        a.eps2, a.norm2_w = block.mlp.norm_eps, feed.vec(block.mlp.norm_weight)
        a.fc1_w, a.fc2_w = feed.mat(block.mlp.fc1_weight), feed.mat(block.mlp.fc2_weight)
    return batch * (d_model + E + Z + H * P + U + H * T + 3 * F)


# the dtype the step computes in, for each dtype of the hidden stream it is given
_COMPUTE = {torch.float64: torch.float64, torch.float32: torch.float32}
_COMPUTE.update({torch.bfloat16: torch.float32, torch.float16: torch.float32})

# each kind of block: its C arguments, the function that fills them, the kernel's name
_KINDS = {
    MambaBlockWeights: (_BlockStepArgs, _mamba1_args, "mamba_blocks_step"),
    Mamba2BlockWeights: (_Mamba2StepArgs, _mamba2_args, "mamba2_blocks_step"),
    Mamba3BlockWeights: (_Mamba3StepArgs, _mamba3_args, "mamba3_blocks_step"),
    AttentionBlockWeights: (_AttentionStepArgs, _attention_args, "attention_blocks_step"),
}


class MambaBlocksStep:
    """``mamba_blocks_step`` prepared once and run once per token: the C arguments, the
    scratch and the output buffers are built in ``prepare``, so a call costs only the C call
    (building them took 0.5 ms a token at mamba-130m's 24 layers, checking and collecting the
    tensors another 0.9 ms, against 19.5 ms for the C call).

    The caller writes each token's input into ``hidden`` (the tensor given to ``prepare``) and
    calls; the result (logits, or the (hidden, residual) pair) lives in buffers that the next
    call overwrites. Valid only while every tensor it was prepared from keeps its storage and
    layout (in-place changes of values are seen): for a caller that holds them fixed between
    calls, such as ``MambaLM.generate``'s loop. It keeps them alive, so a stale one is never
    freed memory."""

    def __init__(self, tensors: list, fn, args, head: _HeadArgs | None, result, residual: Tensor | None = None):
        self.hidden, self.residual = tensors[0], residual
        self._tensors, self._fn, self._args, self._head, self._result = tensors, fn, args, head, result
        self._head_ref = None if head is None else ctypes.byref(head)

    @classmethod
    def prepare(
        cls,
        hidden: Tensor,
        blocks: Sequence[MambaBlockWeights] | Sequence[Mamba2BlockWeights] | Sequence[Mamba3BlockWeights],
        head: LMHeadWeights | None = None,
        residual: bool = False,
    ) -> MambaBlocksStep | None:
        """See ``mamba_blocks_step`` for the arguments, and for when this is None. ``residual``:
        the first block adds an incoming residual stream (blocks that follow others, e.g. an
        attention block's step): the caller writes it into ``self.residual`` (B, M), in the
        step's compute dtype, as it writes ``hidden``; else the first block starts it."""
        kind = _KINDS.get(type(blocks[0])) if blocks else None
        compute = _COMPUTE.get(hidden.dtype)
        if (
            kind is None
            or compute is None
            or any(type(block) is not type(blocks[0]) for block in blocks)
            or hidden.device.type != "cpu"
            or torch.compiler.is_compiling()
            or not ready()
        ):
            return None
        if hidden.dtype != compute or not hidden.is_contiguous():  # the stream is wide in the step
            hidden = hidden.to(compute).contiguous()
        struct, fill, name = kind
        batch, d_model = hidden.shape
        feed = _Feed(compute)
        args = (struct * len(blocks))()
        # outputs alternate between two (hidden, residual) pairs: block l reads block l - 1's pair
        pairs = hidden.new_empty(2, 2, batch, d_model)
        pair_ptrs = [(pairs[p, 0].data_ptr(), pairs[p, 1].data_ptr()) for p in (0, 1)]
        incoming = hidden.new_zeros(batch, d_model) if residual else None
        work_size = 0
        for i, (a, block) in enumerate(zip(args, blocks)):
            work_size = max(work_size, fill(a, block, batch, d_model, feed))
            a.nthreads = threads()
            first = (hidden.data_ptr(), None if incoming is None else incoming.data_ptr())
            a.hidden, a.residual = first if i == 0 else pair_ptrs[(i - 1) % 2]
            a.new_hidden, a.new_residual = pair_ptrs[i % 2]
        h = None
        if head is not None:
            h = _HeadArgs()
            h.vocab, h.eps = head.weight.shape[0], head.norm_eps
            h.norm_w, h.weight = feed.vec(head.norm_weight), feed.mat(head.weight)
        if not feed.ok:
            return None
        work = hidden.new_empty(work_size)
        for a in args:
            a.work = work.data_ptr()
        # kept alive with the step: every tensor its pointers lead to
        tensors = [hidden, list(blocks), head, feed.keep, pairs, work, incoming]
        fn = kernel(name, compute)
        last = (len(blocks) - 1) % 2
        if head is None:
            return cls(tensors, fn, args, None, (pairs[last, 0], pairs[last, 1]), incoming)
        logits = hidden.new_empty(batch, h.vocab)
        h.logits = logits.data_ptr()
        tensors.append(logits)
        return cls(tensors, fn, args, h, logits, incoming)

    def __call__(self) -> Tensor | tuple[Tensor, Tensor]:
        self._fn(self._args, len(self._args), self._head_ref)
        return self._result
