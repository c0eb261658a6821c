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
SSD does not compute, the diagonal's −c_t·(q̃_t·k̃_t)·v_t, D and the gate, is added after in
PyTorch; the keys and queries are rotated before it (``keys_queries_values``). The "cpu" backend
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

import torch

from .._common_trapezoidal import (
    Prepared,
    TrapezoidalArgs,
    decays_in_range,
    gate_and_contract,
    keys_queries_values,
    run_core,
)
from .ssd import _ssd_bwd, _ssd_fwd, chunk_length, declines


def ssd_takes(args: TrapezoidalArgs, p: Prepared) -> bool:
    """Whether the SSD kernels compute this call's core (see the module docstring)."""
    ranks, N, P = args.B.shape[2], args.B.shape[-1], args.x.shape[-1]
    if ranks != 1 or declines(P, N) is not None or torch.compiler.is_compiling():
        return False
    return decays_in_range(p.a)


class _SSDCore(torch.autograd.Function):
    """The core's H and y (before the diagonal term) by the SSD kernels: v (B, L, H, P), the
    decay rate −a (B, L, H), the rotated keys k̃ and queries q̃ (B, L, H, N), s (B, L, H), H_{-1}
    (B or S, H, P, N) or None. SSD runs with Δ = −a, A = −1 and the keys k̃·s / (−a).

    Its own backward, because autograd's would not do: through SSD's input Δ·x ⊗ B, the rate's
    gradient is Σ x·dx / Δ, and through the keys' division by it minus the same again, which
    cancels to nothing, but after both were rounded (bfloat16 operands, and a key scale of 1/|A|
    that magnifies the rounding as |A| shrinks). Here the rate's gradient is the decay's share
    alone (``dt_scales_input=False``), and the keys' scale is differentiated by hand: dk̃ = dB·s /
    (−a), ds = Σ_n dB·k̃ / (−a)."""

    @staticmethod
    def forward(ctx, v, rate, k, q, s, H_init, operand, chunk: int, cu_seqlens):
        scale = s / rate
        y, H_last, _ = _ssd_fwd(*_operands(v, rate, k, q, scale, operand), H_init, chunk, cu_seqlens, False)
        # what the kernels read is formed again in the backward from tensors kept anyway (v, k̃
        # and q̃ by the diagonal term's autograd), not kept in the operands' dtype beside them
        ctx.save_for_backward(v, rate, k, q, scale, H_init, cu_seqlens)
        ctx.chunk, ctx.operand = chunk, operand
        return y, H_last

    @staticmethod
    def backward(ctx, dy, dlast):
        v, rate, k, q, scale, H_init, cu_seqlens = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(v, dtype=ctx.operand)
        v_, rate, A, keys, q_, *options = _operands(v, rate, k, q, scale, ctx.operand)
        dx, drate, _, dB, dC, _, _, _, dH = _ssd_bwd(
            dy.contiguous(), dlast, v_, rate, A, keys, q_, *options, H_init, ctx.chunk, cu_seqlens, None,
            dt_scales_input=False,
        )  # fmt: skip
        dB = dB.to(k.dtype)
        ds = (dB * k).sum(-1) / rate
        return dx.to(v.dtype), drate, dB * scale[..., None], dC.to(q.dtype), ds, dH, None, None, None


def _operands(v, rate, k, q, scale, operand):
    """The SSD kernels' arguments up to the initial state: x = v, Δ = rate, A = −1, B = k̃·scale,
    C = q̃ (x, B, C in ``operand``), no D, z or Δ bias, no softplus, no clamp."""
    A = torch.full((v.shape[2],), -1.0, dtype=rate.dtype, device=v.device)
    keys = (k * scale[..., None]).to(operand)
    return v.to(operand), rate, A, keys, q.to(operand), None, None, None, False, 0.0, math.inf


def _core(args: TrapezoidalArgs, p: Prepared, fallback: Callable):
    """The core as SSD on the rotated keys (or ``fallback``'s where SSD cannot take it); out in
    x's dtype and H_{L-1}."""
    if not ssd_takes(args, p):
        return fallback(args, p)
    x, dtype = args.x, args.dtype
    k, q, v = keys_queries_values(args, p.cos, p.sin)  # (B, L, 1, H, N), (B, L, 1, H, P)
    k, q, v1 = k.squeeze(2), q.squeeze(2), v.squeeze(2)
    operand = torch.bfloat16 if x.dtype == torch.bfloat16 else dtype
    y, H_last = _SSDCore.apply(v1, -p.a, k, q, p.s, p.H_init, operand, chunk_length(args.chunk_size), args.cu_seqlens)
    y = y.to(dtype) - (p.c * (q * k).sum(-1))[..., None] * v1  # the diagonal's shifted part
    out = gate_and_contract(y[:, :, None], v, args.D, args.z, args.mimo_z, args.mimo_o, dtype)
    return out.to(x.dtype), H_last


def trapezoidal_scan_ssd(args: TrapezoidalArgs, fallback: Callable):
    """Backend "triton-ssd" of :func:`ssm.scan.trapezoidal_scan`: (out, last state). ``fallback``:
    the core for the calls SSD cannot take (the chunked one, which trapezoidal.py passes in: this
    module imports nothing above ssm.scan.triton's own, so that no import loops back here)."""
    return run_core(lambda a, p: _core(a, p, fallback), args)
