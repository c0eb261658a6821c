"""``Linear``: ``nn.Linear`` (same parameters, same state-dict keys) whose bfloat16 matrix
products on the CPU run in float32 when there are enough rows.

torch's bfloat16 matrix product on the CPU ran slower than widening both operands to float32
and multiplying those: 512 rows × (3352 × 768), 15.1 ms against 8.9 (1.7x), and 1.17x at 64
rows, 2 threads, torch 2.13 on an AVX512_BF16 Xeon; below 64 rows the widening costs more than
it saves (0.37x at 1 row). So a prompt's prefill widens, a decoding step's product does not.
float16 gained nothing the same way (1.02x at 512 rows) and keeps torch's own product.

The widened product is the exact products of the same bfloat16 values summed in float32, the
output rounded to bfloat16 once: what a bfloat16 product with float32 accumulation computes,
in another summation order. Gradients flow through the widening as through any cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDEN_MIN_ROWS = 64  # the fewest rows for which widening paid (above)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, in float32 for a bfloat16 ``x`` and ``weight`` on the CPU
    with at least WIDEN_MIN_ROWS rows of ``x``; the result in ``x``'s dtype either way."""
    wide = weight.dtype == torch.bfloat16 and x.dtype == weight.dtype and weight.device.type == "cpu"
    if wide and x.numel() >= WIDEN_MIN_ROWS * x.shape[-1]:
        y = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return y.to(x.dtype)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear whose forward is ``linear`` above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
