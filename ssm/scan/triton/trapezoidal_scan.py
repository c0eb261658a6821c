"""Backend "triton" of ``trapezoidal_scan`` (Mamba-3), top to bottom: launch heuristics,
launchers, the custom ops with their autograd formula, and the backend entry point. The kernels
are in _trapezoidal_kernels.py (what they compute, and how a program is laid out, is said there),
the @triton.jit helpers they share in _trapezoidal_jit.py.

    _trapezoidal_scan_fwd_kernel  →  _trapezoidal_scan_fwd  →  ssm::trapezoidal_scan_fwd  →  trapezoidal_scan_triton
    _trapezoidal_scan_bwd_kernel  →  _trapezoidal_scan_bwd  →  ssm::trapezoidal_scan_bwd     (its autograd formula)

The kernels run the core of the shifted form (_common_trapezoidal.py) on a = Δ·A, σ, c, cos φ,
sin φ and H_{-1}, which the shared prologue (run_core) computes in PyTorch. The backend takes
the scan's arguments as one TrapezoidalArgs; ``_core`` turns them, with the prologue's, into the
KernelInputs the kernels read, which the custom ops take flat (an op's schema is a list of
tensors). Sums over programs come back from the backward kernel as partial sums, one per
program, and the launcher adds them in a fixed order: the gradients are reproducible, no
atomics. The rotation's own backward (to B, C, the biases and cos, sin) is elementwise, in
PyTorch, in the launcher.

Shape symbols: B batch, L length, H heads, P head dim, G groups, N state size, R MIMO rank,
M rotary pairs, S packed sequences, T chunk length (CHUNK).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..._custom_op import kernel_op
from .._common_trapezoidal import Prepared, TrapezoidalArgs, per_head, rotate_backward, run_core
from ._jit import check_launchable, contiguous, fake_like, needs_backward, next_power_of_2, placeholders
from ._trapezoidal_kernels import _trapezoidal_scan_bwd_kernel, _trapezoidal_scan_fwd_kernel

# ----------------------------------------------------------------------------- launch heuristics
# Pure functions of shapes, shared by the launchers and the fake implementations. The largest
# live tiles are (BLOCK_R, BLOCK_P, BLOCK_N, CHUNK) products, at most TILE elements. Tuned on an
# H200 (tests/scan/tune_trapezoidal.py; BENCHMARKS.md, "CUDA"): at batch 8, 24 heads of P 64,
# L 2048, fp32, forward+backward went from 13.8 to 9.6 ms at N 16 and from 85.7 to 40.6 ms at
# N 128 against the first guess (CHUNK 16, TILE 4096, 8 warps). Short chunks, at most 16
# channels a program (more programs), and 4 warps (8 never won) are what mattered.

CHUNK = 8  # time steps a program scans at once (a power of two)
TILE = 8192
BLOCK_P = 16  # channels a program takes, at most


@dataclass(frozen=True)
class Config:
    block_r: int
    block_p: int
    block_n: int
    chunk: int
    num_warps: int  # forward
    num_warps_bwd: int  # backward

    def p_blocks(self, P: int) -> int:
        return -(-P // self.block_p)

    def max_chunks(self, rows: int, length, packed: bool):
        """Saved chunk states: rows·⌈L/T⌉ for a batch; for S packed sequences at most
        ⌈L/T⌉ + S (each sequence starts a chunk). A function of shapes only (the fake op's)."""
        per_row = (length + self.chunk - 1) // self.chunk
        return per_row + rows if packed else rows * per_row


def config(P: int, N: int, R: int) -> Config:
    block_r, block_n = next_power_of_2(R), next_power_of_2(N)
    block_p = max(1, min(next_power_of_2(P), BLOCK_P, TILE // (block_r * block_n * CHUNK)))
    tile = block_r * block_p * block_n * CHUNK
    # N 16: a (1, 16, 16, 8) tile, whose forward is fastest on 2 warps (2.4 ms against 3.9 on
    # 4); N 128: (1, 8, 128, 8) on 4; rank 4 at N 128: (4, 2, 128, 8). The backward: 4 warps.
    return Config(block_r, block_p, block_n, CHUNK, 2 if tile <= 2048 else 4, 4)


# ----------------------------------------------------------------------------- launchers


def _bounds(batch: int, length: int, cu_seqlens: Tensor | None, cfg: Config, device):
    """Each program row's range of flattened positions (rows + 1,) and the index of its first
    saved chunk state (rows,), both int64."""
    if cu_seqlens is None:
        bounds = torch.arange(batch + 1, device=device, dtype=torch.int64) * length
    else:
        bounds = cu_seqlens.to(torch.int64)
    chunks = (bounds[1:] - bounds[:-1] + cfg.chunk - 1) // cfg.chunk
    return bounds.contiguous(), (torch.cumsum(chunks, 0) - chunks).contiguous()


class KernelInputs(NamedTuple):
    """The forward's inputs, which both kernels read (as ``{name}_ptr``): the scan's tensors and
    the core's, from the prologue. The custom ops take them flat, in this order; a backward
    returns their gradients in it too."""

    x: Tensor  # (B, L, H, P)
    B: Tensor  # (B, L, R, G, N)
    C: Tensor  # (B, L, R, G, N)
    B_bias: Tensor | None  # (H, R, N)
    C_bias: Tensor | None  # (H, R, N)
    mimo_x: Tensor | None  # (H, R, P)
    z: Tensor | None  # (B, L, H, P)
    mimo_z: Tensor | None  # (H, R, P)
    mimo_o: Tensor | None  # (H, R, P)
    D: Tensor | None  # (H,)
    a: Tensor  # (B, L, H) Δ·A
    sigma: Tensor  # (B, L, H)
    c: Tensor  # (B, L, H)
    cos: Tensor  # (B, L, H, M)
    sin: Tensor  # (B, L, H, M)


def _kernel_args(inputs: KernelInputs, cu_seqlens: Tensor | None, halved: bool) -> tuple[Config, int, dict]:
    """What both kernels are launched with, from the forward's inputs (contiguous): the launch
    config, the number of program rows (sequences), and the arguments both take: the inputs,
    each row's bounds and first chunk, sizes, HALVED, block sizes."""
    batch, length, heads, P = inputs.x.shape
    ranks, groups, N = inputs.B.shape[2:]
    cfg = config(P, N, ranks)
    rows = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    bounds, chunk_first = _bounds(batch, length, cu_seqlens, cfg, inputs.x.device)
    args = {f"{name}_ptr": t for name, t in zip(inputs._fields, inputs)}
    M = inputs.cos.shape[-1]
    args.update(bounds_ptr=bounds, chunk_first_ptr=chunk_first, H=heads, P=P, N=N, M=M, R=ranks, G=groups)
    args.update(HALVED=halved, BLOCK_R=cfg.block_r, BLOCK_P=cfg.block_p, BLOCK_N=cfg.block_n, CHUNK=cfg.chunk)
    return cfg, rows, args


def _forward_outputs(inputs: KernelInputs, cu_seqlens: Tensor | None, save_chunk_states: bool):
    """The forward's outputs, empty (the launcher's, and the fake op's): out (B, L, H, P) in x's
    dtype ((B, L, R, H, P) without mimo_o), the last state (rows, H, P, N) and the chunk-start
    states (chunks, H, P, N) (none without ``save_chunk_states``), both in a's dtype."""
    x, a = inputs.x, inputs.a
    batch, length, heads, P = x.shape
    ranks, N = inputs.B.shape[2], inputs.B.shape[4]
    rows = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    n_saved = config(P, N, ranks).max_chunks(rows, length, cu_seqlens is not None) if save_chunk_states else 0
    per_rank = () if inputs.mimo_o is not None else (ranks,)
    out = x.new_empty(batch, length, *per_rank, heads, P)
    return out, a.new_empty(rows, heads, P, N), a.new_empty(n_saved, heads, P, N)


def _trapezoidal_scan_fwd(
    inputs: KernelInputs, H_init: Tensor | None, cu_seqlens: Tensor | None, halved: bool, save_chunk_states: bool
):
    """The forward kernel on ``inputs`` from H_init (rows, H, P, N) (or 0). Returns out
    (B, L, H, P) in x's dtype ((B, L, R, H, P) without mimo_o), the last state (rows, H, P, N)
    and the chunk-start states (chunks, H, P, N) (none without ``save_chunk_states``)."""
    inputs = KernelInputs(*contiguous(*inputs))
    cfg, rows, args = _kernel_args(inputs, cu_seqlens, halved)
    out, H_last, chunk_states = _forward_outputs(inputs, cu_seqlens, save_chunk_states)
    (H_init,) = contiguous(H_init)
    heads, P = inputs.x.shape[2:]
    check_launchable(inputs.x)
    _trapezoidal_scan_fwd_kernel[(rows, heads, cfg.p_blocks(P))](
        **args,
        H_init_ptr=H_init,
        out_ptr=out,
        H_last_ptr=H_last,
        chunk_states_ptr=chunk_states,
        num_warps=cfg.num_warps,
    )
    return out, H_last, chunk_states


def _trapezoidal_scan_bwd(
    dout: Tensor,
    dH_last: Tensor | None,
    inputs: KernelInputs,
    cu_seqlens: Tensor | None,
    halved: bool,
    chunk_states: Tensor,
) -> tuple[KernelInputs, Tensor]:
    """Gradients of :func:`_trapezoidal_scan_fwd`'s out and last state, given its saved chunk
    states: those of the inputs, each in its input's dtype (None for an absent input), and
    dH_init in the state dtype."""
    inputs = KernelInputs(*contiguous(*inputs))
    cfg, rows, args = _kernel_args(inputs, cu_seqlens, halved)
    x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin = inputs
    dout, dH_last = contiguous(dout, dH_last)
    batch, length, heads, P = x.shape
    ranks, groups, N = B.shape[2:]
    dtype = a.dtype
    blocks = cfg.p_blocks(P)
    new = dict(device=x.device, dtype=dtype)
    dx = torch.empty(batch, length, heads, P, **new)
    dz = None if z is None else torch.empty(batch, length, heads, P, **new)
    dH_init = torch.empty(rows, heads, P, N, **new)
    dk_part = torch.empty(blocks, batch, length, ranks, heads, N, **new)
    dq_part = torch.empty(blocks, batch, length, ranks, heads, N, **new)
    da_part, dsigma_part, dc_part = (torch.empty(blocks, batch, length, heads, **new) for _ in range(3))
    dD_part = torch.zeros(rows, heads, blocks, **new)
    dmimo_part = torch.zeros(3, rows, heads, ranks, P, **new)
    check_launchable(x)
    _trapezoidal_scan_bwd_kernel[(rows, heads, blocks)](
        **args,
        num_warps=cfg.num_warps_bwd,
        chunk_states_ptr=chunk_states,
        dout_ptr=dout,
        dH_last_ptr=dH_last,
        dx_ptr=dx,
        dz_ptr=dz,
        dH_init_ptr=dH_init,
        dk_part_ptr=dk_part,
        dq_part_ptr=dq_part,
        da_part_ptr=da_part,
        dsigma_part_ptr=dsigma_part,
        dc_part_ptr=dc_part,
        dD_part_ptr=dD_part,
        dmimo_part_ptr=dmimo_part,
        BL=batch * length,
    )
    # Sums over P-blocks, then the rotation's backward: k̃ = Rot(φ)·(B + B_bias) per head.
    rotary = "halved" if halved else "interleaved"
    cos5, sin5 = cos[:, :, None], sin[:, :, None]  # (B, L, 1, H, M)
    grads_BC, dcos, dsin = [], 0, 0
    for M_, bias, part in ((B, B_bias, dk_part), (C, C_bias, dq_part)):
        w = per_head(M_, heads, bias, dtype)  # (B, L, R, H, N)
        dw, dcos_, dsin_ = rotate_backward(part.sum(0), w, cos5, sin5, rotary)
        dcos, dsin = dcos + dcos_.sum(2), dsin + dsin_.sum(2)
        dM = dw.unflatten(3, (groups, heads // groups)).sum(4)  # heads → their group
        # (H, R, N) contiguous, as the fake says: torch.compile lays out its graph by the fake's strides
        dbias = None if bias is None else dw.sum((0, 1)).transpose(0, 1).contiguous().to(bias.dtype)
        grads_BC.append((dM.to(M_.dtype), dbias))
    (dB, dB_bias), (dC, dC_bias) = grads_BC
    dmimo = [None if t is None else dmimo_part[i].sum(0).to(t.dtype) for i, t in enumerate((mimo_x, mimo_z, mimo_o))]
    grads = KernelInputs(
        x=dx.to(x.dtype),
        B=dB,
        C=dC,
        B_bias=dB_bias,
        C_bias=dC_bias,
        mimo_x=dmimo[0],
        z=None if z is None else dz.to(z.dtype),
        mimo_z=dmimo[1],
        mimo_o=dmimo[2],
        D=None if D is None else dD_part.sum((0, 2)).to(D.dtype),
        a=da_part.sum(0).to(a.dtype),
        sigma=dsigma_part.sum(0).to(sigma.dtype),
        c=dc_part.sum(0).to(c.dtype),
        cos=dcos.to(cos.dtype),
        sin=dsin.to(sin.dtype),
    )
    return grads, dH_init


# ----------------------------------------------------------------------------- custom ops
# Custom ops take tensors, not a NamedTuple: each takes the KernelInputs flat, in their order.


def _fwd_fake(
    x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin,
    H_init, cu_seqlens, halved, save_chunk_states,
):  # fmt: skip
    inputs = KernelInputs(x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin)
    return _forward_outputs(inputs, cu_seqlens, save_chunk_states)


def _bwd_fake(
    dout, dH_last, x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin,
    cu_seqlens, halved, chunk_states,
):  # fmt: skip
    inputs = KernelInputs(x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin)
    rows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    dH_init = a.new_empty(rows, x.shape[2], x.shape[3], B.shape[4])
    return (*(fake_like(t, x) for t in inputs), dH_init)


def _setup_context(ctx, inputs, output):
    *tensors, H_init, cu_seqlens, halved, _save = inputs  # tensors: the KernelInputs
    ctx.mark_non_differentiable(output[2])
    ctx.save_for_backward(*tensors, cu_seqlens, output[2])
    ctx.halved = halved
    ctx.H_init_dtype = None if H_init is None else H_init.dtype


def _backward(ctx, dout, dH_last, _dchunk_states):
    *tensors, cu_seqlens, chunk_states = ctx.saved_tensors
    inputs = KernelInputs(*tensors)
    if dout is None:
        rank_shape = () if inputs.mimo_o is not None else (inputs.B.shape[2],)
        dout = inputs.x.new_zeros(*inputs.x.shape[:2], *rank_shape, *inputs.x.shape[2:])
    *grads, dH_init = trapezoidal_scan_bwd(dout, dH_last, *inputs, cu_seqlens, ctx.halved, chunk_states)
    result = [None if t is None else g for t, g in zip(inputs, grads)]
    dH_init = None if ctx.H_init_dtype is None else dH_init.to(ctx.H_init_dtype)
    return (*result, dH_init, None, None, None)  # cu_seqlens, halved, save_chunk_states


@kernel_op("ssm::trapezoidal_scan_fwd", fake=_fwd_fake, backward=_backward, setup_context=_setup_context)
def trapezoidal_scan_fwd(
    x: Tensor,
    B: Tensor,
    C: Tensor,
    B_bias: Tensor | None,
    C_bias: Tensor | None,
    mimo_x: Tensor | None,
    z: Tensor | None,
    mimo_z: Tensor | None,
    mimo_o: Tensor | None,
    D: Tensor | None,
    a: Tensor,
    sigma: Tensor,
    c: Tensor,
    cos: Tensor,
    sin: Tensor,
    H_init: Tensor | None,
    cu_seqlens: Tensor | None,
    halved: bool,
    save_chunk_states: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """out, last state, chunk-start states (what the backward needs)."""
    inputs = KernelInputs(x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin)
    return _trapezoidal_scan_fwd(inputs, H_init, cu_seqlens, halved, save_chunk_states)


@kernel_op("ssm::trapezoidal_scan_bwd", fake=_bwd_fake)
def trapezoidal_scan_bwd(
    dout: Tensor,
    dH_last: Tensor | None,
    x: Tensor,
    B: Tensor,
    C: Tensor,
    B_bias: Tensor | None,
    C_bias: Tensor | None,
    mimo_x: Tensor | None,
    z: Tensor | None,
    mimo_z: Tensor | None,
    mimo_o: Tensor | None,
    D: Tensor | None,
    a: Tensor,
    sigma: Tensor,
    c: Tensor,
    cos: Tensor,
    sin: Tensor,
    cu_seqlens: Tensor | None,
    halved: bool,
    chunk_states: Tensor,
) -> tuple[(Tensor,) * (len(KernelInputs._fields) + 1)]:
    """The gradients of the inputs (an empty placeholder for an absent one), then dH_init."""
    inputs = KernelInputs(x, B, C, B_bias, C_bias, mimo_x, z, mimo_z, mimo_o, D, a, sigma, c, cos, sin)
    grads, dH_init = _trapezoidal_scan_bwd(dout, dH_last, inputs, cu_seqlens, halved, chunk_states)
    return placeholders((*grads, dH_init), x)


# ----------------------------------------------------------------------------- backend entry point


def _core(args: TrapezoidalArgs, p: Prepared):
    """The core of the shared fast-path skeleton (run_core) on the kernels: where the typed
    arguments become the custom op's flat ones. ``args.chunk_size`` is the chunked backend's,
    not used here (the kernels scan CHUNK steps at a time)."""
    inputs = KernelInputs(
        x=args.x,
        B=args.B,
        C=args.C,
        B_bias=args.B_bias,
        C_bias=args.C_bias,
        mimo_x=args.mimo_x,
        z=args.z,
        mimo_z=args.mimo_z,
        mimo_o=args.mimo_o,
        D=args.D,
        a=p.a,
        sigma=p.s,
        c=p.c,
        cos=p.cos,
        sin=p.sin,
    )
    save = needs_backward(*inputs, p.H_init)  # chunk states are only for a backward
    out, H_last, _ = trapezoidal_scan_fwd(*inputs, p.H_init, args.cu_seqlens, args.rotary == "halved", save)
    return out, H_last


def trapezoidal_scan_triton(args: TrapezoidalArgs):
    """Backend "triton" of :func:`ssm.scan.trapezoidal_scan`: out in x's dtype and the last
    state in float32 (float64 for float64 inputs)."""
    return run_core(_core, args)
