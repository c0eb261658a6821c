"""The text front door: a model and its tokenizer from one name (a model directory, a hub repo
id, or a training run's directory), and text in, text out (``complete``): what
scripts/generate.py and a newcomer's first example use.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .lm import MambaLM
from .quantize import read_quantization
from .resolve import resolve_model_dir
from .tokenizer import load_tokenizer


class QuantizationMismatch(ValueError):
    """A checkpoint saved quantised in one scheme, asked to load in another."""


def load_model_and_tokenizer(
    name_or_path,
    tokenizer=None,
    *,
    device=None,
    dtype=None,
    backend: str = "auto",
    quantize: str | None = None,
    activations: str | None = None,
):
    """(model in eval mode, tokenizer, model directory) for text in and text out. ``name_or_path``:
    a model directory, a hub repo id, or a run directory of scripts/train.py (its model/). The
    tokenizer: ``tokenizer`` when given (see ``load_tokenizer``), else the one beside the weights.
    ``quantize``: a float checkpoint is quantised as it is read (from_pretrained); one saved
    quantised in that scheme loads as saved, in another is a QuantizationMismatch (a ValueError).
    ``activations``: what a quantised model's layers multiply their integers by (from_pretrained)."""
    path = Path(name_or_path) if isinstance(name_or_path, (str, os.PathLike)) else None
    if path is not None and (path / "config.yaml").is_file() and (path / "model").is_dir():
        path = path / "model"  # a training run: its model/ holds the weights and, if any, the tokenizer
    directory = resolve_model_dir(path if path is not None and path.is_dir() else name_or_path)
    saved = read_quantization(directory)
    if quantize is not None and saved is not None:
        if saved["scheme"] != quantize:
            raise QuantizationMismatch(
                f"quantize {quantize}: {directory} is saved quantised as {saved['scheme']}; load it without quantize"
            )
        quantize = None  # as saved
    model = MambaLM.from_pretrained(
        directory, device=device, dtype=dtype, backend=backend, quantize=quantize, activations=activations
    ).eval()
    return model, load_tokenizer(directory, tokenizer, vocab_size=model.config.vocab_size), directory


def left_pad(encoded: list[list[int]], tokenizer, device=None):
    """input_ids (batch, L) with each prompt's ids at the right end, and attention_mask (batch, L):
    1 for a token, 0 for padding; None when the prompts have one length."""
    L = max(len(ids) for ids in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    input_ids = torch.tensor([[pad] * (L - len(ids)) + ids for ids in encoded], device=device)
    if all(len(ids) == L for ids in encoded):
        return input_ids, None
    mask = torch.tensor([[0] * (L - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
    return input_ids, mask


def continuation(ids: list[int], eos: int | None) -> list[int]:
    """The new ids up to (not including) the first eos."""
    return ids[: ids.index(eos)] if eos is not None and eos in ids else ids


def complete(model, tokenizer, prompts, max_new_tokens: int = 50, **sampling):
    """Text in, text out: the continuation of ``prompts`` (a string, or a list of them generated
    together as one left-padded batch), up to ``max_new_tokens`` tokens or the tokenizer's eos.
    ``sampling``: MambaLM.generate's temperature (0: greedy), top_k, top_p, generator. Returns a
    string for a string, a list for a list.

        model, tokenizer, _ = load_model_and_tokenizer("state-spaces/mamba-130m-hf")
        print(complete(model, tokenizer, "Mamba is", 30, temperature=0))
    """
    single = isinstance(prompts, str)
    texts = [prompts] if single else list(prompts)
    encoded = [tokenizer.encode(text) for text in texts]
    if not texts or any(not ids for ids in encoded):
        raise ValueError("complete: prompts must be one or more texts that each encode to at least one token")
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(encoded, tokenizer, device)
    out = model.generate(
        input_ids, max_new_tokens, eos_token_id=tokenizer.eos_token_id, attention_mask=attention_mask, **sampling
    )
    new = [tokenizer.decode(continuation(row[input_ids.shape[1] :].tolist(), tokenizer.eos_token_id)) for row in out]
    return new[0] if single else new
