"""The causal depthwise convolution: values by hand, gradients by finite differences."""

from __future__ import annotations

import pytest
import torch

from ssm.ops import causal_conv1d
from tests.helpers import GRADCHECK_TOL


def by_hand(x, weight, bias, state):
    """y[b, d, t] = bias[d] + Σ_k weight[d, 0, k] · v[b, d, t - (K - 1) + k], v the history
    (state's last K - 1 entries, or zeros) followed by x: a plain loop."""
    batch, D, L = x.shape
    K = weight.shape[-1]
    past = state[..., 1:] if state is not None else x.new_zeros(batch, D, K - 1)
    v = torch.cat([past, x], -1)
    y = x.new_zeros(batch, D, L)
    for t in range(L):
        for k in range(K):
            y[..., t] += weight[:, 0, k] * v[..., t + k]
    return y if bias is None else y + bias[:, None]


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_values_and_gradients(with_bias, with_state):
    g = torch.Generator().manual_seed(0)
    batch, D, L, K = 2, 3, 7, 4
    x = torch.randn(batch, D, L, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(D, 1, K, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    state = torch.randn(batch, D, K, generator=g, dtype=torch.float64, requires_grad=True) if with_state else None
    y, _ = causal_conv1d(x, weight, bias, state)
    torch.testing.assert_close(y, by_hand(x, weight, bias, state), rtol=1e-12, atol=1e-12)
    inputs = tuple(t for t in (x, weight, bias, state) if t is not None)

    def conv(*args):
        it = iter(args)
        return causal_conv1d(next(it), next(it), next(it) if with_bias else None, next(it) if with_state else None)[0]

    assert torch.autograd.gradcheck(conv, inputs, **GRADCHECK_TOL)


def test_the_new_state_is_the_last_inputs_in_a_tensor_of_its_own():
    """The state after a long prefill is the last K inputs, contiguous and in storage of its own
    size: a view would keep the whole (batch, D, K - 1 + L) history alive in the cache."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 500, generator=g)
    state = torch.randn(2, 3, 4, generator=g)
    _, new_state = causal_conv1d(x, torch.randn(3, 1, 4, generator=g), None, state)
    assert torch.equal(new_state, x[..., -4:])
    assert new_state.is_contiguous()
    assert new_state.untyped_storage().nbytes() == new_state.numel() * new_state.element_size()


def packed_by_hand(x, weight, bias, cu_seqlens):
    """by_hand on each packed sequence of x (1, D, L) alone: no tap crosses a boundary."""
    cuts = cu_seqlens.tolist()
    return torch.cat([by_hand(x[..., a:b], weight, bias, None) for a, b in zip(cuts, cuts[1:])], -1)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("case", ["plain", "packed", "no-bias", "K2", "strided-batch"], ids=lambda c: c)
def test_the_channels_last_c_convolution(case, silu):
    """causal_conv1d_cpu on x (B, L, D) as in_proj leaves it (a strided view of x and z side by
    side): values against the loop above (per packed sequence alone), and its gradients of x,
    weight and bias against finite differences (gradcheck, float64). L spans several of the
    backward's row blocks per thread, so their recomputed edges are covered."""
    from ssm.native import library
    from ssm.ops import cpu

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C convolution is untested")
    g = torch.Generator().manual_seed(1)
    K = 2 if case == "K2" else 4
    batch, L, D = (1, 23, 5) if case == "packed" else (3, 11, 5)
    xz = torch.randn(batch, L, 2 * D, generator=g, dtype=torch.float64)
    if case == "strided-batch":
        xz = torch.randn(batch * 2, L, 2 * D, generator=g, dtype=torch.float64)[::2]
    x = xz[..., :D].detach().requires_grad_()
    weight = torch.randn(D, 1, K, generator=g, dtype=torch.float64, requires_grad=True)
    bias = None if case == "no-bias" else torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 4, 4, 5, 16, 23]) if case == "packed" else None

    y = cpu.causal_conv1d_cpu(x, weight, bias, cu, silu=silu)
    assert y is not None and y.shape == (batch, L, D) and y.is_contiguous()
    xt = x.detach().transpose(1, 2)
    want = packed_by_hand(xt, weight.detach(), bias, cu) if cu is not None else by_hand(xt, weight.detach(), bias, None)
    if bias is not None:
        want = want.detach()
    if silu:
        want = torch.nn.functional.silu(want)
    torch.testing.assert_close(y, want.transpose(1, 2), rtol=1e-12, atol=1e-12)

    inputs = (x, weight) + ((bias,) if bias is not None else ())
    fn = lambda x, w, *b: cpu.causal_conv1d_cpu(x, w, b[0] if b else None, cu, silu=silu)  # noqa: E731
    assert torch.autograd.gradcheck(fn, inputs, **GRADCHECK_TOL)

    # both layouts from one pass: the same values, and the gradients of both added
    y2, yT = cpu.causal_conv1d_cpu(x, weight, bias, cu, silu=silu, transposed=True)
    assert torch.equal(y2, y) and torch.equal(yT, y.transpose(1, 2)) and yT.is_contiguous()
    both = lambda x, w, *b: cpu.causal_conv1d_cpu(x, w, b[0] if b else None, cu, silu=silu, transposed=True)  # noqa: E731
    assert torch.autograd.gradcheck(both, inputs, **GRADCHECK_TOL)
    only_t = lambda x, w, *b: both(x, w, *b)[1]  # noqa: E731  (the first output unused: no gradient for it)
    assert torch.autograd.gradcheck(only_t, inputs, **GRADCHECK_TOL)


@pytest.mark.parametrize("L", [1, 3, 4, 9])
@pytest.mark.parametrize("strided_state", [False, True])
def test_the_c_convolution_continues_from_a_state(L, strided_state):
    """A cached prefill (or a chunked evaluation) continues from a conv state: the C kernel
    reads it for the first K - 1 steps. Values and the new state against the loop above, for
    L shorter than, equal to and longer than K, with a state of any strides; under no_grad."""
    from ssm.native import library
    from ssm.ops import causal_conv1d_silu

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C convolution is untested")
    g = torch.Generator().manual_seed(2)
    batch, D, K = 3, 5, 4
    xz = torch.randn(batch, L, 2 * D, generator=g, dtype=torch.float64)
    x = xz[..., :D]  # as in_proj leaves it
    weight = torch.randn(D, 1, K, generator=g, dtype=torch.float64)
    bias = torch.randn(D, generator=g, dtype=torch.float64)
    state = torch.randn(batch, D, K, generator=g, dtype=torch.float64)
    if strided_state:
        state = torch.randn(batch, K, D, generator=g, dtype=torch.float64).transpose(1, 2)
    want = torch.nn.functional.silu(by_hand(x.transpose(1, 2), weight, bias, state))
    want_state = torch.cat([state, x.transpose(1, 2)], -1)[..., -K:]
    with torch.no_grad():
        (y, yT), new_state = causal_conv1d_silu(x, weight, bias, state, None, True, backend="cpu")
    torch.testing.assert_close(yT, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(y, yT.transpose(1, 2)) and y.is_contiguous() and yT.is_contiguous()
    assert torch.equal(new_state, want_state) and new_state.is_contiguous()
    # the tensor path gives the same
    with torch.no_grad():
        (_, yT_torch), state_torch = causal_conv1d_silu(x, weight, bias, state, None, True, backend="torch")
    torch.testing.assert_close(yT, yT_torch, rtol=1e-12, atol=1e-12)
    assert torch.equal(new_state, state_torch)


@pytest.mark.parametrize("L", [1, 2, 3, 4, 9, 40])
@pytest.mark.parametrize("silu", [False, True])
def test_the_c_convolution_takes_gradients_through_a_state(L, silu):
    """A context-parallel rank's halo (or any state with a gradient) on the C kernel: values
    against the loop above, and the gradients of x, weight, bias and the state against finite
    differences (gradcheck, float64), through either output and both; L shorter than, equal to
    and longer than K - 1, and long enough (40) that the backward splits its rows among
    threads."""
    from ssm.native import library
    from ssm.ops import causal_conv1d_silu, cpu

    if library() is None:
        pytest.fail("the cpu kernels did not build: the C convolution is untested")
    g = torch.Generator().manual_seed(3)
    batch, D, K = 2, 5, 4
    x = torch.randn(batch, L, 2 * D, generator=g, dtype=torch.float64)[..., :D].requires_grad_()
    weight = torch.randn(D, 1, K, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(D, generator=g, dtype=torch.float64, requires_grad=True)
    state = torch.randn(batch, K, D, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    y, yT = cpu.causal_conv1d_cpu(x, weight, bias, None, silu=silu, transposed=True, state=state)
    want = by_hand(x.detach().transpose(1, 2), weight.detach(), bias.detach(), state.detach())
    want = torch.nn.functional.silu(want) if silu else want
    torch.testing.assert_close(yT, want, rtol=1e-12, atol=1e-12)
    inputs = (x, weight, bias, state)
    both = lambda x, w, b, s: cpu.causal_conv1d_cpu(x, w, b, None, silu=silu, transposed=True, state=s)  # noqa: E731
    assert torch.autograd.gradcheck(both, inputs, **GRADCHECK_TOL)
    assert torch.autograd.gradcheck(lambda *a: both(*a)[0], inputs, **GRADCHECK_TOL)
    assert torch.autograd.gradcheck(lambda *a: both(*a)[1], inputs, **GRADCHECK_TOL)
    if silu:  # the layers' entry point takes it on "cpu", the new state's gradient included
        layer = lambda x, w, b, s: causal_conv1d_silu(x, w, b, s, None, True, backend="cpu")  # noqa: E731
        assert torch.autograd.gradcheck(lambda *a: (layer(*a)[0][1], layer(*a)[1]), inputs, **GRADCHECK_TOL)


def test_the_channels_last_c_convolution_declines_what_it_does_not_run():
    from ssm.ops import cpu

    x = torch.randn(2, 6, 4)
    w = torch.randn(4, 1, 4)
    assert cpu.causal_conv1d_cpu(x.transpose(1, 2), torch.randn(6, 1, 4)) is None  # channels not contiguous
    assert cpu.causal_conv1d_cpu(x.half(), w.half()) is None
    assert cpu.causal_conv1d_cpu(x, w.double()) is None


@pytest.mark.parametrize("kind", ["Mamba1", "Mamba2"])
def test_training_under_cpu_autocast_bfloat16(kind):
    """A model trained under torch.autocast("cpu", bfloat16) (Lightning's "bf16-mixed" on the
    CPU): the conv then runs in bfloat16 on a float32 weight, and its backward, which runs
    outside autocast, must still work. Gradients finite and near the float32 ones."""
    from ssm import MambaConfig, MambaLM

    cfg = {"layer": kind, "d_state": 16, **({"headdim": 16} if kind == "Mamba2" else {})}
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=64, n_layer=2, vocab_size=50, ssm_cfg=cfg))
    ids = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(0))

    def grads(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids).float().logsumexp(-1).mean()
        loss.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    low, full = grads(True), grads(False)
    assert torch.isfinite(low).all()
    assert (low - full).norm() < 0.05 * full.norm()
