"""What a run writes as it goes: metrics.csv (kept across resumes), log lines, curves.png."""

from __future__ import annotations

import csv
import math
import os
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.loggers.logger import Logger
from pytorch_lightning.utilities import rank_zero_only

from ._optional import require


class MetricsCSV(Logger):
    """Appends every logged metric to ``path`` as rows (step, name, value). Long format keeps
    the file valid when new metrics appear, and appending never loses earlier rows."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = Path(path)
        self._rows: list[tuple[int, str, float]] = []

    def drop_rows_after(self, step: int) -> None:
        """Forget what an interrupted run logged after its checkpoint of ``step`` steps, the one
        the run resumes from, so that the file reads as one run. Rows are numbered as Lightning
        counts, from 0: those numbered ``step`` and above were logged by later steps.
        (Rank 0 only: the other ranks write nothing.)"""
        if self.path.is_file():  # rewritten beside it and renamed over it: a kill now loses no row
            rows = [row for row in read_metrics(self.path) if row[0] < step]
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            try:
                self._write(rows, "w", temporary)
                os.replace(temporary, self.path)
            finally:
                temporary.unlink(missing_ok=True)

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        for name, value in metrics.items():
            if name != "epoch":
                self._rows.append((int(step or 0), name, float(value)))

    @rank_zero_only
    def save(self) -> None:
        if self._rows:
            self._write(self._rows, "a")
            self._rows = []

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()

    def _write(self, rows, mode, path: Path | None = None):
        path = path or self.path
        new = mode == "w" or not path.is_file()
        with open(path, mode, newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(["step", "metric", "value"])
            writer.writerows(rows)


def read_metrics(path: Path) -> list[tuple[int, str, float]]:
    with open(path, newline="") as f:
        return [(int(r["step"]), r["metric"], float(r["value"])) for r in csv.DictReader(f)]


class LogLines(pl.Callback):
    """Plain progress lines every ``every`` steps (for logs and non-interactive terminals)."""

    def __init__(self, every: int):
        self.every = every
        self.start = None

    def on_train_start(self, trainer, pl_module):
        self.start = time.perf_counter()

    @rank_zero_only
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.every and step != trainer.max_steps:
            return
        self._print(
            trainer,
            f"step {step}/{trainer.max_steps}",
            (("train/loss", "loss {:.4f}"), ("train/acc", "acc {:.3f}"), ("train/tokens_per_s", "{:,.0f} tokens/s")),
        )

    @rank_zero_only
    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self._print(
                trainer,
                f"validation at step {trainer.global_step}",
                (("val/loss", "val/loss {:.4f}"), ("val/acc", "val/acc {:.3f}"), ("val/bpb", "val/bpb {:.3f}")),
            )

    def _print(self, trainer, head: str, fields) -> None:
        m = trainer.callback_metrics
        parts = [head] + [fmt.format(float(m[key])) for key, fmt in fields if key in m]
        if self.start is not None:
            parts.append(f"{time.perf_counter() - self.start:.0f} s")
        print("  ".join(parts), file=sys.stdout, flush=True)


def plot_curves(metrics_path: Path, out_path: Path) -> None:
    """curves.png: training and validation loss (and accuracy, when logged) against steps."""
    figure = require("matplotlib.figure", "plotting curves.png")

    series: dict[str, tuple[list, list]] = {}
    for step, name, value in read_metrics(metrics_path):
        if math.isfinite(value):
            xs, ys = series.setdefault(name, ([], []))
            xs.append(step)
            ys.append(value)
    panels = [("loss", ["train/loss", "val/loss"])]
    if "val/acc" in series or "train/acc" in series:
        panels.append(("accuracy", ["train/acc", "val/acc"]))
    # A Figure of its own, not pyplot: no global backend or figure state is touched.
    fig = figure.Figure(figsize=(6 * len(panels), 4))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (title, names) in zip(axes[0], panels):
        for name in names:
            if name in series:
                xs, ys = series[name]
                ax.plot(
                    xs,
                    ys,
                    label=name,
                    marker="o" if name.startswith("val") else None,
                    alpha=0.6 if name.startswith("train") else 1.0,
                )
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
