"""The LightningModule: a thin wrapper that trains a plain MambaLM (which runs without Lightning)."""

from __future__ import annotations

import math
import time

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import shard_sequence
from ..models import InferenceCache, MambaLM
from .config import OptimSection
from .data import IGNORE


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on the matrices only. Excluded: parameters marked
    ``_no_weight_decay`` (A_log, D, the Δ bias), norms and biases (every parameter below 2-D)."""
    decay, no_decay = [], []
    seen = set()
    for p in model.parameters():
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


def sequence_boundaries(resets: torch.Tensor) -> torch.Tensor:
    """cu_seqlens (S + 1,) of the rows of a batch (B, L) laid end to end: a sequence starts at
    every row's first position and wherever ``resets`` (B, L) is True (a document starts)."""
    starts = resets.clone()
    starts[:, 0] = True
    positions = starts.flatten().nonzero()[:, 0]
    return torch.cat([positions, positions.new_full((1,), starts.numel())])


def forward_rows(
    model: MambaLM, inputs: torch.Tensor, resets: torch.Tensor | None = None, state: InferenceCache | None = None
) -> tuple[torch.Tensor, InferenceCache | None]:
    """Logits (B, L, V) of the rows ``inputs`` (B, L), and with ``state`` the state after them.

    ``resets`` (B, L) bool: documents start there; the rows are packed end to end with a
    sequence boundary at each row start and each reset, so that nothing crosses a document.
    ``state`` (batch B): each row continues from its row of it (truncated BPTT), unless the row
    starts a new document at position 0; the returned state is each row's state after its last
    position (its last document's), detached: gradients stop at the segment's start."""
    batch, length = inputs.shape
    if resets is None:  # rows are plain sequences
        if state is None:
            return model(inputs), None
        state = state.map(lambda t: t)  # a cache of its own: the rows' state is not changed in place
        logits = model(inputs, cache=state)
        return logits, state.map(lambda t: t.detach())
    cu_seqlens = sequence_boundaries(resets)
    flat = inputs.reshape(1, batch * length)
    if state is None:
        return model(flat, cu_seqlens=cu_seqlens).view(batch, length, -1), None
    num_seqs = cu_seqlens.numel() - 1
    row_starts = torch.arange(batch, device=inputs.device) * length
    first = torch.searchsorted(cu_seqlens[:-1], row_starts)  # (B,) the sequence each row starts with
    last = torch.cat([first[1:], first.new_full((1,), num_seqs)]) - 1  # (B,) ... and ends with
    keep = ~resets[:, 0]  # a row whose first byte starts a document drops its carried state

    def per_sequence_state(rows):  # (B, ...) -> (S, ...): each row's at its first sequence, else 0
        rows = rows * keep.view(-1, *[1] * (rows.ndim - 1)).to(rows.dtype)
        return rows.new_zeros(num_seqs, *rows.shape[1:]).index_copy(0, first, rows)

    per_sequence = state.map(per_sequence_state)
    logits = model(flat, cache=per_sequence, cu_seqlens=cu_seqlens).view(batch, length, -1)
    return logits, per_sequence.map(lambda t: t[last].detach())


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float, decay: int = 0) -> float:
    """Learning-rate factor: linear from 0 to 1 over ``warmup`` steps, then a cosine down to
    ``min_ratio`` at ``total``; with ``decay`` > 0 the last ``decay`` steps before ``total`` also
    take it linearly to 0 (the last step at 1/decay of it): with min_ratio 1, warmup-stable-decay."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    factor = min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if decay > 0 and step >= total - decay:
        factor *= max(0, total - step) / decay
    return factor


def schedule_factor(step: int, optim: OptimSection, total: int) -> float:
    """``warmup_cosine`` as ``optim`` sets it."""
    return warmup_cosine(step, optim.warmup_steps, total, optim.min_lr_ratio, optim.decay_steps)


class LanguageModelTask(pl.LightningModule):
    """Next-token cross-entropy on the positions the task scores (targets != -100).

    Logs train/loss, train/acc, train/tokens_per_s, lr, and val/loss, val/acc (per-token accuracy
    on the scored positions), plus val/bpb: bits per byte of text with ``token_bytes`` (V,), the
    bytes each token id stands for (a text run's tokenizer), else bits per token.

    Batches are (inputs, targets) or, with packed documents, (inputs, targets, resets).
    ``stateful``: each training batch's rows continue those of the step before (data.stateful),
    and the model carries every layer's state across steps, detached (see forward_rows); one
    carried state per micro-batch of a step (gradient accumulation), saved in checkpoints so
    that a resumed run continues exactly. Validation always starts from a zero state.

    ``context_parallel`` = W > 1 (trainer.context_parallel): the processes form groups of W
    consecutive ranks (made in ``setup``); the ranks of a group read the same batch (the data
    module's ``_world``) and each runs the model over its slice of every row
    (``MambaLM.forward(cp_group=)``; with packed documents, its slice of the rows laid end to
    end). Each rank's loss is its slice's summed cross-entropy over the batch's scored positions,
    times W: the data-parallel average of the gradients over all W·G ranks is then the average
    over the G groups of the whole batch's mean loss, as G processes without context parallelism
    would train. The logged loss and accuracy are the whole batch's.
    """

    def __init__(
        self,
        model: MambaLM,
        optim: OptimSection,
        max_steps: int,
        stateful: bool = False,
        token_bytes: torch.Tensor | None = None,
        context_parallel: int = 1,
    ):
        super().__init__()
        if isinstance(context_parallel, bool) or not isinstance(context_parallel, int) or context_parallel < 1:
            raise ValueError(f"trainer.context_parallel must be an int >= 1, got {context_parallel!r}")
        if stateful and context_parallel > 1:
            raise ValueError(
                "data.stateful carries each row's state from step to step on one device; it does not combine "
                f"with trainer.context_parallel = {context_parallel}"
            )
        if stateful and model.config.attn_layer_idx:
            raise ValueError(
                "data.stateful carries every layer's state from step to step; an attention layer's state is "
                "the keys and values of every token seen, which would grow without bound. Train the hybrid "
                f"(model.attn_layer_idx = {model.config.attn_layer_idx}) with data.stateful=false"
            )
        if isinstance(optim.decay_steps, bool) or not isinstance(optim.decay_steps, int) or optim.decay_steps < 0:
            raise ValueError(f"optim.decay_steps must be an int >= 0 (0: no final decay), got {optim.decay_steps!r}")
        self.model, self.optim, self.max_steps, self.stateful = model, optim, max_steps, stateful
        self.token_bytes = token_bytes  # (V,) bytes per token id (text): val/bpb per byte, not per token
        self._last_batch_end = None
        self.carried: dict[int, InferenceCache] = {}  # micro-batch slot -> state after its last rows
        self.context_parallel, self.cp_group = context_parallel, None

    def setup(self, stage: str) -> None:
        if self.context_parallel == 1 or self.cp_group is not None:
            return
        world, rank, W = self.trainer.world_size, self.trainer.global_rank, self.context_parallel
        if world % W or not dist.is_initialized():
            raise ValueError(
                f"trainer.context_parallel = {W} must divide the number of processes, {world} "
                "(trainer.devices × trainer.num_nodes, with a distributed strategy such as ddp)"
            )
        groups = [dist.new_group(list(range(start, start + W))) for start in range(0, world, W)]  # on every rank
        self.cp_group = groups[rank // W]

    def configure_model(self) -> None:
        """trainer.strategy=fsdp (ModelParallelStrategy, which sets the device mesh): shard the
        model's parameters over the processes (ssm.training.sharding)."""
        if self._device_mesh is not None:
            from .sharding import shard

            shard(self.model, self._device_mesh["data_parallel"])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss_and_accuracy(self, batch, slot: int | None = None):
        """(the batch's mean loss over its scored positions, their accuracy, their number)."""
        return self._losses(batch, slot)[1:]

    def _losses(self, batch, slot: int | None = None):
        """(the loss to differentiate, then as ``_loss_and_accuracy``): the same but for context
        parallelism, where each rank differentiates its slice's share."""
        inputs, targets, resets = batch if len(batch) == 3 else (*batch, None)
        state = None
        if slot is not None:
            state = self.carried.get(slot)
            if state is None:
                state = self.model.allocate_inference_cache(inputs.shape[0], device=inputs.device)
            else:  # (from a checkpoint, it arrives on the CPU)
                state = state.map(lambda t: t.to(inputs.device))
        if self.cp_group is not None:
            return self._context_parallel_loss(inputs, targets, resets)
        logits, state = forward_rows(self.model, inputs, resets, state)
        if slot is not None:
            self.carried[slot] = state
        loss_sum, correct, n = scored_token_metrics(logits, targets)
        loss = loss_sum / max(n, 1)
        return loss, loss, correct / max(n, 1), n

    def _context_parallel_loss(self, inputs, targets, resets):
        """(the loss to differentiate, the whole batch's loss, its accuracy, its scored positions)
        with this rank's slice of the batch (see the class)."""
        group, W = self.cp_group, self.context_parallel
        n = int((targets != IGNORE).sum())  # the whole batch's: every rank of the group holds it
        if resets is None:
            mine = shard_sequence(inputs, group, argument="the inputs (data.seq_len)")
            logits, targets = self.model(mine, cp_group=group), shard_sequence(targets, group)
        else:  # the rows end to end, documents crossing the ranks' boundaries
            flat = inputs.reshape(1, -1)
            mine = shard_sequence(flat, group, argument="the inputs (data.seq_len)")
            logits = self.model(mine, cu_seqlens=sequence_boundaries(resets), cp_group=group)
            targets = shard_sequence(targets.reshape(1, -1), group)
        loss_sum, correct, _ = scored_token_metrics(logits, targets)
        whole = torch.stack([loss_sum.detach(), correct.to(loss_sum.dtype)])
        dist.all_reduce(whole, group=group)
        return loss_sum * W / max(n, 1), whole[0] / max(n, 1), whole[1] / max(n, 1), n

    def training_step(self, batch, batch_idx):
        slot = batch_idx % self.trainer.accumulate_grad_batches if self.stateful else None
        loss, shown, acc, n = self._losses(batch, slot)
        self.log("train/loss", shown, prog_bar=True, batch_size=n)
        self.log("train/acc", acc, prog_bar=True, batch_size=n)
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        now = time.perf_counter()
        if self._last_batch_end is not None:
            tokens = batch[0].numel() * self.trainer.world_size // self.context_parallel
            self.log("train/tokens_per_s", tokens / (now - self._last_batch_end), prog_bar=True)
        self._last_batch_end = now

    def on_validation_start(self):
        self._last_batch_end = None  # validation time is not training throughput

    def validation_step(self, batch, batch_idx):
        loss, acc, n = self._loss_and_accuracy(batch)
        self.log("val/loss", loss, batch_size=n, sync_dist=True, prog_bar=True)
        if self.token_bytes is None:  # bits per token
            self.log("val/bpb", loss / math.log(2), batch_size=n, sync_dist=True)
        else:  # summed over the batches, divided by their bytes
            targets = batch[1]
            text_bytes = int(self.token_bytes.to(targets.device)[targets[targets != IGNORE]].sum())
            self.log("val/bpb", loss * n / math.log(2) / max(text_bytes, 1), batch_size=text_bytes, sync_dist=True)
        self.log("val/acc", acc, batch_size=n, sync_dist=True, prog_bar=True)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.stateful:
            checkpoint["carried_state"] = {slot: state.tensors() for slot, state in self.carried.items()}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.carried = {
            int(slot): self.model.inference_cache_from(layers)
            for slot, layers in checkpoint.get("carried_state", {}).items()
        }
        # The schedule's base rate and the optimiser's hyperparameters are part of their saved
        # state, so a resume would keep the old optim.lr, betas and eps however the config now
        # sets them. The config wins: a resumed run (a curriculum stage, say) trains with what its
        # config asks for, from the step it resumes at. Lightning restores optimisers and
        # schedules after this hook, from this dict.
        o, step = self.optim, int(checkpoint.get("global_step", 0))
        rate = o.lr * schedule_factor(step, o, self.max_steps)
        for schedule in checkpoint.get("lr_schedulers", []):
            if "base_lrs" in schedule:
                schedule["base_lrs"] = [o.lr] * len(schedule["base_lrs"])
                schedule["_last_lr"] = [rate] * len(schedule["base_lrs"])
        for optimizer in checkpoint.get("optimizer_states", []):
            for group in optimizer.get("param_groups", []):
                group["initial_lr"], group["lr"] = o.lr, rate
                group["betas"], group["eps"] = tuple(o.betas), o.eps

    def configure_optimizers(self):
        o = self.optim
        optimizer = torch.optim.AdamW(
            parameter_groups(self.model, o.weight_decay), lr=o.lr, betas=tuple(o.betas), eps=o.eps
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule_factor(step, o, self.max_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
