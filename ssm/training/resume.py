"""A run directory across starts: what a resume may change, the checks made before anything is
written, and the run's files written only once training has started.

A resume continues the run it names, so it keeps what the run is: the model, the task and its
data, the seed. It may change how the run goes on (``MAY_CHANGE``): the length of the run and
every optimiser and trainer setting, the curriculum's data keys (sequence length, batch, the
validation size, induction heads' short-gap share, carrying state across steps), the scan
backend (a run moved to a GPU) and where and how often it writes. Any other difference between
the checkpoint's config (saved in each checkpoint; for older checkpoints the run directory's
config.yaml) and the requested one is refused before anything is written, naming every key.
The checkpoint's tensors must also fit the model: a checkpoint without a config is checked
by its state dict's names and shapes.

On disk, a start writes nothing until Lightning has loaded the checkpoint into the model and
the optimisers and training begins (``RunDirectory.on_train_start``): then config.yaml is
written, metrics.csv loses the rows logged after the checkpoint, and the temporary files of
checkpoint writers that were killed are removed. A fresh run that fails before its first step
removes what it wrote (its folder too, when it made it and nothing else is in it); a folder it
could not clean up (a SIGKILL) holds no checkpoint and no metrics, and ``run_dir=`` reuses it.
"""

from __future__ import annotations

import contextlib
import csv
import inspect
import os
from pathlib import Path

import pytorch_lightning as pl
import yaml

from ..layers import MHA, Mamba, Mamba2, Mamba3
from .checkpoint import CheckpointError, remove_orphan_checkpoints
from .config import ConfigError, TrainConfig, load_yaml, save_config, to_dict
from .metrics import MetricsCSV

# Keys a resume may change; a name ending in "." covers its whole section.
MAY_CHANGE = (
    "run_dir",
    "resume",
    "checkpoint_every",
    "keep_checkpoint_every",
    "log_every",
    "progress_bar",
    "trainer.",
    "optim.",
    "model.backend",
    "model.ssm_cfg.backend",
    "data.seq_len",
    "data.batch_size",
    "data.val_samples",
    "data.short_gap_prob",
    "data.short_gap_window",
    "data.stateful",
    "data.num_workers",
)
CONFIG_KEY = "train_config"  # the checkpoint's entry holding the run's resolved config (to_dict)
_LAYERS = {"Mamba1": Mamba, "Mamba2": Mamba2, "Mamba3": Mamba3}
_NOT_CONFIG = ("self", "d_model", "embed_dim", "layer_idx", "device", "dtype", "backend")


def may_change(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in MAY_CHANGE)


def _plain(value):
    """Tuples as lists, recursively: YAML and the checkpoint give lists where a default is a tuple."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _with_defaults(cfg: dict, cls) -> dict:
    """``cfg`` with every constructor argument of ``cls`` it leaves out at its default, so that
    {layer: Mamba1} and {layer: Mamba1, d_state: 16} compare equal."""
    params = inspect.signature(cls).parameters.items()
    defaults = {n: p.default for n, p in params if n not in _NOT_CONFIG and p.default is not inspect.Parameter.empty}
    return {**defaults, **cfg}


def flat_config(config: dict) -> dict:
    """A config (to_dict's form) as {dotted key: value}; model.ssm_cfg and model.attn_cfg
    spelt out to every argument of their layer (defaults included), one key each."""
    flat = {}
    for section, value in config.items():
        if not isinstance(value, dict):
            flat[section] = _plain(value)
            continue
        for key, item in value.items():
            flat[f"{section}.{key}"] = _plain(item)
    model = config.get("model", {})
    ssm_cfg = dict(model.get("ssm_cfg") or {})
    layer = ssm_cfg.setdefault("layer", "Mamba1")
    if layer in _LAYERS:
        ssm_cfg = _with_defaults(ssm_cfg, _LAYERS[layer])
    attn_cfg = _with_defaults(dict(model.get("attn_cfg") or {}), MHA) if model.get("attn_layer_idx") else {}
    for name, cfg in (("ssm_cfg", ssm_cfg), ("attn_cfg", attn_cfg)):
        flat.pop(f"model.{name}", None)
        flat.update({f"model.{name}.{k}": _plain(v) for k, v in cfg.items()})
    return flat


def saved_config(checkpoint: dict, ckpt_path: Path) -> dict | None:
    """The config the checkpoint was trained with: its own copy, else (a checkpoint written
    before they held one) its run directory's config.yaml; None when neither exists."""
    if isinstance(checkpoint.get(CONFIG_KEY), dict):
        return checkpoint[CONFIG_KEY]
    path = ckpt_path.parent.parent / "config.yaml"
    if ckpt_path.parent.name == "checkpoints" and path.is_file():
        with contextlib.suppress(yaml.YAMLError, OSError):
            raw = load_yaml(path.read_text())
            return raw if isinstance(raw, dict) else None
    return None


def check_resume(config: TrainConfig, checkpoint: dict, ckpt_path: Path, module) -> None:
    """Refuse a resume that would change what the run is (ConfigError naming every key that
    differs from the checkpoint's config, one line), or whose checkpoint does not fit the model
    (CheckpointError naming the tensors). ``config``: the requested one, vocab_size resolved."""
    saved = saved_config(checkpoint, ckpt_path)
    if saved is not None:
        theirs, ours = flat_config(saved), flat_config(to_dict(config))
        # (a key only one of them has, from another version of the schema, cannot be compared)
        changed = [
            f"{key} ({theirs[key]!r} in the run, {ours[key]!r} here)"
            for key in sorted(theirs.keys() & ours.keys())
            if not may_change(key) and theirs[key] != ours[key]
        ]
        if changed:
            raise ConfigError(
                f"resume={config.resume}: a resume continues its run and cannot change {'; '.join(changed)} "
                "(a resume may change trainer.*, optim.*, data.seq_len, data.batch_size, data.val_samples, the "
                "backend and logging; a changed model or task is a new run: drop resume=)"
            )
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    stored = {k: tuple(v.shape) for k, v in checkpoint["state_dict"].items()}
    problems = [f"{k}: checkpoint {stored[k]}, model {v}" for k, v in expected.items() if stored.get(k, v) != v]
    problems += [f"{k} missing" for k in expected if k not in stored]
    problems += [f"{k} not in the model" for k in stored if k not in expected]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{ckpt_path} does not hold the model of this config: {'; '.join(problems[:3])}{more}; "
            "resume it with the config it was trained with"
        )


def _metric_rows(path: Path) -> int:
    if not path.is_file():
        return 0
    with open(path, newline="") as f:
        return max(0, sum(1 for _ in csv.reader(f)) - 1)


def check_run_dir(run_dir: Path, ckpt_path: Path | None) -> None:
    """Refuse a ``run_dir`` that holds another run: one with a checkpoint, final metrics or
    logged rows, unless the run resumes from a checkpoint inside it. A folder that only a start
    which failed before its first step wrote into (config.yaml, a header-only metrics.csv) is
    not a run, and is reused."""
    if ckpt_path is not None and run_dir.resolve() in ckpt_path.resolve().parents:
        return
    rows = _metric_rows(run_dir / "metrics.csv")
    if (run_dir / "checkpoints" / "last.ckpt").is_file() or (run_dir / "metrics.json").is_file():
        hint = f"continue it with resume={run_dir}" if ckpt_path is None else f"resume={ckpt_path} would write into it"
        raise ConfigError(f"run_dir={str(run_dir)!r} already holds a run; {hint}, or give another run_dir")
    if rows:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} holds a run stopped before its first checkpoint ({rows} rows in metrics.csv, "
            "no checkpoints/last.ckpt), which cannot be resumed; remove it, or give another run_dir"
        )


class RunDirectory(pl.Callback):
    """The run directory: rank 0's path on every rank, and the files written when training
    starts. With several devices, Lightning starts the other processes by running the same
    command line again, so a run directory named after the clock could differ between them;
    once the processes have connected, rank 0's is broadcast (``setup``).

    ``on_train_start`` (after Lightning has loaded the checkpoint into the model, optimisers and
    loops): rank 0 writes config.yaml, drops metrics.csv's rows after the checkpoint's step and
    removes orphan temporary checkpoints. ``start`` does the same once, whichever calls it first
    (train() calls it after fit too, for a resume with no step left to train). Each checkpoint
    carries ``config`` (``CONFIG_KEY``), what a later resume is compared with."""

    def __init__(self, path: Path, config: TrainConfig, logger: MetricsCSV, resume_step: int | None, fresh: bool):
        self.path, self.config, self.logger, self.resume_step = path, config, logger, resume_step
        self.fresh = fresh  # the folder holds no run of its own (a new run, or a resume forked into it)
        self.existed = path.exists()  # the folder was there before this start
        self.started = False

    def setup(self, trainer, pl_module, stage):
        self.path = Path(trainer.strategy.broadcast(str(self.path), src=0))

    def on_train_start(self, trainer, pl_module):
        self.start(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint[CONFIG_KEY] = to_dict(self.config)

    def start(self, trainer) -> None:
        if self.started or not trainer.is_global_zero:
            return
        self.started = True
        self.path.mkdir(parents=True, exist_ok=True)
        remove_orphan_checkpoints(self.path / "checkpoints")
        save_config(self.config, self.path / "config.yaml")
        if self.resume_step is not None:
            self.logger.drop_rows_after(self.resume_step)

    def remove_unstarted(self, trainer) -> None:
        """After a fresh run failed before its first step: remove what it wrote (config.yaml,
        metrics.csv, an empty checkpoints/) and its folder when it made it and it is empty."""
        if not self.fresh or trainer.global_step > (self.resume_step or 0) or not trainer.is_global_zero:
            return
        for name in ("config.yaml", "metrics.csv"):
            (self.path / name).unlink(missing_ok=True)
        for folder in [self.path / "checkpoints"] + ([] if self.existed else [self.path]):
            with contextlib.suppress(OSError):  # not there, or not empty: left as it is
                os.rmdir(folder)
