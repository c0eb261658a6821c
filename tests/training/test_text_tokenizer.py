"""Text training on tokens: data.tokenizer (bytes | a tokenizer.json | bpe:SIZE), bits per byte
(not per token) against values computed by hand, the tokenizer saved beside the run's weights
for generate.py and evaluate.py, and carried-state training with gradient accumulation against
the same rows without it."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.models.tokenizer import read_tokenizer_json
from ssm.training import load_config, train
from ssm.training.config import DataSection
from ssm.training.data import IGNORE, TaskDataModule
from ssm.training.evaluate import evaluate, evaluate_carried_state

ROOT = Path(__file__).resolve().parents[2]
# ASCII, so that any run of tokens decodes to exactly its bytes
PARAGRAPHS = [
    "The selective state space model reads a sequence one token at a time and keeps a state. ",
    "A language model assigns a probability to every continuation; sampling draws one of them. ",
    "def main(argv):\n    for line in open(argv[1]):\n        print(line.strip())\n    return 0\n",
    "Bits per byte compare models whose tokens differ, where the loss per token does not. ",
]


def corpus(tmp_path: Path, files: int = 6) -> str:
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    for k in range(files):
        (folder / f"f{k}.txt").write_text("".join(PARAGRAPHS[(k + j) % 4] for j in range(8)))
    return str(folder / "*.txt")


def uniform_model(vocab: int) -> MambaLM:
    """Every logit 0: each of the padded_vocab_size ids is equally likely."""
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=16, n_layer=1, vocab_size=vocab, tie_embeddings=False, ssm_cfg={"d_state": 4}))
    with torch.no_grad():
        model.lm_head.weight.zero_()
    return model.eval()


def test_bits_per_byte_of_evaluate_by_hand(tmp_path):
    data = TaskDataModule(DataSection(task="text", paths=[corpus(tmp_path)], seq_len=32, batch_size=4, val_samples=8))
    m = evaluate(uniform_model(256), data)
    assert m["val/bpb"] == pytest.approx(8.0, abs=1e-5)  # log2(256) for every byte
    carried = evaluate_carried_state(uniform_model(256), data, segments=3)
    assert carried["bpb_carried"] == pytest.approx(8.0, abs=1e-5)
    assert carried["bpb_fresh"] == pytest.approx(8.0, abs=1e-5)

    # A BPE of 304 ids: log2(304) bits per token, over the bytes those tokens decode to.
    bpe = TaskDataModule(
        DataSection(task="text", paths=[corpus(tmp_path)], seq_len=32, batch_size=4, val_samples=8, tokenizer="bpe:304")
    )
    assert bpe.vocab_size == 304
    m = evaluate(uniform_model(304), bpe)
    tokens, text_bytes = 0, 0
    for _, targets, *_ in bpe.val_dataloader():
        for row in targets:
            ids = row[row != IGNORE].tolist()
            tokens += len(ids)
            text_bytes += len(bpe.tokenizer.tokenizer.decode(ids).encode("utf-8"))  # the tokenizers library's own
    assert text_bytes > 1.5 * tokens  # several bytes per token: per byte and per token differ
    assert m["val/bpb"] == pytest.approx(tokens * math.log2(304) / text_bytes, rel=1e-5)


def test_tokenizer_option_errors(tmp_path):
    paths = [corpus(tmp_path)]
    with pytest.raises(ValueError, match=r"bpe:SIZE needs an integer SIZE >= 257"):
        TaskDataModule(DataSection(task="text", paths=paths, tokenizer="bpe:12"))
    with pytest.raises(ValueError, match=r"data.tokenizer must be 'bytes', 'bpe:SIZE' or a path .* 'nope.json'"):
        TaskDataModule(DataSection(task="text", paths=paths, tokenizer="nope.json"))
    with pytest.raises(ValueError, match=r"data.tokenizer applies to data.task: text"):
        TaskDataModule(DataSection(task="induction_heads", tokenizer="bpe:300"))


TINY = [
    "model.d_model=16",
    "model.n_layer=1",
    "model.ssm_cfg={layer: Mamba1, d_state: 4}",
    "data.task=text",
    "data.seq_len=16",
    "data.val_samples=8",
    "progress_bar=false",
    "trainer.val_check_interval=100",
    "trainer.accelerator=cpu",
]


def test_a_bpe_run_saves_its_tokenizer_for_generate_and_evaluate(tmp_path, capsys):
    pattern = corpus(tmp_path)
    args = TINY + [f"data.paths=[{pattern}]", "data.tokenizer=bpe:300", "data.batch_size=2", "trainer.max_steps=2"]
    result = train(load_config(None, args + [f"run_dir={tmp_path / 'run'}"]))
    model_dir = result.run_dir / "model"
    tokenizer = read_tokenizer_json(model_dir)
    assert tokenizer.vocab_size == 300 and tokenizer.eos_token_id is not None
    assert load_config(result.run_dir / "config.yaml").model.vocab_size == 300
    assert result.metrics["val/bpb"] < result.metrics["val/loss"] / math.log(2)  # per byte, not per token
    capsys.readouterr()
    generate = runpy.run_path(str(ROOT / "scripts" / "generate.py"))["main"]
    assert generate([str(result.run_dir), "--prompt", "The state", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("The state")
    (tmp_path / "t.txt").write_text(PARAGRAPHS[0] * 3)
    evaluate_script = runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))["main"]
    assert evaluate_script([str(result.run_dir), "--text", str(tmp_path / "t.txt"), "--window", "16"]) == 0
    assert "bits per byte" in capsys.readouterr().out


def final_weights(run_dir: Path) -> dict:
    return MambaLM.from_pretrained(run_dir / "model").state_dict()


def test_carried_state_with_gradient_accumulation_equals_the_same_rows_without(tmp_path):
    """Stateful text training: 2 micro-batches of 2 rows per step give the weights of 1 batch of
    4 rows (the same streams: each micro-batch carries its own rows' state). Float64; the files
    are one stream (no packed documents), so each micro-batch scores the same number of tokens
    and the mean of the micro-batch means is the mean over the 4 rows."""
    pattern = corpus(tmp_path)
    common = TINY + [
        f"data.paths=[{pattern}]",
        "data.stateful=true",
        "data.pack_documents=false",
        "trainer.precision=64-true",
        "trainer.max_steps=4",
        "optim.warmup_steps=1",
    ]
    plain = train(load_config(None, common + ["data.batch_size=4", f"run_dir={tmp_path / 'plain'}"]))
    accumulated = train(
        load_config(
            None,
            common + ["data.batch_size=2", "trainer.accumulate_grad_batches=2", f"run_dir={tmp_path / 'acc'}"],
        )
    )
    a, b = final_weights(plain.run_dir), final_weights(accumulated.run_dir)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-9, atol=1e-11, msg=lambda m: f"{key}: {m}")
