"""Evaluating a trained run outside Lightning: accuracy and loss at any sequence length."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from ..models import MambaLM
from .checkpoint import CheckpointError, load_checkpoint
from .config import ConfigError, TrainConfig, from_dict, load_config
from .data import IGNORE, TEST_SPLIT, TaskDataModule
from .module import forward_rows, scored_token_metrics


def load_run(run_dir: str | Path, device=None) -> tuple[TrainConfig, MambaLM]:
    """The resolved config and the trained model of a finished run."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file() or not (run_dir / "model").is_dir():
        raise FileNotFoundError(f"{run_dir} is not a finished run (config.yaml and model/ expected)")
    config = load_config(run_dir / "config.yaml")
    model = MambaLM.from_pretrained(run_dir / "model", device=device, backend=config.model.backend)
    return config, model.eval()


def parse_lengths(text: str) -> list[int]:
    """ "64,128,4096" or "2^6..2^20" (every power of two from 2^6 to 2^20), or both, comma-separated.
    ValueError on anything else."""
    lengths = []
    for part in text.split(","):
        if ".." in part:
            lo, hi = (_power(p) for p in part.split(".."))
            lengths += [2**k for k in range(lo, hi + 1)]
        else:
            text = part.strip()
            lengths.append(2 ** _power(text) if text.startswith("2^") else int(text))
    return lengths


def _power(text: str) -> int:
    text = text.strip()
    if not text.startswith("2^"):
        raise ValueError(f"expected 2^k, got {text!r}")
    return int(text[2:])


def load_checkpoint_model(path: str | Path, device=None) -> tuple[TrainConfig, MambaLM, int]:
    """(config, model, step) of a training checkpoint (last.ckpt, a kept step-NNNNNNN.ckpt):
    the model built from the config the checkpoint holds and given its weights. Raises
    CheckpointError naming the file when it is not a training checkpoint of this library."""
    from .resume import CONFIG_KEY
    from .run import build_model

    path = Path(path)
    checkpoint = load_checkpoint(path)
    saved = checkpoint.get(CONFIG_KEY)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path} holds no run config ({CONFIG_KEY}); it was not written by ssm's train()")
    try:
        config = from_dict(TrainConfig, saved, "")
    except ConfigError as err:
        raise CheckpointError(f"{path}: its config does not load: {err}") from err
    model = build_model(config, config.model.vocab_size)
    weights = {k[len("model.") :]: v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        raise CheckpointError(f"{path} does not hold the weights of its config's model: {err}") from err
    return config, model.to(device).eval(), int(checkpoint["global_step"])


@torch.no_grad()
def evaluate(model: MambaLM, data: TaskDataModule, seq_len: int | None = None) -> dict:
    """val/loss (nats per scored token), val/bpb (bits per byte of text for the text task, per
    token otherwise) and val/acc (per scored token) on the validation examples of ``data`` at
    ``seq_len`` (default: the trained length)."""
    device = next(model.parameters()).device
    token_bytes = data.token_bytes()
    total_loss, correct, count, text_bytes = 0.0, 0, 0, 0
    for batch in data.val_dataloader(seq_len):
        inputs, targets, *resets = (t.to(device) for t in batch)  # resets: packed documents
        logits, _ = forward_rows(model, inputs, resets[0] if resets else None)
        loss_sum, n_correct, n = scored_token_metrics(logits, targets)
        total_loss, correct, count = total_loss + float(loss_sum), correct + int(n_correct), count + n
        if token_bytes is not None:
            text_bytes += int(token_bytes[targets[targets != IGNORE].cpu()].sum())
    loss = total_loss / max(count, 1)
    bpb = loss / math.log(2) if token_bytes is None else total_loss / math.log(2) / max(text_bytes, 1)
    return {"val/loss": loss, "val/bpb": bpb, "val/acc": correct / max(count, 1)}


def peak_rss_reset() -> bool:
    """Reset this process's peak resident memory (Linux: VmHWM, via /proc/self/clear_refs), so
    that ``peak_rss_bytes`` afterwards measures what follows. False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory since start or the last ``peak_rss_reset`` (Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@torch.no_grad()
def scored_suffix_metrics(model: MambaLM, inputs: torch.Tensor, targets: torch.Tensor, chunk: int | None = None):
    """(summed cross-entropy, correct argmax predictions, scored positions) of ``inputs``
    (B, L) against ``targets`` (B, L; -100 where nothing is scored), computing logits only from
    the first scored position on (the synthetic tasks score a suffix: the last position for
    induction heads, the last K for selective copying).

    ``chunk``: read the sequence in pieces of that many tokens, every layer's state (SSM state
    and conv window) carried from one piece to the next, so that memory is O(B·chunk·d_model)
    whatever L is; None reads it in one pass, memory O(B·L·d_model). Both give the same logits
    up to float rounding. Nothing of size (L, d_inner, d_state) is made either way."""
    logits, targets = scored_suffix_logits(model, inputs, targets, chunk)
    if logits is None:
        return torch.zeros(()), torch.zeros((), dtype=torch.long), 0
    return scored_token_metrics(logits, targets)


@torch.no_grad()
def scored_suffix_logits(model: MambaLM, inputs: torch.Tensor, targets: torch.Tensor, chunk: int | None = None):
    """(logits (B, S, V), targets (B, S)) of the suffix of ``inputs`` from its first scored
    position on, read as ``scored_suffix_metrics`` describes; (None, None) when nothing is scored."""
    batch, length = inputs.shape
    scored = (targets != IGNORE).any(0).nonzero()
    if scored.numel() == 0:
        return None, None
    first = int(scored[0])
    step = length if chunk is None else int(chunk)
    if step < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    cache = model.allocate_inference_cache(batch, device=inputs.device)
    for start in range(0, first, step):  # the unscored prefix: states only (one logit row per piece)
        model(inputs[:, start : min(start + step, first)], cache=cache, num_last_tokens=1)
    logits = [
        model(inputs[:, start : start + step], cache=cache) for start in range(first, length, step)
    ]  # the scored suffix
    return torch.cat(logits, 1), targets[:, first:]


def per_sequence_records(logits: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor, first_index: int, trigger):
    """One record per row of a batch: its index in the split, whether every scored position
    was predicted right, the targets, the argmax predictions, and the smallest probability the
    model gave a target; for induction heads (``trigger`` not None) also where the key is and
    its gap (tokens between the key and the final trigger)."""
    scored = targets != IGNORE
    probs = logits.float().softmax(-1)
    predicted = logits.argmax(-1)
    records = []
    for r in range(targets.shape[0]):
        mask = scored[r]
        want, got = targets[r][mask], predicted[r][mask]
        p = probs[r][mask].gather(-1, want[:, None])[:, 0]
        record = {"index": first_index + r, "correct": bool((want == got).all()), "targets": want.tolist()}
        record |= {"predicted": got.tolist(), "p_target_min": round(float(p.min()), 6)}
        if trigger is not None:
            key = int((inputs[r] == trigger).nonzero()[0]) + 1
            record |= {"key_position": key, "gap": inputs.shape[1] - 1 - key}
        records.append(record)
    return records


@torch.no_grad()
def evaluate_length(
    model: MambaLM,
    data: TaskDataModule,
    seq_len: int,
    samples: int,
    batch_size: int = 16,
    chunk: int | None = None,
    split: str = TEST_SPLIT,
    per_sequence: bool = False,
) -> dict:
    """Accuracy (per scored token) and loss of ``model`` on ``samples`` examples of the task at
    ``seq_len``, drawn from ``split`` (default the test split, data.TEST_SPLIT: see data.SPLITS),
    ``batch_size`` sequences at a time, each read in pieces of ``chunk`` tokens (None: one
    pass). "last/acc": the share of examples whose last position was predicted right (the
    task's answer after the whole sequence: parity of all the bits). Also the seconds it took
    and the process's peak resident memory meanwhile (Linux; None elsewhere); with
    ``per_sequence``, "sequences": one record per example (``per_sequence_records``). Synthetic
    tasks only (their scored positions are a suffix)."""
    if data.config.task == "text":
        raise ValueError("evaluate_length scores the synthetic tasks; for text use evaluate or evaluate_carried_state")
    device = next(model.parameters()).device
    dataset = data.dataset(split, samples, seq_len)
    peak_rss_reset()
    started = time.perf_counter()
    total_loss, correct, count, records, last_correct = 0.0, 0, 0, [], 0
    trigger = getattr(dataset, "trigger", None)
    for lo in range(0, samples, batch_size):
        examples = [dataset[i] for i in range(lo, min(lo + batch_size, samples))]
        inputs, targets = (torch.stack(t).to(device) for t in zip(*examples))
        logits, suffix = scored_suffix_logits(model, inputs, targets, chunk)
        if logits is None:
            continue
        loss_sum, n_correct, n = scored_token_metrics(logits, suffix)
        total_loss, correct, count = total_loss + float(loss_sum), correct + int(n_correct), count + n
        last_correct += int((logits[:, -1].argmax(-1) == suffix[:, -1]).sum())  # a suffix ends scored
        if per_sequence:
            records += per_sequence_records(logits, suffix, inputs, lo, trigger)
    loss = total_loss / max(count, 1)
    result = {
        "val/loss": loss,
        "val/acc": correct / max(count, 1),
        "last/acc": last_correct / max(samples, 1),
        "correct": correct,
        "scored": count,
        "samples": samples,
        "seconds": time.perf_counter() - started,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    return result | ({"sequences": records} if per_sequence else {})


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
    token_bytes, count = data.token_bytes(), 0
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
        count += int(token_bytes[targets[targets != IGNORE].cpu()].sum())  # bytes of text scored
    return {
        "bpb_carried": nats["carried"] / max(count, 1) / math.log(2),
        "bpb_fresh": nats["fresh"] / max(count, 1) / math.log(2),
        "bytes": count,
    }
