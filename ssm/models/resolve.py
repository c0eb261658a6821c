"""A model's name or path as a local directory (and nothing else): the path itself, or a Hugging Face hub repo id
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
