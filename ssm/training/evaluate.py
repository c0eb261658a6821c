"""Evaluating a trained run outside Lightning: accuracy and loss at any sequence length."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..models import MambaLM
from .config import TrainConfig, load_config
from .data import TaskDataModule
from .module import forward_rows, scored_token_metrics


def load_run(run_dir: str | Path, device=None) -> tuple[TrainConfig, MambaLM]:
    """The resolved config and the trained model of a finished run."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "model").is_dir():
        raise FileNotFoundError(f"{run_dir} is not a finished run (config.yaml and model/ expected)")
    config = load_config(run_dir / "config.yaml")
    model = MambaLM.from_pretrained(run_dir / "model", device=device, backend=config.model.backend)
    return config, model.eval()


@torch.no_grad()
def evaluate(model: MambaLM, data: TaskDataModule, seq_len: int | None = None) -> dict:
    """val/loss (nats per scored token), val/bpb and val/acc (per scored token) on the
    validation examples of ``data`` at ``seq_len`` (default: the trained length)."""
    device = next(model.parameters()).device
    total_loss, correct, count = 0.0, 0, 0
    for batch in data.val_dataloader(seq_len):
        inputs, targets, *resets = (t.to(device) for t in batch)  # resets: packed documents
        logits, _ = forward_rows(model, inputs, resets[0] if resets else None)
        loss_sum, n_correct, n = scored_token_metrics(logits, targets)
        total_loss, correct, count = total_loss + float(loss_sum), correct + int(n_correct), count + n
    loss = total_loss / max(count, 1)
    return {"val/loss": loss, "val/bpb": loss / math.log(2), "val/acc": correct / max(count, 1)}
