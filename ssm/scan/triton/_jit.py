"""What the Triton ops share: @triton.jit helpers of their kernels, and the checks, conversions
and custom-op plumbing of their launchers.

Imports triton: only the op modules import this, and only when a Triton kernel is launched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._interpreter import interpreting

# Whether this process defined its kernels for Triton's interpreter: triton.jit reads
# TRITON_INTERPRET when a kernel is defined, i.e. when an op module is first imported.
DEFINED_INTERPRETED = interpreting()


def check_launchable(x: torch.Tensor) -> None:
    """The kernels were defined for the mode ``x``'s device needs (CPU tensors need the
    interpreter, CUDA tensors the compiler); say how to fix it otherwise."""
    if x.device.type == "cpu" and not DEFINED_INTERPRETED:
        raise RuntimeError(
            "the 'triton' backend runs CPU tensors only in Triton's interpreter, and this process "
            "defined its kernels without it: set TRITON_INTERPRET=1 before the first Triton launch"
        )
    if x.device.type != "cpu" and DEFINED_INTERPRETED:
        raise RuntimeError(
            "this process defined its Triton kernels for the interpreter (TRITON_INTERPRET=1 at "
            f"the first launch), which cannot run {x.device.type} tensors; unset it in a new process"
        )


def compute_dtype(*tensors) -> torch.dtype:
    """The state's dtype: float64 if any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def tl_dtype(dtype: torch.dtype):
    """The Triton type of a state of torch dtype ``dtype`` (float32 or float64)."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def contiguous(*tensors) -> list:
    """The tensors made contiguous, as the kernels index them; None stays None."""
    return [None if t is None else t.contiguous() for t in tensors]


def sequence_of_steps(cu_seqlens: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """(L,) int32: the packed sequence each step belongs to (None when not packed)."""
    if cu_seqlens is None:
        return None
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    steps = torch.arange(lengths.numel(), device=cu_seqlens.device, dtype=torch.int32)
    return torch.repeat_interleave(steps, lengths, output_size=length)


def needs_backward(*tensors) -> bool:
    """Whether a backward can follow a forward on these inputs: what the chunk states are saved
    for, so they are not written when none can follow (inference)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Custom ops cannot return None: a backward returns an empty placeholder of this shape for an
# absent input's gradient, and the autograd formula turns it back into None.
NONE = (0,)


def placeholders(grads, like: torch.Tensor) -> tuple:
    """``grads`` with the placeholder (on ``like``'s device and dtype) for each None."""
    return tuple(like.new_empty(NONE) if g is None else g for g in grads)


def fake_like(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A fake backward's gradient of input ``t``: a tensor like it, or the placeholder."""
    return like.new_empty(NONE) if t is None else torch.empty_like(t)


@triton.jit
def first_order_combine(a_left, x_left, a_right, x_right):
    """(a_r, x_r) ∘ (a_l, x_l): apply the left step, then the right one (h -> a·h + x)."""
    return a_right * a_left, a_right * x_left + x_right


@triton.jit
def restarting_combine(a_left, x_left, r_left, a_right, x_right, r_right):
    """first_order_combine for packed sequences, with r > 0 marking steps (and runs of steps)
    that restart a sequence: a run whose right part restarts is that part alone, chosen by a
    selection. Its gate is 0, but 0·NaN is NaN: a product would carry a non-finite state of the
    sequence before into this one."""
    restart = r_right > 0
    a = tl.where(restart, a_right, a_right * a_left)
    x = tl.where(restart, x_right, a_right * x_left + x_right)
    return a, x, tl.maximum(r_left, r_right)


@triton.jit
def softplus(x):
    """log(1 + e^x) without overflow; x itself above 20, as torch's softplus does."""
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))


@triton.jit
def at_time(x, t_local, at: tl.constexpr):
    """x[:, :, at] of a (BLOCK_D, BLOCK_N, CHUNK) tile."""
    return tl.sum(tl.where(t_local[None, None, :] == at, x, 0.0), axis=2)


@triton.jit
def flip_time(x, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, LOG2_CHUNK: tl.constexpr, INT: tl.constexpr):
    """x[:, :, ::-1] of a (BLOCK_D, BLOCK_N, 2**LOG2_CHUNK) tile, exactly.

    As tl.flip: view time as LOG2_CHUNK axes of size 2 and swap the two halves of each. The
    swap of a pair (p, q) is (p + q) - itself, in integers (wrapping, so exact) on the bits of
    the values: a plain sum, which Triton's interpreter runs vectorised, where tl.flip's
    xor-reduction runs element by element in Python (minutes for the tests)."""
    y = tl.reshape(x.to(INT, bitcast=True), [BLOCK_D, BLOCK_N] + [2] * LOG2_CHUNK)
    for i in tl.static_range(LOG2_CHUNK):
        y = tl.sum(y, 2 + i, keep_dims=True) - y
    return tl.reshape(y, [BLOCK_D, BLOCK_N, 2**LOG2_CHUNK]).to(x.dtype, bitcast=True)
