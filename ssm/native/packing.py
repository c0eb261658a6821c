"""The host copies of packed-sequence boundaries (``cu_seqlens``) that passed validation, kept per
tensor while it lives: ``ssm.scan.packed_sequences`` records each one it validates, and the ops
whose C kernels read the boundaries (the causal convolution) look them up instead of reading
the tensor again (on CUDA each read is a host sync; a model reads its cu_seqlens once per
forward). Here, on the lowest floor, because both the scans and the ops use it.
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakTensorKeyDictionary

_BOUNDS = WeakTensorKeyDictionary()


def remember_bounds(cu_seqlens: torch.Tensor, bounds: tuple[int, ...]) -> None:
    """Record ``bounds``, the validated values of ``cu_seqlens``."""
    _BOUNDS[cu_seqlens] = bounds


def known_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...] | None:
    """The validated values of ``cu_seqlens`` if it passed validation, else None."""
    return _BOUNDS.get(cu_seqlens)
