"""The fused steps' matrix-vector products at every instruction-set level this CPU runs
(ssm/native/decode_simd.c's AVX2 and AVX-512 intrinsics, and the portable C, forced by
SSM_CPU_ISA): each format (float32, bfloat16, float16, int8, int4) against a float64 product of
the same stored weights widened by ops.dequantize_ref (no code shared with the C reads), at
sizes that leave every kind of tail (past the last full vector of 8, 16 or 32 inputs, a short
last block of 32, a last group of fewer than 4 rows); and small models decoding the same greedy
tokens at each level as with the portable code.

Tolerance of a product, per output: (n + 4)·2⁻²⁴·Σᵢ|wᵢ·xᵢ|, the float32 rounding bound of n
products summed in any order (each weight is widened exactly and the activations are not
rounded, so the order of the additions is the only difference between the levels). A weight
read wrongly (a nibble swapped, a scale missing, a tail block dropped) moves an output by about
one |wᵢ·xᵢ| ≈ Σ/n, far above (n + 4)·2⁻²⁴·Σ at these n."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.native import ISA_LEVELS, cpu_isa, library
from ssm.ops import (
    decode,
    dequantize_ref,
    quantize_matrix,
    quantized_ints_ref,
    quantized_product_ref,
    round_activations_ref,
)
from ssm.ops.quant_cpu import decode_matvec


def levels() -> list[str]:
    """The levels this CPU runs, portable first."""
    if library() is None:
        pytest.fail("the C library did not build: the matrix reads are untested")
    return list(ISA_LEVELS[: library().ssm_cpu_isa() + 1])


FORMATS = ["float32", "bfloat16", "float16", "int8", "int4"]
SIZES = [1, 7, 8, 15, 16, 17, 31, 32, 33, 47, 48, 63, 64, 65, 100, 129, 768]


def stored(w: torch.Tensor, fmt: str):
    """w in fmt, and the float64 weights that fmt holds."""
    if fmt in ("int8", "int4"):
        q = quantize_matrix(w, fmt)
        return q, dequantize_ref(q)
    narrow = w.to(getattr(torch, fmt))
    return narrow, narrow.double()


def assert_every_level_within(found, mat, x, want, bound, what, monkeypatch):
    """decode_matvec(mat, x) at each level in ``found`` is within ``bound`` of ``want`` (float64,
    per output)."""
    for level in found:
        monkeypatch.setenv("SSM_CPU_ISA", level)
        err = (decode_matvec(mat, x, nthreads=1).double() - want).abs()
        assert (err <= bound).all(), (
            f"{what} at {level}: error {err.max().item():.3g} above the bound "
            f"{bound[err.argmax()].item():.3g} (row {err.argmax().item()})"
        )


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_level_reads_every_format_as_the_float64_product(fmt, monkeypatch):
    g = torch.Generator().manual_seed(21)
    found = levels()
    for n in SIZES:
        for n_out in (1, 3, 4, 5, 9):
            w = torch.randn(n_out, n, generator=g) * torch.rand(n_out, 1, generator=g) * 3
            x = torch.randn(n, generator=g)
            mat, wide = stored(w, fmt)
            want = wide @ x.double()
            bound = (n + 4) * 2.0**-24 * (wide.abs() @ x.double().abs()) + 1e-30
            assert_every_level_within(found, mat, x, want, bound, f"{fmt}, {n_out}x{n}", monkeypatch)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_every_level_multiplies_int8_activations_as_the_float64_integer_product(scheme, monkeypatch):
    """activations="int8": x rounded per block (round_activations_ref, float32 operations one
    input at a time), each block's integer sum exact, scaled by (weight scale · d). The levels
    differ only in the order of the float32 additions of the scaled sums (and of a VNNI lane's
    partial sums), bounded by (nb + 20)·2⁻²³·Σⱼ sⱼ·dⱼ·Σₖ|wₖ·qₖ|; an activation rounded one step
    the wrong way moves an output by sⱼ·dⱼ·|w| ≈ that sum / (32·nb), well above the bound."""
    g = torch.Generator().manual_seed(23)
    found = levels()
    for n in SIZES + [1000, 1536]:
        for n_out in (1, 3, 4, 5, 9):
            w = torch.randn(n_out, n, generator=g) * torch.rand(n_out, 1, generator=g) * 3
            x = torch.randn(n, generator=g) * torch.rand(n, generator=g) ** 4 * 2  # uneven blocks
            if n > 40:
                x[:32] = 0  # a block of zeros (d = 0)
            mat = dataclasses.replace(quantize_matrix(w, scheme), activations="int8")
            want = quantized_product_ref(mat, x)
            q, d = round_activations_ref(x)
            terms = quantized_ints_ref(mat).abs() * torch.tensor(q, dtype=torch.float64).abs()  # |w·q| per input
            blocks = torch.stack([terms[:, 32 * j : 32 * j + 32].sum(1) for j in range(len(d))], 1)
            mags = (blocks * mat.scales.double() * torch.tensor(d, dtype=torch.float64)).sum(1)
            bound = (len(d) + 20) * 2.0**-23 * mags + 1e-30
            assert_every_level_within(found, mat, x, want, bound, f"{scheme}, {n_out}x{n}", monkeypatch)


def test_int8_activations_of_a_non_finite_block_give_nan(monkeypatch):
    """A NaN or an infinity among the inputs makes every output NaN (each row reads every
    block), never a number computed from a silently clipped input."""
    w = quantize_matrix(torch.randn(6, 70), "int8")
    mat = dataclasses.replace(w, activations="int8")
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = torch.randn(70)
        x[40] = bad
        for level in levels():
            monkeypatch.setenv("SSM_CPU_ISA", level)
            assert decode_matvec(mat, x, nthreads=1).isnan().all(), (bad, level)


def test_threads_split_the_rows_without_changing_a_bit(monkeypatch):
    """Each output is one thread's sum whatever the number of threads (rows are split, never
    the inputs)."""
    g = torch.Generator().manual_seed(22)
    w, x = torch.randn(50, 100, generator=g), torch.randn(100, generator=g)
    for level in levels():
        monkeypatch.setenv("SSM_CPU_ISA", level)
        q4 = quantize_matrix(w, "int4")
        for mat in (w, w.bfloat16(), q4, dataclasses.replace(q4, activations="int8")):
            assert torch.equal(decode_matvec(mat, x, nthreads=1), decode_matvec(mat, x, nthreads=2))


def test_the_level_asked_for_is_the_level_run_or_an_error(monkeypatch):
    best = levels()[-1]
    monkeypatch.delenv("SSM_CPU_ISA", raising=False)
    assert ISA_LEVELS[cpu_isa()] == best
    monkeypatch.setenv("SSM_CPU_ISA", "auto")
    assert ISA_LEVELS[cpu_isa()] == best
    monkeypatch.setenv("SSM_CPU_ISA", "portable")
    assert cpu_isa() == 0
    monkeypatch.setenv("SSM_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="SSM_CPU_ISA must be"):
        cpu_isa()
    if best != ISA_LEVELS[-1]:  # a CPU without AVX-512: asking for it is an error, not a fallback
        monkeypatch.setenv("SSM_CPU_ISA", ISA_LEVELS[-1])
        with pytest.raises(ValueError, match="this CPU runs at most"):
            cpu_isa()


def tiny(layer: str) -> MambaLM:
    torch.manual_seed(3)
    ssm_cfg = {"d_state": 8} if layer == "Mamba1" else {"layer": "Mamba2", "d_state": 8, "headdim": 8}
    model = MambaLM(MambaConfig(d_model=80, n_layer=2, vocab_size=61, ssm_cfg=ssm_cfg)).eval()
    with torch.no_grad():  # weights larger than the init's: the logits spread, a misread shows
        for name, p in model.named_parameters():
            if name.endswith(("in_proj.weight", "out_proj.weight")):
                p.mul_(3)
    return model


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_every_level_decodes_the_portable_tokens(layer, precision, monkeypatch):
    model = tiny(layer)
    if precision in ("int8", "int4"):
        model.quantize(precision)
    elif precision == "bfloat16":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(4))
    prepare, taken = decode.MambaBlocksStep.prepare.__func__, []

    def spy(cls, *args, **kwargs):
        out = prepare(cls, *args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(decode.MambaBlocksStep, "prepare", classmethod(spy))
    tokens = {}
    for level in levels():
        monkeypatch.setenv("SSM_CPU_ISA", level)
        tokens[level] = model.generate(ids, 24, temperature=0)
    assert taken and all(taken), "generate did not take the fused step"
    for level, got in tokens.items():
        assert torch.equal(got, tokens["portable"]), f"{layer} {precision}: {level} gave other tokens"
