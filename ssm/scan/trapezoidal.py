"""The public trapezoidal scan: the recurrence of Mamba-3 (exponential-trapezoidal rule, rotary
complex state, MIMO), mamba-ssm's ``mamba3_siso_combined`` / ``mamba3_mimo`` with named options.

Named for what sets the recurrence apart, as its siblings are (``selective_scan``: the selective
S6 scan; ``ssd``: state-space duality): the trapezoidal rule that mixes each step's input with
the previous one.
"""

from __future__ import annotations

import torch

from .._backends import BackendTable
from . import triton
from ._checks import (
    check_cu_seqlens,
    check_same_device,
    check_shape,
    check_state_size,
    check_tensor,
    empty_output,
)
from ._common_trapezoidal import TrapezoidalArgs, TrapezoidalState
from .cpu import subnormals_flushed
from .reference import trapezoidal_scan_ref
from .trapezoidal_chunked import chunked_core, trapezoidal_scan_chunked
from .trapezoidal_cpu import trapezoidal_scan_cpu


def _reference(args: TrapezoidalArgs):
    """Backend "ref": the reference, which imports nothing of the fast paths and so takes plain
    arguments, not their TrapezoidalArgs."""
    return trapezoidal_scan_ref(**args.keywords())


# Backends take one TrapezoidalArgs (validated; B and C (batch, L, R, G, N), the biases
# (H, R, N), the key state (·, R, H, N)) and return (out, last_state) with out (batch, L, H, P),
# or (batch, L, R, H, P) without mimo_o.
BACKENDS = BackendTable(
    "trapezoidal_scan", auto={"cpu": ("cpu", "chunked"), "cuda": ("triton", "chunked"), "*": ("chunked",)}
)
BACKENDS.add("ref", _reference)
BACKENDS.add("chunked", subnormals_flushed(trapezoidal_scan_chunked))
BACKENDS.add("cpu", subnormals_flushed(trapezoidal_scan_cpu), devices=("cpu",))
BACKENDS.add("triton", triton.trapezoidal_scan_triton, devices=triton.devices, hint=triton.hint)
BACKENDS.add(
    "triton-ssd", lambda args: triton.trapezoidal_scan_ssd(args, chunked_core), devices=triton.devices, hint=triton.hint
)

ROTARY = ("interleaved", "halved")


def auto_on_cuda(batch: int, heads: int, ranks: int, multiprocessors: int) -> str:
    """What ``backend="auto"`` runs on a CUDA device: for rank 1 "triton-ssd", the SSD kernels'
    chunk-parallel form, at any batch; for MIMO "triton" where its scan fills the GPU, else
    "chunked". The Triton scan runs a program per row and head (and block of P), each walking all
    L steps, so with fewer of them than multiprocessors most of the GPU idles. Measured on an H100
    (132 SMs), float32 forward+backward: batch 1 × 8 heads, N 40, the chunked form 12.8 against
    38.6 ms at L 16384, 242 against 650 at 2^18; batch 8 × 96 heads, N 16, L 2048, Triton 11.0
    against 14.2. ("triton-ssd" is not timed yet, no GPU having been lent since it was written: it
    is rank 1's default by design, the SSD kernels being the form mamba-ssm runs, within 0.9x of
    mamba-ssm's own SSD on an H200 (BENCHMARKS.md); scripts/gpu_check.py times it beside the
    other two.)"""
    if ranks == 1:
        return "triton-ssd"
    return "triton" if batch * heads >= multiprocessors else "chunked"


def trapezoidal_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    trap: torch.Tensor,
    angles: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    B_bias: torch.Tensor | None = None,
    C_bias: torch.Tensor | None = None,
    mimo_x: torch.Tensor | None = None,
    mimo_z: torch.Tensor | None = None,
    mimo_o: torch.Tensor | None = None,
    rotary: str = "interleaved",
    initial_state: tuple | None = None,
    return_last_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
):
    """The Mamba-3 scan: a trapezoidal-rule state update on a rotating (complex) state, with
    rank-R (MIMO) inputs and outputs.

    Shapes (time second, as in mamba-ssm's Mamba-3 ops):
        x, z:             (batch, L, H, P)          H heads of P channels
        dt, A, trap:      (batch, L, H)             Δ > 0, A < 0 (per step), λ in [0, 1]
        B, C:             (batch, L, G, N), or (batch, L, R, G, N) for MIMO rank R; H % G == 0,
                          head h uses group h // (H / G)
        angles:           (batch, L, H, M)          rotary rates θ of M ≤ N/2 state pairs
        D:                (H,)
        B_bias, C_bias:   (H, N), or (H, R, N) with the rank axis
        mimo_x, mimo_z, mimo_o:  (H, R, P), only with the rank axis
        initial_state:    TrapezoidalState (phase (batch, H, M), ssm (batch, H, P, N),
                          key (batch, H, N) or (batch, R, H, N), value (batch, H, P)); with
                          cu_seqlens every batch there is S
        cu_seqlens:       (S + 1,) integer: S sequences end to end along L in a batch of one

    Computes, per head, for t = 0 .. L-1 (k = B + B_bias, q = C + C_bias, v_r = x ⊙ mimo_x[:, r]):
        φ_t = φ_{t-1} + Δ_t·θ_t                          the phase of each rotary pair
        k̃_{t,r}, q̃_{t,r} = Rot(φ_t)·k_{t,r}, Rot(φ_t)·q_{t,r}
        α_t = exp(Δ_t·A_t),  β_t = (1 − λ_t)·Δ_t·α_t,  γ_t = λ_t·Δ_t
        h_t = α_t·h_{t-1} + β_t·Σ_r v_{t-1,r} ⊗ k̃_{t-1,r} + γ_t·Σ_r v_{t,r} ⊗ k̃_{t,r}   (P × N)
        y_{t,r} = h_t·q̃_{t,r} + D·v_{t,r},   gated by silu(z_t ⊙ mimo_z[:, r])
        out_t = Σ_r mimo_o[:, r] ⊙ y_{t,r}
    Rot(φ) turns each pair (n0, n1), by φ of its index m: (w0, w1) → (w0·cos φ − w1·sin φ,
    w0·sin φ + w1·cos φ); the pairs are (2m, 2m + 1) for ``rotary="interleaved"`` (mamba-ssm's
    SISO) or (m, m + N/2) for ``"halved"`` (its MIMO); the other N − 2M entries do not turn.
    This is the complex state of the Mamba-3 paper written in real coordinates (see
    reference.py). The step before the first is the initial state's (its key and value give
    the β-term of step 0), or zero.

    Returns ``out`` (batch, L, H, P) in x's dtype ((batch, L, R, H, P), one output per rank,
    when B has a rank axis and mimo_o is not given), or ``(out, last_state)``: a
    TrapezoidalState in float32 (float64 for float64 inputs) of the phase φ_{L-1} (not reduced
    modulo 2π), h_{L-1}, the last rotated key k̃_{L-1} and the last x, which continues the scan
    exactly when passed as ``initial_state``. With cu_seqlens, each sequence starts from its
    own initial state (or zero) and the last state is per sequence (a zero-length sequence's
    is its initial state). Gradients flow to every tensor argument, into the initial state and
    from the last state.

    ``chunk_size``: block length of the "chunked" algorithm (others ignore it).
    ``backend``: ``"auto"`` or a name from ``ssm.scan.backends("trapezoidal_scan")``: "ref" (a
    loop over time on the complex state), "chunked" (chunked matrix products, any device),
    "triton" (fused kernels for CUDA, a program per row and head walking every step; on the CPU
    only in Triton's interpreter), "triton-ssd" (rank 1 on Mamba-2's chunked SSD kernels:
    chunk-parallel, triton/trapezoidal_ssd.py; MIMO runs the chunked form), "cpu" (rank 1:
    the keys' rotation and the output pass in C, the core on the C selective sweeps up to
    N·P = 1024 and as the chunked form's products above, trapezoidal_cpu.py; MIMO on those
    products, a step's ranks as positions). On CUDA "auto" takes "triton-ssd" for rank 1 and, for
    MIMO, "triton" where batch × H reaches the GPU's multiprocessor count, else "chunked"
    (``auto_on_cuda``); packed MIMO sequences keep "triton" (the chunked form loops over them). On
    the CPU it takes "cpu".
    """
    check_tensor("x", x, ndim=4)
    batch, length, heads, head_dim = x.shape
    for name, t in (("dt", dt), ("A", A), ("trap", trap)):
        check_tensor(name, t, ndim=3)
        check_shape(name, t, (batch, length, heads), "(batch, L, H)")
    check_tensor("B", B, ndim=(4, 5))
    rank_axis = B.ndim == 5
    if rank_axis:
        ranks, groups, N = B.shape[2:]
        check_shape("B", B, (batch, length, ranks, groups, N), "(batch, L, R, G, N)")
        if ranks < 1:
            raise ValueError(f"B must have shape (batch, L, R, G, N) with a rank R >= 1, got {tuple(B.shape)}")
    else:
        ranks, (groups, N) = 1, B.shape[2:]
        check_shape("B", B, (batch, length, groups, N), "(batch, L, G, N)")
    check_state_size("B", B, N, "(batch, L, R, G, N)" if rank_axis else "(batch, L, G, N)")
    if groups == 0 or heads % groups != 0:
        raise ValueError(f"B has G = {groups} groups, but H = {heads} heads (from x) is not divisible by G")
    check_tensor("C", C, ndim=B.ndim)
    check_shape("C", C, B.shape, "(batch, L, R, G, N) like B" if rank_axis else "(batch, L, G, N) like B")
    check_tensor("angles", angles, ndim=4)
    M = angles.shape[3]
    check_shape("angles", angles, (batch, length, heads, M), "(batch, L, H, M)")
    if rotary not in ROTARY:
        raise ValueError(f"rotary must be one of {list(ROTARY)}, got {rotary!r}")
    if rotary == "halved" and N % 2:
        raise ValueError(f"rotary='halved' pairs entry m with m + N/2, so N must be even, got N = {N}")
    if 2 * M > N:
        raise ValueError(f"angles has M = {M} rotary pairs, but the state has only N = {N} entries (2·M ≤ N)")
    if D is not None:
        check_tensor("D", D, ndim=1)
        check_shape("D", D, (heads,), "(H,)")
    if z is not None:
        check_tensor("z", z, ndim=4)
        check_shape("z", z, x.shape, "(batch, L, H, P) like x")
    for name, t in (("B_bias", B_bias), ("C_bias", C_bias)):
        if t is not None:
            check_tensor(name, t, ndim=B.ndim - 2)
            check_shape(name, t, (heads, ranks, N) if rank_axis else (heads, N), "(H, R, N)" if rank_axis else "(H, N)")
    for name, t in (("mimo_x", mimo_x), ("mimo_z", mimo_z), ("mimo_o", mimo_o)):
        if t is not None:
            if not rank_axis:
                raise ValueError(f"{name} needs B and C with a rank axis (batch, L, R, G, N); B is {tuple(B.shape)}")
            check_tensor(name, t, ndim=3)
            check_shape(name, t, (heads, ranks, head_dim), "(H, R, P)")
    if mimo_z is not None and z is None:
        raise ValueError("mimo_z scales z, but z is None")
    state_batch = batch
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(cu_seqlens, length, batch, x.device)
        state_batch = cu_seqlens.numel() - 1
    if initial_state is not None:
        initial_state = _check_state(
            initial_state, state_batch, heads, head_dim, N, M, ranks, rank_axis, cu_seqlens is not None
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if not rank_axis:  # one form for the backends: a rank axis of 1
        B, C = B.unsqueeze(2), C.unsqueeze(2)
        B_bias = None if B_bias is None else B_bias.unsqueeze(1)
        C_bias = None if C_bias is None else C_bias.unsqueeze(1)
        if initial_state is not None:
            initial_state = initial_state._replace(key=initial_state.key.unsqueeze(1))
    args = TrapezoidalArgs(
        x=x,
        dt=dt,
        A=A,
        B=B,
        C=C,
        trap=trap,
        angles=angles,
        D=D,
        z=z,
        B_bias=B_bias,
        C_bias=C_bias,
        mimo_x=mimo_x,
        mimo_z=mimo_z,
        mimo_o=mimo_o,
        rotary=rotary,
        initial_state=initial_state,
        chunk_size=chunk_size,
        cu_seqlens=cu_seqlens,
    )
    check_same_device("x", x, **args.tensors())
    impl = BACKENDS.resolve(backend, x.device)
    # (under torch.compile the choice stays Triton's: the traced graph asks no device properties,
    # and "triton-ssd" would hand the call to the chunked core; packed MIMO sequences keep it too)
    if impl.name == "triton" and backend == "auto" and (ranks == 1 or cu_seqlens is None):
        if not torch.compiler.is_compiling():
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            impl = BACKENDS.resolve(auto_on_cuda(batch, heads, ranks, sms), x.device)

    per_rank = rank_axis and mimo_o is None
    if x.numel() == 0:  # no output to compute (L, batch, H or P is 0): no backend runs
        shape = (batch, length, *((ranks,) if per_rank else ()), heads, head_dim)
        out = empty_output(shape, x.dtype, *args.tensors().values())
        if not return_last_state:
            return out
        dtype = args.dtype
        if initial_state is None:
            last = TrapezoidalState(
                x.new_zeros(state_batch, heads, M, dtype=dtype),
                x.new_zeros(state_batch, heads, head_dim, N, dtype=dtype),
                x.new_zeros(state_batch, ranks, heads, N, dtype=dtype),
                x.new_zeros(state_batch, heads, head_dim, dtype=dtype),
            )
        else:
            last = TrapezoidalState(*(t.to(dtype, copy=True) for t in initial_state))
    else:
        out, last = impl.fn(args)
        if not rank_axis:
            out = out.squeeze(2)  # (batch, L, 1, H, P): the backends' one output per rank
        out = out.contiguous()
        last = TrapezoidalState(*last)
    if not return_last_state:
        return out
    if not rank_axis:
        last = last._replace(key=last.key.squeeze(1))
    return out, last


def _check_state(state, batch, heads, head_dim, N, M, ranks, rank_axis, packed) -> TrapezoidalState:
    if not isinstance(state, (tuple, list)) or len(state) != 4:
        raise ValueError(
            "initial_state must be a TrapezoidalState (phase, ssm, key, value) as returned with "
            f"return_last_state=True, got {type(state).__name__}"
        )
    rows = "S" if packed else "batch"
    key_shape = (batch, ranks, heads, N) if rank_axis else (batch, heads, N)
    key_symbols = f"({rows}, R, H, N)" if rank_axis else f"({rows}, H, N)"
    expected = (
        ("phase", (batch, heads, M), f"({rows}, H, M)"),
        ("ssm", (batch, heads, head_dim, N), f"({rows}, H, P, N)"),
        ("key", key_shape, key_symbols),
        ("value", (batch, heads, head_dim), f"({rows}, H, P)"),
    )
    for t, (name, shape, symbols) in zip(state, expected):
        check_tensor(f"initial_state.{name}", t, ndim=len(shape))
        check_shape(f"initial_state.{name}", t, shape, symbols)
    return TrapezoidalState(*state)
