"""A model's name or path as a local directory: the path itself, or a Hugging Face hub repo id
(``state-spaces/mamba-130m-hf``) fetched, or found in the local hub cache, by ``huggingface_hub``
(an optional dependency: the ``hub`` extras).

Only the files a model and its tokenizer need are fetched: the JSON files (config, shard index,
tokenizer, special tokens) and the weights in one format, safetensors when the repo has them,
else pytorch_model*.bin. With HF_HUB_OFFLINE=1 (or ``local_files_only``) nothing touches the
network and the cache must hold the repo.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

_INSTALL = 'pip install "ssm-scan[hub]" (or pip install huggingface_hub)'
_METADATA = ["*.json", "*.txt", "*.model"]  # config, index, tokenizer files; vocab / merges / sentencepiece


def _import_hub():
    try:
        return importlib.import_module("huggingface_hub")
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != "huggingface_hub":
            raise
        return None


def looks_like_repo_id(name: str) -> bool:
    """``owner/name`` or ``name``: letters, digits, - _ . only, at most one slash, no leading dot."""
    parts = name.split("/")
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    return (
        1 <= len(parts) <= 2
        and all(p and set(p) <= allowed and not p.startswith(".") and ".." not in p for p in parts)
        and len(name) <= 96
    )


def resolve_model_dir(
    name_or_path, revision: str | None = None, local_files_only: bool | None = None, weights: bool = True
) -> Path:
    """A local directory holding config.json and weights: ``name_or_path`` when it is a
    directory, else the snapshot of that hub repo (downloaded, or read from the hub cache when
    offline). ``weights=False``: only the repo's JSON and text files (a tokenizer's).
    Raises FileNotFoundError naming both places looked in when neither has it."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"name_or_path must be a directory or a hub repo id (str), got {type(name_or_path).__name__}")
    path = Path(name_or_path)
    if path.is_dir():
        return path
    name = os.fspath(name_or_path)
    not_a_dir = f"{name!r} is not a local directory ({path.absolute()} does not exist)"
    if path.exists():
        raise FileNotFoundError(f"{name!r} is a file; from_pretrained needs a model directory or a hub repo id")
    if not looks_like_repo_id(name):
        raise FileNotFoundError(f"{not_a_dir}, and it is not a hub repo id of the form owner/name")
    hub = _import_hub()
    if hub is None:
        raise FileNotFoundError(
            f"{not_a_dir}; to load it as a Hugging Face hub repo id, install huggingface_hub: {_INSTALL}"
        )
    try:
        return _snapshot(hub, name, revision, local_files_only, weights)
    except Exception as err:  # the hub's errors: offline without a cache, no such repo, network down
        offline = local_files_only or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
        where = "the local hub cache (HF_HUB_OFFLINE is set)" if offline else "the Hugging Face hub"
        raise FileNotFoundError(
            f"{not_a_dir}, and {where} could not provide the repo {name!r}"
            f"{'' if revision is None else f' at revision {revision!r}'}: {type(err).__name__}: {err}"
        ) from err


def _snapshot(hub, repo_id: str, revision, local_files_only, weights: bool) -> Path:
    kw = dict(revision=revision, local_files_only=bool(local_files_only))
    if not weights:
        return Path(hub.snapshot_download(repo_id, allow_patterns=_METADATA, **kw))
    folder = Path(hub.snapshot_download(repo_id, allow_patterns=_METADATA + ["*.safetensors"], **kw))
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"the snapshot {folder} has no config.json")
    if not any(folder.glob("*.safetensors")):  # only pickled weights in this repo
        folder = Path(hub.snapshot_download(repo_id, allow_patterns=_METADATA + ["pytorch_model*.bin"], **kw))
    return folder


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
    from .lm import MambaLM
    from .quantize import read_quantization
    from .tokenizer import load_tokenizer

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
    import torch

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
