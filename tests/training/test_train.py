"""End to end: each task trains a few steps and leaves its results; resume is exact; DDP on
CPU runs two processes; the scripts' main(argv) work."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from ssm import MambaLM
from ssm.training import load_config, train

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model.d_model=16", "model.n_layer=1", "model.ssm_cfg={layer: Mamba1, d_state: 4}", "data.batch_size=4",
        "data.val_samples=8", "trainer.val_check_interval=2", "checkpoint_every=2", "progress_bar=false", "log_every=1",
        "trainer.log_every_n_steps=1"]
TASKS = {
    "selective_copying": ["data.seq_len=12", "data.num_memorize=3"],
    "induction_heads": ["data.task=induction_heads", "data.seq_len=16"],
    "text": ["data.task=text", "data.seq_len=16", "model.ssm_cfg={layer: Mamba2, d_state: 4, headdim: 8, chunk_size: 8}"],
}


def script(name):
    return runpy.run_path(str(ROOT / "scripts" / f"{name}.py"))["main"]


@pytest.mark.parametrize("task", TASKS)
def test_each_task_trains_and_leaves_its_results(task, tmp_path):
    run_dir = tmp_path / "run"
    config = load_config(ROOT / "configs" / "default.yaml", TINY + TASKS[task] + ["trainer.max_steps=3", f"run_dir={run_dir}"])
    result = train(config)
    assert not result.interrupted
    for name in ("config.yaml", "metrics.csv", "metrics.json", "curves.png", "checkpoints/last.ckpt", "checkpoints/best.ckpt", "model/config.json"):
        assert (run_dir / name).is_file(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["step"] == 3 and 0 <= metrics["val/acc"] <= 1 and metrics["val/loss"] > 0
    model = MambaLM.from_pretrained(run_dir / "model")
    assert model.config.vocab_size == load_config(run_dir / "config.yaml").model.vocab_size
    lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert lines[0] == "step,metric,value" and any(",train/loss," in line for line in lines)


class StopAt(pl.Callback):
    """Stops training after ``step`` steps, as an interruption would."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def test_resume_gives_the_parameters_of_an_uninterrupted_run(tmp_path):
    common = TINY + TASKS["selective_copying"] + ["trainer.max_steps=6", "optim.warmup_steps=2"]
    whole = train(load_config(None, common + [f"run_dir={tmp_path / 'whole'}"]))
    cut = train(load_config(None, common + [f"run_dir={tmp_path / 'cut'}"]), callbacks=(StopAt(3),))
    assert cut.interrupted
    resumed = train(load_config(None, common + [f"resume={tmp_path / 'cut'}"]))
    assert resumed.run_dir == tmp_path / "cut" and not resumed.interrupted
    a = MambaLM.from_pretrained(tmp_path / "whole" / "model").state_dict()
    b = MambaLM.from_pretrained(tmp_path / "cut" / "model").state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    steps = [int(line.split(",")[0]) for line in (tmp_path / "cut" / "metrics.csv").read_text().splitlines()[1:]
             if ",train/loss," in line]
    assert steps == sorted(set(steps))  # logged once per step across the interruption


def test_train_script_reports_mistakes(capsys):
    assert script("train")(["trainer.max_stpes=3"]) == 2
    assert "unknown key 'trainer.max_stpes'" in capsys.readouterr().err


def test_evaluate_and_generate_scripts(tmp_path, capsys):
    for task in ("induction_heads", "text"):
        config = load_config(None, TINY + TASKS[task] + ["trainer.max_steps=2", f"run_dir={tmp_path / task}"])
        train(config)
    assert script("evaluate")([str(tmp_path / "induction_heads"), "--lengths", "16,32"]) == 0
    rows = json.loads((tmp_path / "induction_heads" / "extrapolation.json").read_text())
    assert [r["length"] for r in rows] == [16, 32] and (tmp_path / "induction_heads" / "extrapolation.png").is_file()
    capsys.readouterr()
    assert script("generate")([str(tmp_path / "text"), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("def ")


def test_two_process_ddp_on_cpu(tmp_path):
    """trainer.devices=2 trainer.strategy=ddp: Lightning launches a second process (gloo)."""
    args = [sys.executable, str(ROOT / "scripts" / "train.py"), *TINY, *TASKS["selective_copying"], "trainer.max_steps=2",
            "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp", f"run_dir={tmp_path / 'ddp'}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world_size: 2" in proc.stderr + proc.stdout or "GLOBAL_RANK: 1" in proc.stderr + proc.stdout
    metrics = json.loads((tmp_path / "ddp" / "metrics.json").read_text())
    assert metrics["step"] == 2
