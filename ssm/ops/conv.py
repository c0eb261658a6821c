"""The causal depthwise convolution of the Mamba mixers, over a sequence and one step at a time.

    causal_conv1d_silu(x, weight, bias, state, cu_seqlens, transposed, backend=...)
        SiLU(conv) of x (B, L, D) as in_proj leaves it: what the Mamba-1 and Mamba-2 layers call.
        Backends: "cpu" (one C pass each way, ops/cpu.py), "torch" (the tensor code below).
    causal_conv1d(x, weight, bias, state, cu_seqlens)   the conv of x (B, D, L), tensor code
    causal_conv1d_step(x, weight, bias, state)          one token

The convolution state is the last K inputs (K = kernel size), most recent last: (B, D, K), as in
mamba-ssm's inference cache. A zero state means "no history".

Packed sequences (``cu_seqlens``, batch 1): the convolution never reads across a boundary. A
sequence's first K - 1 outputs read, for the taps before its start, its own history (that
sequence's row of ``state``, (S, D, K)) or zeros, exactly as if it were run alone.
``reference.causal_conv1d_ref`` is the plain loop every path is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._backends import BackendTable
from ..native.packing import known_bounds
from .activation import dsilu
from .cpu import causal_conv1d_cpu

ConvOut = tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]


def _check_conv(x, weight, bias, state, cu_seqlens, channels_last: bool) -> None:
    """The arguments of the convolution ops, checked before any kernel reads them: x (B, L, D)
    (``channels_last``) or (B, D, L), weight (D, 1, K) with K >= 1 (the C kernels index a ring
    of K rows), bias (D,), state (B, D, K) or (S, D, K) per packed sequence, cu_seqlens (S + 1,)
    integer (its values too, on the CPU, where the C kernel reads them)."""
    layout = "(batch, L, D)" if channels_last else "(batch, D, L)"
    for name, t, ndim in (("x", x, 3), ("weight", weight, 3)):
        if not isinstance(t, torch.Tensor) or t.ndim != ndim or not t.is_floating_point():
            got = f"{t.ndim}-D {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must be a {ndim}-D floating-point tensor {layout if name == 'x' else '(D, 1, K)'}, got {got}"
            )
    D, L = (x.shape[2], x.shape[1]) if channels_last else x.shape[1:]
    if weight.shape[0] != D or weight.shape[1] != 1 or weight.shape[2] < 1:
        raise ValueError(
            f"weight must have shape (D, 1, K) with D = {D} (from x) and a width K >= 1, got {tuple(weight.shape)}"
        )
    K = weight.shape[2]
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (D,)):
        raise ValueError(
            f"bias must be None or have shape (D,) = ({D},), got {getattr(bias, 'shape', type(bias).__name__)}"
        )
    rows = x.shape[0]
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"cu_seqlens must be an int32 or int64 tensor, got {getattr(cu_seqlens, 'dtype', cu_seqlens)!r}"
            )
        if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2 or x.shape[0] != 1:
            raise ValueError(
                f"cu_seqlens must be 1-D (S + 1,) with S >= 1 and x a batch of one, got cu_seqlens of shape "
                f"{tuple(cu_seqlens.shape)} and x of shape {tuple(x.shape)}"
            )
        known = known_bounds(cu_seqlens)  # validated by ssm.scan.packed_sequences (a layer's): not read again
        values = cu_seqlens.tolist() if known is None and cu_seqlens.device.type == "cpu" else known
        # (unknown values on another device are not read: that is a host sync, and only the C kernel,
        # on the CPU, reads them; the tensor code there fails on bad ones)
        bad = values is not None and (values[0] != 0 or values[-1] != L)
        if bad or (known is None and values is not None and any(b < a for a, b in zip(values, values[1:]))):
            raise ValueError(f"cu_seqlens must rise from 0 to L = {L} without decreasing, got {list(values[:12])}")
        rows = cu_seqlens.numel() - 1
    if state is not None and (not isinstance(state, torch.Tensor) or tuple(state.shape) != (rows, D, K)):
        what = "(S, D, K)" if cu_seqlens is not None else "(batch, D, K)"
        raise ValueError(
            f"state must have shape {what} = {(rows, D, K)}, got {getattr(state, 'shape', type(state).__name__)}"
        )


def _silu_cpu(x, weight, bias, state, cu_seqlens, transposed) -> ConvOut | None:
    """The C kernel, or None where it does not apply (another device or dtype, x's channels not
    contiguous, no library; a state to continue from with packed sequences or a gradient)."""
    out = causal_conv1d_cpu(x, weight, bias, cu_seqlens, True, transposed, state)
    if out is None or state is None:
        return None if out is None else (out, None)
    # the new state: the last K inputs of each row, its own steps then (L < K) the old state's
    K, L = state.shape[-1], x.shape[1]
    recent = x[:, max(L - K, 0) :].transpose(1, 2).to(state.dtype)
    new_state = recent.contiguous() if L >= K else torch.cat([state[..., L:], recent], -1)
    return out, new_state


def _silu_torch(x, weight, bias, state, cu_seqlens, transposed) -> ConvOut:
    if state is None and cu_seqlens is None and x.shape[1] > 0:  # training: keep only x for the backward
        y, new_state = _CausalConvSiLU.apply(x.transpose(1, 2), weight, bias), None
    else:
        y, new_state = causal_conv1d(x.transpose(1, 2), weight, bias, state, cu_seqlens)
        y = F.silu(y)
    return ((y.transpose(1, 2), y) if transposed else y.transpose(1, 2)), new_state


# Backends take the public arguments less ``backend``; "cpu" returns None where it does not
# apply, and "auto" then runs "torch".
BACKENDS = BackendTable("causal_conv1d_silu", auto={"cpu": ("cpu", "torch"), "*": ("torch",)})
BACKENDS.add("torch", _silu_torch)
BACKENDS.add("cpu", _silu_cpu, devices=("cpu",))


def causal_conv1d_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    transposed: bool = False,
    backend: str = "auto",
) -> ConvOut:
    """SiLU of the causal convolution of x (B, L, D), channels last as in_proj leaves them
    (e.g. x a view of in_proj's output), with weight (D, 1, K) and bias (D,) or None,
    continuing from ``state`` (B, D, K) as ``causal_conv1d`` does. Returns (out, the new state
    or None): out is (B, L, D), or with ``transposed`` (that, the same values as (B, D, L), the
    scans' layout).

    ``backend="auto"`` takes the C kernel on the CPU where it applies (float32 or float64; x's
    channels contiguous; a state only without cu_seqlens, as a cached prefill, a chunked
    evaluation or a context-parallel rank's halo reads): no copy of x, no padded or transposed copies, the
    SiLU fused, each output contiguous, the backward in one pass. Elsewhere, or with
    ``backend="torch"``, ``causal_conv1d`` on x seen as (B, D, L), the first output a view of
    the second. ``backend="cpu"`` where the kernel does not apply is an error."""
    _check_conv(x, weight, bias, state, cu_seqlens, channels_last=True)
    needs = lambda: (
        f"float32 or float64 CPU tensors, x's channels contiguous, and a state only without cu_seqlens "
        f"(got state {'given' if state is not None else 'None'}, cu_seqlens "
        f"{'given' if cu_seqlens is not None else 'None'}, x {x.dtype} on {x.device} with strides {x.stride()})"
    )
    return BACKENDS.run(
        backend, x.device, (x, weight, bias, state, cu_seqlens, transposed), fallback="torch", needs=needs
    )


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of x (batch, D, L) with weight (D, 1, K), continuing from
    ``state`` (batch, D, K) when given. Returns (y (batch, D, L), the new state or None).
    With ``cu_seqlens`` (S + 1,) (validated, int64; batch 1) each packed sequence is convolved
    alone, and ``state`` and the new state are (S, D, K), one per sequence."""
    _check_conv(x, weight, bias, state, cu_seqlens, channels_last=False)
    if cu_seqlens is not None:
        return _packed_causal_conv1d(x, weight, bias, state, cu_seqlens)
    K = weight.shape[-1]
    if x.shape[-1] == 0:  # nothing to convolve; the state is unchanged
        return x.new_empty(x.shape[0], weight.shape[0], 0), state
    if state is None:
        history = F.pad(x, (K - 1, 0))  # no history: zeros
    else:
        history = torch.cat([state[..., 1:].to(x.dtype), x], dim=-1)  # (batch, D, K - 1 + L)
    y = _DepthwiseConv.apply(history, weight, bias)
    # a copy of its own: a view would keep the whole (batch, D, K - 1 + L) history alive in the
    # cache, and a strided state takes decoding off its fused C step
    new_state = None if state is None else history[..., -K:].to(state.dtype).contiguous()
    return y, new_state


class _DepthwiseConv(torch.autograd.Function):
    """``F.conv1d(h, weight, bias, groups=channels)`` (h (batch, D, K - 1 + L), weight
    (D, 1, K)) with a backward in three plain passes: the input's gradient is the same
    depthwise conv of the zero-padded output gradient with the flipped taps, the weight's K
    sums of a shifted product, the bias's one sum. Measured on the CPU against torch's own
    convolution backward, causal_conv1d fwd+bwd: 25.3 -> 11.5 ms at (8, 512, 512), K 4."""

    @staticmethod
    def forward(ctx, h, weight, bias):
        ctx.save_for_backward(h, weight)
        ctx.with_bias = bias is not None
        return F.conv1d(h, weight, bias, groups=h.shape[1])

    @staticmethod
    def backward(ctx, grad):
        h, weight = ctx.saved_tensors
        K = weight.shape[-1]
        grad_h = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # in grad's dtype: under autocast the forward ran in bfloat16 on a float32 weight, and
            # the backward runs outside autocast (autograd casts each gradient to its input's dtype)
            grad_h = F.conv1d(F.pad(grad, (K - 1, K - 1)), weight.flip(-1).to(grad.dtype), groups=h.shape[1])
        if ctx.needs_input_grad[1]:
            grad_w = _taps_grad(h, grad, K).to(weight.dtype)
        if ctx.with_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum((0, 2))
        return grad_h, grad_w, grad_b


def _taps_grad(h: torch.Tensor, grad: torch.Tensor, K: int) -> torch.Tensor:
    """The weight's gradient (D, 1, K) of the depthwise conv of h (batch, D, K - 1 + L), whose
    output's gradient is ``grad`` (batch, D, L): K sums of a shifted product."""
    L = grad.shape[-1]
    return torch.stack([(h[..., k : k + L] * grad).sum((0, 2)) for k in range(K)], -1)[:, None]


class _CausalConvSiLU(torch.autograd.Function):
    """SiLU(causal depthwise conv of x (batch, D, L)), no history, keeping for the backward only
    x (in the layers a view of in_proj's output, which is kept anyway) and the taps: the
    backward convolves again. Through ``causal_conv1d`` and ``F.silu`` autograd kept x padded
    and the conv's output besides, two more copies of x's size (in a bfloat16 Mamba-2 layer at
    mamba-130m's shapes, 7 KiB per token). The taps' gradient is ``_DepthwiseConv``'s (``_taps_grad``)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        y = F.silu(_CausalConvSiLU._conv(x, weight, bias))
        ctx.save_for_backward(x, weight, bias)
        ctx.dtype = y.dtype  # under autocast the conv ran in its dtype; the backward runs outside it
        return y

    @staticmethod
    def _conv(x, weight, bias, dtype=None):
        h = F.pad(x if dtype is None else x.to(dtype), (weight.shape[-1] - 1, 0))
        if dtype is not None:
            weight, bias = weight.to(dtype), None if bias is None else bias.to(dtype)
        return F.conv1d(h, weight, bias, groups=x.shape[1])

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        dtype = ctx.dtype
        g = grad.to(dtype) * dsilu(_CausalConvSiLU._conv(x, weight, bias, dtype))  # through the SiLU
        K = weight.shape[-1]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            w = weight.flip(-1).to(dtype)
            grad_x = F.conv1d(F.pad(g, (0, K - 1)), w, groups=x.shape[1]).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _taps_grad(F.pad(x.to(dtype), (K - 1, 0)), g, K).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            grad_b = g.sum((0, 2)).to(bias.dtype)
        return grad_x, grad_w, grad_b


def _packed_causal_conv1d(x, weight, bias, state, cu_seqlens):
    """y_t = bias + Σ_j w[K-1-j]·v(t - j), where v(t - j) is x at t - j when that step belongs
    to t's sequence, else that sequence's history (state[s][:, K - i] for the i-th step before
    its start) or 0."""
    D, K, L = weight.shape[0], weight.shape[-1], x.shape[-1]
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    lengths = ends - starts
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths, output_size=L)  # (L,)
    offset = torch.arange(L, device=x.device) - starts[seq]  # (L,) steps since the sequence's start
    padded = F.pad(x, (K - 1, 0))  # (1, D, K - 1 + L)
    y = x.new_zeros(1, D, L) if bias is None else bias.to(x.dtype)[None, :, None].expand(1, D, L)
    for j in range(K):  # the tap reading step t - j
        shifted = padded[..., K - 1 - j : K - 1 - j + L]  # x_{t-j}, zero before step 0
        inside = offset >= j  # (L,) t - j is in t's sequence
        if state is None:  # where, not a product: a NaN of the sequence before must not leak in
            v = torch.where(inside, shifted, 0.0)
        else:
            before = (K - (j - offset)).clamp(0, K - 1)  # the history slot of step t - j
            history = state[seq, :, before].to(x.dtype).T[None]  # (1, D, L)
            v = torch.where(inside, shifted, history)
        y = y + weight[:, 0, K - 1 - j, None].to(x.dtype) * v
    if state is None:
        return y, None
    # Each sequence's last K inputs: its own steps, then (if shorter than K) its history.
    steps = ends[:, None] - K + torch.arange(K, device=x.device)  # (S, K)
    own = steps >= starts[:, None]
    from_x = x[0][:, steps.clamp(0, max(L - 1, 0))].permute(1, 0, 2) if L else state.to(x.dtype)  # (S, D, K)
    slot = (K - (starts[:, None] - steps)).clamp(0, K - 1)  # (S, K)
    from_state = state.gather(2, slot[:, None, :].expand(-1, D, -1)).to(x.dtype)
    new_state = torch.where(own[:, None, :], from_x, from_state).to(state.dtype)
    return y, new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: x (batch, D), state (batch, D, K). Returns (y (batch, D), the new state)."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise ValueError(f"x must be a 2-D tensor (batch, D), got {getattr(x, 'shape', type(x).__name__)}")
    _check_conv(x[:, :, None], weight, bias, state, None, channels_last=False)
    if state is None:
        raise ValueError("state must be a tensor (batch, D, K): the step continues from it")
    state = torch.cat([state[..., 1:], x[..., None].to(state.dtype)], dim=-1)
    y = (state * weight[:, 0, :].to(state.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype), state
