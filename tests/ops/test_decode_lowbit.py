"""The fused decoding steps (Mamba-1 and Mamba-2, ssm.ops.mamba_blocks_step) with their matrices
stored narrow — bfloat16, float16, int8 and int4 with a scale per block of 32 inputs — against
the float64 references run on the same weights widened (ssm.ops.dequantize_ref, which shares no
code with the C reads nor with ssm.ops.quant): logits and both states of every block. Sizes
give each matrix full blocks of 32 and a short last one. The quantiser itself: its round trip
and its errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssm import ops
from ssm.native import ISA_LEVELS, library
from ssm.ops import LMHeadWeights, QuantizedMatrix, quantize_matrix

from .test_against_reference import random_blocks as mamba1_blocks
from .test_decode_mamba2 import random_blocks as mamba2_blocks

FORMATS = ["bfloat16", "float16", "int8", "int4"]
MATRICES = ("in_proj_weight", "x_proj_weight", "dt_proj_weight", "out_proj_weight", "fc1_weight", "fc2_weight")


def narrow(t, fmt):
    if fmt in ("int8", "int4"):
        return quantize_matrix(t, fmt)
    return t.to(getattr(torch, fmt))


def store(blocks, fmt, vectors_16bit=False):
    """The blocks with every matrix in ``fmt`` (dt_proj too, except for the int formats, where a
    model keeps it float); with ``vectors_16bit`` the norms, biases, conv, A, D in ``fmt`` too."""
    out = []
    for blk in blocks:
        change = {}
        for f in dataclasses.fields(blk):
            v = getattr(blk, f.name)
            if f.name in MATRICES and not (f.name == "dt_proj_weight" and fmt in ("int8", "int4")):
                change[f.name] = narrow(v, fmt)
            elif vectors_16bit and isinstance(v, torch.Tensor) and "state" not in f.name:
                change[f.name] = v.to(getattr(torch, fmt))
        if getattr(blk, "mlp", None) is not None:
            change["mlp"] = dataclasses.replace(
                blk.mlp, fc1_weight=narrow(blk.mlp.fc1_weight, fmt), fc2_weight=narrow(blk.mlp.fc2_weight, fmt)
            )
        out.append(dataclasses.replace(blk, **change))
    return out


def make(kind, dtype, g):
    if kind == "mamba1":  # M 40 (one block and 8), D 70 (two and 6), R 3
        return mamba1_blocks(3, 2, 40, 70, 4, 3, 4, g, dtype), 40
    # M 40, S 36 (heads 4 of 9), F 35, an MLP-branch Q 5, groups 2
    return mamba2_blocks(3, 2, 40, 4, 9, 4, 2, 4, dtype, g, Q=5, F=35), 40


@pytest.mark.parametrize(
    "compute, isa", [(torch.float64, "auto")] + [(torch.float32, level) for level in ("auto", *ISA_LEVELS)]
)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_narrow_matrices_against_the_reference_on_the_same_weights(kind, fmt, compute, isa, monkeypatch):
    """float64 compute isolates the reads (tolerance 1e-10: a wrong scale, block or nibble
    shows); float32 is what a model runs, at each instruction-set level (SSM_CPU_ISA: the
    portable C and each intrinsics path this CPU has; tests/ops/test_decode_simd.py bounds
    their products more tightly)."""
    if library() is None:
        pytest.fail("the C library did not build: the low-precision fused steps are untested")
    if isa != "auto" and ISA_LEVELS.index(isa) > library().ssm_cpu_isa():
        pytest.skip(f"this CPU does not run {isa}")
    monkeypatch.setenv("SSM_CPU_ISA", isa)
    g = torch.Generator().manual_seed(11)
    blocks, M = make(kind, compute, g)
    blocks = store(blocks, fmt)
    head = LMHeadWeights(1 + 0.1 * torch.randn(M, generator=g, dtype=compute), 1e-5, torch.randn(37, M, generator=g))
    head = dataclasses.replace(head, weight=narrow(head.weight, fmt))
    hidden = torch.randn(2, M, generator=g, dtype=compute)
    tol = dict(rtol=1e-10, atol=1e-10) if compute == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    for _ in range(3):  # three tokens: the states carry
        want, conv_states, ssm_states = (ops.mamba_blocks_step_ref if kind == "mamba1" else ops.mamba2_blocks_step_ref)(
            hidden, blocks, head
        )
        got = ops.mamba_blocks_step(hidden, blocks, head)
        assert got is not None, f"the C step declined {fmt} matrices"
        assert got.dtype == compute
        torch.testing.assert_close(got.double(), want, **tol)
        for blk, conv, ssm in zip(blocks, conv_states, ssm_states):
            torch.testing.assert_close(blk.conv_state.double(), conv, **tol)
            torch.testing.assert_close(blk.ssm_state.double(), ssm, **tol)
        hidden = torch.randn(2, M, generator=g, dtype=compute)


@pytest.mark.parametrize("fmt", ["bfloat16", "float16"])
def test_a_16bit_model_steps_in_float32(fmt):
    """Every tensor but the states in 16 bits (a model after .to(bfloat16)): the step widens
    the vectors once, keeps the stream, the states and the sums in float32, and gives float32
    logits equal to the float64 reference on the same 16-bit values."""
    if library() is None:
        pytest.fail("the C library did not build")
    g = torch.Generator().manual_seed(12)
    blocks = store(mamba2_blocks(2, 2, 40, 4, 9, 4, 2, 4, torch.float32, g, F=35), fmt, vectors_16bit=True)
    narrowed = getattr(torch, fmt)
    head = LMHeadWeights(torch.ones(40, dtype=narrowed), 1e-5, torch.randn(37, 40, generator=g).to(narrowed))
    hidden = torch.randn(2, 40, generator=g).to(narrowed)
    want, _, ssm_states = ops.mamba2_blocks_step_ref(hidden, blocks, head)
    got = ops.mamba_blocks_step(hidden, blocks, head)
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    for blk, ssm in zip(blocks, ssm_states):
        assert blk.ssm_state.dtype == torch.float32
        torch.testing.assert_close(blk.ssm_state.double(), ssm, rtol=1e-4, atol=1e-4)


def test_states_of_another_dtype_are_declined():
    """A 16-bit state would round the recurrence every token: the step declines it (the model
    keeps its states in float32)."""
    g = torch.Generator().manual_seed(13)
    blocks = mamba1_blocks(1, 1, 40, 70, 4, 3, 4, g, torch.float32)
    blk = dataclasses.replace(blocks[0], ssm_state=blocks[0].ssm_state.bfloat16())
    assert ops.mamba_blocks_step(torch.randn(1, 40), [blk]) is None
    blk = dataclasses.replace(blocks[0], in_proj_weight=blocks[0].in_proj_weight.to(torch.int32))
    assert ops.mamba_blocks_step(torch.randn(1, 40), [blk]) is None


def test_a_strided_hidden_is_read_as_its_values():
    """A 16-bit or strided input (an embedding's rows sliced out of wider ones) is copied into
    the step's own contiguous float32 stream, never read by its storage."""
    g = torch.Generator().manual_seed(15)
    blocks = mamba1_blocks(1, 3, 40, 70, 4, 3, 4, g, torch.float32)
    wide = torch.randn(3, 64, generator=g)
    copies = [dataclasses.replace(b, conv_state=b.conv_state.clone(), ssm_state=b.ssm_state.clone()) for b in blocks]
    want = ops.mamba_blocks_step(wide[:, :40].contiguous(), copies)
    for hidden in (wide[:, :40], wide[:, :40].bfloat16().float()):
        copies = [
            dataclasses.replace(b, conv_state=b.conv_state.clone(), ssm_state=b.ssm_state.clone()) for b in blocks
        ]
        got = ops.mamba_blocks_step(hidden, copies)
        if hidden.is_contiguous():
            continue
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantize_matrix_round_trip(scheme):
    """Each weight within half a step of its block's scale; the scale is the block's largest
    magnitude over the largest level; zero blocks stay zero; short last blocks."""
    g = torch.Generator().manual_seed(14)
    w = torch.randn(5, 70, generator=g)
    w[1, 32:64] = 0
    w[2, 5] = 40.0  # an outlier: only its own block's scale grows
    q = quantize_matrix(w, scheme)
    levels = 127 if scheme == "int8" else 7
    assert q.scales.shape == (5, 3) and q.scales.dtype == torch.float32
    assert q.data.shape == ((5, 70) if scheme == "int8" else (5, 48))
    back = ops.dequantize_ref(q)
    step = torch.repeat_interleave(q.scales.double(), 32, 1)[:, :70]
    assert ((back - w.double()).abs() <= step / 2 + 1e-6).all()
    torch.testing.assert_close(q.scales[2, 0], torch.tensor(40.0 / levels))
    assert q.scales[2, 1] < 1
    assert (back[1, 32:64] == 0).all()


def test_quantize_matrix_errors_name_the_argument():
    with pytest.raises(ValueError, match="scheme must be one of"):
        quantize_matrix(torch.randn(3, 4), "int3")
    with pytest.raises(ValueError, match="weight must be a 2-d float tensor"):
        quantize_matrix(torch.randn(3, 4, 5), "int8")
    assert isinstance(quantize_matrix(torch.randn(3, 4), "int8"), QuantizedMatrix)
