"""One training run from a TrainConfig: data, model, Lightning Trainer, and what the run leaves
in its directory:

    config.yaml      the resolved config            metrics.csv   every logged value (step, metric, value)
    checkpoints/     last.ckpt and best.ckpt        metrics.json  final validation metrics
    model/           MambaLM.save_pretrained        curves.png    loss and accuracy against steps
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar

from ..models import MambaConfig, MambaLM
from .config import ConfigError, TrainConfig, save_config
from .data import TaskDataModule
from .metrics import LogLines, MetricsCSV, plot_curves
from .module import LanguageModelTask

_RUN_DIR_ENV = "SSM_RUN_DIR"  # hands rank 0's run directory to the processes DDP launches


@dataclass
class RunResult:
    run_dir: Path
    metrics: dict
    interrupted: bool = False


def checkpoint_of(resume: str) -> Path:
    """The checkpoint to resume from: the path itself, or a run dir's checkpoints/last.ckpt."""
    path = Path(resume)
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ConfigError(f"resume={resume!r}: no checkpoint at {path}")
    return path


def resolve_run_dir(config: TrainConfig) -> Path:
    if config.run_dir:
        return Path(config.run_dir)
    if config.resume:
        ckpt = checkpoint_of(config.resume)
        if ckpt.parent.name == "checkpoints":
            return ckpt.parent.parent  # continue in the run's own directory
    if int(os.environ.get("LOCAL_RANK", "0")) > 0 and _RUN_DIR_ENV in os.environ:
        return Path(os.environ[_RUN_DIR_ENV])
    base = Path("runs") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def build_model(config: TrainConfig, vocab_size: int) -> MambaLM:
    fields = dataclasses.asdict(config.model)
    backend = fields.pop("backend")
    if fields["vocab_size"] is None:
        fields["vocab_size"] = vocab_size
    elif fields["vocab_size"] < vocab_size:
        raise ConfigError(f"model.vocab_size = {fields['vocab_size']} is smaller than the task's vocabulary ({vocab_size})")
    try:
        return MambaLM(MambaConfig(**fields), backend=backend)
    except ValueError as err:
        raise ConfigError(f"model: {err}") from err


def trainer_kwargs(config: TrainConfig) -> dict:
    kw = dataclasses.asdict(config.trainer)
    if kw["precision"] is None:
        on_cuda = kw["accelerator"] in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        kw["precision"] = "bf16-mixed" if on_cuda else "32-true"
    if kw["limit_val_batches"] is None:
        del kw["limit_val_batches"]
    if kw["max_steps"] < 1:
        raise ConfigError(f"trainer.max_steps must be >= 1, got {kw['max_steps']}")
    kw["val_check_interval"] = min(kw["val_check_interval"], kw["max_steps"])
    return kw


def train(config: TrainConfig, callbacks: tuple = ()) -> RunResult:
    """Run ``config`` (resuming when ``config.resume`` is set); returns where the results are."""
    started = time.perf_counter()
    # Lightning warns that a mid-epoch resume is unreliable unless the dataloader is stateful;
    # ours is a stream indexed by the step count (data.StepSampler), which resumes exactly.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    # pytorch-lightning 2.6 calls a torch pytree API that newer torch deprecates; not ours to fix.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    pl.seed_everything(config.seed, workers=True, verbose=False)
    data = TaskDataModule(config.data, seed=config.seed)
    model = build_model(config, data.vocab_size)
    module = LanguageModelTask(model, config.optim, config.trainer.max_steps)
    kwargs = trainer_kwargs(config)
    ckpt_path = checkpoint_of(config.resume) if config.resume else None
    # (memory-mapped: only the step count is read here; Lightning loads the checkpoint itself)
    resume_step = torch.load(ckpt_path, map_location="cpu", weights_only=False, mmap=True)["global_step"] if ckpt_path else None

    run_dir = resolve_run_dir(config)
    os.environ[_RUN_DIR_ENV] = str(run_dir)
    config = copy.deepcopy(config)
    config.run_dir = str(run_dir)
    config.model.vocab_size = model.config.vocab_size
    ckpt_dir = run_dir / "checkpoints"
    progress_bar = sys.stdout.isatty() if config.progress_bar is None else config.progress_bar
    trainer = pl.Trainer(
        **kwargs,
        default_root_dir=str(run_dir),
        logger=MetricsCSV(run_dir / "metrics.csv", resume_step=resume_step),
        callbacks=[
            ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=config.checkpoint_every),
            ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
                            enable_version_counter=False, save_on_train_epoch_end=False),
            TQDMProgressBar() if progress_bar else LogLines(config.log_every),
            *callbacks,
        ],
        enable_progress_bar=progress_bar,
        enable_model_summary=False,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # the data modules split examples between ranks themselves
    )
    if trainer.is_global_zero:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, run_dir / "config.yaml")
        params = sum(p.numel() for p in model.parameters())
        print(f"training {config.data.task} with a {params / 1e6:.2f} M-parameter MambaLM "
              f"({model.config.ssm_cfg.get('layer', 'Mamba1')}, {config.trainer.max_steps} steps) in {run_dir}",
              flush=True)

    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    trainer.save_checkpoint(ckpt_dir / "last.ckpt")  # the final (or interrupted) state
    if trainer.interrupted or trainer.global_step < config.trainer.max_steps:
        if trainer.is_global_zero:
            print(f"stopped at step {trainer.global_step}; continue with: python scripts/train.py resume={run_dir}")
        return RunResult(run_dir, {}, interrupted=True)

    metrics = {k: float(v) for k, v in trainer.validate(module, datamodule=data, verbose=False)[0].items()}
    metrics["step"] = trainer.global_step
    metrics["wall_s"] = round(time.perf_counter() - started, 1)
    if trainer.is_global_zero:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        model.save_pretrained(run_dir / "model")
        plot_curves(run_dir / "metrics.csv", run_dir / "curves.png")
        shown = "  ".join(f"{k} {metrics[k]:.4f}" for k in ("val/loss", "val/acc", "val/bpb") if k in metrics)
        print(f"done: step {trainer.global_step}  {shown}  ({metrics['wall_s']:.0f} s)")
        print(f"results in {run_dir}/: config.yaml checkpoints/ metrics.csv metrics.json model/ curves.png")
    return RunResult(run_dir, metrics)
