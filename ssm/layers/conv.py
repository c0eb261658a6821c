"""The causal depthwise convolution of the Mamba mixers, over a sequence and one step at a time.

The convolution state is the last K inputs (K = kernel size), most recent last: (batch, D, K),
as in mamba-ssm's inference cache. A zero state means "no history".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal convolution of x (batch, D, L) with weight (D, 1, K), continuing from
    ``state`` (batch, D, K) when given. Returns (y (batch, D, L), the new state or None)."""
    K = weight.shape[-1]
    if x.shape[-1] == 0:  # nothing to convolve; the state is unchanged
        return x.new_empty(x.shape[0], weight.shape[0], 0), state
    if state is None:
        history = F.pad(x, (K - 1, 0))  # no history: zeros
    else:
        history = torch.cat([state[..., 1:].to(x.dtype), x], dim=-1)  # (batch, D, K - 1 + L)
    y = F.conv1d(history, weight, bias, groups=x.shape[1])
    new_state = None if state is None else history[..., -K:].to(state.dtype)
    return y, new_state


def causal_conv1d_step(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step: x (batch, D), state (batch, D, K). Returns (y (batch, D), the new state)."""
    state = torch.cat([state[..., 1:], x[..., None].to(state.dtype)], dim=-1)
    y = (state * weight[:, 0, :].to(state.dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(x.dtype), state
