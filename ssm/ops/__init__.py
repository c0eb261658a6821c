"""The non-scan ops the layers need, each one public function with a backend table like the
scans' (``backend="auto"`` picks per device; a named backend that cannot take the inputs is an
error, never a silent fallback), and a plain reference that every backend is tested against.

    causal_conv1d_silu(x, weight, bias, ...)   SiLU(causal depthwise conv) of x (B, L, D)  (conv.py)
    causal_conv1d(x, weight, bias, ...)        the causal depthwise conv of x (B, D, L)    (conv.py)
    causal_conv1d_step(x, weight, bias, state) its one-token step                          (conv.py)
    rms_norm(x, weight, eps, z=None, ...)      RMSNorm, grouped and gated (Mamba-2)         (norm.py)
    mamba_blocks_step(hidden, blocks, head)    a stack of Mamba-1, -2 or -3 (or attention)
                                               blocks' decoding step and the LM head in one
                                               C call, or None                              (decode.py)
    MambaBlockWeights, Mamba2BlockWeights,     what a layer, a block's MLP and a model hand
    Mamba3BlockWeights, AttentionBlockWeights, that step                                    (step_weights.py)
    GatedMLPWeights, LMHeadWeights
    quantize_matrix(weight, scheme)            a matrix as int8 / int4 with a scale per 32
                                               inputs (QuantizedMatrix), as that step reads it (quant.py)

Backends: "cpu" (C kernels from ssm.native, bound in cpu.py, decode.py and quant_cpu.py, the
last the C reads of a stored matrix that the step and a quantised layer's prefill share) and
"torch" (tensor code, any device). References: reference.py.
"""

from .._backends import lister
from .conv import BACKENDS as _CONV
from .conv import causal_conv1d, causal_conv1d_silu, causal_conv1d_step
from .decode import MambaBlocksStep, mamba_blocks_step
from .norm import BACKENDS as _NORM
from .norm import rms_norm
from .quant import QuantizedMatrix, quantize_matrix
from .reference import (
    causal_conv1d_ref,
    dequantize_ref,
    mamba2_blocks_step_ref,
    mamba_blocks_step_ref,
    quantized_ints_ref,
    quantized_product_ref,
    rms_norm_ref,
    round_activations_ref,
)
from .step_weights import (
    AttentionBlockWeights,
    GatedMLPWeights,
    LMHeadWeights,
    Mamba2BlockWeights,
    Mamba3BlockWeights,
    MambaBlockWeights,
)

# backends(op, device=None): the names of the backends of "causal_conv1d_silu" or "rms_norm";
# with a device, only those that run there ("auto" is always accepted).
backends = lister((_CONV, _NORM))


__all__ = [
    "causal_conv1d",
    "causal_conv1d_silu",
    "causal_conv1d_step",
    "rms_norm",
    "mamba_blocks_step",
    "MambaBlocksStep",
    "MambaBlockWeights",
    "Mamba2BlockWeights",
    "Mamba3BlockWeights",
    "AttentionBlockWeights",
    "GatedMLPWeights",
    "LMHeadWeights",
    "QuantizedMatrix",
    "quantize_matrix",
    "backends",
    "causal_conv1d_ref",
    "rms_norm_ref",
    "mamba_blocks_step_ref",
    "mamba2_blocks_step_ref",
    "dequantize_ref",
    "round_activations_ref",
    "quantized_ints_ref",
    "quantized_product_ref",
]
