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


@torch.no_grad()
def evaluate_carried_state(
    model: MambaLM, data: TaskDataModule, segments: int, rows: int | None = None, seq_len: int | None = None
) -> dict:
    """Bits per byte on long stretches of the validation text, with the state carried against
    without it: ``rows`` streams (default data.batch_size) of ``segments`` consecutive segments
    of ``seq_len`` bytes each, read once carrying every layer's state from one segment to the
    next (as data.stateful trains) and once starting each segment from a zero state. The same
    bytes are scored both ways; with packed documents the state restarts at each document in
    both. Returns bpb_carried, bpb_fresh and the number of scored bytes."""
    if data.config.task != "text":
        raise ValueError(f"carried state is measured on the text task, not {data.config.task!r}")
    device = next(model.parameters()).device
    rows = rows or data.config.batch_size
    streams = data.dataset("val", rows * segments, seq_len, streams=rows)
    nats = {"carried": 0.0, "fresh": 0.0}
    count = 0
    state = model.allocate_inference_cache(rows, device=device)
    for k in range(segments):
        examples = [streams[k * rows + r] for r in range(rows)]
        inputs, targets, *resets = (torch.stack(t).to(device) for t in zip(*examples))
        resets = resets[0] if resets else None
        carried, state = forward_rows(model, inputs, resets, state)
        fresh, _ = forward_rows(model, inputs, resets)
        for name, logits in (("carried", carried), ("fresh", fresh)):
            loss_sum, _, n = scored_token_metrics(logits, targets)
            nats[name] += float(loss_sum)
        count += n
    return {
        "bpb_carried": nats["carried"] / max(count, 1) / math.log(2),
        "bpb_fresh": nats["fresh"] / max(count, 1) / math.log(2),
        "bytes": count,
    }
