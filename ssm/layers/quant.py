"""Weight-only quantised layers: ``QuantLinear`` (an ``nn.Linear`` whose matrix is held as int8
or int4 with a float32 scale per block of 32 inputs, ssm.ops.quant) and ``QuantEmbedding`` (the
embedding of a model whose tied LM head is quantised: it reads the head's integers).

The fused decoding step reads the integers and scales as they are (``decoding_matrix``); the
tensor path (prefill, or where the fused step does not apply) widens a chunk of rows at a time,
so no float copy of a whole matrix is ever made. The scales stay float32 whatever ``.to(dtype)``
the model is given (they follow its device only); the bias, if any, is an ordinary parameter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.quant import (
    BLOCK,
    QuantizedMatrix,
    blocks_per_row,
    check_activations,
    check_scheme,
    dequantize_rows,
    quantize_matrix,
    round_activations,
)
from ..ops.quant_cpu import round_rows, widen_rows

_ROWS = 1024  # rows widened at a time on the tensor path


class QuantLinear(nn.Module):
    """y = x·Wᵀ + b with W (out_features, in_features) quantised by ``scheme`` ("int8", "int4").
    Buffers: ``qweight`` (the integers) and ``scales`` (float32, out_features × ceil(in / 32))."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: str,
        bias: bool = False,
        device=None,
        dtype=None,
        activations: str = "int8",
    ):
        super().__init__()
        check_scheme(scheme)
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.activations = check_activations(activations)  # what the weights multiply (ssm.ops.quant)
        self.dtype = dtype or torch.get_default_dtype()  # the float dtype of the model around it
        nb = blocks_per_row(in_features)
        shape = (out_features, in_features) if scheme == "int8" else (out_features, nb * BLOCK // 2)
        kind = torch.int8 if scheme == "int8" else torch.uint8
        self.register_buffer("qweight", torch.zeros(shape, dtype=kind, device=device))
        self.register_buffer("scales", torch.zeros(out_features, nb, dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str, activations: str = "int8") -> QuantLinear:
        w = linear.weight
        q = quantize_matrix(w, scheme)
        bias = linear.bias is not None
        out = cls(
            linear.in_features, linear.out_features, scheme, bias, device="meta", dtype=w.dtype, activations=activations
        )
        out.qweight, out.scales = q.data, q.scales
        if linear.bias is not None:
            out.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        return out

    def matrix(self) -> QuantizedMatrix:
        return QuantizedMatrix(self.qweight, self.scales, self.scheme, self.in_features, self.activations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.matrix()
        # On the CPU a 16-bit x is multiplied in float32: the widened rows are float32 already,
        # and casting them to bfloat16 would round them and take torch's slower bfloat16 product
        # (ssm.layers.linear); float32 and float64 keep their own dtype. The rows are widened by
        # the C reads where they apply, into one buffer reused chunk after chunk unless autograd
        # keeps the rows for x's gradient.
        cpu = x.device.type == "cpu"
        xc = x.float() if cpu and x.dtype in (torch.bfloat16, torch.float16) else x
        reuse = cpu and not (torch.is_grad_enabled() and x.requires_grad)
        if self.activations == "int8" and x.dtype != torch.float64:  # as the fused step rounds them
            # (a float64 model is for checking: never rounded); in C where it applies: torch's
            # eight passes over a prompt's rows cost a fifth of a 512-token prefill (measured)
            rounded = round_rows(xc) if reuse else None  # (None where x is not a float32 CPU tensor)
            xc = (rounded if rounded is not None else round_activations(xc)).to(xc.dtype)
        buf, parts = None, []
        for lo in range(0, self.out_features, _ROWS):
            hi = min(lo + _ROWS, self.out_features)
            w = widen_rows(q, lo, hi, buf) if cpu else None
            if w is None:
                w = dequantize_rows(q, lo, hi)
            elif reuse and buf is None:
                buf = w
            parts.append(F.linear(xc, w.to(xc.dtype)))
        y = parts[0] if len(parts) == 1 else torch.cat(parts, -1)
        y = y if self.bias is None else y + self.bias.to(y.dtype)
        return y.to(x.dtype)

    def _apply(self, fn, recurse=True):
        # the scales keep float32 whatever dtype the model is moved to; they follow its device
        scales = self._buffers.pop("scales")
        try:
            super()._apply(fn, recurse)
        finally:
            self._buffers["scales"] = scales
        self._buffers["scales"] = scales.to(fn(torch.empty(0, device=scales.device)).device)
        probe = fn(torch.empty(0, dtype=self.dtype))
        self.dtype = probe.dtype if probe.is_floating_point() else self.dtype
        return self

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}, bias={bias}, "
            f"activations={self.activations}"
        )


class QuantEmbedding(nn.Module):
    """The embedding of a model whose LM head, tied to it, is a QuantLinear: row i of the head's
    matrix, widened to the dtype of the head's bias-free float parameters (``dtype``). Holds no
    tensors of its own (the checkpoint stores the head's)."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype):
        super().__init__()
        self._head = [head]  # not a submodule: its tensors belong to the model's lm_head
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self._head[0].matrix()
        flat = ids.reshape(-1)
        rows = QuantizedMatrix(q.data[flat], q.scales[flat], q.scheme, q.in_features)
        return dequantize_rows(rows).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse=True):
        probe = fn(torch.empty(0, dtype=self.dtype))
        self.dtype = probe.dtype if probe.is_floating_point() else self.dtype
        return super()._apply(fn, recurse)


def float_dtype_and_device(linear: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The float dtype and the device of a linear layer's weights: a QuantLinear's model dtype
    (its integers are not float) and its integers' device."""
    if isinstance(linear, QuantLinear):
        return linear.dtype, linear.qweight.device
    return linear.weight.dtype, linear.weight.device


def decoding_matrix(linear: nn.Module):
    """What a fused decoding step reads for a linear layer: its weight, or a QuantLinear's
    QuantizedMatrix."""
    return linear.matrix() if isinstance(linear, QuantLinear) else linear.weight
