"""Generation: drawing tokens from logits, and the decoding loop of ``MambaLM.generate`` (one
prefill of the prompts, then one cached step per token).

It drives the model through its public methods (``allocate_inference_cache``, ``prefill``,
``decoding_step``); it never imports the model.
"""

from __future__ import annotations

import math

import torch

from .inputs import check_ids


def check_sampling(temperature, top_k, top_p, eos_token_id, vocab_size) -> None:
    if (
        not isinstance(temperature, (int, float))
        or isinstance(temperature, bool)
        or temperature < 0
        or not math.isfinite(temperature)
    ):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a number in (0, 1], got {top_p!r}")
    if eos_token_id is not None and not (isinstance(eos_token_id, int) and 0 <= eos_token_id < vocab_size):
        raise ValueError(f"eos_token_id must be None or a token id in [0, {vocab_size}), got {eos_token_id!r}")


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token id per row of logits (batch, V): greedy for temperature 0, else sampled from
    softmax(logits / temperature) restricted to the top_k tokens and to the top_p nucleus."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens before it already reach top_p (the first one always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(
    model,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | None = None,
    generator: torch.Generator | None = None,
    attention_mask: torch.Tensor | None = None,
    on_token=None,
) -> torch.Tensor:
    """See ``MambaLM.generate``."""
    check_ids(model.config, input_ids, 2, "(batch, L)", attention_mask)
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids must hold at least one token per sequence, got L = 0")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    vocab_size = model.config.vocab_size
    check_sampling(temperature, top_k, top_p, eos_token_id, vocab_size)
    if max_new_tokens == 0:
        return input_ids.clone()
    cache = model.allocate_inference_cache(
        input_ids.shape[0], device=input_ids.device, max_seqlen=input_ids.shape[1] + max_new_tokens
    )
    logits = model.prefill(input_ids, cache, attention_mask=attention_mask)  # (batch, V)
    step = model.decoding_step(cache)
    tokens = [input_ids]
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        next_ids = sample(logits[:, :vocab_size], temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            next_ids = next_ids.masked_fill(done, eos_token_id)
            done |= next_ids == eos_token_id
        tokens.append(next_ids[:, None])
        if on_token is not None:
            on_token(next_ids)
        if i + 1 == max_new_tokens or bool(done.all()):
            break
        logits = step(next_ids)
    return torch.cat(tokens, dim=1)
