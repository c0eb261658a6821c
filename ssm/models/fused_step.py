"""The plan of the fused CPU decoding step: which blocks of a model's stack
``ssm.ops.mamba_blocks_step`` runs in C, in how many calls, and what runs between them.

A model's blocks fall into runs: a run of consecutive Mamba blocks of one kind is one C call
(with the final norm and the LM head in the same call when the run ends the stack); any other
block (attention, or one the C step does not take: gradients kept, not on the CPU, ...) steps
by its own tensor code between the calls. ``FusedStep.prepare`` builds the calls' arguments
once, for a caller that changes neither the parameters nor the cache's tensors between tokens
(``MambaLM`` while generating); ``fused_step`` plans and runs one token.

This module reads the backbone's blocks, norm and embedding through their public methods
(``step_weights``, ``forward``); it never imports the model.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layers import LayerCache, RMSNorm
from ..layers.quant import decoding_matrix
from ..ops import AttentionBlockWeights, LMHeadWeights, MambaBlocksStep, mamba_blocks_step
from .cache import InferenceCache


def block_runs(backbone: nn.Module, cache: InferenceCache, batch: int) -> list | None:
    """The stack as runs: (first layer index, the step weights of a run of consecutive blocks of
    one kind that the C step runs), or (index, None) for a block it does not; None where no block
    fits it."""
    runs = []
    for i, (layer, layer_cache) in enumerate(zip(backbone.layers, cache.layers)):
        if isinstance(layer_cache, LayerCache):
            # a packed prefill leaves the conv state strided, and a 16-bit model's conv state is
            # kept in float32 by the C step as its SSM state: one copy per cache, later calls find
            # it so (the tensor path reads either)
            if not layer_cache.conv_state.is_contiguous():
                layer_cache.conv_state = layer_cache.conv_state.contiguous()
            if layer_cache.conv_state.dtype in (torch.bfloat16, torch.float16):
                layer_cache.conv_state = layer_cache.conv_state.float()
        weights = layer.step_weights(layer_cache)
        if weights is not None:
            layer_cache.check_batch(batch)
        previous = runs[-1][1] if runs else None
        if weights is not None and previous is not None and type(previous[0]) is type(weights):
            previous.append(weights)
        else:
            runs.append((i, None if weights is None else [weights]))
    return runs if any(blocks is not None for _, blocks in runs) else None


def head_weights(backbone: nn.Module, lm_head: nn.Linear) -> LMHeadWeights | None:
    """The final norm and ``lm_head`` for the C step, or None where it does not run them."""
    norm = backbone.norm_f
    if not isinstance(norm, RMSNorm) or lm_head.bias is not None:
        return None
    return LMHeadWeights(norm_weight=norm.weight, norm_eps=norm.eps, weight=decoding_matrix(lm_head))


def fused_step(backbone: nn.Module, input_ids: torch.Tensor, cache: InferenceCache, lm_head: nn.Linear):
    """``lm_head(backbone(input_ids, cache, step=True))`` with the blocks stepped in C, or None
    where no block can be (the caller then steps the blocks one by one). Same numbers either
    way, but for a bfloat16 / float16 model, whose fused step keeps the stream in float32 where
    the tensor path rounds each layer's output to 16 bits (the logits are float32 where the head
    runs in C, in the model's dtype where the last block is stepped by its tensor code)."""
    if input_ids.ndim != 1:
        return None
    runs = block_runs(backbone, cache, input_ids.shape[0])
    head = head_weights(backbone, lm_head)
    if runs is not None and len(runs) == 1 and head is not None:  # every block and the head: one C call
        return mamba_blocks_step(backbone.embedding(input_ids), runs[0][1], head)
    step = None if runs is None else FusedStep.from_runs(backbone, runs, head, cache, lm_head, input_ids.shape[0])
    return None if step is None else step(input_ids)


class FusedStep:
    """A prepared decoding step: input_ids (batch,) → logits, its C arguments built once. Its
    logits may be overwritten by the next call. It does not advance ``cache.seqlen_offset``
    (the model does)."""

    def __init__(self, backbone, plan: list, fused_head: bool, room: int, cache: InferenceCache, lm_head, batch: int):
        self.backbone, self.plan, self.fused_head = backbone, plan, fused_head
        self.cache, self.lm_head, self.batch = cache, lm_head, batch
        self.room = room  # tokens until an attention block's cache is full; -1: no limit
        self.successor = None  # the step prepared again once the cache is full

    @classmethod
    def prepare(cls, backbone, cache: InferenceCache, lm_head: nn.Linear, batch: int | None = None):
        """The prepared step, or None where the fused step does not apply."""
        batch = cache.batch_size if batch is None else batch
        runs = block_runs(backbone, cache, batch)
        return (
            None
            if runs is None
            else cls.from_runs(backbone, runs, head_weights(backbone, lm_head), cache, lm_head, batch)
        )

    @classmethod
    def from_runs(cls, backbone, runs: list, head, cache: InferenceCache, lm_head: nn.Linear, batch: int):
        """The step of the runs ``block_runs`` found, with the head ``head_weights`` gave (None:
        ``lm_head`` runs after the C calls); None where a run cannot be prepared."""
        norm = backbone.norm_f.weight  # the stream's width and dtype (the step widens a 16-bit one)
        plan = []  # (first layer, MambaBlocksStep or None: that layer's own tensor step)
        for first, blocks in runs:
            if blocks is None:
                plan.append((first, None))
                continue
            ends = first + len(blocks) == len(backbone.layers)
            step = MambaBlocksStep.prepare(
                norm.new_empty(batch, norm.shape[0]), blocks, head if ends else None, residual=first > 0
            )
            if step is None:
                return None
            plan.append((first, step))
        # The attention blocks' C step writes each new key and value into the cache in place:
        # after as many tokens as the fullest row has room for, the cache grows (new tensors),
        # so the step is prepared again.
        attention = [w for _, blocks in runs for w in blocks or () if isinstance(w, AttentionBlockWeights)]
        room = min((w.key.shape[1] - int(w.lengths.max()) for w in attention), default=-1)
        return cls(backbone, plan, plan[-1][1] is not None and head is not None, room, cache, lm_head, batch)

    def _prepare_again(self):
        again = FusedStep.prepare(self.backbone, self.cache, self.lm_head, self.batch)
        return again or (lambda ids: self.lm_head(self.backbone(ids, self.cache, step=True)))

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.room == 0 and self.successor is None:
            self.successor = self._prepare_again()
        if self.successor is not None:
            return self.successor(input_ids)
        if self.room > 0:
            self.room -= 1
        layers = self.backbone.layers
        hidden, residual = self.backbone.embedding(input_ids), None
        for first, step in self.plan:
            if step is None:
                hidden, residual = layers[first](hidden, residual, cache=self.cache.layers[first], step=True)
                continue
            step.hidden.copy_(hidden)
            if step.residual is not None:
                step.residual.copy_(residual)
            out = step()
            if step is self.plan[-1][1] and self.fused_head:
                return out
            hidden, residual = out
        residual = hidden + residual if residual is not None else hidden
        norm = self.backbone.norm_f
        return self.lm_head(norm(residual.to(norm.weight.dtype)))
