"""The whole model's recurrent state during inference: one layer cache per block, and the
count of tokens seen."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layers import AttentionCache, LayerCache, Mamba3Cache


@dataclass
class InferenceCache:
    """The recurrent state of every layer plus the number of tokens seen. A Mamba layer's
    tensors keep their size as decoding proceeds (each new token costs the same); an attention
    layer's keys and values grow with the tokens seen. ``MambaLM`` advances ``seqlen_offset``:
    by L for a prefill of (batch, L) ids, by one for each step."""

    layers: list[LayerCache | Mamba3Cache | AttentionCache]
    seqlen_offset: int = 0
    batch_size: int = field(init=False)

    def __post_init__(self):
        self.batch_size = self.layers[0].batch_size if self.layers else 0

    def map(self, fn) -> InferenceCache:
        """A new cache holding ``fn(t)`` for each state tensor ``t`` of every layer (moved,
        detached, some batch rows of it...), with the same ``seqlen_offset``; this one is
        unchanged. What code above the model (training, serving) uses instead of a layer's fields."""
        return InferenceCache([layer.map(fn) for layer in self.layers], self.seqlen_offset)

    def tensors(self) -> list[list[torch.Tensor]]:
        """Every layer's state tensors, e.g. to save them; ``MambaLM.inference_cache_from`` takes
        them back."""
        return [layer.tensors() for layer in self.layers]

    def check_batch(self, batch: int, what: str = "input_ids") -> None:
        if self.batch_size != batch:
            raise ValueError(f"cache was allocated for batch size {self.batch_size}, but {what} has batch size {batch}")


def check_cache(cache, batch: int, what: str = "input_ids") -> None:
    """``cache`` is an InferenceCache for ``batch`` sequences."""
    if not isinstance(cache, InferenceCache):
        raise ValueError(f"cache must be an InferenceCache from allocate_inference_cache, got {type(cache).__name__}")
    cache.check_batch(batch, what)
