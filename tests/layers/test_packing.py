"""Packed sequences through the mixers (cu_seqlens): the causal convolution never reads across a
boundary and the scan restarts there, so a packed forward gives each sequence's outputs, and
every parameter gradient, as if each sequence were run alone (by the "ref" backend, float64);
a packed prefill leaves each sequence's own state in a cache of batch S."""

from __future__ import annotations

import pytest
import torch

from ssm import Mamba, Mamba2
from ssm.ops import causal_conv1d
from ssm.scan import backends, cpu
from tests.helpers import REFERENCE_TOLERANCES, assert_relative, cu_seqlens_of, packed_lengths

MIXERS = {
    "mamba": lambda **kw: Mamba(24, d_state=6, **kw),
    "mamba2": lambda **kw: Mamba2(24, d_state=6, headdim=8, ngroups=2, chunk_size=5, **kw),
    "mamba2-mlp-branch": lambda **kw: Mamba2(
        24, d_state=6, headdim=8, d_ssm=32, rmsnorm=False, D_has_hdim=True, chunk_size=4, **kw
    ),
}
OP = {"mamba": "selective_scan", "mamba2": "ssd", "mamba2-mlp-branch": "ssd"}
# The chunk length each backend sweeps in, so that the layout puts boundaries on its edges.
CHUNK = {"cpu": cpu.CHUNK, "triton": 32, "pscan": 5, "ref": 5, "chunked": None}
CASES = [(kind, backend) for kind in MIXERS for backend in backends(OP[kind], "cpu")]


def build(kind, backend="auto"):
    torch.manual_seed(0)
    return MIXERS[kind](backend=backend).double()


def layout(kind, backend):
    T = CHUNK[backend] or build(kind).chunk_size
    return packed_lengths(T)


def solo(m, x, cu):
    """Each sequence run alone (no cu_seqlens), the outputs put together."""
    bounds = cu.tolist()
    return torch.cat([m(x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], dim=1)


@pytest.mark.parametrize("kind,backend", CASES)
def test_packed_forward_and_gradients_equal_each_sequence_alone(kind, backend):
    lengths = layout(kind, backend)
    cu = cu_seqlens_of(lengths)
    m, ref = build(kind, backend), build(kind, "ref")
    x = torch.randn(1, sum(lengths), 24, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(1, sum(lengths), 24, dtype=torch.float64)
    y = m(x, cu_seqlens=cu)
    y_ref = solo(ref, x, cu)
    fwd_tol, grad_tol = REFERENCE_TOLERANCES[torch.float64]
    assert_relative(y, y_ref, fwd_tol, f"{kind} {backend} packed output")
    grads = torch.autograd.grad(y, [x, *m.parameters()], upstream)
    ref_grads = torch.autograd.grad(y_ref, [x, *ref.parameters()], upstream)
    names = ["x"] + [n for n, _ in m.named_parameters()]
    for name, g, g_ref in zip(names, grads, ref_grads):
        assert_relative(g, g_ref, grad_tol, f"{kind} {backend} d{name}")


@pytest.mark.parametrize("kind", MIXERS)
def test_packed_prefill_then_steps(kind):
    """A cache of batch S: one packed prefill (each sequence continuing from its own state),
    then steps for all sequences, equal each sequence's own prefill and steps."""
    m = build(kind)
    lengths = [1, 0, 6, 2, 9]
    cu = cu_seqlens_of(lengths)
    S = len(lengths)
    history = torch.randn(S, 3, 24, dtype=torch.float64)  # a first prefill, 3 tokens each
    x = torch.randn(1, sum(lengths), 24, dtype=torch.float64)
    steps = torch.randn(S, 4, 24, dtype=torch.float64)

    cache = m.allocate_inference_cache(S, dtype=torch.float64)
    m(history, cache=cache)
    y = m(x, cache=cache, cu_seqlens=cu)
    stepped = torch.stack([m.step(steps[:, t], cache) for t in range(4)], 1)

    bounds = cu.tolist()
    for s, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        alone = m.allocate_inference_cache(1, dtype=torch.float64)
        m(history[s : s + 1], cache=alone)
        torch.testing.assert_close(y[:, a:b], m(x[:, a:b], cache=alone), rtol=1e-10, atol=1e-10)
        for t in range(4):
            torch.testing.assert_close(stepped[s, t], m.step(steps[s : s + 1, t], alone)[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(cache.ssm_state[s], alone.ssm_state[0], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(cache.conv_state[s], alone.conv_state[0], rtol=1e-10, atol=1e-10)


def test_packed_conv_equals_each_sequence_alone_with_and_without_history():
    """Against the unpacked convolution (F.conv1d) per sequence, sequences shorter than the
    kernel included; with a state per sequence, the new states too."""
    torch.manual_seed(0)
    D, K = 5, 4
    weight, bias = torch.randn(D, 1, K, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    lengths = [1, 0, 2, 3, 4, 7, 1]
    cu = cu_seqlens_of(lengths)
    x = torch.randn(1, D, sum(lengths), dtype=torch.float64)
    state = torch.randn(len(lengths), D, K, dtype=torch.float64)
    bounds = list(zip(cu.tolist()[:-1], cu.tolist()[1:]))

    y, none = causal_conv1d(x, weight, bias, None, cu)
    assert none is None
    expected = torch.cat([causal_conv1d(x[..., a:b], weight, bias)[0] for a, b in bounds], -1)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)

    y, new_state = causal_conv1d(x, weight, bias, state, cu)
    alone = [causal_conv1d(x[..., a:b], weight, bias, state[s : s + 1]) for s, (a, b) in enumerate(bounds)]
    torch.testing.assert_close(y, torch.cat([o for o, _ in alone], -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(new_state, torch.cat([st for _, st in alone]), rtol=1e-12, atol=1e-12)


def test_conv_reads_nothing_across_a_boundary():
    """Hand-checked: with weights 1 and no bias each output is the sum of the last K inputs of
    its own sequence."""
    x = torch.arange(1.0, 8.0)[None, None]  # 1..7
    y, _ = causal_conv1d(x, torch.ones(1, 1, 3), None, None, torch.tensor([0, 2, 7]))
    assert y.flatten().tolist() == [1, 3, 3, 7, 12, 15, 18]


@pytest.mark.parametrize("kind", MIXERS)
def test_bad_packing(kind):
    m = build(kind)
    with pytest.raises(ValueError, match="batch of 1, got batch = 2"):
        m(torch.randn(2, 5, 24, dtype=torch.float64), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="cu_seqlens must end at the packed length L = 5, got 4"):
        m(torch.randn(1, 5, 24, dtype=torch.float64), cu_seqlens=torch.tensor([0, 4]))
    cache = m.allocate_inference_cache(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache was allocated for batch size 1, but the input has batch size 2"):
        m(torch.randn(1, 5, 24, dtype=torch.float64), cache=cache, cu_seqlens=torch.tensor([0, 2, 5]))
