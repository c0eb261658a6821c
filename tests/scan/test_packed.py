"""Packed variable-length sequences (cu_seqlens, and ssd's seq_idx) on every backend: the packed
run's outputs, per-sequence last states and every gradient equal those of each sequence run
alone, computed by the float64 reference without packing. The Triton kernels are checked the
same way in tests/scan/test_triton.py (at the interpreter's sizes).

The layouts (tests/helpers.py packed_lengths) put boundaries after step 1, inside a chunk and
exactly on chunk edges of the backend's own chunk length, with sequences of length 1 and 0.
"""

from __future__ import annotations

import pytest
import torch

from ssm.scan import cpu, linear_scan, selective_scan, ssd
from tests.helpers import (
    SELECTIVE_FORMS,
    check_against_reference,
    cu_seqlens_of,
    linear_inputs,
    linear_packed_call,
    linear_solo_call,
    packed_lengths,
    selective_inputs,
    selective_packed_call,
    selective_solo_call,
    ssd_inputs,
    ssd_packed_call,
    ssd_solo_call,
    with_sequence_states,
)

# The chunk length each backend sweeps in (pscan and ref have none: any layout will do).
SELECTIVE_CHUNKS = {"ref": 8, "pscan": 8, "cpu": cpu.CHUNK}


def packed_selective(T: int, *, initial_state: bool, dtype=torch.float32, **kw):
    lengths = packed_lengths(T)
    inputs = selective_inputs(sum(lengths), batch=1, initial_state=True, dtype=dtype, **kw)
    if initial_state:
        inputs = with_sequence_states(inputs, len(lengths))
    else:
        del inputs["initial_state"]
    return inputs, cu_seqlens_of(lengths)


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("form", SELECTIVE_FORMS)
@pytest.mark.parametrize("backend", list(SELECTIVE_CHUNKS))
def test_selective_scan_packed_equals_each_sequence_alone(backend, form, initial_state):
    inputs, cu = packed_selective(
        SELECTIVE_CHUNKS[backend],
        initial_state=initial_state,
        B_form=form,
        C_form="grouped" if form == "varying" else form,
    )
    (out, last), _ = check_against_reference(
        selective_packed_call(cu),
        inputs,
        backend,
        names=["out", "last_state"],
        reference_call=selective_solo_call(cu),
    )
    assert last.shape == (cu.numel() - 1, 6, 4) and last.dtype == torch.float32


@pytest.mark.parametrize("backend", ["pscan", "cpu"])
def test_selective_scan_packed_half_precision(backend):
    inputs, cu = packed_selective(SELECTIVE_CHUNKS[backend], initial_state=True, dtype=torch.bfloat16)
    check_against_reference(selective_packed_call(cu), inputs, backend, reference_call=selective_solo_call(cu))


def test_zero_length_sequences_pass_their_initial_state_through():
    """An empty sequence's last state is its initial state, gradient included; int32 accepted."""
    inputs, _ = packed_selective(8, initial_state=True)
    cu = cu_seqlens_of(packed_lengths(8), dtype=torch.int32)
    for backend in SELECTIVE_CHUNKS:
        _, last = selective_scan(**inputs, return_last_state=True, cu_seqlens=cu, backend=backend)
        for s in (1, 7):  # the empty ones
            torch.testing.assert_close(last[s], inputs["initial_state"][s].detach())
        (grad,) = torch.autograd.grad(last[1].sum(), inputs["initial_state"])
        torch.testing.assert_close(grad[1], torch.ones_like(grad[1]))
        assert grad[[0, 2, 3, 4, 5, 6, 7]].abs().max() == 0


def test_all_sequences_empty():
    inputs = selective_inputs(0, batch=1)
    inputs = with_sequence_states(inputs, 3)
    for backend in SELECTIVE_CHUNKS:
        out, last = selective_scan(
            **inputs, return_last_state=True, cu_seqlens=torch.zeros(4, dtype=torch.long), backend=backend
        )
        assert out.shape == (1, 6, 0)
        torch.testing.assert_close(last, inputs["initial_state"].detach())


def test_one_sequence_equals_no_packing():
    x = selective_inputs(37, batch=1)
    for backend in SELECTIVE_CHUNKS:
        packed = selective_scan(
            **x, delta_softplus=True, return_last_state=True, cu_seqlens=torch.tensor([0, 37]), backend=backend
        )
        plain = selective_scan(**x, delta_softplus=True, return_last_state=True, backend=backend)
        for p, q in zip(packed, plain):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- linear_scan

LINEAR_CHUNKS = {"ref": 8, "pscan": 8, "cpu": cpu.CHUNK}


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("layout", ["(1, L, 3, 2) dim 1", "(1, 1, L) dim -1"])
@pytest.mark.parametrize("backend", list(LINEAR_CHUNKS))
def test_linear_scan_packed_equals_each_sequence_alone(backend, layout, reverse, initial_state):
    lengths = packed_lengths(LINEAR_CHUNKS[backend])
    L = sum(lengths)
    shape, dim = ((1, L, 3, 2), 1) if layout.endswith("dim 1") else ((1, 1, L), 2)
    inputs = linear_inputs(shape, dim, initial_state=True)
    if initial_state:
        inputs = with_sequence_states(inputs, len(lengths))
        inputs["initial_state"] = (
            inputs["initial_state"].detach().reshape(len(lengths), *shape[dim + 1 :]).requires_grad_()
        )
    else:
        del inputs["initial_state"]
    cu = cu_seqlens_of(lengths)
    check_against_reference(
        linear_packed_call(cu, dim, reverse), inputs, backend, reference_call=linear_solo_call(cu, dim, reverse)
    )


# ----------------------------------------------------------------------------- ssd


@pytest.mark.parametrize("initial_state", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 8, 16])
@pytest.mark.parametrize("backend", ["ref", "chunked"])
def test_ssd_packed_equals_each_sequence_alone(backend, chunk_size, initial_state):
    lengths = packed_lengths(chunk_size)
    inputs = ssd_inputs(sum(lengths), batch=1, D="channels")
    if initial_state:
        inputs = with_sequence_states(inputs, len(lengths))
    else:
        del inputs["initial_state"]
    cu = cu_seqlens_of(lengths)
    (out, last), _ = check_against_reference(
        ssd_packed_call(cu, chunk_size),
        inputs,
        backend,
        names=["out", "last_state"],
        reference_call=ssd_solo_call(cu, chunk_size),
    )
    assert last.shape == (len(lengths), 4, 3, 5)


def test_ssd_packed_one_long_sequence_among_short_ones():
    """Many chunks inside one sequence, and sequences shorter than a chunk around it."""
    lengths = [2, 45, 1, 3]
    inputs = with_sequence_states(ssd_inputs(sum(lengths), batch=1), len(lengths))
    cu = cu_seqlens_of(lengths)
    check_against_reference(ssd_packed_call(cu, 8), inputs, "chunked", reference_call=ssd_solo_call(cu, 8))


def ssd_seq_idx_call(seq_idx):
    def call(inputs, backend):
        return ssd(**inputs, dt_softplus=True, return_last_state=True, chunk_size=4, seq_idx=seq_idx, backend=backend)

    return call


def ssd_rows_solo_call(seq_idx):
    """Each row's runs of equal seq_idx alone; the row's initial state starts its first run and
    the row's last run gives its last state (mamba-ssm's meaning of seq_idx)."""

    def call(inputs, backend):
        rows, lasts = [], []
        for b, row in enumerate(seq_idx.tolist()):
            starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]] + [len(row)]
            outs, state = [], None
            for i, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
                part = {k: v[b : b + 1, start:end] if k in ("x", "dt", "B", "C", "z") else v for k, v in inputs.items()}
                part["initial_state"] = inputs["initial_state"][b : b + 1] if i == 0 else None
                out, state = ssd(**part, dt_softplus=True, return_last_state=True, backend=backend)
                outs.append(out)
            rows.append(torch.cat(outs, dim=1))
            lasts.append(state)
        return torch.cat(rows), torch.cat(lasts)

    return call


@pytest.mark.parametrize("backend", ["ref", "chunked"])
def test_ssd_seq_idx_as_in_mamba_ssm(backend):
    seq_idx = torch.tensor(
        [[0, 0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 3, 3], [0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2]], dtype=torch.int32
    )
    inputs = ssd_inputs(13, batch=2)
    check_against_reference(ssd_seq_idx_call(seq_idx), inputs, backend, reference_call=ssd_rows_solo_call(seq_idx))


def test_ssd_seq_idx_all_zero_is_no_packing():
    x = ssd_inputs(19, batch=2)
    plain = ssd(**x, dt_softplus=True, return_last_state=True, chunk_size=4)
    packed = ssd(
        **x, dt_softplus=True, return_last_state=True, chunk_size=4, seq_idx=torch.zeros(2, 19, dtype=torch.int32)
    )
    for p, q in zip(packed, plain):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x = selective_inputs(10, batch=1)
    cu = torch.tensor([0, 4, 10])
    with pytest.raises(
        ValueError, match=r"initial_state must have shape \(num_seqs, dim, N\) = \(2, 6, 4\), got \(1, 6, 4\)"
    ):
        selective_scan(**x, cu_seqlens=cu, backend="ref")
    with pytest.raises(ValueError, match="cu_seqlens must end at the packed length L = 10, got 9"):
        selective_scan(**{**x, "initial_state": None}, cu_seqlens=torch.tensor([0, 9]), backend="ref")
    two = selective_inputs(10, batch=2, initial_state=False)
    with pytest.raises(ValueError, match="batch of 1, got batch = 2"):
        selective_scan(**two, cu_seqlens=cu, backend="pscan")
    with pytest.raises(ValueError, match=r"every dimension before it must have size 1; got inputs of shape \(2, 10\)"):
        linear_scan(torch.rand(2, 10), torch.rand(2, 10), dim=1, cu_seqlens=cu)
    with pytest.raises(
        ValueError, match=r"initial_state must have shape \(num_seqs, \*inputs.shape after dim 1\) = \(2, 3\)"
    ):
        linear_scan(torch.rand(1, 10, 3), torch.rand(1, 10, 3), dim=1, initial_state=torch.zeros(1, 3), cu_seqlens=cu)
    s = ssd_inputs(10, batch=1, initial_state=False)
    with pytest.raises(ValueError, match="not both"):
        ssd(**s, cu_seqlens=cu, seq_idx=torch.zeros(1, 10, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"seq_idx must have shape \(batch, L\) = \(1, 10\), got \(10,\)"):
        ssd(**s, seq_idx=torch.zeros(10, dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_idx must have dtype torch.int32 or torch.int64, got torch.float32"):
        ssd(**s, seq_idx=torch.zeros(1, 10))
    with pytest.raises(ValueError, match=r"initial_state must have shape \(num_seqs, H, P, N\)"):
        ssd(**s, cu_seqlens=cu, initial_state=torch.zeros(1, 4, 3, 5))
