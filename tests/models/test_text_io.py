"""Text in, text out: the tokenizer found beside the weights (tokenizer.json trained here with the
tokenizers library, special tokens from tokenizer_config.json), --tokenizer, byte-level models,
streaming, and scripts/generate.py against MambaLM.generate on the encoded prompt."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ssm import MambaConfig, MambaLM
from ssm.models.tokenizer import ByteTokenizer, TextStream, load_tokenizer, read_tokenizer_json
from tests.models.test_hub import HF_CONFIG, write_sharded

ROOT = Path(__file__).resolve().parents[2]
PARAGRAPHS = [
    "The selective state space model reads a sequence one token at a time and keeps a state whose "
    "size does not grow with the length of the text.",
    "Über die Brücke gingen zwölf Menschen; naïve café owners served crème brûlée at 日本 prices.",
    "def main(argv):\n    for line in open(argv[1]):\n        print(line.strip())\n    return 0\n",
    "A language model assigns a probability to every continuation, and sampling draws one of them.",
] * 3
VOCAB = 300  # the tokenizer's ids (256 bytes, eos, merges); the model's embedding has 320


def train_tokenizer(vocab_size: int = VOCAB) -> Tokenizer:
    """A byte-level BPE, GPT-2's scheme, trained directly with the tokenizers library."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(PARAGRAPHS, trainer)
    return tok


def model_dir(tmp_path: Path, vocab_size: int = VOCAB, eos: int | None = None) -> tuple[Path, MambaLM]:
    """transformers' sharded layout (2 shards + index), tokenizer.json and tokenizer_config.json."""
    torch.manual_seed(0)
    config = MambaConfig(d_model=32, n_layer=2, vocab_size=320, pad_vocab_size_multiple=1, ssm_cfg={"d_state": 8})
    model = MambaLM(config).eval()
    directory = tmp_path / "model"
    write_sharded(model, directory)
    (directory / "config.json").write_text(json.dumps({**HF_CONFIG, "vocab_size": 320}))
    train_tokenizer(vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>"}, "pad_token": "<pad>"})
    )
    return directory, model


def run_script(name: str, argv: list[str], capsys) -> tuple[str, str]:
    main = runpy.run_path(str(ROOT / "scripts" / name))["main"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_the_tokenizer_beside_the_weights_and_its_special_tokens(tmp_path):
    directory, _ = model_dir(tmp_path)
    tok = load_tokenizer(directory, vocab_size=320)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.eos_token_id == reference.token_to_id("<|endoftext|>") == 0
    assert tok.pad_token_id == reference.token_to_id("<pad>") == 1
    text = PARAGRAPHS[1]
    assert tok.encode(text) == reference.encode(text).ids
    assert tok.decode(tok.encode(text)) == text
    # special_tokens_map.json is read when tokenizer_config.json names nothing
    (directory / "tokenizer_config.json").unlink()
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<pad>"}))
    assert load_tokenizer(directory).eos_token_id == 1
    # byte-level BPE: every token's bytes, counted by hand from a text
    lengths = tok.token_byte_lengths()
    ids = tok.encode(text)
    assert sum(lengths[i] for i in ids) == len(text.encode("utf-8"))


def test_tokenizer_errors_name_the_file_and_the_sizes(tmp_path):
    directory, _ = model_dir(tmp_path)
    with pytest.raises(
        ValueError, match=rf"tokenizer {directory / 'tokenizer.json'} has 300 token ids, more than .* 200"
    ):
        load_tokenizer(directory, vocab_size=200)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json beside the weights .* --tokenizer"):
        load_tokenizer(tmp_path, vocab_size=320)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad.json is not a tokenizer.json"):
        read_tokenizer_json(tmp_path / "bad.json")
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"tokenizer_config.json names eos_token '</s>', which the tokenizer"):
        load_tokenizer(directory)
    assert isinstance(load_tokenizer(tmp_path, vocab_size=256), ByteTokenizer)  # our byte-level runs


ADDED = {"0": {"content": "<|endoftext|>", "special": True}, "1": {"content": "<pad>", "special": True}}


@pytest.mark.parametrize(
    "tokenizer_config,special_tokens_map,expected",
    [
        # older files (no added_tokens_decoder): the map's names replace the config's, kind by kind
        ({"eos_token": "<|endoftext|>", "pad_token": "<pad>"}, {"eos_token": "<pad>"}, {"eos": 1, "pad": 1}),
        ({"eos_token": "<pad>"}, {"pad_token": {"content": "<|endoftext|>"}}, {"eos": 1, "pad": 0}),
        # transformers >= 4.34's files: tokenizer_config.json alone, the map is not read
        (
            {"eos_token": "<|endoftext|>", "added_tokens_decoder": ADDED},
            {"eos_token": "<pad>", "pad_token": "<|endoftext|>"},
            {"eos": 0, "pad": None},
        ),
        # neither names eos: config.json's eos_token_id (0 here); the map alone names pad
        (None, {"pad_token": "<pad>"}, {"eos": 0, "pad": 1}),
    ],
)
def test_special_tokens_are_read_with_transformers_precedence(tmp_path, tokenizer_config, special_tokens_map, expected):
    directory, _ = model_dir(tmp_path)
    (directory / "tokenizer_config.json").unlink()
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    tok = load_tokenizer(directory)
    assert {"eos": tok.eos_token_id, "pad": tok.pad_token_id} == expected
    transformers = pytest.importorskip("transformers")  # the reference, where installed
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    if tokenizer_config is not None:  # (transformers' tokenizer reads no config.json)
        assert (tok.eos_token_id, tok.pad_token_id) == (theirs.eos_token_id, theirs.pad_token_id)


def test_bytes_of_a_text_holding_special_and_added_tokens(tmp_path):
    """Every token of a text stands for its bytes of the text, special tokens read from it
    included (encode adds none), so that bits per byte divide by the text's own bytes."""
    from tokenizers import AddedToken

    directory, _ = model_dir(tmp_path)
    reference = Tokenizer.from_file(str(directory / "tokenizer.json"))
    reference.add_tokens([AddedToken("naïve café", special=False)])  # non-ASCII: more bytes than characters
    reference.save(str(directory / "tokenizer.json"))
    tok = load_tokenizer(directory)
    text = PARAGRAPHS[0] + "<|endoftext|>" + PARAGRAPHS[1] + "<pad><pad>" + PARAGRAPHS[2]
    ids = tok.encode(text)
    assert {0, 1, reference.token_to_id("naïve café")} <= set(ids)  # read as the tokens, not their characters
    lengths = tok.token_byte_lengths()
    assert sum(lengths[i] for i in ids) == len(text.encode("utf-8"))
    assert lengths[0] == len(b"<|endoftext|>") and lengths[reference.token_to_id("naïve café")] == 12


def test_the_stream_pieces_join_to_the_decoded_text(tmp_path):
    tok = read_tokenizer_json(model_dir(tmp_path)[0])
    for tokenizer in (tok, ByteTokenizer()):
        ids = tokenizer.encode(PARAGRAPHS[1])
        stream = TextStream(tokenizer)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.finish() == PARAGRAPHS[1]
        assert not any("\ufffd" in p for p in pieces)  # a multi-byte character is held back until whole


def new_ids(out: str) -> list[list[int]]:
    return [[int(t) for t in line.split(":", 1)[1].split()] for line in out.splitlines() if line.startswith("ids[")]


@pytest.mark.parametrize("temperature", ["0", "0.9"])
def test_generate_script_prints_the_tokens_of_model_generate(tmp_path, capsys, temperature):
    directory, model = model_dir(tmp_path)
    tok = load_tokenizer(directory)
    prompt = "The selective state"
    argv = [str(directory), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", temperature]
    argv += ["--top-k", "50", "--top-p", "0.95", "--seed", "3", "--show-ids"]
    out, err = run_script("generate.py", argv, capsys)
    ids = torch.tensor([tok.encode(prompt)])
    expected = model.generate(
        ids,
        12,
        temperature=float(temperature),
        top_k=50,
        top_p=0.95,
        eos_token_id=0,
        generator=torch.Generator().manual_seed(3),
    )[0, ids.shape[1] :].tolist()
    expected = expected[: expected.index(0)] if 0 in expected else expected
    assert new_ids(out) == [expected]
    assert out.startswith(prompt + tok.decode(expected) + "\n")  # streamed text, prompt first
    assert "tokens/s" in err.strip().splitlines()[-1]


def test_generate_script_batches_prompts_with_left_padding(tmp_path, capsys):
    directory, model = model_dir(tmp_path)
    tok = load_tokenizer(directory)
    prompts = ["A language model assigns", "def"]
    argv = [str(directory), "--max-new-tokens", "8", "--temperature", "0", "--show-ids"]
    out, _ = run_script("generate.py", argv + [a for p in prompts for a in ("--prompt", p)], capsys)
    rows = new_ids(out)
    for prompt, row in zip(prompts, rows):  # each prompt alone, greedy: the same tokens
        ids = torch.tensor([tok.encode(prompt)])
        alone = model.generate(ids, 8, temperature=0, eos_token_id=0)[0, ids.shape[1] :].tolist()
        assert row == (alone[: alone.index(0)] if 0 in alone else alone)
        assert f"{prompt}{tok.decode(row)}\n" in out


def test_generate_script_eos_stops_and_tokenizer_override(tmp_path, capsys):
    directory, model = model_dir(tmp_path)
    tok = load_tokenizer(directory)
    ids = torch.tensor([tok.encode("def")])
    drawn = model.generate(ids, 6, temperature=1.0, generator=torch.Generator().manual_seed(5))[0, ids.shape[1] :]
    drawn = drawn.tolist()
    stop = next(k for k in range(1, 6) if drawn[k] not in drawn[:k])  # eos: a token the draws reach later
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    (directory / "tokenizer.json").rename(moved / "tokenizer.json")
    (directory / "tokenizer_config.json").unlink()
    eos = Tokenizer.from_file(str(moved / "tokenizer.json")).id_to_token(drawn[stop])
    (moved / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    argv = [str(directory), "--prompt", "def", "--max-new-tokens", "6", "--temperature", "1", "--seed", "5"]
    out, err = run_script("generate.py", argv + ["--show-ids", "--tokenizer", str(moved)], capsys)
    assert new_ids(out) == [drawn[:stop]]
    assert f"{stop} new token(s), {stop + 1} step(s) x batch 1" in err  # no step after eos
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        run_script("generate.py", argv, capsys)


def test_generate_script_on_a_byte_level_run(tmp_path, capsys):
    """A run of scripts/train.py (config.yaml and model/, no tokenizer.json): bytes, as before."""
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layer=1, vocab_size=256, ssm_cfg={"d_state": 4})).eval()
    model.save_pretrained(tmp_path / "run" / "model")
    (tmp_path / "run" / "config.yaml").write_text("data:\n  task: text\n")
    argv = [str(tmp_path / "run"), "--prompt", "héllo", "--max-new-tokens", "6", "--show-ids"]
    out, _ = run_script("generate.py", argv, capsys)
    expected = model.generate(
        torch.tensor([list("héllo".encode())]), 6, temperature=0.8, generator=torch.Generator().manual_seed(0)
    )[0, 6:].tolist()
    assert new_ids(out) == [expected]
    assert out.startswith("héllo" + bytes(expected).decode("utf-8", errors="replace"))


def test_complete_gives_each_prompt_the_text_of_generate_alone(tmp_path):
    from ssm.models.hub import complete, load_model_and_tokenizer

    directory, model = model_dir(tmp_path)
    loaded, tok, _ = load_model_and_tokenizer(directory)
    prompts = ["A language model assigns", "def", "Über die"]

    def alone(prompt):
        ids = torch.tensor([tok.encode(prompt)])
        new = model.generate(ids, 9, temperature=0, eos_token_id=0)[0, ids.shape[1] :].tolist()
        return tok.decode(new[: new.index(0)] if 0 in new else new)

    assert complete(loaded, tok, prompts[0], 9, temperature=0) == alone(prompts[0])
    assert complete(loaded, tok, prompts, 9, temperature=0) == [alone(p) for p in prompts]
    with pytest.raises(ValueError, match="complete: prompts"):
        complete(loaded, tok, [""], 3)


def fused_spy(monkeypatch) -> list[bool]:
    """Whether each generate call took the fused C step (MambaBlocksStep.prepare gave a step)."""
    from ssm.ops import decode

    prepare, taken = decode.MambaBlocksStep.prepare.__func__, []

    def spy(cls, *args, **kwargs):
        out = prepare(cls, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(decode.MambaBlocksStep, "prepare", classmethod(spy))
    return taken


@pytest.mark.parametrize(
    "flags",
    [
        ["--quantize", "int8"],
        ["--quantize", "int4"],
        ["--quantize", "int4", "--activations", "float32"],
        ["--dtype", "bfloat16"],
    ],
)
def test_generate_script_precision_flags_take_the_fused_step(tmp_path, capsys, monkeypatch, flags):
    """--quantize (with --activations) / --dtype give the tokens of model.quantize(...) (or
    .to(dtype)) + generate, decoded by the fused C step."""
    from ssm.native import library

    if library() is None:
        pytest.fail("the C library did not build: the fused low-precision step is untested")
    directory, model = model_dir(tmp_path)
    tok = load_tokenizer(directory)
    prompt = "The selective state"
    taken = fused_spy(monkeypatch)
    argv = [str(directory), "--prompt", prompt, "--max-new-tokens", "12", "--temperature", "0", "--show-ids"]
    out, err = run_script("generate.py", argv + flags, capsys)
    assert taken and all(taken), f"{flags} did not decode through the fused step"
    activations = flags[3] if len(flags) > 2 else "int8"
    quantize = flags[0] == "--quantize"
    last = err.strip().splitlines()[-1]
    assert f"{flags[1]} weights" in last and (not quantize or f"{activations} activations" in last), last
    want = model.quantize(flags[1], activations=activations) if quantize else model.to(getattr(torch, flags[1]))
    ids = torch.tensor([tok.encode(prompt)])
    expected = want.generate(ids, 12, temperature=0, eos_token_id=0)[0, ids.shape[1] :].tolist()
    assert new_ids(out) == [expected[: expected.index(0)] if 0 in expected else expected]


def test_generate_script_on_a_quantised_checkpoint(tmp_path, capsys, monkeypatch):
    """A checkpoint saved quantised loads as saved: with or without its own --quantize the same
    tokens; another scheme is an error naming the flag."""
    directory, model = model_dir(tmp_path)
    saved = tmp_path / "int8"
    model.quantize("int8").save_pretrained(saved)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (saved / name).write_bytes((directory / name).read_bytes())
    argv = [str(saved), "--prompt", "def", "--max-new-tokens", "8", "--temperature", "0", "--show-ids"]
    plain, _ = run_script("generate.py", argv, capsys)
    again, err = run_script("generate.py", argv + ["--quantize", "int8"], capsys)
    assert new_ids(plain) == new_ids(again) and "int8 weights" in err
    main = runpy.run_path(str(ROOT / "scripts" / "generate.py"))["main"]
    with pytest.raises(SystemExit):
        main(argv + ["--quantize", "int4"])
    assert "--quantize int4" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # --activations on a float checkpoint: an error naming the flag
        main([str(directory), *argv[1:], "--activations", "float32"])
    assert "--activations float32: applies to a quantised model" in capsys.readouterr().err
