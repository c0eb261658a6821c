"""The decoding step of a stack of Mamba-1, Mamba-2 or Mamba-3 blocks (or of a hybrid's
attention blocks), and the LM head, in one C call per token (ssm/native/decode.c,
decode_mamba2.c, decode_mamba3.c, decode_attention.c), for recurrent generation on the CPU: the
step and the ctypes mirrors of its C argument structs.

A layer hands its tensors over as a ``MambaBlockWeights``, ``Mamba2BlockWeights``,
``Mamba3BlockWeights`` or ``AttentionBlockWeights`` (with a ``GatedMLPWeights`` for a block's
MLP), and the model its head as ``LMHeadWeights`` (step_weights.py, which also states the dtypes
and shape symbols). ``mamba_blocks_step`` runs one step; ``MambaBlocksStep.prepare`` builds the
C arguments once for a caller that decodes many tokens with the same tensors
(``MambaLM.generate``). Each tensor reaches the C code through quant_cpu.py's ``Feed`` (a matrix
as a ``WMat``, read in its stored format).

Both return None where the C step does not apply, and the caller steps its layers one by one
(same numbers): every tensor on the CPU, contiguous, no gradient to keep, not inside
torch.compile, the library built, every block of one kind, and the dtypes those step_weights.py
lists. ``mamba_blocks_step_ref`` and ``mamba2_blocks_step_ref`` (reference.py) compute the same
steps in plain float64 loops.

The weight types and the matrix helpers that lived here (``decode_matvec``, ``widen_rows``,
``round_rows``, now in quant_cpu.py) still import from this module.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch import Tensor

from ..native import declare, kernel, ready, threads
from .quant_cpu import Feed, WMat, decode_matvec, round_rows, widen_rows
from .step_weights import (
    AttentionBlockWeights,
    GatedMLPWeights,
    LMHeadWeights,
    Mamba2BlockWeights,
    Mamba3BlockWeights,
    MambaBlockWeights,
)

__all__ = [
    "mamba_blocks_step",
    "MambaBlocksStep",
    "MambaBlockWeights",
    "Mamba2BlockWeights",
    "Mamba3BlockWeights",
    "AttentionBlockWeights",
    "GatedMLPWeights",
    "LMHeadWeights",
    "decode_matvec",
    "widen_rows",
    "round_rows",
]


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
        + [(name, WMat) for name in ("in_w", "x_w", "dt_w", "out_w")]
    )  # fmt: skip


class _HeadArgs(ctypes.Structure):
    """HeadArgs of ssm/native, field for field."""

    _fields_ = [("vocab", ctypes.c_int64), ("eps", ctypes.c_double)] + [
        (name, ctypes.c_void_p) for name in ("norm_w", "logits")
    ]
    _fields_ += [("weight", WMat)]


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
        + [(name, WMat) for name in ("in_w", "out_w", "fc1_w", "fc2_w")]
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
        + [(name, WMat) for name in ("in_w", "out_w", "fc1_w", "fc2_w")]
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
        + [(name, WMat) for name in ("in_w", "out_w", "fc1_w", "fc2_w")]
    )  # fmt: skip


_HEAD = ctypes.POINTER(_HeadArgs)
declare("mamba_blocks_step", [ctypes.POINTER(_BlockStepArgs), ctypes.c_int64, _HEAD])
declare("mamba2_blocks_step", [ctypes.POINTER(_Mamba2StepArgs), ctypes.c_int64, _HEAD])
declare("mamba3_blocks_step", [ctypes.POINTER(_Mamba3StepArgs), ctypes.c_int64, _HEAD])
declare("attention_blocks_step", [ctypes.POINTER(_AttentionStepArgs), ctypes.c_int64, _HEAD])


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


def _check_sizes(kind: str, **sizes: int) -> None:
    """Every size the C step loops over or indexes by is at least 1 (a conv of width 0 writes
    before its state's row; a state of no entries sizes nothing)."""
    small = {name: value for name, value in sizes.items() if value < 1}
    if small:
        raise ValueError(f"{kind}: the sizes {', '.join(sizes)} must each be >= 1, got {small}")


def _check_shapes(kind: str, expected: dict) -> None:
    """Each tensor named in ``expected`` (name -> (shape, tensor)) has that shape."""
    for name, (shape, t) in expected.items():
        if t is None or tuple(t.shape) != tuple(shape):
            raise ValueError(f"{kind}.{name} must have shape {shape}, got {None if t is None else tuple(t.shape)}")


def _mamba1_args(a: _BlockStepArgs, block: MambaBlockWeights, batch: int, d_model: int, feed: Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    kind = "MambaBlockWeights"
    if block.A.ndim != 2 or len(block.dt_proj_weight.shape) != 2 or block.conv_weight.ndim not in (2, 3):
        shapes = tuple(block.A.shape), tuple(block.dt_proj_weight.shape), tuple(block.conv_weight.shape)
        raise ValueError(f"{kind}: A must be (D, N), dt_proj_weight (D, R), conv_weight (D, 1, K); got {shapes}")
    dim, N = block.A.shape
    R, K = block.dt_proj_weight.shape[1], block.conv_weight.shape[-1]
    _check_sizes(kind, D=dim, N=N, R=R, K=K)
    expected = {
        "norm_weight": ((d_model,), block.norm_weight),
        "in_proj_weight": ((2 * dim, d_model), block.in_proj_weight),
        "conv_weight": ((dim, K), block.conv_weight.reshape(block.conv_weight.shape[0], -1)),
        "conv_state": ((batch, dim, K), block.conv_state),
        "x_proj_weight": ((R + 2 * N, dim), block.x_proj_weight),
        "dt_proj_weight": ((dim, R), block.dt_proj_weight),
        "ssm_state": ((batch, dim, N), block.ssm_state),
        "out_proj_weight": ((d_model, dim), block.out_proj_weight),
    }
    optional = {"in_proj_bias": (2 * dim,), "conv_bias": (dim,), "dt_proj_bias": (dim,), "D": (dim,)}
    optional["out_proj_bias"] = (d_model,)
    expected.update(
        (name, (shape, getattr(block, name))) for name, shape in optional.items() if getattr(block, name) is not None
    )
    _check_shapes(kind, expected)
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


def _mamba2_args(a: _Mamba2StepArgs, block: Mamba2BlockWeights, batch: int, d_model: int, feed: Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    if block.ssm_state.ndim != 4:
        raise ValueError(f"ssm_state must be (B, H, P, N), got shape {tuple(block.ssm_state.shape)}")
    _, H, P, N = block.ssm_state.shape
    G, S = block.ngroups, H * P
    C, K = block.conv_weight.shape[0], block.conv_weight.shape[-1]
    _check_sizes("Mamba2BlockWeights", H=H, P=P, N=N, K=K)
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
    _check_shapes("Mamba2BlockWeights", expected)
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


def _mamba3_args(a: _Mamba3StepArgs, block: Mamba3BlockWeights, batch: int, d_model: int, feed: Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    if block.ssm_state.ndim != 4 or block.B_bias.ndim != 3:
        shapes = tuple(block.ssm_state.shape), tuple(block.B_bias.shape)
        raise ValueError(f"ssm_state must be (B, H, P, N) and B_bias (H, R, N), got shapes {shapes}")
    _, H, P, N = block.ssm_state.shape
    G, S, T, R = block.ngroups, H * P, block.phase.shape[-1], block.B_bias.shape[1]
    _check_sizes("Mamba3BlockWeights", H=H, P=P, N=N, R=R)
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
    _check_shapes("Mamba3BlockWeights", expected)
    if G < 1 or H % G or T < 0 or T > (N // 2) or (block.key.ndim == 3 and R != 1):
        raise ValueError(
            f"Mamba3BlockWeights: ngroups {G} must divide H = {H}, 0 <= T = {T} <= N / 2 = {N // 2}, "
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


def _attention_args(a: _AttentionStepArgs, block: AttentionBlockWeights, batch: int, d_model: int, feed: Feed) -> int:
    """Fill a's sizes and weights, checking that the shapes fit together (the C code reads by
    them); return the scratch the block needs (elements)."""
    H, Hk = block.num_heads, block.num_heads_kv
    if block.key.ndim != 4 or H < 1 or Hk < 1 or H % Hk:
        raise ValueError(
            f"AttentionBlockWeights: key must be (B, capacity, Hk, P) and num_heads_kv {Hk} divide num_heads {H}, "
            f"got key shape {tuple(block.key.shape)}"
        )
    _, T, _, P = block.key.shape
    _check_sizes("AttentionBlockWeights", P=P)
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
    _check_shapes("AttentionBlockWeights", expected)
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
        if hidden.ndim != 2 or hidden.shape[1] < 1:
            raise ValueError(f"hidden must have shape (batch, d_model) with d_model >= 1, got {tuple(hidden.shape)}")
        batch, d_model = hidden.shape
        feed = Feed(compute)
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
            _check_shapes("LMHeadWeights", {"norm_weight": ((d_model,), head.norm_weight)})
            if len(head.weight.shape) != 2 or head.weight.shape[1] != d_model:
                raise ValueError(f"LMHeadWeights.weight must have shape (V, {d_model}), got {tuple(head.weight.shape)}")
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
