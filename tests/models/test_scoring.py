"""Perplexity and bits per byte of a text (ssm/models/scoring.py, scripts/evaluate.py --text):
against values computed by hand (a model that predicts the uniform distribution scores
log2(V) bits per token), and the windows and the carried state against each token scored from
its own context in a plain forward pass."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from ssm import MambaConfig, MambaLM
from ssm.models.scoring import score_ids
from tests.models.test_text_io import PARAGRAPHS, model_dir

ROOT = Path(__file__).resolve().parents[2]
TEXT = "\n\n".join(PARAGRAPHS[:4])


def run_evaluate(argv, capsys) -> dict:
    main = runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))["main"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    values = {}
    for line in out.splitlines():
        if "perplexity" in line:
            values["perplexity"] = float(line.split()[1])
        if "bits per byte" in line:
            values["bpb"] = float(line.split()[-1])
    return values


def uniform(model: MambaLM) -> MambaLM:
    """Every logit 0: each token has probability 1 / vocab_size (the padding ids are left out)."""
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model


def test_a_uniform_byte_model_scores_8_bits_per_byte(tmp_path, capsys):
    torch.manual_seed(0)
    config = MambaConfig(d_model=16, n_layer=1, vocab_size=256, tie_embeddings=False, ssm_cfg={"d_state": 4})
    uniform(MambaLM(config)).save_pretrained(tmp_path / "m")
    (tmp_path / "t.txt").write_text(TEXT)
    for extra in ([], ["--stride", "7"], ["--carried-state"]):
        values = run_evaluate(
            [str(tmp_path / "m"), "--text", str(tmp_path / "t.txt"), "--window", "64", *extra], capsys
        )
        assert values["bpb"] == pytest.approx(8.0, abs=5e-5)  # log2(256) bits for each byte
        assert values["perplexity"] == pytest.approx(256, rel=1e-4)


@pytest.mark.parametrize("special", [False, True], ids=["plain", "with special tokens"])
def test_bits_per_byte_of_a_bpe_model_by_hand(tmp_path, capsys, special):
    # with special tokens in the text, their bytes count as any other's (the text's own bytes)
    text = TEXT.replace("\n\n", "<|endoftext|>") + "<pad>" if special else TEXT
    directory, model = model_dir(tmp_path)
    model.config.tie_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(torch.zeros_like(model.lm_head.weight))
    model.save_pretrained(directory, safe_serialization=True)
    assert not list(directory.glob("model*-of-*")) + list(directory.glob("*.index.json"))  # the stale shards went
    (tmp_path / "t.txt").write_text(text)
    encoding = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text, add_special_tokens=False)
    n = len(encoding.ids)
    assert (0 in encoding.ids) == special  # <|endoftext|> read as its token
    first_token_bytes = len(text[: encoding.offsets[0][1]].encode("utf-8"))
    scored_bytes = len(text.encode("utf-8")) - first_token_bytes
    expected = (n - 1) * math.log2(320) / scored_bytes  # model vocabulary 320, uniform over it
    values = run_evaluate([str(directory), "--text", str(tmp_path / "t.txt"), "--window", "32"], capsys)
    assert values["bpb"] == pytest.approx(expected, rel=1e-4)
    assert values["perplexity"] == pytest.approx(320, rel=1e-4)
    assert expected < math.log2(320) / 1.3  # BPE tokens hold several bytes: the figure is per byte, not token


@torch.no_grad()
def token_nats(model, ids, context_start: int, target: int) -> float:
    """Cross-entropy of ids[target] from the model run on ids[context_start:target] alone."""
    logits = model(ids[context_start:target][None])[0, -1, : model.config.vocab_size].double()
    return float(F.cross_entropy(logits[None], ids[target][None]))


def test_windows_and_carried_state_score_each_token_from_its_context():
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layer=2, vocab_size=50, ssm_cfg={"d_state": 4})).double().eval()
    ids = torch.randint(0, 50, (10,), generator=torch.Generator().manual_seed(2))
    whole = sum(token_nats(model, ids, 0, t) for t in range(1, 10))
    for window in (3, 4, 20):
        nats, count = score_ids(model, ids, window, carry=True)
        assert count == 9 and nats == pytest.approx(whole, rel=1e-9)
    assert score_ids(model, ids, 20)[0] == pytest.approx(whole, rel=1e-9)
    # window 4, stride 2: windows read [0, 4), [2, 6), [4, 8), [6, 9); each scores what is new
    by_hand = [(0, 1), (0, 2), (0, 3), (0, 4), (2, 5), (2, 6), (4, 7), (4, 8), (6, 9)]
    expected = sum(token_nats(model, ids, start, t) for start, t in by_hand)
    nats, count = score_ids(model, ids, 4, stride=2)
    assert count == 9 and nats == pytest.approx(expected, rel=1e-9)
    assert nats != pytest.approx(whole, rel=1e-6)  # the windows' shorter contexts show
    with pytest.raises(ValueError, match=r"stride must be an int in \[1, window = 4\], got 5"):
        score_ids(model, ids, 4, stride=5)
