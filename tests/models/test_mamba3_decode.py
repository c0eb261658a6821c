"""MambaLM's decoding of Mamba-3 blocks (SISO and MIMO) through the fused C step
(ssm.ops.mamba_blocks_step with Mamba3BlockWeights): taken on the CPU in float32 and float64, and
giving what the per-op path (Mamba3.step, tensor code) and the forward (the chunked trapezoidal
scan) give: logits and every part of every layer's state (phase, ssm, key, value), over several
tokens at batch > 1, with groups, the output norm, a block MLP, both rotary fractions and MIMO
ranks, and no rotation at all (rope_fraction 0). Greedy generation gives the same tokens with it
and without it; a gradient to keep declines it."""

from __future__ import annotations

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.native import library
from tests.helpers import assert_generate_takes_the_fused_step_and_keeps_its_tokens

M3 = {"layer": "Mamba3", "d_state": 8, "headdim": 8, "chunk_size": 4}
CONFIGS = {
    "plain": dict(ssm_cfg=M3),
    "ngroups 2, block MLP": dict(ssm_cfg={**M3, "ngroups": 2}, d_intermediate=40),
    "output norm, untied head": dict(ssm_cfg={**M3, "is_outproj_norm": True}, tie_embeddings=False),
    "every pair rotated, d_state 12, A floor": dict(
        ssm_cfg={**M3, "d_state": 12, "rope_fraction": 1.0, "A_floor": 0.5}
    ),
    "no rotary state (rope_fraction 0)": dict(ssm_cfg={**M3, "rope_fraction": 0.0}),
    "MIMO rank 2, no rotary state": dict(ssm_cfg={**M3, "is_mimo": True, "mimo_rank": 2, "rope_fraction": 0.0}),
    "MIMO rank 2": dict(ssm_cfg={**M3, "is_mimo": True, "mimo_rank": 2}),
    "MIMO rank 3, output norm, ngroups 2, every pair rotated": dict(
        ssm_cfg={**M3, "is_mimo": True, "mimo_rank": 3, "is_outproj_norm": True, "ngroups": 2, "rope_fraction": 1.0}
    ),
}
# perturbed off their initial values, so that a parameter the step drops or swaps shows
PERTURBED = ("bias", ".D", "norm.weight", "norm2.weight", "norm_f.weight", "_norm.weight", "mimo_x", "mimo_z", "mimo_o")


def model_of(kind: str, dtype=torch.float32, ssm_cfg=None) -> MambaLM:
    if library() is None:
        pytest.fail("the cpu kernels did not build: the fused Mamba-3 step is untested")
    torch.manual_seed(0)
    config = dict(CONFIGS[kind]) if ssm_cfg is None else dict(ssm_cfg=ssm_cfg)
    model = MambaLM(MambaConfig(d_model=32, n_layer=3, vocab_size=45, **config)).to(dtype).eval()
    with torch.no_grad():  # biases, norm weights and D off their initial 0 / 1, so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith(PERTURBED):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(sum(map(ord, name)))) * 0.3)
    return model


def decode(model, ids, monkeypatch, fused: bool, prefill: int = 5):
    """A prefill of ``prefill`` tokens, then one step per token: the step logits, the cache, and
    whether each step took the fused C call."""
    import ssm.models.fused_step as fused_module

    fused_step, taken = fused_module.mamba_blocks_step, []

    def spy(*args, **kwargs):
        out = fused_step(*args, **kwargs)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(fused_module, "mamba_blocks_step", spy if fused else lambda *a, **k: None)
    cache = model.allocate_inference_cache(ids.shape[0])
    with torch.no_grad():
        model(ids[:, :prefill], cache=cache)
        logits = torch.stack([model.step(ids[:, t], cache) for t in range(prefill, ids.shape[1])], 1)
    monkeypatch.setattr(fused_module, "mamba_blocks_step", fused_step)
    return logits, cache, taken


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", CONFIGS)
def test_the_fused_mamba3_step_equals_the_per_op_step_and_the_forward(kind, dtype, monkeypatch):
    """Batch 3, a 5-token prefill, then 9 steps: fused (every step must take it) against the
    per-op Mamba3.step path (fused step switched off), logits and all four state tensors of
    every layer; and the fused logits against the forward over the whole sequence."""
    model = model_of(kind, dtype)
    ids = torch.randint(0, 45, (3, 14), generator=torch.Generator().manual_seed(1))
    fused_logits, fused_cache, taken = decode(model, ids, monkeypatch, True)
    assert len(taken) == 9 and all(taken), "the fused step was not taken"
    logits, cache, _ = decode(model, ids, monkeypatch, False)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fused_logits, logits, rtol=tol, atol=tol)
    for mine, theirs in zip(fused_cache.layers, cache.layers):
        for name, a, b in zip(("phase", "ssm", "key", "value"), mine.state, theirs.state):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, name=name: f"state.{name}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(fused_logits, model(ids)[:, 5:], rtol=5 * tol, atol=5 * tol)


def test_the_phase_stays_in_range_over_many_fused_steps(monkeypatch):
    """200 steps with large rotary angles: the fused step keeps the phase in [0, 2π), as the
    layer's own step does, and the two still agree at the end."""
    model = model_of("plain", torch.float64)
    with torch.no_grad():  # θ's rows of in_proj scaled up: Δ·π·tanh(θ) turns by whole radians a step
        for layer in model.backbone.layers:
            mixer = layer.mixer
            mixer.in_proj.weight[-mixer.num_rope_angles :] *= 20
            mixer.dt_bias.add_(3)
    ids = torch.randint(0, 45, (2, 201), generator=torch.Generator().manual_seed(4))
    fused_logits, fused_cache, taken = decode(model, ids, monkeypatch, True, prefill=1)
    assert all(taken)
    logits, cache, _ = decode(model, ids, monkeypatch, False, prefill=1)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-10, atol=1e-10)
    for layer in fused_cache.layers:
        phase = layer.state[0]
        assert phase.min() >= 0 and phase.max() < 2 * torch.pi and phase.max() > 3  # turned, and wrapped


def test_greedy_generation_gives_the_same_tokens_with_the_fused_step(monkeypatch):
    """generate (batch 2, left-padded prompts of different lengths) with the fused step prepared
    once, and with it refused: the same tokens."""
    model = model_of("ngroups 2, block MLP")
    assert_generate_takes_the_fused_step_and_keeps_its_tokens(model, monkeypatch)


def test_a_gradient_to_keep_takes_the_per_op_step(monkeypatch):
    """A step under autograd with parameters that want gradients declines the fused step (it
    keeps none); the per-op step's output equals the forward's."""
    import ssm.models.fused_step as fused_module

    ids = torch.randint(0, 45, (2, 8), generator=torch.Generator().manual_seed(3))
    model = model_of("MIMO rank 2")
    cache = model.allocate_inference_cache(2)
    model(ids[:, :5], cache=cache)
    calls, fused_step = [], fused_module.mamba_blocks_step
    monkeypatch.setattr(
        fused_module, "mamba_blocks_step", lambda *a, **k: calls.append(fused_step(*a, **k) is not None)
    )
    step = model.step(ids[:, 5], cache)
    assert calls == [False] and step.requires_grad
    torch.testing.assert_close(step, model(ids[:, :6])[:, -1], rtol=1e-4, atol=1e-4)


def test_mamba3_block_weights_of_the_wrong_shape_are_refused():
    from ssm.ops import MambaBlocksStep

    model = model_of("plain")
    cache = model.allocate_inference_cache(2)
    weights = model.backbone.layers[0].step_weights(cache.layers[0])
    import dataclasses

    bad = dataclasses.replace(weights, C_bias=weights.C_bias[..., :-1])
    with pytest.raises(ValueError, match=r"Mamba3BlockWeights.C_bias must have shape \(8, 1, 8\)"):
        MambaBlocksStep.prepare(torch.zeros(2, 32), [bad])
    bad = dataclasses.replace(weights, mimo_x=torch.ones(8, 2, 8))
    with pytest.raises(ValueError, match=r"Mamba3BlockWeights.mimo_x must have shape \(8, 1, 8\)"):
        MambaBlocksStep.prepare(torch.zeros(2, 32), [bad])
