"""Length evaluation (ssm/training/evaluate.py, scripts/evaluate.py --lengths): the chunked
path with the state carried across pieces gives the logits of one plain forward pass, and
memory does not grow with the length when chunked."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest
import torch

from ssm import MambaLM
from ssm.models import MambaConfig
from ssm.training import load_config, train
from ssm.training.config import DataSection
from ssm.training.data import SELECTION_SPLIT, TEST_SPLIT, TaskDataModule
from ssm.training.evaluate import evaluate_length, peak_rss_bytes, peak_rss_reset, scored_suffix_metrics
from ssm.training.module import scored_token_metrics

ROOT = Path(__file__).resolve().parents[2]


def tiny_model(vocab: int, seed: int = 0) -> MambaLM:
    """A random model whose Δ is large enough that tokens thousands of steps back still move
    the last logits (so that a dropped state shows)."""
    torch.manual_seed(seed)
    config = MambaConfig(
        d_model=16, n_layer=2, vocab_size=vocab, ssm_cfg={"layer": "Mamba1", "d_state": 4, "dt_max": 0.01}
    )
    return MambaLM(config).eval()


def examples(task: str, length: int, n: int, **kw):
    data = TaskDataModule(DataSection(task=task, seq_len=length, num_tokens=16, **kw), seed=3)
    ds = data.dataset(TEST_SPLIT, n, length)
    inputs, targets = (torch.stack(t) for t in zip(*[ds[i] for i in range(n)]))
    return data, inputs, targets


@pytest.mark.parametrize(
    "task, kw", [("induction_heads", {}), ("selective_copying", {"num_memorize": 300})]
)  # 300 scored tokens: the scored suffix itself spans several pieces
def test_chunked_equals_one_pass_equals_plain_forward(task, kw):
    data, inputs, targets = examples(task, 3000, 3, **kw)
    model = tiny_model(data.vocab_size)
    with torch.no_grad():
        plain = scored_token_metrics(model(inputs), targets)  # every logit, no cache: independent of the code tested
    one_pass = scored_suffix_metrics(model, inputs, targets, chunk=None)
    for chunk in (1000, 257, 4096):  # even, uneven, longer than the sequence
        chunked = scored_suffix_metrics(model, inputs, targets, chunk=chunk)
        assert chunked[2] == one_pass[2] == plain[2] == (3 if task == "induction_heads" else 900)
        torch.testing.assert_close(chunked[0], plain[0], rtol=1e-5, atol=1e-5)
        assert int(chunked[1]) == int(plain[1])
    torch.testing.assert_close(one_pass[0], plain[0], rtol=1e-5, atol=1e-5)


def test_a_dropped_state_would_be_caught(monkeypatch):
    """The check above fails when the carried state is lost between pieces: the same model read
    in pieces that each start from a zero state gives another loss."""
    data, inputs, targets = examples("induction_heads", 3000, 3)
    model = tiny_model(data.vocab_size)
    with torch.no_grad():
        plain = scored_token_metrics(model(inputs), targets)
    forward = model.forward

    def forgetful(input_ids, cache=None, **kw):  # the planted bug: each piece starts from zeros
        if cache is not None:
            for layer in cache.layers:
                layer.conv_state.zero_()
                layer.ssm_state.zero_()
        return forward(input_ids, cache=cache, **kw)

    monkeypatch.setattr(model, "forward", forgetful)
    dropped = scored_suffix_metrics(model, inputs, targets, chunk=1000)
    assert not torch.allclose(dropped[0], plain[0], rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    torch.testing.assert_close(scored_suffix_metrics(model, inputs, targets, chunk=1000)[0], plain[0])


def test_chunked_memory_does_not_grow_with_length():
    if not peak_rss_reset() or peak_rss_bytes() is None:
        pytest.skip("peak resident memory cannot be reset on this system")
    data, inputs, targets = examples("induction_heads", 2**17, 4)
    model = tiny_model(data.vocab_size)
    # one pass: in_proj alone is 4 x 2^17 x 64 floats = 128 MiB; in pieces of 2048, 2 MiB
    scored_suffix_metrics(model, inputs[:, :4096], targets[:, :4096], chunk=2048)  # warm up
    peak_rss_reset()
    base = peak_rss_bytes()
    scored_suffix_metrics(model, inputs, targets, chunk=2048)
    grown = peak_rss_bytes() - base
    assert grown < 48 * 2**20, f"chunked evaluation at L = 2^17 grew the peak by {grown / 2**20:.0f} MiB"


def test_evaluate_length_reads_the_test_split():
    data, _, _ = examples("induction_heads", 64, 1)
    model = tiny_model(data.vocab_size)
    m = evaluate_length(model, data, 64, samples=10, batch_size=4, chunk=16)
    assert m["samples"] == m["scored"] == 10 and 0 <= m["correct"] <= 10 and m["seconds"] > 0
    assert not torch.equal(data.dataset(TEST_SPLIT, 1, 64)[0][0], data.dataset("val", 1, 64)[0][0])
    assert not torch.equal(data.dataset(TEST_SPLIT, 1, 64)[0][0], data.dataset("train", 1, 64)[0][0])
    assert not torch.equal(data.dataset(TEST_SPLIT, 1, 64)[0][0], data.dataset(SELECTION_SPLIT, 1, 64)[0][0])


def test_last_position_accuracy_of_parity_against_a_plain_forward():
    """last/acc counts the sequences whose final position (the parity of every bit) the model
    gets right: against the argmax of one plain forward pass at the last position and a parity
    computed here from the bits; val/acc scores every position."""
    data = TaskDataModule(DataSection(task="parity", seq_len=40), seed=5)
    ds = data.dataset(TEST_SPLIT, 23, 40)
    inputs = torch.stack([ds[i][0] for i in range(23)])
    parity = inputs.sum(1) % 2  # the last target, from the bits alone
    model = tiny_model(data.vocab_size, seed=3)
    with torch.no_grad():
        predicted = model(inputs).argmax(-1)
    expected = int((predicted[:, -1] == parity).sum())
    # a random model whose answers move from one position to the next, neither all right nor all
    # wrong: so that reading another position, or miscounting, shows
    assert 0 < expected < 23 and (predicted[:, -1] != predicted[:, -2]).sum() > 5
    m = evaluate_length(model, data, 40, samples=23, batch_size=5, chunk=16)
    assert m["last/acc"] == expected / 23
    assert m["scored"] == 23 * 40


def test_evaluate_script_lengths(tmp_path, capsys):
    main = runpy.run_path(str(ROOT / "scripts" / "evaluate.py"))
    assert main["parse_lengths"]("2^4..2^6,100") == [16, 32, 64, 100]
    assert main["default_samples"](2**14) == 1024 and main["default_samples"](2**15) == 64
    overrides = [
        "model.d_model=16",
        "model.n_layer=1",
        "model.ssm_cfg={layer: Mamba1, d_state: 4}",
        "data.task=induction_heads",
        "data.seq_len=16",
        "data.batch_size=4",
        "data.val_samples=8",
        "trainer.max_steps=2",
        "progress_bar=false",
        f"run_dir={tmp_path / 'run'}",
    ]
    train(load_config(None, overrides))
    args = [str(tmp_path / "run"), "--lengths", "2^4..2^6", "--samples", "5", "--chunk", "24"]
    assert main["main"](args) == 0
    rows = json.loads((tmp_path / "run" / "extrapolation.json").read_text())
    assert [r["length"] for r in rows] == [16, 32, 64] and all(r["samples"] == 5 for r in rows)
    assert (tmp_path / "run" / "extrapolation.png").is_file()
    assert "peak MiB" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a misspelt split is refused, not read as another stream
        main["main"]([*args, "--split", "valid"])
    assert main["main"]([*args, "--split", "val"]) == 0
    assert "; val split," in capsys.readouterr().out
    assert main["main"]([*args[:2], "2^5", "--samples", "6", "--per-sequence"]) == 0
    sequences = json.loads((tmp_path / "run" / "per_sequence.json").read_text())
    (records,) = sequences.values()
    assert list(sequences) == ["32"] and [r["index"] for r in records] == list(range(6))
    missed = sum(not r["correct"] for r in records)
    assert (f"L 32: {missed} of 6 sequences missed" in capsys.readouterr().out) == (missed > 0)


@pytest.mark.parametrize("task, kw", [("induction_heads", {}), ("selective_copying", {"num_memorize": 4})])
def test_per_sequence_records_agree_with_the_totals_and_the_data(task, kw):
    """evaluate_length(per_sequence=True): one record per test sequence, in split order; the
    records' right answers add up to the total; each record's targets are the example's own
    (drawn again from the dataset); an induction-heads record's key is the token after the
    first trigger and its gap the tokens between key and final trigger; the probability is the
    softmax of a plain forward pass's logits at the target."""
    data, _, _ = examples(task, 48, 1, **kw)
    model = tiny_model(data.vocab_size)
    m = evaluate_length(model, data, 48, samples=7, batch_size=3, chunk=16, per_sequence=True)
    records = m["sequences"]
    assert [r["index"] for r in records] == list(range(7))
    per_position = sum(sum(int(a == b) for a, b in zip(r["targets"], r["predicted"])) for r in records)
    assert per_position == m["correct"]
    dataset = data.dataset(TEST_SPLIT, 7, 48)
    for r in records:
        inputs, targets = dataset[r["index"]]
        assert r["targets"] == targets[targets != -100].tolist()
        assert r["correct"] == (r["targets"] == r["predicted"])
        with torch.no_grad():
            probs = model(inputs[None])[0].softmax(-1)  # every position, no cache
        scored = (targets != -100).nonzero()[:, 0]
        want = probs[scored, targets[scored]].min().item()
        assert r["p_target_min"] == pytest.approx(want, abs=1e-5)
        if task == "induction_heads":
            key = r["key_position"]
            assert inputs[key - 1] == data.vocab_size - 1 and r["targets"] == [int(inputs[key])]
            assert r["gap"] == 48 - 1 - key
        else:
            assert "gap" not in r
