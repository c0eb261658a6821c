"""Which kernel each SSM_CPU_ISA level dispatches to (ssm/native/decode_simd.c), not only the
numbers it gives (test_decode_simd.py checks those): a level must never run an instruction its
CPU lacks. On an AVX-512 CPU without VNNI, the VNNI kernel at the AVX-512 level is an illegal
instruction, which no test of the numbers on a VNNI machine would see.

The library answers by name (``ssm_decode_kernel``: the dispatch's own code picks the kernel,
and each kernel's table entry carries its function's identifier) for any level on any CPU
level, simulated, so every row of the table below is checked on whatever machine runs the test.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ssm.native import ISA_LEVELS, library
from ssm.ops import quantize_matrix
from ssm.ops.quant_cpu import decode_kernel

# what the fused step reads: a format, as (WMat.type, WMat.act) and a matrix in it
FORMATS = {
    "float32": (0, 0),
    "bfloat16": (1, 0),
    "float16": (2, 0),
    "int8": (3, 0),
    "int4": (4, 0),
    "int8, int8 activations": (3, 1),
    "int4, int8 activations": (4, 1),
}

# the kernel each level runs for each format, on a CPU that runs the level
TABLE = {
    "portable": dict.fromkeys(FORMATS, "portable")
    | {"int8, int8 activations": "qdot_rows_portable", "int4, int8 activations": "qdot_rows_portable"},
    "avx2": {
        "float32": "dot4_f32_256",
        "bfloat16": "dot4_bf16_256",
        "float16": "dot4_f16_256",
        "int8": "dot4_q8_256",
        "int4": "dot4_q4_256",
        "int8, int8 activations": "qdot4_256",
        "int4, int8 activations": "qdot4_256",
    },
    "avx512": {
        "float32": "dot4_f32_512",
        "bfloat16": "dot4_bf16_512",
        "float16": "dot4_f16_512",
        "int8": "dot4_q8_512",
        "int4": "dot4_q4_512",
        "int8, int8 activations": "qdot4_256",  # no VNNI at this level: AVX2's vpmaddubsw
        "int4, int8 activations": "qdot4_256",
    },
    "avx512vnni": {
        "float32": "dot4_f32_512",
        "bfloat16": "dot4_bf16_512",
        "float16": "dot4_f16_512",
        "int8": "dot4_q8_512",
        "int4": "dot4_q4_512",
        "int8, int8 activations": "qdot4_vnni",
        "int4, int8 activations": "qdot4_vnni",
    },
}

# the level whose instructions each kernel runs (its target attribute in decode_simd.c)
NEEDS = {"portable": "portable", "qdot_rows_portable": "portable", "qdot4_256": "avx2", "qdot4_vnni": "avx512vnni"}
NEEDS |= {f"dot4_{f}_256": "avx2" for f in ("f32", "bf16", "f16", "q8", "q4")}
NEEDS |= {f"dot4_{f}_512": "avx512" for f in ("f32", "bf16", "f16", "q8", "q4")}


def asked(level: str, fmt: str, cpu: str) -> str:
    if library() is None:
        pytest.fail("the C library did not build: the dispatch is untested")
    wtype, act = FORMATS[fmt]
    return library().ssm_decode_kernel(ISA_LEVELS.index(level), wtype, act, ISA_LEVELS.index(cpu)).decode()


@pytest.mark.parametrize("cpu", ISA_LEVELS)
def test_each_level_runs_the_kernel_of_the_table(cpu):
    """On a CPU whose best level is ``cpu``, a level it runs dispatches as the table says; a
    level above it (asked for by a step prepared elsewhere) falls back to the portable code."""
    for level, fmt in itertools.product(ISA_LEVELS, FORMATS):
        runs = ISA_LEVELS.index(level) <= ISA_LEVELS.index(cpu)
        want = TABLE[level if runs else "portable"][fmt]
        assert asked(level, fmt, cpu) == want, f"level {level}, {fmt}, on a CPU of level {cpu}"


def test_no_level_runs_an_instruction_its_cpu_lacks():
    """Whatever the table says: the kernel any level dispatches to on any CPU needs at most
    what that CPU runs (the AVX-512 CPU without VNNI among them)."""
    for cpu, level, fmt in itertools.product(ISA_LEVELS, ISA_LEVELS, FORMATS):
        name = asked(level, fmt, cpu)
        assert name in NEEDS, f"an unknown kernel {name!r}: add it to NEEDS with the level it needs"
        needs = NEEDS[name]
        assert ISA_LEVELS.index(needs) <= ISA_LEVELS.index(cpu), (
            f"on a CPU of level {cpu}, level {level} runs {name} for {fmt}, which needs {needs}"
        )


def weights(fmt: str):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    if fmt in ("float32", "bfloat16", "float16"):
        return w.to(getattr(torch, fmt))
    q = quantize_matrix(w, fmt.split(",")[0])
    return q if "activations" not in fmt else type(q)(q.data, q.scales, q.scheme, q.in_features, "int8")


def test_SSM_CPU_ISA_reaches_the_dispatch(monkeypatch):
    """Each level this CPU runs, asked for by SSM_CPU_ISA, prepares the step's matrices at that
    level (ssm.ops.quant_cpu.Feed) and runs the table's kernel; unset, the best level's."""
    best = ISA_LEVELS[library().ssm_cpu_isa()]
    for level in ISA_LEVELS[: ISA_LEVELS.index(best) + 1]:
        monkeypatch.setenv("SSM_CPU_ISA", level)
        for fmt in FORMATS:
            assert decode_kernel(weights(fmt)) == TABLE[level][fmt], (level, fmt)
    monkeypatch.delenv("SSM_CPU_ISA")
    assert decode_kernel(weights("int8, int8 activations")) == TABLE[best]["int8, int8 activations"]
