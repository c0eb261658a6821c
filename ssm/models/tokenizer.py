"""Text <-> token ids for the models: bytes (this library's own text runs, vocabulary 256), or a
``tokenizer.json`` read by the ``tokenizers`` library (what transformers' fast tokenizers are; an
optional dependency, the ``hub`` extras), with its special tokens from tokenizer_config.json /
special_tokens_map.json / config.json beside it, read with transformers' precedence.

``load_tokenizer(model_dir, override)`` finds the one that goes with a model directory;
``train_bpe`` trains a byte-level BPE (data.tokenizer: bpe:SIZE); ``TextStream`` turns ids into
text as they are decoded, holding back a character whose bytes have not all arrived.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from .resolve import resolve_model_dir

TOKENIZER_FILE = "tokenizer.json"
_INSTALL = 'pip install "ssm-scan[hub]" (or pip install tokenizers)'
BYTES_VOCAB = 256


def _tokenizers(needed_by: str):
    try:
        return importlib.import_module("tokenizers")
    except ImportError as err:
        if err.name is not None and err.name.split(".")[0] != "tokenizers":
            raise
        raise ImportError(f"{needed_by} needs the tokenizers library, which is not installed: {_INSTALL}") from err


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: the tokenizer of this library's byte-level text runs."""

    vocab_size = BYTES_VOCAB
    eos_token_id = None
    pad_token_id = None
    source = "bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> list[int]:
        return [1] * BYTES_VOCAB


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` (tokenizer.json) with its eos / pad / bos token ids."""

    def __init__(self, tokenizer, source: str, special: dict[str, int | None] | None = None):
        self.tokenizer, self.source = tokenizer, source
        special = special or {}
        self.eos_token_id = special.get("eos")
        self.pad_token_id = special.get("pad")
        self.bos_token_id = special.get("bos")
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_byte_lengths(self) -> list[int]:
        """How many bytes of text each token id stands for: an added token (special ones such as
        <|endoftext|> included) the UTF-8 bytes of its text, since ``encode`` reads it from the
        text (it adds none of its own), so that bits per byte count every byte of a text that
        holds one; a byte-level BPE token its characters (one per byte); any other token the
        bytes of it decoded alone."""
        added = {i: t.content for i, t in self.tokenizer.get_added_tokens_decoder().items()}
        byte_level = type(self.tokenizer.decoder).__name__ == "ByteLevel"
        lengths = []
        for i in range(self.vocab_size):
            token = self.tokenizer.id_to_token(i)
            if i in added:
                lengths.append(len(added[i].encode("utf-8")))
            elif token is None:
                lengths.append(0)
            elif byte_level:
                lengths.append(len(token))
            else:
                lengths.append(len(self.tokenizer.decode([i], skip_special_tokens=False).encode("utf-8")))
        return lengths

    def save(self, directory) -> None:
        """tokenizer.json and, for eos / pad, special_tokens_map.json into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / TOKENIZER_FILE))
        names = {"eos_token": self.eos_token_id, "pad_token": self.pad_token_id, "bos_token": self.bos_token_id}
        special = {k: self.tokenizer.id_to_token(v) for k, v in names.items() if v is not None}
        if special:
            (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


def _special_tokens(directory: Path, tokenizer) -> dict[str, int | None]:
    """eos / pad / bos ids, as transformers reads them: from tokenizer_config.json alone when it
    holds "added_tokens_decoder" (what transformers >= 4.34 writes; special_tokens_map.json is
    then not read); otherwise from special_tokens_map.json, then, for a kind it does not name,
    tokenizer_config.json (older files: the map's names replace the config's). Each names a
    token's text, or {"content": text}. A kind none of them names comes from config.json
    (eos_token_id ...)."""
    found: dict[str, int | None] = {"eos": None, "pad": None, "bos": None}
    config_path, map_path = directory / "tokenizer_config.json", directory / "special_tokens_map.json"
    config = _read_json(config_path) if config_path.is_file() else None
    sources = []
    if config is None or "added_tokens_decoder" not in config:
        sources += [(map_path, _read_json(map_path))] if map_path.is_file() else []
    sources += [(config_path, config)] if config is not None else []
    for path, raw in sources:
        for kind in found:
            value = raw.get(f"{kind}_token")
            if isinstance(value, dict):
                value = value.get("content")
            if found[kind] is None and isinstance(value, str):
                token_id = tokenizer.token_to_id(value)
                if token_id is None:
                    raise ValueError(f"{path} names {kind}_token {value!r}, which the tokenizer does not know")
                found[kind] = token_id
    if (directory / "config.json").is_file():
        raw = _read_json(directory / "config.json")
        for kind in found:
            value = raw.get(f"{kind}_token_id")
            if found[kind] is None and isinstance(value, int) and not isinstance(value, bool):
                found[kind] = value
    return found


def read_tokenizer_json(path) -> HFTokenizer:
    """``path``: a tokenizer.json, or a directory holding one (and its special-token files)."""
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a {TOKENIZER_FILE} file or a directory holding one")
    tokenizers = _tokenizers(f"the tokenizer {file}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises its own Exception subclass
        raise ValueError(f"{file} is not a tokenizer.json the tokenizers library can read: {err}") from err
    return HFTokenizer(tokenizer, str(file), _special_tokens(file.parent, tokenizer))


def load_tokenizer(model_dir, override=None, vocab_size: int | None = None):
    """The tokenizer of the model in ``model_dir``: ``override`` when given ("bytes", a
    tokenizer.json, a directory holding one, or a hub repo id), else the tokenizer.json beside
    the weights, else bytes when the model's vocabulary is 256 (this library's byte-level runs).
    ``vocab_size``: the model's; a tokenizer with more ids than that is refused."""
    if override is not None:
        if override == "bytes":
            tokenizer = ByteTokenizer()
        elif Path(override).exists():
            tokenizer = read_tokenizer_json(override)
        else:
            tokenizer = read_tokenizer_json(resolve_model_dir(override, weights=False))
    elif model_dir is not None and (Path(model_dir) / TOKENIZER_FILE).is_file():
        tokenizer = read_tokenizer_json(model_dir)
    elif vocab_size == BYTES_VOCAB:
        tokenizer = ByteTokenizer()
    else:
        raise FileNotFoundError(
            f"no {TOKENIZER_FILE} beside the weights in {model_dir}, and the model's vocabulary ({vocab_size}) is "
            "not bytes (256): give one with --tokenizer PATH (a tokenizer.json, its directory or a hub repo id; "
            "mamba-ssm's checkpoints use GPT-NeoX's: --tokenizer EleutherAI/gpt-neox-20b)"
        )
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size} token ids, more than the model's "
            f"vocabulary ({vocab_size}): ids from {vocab_size} on have no embedding; it is not this model's tokenizer"
        )
    return tokenizer


def train_bpe(texts, vocab_size: int, eos_token: str = "<|endoftext|>") -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` ids (256 bytes, ``eos_token``, then merges) trained on
    the strings ``texts`` with the tokenizers library, GPT-2's scheme: any text encodes."""
    tokenizers = _tokenizers("data.tokenizer: bpe:SIZE")
    min_size = BYTES_VOCAB + 1
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < min_size:
        raise ValueError(f"vocab_size must be an int >= {min_size} (the 256 bytes and eos), got {vocab_size!r}")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, f"byte-level BPE ({vocab_size})", {"eos": tok.token_to_id(eos_token)})


class TextStream:
    """The text of a growing list of ids, handed out piece by piece: ``push(id)`` returns the
    text that id completes ('' while a character's bytes are incomplete), ``finish()`` the rest.
    The pieces joined are ``tokenizer.decode`` of all the ids."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.emitted = tokenizer, [], ""

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""  # a character cut between tokens, or a decoder that rewrites earlier text
        piece, self.emitted = text[len(self.emitted) :], text
        return piece

    def finish(self) -> str:
        text = self.tokenizer.decode(self.ids)
        piece = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text
        return piece
