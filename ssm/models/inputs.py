"""The checks of what a user hands a model: token ids, and the attention mask of left-padded
prompts. Each raises ValueError naming the argument, what was expected and what was given."""

from __future__ import annotations

import torch


def check_ids(config, input_ids, ndim: int, what: str, attention_mask=None) -> None:
    """``input_ids`` is an integer tensor of ``ndim`` dimensions whose ids (those that are
    not padding, with an ``attention_mask``) lie in the vocabulary."""
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.ndim != ndim
        or input_ids.is_floating_point()
        or input_ids.is_complex()
    ):
        got = (
            f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(f"input_ids must be an integer tensor of shape {what}, got a {got}")
    tokens = input_ids if attention_mask is None else input_ids[left_padding_mask(attention_mask, input_ids)]
    if tokens.numel():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size = {config.vocab_size}), got values in [{lo}, {hi}]")


def left_padding_mask(attention_mask, input_ids: torch.Tensor) -> torch.Tensor:
    """``attention_mask`` is (batch, L) of 0/1 with the zeros on the left and at least one 1
    per row; returned as bool."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise ValueError(f"attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got {got}")
    if attention_mask.device != input_ids.device:
        raise ValueError(f"attention_mask is on '{attention_mask.device}' but input_ids on '{input_ids.device}'")
    if attention_mask.is_floating_point() or attention_mask.is_complex():
        raise ValueError(f"attention_mask must have an integer or bool dtype, got {attention_mask.dtype}")
    if not ((attention_mask == 0) | (attention_mask == 1)).all():
        raise ValueError(
            "attention_mask must hold only 0 (padding) and 1 (token), "
            f"got the values {attention_mask.unique().tolist()}"
        )
    mask = attention_mask.bool()
    empty = (~mask.any(1)).nonzero()[:, 0].tolist()
    if empty:
        raise ValueError(f"attention_mask must keep at least one token per row; rows {empty} are all padding")
    right = (mask[:, :-1] & ~mask[:, 1:]).any(1).nonzero()[:, 0].tolist()
    if right:
        raise ValueError(
            f"attention_mask must pad on the left (0s before the 1s, as transformers does for generation); "
            f"rows {right} have a 0 after a 1"
        )
    return mask
