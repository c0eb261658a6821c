"""One training run from a TrainConfig: data, model, Lightning Trainer, and what the run leaves
in its directory:

    config.yaml      the resolved config            metrics.csv   every logged value (step, metric, value)
    checkpoints/     last.ckpt and best.ckpt        metrics.json  final validation metrics
                     (and step-NNNNNNN.ckpt, with keep_checkpoint_every)
    model/           MambaLM.save_pretrained        curves.png    loss and accuracy against steps

A start writes nothing into the run directory before training begins, and a resume that would
change the model or the task is refused before that (resume.py); a fresh run that fails before
its first step leaves no folder behind. A run changes no process-wide state that outlives it:
warning filters and Lightning's log level are set for the duration of ``train`` only, the model
is initialised from its own seeded random stream, and nothing is written into the environment.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar
from pytorch_lightning.utilities.exceptions import MisconfigurationException, SIGTERMException

from ..models import MambaLM
from ..native import flushed_subnormals
from .checkpoint import SafeCheckpointIO, load_checkpoint
from .config import ConfigError, TrainConfig, check_config
from .data import TaskDataModule
from .metrics import LogLines, MetricsCSV, plot_curves
from .module import LanguageModelTask
from .resume import RunDirectory, check_resume, check_run_dir
from .sharding import full_state_dict


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
    """``run_dir``; else the directory of the run being resumed; else a new folder under runs/."""
    if config.run_dir:
        return Path(config.run_dir)
    if config.resume:
        ckpt = checkpoint_of(config.resume)
        if ckpt.parent.name == "checkpoints":
            return ckpt.parent.parent  # continue in the run's own directory
    base = Path("runs") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    path, n = base, 1
    while path.exists():
        path, n = Path(f"{base}-{n}"), n + 1
    return path


def build_model(config: TrainConfig, vocab_size: int) -> MambaLM:
    """The model of ``config.model``, for a task with ``vocab_size`` tokens, initialised from
    ``config.seed`` (without touching the process's random state)."""
    mamba_config = config.model.mamba_config(vocab_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        try:
            return MambaLM(mamba_config, backend=config.model.backend)
        except ValueError as err:
            raise ConfigError(f"model: {err}") from err


def trainer_kwargs(config: TrainConfig) -> dict:
    kw = dataclasses.asdict(config.trainer)
    del kw["context_parallel"]  # the LightningModule's (LanguageModelTask), not the Trainer's
    if kw["precision"] is None:
        on_cuda = kw["accelerator"] in ("auto", "gpu", "cuda") and torch.cuda.is_available()
        kw["precision"] = "bf16-mixed" if on_cuda else "32-true"
    if kw["limit_val_batches"] is None:
        del kw["limit_val_batches"]
    if kw["strategy"] == "fsdp":  # FSDP2 through ModelParallelStrategy, which runs on the CPU too
        from .sharding import FullyShardedStrategy

        kw["strategy"] = FullyShardedStrategy()
    kw["val_check_interval"] = min(kw["val_check_interval"], kw["max_steps"])
    kw["log_every_n_steps"] = min(kw["log_every_n_steps"], kw["max_steps"])
    return kw


KEPT_CHECKPOINT = "step-{step:07d}"  # checkpoints/step-0010000.ckpt: keep_checkpoint_every's


class KeptCheckpoints(ModelCheckpoint):
    """ModelCheckpoint under a class name of its own: Lightning keys each checkpoint callback's
    state by its class and settings, and refuses two with the same key (as last.ckpt's and this
    one would have when keep_checkpoint_every equals checkpoint_every)."""


def _kept_checkpoints(run_dir: Path, every: int) -> list:
    """The callback that writes checkpoints/step-NNNNNNN.ckpt every ``every`` steps and keeps
    all of them (none when ``every`` is 0)."""
    if every == 0:
        return []
    return [
        KeptCheckpoints(
            dirpath=run_dir / "checkpoints",
            filename=KEPT_CHECKPOINT,
            auto_insert_metric_name=False,
            save_top_k=-1,
            every_n_train_steps=every,
            enable_version_counter=False,
        )
    ]


class StopOnSignal(pl.Callback):
    """Ctrl+C (SIGINT) ends a single-process run at the end of the step in progress, so that the
    caller saves last.ckpt at a step boundary and the run continues from there with resume=.
    Lightning's own answer, sys.exit, loses every step since the last periodic checkpoint (49
    steps at L 2^18 of a GPU run, once). A second Ctrl+C interrupts at once. SIGTERM needs no
    handler here: Lightning raises SIGTERMException at a step boundary, which train() catches.
    With several processes Lightning's behaviour is kept: the ranks could stop at different steps.
    """

    def __init__(self):
        self.requested = False
        self._previous = None

    def on_fit_start(self, trainer, pl_module):
        if trainer.world_size > 1 or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.getsignal(signal.SIGINT)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.requested:  # the second one
            self.restore()
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupted: stopping at the end of this step (Ctrl+C again to stop at once)", flush=True)

    def on_train_batch_end(self, trainer, *args):
        if self.requested:
            trainer.should_stop = True

    def restore(self):
        """Put back the SIGINT handler of before the run (train() calls it however fit ends)."""
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class FlushSubnormals(pl.Callback):
    """On the CPU, each training step (forward, backward, optimizer step) runs with torch's threads
    flushing subnormal numbers to zero (ssm.native.flushed_subnormals), as the C sweeps do inside
    themselves: gradients and decays that pass through the subnormal range otherwise cost a
    microcode assist per operation. Measured: a Mamba-2 step (d_model 128, 2 layers, L 16384,
    forward and backward) 715-725 ms plainly, 470-478 ms flushed. Values below 1.2e-38 become 0,
    as on GPUs. Each thread's own mode comes back after the step (and on an exception).

    Only the step: validation, the final validation and every other callback run in the mode
    of before. The flush starts in this callback's on_train_batch_start, so it goes last in the
    trainer's callbacks (the others' on_train_batch_start come before it), and ends in the
    on_train_batch_end of ``leaving``, which goes first (the others' come after it)."""

    def __init__(self):
        self._scope = None
        self.leaving = _EndFlush(self)

    def on_train_batch_start(self, trainer, pl_module, *args):
        self._leave()
        if pl_module.device.type == "cpu":
            self._scope = contextlib.ExitStack()
            self._scope.enter_context(flushed_subnormals())

    def on_train_batch_end(self, trainer, *args):
        self._leave()

    def on_validation_start(self, trainer, pl_module):
        self._leave()

    def on_exception(self, trainer, pl_module, exception):
        self._leave()

    def on_fit_end(self, trainer, pl_module):
        self._leave()

    def _leave(self):
        if self._scope is not None:
            scope, self._scope = self._scope, None
            scope.close()


class _EndFlush(pl.Callback):
    """FlushSubnormals' end of the step, as a callback of its own that goes first."""

    def __init__(self, flush: FlushSubnormals):
        self.flush = flush

    def on_train_batch_end(self, trainer, *args):
        self.flush._leave()


# Lightning logs at INFO level what helps no user of these runs: which accelerators exist,
# an advertisement for its logging service, that fit stopped at max_steps. Its warnings stay.
_LIGHTNING_LOGGERS = ("pytorch_lightning", "lightning_fabric")


@contextlib.contextmanager
def _run_scope(resuming: bool):
    """Warning filters and Lightning's log level for the duration of a run, restored after."""
    loggers = [logging.getLogger(name) for name in _LIGHTNING_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        # pytorch-lightning 2.6 calls a torch pytree API that newer torch deprecates; not ours to fix.
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
        if resuming:
            # A mid-epoch resume is exact here: the data are a stream indexed by the step count
            # (data.StepSampler), not a stateful loader. And the run continues in its own folder.
            warnings.filterwarnings(
                "ignore", message="You're resuming from a checkpoint that ended before the epoch ended"
            )
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
        for logger in loggers:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def train(config: TrainConfig, callbacks: tuple = ()) -> RunResult:
    """Run ``config`` (resuming when ``config.resume`` is set); returns where the results are.

    Raises ConfigError for a mistake in the config and CheckpointError (naming the file) when
    the checkpoint to resume from is damaged or holds anything but tensors and plain containers."""
    with _run_scope(resuming=bool(config.resume)):
        return _train(config, tuple(callbacks), time.perf_counter())


def _train(config: TrainConfig, callbacks: tuple, started: float) -> RunResult:
    check_config(config, run=True)  # (load_config checked each key; a config built in code is checked here)
    try:
        data = TaskDataModule(config.data, seed=config.seed)
    except (ValueError, FileNotFoundError) as err:  # data that cannot be built: a config mistake
        raise ConfigError(str(err)) from err
    model = build_model(config, data.vocab_size)
    try:
        module = LanguageModelTask(
            model,
            config.optim,
            config.trainer.max_steps,
            stateful=config.data.stateful,
            token_bytes=data.token_bytes(),
            context_parallel=config.trainer.context_parallel,
        )
    except ValueError as err:  # a combination the module cannot train (a stateful hybrid)
        raise ConfigError(str(err)) from err
    kwargs = trainer_kwargs(config)
    ckpt_path = checkpoint_of(config.resume) if config.resume else None
    run_dir = resolve_run_dir(config)
    config = copy.deepcopy(config)
    config.run_dir = str(run_dir)
    config.model.vocab_size = model.config.vocab_size
    resume_step = None
    if ckpt_path is not None:
        # Read safely before anything else, so that a damaged file stops the run here with its
        # name, and compared with this config and model: a resume that would change the model or
        # the task stops here too, before anything is written. (Memory-mapped: Lightning loads
        # the checkpoint itself, through SafeCheckpointIO.)
        checkpoint = load_checkpoint(ckpt_path, mmap=True)
        resume_step = int(checkpoint["global_step"])
        check_resume(config, checkpoint, ckpt_path, module)
        del checkpoint
    check_run_dir(run_dir, ckpt_path)
    progress_bar = sys.stdout.isatty() if config.progress_bar is None else config.progress_bar
    logger = MetricsCSV(run_dir / "metrics.csv")
    fresh = ckpt_path is None or run_dir.resolve() not in ckpt_path.resolve().parents
    directory = RunDirectory(run_dir, config, logger, resume_step, fresh)
    stop_on_signal, flush = StopOnSignal(), FlushSubnormals()
    try:
        trainer = pl.Trainer(
            **kwargs,
            default_root_dir=str(run_dir),
            logger=logger,
            plugins=[SafeCheckpointIO()],
            callbacks=[
                directory,
                flush.leaving,  # first: every callback's on_train_batch_end runs unflushed
                ModelCheckpoint(
                    dirpath=run_dir / "checkpoints",
                    save_last=True,
                    save_top_k=0,
                    every_n_train_steps=config.checkpoint_every,
                ),
                *_kept_checkpoints(run_dir, config.keep_checkpoint_every),
                ModelCheckpoint(
                    dirpath=run_dir / "checkpoints",
                    filename="best",
                    monitor="val/loss",
                    mode="min",
                    save_top_k=1,
                    enable_version_counter=False,
                    save_on_train_epoch_end=False,
                ),
                TQDMProgressBar() if progress_bar else LogLines(config.log_every),
                stop_on_signal,
                *callbacks,
                flush,  # last: every callback's on_train_batch_start runs unflushed
            ],
            enable_progress_bar=progress_bar,
            enable_model_summary=False,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,  # the data modules split examples between ranks themselves
        )
    except (ValueError, MisconfigurationException) as err:  # Lightning's refusal of accelerator, devices, ...
        raise ConfigError(f"trainer: {' '.join(str(err).split())}") from err
    if trainer.is_global_zero:
        params = sum(p.numel() for p in model.parameters())
        mixer = model.config.ssm_cfg.get("layer", "Mamba1")
        if model.config.attn_layer_idx:
            mixer += f" + attention at layers {list(model.config.attn_layer_idx)}"
        print(
            f"training {config.data.task} with a {params / 1e6:.2f} M-parameter MambaLM "
            f"({mixer}, {config.trainer.max_steps} steps) in {run_dir}",
            flush=True,
        )
        if resume_step is not None:
            print(f"resuming from {ckpt_path} at step {resume_step}", flush=True)

    try:
        trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, weights_only=True)
    except SIGTERMException:  # raised between steps: the state below is a whole step's
        if trainer.is_global_zero:
            print("\nSIGTERM: saving the last step's state", flush=True)
    except BaseException:
        directory.remove_unstarted(trainer)  # a fresh run that failed before its first step
        raise
    finally:
        stop_on_signal.restore()
    directory.start(trainer)  # (once: a resume with no step left to train has not started)
    run_dir = directory.path  # rank 0's, on every rank
    ckpt_dir = run_dir / "checkpoints"
    trainer.save_checkpoint(ckpt_dir / "last.ckpt", weights_only=False)  # the final (or interrupted) state, in full
    if trainer.interrupted or trainer.global_step < config.trainer.max_steps:
        if trainer.is_global_zero:
            print(f"stopped at step {trainer.global_step}; continue with: python scripts/train.py resume={run_dir}")
        return RunResult(run_dir, {}, interrupted=True)

    exported = trainer.global_step
    best = ckpt_dir / "best.ckpt"
    if config.export == "best" and best.is_file():  # the validation's choice, in place of the last step's
        chosen = load_checkpoint(best)
        module.load_state_dict(chosen["state_dict"])
        exported = int(chosen["global_step"])
    metrics = {k: float(v) for k, v in trainer.validate(module, datamodule=data, verbose=False)[0].items()}
    metrics["step"] = trainer.global_step
    metrics["exported_step"] = exported
    metrics["wall_s"] = round(time.perf_counter() - started, 1)
    whole = full_state_dict(model)  # sharded (trainer.strategy=fsdp): gathered, on every process
    if trainer.is_global_zero:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        if whole is not None:  # an unsharded copy to write
            model = build_model(config, model.config.vocab_size)
            model.load_state_dict(whole)
        model.save_pretrained(run_dir / "model")
        if data.tokenizer is not None:  # beside the weights, where generate.py and evaluate.py look
            data.tokenizer.save(run_dir / "model")
        plot_curves(run_dir / "metrics.csv", run_dir / "curves.png")
        shown = "  ".join(f"{k} {metrics[k]:.4f}" for k in ("val/loss", "val/acc", "val/bpb") if k in metrics)
        chosen = f", the weights of step {exported} (export = best)" if exported != trainer.global_step else ""
        print(f"done: step {trainer.global_step}  {shown}  ({metrics['wall_s']:.0f} s){chosen}")
        print(f"results in {run_dir}/: config.yaml checkpoints/ metrics.csv metrics.json model/ curves.png")
    return RunResult(run_dir, metrics)
