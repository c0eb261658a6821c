"""The LightningModule: a thin wrapper that trains a plain MambaLM (which runs without Lightning)."""

from __future__ import annotations

import math
import time

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn

from ..models import MambaLM
from .config import OptimSection
from .data import IGNORE


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on the matrices only. Excluded: parameters marked
    ``_no_weight_decay`` (A_log, D, the Δ bias), norms and biases (every parameter below 2-D)."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:  # tied weights appear once
            continue
        seen.add(id(p))
        (no_decay if getattr(p, "_no_weight_decay", False) or p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def scored_token_metrics(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Over the positions a task scores (targets != -100): the summed cross-entropy (nats),
    the number of correct argmax predictions, and how many positions there are.
    logits (B, L, V), targets (B, L)."""
    logits = logits.float()
    loss_sum = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    scored = targets != IGNORE
    correct = ((logits.argmax(-1) == targets) & scored).sum()
    return loss_sum, correct, int(scored.sum())


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate factor: linear from 0 to 1 over ``warmup`` steps, then a cosine down to
    ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LanguageModelTask(pl.LightningModule):
    """Next-token cross-entropy on the positions the task scores (targets != -100).

    Logs train/loss, train/acc, train/tokens_per_s, lr, and val/loss, val/acc (per-token accuracy
    on the scored positions), plus val/bpb (bits per token, i.e. per byte for byte-level text).
    """

    def __init__(self, model: MambaLM, optim: OptimSection, max_steps: int):
        super().__init__()
        self.model, self.optim, self.max_steps = model, optim, max_steps
        self._last_batch_end = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss_and_accuracy(self, batch):
        inputs, targets = batch
        loss_sum, correct, n = scored_token_metrics(self.model(inputs), targets)
        return loss_sum / max(n, 1), correct / max(n, 1), n

    def training_step(self, batch, batch_idx):
        loss, acc, n = self._loss_and_accuracy(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=n)
        self.log("train/acc", acc, prog_bar=True, batch_size=n)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        now = time.perf_counter()
        if self._last_batch_end is not None:
            tokens = batch[0].numel() * self.trainer.world_size
            self.log("train/tokens_per_s", tokens / (now - self._last_batch_end), prog_bar=True)
        self._last_batch_end = now

    def on_validation_start(self):
        self._last_batch_end = None  # validation time is not training throughput

    def validation_step(self, batch, batch_idx):
        loss, acc, n = self._loss_and_accuracy(batch)
        self.log("val/loss", loss, batch_size=n, sync_dist=True, prog_bar=True)
        self.log("val/bpb", loss / math.log(2), batch_size=n, sync_dist=True)
        self.log("val/acc", acc, batch_size=n, sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(
            parameter_groups(self.model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, o.warmup_steps, self.max_steps, o.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
