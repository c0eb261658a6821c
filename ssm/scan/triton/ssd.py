"""Backend "triton" of ``ssd`` (Mamba-2's SSD), top to bottom: launch heuristics, launchers,
the custom ops with their autograd formula, and the backend entry point. The kernels are in
_ssd_kernels.py (the forward, and the chunked algorithm they run) and _ssd_bwd_kernels.py (the
backward, and how its sums are kept in a fixed order).

    _ssd_*_kernel (forward)   →  _ssd_fwd  →  ssm::ssd_fwd  →  ssd_triton
    _ssd_*_kernel (backward)  →  _ssd_bwd  →  ssm::ssd_bwd     (its autograd formula)

Memory: the forward saves its inputs only (and, with z, the output before the gate, as
mamba-ssm does); the backward reruns the forward's first four kernels. Both hold, for the time
of one call, float32 buffers of Δ and cum (B, H, L), C·Bᵀ per chunk and group (B, c, G, T, T)
and one state per chunk and head (B, c, H, P, N); the backward also one gradient of the state
per chunk and head, and partial sums of dB and dC over splits of a group's heads
(B, L, n_splits, G, N).

torch.compile sees each custom op as one opaque node whose output shapes come from its fake
implementation: a model calling them traces with ``fullgraph=True``. Custom ops cannot return
None: absent outputs are empty placeholders that the autograd formula turns back into None.

Shape symbols: B batch, L length, H heads, P head dim, N state size, G groups, T chunk length,
c chunks, S packed sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton.language as tl
from torch import Tensor

from ..._custom_op import kernel_op
from ._jit import check_launchable, compute_dtype, fake_like, needs_backward, next_power_of_2, placeholders
from ._ssd_bwd_kernels import (
    _ssd_bwd_dc_kernel,
    _ssd_bwd_dx_kernel,
    _ssd_dstate_kernel,
    _ssd_dt_bwd_kernel,
    _ssd_gate_bwd_kernel,
    _ssd_sequence_bwd_kernel,
    _ssd_state_passing_bwd_kernel,
)
from ._ssd_kernels import (
    _ssd_cb_kernel,
    _ssd_chunk_scan_kernel,
    _ssd_chunk_state_kernel,
    _ssd_cumsum_kernel,
    _ssd_last_state_kernel,
    _ssd_state_passing_kernel,
)

# ----------------------------------------------------------------------------- launch heuristics
# Pure functions of shapes, shared by the launchers and the fake implementations. Not yet tuned
# on a GPU (no GPU has run these kernels yet): first guesses after mamba-ssm's tile sizes.

MIN_CHUNK, MAX_CHUNK = 16, 256  # chunk_size is rounded up to a power of two in this range
BLOCK_T = 64  # steps of the (BLOCK_T, BLOCK_T) tiles a chunk's T × T weights are cut into,
# for 16-bit products; half that for float32 ones and a quarter for float64 (at least 16): the
# products' operands are staged in shared memory, and 64-step tiles of float32 took 177 KiB in
# the backward's dx kernel at P 64, N 128 (compiled for sm_90: an A100 has 164), 80 at 32.
BLOCK_P = 64  # channels of a forward program
MAX_DIM = 256  # P and N above this are declined ("auto" then takes "chunked")
STATE_BLOCK = 1024  # elements of the state a program of the state passing carries
TILE = 4096  # elements of the elementwise kernels' tiles
TARGET_PROGRAMS = 1024  # the backward splits a group's heads until its grid has this many programs
# float32 inputs' matrix products: "ieee" (no tensor cores) keeps them within float32's rounding,
# as the tests against the reference ask; "tf32x3" (three TF32 passes on tensor cores) is the
# candidate to time in a GPU window; plain "tf32" (mamba-ssm's) rounds operands to 10 bits.
FP32_DOT = "ieee"


@dataclass(frozen=True)
class Config:
    chunk: int  # T, a power of two
    block_t: int
    block_p: int  # forward's channels per program
    block_p_full: int  # P rounded up: the backward's programs take a head's whole state
    block_n: int
    block_h: int  # heads of a cumsum / dt program
    block_l: int  # steps of a gate program
    heads_per_split: int  # heads of a group one backward program loops over
    n_splits: int
    num_warps: int

    def n_chunks(self, length):
        # (also on torch.compile's symbolic lengths)
        return (length + self.chunk - 1) // self.chunk


def chunk_length(chunk_size: int) -> int:
    """The chunk length T the kernels take for ``chunk_size``: the next power of two, at least
    16 (a tensor-core tile) and at most 256. Only the rounding of the sums depends on it."""
    return min(MAX_CHUNK, max(MIN_CHUNK, next_power_of_2(chunk_size)))


def declines(head_dim: int, N: int) -> str | None:
    """Why the kernels do not take a head of ``head_dim`` channels and state size ``N``, or None."""
    if head_dim > MAX_DIM:
        return f"a head dim P of at most {MAX_DIM} (x has {head_dim})"
    if N > MAX_DIM:
        return f"a state size N of at most {MAX_DIM} (B and C have {N})"
    return None


def config(
    batch: int, length, heads: int, head_dim: int, groups: int, N: int, chunk_size: int, dot_bytes: int = 2
) -> Config:
    """Block sizes for x (batch, L, H, P) and B, C (batch, L, G, N) in chunks of ``chunk_size``
    (rounded: :func:`chunk_length`), the matrix products' operands of ``dot_bytes`` bytes. The
    backward's programs each loop over ``heads_per_split`` heads of a group, with the group's
    heads split until the grid has TARGET_PROGRAMS programs."""
    T = chunk_length(chunk_size)
    block_t = min(T, max(16, BLOCK_T * 2 // dot_bytes))
    block_p_full = max(16, next_power_of_2(head_dim))
    per_group = heads // groups
    if isinstance(length, int):  # the split only sizes partial sums; the fake op never needs it
        base = max(1, batch * -(-length // T) * (T // block_t) * groups)
        splits = max(1, min(per_group, -(-TARGET_PROGRAMS // base)))
    else:
        splits = per_group
    heads_per_split = max(1, -(-per_group // splits))
    return Config(
        chunk=T,
        block_t=block_t,
        block_p=min(block_p_full, BLOCK_P),
        block_p_full=block_p_full,
        block_n=max(16, next_power_of_2(N)),
        block_h=max(1, min(next_power_of_2(heads), TILE // T)),
        block_l=max(16, TILE // block_p_full),
        heads_per_split=heads_per_split,
        n_splits=max(1, -(-per_group // heads_per_split)),
        num_warps=4,
    )


_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}


def _dtypes(x: Tensor, B: Tensor, C: Tensor, dtype: torch.dtype) -> dict:
    """COMPUTE (float32, or float64), and the matrix products' operands: 16-bit on tensor cores
    when x, B and C share a 16-bit dtype, else COMPUTE without TF32."""
    half = x.dtype in (torch.float16, torch.bfloat16) and x.dtype == B.dtype == C.dtype
    precision = "tf32" if half else FP32_DOT if dtype == torch.float32 else "ieee"  # ("tf32": unused for 16-bit)
    return dict(COMPUTE=_TL[dtype], DOT=_TL[x.dtype] if half else _TL[dtype], PRECISION=precision)


def _config(x: Tensor, B: Tensor, C: Tensor, dtype: torch.dtype, chunk: int) -> Config:
    """:func:`config` for these inputs, the products' operand size as :func:`_dtypes` picks it."""
    batch, length, heads, P = x.shape
    groups, N = B.shape[2:]
    half = x.dtype in (torch.float16, torch.bfloat16) and x.dtype == B.dtype == C.dtype
    return config(batch, length, heads, P, groups, N, chunk, 2 if half else dtype.itemsize)


# ----------------------------------------------------------------------------- launchers


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _rows(t: Tensor | None) -> Tensor | None:
    """``t`` with a unit stride in its last dimension, as the kernels index it."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _x_strides(name: str, t: Tensor | None) -> dict:
    """The batch, step and head strides of x or z (B, L, H, P) as kernel arguments (0 if absent)."""
    strides = t.stride()[:3] if t is not None else (0, 0, 0)
    return {f"stride_{name}_{dim}": s for dim, s in zip("blh", strides)}


def _bc_strides(name: str, t: Tensor) -> dict:
    """The batch, step and group strides of B or C (B, L, G, N) as kernel arguments."""
    return {f"stride_{name}_{dim}": s for dim, s in zip("blg", t.stride()[:3])}


def _padded_sequences(cu_seqlens: Tensor | None, length: int, padded: int) -> Tensor | None:
    """(c·T,) int32: each step's packed sequence, the padding after L taking the last step's."""
    if cu_seqlens is None:
        return None
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    steps = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    seq = torch.repeat_interleave(steps, lengths, output_size=length)
    return torch.cat([seq, seq[-1:].expand(padded - length)])


def _prologue(x, dt, A, B, C, dt_bias, dt_softplus, dt_min, dt_max, initial_state, cfg, seq, cu_seqlens, last, dtype):
    """The forward's first four kernels: Δ and cum (B, H, c·T), C·Bᵀ (B, c, G, T, T) and the state
    entering each chunk (B, c, H, P, N), in ``dtype``; unpacked, the last state goes to ``last``
    if given."""
    batch, length, heads, P = x.shape
    groups, N = B.shape[2:]
    T = cfg.chunk
    c = cfg.n_chunks(length)
    flags = _dtypes(x, B, C, dtype)
    new = dict(device=x.device, dtype=dtype)
    delta, cum = torch.empty(batch, heads, c * T, **new), torch.empty(batch, heads, c * T, **new)
    _ssd_cumsum_kernel[(batch * c, triton_cdiv(heads, cfg.block_h))](
        dt, A, dt_bias, delta, cum, length, heads, c * T, c, dt.stride(0), dt.stride(1), float(dt_min), float(dt_max),
        HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus), CLAMP=(dt_min, dt_max) != (0.0, math.inf),
        COMPUTE=flags["COMPUTE"], CHUNK=T, BLOCK_H=cfg.block_h, num_warps=cfg.num_warps,
    )  # fmt: skip
    CB = torch.empty(batch, c, groups, T, T, **new)
    n_t = T // cfg.block_t
    _ssd_cb_kernel[(batch * c, groups, n_t * n_t)](
        B, C, CB, length, N, groups, c, **_bc_strides("B", B), **_bc_strides("C", C), **flags,
        CHUNK=T, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )  # fmt: skip
    states = torch.empty(batch, c, heads, P, N, **new)
    packed = cu_seqlens is not None
    _ssd_chunk_state_kernel[(batch * c, heads, triton_cdiv(P, cfg.block_p))](
        x, B, delta, cum, seq, cu_seqlens, initial_state, states,
        length, c * T, heads, P, N, groups, c, **_x_strides("x", x), **_bc_strides("B", B),
        PACKED=packed, HAS_H0=initial_state is not None, **flags,
        CHUNK=T, BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
    )  # fmt: skip
    store_last = last is not None and not packed
    _ssd_state_passing_kernel[(batch * heads, triton_cdiv(P * N, STATE_BLOCK))](
        states, cum, seq, initial_state, last if store_last else None, heads, c * T, P * N, c,
        PACKED=packed, HAS_H0=initial_state is not None, STORE_LAST=store_last, COMPUTE=flags["COMPUTE"],
        CHUNK=T, BLOCK=STATE_BLOCK, num_warps=cfg.num_warps,
    )  # fmt: skip
    return delta, cum, CB, states, flags


def _ssd_fwd(x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, save_y):
    """x, z: (B, L, H, P); dt: (B, L, H); A, dt_bias: (H,); B, C: (B, L, G, N); D: (H,) or (H, P);
    initial_state: (B, H, P, N), or (S, H, P, N) packed (``cu_seqlens`` (S + 1,) int64, B = 1).
    Returns out (B, L, H, P) in x's dtype, the last state(s) in the state dtype, and (with z and
    ``save_y``) the output before the gate, else an empty placeholder."""
    batch, length, heads, P = x.shape
    groups, N = B.shape[2:]
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    cfg = _config(x, B, C, dtype, chunk)
    rows = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    out = torch.empty(batch, length, heads, P, dtype=x.dtype, device=x.device)
    y_pre = torch.empty_like(out) if z is not None and save_y else x.new_empty(0)
    if cu_seqlens is not None or x.numel() == 0:  # what no sequence overwrites: its initial state
        last = (
            x.new_zeros(rows, heads, P, N, dtype=dtype) if initial_state is None else initial_state.to(dtype, copy=True)
        )
    else:
        last = torch.empty(rows, heads, P, N, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out, last.contiguous(), y_pre
    check_launchable(x)
    x, dt, B, C, z = (_rows(t) for t in (x, dt, B, C, z))
    A, D, dt_bias, initial_state = (None if t is None else t.contiguous() for t in (A, D, dt_bias, initial_state))
    T = cfg.chunk
    c = cfg.n_chunks(length)
    seq = _padded_sequences(cu_seqlens, length, c * T)
    delta, cum, CB, states, flags = _prologue(
        x, dt, A, B, C, dt_bias, dt_softplus, dt_min, dt_max, initial_state, cfg, seq, cu_seqlens, last, dtype
    )
    n_pb = triton_cdiv(P, cfg.block_p)
    blocks = dict(CHUNK=T, BLOCK_T=cfg.block_t, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    packed, has_h0 = cu_seqlens is not None, initial_state is not None
    _ssd_chunk_scan_kernel[(batch * c, heads, (T // cfg.block_t) * n_pb)](
        x, z, C, CB, delta, cum, seq, cu_seqlens, states, initial_state, D, out, y_pre,
        length, c * T, heads, P, N, groups, c, n_pb, **_x_strides("x", x), **_x_strides("z", z), **_bc_strides("C", C),
        PACKED=packed, HAS_H0=has_h0, HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.ndim == 2,
        HAS_Z=z is not None, SAVE_Y=z is not None and save_y, **flags, **blocks,
    )  # fmt: skip
    if packed:
        _ssd_last_state_kernel[(rows, heads, n_pb)](
            x, B, delta, cum, seq, cu_seqlens, states, initial_state, last,
            length, c * T, heads, P, N, groups, x.stride(1), x.stride(2), B.stride(1), B.stride(2),
            HAS_H0=has_h0, **flags, **blocks,
        )  # fmt: skip
    return out, last, y_pre


def _ssd_bwd(
    dout, dlast, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, y_pre,
    dt_scales_input=True,
):  # fmt: skip
    """Gradients of :func:`_ssd_fwd`'s out and last state(s): (dx, ddt, dA, dB, dC, dD, dz,
    ddt_bias, dinitial_state), each in its input's dtype (None for an absent input;
    dinitial_state in the state dtype). ``y_pre``: the forward's output before the gate (with z).
    ``dt_scales_input=False``: ddt is Δ's gradient through the decay exp(Δ·A) alone, not through
    the input Δ·x ⊗ B (for a caller whose x or B divides by Δ, so that the two parts would
    cancel: trapezoidal_ssd.py)."""
    batch, length, heads, P = x.shape
    groups, N = B.shape[2:]
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    cfg = _config(x, B, C, dtype, chunk)
    packed, has_h0, has_dlast = cu_seqlens is not None, initial_state is not None, dlast is not None
    rows = batch if not packed else cu_seqlens.numel() - 1
    new = dict(device=x.device, dtype=dtype)
    if x.numel() == 0:
        dinitial = dlast.to(dtype, copy=True) if has_dlast else torch.zeros(rows, heads, P, N, **new)
        return (
            torch.zeros_like(x), torch.zeros_like(dt), torch.zeros_like(A), torch.zeros_like(B), torch.zeros_like(C),
            None if D is None else torch.zeros_like(D), None if z is None else torch.zeros_like(z),
            None if dt_bias is None else torch.zeros_like(dt_bias), dinitial if has_h0 else None,
        )  # fmt: skip
    check_launchable(x)
    x, dt, B, C, z = (_rows(t) for t in (x, dt, B, C, z))
    A, D, dt_bias, initial_state, dout, y_pre = (
        None if t is None else t.contiguous() for t in (A, D, dt_bias, initial_state, dout, y_pre)
    )
    dlast = None if dlast is None else dlast.to(dtype).contiguous()
    T = cfg.chunk
    c = cfg.n_chunks(length)
    Lp = c * T
    seq = _padded_sequences(cu_seqlens, length, Lp)
    delta, cum, CB, states, flags = _prologue(
        x, dt, A, B, C, dt_bias, dt_softplus, dt_min, dt_max, initial_state, cfg, seq, cu_seqlens, None, dtype
    )
    blocks = dict(CHUNK=T, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    n_pb = triton_cdiv(P, cfg.block_p)

    # The gate and D.
    dy, dz, dD = dout, None, None
    if z is not None or D is not None:
        n_lb = triton_cdiv(length, cfg.block_l)
        if z is not None:
            dy, dz = torch.empty_like(dout, dtype=x.dtype), torch.empty(x.shape, dtype=z.dtype, device=x.device)
        dD_part = None if D is None else torch.empty(batch * n_lb, heads, P, **new)
        _ssd_gate_bwd_kernel[(batch * n_lb, heads)](
            dout, x, z, y_pre, dy, dz, dD_part, length, heads, P, n_lb, **_x_strides("x", x), **_x_strides("z", z),
            HAS_Z=z is not None, HAS_D=D is not None, COMPUTE=flags["COMPUTE"], BLOCK_L=cfg.block_l,
            BLOCK_P=cfg.block_p_full, num_warps=cfg.num_warps,
        )  # fmt: skip
        if D is not None:
            dD = dD_part.sum(0)
            dD = (dD if D.ndim == 2 else dD.sum(-1)).to(D.dtype)

    # The gradients of the states: each chunk's own, then across the chunks in reverse.
    lam = torch.empty(batch, c, heads, P, N, **new)
    _ssd_dstate_kernel[(batch * c, heads, n_pb)](
        dy, C, cum, seq, cu_seqlens, dlast, lam, length, Lp, heads, P, N, groups, c, **_bc_strides("C", C),
        PACKED=packed, HAS_DLAST=has_dlast, **flags, BLOCK_P=cfg.block_p, **blocks,
    )  # fmt: skip
    n_blocks = triton_cdiv(P * N, STATE_BLOCK)
    yend = torch.empty(batch, heads, c, n_blocks, **new)
    dinitial = torch.empty(rows, heads, P, N, **new) if has_h0 else None
    _ssd_state_passing_bwd_kernel[(batch * heads, n_blocks)](
        lam, states, cum, seq, cu_seqlens, dlast, initial_state, dinitial, yend, heads, Lp, P * N, c, n_blocks,
        PACKED=packed, HAS_DLAST=has_dlast, HAS_H0=has_h0, COMPUTE=flags["COMPUTE"], CHUNK=T, BLOCK=STATE_BLOCK,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    yend = yend.sum(-1)

    # Through the chunks: from the source steps (dx, dB) and the output steps (dC).
    common = dict(
        L=length, Lp=Lp, H=heads, P=P, N=N, G=groups, n_chunks=c, n_splits=cfg.n_splits,
        heads_per_split=cfg.heads_per_split, **_x_strides("x", x), **_bc_strides("B", B), **_bc_strides("C", C),
        PACKED=packed, **flags, BLOCK_P=cfg.block_p_full, **blocks,
    )  # fmt: skip
    grid = (batch * c, groups * cfg.n_splits, T // cfg.block_t)
    dx = torch.empty(batch, length, heads, P, dtype=x.dtype, device=x.device)
    dd_intra, dd_state = torch.empty(batch, heads, Lp, **new), torch.empty(batch, heads, Lp, **new)
    dB_part = torch.empty(batch, length, cfg.n_splits, groups, N, **new)
    _ssd_bwd_dx_kernel[grid](
        x, dy, B, C, CB, delta, cum, seq, cu_seqlens, lam, dlast, D, dx, dd_intra, dd_state, dB_part,
        HAS_DLAST=has_dlast, HAS_D=D is not None, D_PER_CHANNEL=D is not None and D.ndim == 2, **common,
    )  # fmt: skip
    ds_rows = torch.empty(batch, heads, Lp, **new)
    dC_part = torch.empty(batch, length, cfg.n_splits, groups, N, **new)
    _ssd_bwd_dc_kernel[grid](
        x, dy, B, C, CB, delta, cum, seq, cu_seqlens, states, initial_state, ds_rows, dC_part, HAS_H0=has_h0, **common
    )
    ds_last = None
    if packed and (has_dlast or has_h0):
        ds_last = torch.zeros(1, heads, Lp, **new) if has_dlast else None
        _ssd_sequence_bwd_kernel[(rows, heads)](
            dy, C, cum, seq, cu_seqlens, states, lam, dlast, initial_state, dinitial, ds_last,
            length, Lp, heads, P, N, groups, C.stride(1), C.stride(2), n_pb,
            HAS_DLAST=has_dlast, HAS_H0=has_h0, **flags, BLOCK_P=cfg.block_p, **blocks,
        )  # fmt: skip

    # Δ's gradient, and through it dt's, A's and dt_bias's.
    ddt = torch.empty(batch, length, heads, dtype=dt.dtype, device=x.device)
    dA_part = torch.empty(batch * c, heads, **new)
    dbias_part = torch.empty(batch * c, heads, **new) if dt_bias is not None else None
    _ssd_dt_bwd_kernel[(batch * c, triton_cdiv(heads, cfg.block_h))](
        dt, A, dt_bias, delta, ds_rows, dd_intra, dd_state, ds_last, yend, seq, ddt, dA_part, dbias_part,
        length, heads, Lp, c, dt.stride(0), dt.stride(1), float(dt_min), float(dt_max),
        PACKED=packed, HAS_DS_LAST=ds_last is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=bool(dt_softplus),
        DT_SCALES_INPUT=bool(dt_scales_input),
        CLAMP=(dt_min, dt_max) != (0.0, math.inf), COMPUTE=flags["COMPUTE"], CHUNK=T, BLOCK_H=cfg.block_h,
        num_warps=cfg.num_warps,
    )  # fmt: skip
    return (
        dx,
        ddt,
        dA_part.sum(0).to(A.dtype),
        dB_part.sum(2).to(B.dtype),
        dC_part.sum(2).to(C.dtype),
        dD,
        dz,
        None if dt_bias is None else dbias_part.sum(0).to(dt_bias.dtype),
        dinitial,
    )


# ----------------------------------------------------------------------------- custom ops


def _fwd_fake(
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens=None, save_y=True
):
    batch, _, heads, P = x.shape
    rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
    y_pre = torch.empty_like(x) if z is not None and save_y else x.new_empty(0)
    return torch.empty_like(x), x.new_empty(rows, heads, P, B.shape[3], dtype=dtype), y_pre


def _bwd_fake(
    dout, dlast, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, y_pre
):
    def like(t):
        return fake_like(t, x)

    dinitial = like(None)
    if initial_state is not None:
        dtype = compute_dtype(x, dt, A, B, C, D, z, dt_bias, initial_state)
        dinitial = initial_state.new_empty(initial_state.shape, dtype=dtype)
    return like(x), like(dt), like(A), like(B), like(C), like(D), like(z), like(dt_bias), dinitial


def _setup_context(ctx, inputs, output):
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, _save = inputs
    ctx.mark_non_differentiable(output[2])
    y_pre = output[2] if z is not None else None
    ctx.save_for_backward(x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, y_pre)
    ctx.options = (dt_softplus, dt_min, dt_max, chunk)
    ctx.initial_state_dtype = None if initial_state is None else initial_state.dtype


def _backward(ctx, dout, dlast, _dy_pre):
    x, dt, A, B, C, D, z, dt_bias, initial_state, cu_seqlens, y_pre = ctx.saved_tensors
    dt_softplus, dt_min, dt_max, chunk = ctx.options
    if dout is None:
        dout = torch.zeros_like(x)
    dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial = ssd_bwd(
        dout, dlast, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, y_pre
    )
    initial_state_dtype = ctx.initial_state_dtype
    return (
        dx,
        ddt,
        dA,
        dB,
        dC,
        None if D is None else dD,
        None if z is None else dz,
        None if dt_bias is None else ddt_bias,
        None,  # dt_softplus
        None,  # dt_min
        None,  # dt_max
        None if initial_state_dtype is None else dinitial.to(initial_state_dtype),
        None,  # chunk
        None,  # cu_seqlens
        None,  # save_y
    )


@kernel_op("ssm::ssd_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context)
def ssd_fwd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    initial_state: Tensor | None,
    chunk: int,
    cu_seqlens: Tensor | None = None,
    save_y: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """out, last state(s), and the output before the gate (what the backward of z needs)."""
    return _ssd_fwd(
        x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, save_y
    )


@kernel_op("ssm::ssd_bwd", fake=_bwd_fake)
def ssd_bwd(
    dout: Tensor,
    dlast: Tensor | None,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_min: float,
    dt_max: float,
    initial_state: Tensor | None,
    chunk: int,
    cu_seqlens: Tensor | None,
    y_pre: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dx, ddt, dA, dB, dC, dD, dz, ddt_bias, dinitial_state (empty for absent inputs)."""
    grads = _ssd_bwd(
        dout, dlast, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_min, dt_max, initial_state, chunk, cu_seqlens, y_pre
    )
    return placeholders(grads, x)


# ----------------------------------------------------------------------------- backend entry point


def ssd_triton(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    initial_state: Tensor | None,
    chunk_size: int,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor] | None:
    """Backend "triton" of :func:`ssm.scan.ssd` (inputs already validated). Returns out (B, L, H, P)
    in x's dtype and the last state (B, H, P, N) in float32 (float64 for float64 inputs); packed
    (``cu_seqlens``), the states are (S, H, P, N). None (declined) for a head dim or state size
    above ``MAX_DIM``. ``chunk_size`` is rounded as :func:`chunk_length` says."""
    if declines(x.shape[3], B.shape[3]) is not None:
        return None
    save_y = z is not None and needs_backward(x, dt, A, B, C, D, z, dt_bias, initial_state)
    out, last, _ = ssd_fwd(
        x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus), float(dt_limit[0]), float(dt_limit[1]), initial_state,
        chunk_length(chunk_size), cu_seqlens, save_y,
    )  # fmt: skip
    return out, last
