"""Input validation shared by the public scan functions.

Every check raises ``ValueError`` whose message names the argument, what was expected and
what was given. Backends only ever see inputs that passed these checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..native.packing import known_bounds, remember_bounds


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
        raise ValueError(f"{name} must have shape {symbols} = {tuple(expected)}, got {tuple(x.shape)}")


def check_state_size(name: str, x: torch.Tensor, N: int, symbols: str) -> None:
    """The state size N that ``x`` (of shape ``symbols``) gives is at least 1: a state of no
    entries is refused by every scan, whichever backend (the C sweeps' scratch is sized by N)."""
    if N < 1:
        raise ValueError(f"{name} must have shape {symbols} with a state size N >= 1, got {tuple(x.shape)}")


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


def empty_output(shape: Sequence[int], dtype: torch.dtype, *inputs: torch.Tensor | None) -> torch.Tensor:
    """The output of a scan that has nothing to compute (a length, batch or channel count of 0):
    an empty tensor of ``shape``, tied into the autograd graph of the ``inputs`` that need a
    gradient (each then gets a zero one), as a backend's output would be."""
    present = [t for t in inputs if t is not None]
    out = present[0].new_empty(shape, dtype=dtype)
    tied = [t for t in present if t.requires_grad]
    if tied and torch.is_grad_enabled():
        out = out + sum(t.sum() for t in tied).to(dtype) * 0  # (empty: nothing is computed)
    return out


@dataclass(frozen=True)
class PackedSequences:
    """Packed-sequence boundaries that passed ``packed_sequences``: ``cu_seqlens`` (S + 1,) int64
    on the inputs' device, and ``bounds``, the same numbers on the host. Hand it to a model, a
    layer or a scan in place of the tensor, and nothing validates it again: a model checks its
    ``cu_seqlens`` once per forward and passes this down to every layer and scan (on CUDA each
    check of a tensor is a host sync)."""

    cu_seqlens: torch.Tensor
    bounds: tuple[int, ...]

    @property
    def num_sequences(self) -> int:
        return len(self.bounds) - 1

    @property
    def length(self) -> int:
        """The packed length L."""
        return self.bounds[-1]


def packed_sequences(cu_seqlens, length: int, batch: int = 1, device: torch.device | None = None) -> PackedSequences:
    """Validate packed-sequence boundaries for inputs (``batch``, ``length``, ...) on ``device``.

    ``cu_seqlens`` is a 1-D integer tensor (S + 1,) of cumulative lengths: it starts at 0, never
    decreases and ends at the packed length L; sequence s occupies positions
    cu_seqlens[s] .. cu_seqlens[s + 1] - 1 of a batch of one. Zero-length sequences are allowed
    (their last state is their initial state). The convention of flash-linear-attention and of
    mamba-ssm's varlen Mamba-2. A ``PackedSequences`` is checked against ``length``, ``batch``
    and ``device`` only, without reading its values again (no host sync)."""
    if isinstance(cu_seqlens, PackedSequences):
        packed, values = cu_seqlens, list(cu_seqlens.bounds)
        cu_seqlens = packed.cu_seqlens
    elif not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    else:
        packed = None
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must have dtype torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries (num_seqs + 1), got shape {tuple(cu_seqlens.shape)}"
        )
    if device is not None and cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on device '{cu_seqlens.device}' but the inputs are on '{device}'")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along L in a batch of 1, got batch = {batch}")
    if packed is None:
        values = cu_seqlens.tolist()  # the one host sync
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {values[0]} (cu_seqlens = {_shorten(values)})")
    if values[-1] != length:
        raise ValueError(
            f"cu_seqlens must end at the packed length L = {length}, got {values[-1]} (cu_seqlens = {_shorten(values)})"
        )
    if packed is not None:
        remember_bounds(packed.cu_seqlens, packed.bounds)  # trusted as given (a model's, or built by hand)
        return packed
    drops = [i for i in range(len(values) - 1) if values[i + 1] < values[i]]
    if drops:
        i = drops[0]
        raise ValueError(
            f"cu_seqlens must not decrease, but cu_seqlens[{i + 1}] = {values[i + 1]} < cu_seqlens[{i}] = {values[i]}"
        )
    packed = PackedSequences(cu_seqlens.to(torch.int64), tuple(values))
    # the host copy of every validated cu_seqlens tensor still alive (ssm.native.packing), so that
    # a backend looping over the sequences in Python (sequence_bounds), or an op whose C kernel
    # reads them, has them without another host sync
    remember_bounds(packed.cu_seqlens, packed.bounds)
    return packed


def sequence_bounds(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """The values of a validated ``cu_seqlens`` on the host: kept from its validation, else read
    (one host sync)."""
    bounds = known_bounds(cu_seqlens)
    return tuple(cu_seqlens.tolist()) if bounds is None else bounds


def check_cu_seqlens(cu_seqlens, length: int, batch: int, device: torch.device) -> torch.Tensor:
    """``packed_sequences(...).cu_seqlens``: the validated boundaries as an int64 tensor."""
    return packed_sequences(cu_seqlens, length, batch, device).cu_seqlens


def _shorten(values: list) -> str:
    return (
        str(values)
        if len(values) <= 12
        else f"[{', '.join(map(str, values[:5]))}, ..., {', '.join(map(str, values[-5:]))}]"
    )
