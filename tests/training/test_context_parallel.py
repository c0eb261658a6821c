"""trainer.context_parallel: two processes (gloo, Lightning's ddp) that split every sequence of a
batch between them log, step by step, the losses of one process training on the same batches;
what it does not combine with is refused by name, before a run starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ssm import MambaLM
from ssm.training import ConfigError, load_config, train

from .test_train import ROOT, TASKS, TINY

STEPS = 10
COMMON = [
    *TINY,
    *TASKS["selective_copying"],
    "data.seq_len=13",  # inputs of 16 positions (the 3 to memorise after): 8 per rank
    "model.n_layer=2",
    "model.ssm_cfg={layer: Mamba2, d_state: 4, headdim: 8, chunk_size: 4}",
    f"trainer.max_steps={STEPS}",
    f"trainer.val_check_interval={STEPS}",
    f"checkpoint_every={STEPS}",
    "trainer.accelerator=cpu",
]


def train_losses(run_dir) -> list[float]:
    rows = [line.split(",") for line in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
    losses = {int(step): float(value) for step, metric, value in rows if metric == "train/loss"}
    return [losses[step] for step in sorted(losses)]


def text_of_short_documents(directory) -> list[str]:
    """Files of 3 to 30 bytes: rows of 16 bytes hold several documents, and the ranks' halves
    cut through them (the packed path, cu_seqlens crossing the ranks)."""
    directory.mkdir()
    for i in range(60):
        (directory / f"doc{i:02d}.txt").write_text("".join(chr(97 + (i * 7 + j) % 26) for j in range(3 + i * 13 % 28)))
    return ["data.task=text", "data.seq_len=16", f"data.paths=[{directory}/*.txt]", "data.val_fraction=0.2"]


@pytest.mark.parametrize("task", ["selective_copying", "text"])
def test_two_processes_splitting_each_sequence_log_the_losses_of_one(tmp_path, task):
    common = COMMON + (text_of_short_documents(tmp_path / "docs") if task == "text" else [])
    train(load_config(None, [*common, "trainer.devices=1", f"run_dir={tmp_path / 'one'}"]))
    two = [*common, "trainer.devices=2", "trainer.strategy=ddp", "trainer.context_parallel=2"]
    args = [sys.executable, str(ROOT / "tests" / "training" / "ddp_probe.py"), str(tmp_path / "out"), *two]
    args.append(f"run_dir={tmp_path / 'two'}")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert len(one) == len(two) == STEPS
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two)) < 1e-4, (one, two)
    # the model the two processes saved loads into one process, with one process's weights
    models = [MambaLM.from_pretrained(tmp_path / run / "model") for run in ("one", "two")]
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.devices=3", "trainer.context_parallel=2"], "trainer.context_parallel = 2 must divide .* = 3"),
        (["trainer.context_parallel=2", "data.task=text", "data.stateful=true"], "does not combine with data.stateful"),
        (["trainer.context_parallel=0"], "trainer.context_parallel must be an int >= 1"),
    ],
)
def test_what_context_parallelism_does_not_combine_with_is_refused_by_name(overrides, message):
    with pytest.raises(ConfigError, match=message):
        train(load_config(None, [*COMMON, *overrides]))
