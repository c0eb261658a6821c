"""The arithmetic the fast paths of ``trapezoidal_scan`` share (the chunked and Triton backends,
and the one-step form), and the typed value they take the scan's arguments in
(``TrapezoidalArgs``). The reference (reference.py) imports none of it: it runs the recurrence
on complex numbers, where these run it on rotated real vectors, so that a slip in either shows
up as a difference between them.

The fast paths compute the recurrence in a shifted form. With c_t = (1 − λ_{t+1})·Δ_{t+1} the
weight the next step gives to this step's input (0 at the last step of a sequence) and
s_t = λ_t·Δ_t + c_t, the state H_t = h_t + c_t·U_t, U_t = Σ_r v_{t,r} ⊗ k̃_{t,r}, obeys the
first-order recurrence of Mamba-2's SSD with a rank-R input:

    H_t = α_t·H_{t-1} + s_t·U_t,                  H_{-1} = h_{-1} + (1 − λ_0)·Δ_0·U_{-1}
    y_{t,r} = H_t·q̃_{t,r} − c_t·Σ_{r'} (q̃_{t,r}·k̃_{t,r'})·v_{t,r'} + D·v_{t,r}

and h_{L-1} = H_{L-1} (c is 0 there). The *core* that both backends implement takes a = Δ·A
(α = exp(a)), s, c, the phase φ and H_{-1}; the prologue here computes those, the epilogue the
last state (phase, h, rotated key, value) from the core's H_{L-1}.

k̃ = Rot(φ_t)·(B_t + B_bias) and q̃ = Rot(φ_t)·(C_t + C_bias) rotate each state pair (n0, n1) by
its phase: (w0, w1) → (w0·cos φ − w1·sin φ, w0·sin φ + w1·cos φ); the pairs are (2m, 2m + 1)
("interleaved") or (m, m + N/2) ("halved"), m < M; the other entries are not rotated.

Shape symbols: B batch, L length, H heads, P head dim, G groups, N state size, R MIMO rank,
M rotary pairs, S packed sequences.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..ops.activation import dsilu
from ._checks import compute_dtype
from ._common import all_finite, finite_or_zero, poisoned_since

TWO_PI = 2 * math.pi


class TrapezoidalState(NamedTuple):
    """What Mamba-3's recurrence carries from one step to the next, per sequence:
    phase (·, H, M) the cumulative rotary angle φ (not reduced modulo 2π), ssm (·, H, P, N) the
    state h in absolute (rotated) coordinates, key (·, R, H, N) (or (·, H, N) without a rank
    axis) the last step's rotated key k̃, value (·, H, P) the last step's input x."""

    phase: torch.Tensor
    ssm: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor


# TrapezoidalArgs' tensor fields that hold values (not cu_seqlens, an index; the state apart)
_FLOAT_TENSORS = "x dt A B C trap angles D z B_bias C_bias mimo_x mimo_z mimo_o".split()


@dataclass(frozen=True)
class TrapezoidalArgs:
    """``trapezoidal_scan``'s arguments as its backends take them: validated, in one form
    whatever the caller's (a rank axis always, R = 1 without one), with the dtype the state is
    computed in (from the tensors). The public function builds it once; each backend reads the
    fields it needs. (The reference takes plain arguments: ``keywords()``.)"""

    x: Tensor  # (B, L, H, P)
    dt: Tensor  # (B, L, H)
    A: Tensor  # (B, L, H)
    B: Tensor  # (B, L, R, G, N)
    C: Tensor  # (B, L, R, G, N)
    trap: Tensor  # (B, L, H)
    angles: Tensor  # (B, L, H, M)
    D: Tensor | None  # (H,)
    z: Tensor | None  # (B, L, H, P)
    B_bias: Tensor | None  # (H, R, N)
    C_bias: Tensor | None  # (H, R, N)
    mimo_x: Tensor | None  # (H, R, P)
    mimo_z: Tensor | None  # (H, R, P)
    mimo_o: Tensor | None  # (H, R, P)
    rotary: str  # "interleaved" or "halved"
    initial_state: TrapezoidalState | None  # phase (B, H, M), ssm (B, H, P, N), key (B, R, H, N), value (B, H, P)
    chunk_size: int  # the chunked backend's block length
    cu_seqlens: Tensor | None  # (S + 1,) int64 on x's device; then every B of the state is S
    dtype: torch.dtype = field(init=False)  # of the state: float32, or float64 for float64 inputs

    def __post_init__(self):
        object.__setattr__(self, "dtype", compute_dtype(*self.tensors().values()))  # (frozen)

    @property
    def device(self) -> torch.device:
        return self.x.device

    def tensors(self) -> dict[str, Tensor | None]:
        """The float tensors by name, the initial state's parts as ``initial_state.<part>``: what
        sets the dtype, and what must share x's device (cu_seqlens, an index, is not one)."""
        named = {name: getattr(self, name) for name in _FLOAT_TENSORS}
        if self.initial_state is not None:
            named.update((f"initial_state.{n}", t) for n, t in zip(TrapezoidalState._fields, self.initial_state))
        return named

    def keywords(self) -> dict:
        """The arguments by the public function's names (all but ``dtype``), for a backend with
        a plain signature."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.init}


def rotate(w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: str) -> torch.Tensor:
    """w (..., N) with its M pairs rotated by the angles whose cos and sin are (..., M)."""
    M, N = cos.shape[-1], w.shape[-1]
    if rotary == "interleaved":
        w0, w1, rest = w[..., 0 : 2 * M : 2], w[..., 1 : 2 * M : 2], w[..., 2 * M :]
        r0, r1 = w0 * cos - w1 * sin, w0 * sin + w1 * cos
        return torch.cat([torch.stack([r0, r1], dim=-1).flatten(-2), rest], dim=-1)
    half = N // 2
    w0, w1 = w[..., :M], w[..., half : half + M]
    r0, r1 = w0 * cos - w1 * sin, w0 * sin + w1 * cos
    return torch.cat([r0, w[..., M:half], r1, w[..., half + M :]], dim=-1)


def rotate_backward(dw: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary: str):
    """Gradients through :func:`rotate`, given d(rotated w) ``dw`` (..., N) and w (..., N):
    (dw through the inverse rotation, dcos, dsin), the last two (..., M)."""
    M = cos.shape[-1]
    if rotary == "interleaved":
        (d0, d1), (w0, w1) = (
            (dw[..., 0 : 2 * M : 2], dw[..., 1 : 2 * M : 2]),
            (w[..., 0 : 2 * M : 2], w[..., 1 : 2 * M : 2]),
        )
    else:
        half = w.shape[-1] // 2
        (d0, d1), (w0, w1) = (dw[..., :M], dw[..., half : half + M]), (w[..., :M], w[..., half : half + M])
    return rotate(dw, cos, -sin, rotary), d0 * w0 + d1 * w1, d1 * w0 - d0 * w1


def per_head(M: torch.Tensor, heads: int, bias: torch.Tensor | None, dtype) -> torch.Tensor:
    """B or C (..., R, G, N) as (..., R, H, N), head h reading group h // (H / G), plus its
    bias (H, R, N)."""
    out = M.to(dtype).repeat_interleave(heads // M.shape[-2], dim=-2)
    return out if bias is None else out + bias.to(dtype).transpose(0, 1)


def values(x: torch.Tensor, mimo_x: torch.Tensor | None, ranks: int, dtype) -> torch.Tensor:
    """v = x ⊙ mimo_x per rank: x (..., H, P) -> (..., R, H, P)."""
    x = x.to(dtype).unsqueeze(-3)
    return x.expand(*x.shape[:-3], ranks, *x.shape[-2:]) if mimo_x is None else x * mimo_x.to(dtype).transpose(0, 1)


def gate_and_contract(y, v, D, z, mimo_z, mimo_o, dtype):
    """y (B, L, R, H, P) → (y + D·v)·silu(z ⊙ mimo_z), then Σ_r mimo_o ⊙ · when mimo_o is given."""
    if z is not None:
        return _Gated.apply(y, v, D, z, mimo_z, mimo_o, dtype)
    if D is not None:
        y = y + D.to(dtype)[:, None] * v
    if mimo_o is not None:
        y = (y * mimo_o.to(dtype).transpose(0, 1)).sum(2)
    return y


class _Gated(torch.autograd.Function):
    """``gate_and_contract`` with a gate: y (B, L, R, H, P), v (B, L, R, H, P) (read only with
    D), D (H,), z (B, L, H, P), mimo_z and mimo_o (H, R, P) or None. It keeps its inputs as they
    came for the backward, z most often a view of in_proj's output, and forms the rest again
    there. Autograd through the formula kept z in the compute dtype, silu(z) and y + D·v besides,
    and with MIMO's weights four tensors of y's size (R of them a step).

    y, which only the gate's gradients read, is kept in bfloat16 when z is bfloat16 and the
    rank is 1 (as mamba-ssm keeps its output before the gate): half the bytes, and dz carries
    bfloat16's rounding of y, as every gradient through a bfloat16 activation does. With MIMO,
    dz sums R ranks' terms, which can cancel, and y stays in the compute dtype."""

    @staticmethod
    def forward(ctx, y, v, D, z, mimo_z, mimo_o, dtype):
        needs = ctx.needs_input_grad
        gate_grads = needs[3] or needs[4] or needs[5]
        kept = None
        if gate_grads:
            kept = y.to(torch.bfloat16) if z.dtype == torch.bfloat16 and y.shape[2] == 1 else y
        keep_v = D is not None and (needs[2] or gate_grads)
        ctx.save_for_backward(kept, v if keep_v else None, D, z, mimo_z, mimo_o)
        ctx.dtype = dtype
        out = _Gated._pre(y, v, D, dtype) * F.silu(_Gated._gate(z, mimo_z, dtype))
        return out if mimo_o is None else (out * mimo_o.to(dtype).transpose(0, 1)).sum(2)

    @staticmethod
    def _pre(y, v, D, dtype):
        return y if D is None else y + D.to(dtype)[:, None] * v

    @staticmethod
    def _gate(z, mimo_z, dtype):  # (B, L, 1 or R, H, P)
        g = z.to(dtype).unsqueeze(2)
        return g if mimo_z is None else g * mimo_z.to(dtype).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad):
        y, v, D, z, mimo_z, mimo_o = ctx.saved_tensors
        needs, dtype = ctx.needs_input_grad, ctx.dtype
        g = _Gated._gate(z, mimo_z, dtype)
        silu = F.silu(g)
        per_rank = grad if mimo_o is None else grad.unsqueeze(2) * mimo_o.to(dtype).transpose(0, 1)
        d_pre = per_rank * silu  # the gradient of y + D·v, (B, L, R, H, P)
        dy = d_pre if needs[0] else None
        dv = dD = dz = d_mimo_z = d_mimo_o = None
        if D is not None:
            Dc = D.to(dtype)[:, None]
            dv = d_pre * Dc if needs[1] else None
            dD = (d_pre * v).sum_to_size(Dc.shape).view(D.shape).to(D.dtype) if needs[2] else None
        if needs[3] or needs[4] or needs[5]:
            pre = _Gated._pre(y.to(dtype), v, D, dtype)
            if needs[5]:  # Σ over the tokens of grad·(y + D·v)·silu(g), per rank
                d_mimo_o = (grad.unsqueeze(2) * pre * silu).sum((0, 1)).transpose(0, 1).to(mimo_o.dtype)
            d_gate = per_rank * pre * dsilu(g)  # (B, L, 1 or R, H, P)
            if needs[3]:
                dz = (d_gate if mimo_z is None else d_gate * mimo_z.to(dtype).transpose(0, 1)).sum(2).to(z.dtype)
            if needs[4]:
                d_mimo_z = (d_gate * z.to(dtype).unsqueeze(2)).sum((0, 1)).transpose(0, 1).to(mimo_z.dtype)
        return dy, dv, dD, dz, d_mimo_z, d_mimo_o, None


def _pair_slices(N: int, M: int, rotary: str) -> tuple[slice, slice]:
    """Where the first and second entries of the M rotated pairs lie in a state of size N."""
    if rotary == "interleaved":
        return slice(0, 2 * M, 2), slice(1, 2 * M, 2)
    return slice(0, M), slice(N // 2, N // 2 + M)


def rotate_per_head(M: Tensor, bias: Tensor | None, cos: Tensor, sin: Tensor, heads: int, rotary: str, dtype):
    """``rotate(per_head(M, heads, bias, dtype), cos, sin, rotary)`` in one new tensor, rotated in
    place: B or C (B, L, R, G, N) → (B, L, R, H, N), cos and sin (B, L, 1 or R, H, M)."""
    w = per_head(M, heads, bias, dtype)  # (B, L, R, H, N): repeat_interleave's, never M's memory
    first, second = _pair_slices(w.shape[-1], cos.shape[-1], rotary)
    w0, w1 = w[..., first].clone(), w[..., second].clone()
    w[..., first] = w0 * cos - w1 * sin
    w[..., second] = w0 * sin + w1 * cos
    return w


def rotate_per_head_backward(grad, M, bias, cos, sin, heads: int, rotary: str, dtype, needs=(True,) * 4):
    """The gradients of :func:`rotate_per_head`'s M, bias, cos and sin from its output's ``grad``
    (B, L, R, H, N), each formed once (the inverse rotation, the groups' sum as one reduction);
    None where ``needs`` says no. M and bias are read again, not the rotated output."""
    first, second = _pair_slices(grad.shape[-1], cos.shape[-1], rotary)
    w = per_head(M, heads, bias, dtype)
    w0, w1 = w[..., first], w[..., second]
    d0, d1 = grad[..., first], grad[..., second]

    def per_angle(d):  # summed over the ranks when the angles are the same for each
        return d.sum(2, keepdim=True) if cos.shape[2] == 1 < grad.shape[2] else d

    dcos = per_angle(d0 * w0 + d1 * w1) if needs[2] else None
    dsin = per_angle(d1 * w0 - d0 * w1) if needs[3] else None
    dw = grad.clone()  # the inverse rotation, (w0, w1) = Rot(−φ)·(d0, d1)
    dw[..., first] = d0 * cos + d1 * sin
    dw[..., second] = d1 * cos - d0 * sin
    d_bias = dw.flatten(0, 1).sum(0).transpose(0, 1).to(bias.dtype) if needs[1] else None  # (H, R, N)
    d_M = None
    if needs[0]:
        groups = M.shape[-2]
        d_M = dw.unflatten(-2, (groups, heads // groups)).sum(-2).to(M.dtype)
    return d_M, d_bias, dcos, dsin


class _RotatedPerHead(torch.autograd.Function):
    """:func:`rotate_per_head` with a backward of its own: autograd through the slices, stack
    and cat of ``rotate`` and through ``repeat_interleave`` writes a zero-filled tensor of the
    whole (B, L, R, H, N) for every slice and copies into it. With a ``source`` of the phase,
    cos and sin are formed again in the backward rather than kept (``PhaseSource``)."""

    @staticmethod
    def forward(ctx, M, bias, cos, sin, heads: int, rotary: str, dtype, source):
        # M (per group, most often a view of in_proj's output) rather than w0 and w1 per head:
        # the backward forms those again
        ctx.save_for_backward(M, bias, *keep_cos_sin(cos, sin, source))
        ctx.rotary, ctx.heads, ctx.dtype, ctx.source = rotary, heads, dtype, source is not None
        return rotate_per_head(M, bias, cos, sin, heads, rotary, dtype)

    @staticmethod
    def backward(ctx, grad):
        M, bias, *kept = ctx.saved_tensors
        cos, sin = kept_cos_sin(kept, ctx.source, ctx.dtype)
        grads = rotate_per_head_backward(
            grad, M, bias, cos, sin, ctx.heads, ctx.rotary, ctx.dtype, ctx.needs_input_grad[:4]
        )
        return *grads, None, None, None, None


def rotated_per_head(
    M: Tensor, heads: int, bias: Tensor | None, cos: Tensor, sin: Tensor, rotary: str, dtype, source=None
):
    """``rotate(per_head(M, heads, bias, dtype), cos, sin, rotary)``: B or C (B, L, R, G, N) as
    the rotated keys or queries (B, L, R, H, N), cos and sin (B, L, 1 or R, H, M), with one
    backward pass; ``source``: the phase's ``PhaseSource``, which cos and sin (then with a rank
    axis of 1) are formed from again in the backward, or None to keep them."""
    if cos.shape[-1] == 0:
        return per_head(M, heads, bias, dtype)
    return _RotatedPerHead.apply(M, bias, cos, sin, heads, rotary, dtype, source)


def keys_queries_values(args: TrapezoidalArgs, cos: Tensor, sin: Tensor, source=None):
    """The rotated keys k̃ and queries q̃ (B, L, R, H, N) and the values v (B, L, R, H, P) of
    the core, in the compute dtype; cos, sin (B, L, H, M) of the phase, formed again in the
    backward from ``source`` (a ``PhaseSource``) where one is given."""
    heads, ranks, dtype = args.x.shape[2], args.B.shape[2], args.dtype
    cos, sin = cos[:, :, None], sin[:, :, None]  # (B, L, 1, H, M): the same for every rank
    k = rotated_per_head(args.B, heads, args.B_bias, cos, sin, args.rotary, dtype, source)
    q = rotated_per_head(args.C, heads, args.C_bias, cos, sin, args.rotary, dtype, source)
    return k, q, values(args.x, args.mimo_x, ranks, dtype)


# The smallest −a_t (a decay of exp(−1e-30) per step) that the SSD form of the core takes (A = −1,
# Δ = −a_t, the input scaled by s_t / −a_t): v·s/(−a) stays finite for any finite v·s in float32
# and float64.
SMALLEST_DECAY_RATE = 1e-30


def decays_in_range(a: Tensor) -> bool:
    """Whether every −a_t lies in [SMALLEST_DECAY_RATE, ∞), so that the core can run as Mamba-2's
    SSD (A = −1, Δ = −a_t, the keys scaled by s_t / −a_t): the "cpu" backend's sweeps and the
    "triton-ssd" backend. (It reads the tensor: a host sync, and a graph break under compile.)"""
    rate = -a
    return bool(((rate >= SMALLEST_DECAY_RATE) & (rate < float("inf"))).all())


class Prepared(NamedTuple):
    """The core's inputs that the prologue derives (all in the compute dtype)."""

    a: torch.Tensor  # (B, L, H) Δ·A
    s: torch.Tensor  # (B, L, H)
    c: torch.Tensor  # (B, L, H)
    phase: torch.Tensor  # (B, L, H, M) φ_t, not reduced (what the last state reports)
    cos: torch.Tensor  # (B, L, H, M) cos φ_t, from φ reduced modulo 2π in float64
    sin: torch.Tensor
    H_init: torch.Tensor | None  # (B or S, H, P, N)
    # what cos and sin can be formed from again in a backward, rather than kept for it (None:
    # keep them; packed sequences, and a backend's own phase)
    source: PhaseSource | None = None


def prologue(args: TrapezoidalArgs, rotary_phase: Callable | None = None) -> Prepared:
    """a, s, c, the phase and H_{-1} (see the module docstring). ``rotary_phase(delta, angles,
    phase0, cu_seqlens, dtype)``: a backend's (phase, cos, sin), or None to leave them to the
    tensors here (``tensor_rotary_phase``)."""
    x, initial_state, cu_seqlens, dtype = args.x, args.initial_state, args.cu_seqlens, args.dtype
    batch, length, heads, _ = x.shape
    ranks = args.B.shape[2]
    delta, lam = args.dt.to(dtype), args.trap.to(dtype)
    a = delta * args.A.to(dtype)
    carried = (1 - lam) * delta  # (1 − λ_t)·Δ_t: the weight step t gives to step t - 1's input
    c = F.pad(carried[:, 1:], (0, 0, 0, 1))  # c_t = carried_{t+1}; 0 after the last step
    # c_t comes from step t + 1, and any finite value gives step t's output exactly (it is added to
    # H_t and taken out again in y_t): a non-finite Δ or λ at t + 1 must not reach step t
    c = finite_or_zero(c)
    if cu_seqlens is not None:
        starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
        nonempty = ends > starts
        c = c.index_fill(1, ends[nonempty] - 1, 0.0)  # nor across the end of a packed sequence
    s = lam * delta + c

    # φ_t = φ_{-1} + Σ_{s ≤ t} Δ_s·θ_s per sequence, summed in float64 so that long sequences
    # keep their precision; cos and sin of it reduced modulo 2π.
    phase0 = None if initial_state is None else initial_state.phase
    found = None if rotary_phase is None else rotary_phase(delta, args.angles, phase0, cu_seqlens, dtype)
    phase, cos, sin = tensor_rotary_phase(delta, args.angles, phase0, cu_seqlens, dtype) if found is None else found
    source = PhaseSource(delta, args.angles, phase0, dtype) if found is None and cu_seqlens is None else None

    H_init = None
    if initial_state is not None:
        # the first step's β-term: (1 − λ_0)·Δ_0 times the previous step's input U_{-1}
        if cu_seqlens is None:
            first = carried[:, 0] if length else carried.new_zeros(batch, heads)  # (B, H)
        else:
            first = torch.where(nonempty[:, None], carried[0, starts.clamp(max=max(length - 1, 0))], 0.0)
        v0 = values(initial_state.value, args.mimo_x, ranks, dtype)  # (S, R, H, P)
        U0 = torch.einsum("srhp,srhn->shpn", v0, initial_state.key.to(dtype))
        H_init = initial_state.ssm.to(dtype) + first[..., None, None] * U0
    return Prepared(a, s, c, phase, cos, sin, H_init, source)


def tensor_rotary_phase(delta: Tensor, angles: Tensor, phase0: Tensor | None, cu_seqlens: Tensor | None, dtype):
    """φ_t = φ_{-1} + Σ_{s ≤ t} Δ_s·θ_s per sequence (not reduced) and its cos and sin, (B, L, H,
    M) in ``dtype``, by tensors: delta (B, L, H), angles (B, L, H, M), phase0 (B or S, H, M) or
    None."""
    if cu_seqlens is None:  # (a non-finite increment reaches the steps after it only)
        return _RotaryPhase.apply(delta, angles, phase0, dtype)
    length = delta.shape[1]
    increments = delta.double()[..., None] * angles.double()  # (B, L, H, M)
    phase0 = None if phase0 is None else phase0.double()
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    # one sum across the packed sequences, each sequence's start taken off: a non-finite
    # increment is summed as 0 here (it would reach the next sequences through that
    # subtraction), and the phase is NaN from it to its sequence's end
    bad = None if all_finite(increments) else ~torch.isfinite(increments)
    summed = (increments if bad is None else finite_or_zero(increments)).cumsum(1)
    before = F.pad(summed, (0, 0, 0, 0, 1, 0))[:, starts]  # (1, S, H, M): sum before each start
    base = -before if phase0 is None else phase0[None] - before
    seq_of = torch.repeat_interleave(torch.arange(len(starts), device=delta.device), ends - starts, output_size=length)
    phase64 = summed + base[:, seq_of]
    if bad is not None:
        phase64 = phase64.masked_fill(poisoned_since(bad, cu_seqlens), float("nan"))
    return (phase64.to(dtype), *_cos_sin(phase64, dtype))


def _cos_sin(phase64: Tensor, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of a float64 phase reduced modulo 2π, in ``dtype``."""
    reduced = torch.remainder(phase64, TWO_PI)
    return torch.cos(reduced).to(dtype), torch.sin(reduced).to(dtype)


def _phase64(delta: Tensor, angles: Tensor, phase0: Tensor | None) -> Tensor:
    """φ_t = φ_{-1} + Σ_{s ≤ t} Δ_s·θ_s (B, L, H, M) in float64, one unpacked sequence a row."""
    phase64 = (delta.double()[..., None] * angles.double()).cumsum(1)
    return phase64 if phase0 is None else phase64 + phase0.double()[:, None]


class PhaseSource(NamedTuple):
    """What the rotary phase of unpacked rows is summed from: Δ (B, L, H) in the compute dtype,
    θ (B, L, H, M), φ_{-1} (B, H, M) or None, and that dtype. The autograd functions that rotate
    keep these (which the phase's own backward keeps too) and form cos and sin again in their
    backward: kept, cos and sin are 2·H·M numbers a token in the compute dtype (6 KB at d_model
    768, N 128, half the pairs rotated), and forming them again is one sum along L and an
    elementwise pass over (B, L, H, M), little beside the scan's."""

    delta: Tensor
    angles: Tensor
    phase0: Tensor | None
    dtype: torch.dtype

    def cos_sin(self) -> tuple[Tensor, Tensor]:
        """cos and sin (B, L, H, M), the same numbers as the forward's (same operations, same order)."""
        return _cos_sin(_phase64(self.delta, self.angles, self.phase0), self.dtype)


def keep_cos_sin(cos: Tensor, sin: Tensor, source: PhaseSource | None) -> tuple:
    """What an autograd function keeps for cos and sin: the source's tensors, or cos and sin
    themselves (and None) without one. Pass them to ``save_for_backward`` and the saved ones to
    :func:`kept_cos_sin`."""
    return (cos, sin, None) if source is None else (source.delta, source.angles, source.phase0)


def kept_cos_sin(kept, from_source: bool, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin from what :func:`keep_cos_sin` kept: (B, L, 1, H, M) formed again from a
    source (the rank axis of 1 that the rotations take), else as they were kept."""
    if not from_source:
        return kept[0], kept[1]
    cos, sin = PhaseSource(*kept, dtype).cos_sin()
    return cos[:, :, None], sin[:, :, None]


class _RotaryPhase(torch.autograd.Function):
    """``tensor_rotary_phase`` of one unpacked sequence per row: φ_t = φ_{-1} + Σ_{s ≤ t} Δ_s·θ_s
    summed in float64, keeping for the backward only Δ, θ and φ_{-1}. Autograd kept θ and φ in
    float64 besides, two tensors of (B, L, H, M) at 8 bytes; the cos and sin returned are formed
    again in the backward (``PhaseSource``) rather than kept. The backward sums in float64 too:
    dφ_t = dphase_t − dcos_t·sin φ_t + dsin_t·cos φ_t, then the increments' gradient is dφ
    summed from t to the end."""

    @staticmethod
    def forward(ctx, delta, angles, phase0, dtype):
        phase64 = _phase64(delta, angles, phase0)  # (B, L, H, M)
        cos, sin = _cos_sin(phase64, dtype)
        ctx.save_for_backward(delta, angles, phase0)
        ctx.dtype = dtype
        return phase64.to(dtype), cos, sin

    @staticmethod
    def backward(ctx, d_phase, d_cos, d_sin):
        delta, angles, phase0 = ctx.saved_tensors
        d = torch.zeros(angles.shape, dtype=torch.float64, device=angles.device)
        if d_phase is not None:
            d = d + d_phase.double()
        if d_cos is not None or d_sin is not None:
            cos, sin = PhaseSource(delta, angles, phase0, ctx.dtype).cos_sin()
            if d_cos is not None:
                d = d - d_cos.double() * sin.double()
            if d_sin is not None:
                d = d + d_sin.double() * cos.double()
        d_inc = d.flip(1).cumsum(1).flip(1)  # each increment reaches every phase from its step on
        d_delta = (d_inc * angles.double()).sum(-1).to(delta.dtype) if ctx.needs_input_grad[0] else None
        d_angles = (d_inc * delta.double()[..., None]).to(angles.dtype) if ctx.needs_input_grad[1] else None
        d_phase0 = d.sum(1).to(phase0.dtype) if phase0 is not None and ctx.needs_input_grad[2] else None
        return d_delta, d_angles, d_phase0, None


def epilogue(args: TrapezoidalArgs, prepared: Prepared, H_last: Tensor) -> TrapezoidalState:
    """The last state from the core's H_{L-1}: the phase, the rotated key and the value of each
    sequence's last step (its initial state's, or zeros, when it has none)."""
    x, B, initial_state, cu_seqlens, dtype = args.x, args.B, args.initial_state, args.cu_seqlens, args.dtype
    batch, length, heads, head_dim = x.shape
    ranks, N = B.shape[2], B.shape[4]
    M = prepared.phase.shape[-1]
    if cu_seqlens is None:
        rows, last = torch.arange(batch, device=x.device), torch.full((batch,), length - 1, device=x.device)
        nonempty = torch.full((batch,), length > 0, device=x.device)
    else:
        starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
        nonempty = ends > starts
        rows, last = torch.zeros_like(ends), (ends - 1).clamp(min=0)
    if length == 0:
        last = last.clamp(min=0)
        phase = x.new_zeros(len(rows), heads, M, dtype=dtype)
        key = x.new_zeros(len(rows), ranks, heads, N, dtype=dtype)
        value = x.new_zeros(len(rows), heads, head_dim, dtype=dtype)
    else:
        phase = prepared.phase[rows, last]  # (S, H, M)
        k = per_head(B[rows, last], heads, args.B_bias, dtype)  # (S, R, H, N)
        key = rotate(k, prepared.cos[rows, last][:, None], prepared.sin[rows, last][:, None], args.rotary)
        value = x[rows, last].to(dtype)
    if initial_state is None:
        empty = (x.new_zeros(1, dtype=dtype),) * 3
    else:
        empty = tuple(s.to(dtype) for s in (initial_state.phase, initial_state.key, initial_state.value))

    def pick(found, fallback):
        keep = nonempty.reshape(-1, *[1] * (found.ndim - 1))
        return torch.where(keep, found, fallback)

    return TrapezoidalState(pick(phase, empty[0]), H_last, pick(key, empty[1]), pick(value, empty[2]))


def run_core(
    core: Callable[[TrapezoidalArgs, Prepared], tuple[Tensor, Tensor]],
    args: TrapezoidalArgs,
    rotary_phase: Callable | None = None,
):
    """A fast backend: the prologue (with ``rotary_phase``, see :func:`prologue`), ``core``
    (which returns the output and H_{L-1}), the epilogue. Returns (out, last state)."""
    prepared = prologue(args, rotary_phase)
    out, H_last = core(args, prepared)
    return out, epilogue(args, prepared, H_last)
