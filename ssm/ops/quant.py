"""Weight-only quantisation of a matrix, in the formats the fused decoding step reads
(ssm/native/decode_weights.c): ``QuantizedMatrix`` holds the integers and their scales,
``quantize_matrix`` makes one from a float matrix, ``dequantize_rows`` widens some of its rows
back (the per-op path, a chunk of rows at a time: never a float copy of the whole matrix).

Schemes, for a matrix W (O, I) and nb = ceil(I / 32) blocks of 32 inputs per row:

    "int8": data int8 (O, I), q = round(W / s) in [-127, 127], s = max|W| over the block / 127;
    "int4": data uint8 (O, 16·nb), two inputs a byte: byte k of block j holds input 32j + k in
            its low nibble and 32j + 16 + k in its high one, each q + 8 with
            q = round(W / s) in [-8, 7], s = max|W| over the block / 7 (a short last block is
            padded with q = 0).

scales float32 (O, nb); W ≈ q · s. Blocks of 32 along the input dimension rather than one scale
per output row: a scale then covers 32 weights, so one outlier costs the precision of 31
others, not of the whole row (768 to 1536 weights in Mamba's projections); it is the layout of
llama.cpp's q8_0 / q4_0 (so the two are compared like with like), and int4 needs it (one scale
per row of 16 levels loses too much). The cost is 4 bytes of scale per 32 weights (1.125 bytes a
weight for int8), and a multiply per block in the dot products.

Activations (what a quantised layer multiplies its weights by), one of ACTIVATIONS:

    "int8" (``MambaLM.quantize``'s default): the layer's input rounded to int8 per block of 32
            (``round_activations``: d = max|x| / 127 per block), so that a block's products are
            integers summed exactly and scaled once, as llama.cpp's q8_0 / q4_0 compute them.
            The fused CPU step then runs integer instructions (AVX2's vpmaddubsw, AVX-512 VNNI's
            vpdpbusd): 1.24x to 1.65x the tokens per second of float inputs at mamba-130m's size
            (docs/benchmarks-history/2026-11-cpu-decoding.md, "int8 activations"); the tensor path
            rounds the same way.
    "float32": the input as it is (float32 products of the widened weights): exact to float32
            rounding, slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK = 32  # inputs per scale
SCHEMES = ("int8", "int4")
ACTIVATIONS = ("float32", "int8")
_QMAX = {"int8": 127, "int4": 7}


def check_activations(activations, name: str = "activations") -> str:
    """``activations`` if it is one of ACTIVATIONS, else a ValueError naming argument ``name``."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"{name} must be one of {list(ACTIVATIONS)}, got {activations!r}")
    return activations


def round_activations(x: Tensor) -> Tensor:
    """x (..., I) as the int8-activation products see it (``activations="int8"``; the fused
    step's C code, decode_weights.c, does the same in float32): per block of 32 along the last
    dimension, d = max|x| / 127 and q = round(x · (1 / d)) (to nearest, ties to even); returns
    q · d in float32, NaN over a block holding a NaN or an infinity. The gradient passes
    straight through (the rounding's own is zero almost everywhere)."""
    x32 = x.float()
    n = x32.shape[-1]
    nb = blocks_per_row(n)
    blocks = torch.nn.functional.pad(x32, (0, nb * BLOCK - n)).unflatten(-1, (nb, BLOCK))
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 1 / d, torch.zeros_like(d))
    rounded = torch.round(blocks * inv) * d
    rounded = torch.where(torch.isfinite(amax), rounded, torch.full_like(rounded, float("nan")))
    rounded = rounded.flatten(-2)[..., :n]
    return x32 + (rounded - x32).detach() if x.requires_grad else rounded


def check_scheme(scheme, name: str = "scheme") -> str:
    """``scheme`` if it is one of SCHEMES, else a ValueError naming argument ``name``."""
    if scheme not in SCHEMES:
        raise ValueError(f"{name} must be one of {list(SCHEMES)}, got {scheme!r}")
    return scheme


@dataclass(frozen=True)
class QuantizedMatrix:
    """A matrix of ``out_features`` rows of ``in_features`` inputs in one of SCHEMES (see the
    module's docstring for the layout)."""

    data: Tensor  # int8 (O, I) or uint8 (O, 16·nb)
    scales: Tensor  # float32 (O, nb)
    scheme: str
    in_features: int
    activations: str = "float32"  # "int8": the products round their inputs (round_activations)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.in_features)


def blocks_per_row(in_features: int) -> int:
    return (in_features + BLOCK - 1) // BLOCK


def quantize_matrix(weight: Tensor, scheme: str, rows_per_chunk: int = 1024) -> QuantizedMatrix:
    """``weight`` (O, I), any float dtype, as a QuantizedMatrix (on its device), a chunk of rows
    at a time."""
    check_scheme(scheme)
    if not isinstance(weight, Tensor) or weight.ndim != 2 or not weight.is_floating_point():
        got = f"shape {tuple(weight.shape)} {weight.dtype}" if isinstance(weight, Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a 2-d float tensor, got {got}")
    rows, cols = weight.shape
    nb, qmax = blocks_per_row(cols), _QMAX[scheme]
    data = torch.empty(rows, cols if scheme == "int8" else nb * BLOCK // 2, dtype=torch.int8, device=weight.device)
    if scheme == "int4":
        data = data.view(torch.uint8)
    scales = torch.empty(rows, nb, dtype=torch.float32, device=weight.device)
    for lo in range(0, rows, rows_per_chunk):
        hi = min(rows, lo + rows_per_chunk)
        w = torch.nn.functional.pad(weight[lo:hi].detach().double(), (0, nb * BLOCK - cols))
        w = w.reshape(hi - lo, nb, BLOCK)
        s = (w.abs().amax(-1) / qmax).float()  # (rows, nb)
        q = torch.round(w / s.double().clamp_min(torch.finfo(torch.float32).tiny)[..., None])
        q = q.clamp(-qmax - (scheme == "int4"), qmax)
        scales[lo:hi] = s
        if scheme == "int8":
            data[lo:hi] = q.reshape(hi - lo, nb * BLOCK)[:, :cols].to(torch.int8)
        else:
            nib = (q + 8).to(torch.uint8)  # (rows, nb, 32)
            data[lo:hi] = (nib[..., : BLOCK // 2] | (nib[..., BLOCK // 2 :] << 4)).reshape(hi - lo, -1)
    return QuantizedMatrix(data=data, scales=scales, scheme=scheme, in_features=cols)


def dequantize_rows(q: QuantizedMatrix, lo: int = 0, hi: int | None = None) -> Tensor:
    """Rows lo .. hi-1 of the matrix, in float32 (rows, I)."""
    hi = q.data.shape[0] if hi is None else hi
    data, s = q.data[lo:hi], q.scales[lo:hi]
    rows, nb = s.shape
    if q.scheme == "int8":
        ints = torch.nn.functional.pad(data.float(), (0, nb * BLOCK - q.in_features)).reshape(rows, nb, BLOCK)
    else:
        b = data.reshape(rows, nb, BLOCK // 2)
        ints = torch.cat([(b & 15), (b >> 4)], -1).float() - 8  # (rows, nb, 32)
    return (ints * s[..., None]).reshape(rows, nb * BLOCK)[:, : q.in_features].contiguous()
