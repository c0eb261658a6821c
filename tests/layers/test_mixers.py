"""Mamba and Mamba2 mixers: prefill + step equals one forward; every scan backend gives the
same outputs and parameter gradients; mamba-ssm's parameter names and shapes; bad input."""

from __future__ import annotations

import pytest
import torch

from ssm import Mamba, Mamba2
from ssm.scan import backends
from tests.helpers import assert_close, assert_compiled_matches_eager

MIXERS = {
    "mamba": lambda **kw: Mamba(24, d_state=6, **kw),
    "mamba2": lambda **kw: Mamba2(24, d_state=6, headdim=8, ngroups=2, chunk_size=5, **kw),
    "mamba2-mlp-branch": lambda **kw: Mamba2(
        24, d_state=6, headdim=8, d_ssm=32, rmsnorm=False, D_has_hdim=True, chunk_size=4, **kw
    ),
}
OP = {"mamba": "selective_scan", "mamba2": "ssd", "mamba2-mlp-branch": "ssd"}


def build(kind, **kw):
    torch.manual_seed(0)
    return MIXERS[kind](**kw).double()


@pytest.mark.parametrize("prefill", [0, 1, 6])
@pytest.mark.parametrize("kind", MIXERS)
def test_prefill_then_steps_equals_forward(kind, prefill):
    m = build(kind)
    x = torch.randn(3, 13, 24, dtype=torch.float64)
    full = m(x)
    cache = m.allocate_inference_cache(3, dtype=torch.float64)
    outs = [m(x[:, :prefill], cache=cache)]
    for t in range(prefill, 13):
        y = m.step(x[:, t] if t % 2 else x[:, t : t + 1], cache)  # (batch, d) and (batch, 1, d) inputs
        outs.append(y[:, None] if y.ndim == 2 else y)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", MIXERS)
def test_two_prefills_equal_one(kind):
    m = build(kind)
    x = torch.randn(2, 11, 24, dtype=torch.float64)
    cache = m.allocate_inference_cache(2, dtype=torch.float64)
    y = torch.cat([m(x[:, :4], cache=cache), m(x[:, 4:], cache=cache)], 1)
    torch.testing.assert_close(y, m(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", MIXERS)
def test_every_backend_same_outputs_and_gradients(kind):
    x = torch.randn(2, 19, 24)
    results = {}
    for backend in backends(OP[kind], "cpu"):
        torch.manual_seed(0)
        m = MIXERS[kind](backend=backend)
        y = m(x)
        grads = torch.autograd.grad((y * torch.linspace(-1, 1, 24)).sum(), list(m.parameters()))
        results[backend] = (y, dict(zip([n for n, _ in m.named_parameters()], grads)))
    assert len(results) >= 2
    y_ref, g_ref = results.pop("ref")
    for backend, (y, g) in results.items():
        assert_close(y, y_ref, torch.float32, f"{kind}/{backend} output")
        for name in g_ref:
            assert_close(g[name], g_ref[name], torch.float32, f"{kind}/{backend} d{name}")


def test_mamba_keeps_one_conv_output_for_the_backward(monkeypatch):
    """On the CPU the C conv writes its output twice, x (b, l, d) and u (b, d, l); x_proj reads
    u (seen as (b, l, d)), so x is not kept for the backward beside it. (The layer's numbers are
    checked against references and mamba-ssm elsewhere.)"""
    import ssm.layers.mamba as mamba_layer

    conv_outputs = []
    original = mamba_layer.causal_conv1d_silu

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        conv_outputs.append(out[0])
        return out

    monkeypatch.setattr(mamba_layer, "causal_conv1d_silu", spy)
    torch.manual_seed(0)
    m = Mamba(24, d_state=6)
    saved = set()

    def pack(t):
        saved.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(torch.randn(2, 19, 24))
    ((x_conv, u),) = conv_outputs
    assert x_conv.data_ptr() != u.data_ptr()  # the C conv ran: two tensors
    assert u.untyped_storage().data_ptr() in saved
    assert x_conv.untyped_storage().data_ptr() not in saved


@pytest.mark.parametrize("kind", MIXERS)
def test_compiles_without_graph_breaks(kind):
    """The whole mixer, layout changes included, traces as one graph (forward and backward)."""
    m = build(kind)
    x = torch.randn(2, 11, 24, dtype=torch.float64, requires_grad=True)
    weights = torch.linspace(-1, 1, 24, dtype=torch.float64)
    assert_compiled_matches_eager(lambda x: (m(x) * weights).sum(), [x])


def test_mamba_parameters_match_mamba_ssm():
    """Names and shapes of mamba-ssm's Mamba at mamba-130m's width (d_model 768)."""
    m = Mamba(768, device="meta")
    expected = {
        "A_log": (1536, 16),
        "D": (1536,),
        "in_proj.weight": (3072, 768),
        "conv1d.weight": (1536, 1, 4),
        "conv1d.bias": (1536,),
        "x_proj.weight": (80, 1536),
        "dt_proj.weight": (1536, 48),
        "dt_proj.bias": (1536,),
        "out_proj.weight": (768, 1536),
    }
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == expected


def test_mamba2_parameters_match_mamba_ssm():
    """Names and shapes of mamba-ssm's Mamba2 at mamba2-130m's width (d_model 768, N 128, P 64)."""
    m = Mamba2(768, device="meta")
    expected = {
        "dt_bias": (24,),
        "A_log": (24,),
        "D": (24,),
        "in_proj.weight": (3352, 768),
        "conv1d.weight": (1792, 1, 4),
        "conv1d.bias": (1792,),
        "norm.weight": (1536,),
        "out_proj.weight": (768, 1536),
    }
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == expected


def test_initialisation():
    torch.manual_seed(0)
    m = Mamba(64, d_state=8, dt_min=0.01, dt_max=0.05)
    assert torch.equal(m.A_log, torch.log(torch.arange(1, 9.0)).repeat(128, 1))
    assert torch.equal(m.D, torch.ones(128))
    dt = torch.nn.functional.softplus(m.dt_proj.bias)
    assert dt.min() >= 0.01 - 1e-6 and dt.max() <= 0.05 + 1e-6
    m2 = Mamba2(64, d_state=8, headdim=16, A_init_range=(2, 3))
    A = torch.exp(m2.A_log)
    assert A.min() >= 2 and A.max() <= 3
    for p in (m.A_log, m.D, m.dt_proj.bias, m2.A_log, m2.D, m2.dt_bias):
        assert getattr(p, "_no_weight_decay", False)
    assert not getattr(m.in_proj.weight, "_no_weight_decay", False)


@pytest.mark.parametrize("kind", MIXERS)
def test_bad_inputs(kind):
    m = build(kind)
    with pytest.raises(ValueError, match=r"hidden_states must have shape \(batch, L, d_model\) with d_model = 24"):
        m(torch.randn(2, 5, 23, dtype=torch.float64))
    cache = m.allocate_inference_cache(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="cache was allocated for batch size 2, but the input has batch size 3"):
        m(torch.randn(3, 5, 24, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="cache was allocated for batch size 2"):
        m.step(torch.randn(3, 24, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match=r"\(batch, d_model\) or \(batch, 1, d_model\)"):
        m.step(torch.randn(2, 2, 24, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="unknown backend"):
        MIXERS[kind](backend="fast")(torch.randn(1, 3, 24))
