"""The causal depthwise convolution: values by hand, gradients by finite differences."""

from __future__ import annotations

import pytest
import torch

from ssm.layers.conv import causal_conv1d


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

    assert torch.autograd.gradcheck(conv, inputs)


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
