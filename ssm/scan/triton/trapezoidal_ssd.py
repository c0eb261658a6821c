"""Backend "triton-ssd" of ``trapezoidal_scan`` (Mamba-3, rank 1): the core on Mamba-2's chunked
SSD kernels (ssd.py), so that the scan is chunk-parallel on the GPU: every chunk's products at
once, then the short pass of states across chunks, where the backend "triton" walks all L steps
in one program per (row, head, block of P) and leaves most of a GPU idle at batch 1.

For rank 1 the fast paths' shifted form (_common_trapezoidal.py) is the SSD recurrence with a
decay a_t = Δ_t·A_t and an input scale s_t of its own,

    H_t = exp(a_t)·H_{t-1} + s_t·v_t ⊗ k̃_t,     y_t = H_t·q̃_t − c_t·(q̃_t·k̃_t)·v_t,

and SSD ties decay and scale together (exp(Δ·A) beside Δ·x ⊗ B). So it runs with A = −1,
Δ = −a_t and the keys k̃_t·s_t / (−a_t) (one group per head: the rotation makes each head's keys
its own): SSD's Δ·x ⊗ B is s_t·v_t ⊗ k̃_t again, and its state and output are the core's. What
SSD does not compute, the diagonal's −c_t·(q̃_t·k̃_t)·v_t and D, is added in PyTorch in the
same autograd function, which also rotates the keys and queries before it and again in its
backward, rather than keeping them (``_RotatedSSDCore``); the gate follows. The "cpu" backend
runs the same form on the C sweeps (trapezoidal_cpu.py).

bfloat16 inputs give the SSD kernels bfloat16 keys, queries and values (their matrix products
on the tensor cores, as mamba-ssm's kernels take them); float16 ones float32 (a key scale of
1/|A| can pass float16's 65504). The chunked core (trapezoidal_chunked.py, passed in) runs
instead for MIMO ranks above 1 (a rank-R input is not one SSD input), P or N above the kernels'
256, a step whose −a_t is 0, below 1e-30 or not finite (``decays_in_range``), and under
torch.compile (the check reads the decays). ``chunk_size`` is the SSD kernels' chunk (rounded to a power of two,
16 to 256).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .._common_trapezoidal import (
    Prepared,
    TrapezoidalArgs,
    decays_in_range,
    gate_and_contract,
    keep_cos_sin,
    kept_cos_sin,
    rotate_per_head,
    rotate_per_head_backward,
    run_core,
    values,
)
from .ssd import _ssd_bwd, _ssd_fwd, chunk_length, declines


def ssd_takes(args: TrapezoidalArgs, p: Prepared) -> bool:
    """Whether the SSD kernels compute this call's core (see the module docstring)."""
    ranks, N, P = args.B.shape[2], args.B.shape[-1], args.x.shape[-1]
    if ranks != 1 or declines(P, N) is not None or torch.compiler.is_compiling():
        return False
    return decays_in_range(p.a)


class _Options(NamedTuple):
    heads: int
    rotary: str
    dtype: torch.dtype  # the compute dtype
    operand: torch.dtype  # of the SSD kernels' x, B and C
    chunk: int


class _RotatedSSDCore(torch.autograd.Function):
    """The core, from the scan's own inputs to the output before the gate: the keys and queries
    rotated per head, the SSD kernels, the diagonal term and D. x (B, L, H, P); B, C (B, L, 1,
    G, N); their biases (H, 1, N), mimo_x (H, 1, P) and D (H,) or None; cos, sin (B, L, 1, H,
    M) and the ``PhaseSource`` they came from (or None); the decay rate −a, s and c (B, L, H);
    H_{-1} (B or S, H, P, N) or None. Returns
    SSD's y − c·(q̃·k̃)·v + D·v (B, L, H, P) in the compute dtype, and H_{L-1}. SSD runs with
    Δ = −a, A = −1 and the keys k̃·s / (−a).

    One function, with its own backward, for two reasons.
    - Memory. It keeps the inputs it came with (x, B and C most often views of in_proj's
      output, which is kept anyway; Δ and θ, which the phase keeps), and forms cos and sin, the
      rotated keys and queries (B, L, H, N) and the values again in the backward. (With packed
      sequences, no source: it keeps cos and sin.) Autograd through the
      parts kept k̃ and q̃ per head in the compute dtype, and v: at d_model 768, N 128, P 64,
      30 KB a token, more than a Mamba2 layer keeps in all.
    - The rate's gradient: through SSD's input Δ·x ⊗ B it is Σ x·dx / Δ, and through the keys'
      division by Δ minus the same again, which cancels to nothing, but after both were rounded
      (bfloat16 operands, and a key scale of 1/|A| that magnifies the rounding as |A| shrinks).
      Here the rate's gradient is the decay's share alone (``dt_scales_input=False``), and the
      keys' scale is differentiated by hand: dk̃ = dB·s / (−a), ds = Σ_n dB·k̃ / (−a)."""

    @staticmethod
    def forward(ctx, x, B, C, B_bias, C_bias, mimo_x, D, cos, sin, source, rate, s, c, H_init, o: _Options, cu_seqlens):
        k, q, v = _keys_queries_values(x, B, C, B_bias, C_bias, mimo_x, cos, sin, o)
        scale = s / rate
        y, H_last, _ = _ssd_fwd(*_operands(v, rate, k, q, scale, o.operand), H_init, o.chunk, cu_seqlens, False)
        y = y.to(o.dtype) - (c * (q * k).sum(-1))[..., None] * v  # the diagonal's shifted part
        if D is not None:
            y = y + D.to(o.dtype)[:, None] * v
        kept = keep_cos_sin(cos, sin, source)
        ctx.save_for_backward(x, B, C, B_bias, C_bias, mimo_x, D, *kept, rate, s, c, H_init, cu_seqlens)
        ctx.options, ctx.source = o, source is not None
        return y, H_last

    @staticmethod
    def backward(ctx, dy, dlast):
        x, B, C, B_bias, C_bias, mimo_x, D, *kept, rate, s, c, H_init, cu_seqlens = ctx.saved_tensors
        o, needs = ctx.options, ctx.needs_input_grad
        cos, sin = kept_cos_sin(kept, ctx.source, o.dtype)
        k, q, v = _keys_queries_values(x, B, C, B_bias, C_bias, mimo_x, cos, sin, o)
        if dy is None:
            dy = torch.zeros_like(v)
        scale = s / rate
        dv, drate, _, dk, dq, _, _, _, dH = _ssd_bwd(
            dy.to(o.operand).contiguous(), dlast, *_operands(v, rate, k, q, scale, o.operand), H_init, o.chunk,
            cu_seqlens, None, dt_scales_input=False,
        )  # fmt: skip
        dk, dq, dv = dk.to(o.dtype), dq.to(o.dtype), dv.to(o.dtype)
        ds = (dk * k).sum(-1) / rate
        dk = dk * scale[..., None]
        # the diagonal term −c·(q̃·k̃)·v and D·v
        g = (dy * v).sum(-1)  # (B, L, H)
        qk = (q * k).sum(-1)
        dq = dq - (c * g)[..., None] * k
        dk = dk - (c * g)[..., None] * q
        dc = -qk * g
        dv = dv - (c * qk)[..., None] * dy
        dD = None
        if D is not None:
            dv = dv + D.to(o.dtype)[:, None] * dy
            dD = g.sum((0, 1)).to(D.dtype) if needs[6] else None
        dx, dmimo_x = dv, None
        if mimo_x is not None:
            dx = dv * mimo_x.to(o.dtype)[:, 0]
            dmimo_x = (dv * x.to(o.dtype)).sum((0, 1))[:, None].to(mimo_x.dtype) if needs[5] else None
        dB, dB_bias, dcos, dsin = rotate_per_head_backward(
            dk[:, :, None], B, B_bias, cos, sin, o.heads, o.rotary, o.dtype, (needs[1], needs[3], needs[7], needs[8])
        )
        dC, dC_bias, dcos_q, dsin_q = rotate_per_head_backward(
            dq[:, :, None], C, C_bias, cos, sin, o.heads, o.rotary, o.dtype, (needs[2], needs[4], needs[7], needs[8])
        )
        dcos = None if dcos is None else dcos + dcos_q
        dsin = None if dsin is None else dsin + dsin_q
        return (dx.to(x.dtype), dB, dC, dB_bias, dC_bias, dmimo_x, dD, dcos, dsin, None, drate, ds, dc, dH, None, None)


def _keys_queries_values(x, B, C, B_bias, C_bias, mimo_x, cos, sin, o: _Options):
    """The rotated keys k̃ and queries q̃ (B, L, H, N) and the values v (B, L, H, P) of rank 1,
    in the compute dtype."""
    k = rotate_per_head(B, B_bias, cos, sin, o.heads, o.rotary, o.dtype)[:, :, 0]
    q = rotate_per_head(C, C_bias, cos, sin, o.heads, o.rotary, o.dtype)[:, :, 0]
    return k, q, values(x, mimo_x, 1, o.dtype)[:, :, 0]


def _operands(v, rate, k, q, scale, operand):
    """The SSD kernels' arguments up to the initial state: x = v, Δ = rate, A = −1, B = k̃·scale,
    C = q̃ (x, B, C in ``operand``), no D, z or Δ bias, no softplus, no clamp."""
    A = torch.full((v.shape[2],), -1.0, dtype=rate.dtype, device=v.device)
    keys = (k * scale[..., None]).to(operand)
    return v.to(operand), rate, A, keys, q.to(operand), None, None, None, False, 0.0, math.inf


def _core(args: TrapezoidalArgs, p: Prepared, fallback: Callable):
    """The core as SSD on the rotated keys (or ``fallback``'s where SSD cannot take it), through
    the gate and the rank contraction: out in x's dtype, and H_{L-1}."""
    if not ssd_takes(args, p):
        return fallback(args, p)
    x, dtype = args.x, args.dtype
    operand = torch.bfloat16 if x.dtype == torch.bfloat16 else dtype
    options = _Options(x.shape[2], args.rotary, dtype, operand, chunk_length(args.chunk_size))
    cos, sin = p.cos[:, :, None], p.sin[:, :, None]  # (B, L, 1, H, M): the rank axis of 1
    y, H_last = _RotatedSSDCore.apply(
        x, args.B, args.C, args.B_bias, args.C_bias, args.mimo_x, args.D, cos, sin, p.source, -p.a, p.s, p.c, p.H_init,
        options, args.cu_seqlens,
    )  # fmt: skip
    out = gate_and_contract(y[:, :, None], None, None, args.z, args.mimo_z, args.mimo_o, dtype)
    return out.to(x.dtype), H_last


def trapezoidal_scan_ssd(args: TrapezoidalArgs, fallback: Callable):
    """Backend "triton-ssd" of :func:`ssm.scan.trapezoidal_scan`: (out, last state). ``fallback``:
    the core for the calls SSD cannot take (the chunked one, which trapezoidal.py passes in: this
    module imports nothing above ssm.scan.triton's own, so that no import loops back here)."""
    return run_core(lambda a, p: _core(a, p, fallback), args)
