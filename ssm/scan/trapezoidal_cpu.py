"""Backend "cpu" of ``trapezoidal_scan`` (Mamba-3): its SISO core on the C selective sweeps
that Mamba-2's ``ssd`` runs on the CPU (cpu.py), forward and backward, packed sequences and
states included.

The fast paths' shifted form (_common_trapezoidal.py) is, for rank 1, the SSD recurrence with a
decay a_t = Δ_t·A_t and an input scale s_t of its own:

    H_t = exp(a_t)·H_{t-1} + s_t·v_t ⊗ k̃_t,     y_t = H_t·q̃_t − c_t·(q̃_t·k̃_t)·v_t

and ``ssd`` ties the two together (exp(Δ·A) beside Δ·x ⊗ B). So it runs with A = −1, Δ = −a_t
and x = v_t·s_t / (−a_t): the sweep's Δ·x is s_t·v_t again, to a rounding or two, and its
state and output are the core's. The keys and queries are rotated first (per head: the sweep's
groups are the heads), the diagonal term −c·(q̃·k̃)·v, D and the gate are added after, in one C
pass each way (``trapezoidal_output``).

That division needs −a_t positive and finite. Where some a_t is 0 (no decay), below 1e-30 or not
finite, and for MIMO ranks above 1 (a rank-R input is not one sweep), the chunked core runs
instead, as under torch.compile: the same answer, by another route. ``chunk_size`` is the
chunked core's; the sweeps walk every step.
"""

from __future__ import annotations

import torch

from ._common_trapezoidal import Prepared, TrapezoidalArgs, gate_and_contract, keys_queries_values, run_core
from .cpu import ssd_cpu, trapezoidal_output
from .trapezoidal_chunked import chunked_core

# The smallest −a_t (a decay of exp(−1e-30) per step) that the input's division by −a_t takes:
# v·s/(−a) stays finite for any finite v·s in float32 and float64.
SMALLEST_DECAY_RATE = 1e-30


def sweeps_take(args: TrapezoidalArgs, p: Prepared) -> bool:
    """Whether the sweeps compute this call's core: rank 1, and every −a_t in [1e-30, ∞). Not
    under torch.compile, where reading the decays would break the graph: the chunked core
    traces whole."""
    if args.B.shape[2] != 1 or torch.compiler.is_compiling():
        return False
    rate = -p.a
    return bool(((rate >= SMALLEST_DECAY_RATE) & (rate < float("inf"))).all())


def _core(args: TrapezoidalArgs, p: Prepared):
    """The core on the selective sweeps: out in x's dtype and H_{L-1}."""
    if not sweeps_take(args, p):
        return chunked_core(args, p)
    x, dtype = args.x, args.dtype
    heads = x.shape[2]
    k, q, v = keys_queries_values(args, p.cos, p.sin)  # rank 1: (B, L, 1, H, N), (B, L, 1, H, P)
    # rank 1 dropped as views (squeeze, not [:, :, 0], whose backward writes a zero-filled
    # tensor of the whole and copies into it)
    k, q, v1 = k.squeeze(2), q.squeeze(2), v.squeeze(2)
    rate = -p.a  # (B, L, H), in [1e-30, ∞)
    scaled = v1 * (p.s / rate)[..., None]
    y, H_last = ssd_cpu(
        scaled, rate, -torch.ones(heads, dtype=dtype, device=x.device), k, q,
        initial_state=p.H_init, cu_seqlens=args.cu_seqlens,
    )  # fmt: skip
    z, D = (None if t is None else t.to(dtype) for t in (args.z, args.D))
    out = None
    if args.mimo_z is None and args.mimo_o is None:  # rank 1 here: nothing to contract
        out = trapezoidal_output(y, v1, z, q, k, p.c, D)  # one C pass, or None
        out = None if out is None else out[:, :, None]  # (B, L, 1, H, P): the rank axis
    if out is None:
        y = y - (p.c * (q * k).sum(-1))[..., None] * v1  # the diagonal's shifted part
        out = gate_and_contract(y[:, :, None], v, args.D, args.z, args.mimo_z, args.mimo_o, dtype)
    return out.to(x.dtype), H_last


def trapezoidal_scan_cpu(args: TrapezoidalArgs):
    """Backend "cpu" of :func:`ssm.scan.trapezoidal_scan`: (out, last state)."""
    return run_core(_core, args)
