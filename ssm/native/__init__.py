"""The compiled CPU kernels of ssm: C sources by op family and the one module that builds, caches
and loads them (build.py).

    library.c       the one translation unit: includes every family twice (float, double)
    common.h        C headers, fast exp / log1p, packed-sequence bounds, scheduling helpers
    common_real.h   softplus, sigmoid and the per-thread sums, for each REAL
    selective.c     the selective scan's sweeps and its one-token step  (bound in ssm/scan/cpu.py)
    linear.c        the first-order linear scan                         (ssm/scan/cpu.py)
    conv.c          the causal depthwise conv with SiLU                 (ssm/ops/cpu.py)
    norm.c          RMSNorm and the gated, grouped RMSNorm              (ssm/ops/cpu.py)
    decode_weights.c  the steps' matrices in f32, bf16, f16, int8, int4, int8 activations (portable C)
                    (the matrix and its reads bound in ssm/ops/quant_cpu.py)
    decode_simd.c   the same products in AVX2 / AVX-512 (VNNI) intrinsics, chosen at run time (cpu_isa)
    decode.c        a stack of Mamba-1 blocks' decoding step            (ssm/ops/decode.py)
    decode_mamba2.c a stack of Mamba-2 blocks' decoding step            (ssm/ops/decode.py)
    trapezoidal.c   Mamba-3's scan output: diagonal, skip term, gate    (ssm/scan/trapezoidal_cpu.py)
    _buffers.py     the pool the kernels' large outputs come from

Nothing here knows a layer or a model: the kernels take pointers, sizes and strides in
argument structs, which the binding modules mirror with ctypes.
"""

from ._buffers import pool
from .build import (
    ISA_LEVELS,
    build_in_background,
    cache_dir,
    cpu_isa,
    declare,
    empty,
    flushed_subnormals,
    kernel,
    library,
    ptr,
    ready,
    strides3,
    threads,
)

__all__ = [
    "ISA_LEVELS",
    "build_in_background",
    "cache_dir",
    "cpu_isa",
    "declare",
    "empty",
    "flushed_subnormals",
    "kernel",
    "library",
    "pool",
    "ptr",
    "ready",
    "strides3",
    "threads",
]
