"""Fast CPU path: sequential sweeps over time in fused chunks, parallel across everything else.

On a CPU the parallel scan is the wrong algorithm: batch × channels × state already give
ample parallelism, and a sweep over L that keeps the state h in cache does O(L) work with no
(B, L, D, N) temporaries. This backend walks the sequence in chunks of ``CHUNK`` steps. One
chunk is a small function of the state before it and of the chunk's inputs (time-major, so
a chunk is a contiguous slice); it is compiled once by ``torch.compile`` (inductor writes a
fused C++ loop) and called L / CHUNK times. A shorter last chunk runs the same function
eagerly, so the compiled code never sees the sequence length and is not recompiled for a new
one. Without a working compiler the chunks run eagerly after a one-time warning.

Backward is a reverse sweep, not autograd through the loop. The forward keeps only the state
at the start of every chunk (``states``, (L / CHUNK, B, D, N)); the backward recomputes a
chunk's states from it, then runs the adjoint recurrence through the chunk:

    λ_t = dLoss/dh_t = C_t·gy_t + exp(Δ_{t+1}A)·λ_{t+1}        (λ after the last step: dlast)
    dC_t = Σ gy_t·h_t     dB_t = Σ λ_t·Δ_t·u_t      d(Δ_t·u_t) = Σ_n λ_t·B_t
    s_t = λ_t·h_{t-1}·exp(Δ_t A):   dΔ_t += Σ_n s_t·A,   dA += Σ_{b,t} s_t·Δ_t
    dh_{-1} = exp(Δ_0 A)·λ_0

so forward+backward memory is O(B·D·L) plus (L / CHUNK)·B·D·N for the chunk-start states
(with CHUNK ≥ N that is itself O(B·D·L)), never O(B·D·L·N). Under ``torch.no_grad()`` (or
when no input needs a gradient) the forward saves nothing.

Costs: the first call compiles the forward chunk and, on the first backward, the backward
chunk (measured on a loaded 2-core machine: tens of seconds each; inductor caches them on disk,
so later processes load them in seconds). A new sequence length reuses them (the compiled code
only ever sees CHUNK steps); a second batch size or width recompiles once with those sizes
symbolic (torch's automatic dynamic shapes), and not again. The compiled chunk is one parallel
loop over batch × channels, so each chunk ends in a thread barrier: on an oversubscribed machine
(more busy threads than cores) ``torch.set_num_threads(1)`` is much faster.

Environment: ``SSM_CPU_COMPILE=0`` runs the chunks eagerly without a warning (``COMPILE``
below is the switch; tests set it).

Shape symbols: B batch, D channels, L length, N state size, G groups, T chunk length,
M all non-scanned elements of a linear scan flattened.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ._checks import compute_dtype
from ._common import linear_per_sequence, selective_delta, selective_per_sequence, selective_skip_and_gate

CHUNK = 16  # steps per compiled chunk
COMPILE = os.environ.get("SSM_CPU_COMPILE", "1") not in ("0", "false", "off")

# ----------------------------------------------------------------------------- chunk bodies
# Each body is a plain function of one chunk; ``_Body`` runs it compiled (full chunks) or
# eagerly (the last, shorter chunk, or when compiling is off or unavailable).


def _grouped(v: torch.Tensor, M: torch.Tensor, t: int) -> torch.Tensor:
    """v·M_t per channel: v (B, D, K) with K in {1, N}; M fixed (D, N) or time-varying
    (T, B, G, N) where channel d reads group d // (D / G). Returns (B, D, N)."""
    if M.ndim == 2:
        return v * M
    b, d, k = v.shape
    G = M.shape[2]
    return (v.view(b, G, d // G, k) * M[t].unsqueeze(2)).flatten(1, 2)


def _group_sum(v: torch.Tensor, G: int) -> torch.Tensor:
    """(..., B, D, N) -> (..., B, G, N): the sum over the channels of each group."""
    *lead, d, n = v.shape
    return v.view(*lead, G, d // G, n).sum(-2)


def _selective_chunk(h, A, delta, u, B, C):
    """One chunk of the selective scan.
    h: (B, D, N) state before the chunk; A: (D, N); delta (Δ, after bias/softplus), u: (T, B, D);
    B, C: (T, B, G, N) time-varying or (D, N) fixed.
    Returns y (T, B, D) with y_t = C_t·h_t, and the state after the chunk (B, D, N)."""
    ys = []
    for t in range(delta.shape[0]):
        d_t = delta[t].unsqueeze(-1)  # (B, D, 1)
        h = torch.exp(d_t * A) * h + _grouped(d_t * u[t].unsqueeze(-1), B, t)
        ys.append(_grouped(h, C, t).sum(-1))  # (B, D)
    return torch.stack(ys), h


def _selective_chunk_bwd(h, lam_next, A, delta, u, B, C, gy, acc_A, acc_B, acc_C):
    """The reverse sweep through one chunk (see the module docstring).
    h: (B, D, N) state before the chunk; lam_next: (B, D, N) the adjoint flowing in from the
    next chunk, exp(Δ_{t+1}A)·λ_{t+1}; gy: (T, B, D) dLoss/dy; acc_A (B, D, N) and, for
    fixed B or C, acc_B / acc_C (B, D, N) (else None): running sums over batch and time.
    Returns (the adjoint flowing to the previous chunk, dΔ (T, B, D), du (T, B, D),
    dB (T, B, G, N) or the updated acc_B, dC likewise, acc_A)."""
    T = delta.shape[0]
    decays, states = [], [h]
    for t in range(T):  # recompute the chunk's states from the one saved at its start
        d_t = delta[t].unsqueeze(-1)
        decay = torch.exp(d_t * A)  # (B, D, N)
        h = decay * h + _grouped(d_t * u[t].unsqueeze(-1), B, t)
        decays.append(decay)
        states.append(h)
    g = lam_next
    d_delta, d_u, d_B, d_C = [None] * T, [None] * T, [None] * T, [None] * T
    for t in range(T - 1, -1, -1):
        gy_t = gy[t].unsqueeze(-1)  # (B, D, 1)
        lam = g + _grouped(gy_t, C, t)  # λ_t (B, D, N)
        d_C[t] = gy_t * states[t + 1]  # per channel; summed over groups below
        delta_t, u_t = delta[t], u[t]  # (B, D)
        d_B[t] = lam * (delta_t * u_t).unsqueeze(-1)
        lam_B = _grouped(lam, B, t)  # λ_t·B_t; d(Δ_t·u_t) is its sum over N
        s = lam * states[t] * decays[t]
        # Written as single sums over N (no arithmetic after them), so that the compiled
        # loop over channels stays one fused loop.
        d_delta[t] = (s * A + lam_B * u_t.unsqueeze(-1)).sum(-1)  # (B, D)
        d_u[t] = (lam_B * delta_t.unsqueeze(-1)).sum(-1)
        acc_A = acc_A + s * delta_t.unsqueeze(-1)
        g = decays[t] * lam
    # The sums over channels (time-varying B, C) or over time (fixed) are done once per chunk,
    # after the sweep: inside it they would split the fused per-channel loop at every step.
    d_B, d_C = torch.stack(d_B), torch.stack(d_C)  # (T, B, D, N)
    d_B = acc_B + d_B.sum(0) if B.ndim == 2 else _group_sum(d_B, B.shape[2])
    d_C = acc_C + d_C.sum(0) if C.ndim == 2 else _group_sum(d_C, C.shape[2])
    return g, torch.stack(d_delta), torch.stack(d_u), d_B, d_C, acc_A


def _linear_chunk(h, a, x, reverse: bool, adjoint: bool):
    """One chunk of h_t = a_t·h_prev + x_t. h: (M,) the carry from the previous chunk (in scan
    order); a, x: (T, M). With ``reverse`` the steps run from T-1 down to 0.
    ``adjoint`` computes instead out_t = h_prev + x_t and carries a_t·out_t: the backward
    λ_t = g_t + a_{t±1}·λ_{t±1} without shifting the gates, whose last carry is dh_{-1}.
    Returns (out (T, M), the carry after the chunk)."""
    T = a.shape[0]
    outs = [None] * T
    for t in range(T - 1, -1, -1) if reverse else range(T):
        if adjoint:
            out = h + x[t]
            h = a[t] * out
        else:
            h = torch.addcmul(x[t], a[t], h)
            out = h
        outs[t] = out
    return torch.stack(outs), h


_warned = False


class _Body:
    """A chunk body run compiled for full chunks, eagerly otherwise. The compiled function is
    created once (torch.compile caches per input shapes and dtypes). If compiling fails (no
    C++ compiler, an inductor error), warn once and run eagerly from then on."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled = None
        self.failed = False

    def __call__(self, full: bool, *args):
        if not (full and COMPILE and not self.failed) or _get_current_dispatch_mode() is not None:
            # (dynamo does not trace under a TorchDispatchMode such as FlopCounterMode)
            return self.fn(*args)
        if self._compiled is None:
            # max_fusion_size: the backward chunk is ~300 ops; with inductor's default (64)
            # its per-channel loop is cut in ~25 loops, each ending in a thread barrier.
            self._compiled = torch.compile(
                self.fn, fullgraph=True, options={"max_fusion_size": 1024}
            )
        try:
            return self._compiled(*args)
        except Exception as error:  # noqa: BLE001 - any compile failure means: run eagerly
            self.failed = True
            _warn_once(error)
            return self.fn(*args)


def _warn_once(error: Exception) -> None:
    global _warned
    if not _warned:
        _warned = True
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(
            "ssm.scan 'cpu' backend: torch.compile could not compile the fused chunk "
            f"({type(error).__name__}: {first_line}); "
            "running the chunks eagerly (correct, several times slower). A C++ compiler "
            "(gcc/clang) makes it fast; set SSM_CPU_COMPILE=0 to silence this.",
            RuntimeWarning,
            stacklevel=4,
        )


_SELECTIVE_FWD = _Body(_selective_chunk)
_SELECTIVE_BWD = _Body(_selective_chunk_bwd)
_LINEAR = _Body(_linear_chunk)


def _chunks(length: int):
    """(start, end, is_full) of each chunk, in time order."""
    return [(t0, min(t0 + CHUNK, length), t0 + CHUNK <= length) for t0 in range(0, length, CHUNK)]


def _slice(M: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    return M if M.ndim == 2 else M[t0:t1]


# ----------------------------------------------------------------------------- selective scan


def _selective_sweep(delta, u, A, B, C, h, states=None):
    """The forward sweep on time-major inputs (see _selective_chunk); with ``states``
    ((chunks, B, D, N)), the state at the start of each chunk is written there.
    Returns y (L, B, D) and the last state."""
    y = torch.empty_like(delta)
    for k, (t0, t1, full) in enumerate(_chunks(delta.shape[0])):
        if states is not None:
            states[k] = h
        y[t0:t1], h = _SELECTIVE_FWD(
            full, h, A, delta[t0:t1], u[t0:t1], _slice(B, t0, t1), _slice(C, t0, t1)
        )
    return y, h


class SelectiveScanCPUFn(torch.autograd.Function):
    """Differentiable selective scan on time-major inputs of one dtype: delta (Δ), u: (L, B, D);
    A: (D, N); B, C: (L, B, G, N) or (D, N); h0: (B, D, N) or None.
    Returns y (L, B, D), y_t = C_t·h_t, and the last state (B, D, N)."""

    @staticmethod
    def forward(ctx, delta, u, A, B, C, h0):
        # Detached, so that the chunk body sees the same kind of tensors (no requires_grad)
        # here and on the no-grad path and is compiled once for both.
        delta, u, A, B, C = (x.detach() for x in (delta, u, A, B, C))
        h0 = None if h0 is None else h0.detach()
        length, batch, dim = delta.shape
        h = delta.new_zeros(batch, dim, A.shape[1]) if h0 is None else h0
        states = delta.new_empty(len(_chunks(length)), batch, dim, A.shape[1])
        y, last = _selective_sweep(delta, u, A, B, C, h, states)
        ctx.save_for_backward(delta, u, A, B, C, states)
        ctx.has_h0 = h0 is not None
        return y, last

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_last):
        delta, u, A, B, C, states = ctx.saved_tensors
        length, batch, dim = delta.shape
        g = torch.zeros_like(states[0]) if grad_last is None else grad_last.contiguous()
        grad_y = torch.zeros_like(delta) if grad_y is None else grad_y.contiguous()
        d_delta, d_u = torch.empty_like(delta), torch.empty_like(delta)
        d_B = torch.zeros_like(g) if B.ndim == 2 else torch.empty_like(B)
        d_C = torch.zeros_like(g) if C.ndim == 2 else torch.empty_like(C)
        acc_A = torch.zeros_like(g)
        for k, (t0, t1, full) in reversed(list(enumerate(_chunks(length)))):
            g, d_delta[t0:t1], d_u[t0:t1], dB, dC, acc_A = _SELECTIVE_BWD(
                full, states[k], g, A, delta[t0:t1], u[t0:t1], _slice(B, t0, t1),
                _slice(C, t0, t1), grad_y[t0:t1], acc_A,
                d_B if B.ndim == 2 else None, d_C if C.ndim == 2 else None,
            )
            if B.ndim == 2:
                d_B = dB
            else:
                d_B[t0:t1] = dB
            if C.ndim == 2:
                d_C = dC
            else:
                d_C[t0:t1] = dC
        if B.ndim == 2:
            d_B = d_B.sum(0)
        if C.ndim == 2:
            d_C = d_C.sum(0)
        return d_delta, d_u, acc_A.sum(0), d_B, d_C, (g if ctx.has_h0 else None)


def _pad_to_chunks(M: torch.Tensor) -> torch.Tensor:
    """Time-major M (L, ...) padded with zeros to whole chunks, so that every chunk runs the
    compiled body (a short last chunk would run eagerly, several times slower). Padded steps
    have Δ = 0 and u = 0: no decay and no input, so the state passes through unchanged; their
    outputs are dropped. Fixed (D, N) B or C is returned as is."""
    if M.ndim == 2:
        return M
    pad = -M.shape[0] % CHUNK
    if pad:
        M = torch.cat([M, M.new_zeros(pad, *M.shape[1:])])
    return M.contiguous()


def _time_major(M: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, D, L) -> (L, B, D), or B/C (B, G, N, L) -> (L, B, G, N); (D, N) unchanged."""
    if M.ndim == 2:
        return M.to(dtype)
    return M.to(dtype).movedim(-1, 0).contiguous()


def selective_scan_cpu(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend "cpu" of :func:`ssm.scan.selective_scan`.

    u, delta, z: (B, D, L); A: (D, N); B, C: (D, N) or (B, G, N, L); D, delta_bias: (D,);
    initial_state: (B, D, N). Returns out (B, D, L) in u's dtype and the last state (B, D, N)
    in float32 (float64 for float64 inputs). Δ, the D·u skip and the silu(z) gate are plain
    tensor ops (autograd differentiates them); the scan itself is SelectiveScanCPUFn."""
    if torch.compiler.is_compiling():  # inside a user's torch.compile: trace the parallel scan
        from .pscan import selective_scan_pscan

        return selective_scan_pscan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens)
    if cu_seqlens is not None:  # packed sequences: for now one sweep per sequence
        return selective_per_sequence(
            selective_scan_cpu, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state, cu_seqlens
        )
    dtype = compute_dtype(u, delta, A, B, C, D, z, delta_bias, initial_state)
    out_dtype = u.dtype
    u = u.to(dtype)
    delta = selective_delta(delta.to(dtype), delta_bias, delta_softplus)  # (B, D, L)
    length = u.shape[-1]
    args = (
        _pad_to_chunks(delta.movedim(-1, 0)),  # (L', B, D), L' = L rounded up to whole chunks
        _pad_to_chunks(u.movedim(-1, 0)),
        A.to(dtype).contiguous(),  # (D, N)
        _pad_to_chunks(_time_major(B, dtype)),  # (L', B, G, N) or (D, N)
        _pad_to_chunks(_time_major(C, dtype)),
        None if initial_state is None else initial_state.to(dtype).contiguous(),  # (B, D, N)
    )
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args):
        y, last = SelectiveScanCPUFn.apply(*args)
    else:  # inference: no autograd node, no chunk states kept
        # (detached like inside the autograd Function, so the same compiled chunk serves both)
        delta_tm, u_tm, A_, B_, C_, h0 = (None if x is None else x.detach() for x in args)
        h = delta_tm.new_zeros(*delta_tm.shape[1:], A_.shape[1]) if h0 is None else h0
        y, last = _selective_sweep(delta_tm, u_tm, A_, B_, C_, h)
    out = selective_skip_and_gate(y[:length].movedim(0, -1), u, D, z)  # (B, D, L)
    return out.to(out_dtype), last


# ----------------------------------------------------------------------------- linear scan


def _linear_sweep(a, x, h0, reverse: bool, adjoint: bool):
    """All outputs of _linear_chunk over time-major (L, M) inputs, chunk by chunk in scan
    order. Returns (out (L, M), the last carry)."""
    out = torch.empty_like(x)
    h = torch.zeros_like(x[0]) if h0 is None else h0
    chunks = _chunks(x.shape[0])
    for t0, t1, full in reversed(chunks) if reverse else chunks:
        out[t0:t1], h = _LINEAR(full, h, a[t0:t1], x[t0:t1], reverse, adjoint)
    return out, h


class LinearScanCPUFn(torch.autograd.Function):
    """Differentiable h_t = a_t·h_prev + x_t over dim 0 of (L, M) tensors of one dtype."""

    @staticmethod
    def forward(ctx, a, x, h0, reverse: bool):
        a, x, h0 = a.detach(), x.detach(), (None if h0 is None else h0.detach())
        h, _ = _linear_sweep(a, x, h0, reverse, adjoint=False)
        ctx.save_for_backward(a, h, h0)
        ctx.reverse = reverse
        return h

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_h):
        a, h, h0 = ctx.saved_tensors
        reverse = ctx.reverse
        # λ_t = g_t + a_next·λ_next runs against the scan direction; its last carry is dh_{-1}.
        lam, grad_h0 = _linear_sweep(a, grad_h.contiguous(), None, not reverse, adjoint=True)
        grad_a = torch.empty_like(a)  # da_t = λ_t·h_prev(t), h_prev = h0 (or 0) at the first step
        first, rest, prev = (-1, slice(None, -1), slice(1, None)) if reverse else (0, slice(1, None), slice(None, -1))
        torch.mul(lam[rest], h[prev], out=grad_a[rest])
        grad_a[first] = 0 if h0 is None else lam[first] * h0
        return grad_a, lam, (grad_h0 if h0 is not None else None), None


def linear_scan_cpu(
    gates: torch.Tensor,
    inputs: torch.Tensor,
    dim: int,
    initial_state: torch.Tensor | None = None,
    reverse: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Backend "cpu" of :func:`ssm.scan.linear_scan` (``dim`` non-negative): the scanned
    dimension is moved first, (L, M), so that each chunk is one contiguous block."""
    if torch.compiler.is_compiling():
        from .pscan import linear_scan_pscan

        return linear_scan_pscan(gates, inputs, dim, initial_state, reverse, cu_seqlens)
    if cu_seqlens is not None:  # packed sequences: for now one sweep per sequence
        return linear_per_sequence(linear_scan_cpu, gates, inputs, dim, initial_state, reverse, cu_seqlens)
    dtype = compute_dtype(gates, inputs, initial_state)
    out_dtype = torch.promote_types(gates.dtype, inputs.dtype)
    shape = inputs.shape
    length = shape[dim]
    moved = (length, *shape[:dim], *shape[dim + 1 :])  # (L, ...)
    M = math.prod(moved[1:])
    a = gates.to(dtype).movedim(dim, 0).reshape(length, M).contiguous()  # (L, M)
    x = inputs.to(dtype).movedim(dim, 0).reshape(length, M).contiguous()
    h0 = None if initial_state is None else initial_state.to(dtype).reshape(M).contiguous()  # (M,)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, x, h0)):
        h = LinearScanCPUFn.apply(a, x, h0, reverse)
    else:
        h0 = None if h0 is None else h0.detach()
        h, _ = _linear_sweep(a.detach(), x.detach(), h0, reverse, adjoint=False)
    return h.view(moved).movedim(0, dim).to(out_dtype)
