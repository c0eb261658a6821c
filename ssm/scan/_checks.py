"""Input validation shared by the public scan functions.

Every check raises ``ValueError`` whose message names the argument, what was expected and
what was given. Backends only ever see inputs that passed these checks.
"""

from __future__ import annotations

from typing import Sequence

import torch


def check_tensor(name: str, x, *, ndim: int | Sequence[int] | None = None) -> torch.Tensor:
    """``x`` is a real floating-point tensor (of one of the given ranks)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must have a real floating-point dtype, got {x.dtype}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            ranks = " or ".join(f"{r}-D" for r in allowed)
            raise ValueError(f"{name} must be {ranks}, got a {x.ndim}-D tensor of shape {tuple(x.shape)}")
    return x


def check_shape(name: str, x: torch.Tensor, expected: Sequence[int], symbols: str) -> None:
    """``x.shape == expected``; ``symbols`` names the dimensions, e.g. ``"(batch, dim, L)"``."""
    if tuple(x.shape) != tuple(expected):
        raise ValueError(
            f"{name} must have shape {symbols} = {tuple(expected)}, got {tuple(x.shape)}"
        )


def check_same_device(reference_name: str, reference: torch.Tensor, **others) -> None:
    for name, x in others.items():
        if x is not None and x.device != reference.device:
            raise ValueError(
                f"{name} is on device '{x.device}' but {reference_name} is on '{reference.device}'; "
                "all tensors must be on one device"
            )


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype states are computed in: float64 if any input is float64, else float32."""
    if any(t is not None and t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32
