"""The recurrent state one mixer layer carries between calls during inference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..scan import PackedSequences, packed_sequences


class _StateTensors:
    """What every layer cache offers the layers above it, whatever its fields: its tensors as a
    list, the same cache with other tensors in their places, and ``map``."""

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def replace(self, tensors: list[torch.Tensor]):
        raise NotImplementedError

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        """A cache of the same kind holding ``fn(t)`` for each of this one's tensors ``t``
        (e.g. moved to a device, detached, a subset of the batch rows); this one is unchanged."""
        return self.replace([fn(t) for t in self.tensors()])


@dataclass
class LayerCache(_StateTensors):
    """conv_state: the last K inputs of the causal convolution (batch, channels, K);
    ssm_state: the SSM state h, float32 — (batch, D, N) for Mamba, (batch, H, P, N) for Mamba2.
    Both keep their size however many tokens have been seen: decoding is O(1) per token."""

    conv_state: torch.Tensor
    ssm_state: torch.Tensor

    @classmethod
    def zeros(cls, batch: int, conv1d: torch.nn.Conv1d, state_shape: tuple, dtype=None, device=None) -> LayerCache:
        """An empty history for a mixer whose causal convolution is ``conv1d`` and whose SSM
        state is (batch, *state_shape); the conv state takes ``dtype`` (default: conv1d's)."""
        device = device or conv1d.weight.device
        channels, kernel = conv1d.weight.shape[0], conv1d.weight.shape[-1]
        return cls(
            conv_state=torch.zeros(batch, channels, kernel, device=device, dtype=dtype or conv1d.weight.dtype),
            ssm_state=torch.zeros(batch, *state_shape, device=device, dtype=torch.float32),
        )

    @property
    def batch_size(self) -> int:
        return self.conv_state.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv_state, self.ssm_state]

    def replace(self, tensors: list[torch.Tensor]) -> LayerCache:
        return LayerCache(*tensors)

    def check_batch(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(
                f"cache was allocated for batch size {self.batch_size}, but the input has batch size {batch}"
            )


def check_packing(cu_seqlens, x: torch.Tensor) -> PackedSequences | None:
    """``cu_seqlens`` (a tensor, or a ``PackedSequences`` a model validated already) for x
    (1, L, d_model), validated once (``ssm.scan.packed_sequences``), or None."""
    if cu_seqlens is None:
        return None
    return packed_sequences(cu_seqlens, x.shape[1], x.shape[0], x.device)


def check_sequence(name: str, x: torch.Tensor, d_model: int) -> None:
    """x is (batch, L, d_model)."""
    if not isinstance(x, torch.Tensor) or x.ndim != 3 or x.shape[-1] != d_model:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape (batch, L, d_model) with d_model = {d_model}, got {got}")


def check_token(name: str, x: torch.Tensor, d_model: int) -> torch.Tensor:
    """x is (batch, d_model) or (batch, 1, d_model); returned as (batch, d_model)."""
    if isinstance(x, torch.Tensor) and x.ndim == 3 and x.shape[1] == 1:
        x = x[:, 0]
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[-1] != d_model:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(
            f"{name} must have shape (batch, d_model) or (batch, 1, d_model) with d_model = {d_model}, got {got}"
        )
    return x


@dataclass
class Mamba3Cache(_StateTensors):
    """The recurrent state of a Mamba-3 mixer: ``state`` is a TrapezoidalState (phase
    (batch, H, M) kept modulo 2π, ssm (batch, H, P, N), the last rotated key (batch, H, N) or
    (batch, R, H, N) with MIMO, the last input x (batch, H, P)), all float32 (float64 for a
    float64 model). Its size does not grow with the tokens seen."""

    state: tuple

    @property
    def batch_size(self) -> int:
        return self.state[1].shape[0]

    def tensors(self) -> list[torch.Tensor]:
        return list(self.state)

    def replace(self, tensors: list[torch.Tensor]) -> Mamba3Cache:
        return Mamba3Cache(type(self.state)(*tensors))

    def check_batch(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(
                f"cache was allocated for batch size {self.batch_size}, but the input has batch size {batch}"
            )


@dataclass
class AttentionCache(_StateTensors):
    """What an attention mixer keeps between calls: the keys and values of every token seen,
    key and value (batch, C, Hk, P) with C >= the longest row (the capacity; it grows as tokens
    arrive), ``lengths`` (batch,) int64 the tokens each row holds (rows may differ: packed
    prefills, left-padded prompts), and, with a convolution (d_conv > 0), ``conv_state``
    (batch, channels, K) as the Mamba layers keep it. Unlike theirs, its size grows with the
    tokens seen: a decoding step reads every cached key."""

    key: torch.Tensor
    value: torch.Tensor
    lengths: torch.Tensor
    conv_state: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.key.shape[0]

    def tensors(self) -> list[torch.Tensor]:
        extra = [] if self.conv_state is None else [self.conv_state]
        return [self.key, self.value, self.lengths, *extra]

    def replace(self, tensors: list[torch.Tensor]) -> AttentionCache:
        return AttentionCache(*tensors)

    def check_batch(self, batch: int) -> None:
        if batch != self.batch_size:
            raise ValueError(
                f"cache was allocated for batch size {self.batch_size}, but the input has batch size {batch}"
            )
