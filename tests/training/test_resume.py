"""A run directory across starts (ssm/training/resume.py): a resume that would change the run is
refused before anything is written, and one that fails changes nothing on disk; the allowed
changes go through; a fresh run that fails before its first step leaves no folder (and a folder
such a run left is reused); orphan temporary checkpoints go at the next start; the model
directory after a resume holds the resumed model only."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch

from ssm import MambaLM
from ssm.training import CheckpointError, ConfigError, load_checkpoint, load_config, train
from tests.training.test_train import RESUMABLE, KeepCheckpoint, StopAt


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory``, by path, with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


class Fails(pl.Callback):
    """Raises in ``hook``, as a failure there would."""

    def __init__(self, hook: str):
        setattr(self, hook, self._fail)

    def _fail(self, *args, **kwargs):
        raise RuntimeError("failed on purpose")


def interrupted_run(run_dir: Path) -> Path:
    """A run stopped at step 5 (rows logged to step 4) with a copy of its step-4 checkpoint."""
    train(load_config(None, RESUMABLE + [f"run_dir={run_dir}"]), callbacks=(KeepCheckpoint(4, "step4.ckpt"), StopAt(5)))
    return run_dir / "checkpoints" / "step4.ckpt"


def test_a_resume_that_would_change_the_run_is_refused_and_changes_nothing(tmp_path):
    run = tmp_path / "run"
    step4 = interrupted_run(run)
    before = snapshot(run)
    refusals = {
        "model.d_model=32": r"cannot change model.d_model \(16 in the run, 32 here\) \(a resume may change trainer",
        "model.ssm_cfg={layer: Mamba1, d_state: 8}": r"model.ssm_cfg.d_state \(4 in the run, 8 here\)",
        "data.num_tokens=6": r"data.num_tokens \(8 in the run, 6 here\); model.vocab_size \(10 in the run, 8 here\)",
        "seed=1": r"seed \(0 in the run, 1 here\)",
        "model.tie_embeddings=false": r"model.tie_embeddings \(True in the run, False here\)",
    }
    for override, message in refusals.items():
        with pytest.raises(ConfigError, match=message) as err:
            train(load_config(None, RESUMABLE + [override, f"resume={run}"]))
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match=message):
            train(load_config(None, RESUMABLE + [override, f"resume={step4}"]))
    assert snapshot(run) == before  # config.yaml, metrics.csv, checkpoints: as they were

    # A checkpoint of before they carried their config, away from its run: its tensors are checked.
    checkpoint = torch.load(step4, weights_only=True)
    del checkpoint["train_config"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    shapes = (
        r"old.ckpt does not hold the model of this config: model.backbone.embedding.weight: checkpoint \(16, 16\), mo"
    )
    with pytest.raises(CheckpointError, match=shapes):
        train(load_config(None, RESUMABLE + ["model.d_model=32", f"resume={tmp_path / 'old.ckpt'}", "run_dir=fork"]))
    assert not (tmp_path / "fork").exists() and snapshot(run) == before

    # What a resume may change: the schedule, the data's length, the backend, the spelling of a default
    allowed = ["data.seq_len=14", "optim.lr=1e-3", "model.backend=ref", "model.ssm_cfg={d_state: 4}", "log_every=3"]
    result = train(load_config(None, RESUMABLE + allowed + [f"resume={run}"]))
    assert not result.interrupted and result.metrics["step"] == 6
    assert load_config(run / "config.yaml").data.seq_len == 14  # config.yaml is the resumed run's


def test_a_resume_that_fails_before_training_starts_changes_nothing(tmp_path):
    # Lightning has loaded the model's weights when on_fit_start runs, not yet the optimiser's
    # state; a failure there (or anywhere before training starts) must leave config.yaml and
    # the metrics logged after the checkpoint as they were.
    run = tmp_path / "run"
    step4 = interrupted_run(run)
    before = snapshot(run)
    assert any(line.startswith("4,") for line in (run / "metrics.csv").read_text().splitlines())  # after step 4
    for hook in ("setup", "on_load_checkpoint", "on_fit_start"):  # before, while and after loading
        with pytest.raises(RuntimeError, match="failed on purpose"):
            train(load_config(None, RESUMABLE + ["optim.lr=1e-3", f"resume={step4}"]), callbacks=(Fails(hook),))
        assert snapshot(run) == before, hook
    train(load_config(None, RESUMABLE + ["optim.lr=1e-3", f"resume={step4}"]))  # and it still resumes
    assert load_checkpoint(run / "checkpoints" / "last.ckpt")["global_step"] == 6


def test_a_fresh_run_that_fails_before_its_first_step_leaves_no_folder(tmp_path):
    args = RESUMABLE + ["trainer.max_steps=2"]
    for hook in ("on_fit_start", "on_train_start", "on_before_optimizer_step"):
        with pytest.raises(RuntimeError, match="failed on purpose"):
            train(load_config(None, args + [f"run_dir={tmp_path / 'new'}"]), callbacks=(Fails(hook),))
        assert not (tmp_path / "new").exists(), hook
    # A folder of the user's: only what the run wrote goes.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="failed on purpose"):
        train(load_config(None, args + [f"run_dir={tmp_path / 'mine'}"]), callbacks=(Fails("on_train_batch_start"),))
    assert snapshot(tmp_path / "mine") == {"notes.txt": b"mine"}
    # What such a start leaves when it cannot clean up (a SIGKILL): reused by run_dir=.
    left = tmp_path / "killed"
    (left / "checkpoints").mkdir(parents=True)
    (left / "config.yaml").write_text("seed: 5\n")
    (left / "metrics.csv").write_text("step,metric,value\n")
    assert not train(load_config(None, args + [f"run_dir={left}"])).interrupted
    assert load_config(left / "config.yaml").seed == 0
    # A run killed before its first checkpoint holds metrics: never overwritten.
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.csv").write_text("step,metric,value\n0,train/loss,2.5\n")
    with pytest.raises(ConfigError, match=r"holds a run stopped before its first checkpoint \(1 rows in metrics.csv"):
        train(load_config(None, args + [f"run_dir={stopped}"]))


def test_a_resume_into_another_runs_folder_is_refused(tmp_path):
    for name in ("a", "b"):
        train(load_config(None, RESUMABLE + ["trainer.max_steps=2", f"run_dir={tmp_path / name}"]))
    a, b = snapshot(tmp_path / "a"), snapshot(tmp_path / "b")
    with pytest.raises(ConfigError, match=r"run_dir='.*b' already holds a run; resume=.*a/checkpoints/last.ckpt would"):
        train(load_config(None, RESUMABLE + [f"resume={tmp_path / 'a'}", f"run_dir={tmp_path / 'b'}"]))
    assert snapshot(tmp_path / "b") == b
    # into a folder of its own, the run forks and leaves its source as it was
    fork = train(load_config(None, RESUMABLE + [f"resume={tmp_path / 'a'}", f"run_dir={tmp_path / 'c'}"]))
    assert fork.metrics["step"] == 6 and snapshot(tmp_path / "a") == a


def test_orphan_temporary_checkpoints_go_at_the_next_start(tmp_path):
    train(load_config(None, RESUMABLE + [f"run_dir={tmp_path}"]), callbacks=(StopAt(2),))
    checkpoints = tmp_path / "checkpoints"
    orphans = [checkpoints / f".last.ckpt.{dead_pid()}.tmp", checkpoints / f".best.ckpt.{dead_pid()}.tmp"]
    live = checkpoints / f".last.ckpt.{os.getppid()}.tmp"  # a live process's write in progress
    for path in (*orphans, live):
        path.write_bytes(b"\0" * 4096)
    train(load_config(None, RESUMABLE + [f"resume={tmp_path}"]))
    assert not any(p.exists() for p in orphans) and live.exists()


def test_the_model_folder_after_a_resume_holds_the_resumed_model(tmp_path):
    train(load_config(None, RESUMABLE + ["trainer.max_steps=3", f"run_dir={tmp_path}"]))
    stale = MambaLM.from_pretrained(tmp_path / "model")
    with torch.no_grad():
        for p in stale.parameters():
            p.add_(1)
    stale.save_pretrained(tmp_path / "other", safe_serialization=True)
    (tmp_path / "other" / "model.safetensors").rename(tmp_path / "model" / "model.safetensors")  # a stale copy
    train(load_config(None, RESUMABLE + ["trainer.max_steps=5", f"resume={tmp_path}"]))
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == ["config.json", "pytorch_model.bin"]
    final = load_checkpoint(tmp_path / "checkpoints" / "last.ckpt")["state_dict"]
    for key, value in MambaLM.from_pretrained(tmp_path / "model").state_dict().items():
        assert torch.equal(value, final["model." + key]), key
