"""How well a model predicts a text: the summed cross-entropy of every token after the first,
read in windows with a stride (transformers' sliding-window perplexity) or in pieces with every
layer's state carried from one piece to the next (the whole text as one sequence, in bounded
memory). ``text_metrics`` turns the sum into perplexity (per token) and bits per byte (per byte of
the text the scored tokens stand for), which compare across tokenizers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def score_ids(model, ids: torch.Tensor, window: int, stride: int | None = None, carry: bool = False):
    """(summed cross-entropy in nats, scored tokens) of the 1-D token ids ``ids`` (N,): token i
    is scored from tokens < i, for every i >= 1.

    ``carry``: pieces of ``window`` tokens, the state carried across them: each token sees every
    token before it. Else the model reads windows of ``window`` tokens starting every ``stride``
    tokens (default ``window``: no overlap), each scoring only the tokens no earlier window
    scored, so a token sees at least ``window - stride + 1`` tokens (every one in the first window)."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.is_floating_point():
        raise ValueError(f"ids must be a 1-D integer tensor, got {getattr(ids, 'shape', type(ids).__name__)}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an int >= 2, got {window!r}")
    stride = window if stride is None else stride
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride <= window:
        raise ValueError(f"stride must be an int in [1, window = {window}], got {stride!r}")
    n = ids.numel()
    if n < 2:
        raise ValueError(f"the text must hold at least 2 tokens to score one, got {n}")
    device = next(model.parameters()).device
    ids = ids.to(device)
    nats = torch.zeros((), dtype=torch.float64, device=device)
    if carry:
        cache = model.allocate_inference_cache(1, device=device)
        for start in range(0, n - 1, window):  # the last token predicts nothing: it is never read
            piece = ids[start : min(start + window, n - 1)]
            logits = model(piece[None], cache=cache)[0]  # (piece, V): predictions of the next tokens
            nats += _cross_entropy(model, logits, ids[start + 1 : start + 1 + piece.numel()])
        return float(nats), n - 1
    scored_to, begin = 1, 0  # tokens [1, scored_to) are scored; a window reads [begin, end)
    while scored_to < n:
        end = min(begin + window, n - 1)
        logits = model(ids[begin:end][None])[0]  # row j predicts token begin + 1 + j
        first = scored_to - begin - 1  # row of the first token no window scored yet
        nats += _cross_entropy(model, logits[first:], ids[scored_to : end + 1])
        scored_to, begin = end + 1, begin + stride
    return float(nats), n - 1


def _cross_entropy(model, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed over the rows, in float64, over the model's vocabulary (its padding ids left out)."""
    logits = logits[:, : model.config.vocab_size].double()
    return F.cross_entropy(logits, targets, reduction="sum")


def text_metrics(nats: float, tokens: int, text_bytes: int) -> dict:
    """Perplexity and cross-entropy per token, bits per byte (``text_bytes``: the bytes of text the
    scored tokens stand for)."""
    return {
        "tokens": tokens,
        "bytes": text_bytes,
        "nats_per_token": nats / tokens,
        "perplexity": math.exp(nats / tokens),
        "bits_per_byte": nats / math.log(2) / text_bytes,
    }
