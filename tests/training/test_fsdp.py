"""trainer.strategy=fsdp (ssm.training.sharding: FSDP2 through Lightning's ModelParallelStrategy,
on the CPU with gloo): two processes that shard the parameters and optimiser state, each
reading half of every batch, train the weights of one process reading the whole batch, stopped
and resumed on the way; the checkpoint they write loads into one process; with
trainer.context_parallel=2 as well, both processes read the whole batch, each half of every
sequence, and log one process's losses, stopped and resumed on the way too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from ssm import MambaLM
from ssm.training import load_config, train
from ssm.training.evaluate import load_checkpoint_model

from .test_context_parallel import COMMON, STEPS, train_losses
from .test_train import ROOT


def train_on_two(run_dir, *overrides) -> None:
    """scripts/train.py on two processes (Lightning starts the second by running it again)."""
    args = [sys.executable, str(ROOT / "scripts" / "train.py"), *COMMON, "trainer.devices=2", "trainer.strategy=fsdp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*args, *overrides, f"run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=run_dir.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def assert_same_weights(a: MambaLM, b: MambaLM, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{what}: {name}: {m}")


def test_two_sharded_processes_train_the_weights_of_one_with_the_whole_batch(tmp_path):
    train(load_config(None, [*COMMON, "data.batch_size=8", "trainer.devices=1", f"run_dir={tmp_path / 'one'}"]))
    two = tmp_path / "two"
    train_on_two(two, "data.batch_size=4", "trainer.max_steps=3")  # stopped after 3 steps, then resumed
    train_on_two(two, "data.batch_size=4", f"resume={two}")
    one = MambaLM.from_pretrained(tmp_path / "one" / "model")
    assert_same_weights(one, MambaLM.from_pretrained(two / "model"), "model/ of the sharded run")
    _, gathered, step = load_checkpoint_model(two / "checkpoints" / "last.ckpt")  # one process reads it
    assert step == STEPS
    assert_same_weights(one, gathered, "the sharded run's last.ckpt")
    metrics = [json.loads((run / "metrics.json").read_text()) for run in (tmp_path / "one", two)]
    assert abs(metrics[0]["val/loss"] - metrics[1]["val/loss"]) < 1e-5


def test_sharding_composes_with_context_parallelism(tmp_path):
    train(load_config(None, [*COMMON, "data.batch_size=8", "trainer.devices=1", f"run_dir={tmp_path / 'one'}"]))
    two = tmp_path / "two"
    train_on_two(two, "data.batch_size=8", "trainer.context_parallel=2", "trainer.max_steps=4")  # and resumed:
    train_on_two(two, "data.batch_size=8", "trainer.context_parallel=2", f"resume={two}")
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert len(one) == len(two) == STEPS
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two)) < 1e-4, (one, two)
    models = [MambaLM.from_pretrained(tmp_path / run / "model") for run in ("one", "two")]
    assert_same_weights(*models, "context parallel and sharded")
