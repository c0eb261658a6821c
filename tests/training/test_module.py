"""Optimiser groups, the learning-rate schedule, and the metrics on hand-computed batches: loss
and accuracy count only the scored positions (targets != -100)."""

from __future__ import annotations

import math

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

from ssm import MambaConfig, MambaLM
from ssm.training.config import DataSection, OptimSection
from ssm.training.data import IGNORE, TaskDataModule
from ssm.training.module import LanguageModelTask, parameter_groups, scored_token_metrics, warmup_cosine

LOG2 = math.log(2)


def test_weight_decay_skips_ssm_parameters_norms_and_biases():
    for layer in ("Mamba1", "Mamba2"):
        model = MambaLM(
            MambaConfig(
                d_model=16,
                n_layer=2,
                vocab_size=10,
                ssm_cfg={"layer": layer, "headdim": 8, "d_state": 4} if layer == "Mamba2" else {"d_state": 4},
                d_intermediate=32,
            )
        )
        decay, no_decay = parameter_groups(model, 0.1)
        names = {id(p): n for n, p in model.named_parameters()}
        decayed = {names[id(p)].split("layers.0.")[-1] for p in decay["params"]}
        skipped = {names[id(p)].split("layers.0.")[-1] for p in no_decay["params"]}
        assert {"mixer.A_log", "mixer.D", "norm.weight", "mixer.conv1d.bias", "backbone.norm_f.weight"} <= skipped
        assert ("mixer.dt_bias" if layer == "Mamba2" else "mixer.dt_proj.bias") in skipped
        assert {
            "mixer.in_proj.weight",
            "mixer.out_proj.weight",
            "backbone.embedding.weight",
            "mlp.fc1.weight",
        } <= decayed
        assert not decayed & skipped
        assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))  # tied head once
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_warmup_then_cosine():
    assert warmup_cosine(0, 10, 100, 0.1) == 0.1
    assert warmup_cosine(9, 10, 100, 0.1) == 1.0
    assert math.isclose(warmup_cosine(55, 10, 100, 0.1), 0.1 + 0.9 * 0.5)
    assert math.isclose(warmup_cosine(100, 10, 100, 0.1), 0.1)
    assert math.isclose(warmup_cosine(500, 10, 100, 0.1), 0.1)


def test_the_final_decay_takes_the_rate_linearly_to_zero():
    # constant (min_ratio 1), then the last 20 of 100 steps down to 0: warmup-stable-decay, by hand
    assert [warmup_cosine(k, 0, 100, 1.0, decay=20) for k in (0, 79, 80)] == [1.0, 1.0, 1.0]
    assert [warmup_cosine(k, 0, 100, 1.0, decay=20) for k in (90, 99, 100)] == [0.5, 0.05, 0.0]
    # on top of the cosine: at step 90 the cosine's 0.1 + 0.9·(1 + cos(0.9π))/2, halved
    assert math.isclose(warmup_cosine(90, 0, 100, 0.1, decay=20), (0.1 + 0.45 * (1 + math.cos(0.9 * math.pi))) / 2)
    assert warmup_cosine(50, 0, 100, 1.0, decay=0) == 1.0


def hand_batch():
    """Two sequences of 3 positions, 4 tokens. Scored positions have logits (log 2, 0, 0, 0) or
    (0, log 3, 0, 0): probabilities 2/5, 1/5, 1/5, 1/5 and 1/6, 3/6, 1/6, 1/6. Unscored positions
    have logits that would dominate both sums if they were counted."""
    a = [LOG2, 0.0, 0.0, 0.0]
    b = [0.0, math.log(3), 0.0, 0.0]
    loud = [50.0, 0.0, 0.0, 0.0]
    logits = torch.tensor([[a, loud, b], [b, a, loud]])
    targets = torch.tensor([[0, IGNORE, 1], [2, 3, IGNORE]])
    # -log p per scored position: -log(2/5), -log(3/6), -log(1/6), -log(1/5); argmax right at the first two
    losses = [math.log(5 / 2), math.log(2), math.log(6), math.log(5)]
    return logits, targets, sum(losses), 2, 4


def test_scored_token_metrics_on_a_hand_computed_batch():
    logits, targets, loss_sum, correct, n = hand_batch()
    got_loss, got_correct, got_n = scored_token_metrics(logits, targets)
    assert got_n == n and int(got_correct) == correct
    assert math.isclose(float(got_loss), loss_sum, rel_tol=1e-6)


class Fixed(nn.Module):
    """A stand-in model that returns the given logits whatever its inputs."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits
        self.weight = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids):
        return self.logits + 0 * self.weight


def test_lightning_module_means_over_scored_positions():
    logits, targets, loss_sum, correct, n = hand_batch()
    task = LanguageModelTask(Fixed(logits), OptimSection(), max_steps=1)
    loss, acc, count = task._loss_and_accuracy((torch.zeros(2, 3, dtype=torch.long), targets))
    assert count == n
    assert math.isclose(float(loss.detach()), loss_sum / n, rel_tol=1e-6)  # 4 scored positions, not 6
    assert math.isclose(float(acc), correct / n)


class Bigram(nn.Module):
    """A tiny deterministic model: logits are a fixed function of the current token."""

    def __init__(self, vocab):
        super().__init__()
        self.table = nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)) * 3)

    def forward(self, input_ids):
        return self.table[input_ids]


@pytest.mark.filterwarnings("ignore::UserWarning")  # Lightning's hints about workers and loggers
def test_logged_validation_metrics_pool_scored_positions_across_batches(tmp_path):
    # 7 examples in batches of 4 and 3: the logged val/loss and val/acc are those of all scored
    # positions together, computed here with nothing but log_softmax over the whole set.
    data = TaskDataModule(DataSection(task="induction_heads", seq_len=10, num_tokens=5, batch_size=4, val_samples=7))
    model = Bigram(data.vocab_size)
    task = LanguageModelTask(model, OptimSection(), max_steps=1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    logged = trainer.validate(task, datamodule=data, verbose=False)[0]

    examples = [data.dataset("val", 7)[i] for i in range(7)]
    inputs = torch.stack([x for x, _ in examples])
    targets = torch.stack([y for _, y in examples])
    with torch.no_grad():
        logp = torch.log_softmax(model(inputs).double(), -1)
    scored = targets != IGNORE
    assert int(scored.sum()) == 7  # induction heads scores the last position only
    nll = -logp[scored].gather(-1, targets[scored][:, None]).squeeze(-1)
    right = logp[scored].argmax(-1) == targets[scored]
    assert math.isclose(logged["val/loss"], float(nll.mean()), rel_tol=1e-5)
    assert math.isclose(logged["val/bpb"], float(nll.mean()) / LOG2, rel_tol=1e-5)
    assert math.isclose(logged["val/acc"], float(right.double().mean()), rel_tol=1e-6)
