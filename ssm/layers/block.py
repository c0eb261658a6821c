"""The residual block of the language model and its optional gated MLP (mamba-ssm's layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import GatedMLPWeights
from .cache import LayerCache
from .linear import Linear
from .norm import RMSNorm, upcast
from .quant import decoding_matrix


class GatedMLP(nn.Module):
    """fc1 (2·hidden, d) → split (y, gate) → y·silu(gate) → fc2 (d, hidden), no biases.
    ``hidden`` is rounded up to a multiple of ``multiple_of``, as in mamba-ssm."""

    def __init__(self, d_model: int, hidden: int, multiple_of: int = 128, device=None, dtype=None):
        super().__init__()
        hidden = (hidden + multiple_of - 1) // multiple_of * multiple_of
        self.fc1 = Linear(d_model, 2 * hidden, bias=False, device=device, dtype=dtype)
        self.fc2 = Linear(hidden, d_model, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, gate = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(y * F.silu(gate))


class Block(nn.Module):
    """residual ← hidden + residual; hidden ← mixer(norm(residual)); then, with an MLP,
    residual ← hidden + residual; hidden ← mlp(norm2(residual)).

    Returns (hidden, residual) — the addition of the last hidden is left to the next block (or
    to the final norm), as in mamba-ssm. The residual stream is kept in float32 when
    ``residual_in_fp32``. Submodules: norm, mixer, and optionally norm2, mlp.

    ``step_weights(cache)``: what the fused decoding step of this block needs
    (``ssm.ops.MambaBlockWeights`` or ``Mamba2BlockWeights``, see the model's backbone), or None
    where there is none (a mixer without one, an MLP or norm the step does not run).
    """

    def __init__(
        self,
        mixer: nn.Module,
        norm: nn.Module,
        mlp: nn.Module | None = None,
        norm2: nn.Module | None = None,
        residual_in_fp32: bool = True,
    ):
        super().__init__()
        self.norm, self.mixer = norm, mixer
        if mlp is not None:
            self.norm2, self.mlp = norm2, mlp
        else:
            self.mlp = None
        self.residual_in_fp32 = residual_in_fp32

    def step_weights(self, cache: LayerCache):
        if not hasattr(self.mixer, "step_weights"):
            return None
        if self.mlp is None:
            return self.mixer.step_weights(self.norm, cache)
        if not isinstance(self.mlp, GatedMLP) or not isinstance(self.norm2, RMSNorm):
            return None
        mlp = GatedMLPWeights(
            norm_weight=self.norm2.weight,
            norm_eps=self.norm2.eps,
            fc1_weight=decoding_matrix(self.mlp.fc1),
            fc2_weight=decoding_matrix(self.mlp.fc2),
        )
        return self.mixer.step_weights(self.norm, cache, mlp=mlp)

    def _add(self, hidden, residual):
        residual = hidden if residual is None else hidden + residual
        return upcast(residual) if self.residual_in_fp32 else residual

    def forward(
        self,
        hidden,
        residual=None,
        cache: LayerCache | None = None,
        step: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        last: int = 0,
        cp_group=None,
    ):
        """``cu_seqlens``: packed sequences (batch 1), passed to the mixer (the norms and the MLP
        act on each position alone). ``last`` > 0 (a sequence (batch, L, d), no cu_seqlens):
        return only the last ``last`` positions of (hidden, residual), for a caller that reads
        no others (the last block under ``MambaLM.forward(num_last_tokens=)``); the cache is
        advanced over all L. A mixer whose forward takes ``last`` computes only those positions
        after its scan; any other's output is cut. ``cp_group``: context parallelism, passed to
        the mixer (see ``Mamba2.forward``)."""
        residual = self._add(hidden, residual)
        normed = self.norm(residual.to(self.norm.weight.dtype))
        if cp_group is not None:
            hidden = self.mixer(normed, cache=cache, cu_seqlens=cu_seqlens, cp_group=cp_group)
        elif step:
            hidden = self.mixer.step(normed, cache)
        elif cu_seqlens is not None:
            hidden = self.mixer(normed, cache=cache, cu_seqlens=cu_seqlens)
        elif last > 0 and getattr(self.mixer, "computes_last", False):
            hidden = self.mixer(normed, cache=cache, last=last)
            residual = residual[:, -last:]
        else:
            hidden = self.mixer(normed, cache=cache)
            if last > 0:
                hidden, residual = hidden[:, -last:], residual[:, -last:]
        if self.mlp is not None:
            residual = self._add(hidden, residual)
            hidden = self.mlp(self.norm2(residual.to(self.norm2.weight.dtype)))
        return hidden, residual
