"""The decoding step of a stack of Mamba-1 blocks, and the LM head, in one C call per token
(ssm/native/decode.c), for recurrent generation on the CPU.

A layer hands its tensors over as a ``MambaBlockWeights`` (and the model its head as
``LMHeadWeights``): typed, documented fields, so that nothing here knows a module's parameter
names. ``mamba_blocks_step`` runs one step; ``MambaBlocksStep.prepare`` builds the C arguments
once for a caller that decodes many tokens with the same tensors (``MambaLM.generate``).

Both return None where the C step does not apply, and the caller steps its layers one by one
(same numbers): every tensor on the CPU, contiguous, of one dtype (float32 or float64), no
gradient to keep, not inside torch.compile, the library built. ``mamba_blocks_step_ref``
(reference.py) computes the same step in plain tensor code.

Shape symbols: B batch, M d_model, D the mixer's channels (d_inner), N state size, R dt_rank,
K the conv's width, V the vocabulary.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..native import declare, kernel, ptr, ready, threads


@dataclass(frozen=True)
class MambaBlockWeights:
    """One Mamba-1 block's decoding step: residual ← hidden + residual (the first block:
    residual ← hidden); x = RMSNorm(residual); the mixer's step on x (in_proj, the causal conv's
    step and SiLU, x_proj, dt_proj with softplus, the selective step gated by SiLU(z), out_proj).
    Every tensor of one dtype, contiguous; a bias may be None. The two states are updated in
    place."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    in_proj_weight: Tensor  # (2·D, M): x rows then z rows
    in_proj_bias: Tensor | None  # (2·D,)
    conv_weight: Tensor  # (D, 1, K) or (D, K)
    conv_bias: Tensor | None  # (D,)
    conv_state: Tensor  # (B, D, K): the last K conv inputs, most recent last
    x_proj_weight: Tensor  # (R + 2·N, D): dt rows, B rows, C rows
    dt_proj_weight: Tensor  # (D, R)
    dt_proj_bias: Tensor | None  # (D,)
    A: Tensor  # (D, N) = -exp(A_log)
    D: Tensor | None  # (D,): the skip
    ssm_state: Tensor  # (B, D, N)
    out_proj_weight: Tensor  # (M, D)
    out_proj_bias: Tensor | None  # (M,)

    def tensors(self) -> list[Tensor | None]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "norm_eps"]


@dataclass(frozen=True)
class LMHeadWeights:
    """After the last block: residual ← hidden + residual; logits = weight · RMSNorm(residual)."""

    norm_weight: Tensor  # (M,)
    norm_eps: float
    weight: Tensor  # (V, M)


class _BlockStepArgs(ctypes.Structure):
    """BlockStepArgs of ssm/native, field for field."""

    _fields_ = (
        [(name, ctypes.c_int64) for name in ("batch", "d_model", "dim", "N", "R", "K", "nthreads")]
        + [("eps", ctypes.c_double)]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "hidden", "residual", "norm_w", "in_w", "in_b", "conv_w", "conv_b", "conv_state",
                "x_w", "dt_w", "dt_b", "A", "Dskip", "ssm_state", "out_w", "out_b",
                "work", "new_hidden", "new_residual",
            )
        ]
    )  # fmt: skip


class _HeadArgs(ctypes.Structure):
    """HeadArgs of ssm/native, field for field."""

    _fields_ = [("vocab", ctypes.c_int64), ("eps", ctypes.c_double)] + [
        (name, ctypes.c_void_p) for name in ("norm_w", "weight", "logits")
    ]


declare("mamba_blocks_step", [ctypes.POINTER(_BlockStepArgs), ctypes.c_int64, ctypes.POINTER(_HeadArgs)])

# BlockStepArgs' pointer fields, in MambaBlockWeights' order
_POINTERS = ("norm_w", "in_w", "in_b", "conv_w", "conv_b", "conv_state", "x_w", "dt_w", "dt_b")
_POINTERS += ("A", "Dskip", "ssm_state", "out_w", "out_b")


def mamba_blocks_step(
    hidden: Tensor, blocks: Sequence[MambaBlockWeights], head: LMHeadWeights | None = None
) -> Tensor | tuple[Tensor, Tensor] | None:
    """The decoding step of ``blocks`` in order, in one C call. ``hidden`` (B, M) enters the first
    block; returns the last block's (hidden, residual), or with ``head`` the logits (B, V).
    None where the C step does not apply (see the module's docstring). The caller validates
    shapes against its layers."""
    step = MambaBlocksStep.prepare(hidden, blocks, head)
    return None if step is None else step()


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

    def __init__(self, tensors: list, fn, args, head: _HeadArgs | None, result):
        self.hidden = tensors[0]
        self._tensors, self._fn, self._args, self._head, self._result = tensors, fn, args, head, result
        self._head_ref = None if head is None else ctypes.byref(head)

    @classmethod
    def prepare(
        cls, hidden: Tensor, blocks: Sequence[MambaBlockWeights], head: LMHeadWeights | None = None
    ) -> MambaBlocksStep | None:
        """See ``mamba_blocks_step`` for the arguments, and for when this is None."""
        dtype = hidden.dtype
        tensors = [hidden] + [t for block in blocks for t in block.tensors() if t is not None]
        if head is not None:
            tensors += [head.norm_weight, head.weight]
        if (
            not blocks
            or dtype not in (torch.float32, torch.float64)
            or any(t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() for t in tensors)
            or torch.compiler.is_compiling()
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
        ):
            return None
        if not ready():
            return None
        batch, d_model = hidden.shape
        args = (_BlockStepArgs * len(blocks))()
        # outputs alternate between two (hidden, residual) pairs: block l reads block l - 1's pair
        pairs = hidden.new_empty(2, 2, batch, d_model)
        pair_ptrs = [(pairs[p, 0].data_ptr(), pairs[p, 1].data_ptr()) for p in (0, 1)]
        work_size = 0
        for i, (a, block) in enumerate(zip(args, blocks)):
            dim, N = block.A.shape
            R = block.dt_proj_weight.shape[1]
            a.batch, a.d_model, a.dim, a.N, a.R, a.K = batch, d_model, dim, N, R, block.conv_weight.shape[-1]
            a.nthreads, a.eps = threads(), block.norm_eps
            for name, t in zip(_POINTERS, block.tensors()):
                setattr(a, name, ptr(t))
            a.hidden, a.residual = (hidden.data_ptr(), None) if i == 0 else pair_ptrs[(i - 1) % 2]
            a.new_hidden, a.new_residual = pair_ptrs[i % 2]
            work_size = max(work_size, batch * (d_model + 5 * dim + R + 2 * N))
        work = hidden.new_empty(work_size)
        for a in args:
            a.work = work.data_ptr()
        tensors += [pairs, work]
        fn = kernel("mamba_blocks_step", hidden.dtype)
        last = (len(blocks) - 1) % 2
        if head is None:
            return cls(tensors, fn, args, None, (pairs[last, 0], pairs[last, 1]))
        h = _HeadArgs()
        h.vocab, h.eps = head.weight.shape[0], head.norm_eps
        logits = hidden.new_empty(batch, h.vocab)
        h.norm_w, h.weight, h.logits = head.norm_weight.data_ptr(), head.weight.data_ptr(), logits.data_ptr()
        tensors.append(logits)
        return cls(tensors, fn, args, h, logits)

    def __call__(self) -> Tensor | tuple[Tensor, Tensor]:
        self._fn(self._args, len(self._args), self._head_ref)
        return self._result
