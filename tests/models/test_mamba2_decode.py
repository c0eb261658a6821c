"""MambaLM's decoding of Mamba-2 blocks through the fused C step (ssm.ops.mamba_blocks_step with
Mamba2BlockWeights): taken on the CPU in float32 and float64, and giving what the per-op path (Mamba2.step)
and the forward give, logits and both cache states of every layer, over several tokens at
batch > 1, ngroups > 1, with and without the block MLP; greedy generation gives the same tokens
with it and without it."""

from __future__ import annotations

import pytest
import torch

from ssm import MambaConfig, MambaLM
from ssm.native import library
from tests.helpers import assert_generate_takes_the_fused_step_and_keeps_its_tokens

M2 = {"layer": "Mamba2", "d_state": 8, "headdim": 8, "chunk_size": 4}
CONFIGS = {
    "ngroups 2, biases": dict(ssm_cfg={**M2, "ngroups": 2, "bias": True}),
    "ngroups 2, block MLP": dict(ssm_cfg={**M2, "ngroups": 2}, d_intermediate=40),
    "mixer MLP branch, D per channel, dt_limit, no conv bias": dict(
        ssm_cfg={**M2, "ngroups": 2, "d_ssm": 48, "D_has_hdim": True, "dt_limit": (0.02, 0.08), "conv_bias": False},
        d_intermediate=24,
    ),
    "ngroups 4, norm before gate": dict(ssm_cfg={**M2, "ngroups": 4, "norm_before_gate": True}),
    "no gate norm, untied head": dict(ssm_cfg={**M2, "rmsnorm": False}, tie_embeddings=False),
}


def model_of(kind: str, dtype=torch.float32) -> MambaLM:
    if library() is None:
        pytest.fail("the cpu kernels did not build: the fused Mamba-2 step is untested")
    torch.manual_seed(0)
    model = MambaLM(MambaConfig(d_model=32, n_layer=3, vocab_size=45, **CONFIGS[kind])).to(dtype).eval()
    with torch.no_grad():  # biases, norm weights and D off their initial 0 / 1, so that a dropped one shows
        for name, p in model.named_parameters():
            if name.endswith(("bias", ".D", "norm.weight", "norm2.weight", "norm_f.weight")):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", CONFIGS)
def test_the_fused_mamba2_step_equals_the_per_op_step_and_the_forward(kind, dtype, monkeypatch):
    """Batch 3, a 5-token prefill, then 7 steps: fused (every step must take it) against the
    per-op Mamba2.step path (fused step switched off), logits and every layer's states; and the
    fused logits against the forward over the whole sequence."""
    import ssm.models.fused_step as fused_module

    model = model_of(kind, dtype)
    ids = torch.randint(0, 45, (3, 12), generator=torch.Generator().manual_seed(1))
    fused_step, taken = fused_module.mamba_blocks_step, []

    def spy(*args, **kwargs):
        out = fused_step(*args, **kwargs)
        taken.append(out is not None)
        return out

    def decode(fused: bool):
        monkeypatch.setattr(fused_module, "mamba_blocks_step", spy if fused else lambda *a, **k: None)
        cache = model.allocate_inference_cache(3)
        with torch.no_grad():
            model(ids[:, :5], cache=cache)
            logits = torch.stack([model.step(ids[:, t], cache) for t in range(5, 12)], 1)
        return logits, cache

    fused_logits, fused_cache = decode(True)
    assert len(taken) == 7 and all(taken), "the fused step was not taken"
    logits, cache = decode(False)
    tol = 2e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(fused_logits, logits, rtol=tol, atol=tol)
    for mine, theirs in zip(fused_cache.layers, cache.layers):
        torch.testing.assert_close(mine.conv_state, theirs.conv_state, rtol=tol, atol=tol)
        torch.testing.assert_close(mine.ssm_state, theirs.ssm_state, rtol=tol, atol=tol)
    with torch.no_grad():
        torch.testing.assert_close(fused_logits, model(ids)[:, 5:], rtol=5 * tol, atol=5 * tol)


@pytest.mark.parametrize("kind", ["ngroups 2, block MLP", "ngroups 4, norm before gate"])
def test_greedy_generation_gives_the_same_tokens_with_the_fused_step(kind, monkeypatch):
    """generate (batch 2, left-padded prompts of different lengths) with the fused step prepared
    once, and with it refused: the same tokens."""
    model = model_of(kind)
    assert_generate_takes_the_fused_step_and_keeps_its_tokens(model, monkeypatch)


def test_the_fused_mamba2_step_is_declined_where_it_does_not_apply(monkeypatch):
    """A gradient to keep, LayerNorm blocks: the per-op path, still equal to the forward."""
    import ssm.models.fused_step as fused_module

    calls, fused_step = [], fused_module.mamba_blocks_step

    def spy(*args, **kwargs):
        out = fused_step(*args, **kwargs)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused_module, "mamba_blocks_step", spy)
    ids = torch.randint(0, 45, (2, 6), generator=torch.Generator().manual_seed(3))
    model = model_of("ngroups 2, biases")
    cache = model.allocate_inference_cache(2)
    model(ids[:, :5], cache=cache)
    step = model.step(ids[:, 5], cache)
    assert step.requires_grad
    torch.testing.assert_close(step, model(ids)[:, -1], rtol=1e-4, atol=1e-4)
    torch.manual_seed(0)
    layernorm = MambaLM(MambaConfig(d_model=32, n_layer=2, vocab_size=45, ssm_cfg=M2, rms_norm=False)).eval()
    with torch.no_grad():
        cache = layernorm.allocate_inference_cache(2)
        layernorm(ids[:, :5], cache=cache)
        layernorm.step(ids[:, 5], cache)
    assert calls == [False]  # the gradient: declined; LayerNorm: never asked
